"""The ort-shared-kv profile: GroupQueryAttention with one preallocated K/V buffer per layer, bound as past and
present (SharedCacheDecoder), against transformers on randomized left-padded cases; precisions on top of it;
bench at past lengths; the providers it refuses."""

import json

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.benchmarks import timing
from gpt2onnx.cli import app
from gpt2onnx.decoding.generate import decode
from gpt2onnx.errors import RuntimeUnavailable
from gpt2onnx.exporters.optimize import optimize
from gpt2onnx.generation_options import Decoding
from gpt2onnx.layouts.shared import LAYOUT as SHARED_LAYOUT
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.pytorch.checkpoint import load_checkpoint
from gpt2onnx.pytorch.reference import reference_model
from gpt2onnx.runtimes.decoder import OnnxDecoder, SharedCacheDecoder, check_host_provider, open_decoder
from gpt2onnx.runtimes.providers import ProviderConfig
from gpt2onnx.verify.lockstep import left_padded_batch, reference_greedy
from gpt2onnx.verify.parity import parity
from tests.cli.test_cli import assert_one_line_error

runner = CliRunner()


def test_graph_manifest_and_contract(shared_export):
    model = onnx.load(str(shared_export / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("GroupQueryAttention") == 2 and "MultiHeadAttention" not in ops
    manifest = json.loads((shared_export / "gpt2onnx.json").read_text())
    assert manifest["kv_cache"] == "shared" and manifest["fusion"]["profile"] == "ort-shared-kv"
    assert manifest["fusion"]["golden"]["shared_kv"] == {
        "expected": 2,
        "found": 2,
        "ops": ["com.microsoft::GroupQueryAttention"],
    }
    dims = {t["name"]: t["dims"] for t in manifest["io"]["inputs"] + manifest["io"]["outputs"]}
    assert (
        dims["past_key_values.0.key"][2] == "past_buffer_length"
        and dims["present.1.value"][2] == "present_buffer_length"
    )
    assert dims["attention_mask"][1] == "total_sequence_length"


def test_ort_export_records_a_concat_cache(tiny_export):
    assert json.loads((tiny_export / "gpt2onnx.json").read_text())["kv_cache"] == "concat"


def test_randomized_parity_with_chunks_at_batch_8(shared_export):
    """Prefix chunks at batch > 1 (which the kernel refuses in one call) run token by token: same parity."""
    report = parity(shared_export, cases=10, seed=3, max_batch=8)
    assert report.passed, report.failures
    chunked = [c for c in report.cases if c["case"]["prefix_length"] and c["case"]["batch"] > 1]
    assert chunked, "the cases must include a continued prompt at batch > 1"
    assert max(c["logits"]["max"] for c in report.cases) < 1e-4
    assert all(c["tokens_equal"] for c in report.cases)


def test_generate_greedy_equals_transformers_and_never_reallocates(shared_export, tiny_folder):
    decoder = open_decoder(open_folder(shared_export), ProviderConfig())
    assert isinstance(decoder, SharedCacheDecoder)
    ids, mask = left_padded_batch(1000, batch=5, length=9, seed=4)
    calls = []
    original = decoder.empty_past

    def spy(batch, capacity=None):
        calls.append((batch, capacity))
        return original(batch, capacity)

    decoder.empty_past = spy
    addresses = []
    tokens = decode(
        decoder, ids, mask, max_new_tokens=12, on_step=lambda *_: addresses.append(decoder._buffers[0].ctypes.data)
    ).tokens
    assert calls == [(5, 9 + 12)]  # once, for prompt + new tokens (not the context)
    assert decoder._buffers[0].shape == (5, 4, 21, 16) and len(set(addresses)) == 1
    expected = reference_greedy(reference_model(load_checkpoint(str(tiny_folder))), ids, mask, 12)
    np.testing.assert_array_equal(tokens, expected)


def test_chunk_on_a_past_at_batch_3_matches_the_concat_graph(shared_export, tiny_export):
    """A continued prompt at batch 3 (token by token inside) gives the logits of the classic graph in one call."""
    shared = open_decoder(open_folder(shared_export), ProviderConfig())
    classic = open_decoder(open_folder(tiny_export), ProviderConfig())
    assert type(classic) is OnnxDecoder
    ids, mask = left_padded_batch(1000, batch=3, length=10, seed=1)
    positions = np.where(mask == 0, 1, np.cumsum(mask, -1) - 1)
    shared.empty_past(3, capacity=10)
    shared.run(ids[:, :6], mask[:, :6], positions[:, :6])
    ours, presents = shared.step(ids[:, 6:], mask, positions[:, 6:])
    _, past = classic.step(ids[:, :6], mask[:, :6], positions[:, :6], classic.empty_past(3))
    theirs, their_presents = classic.step(ids[:, 6:], mask, positions[:, 6:], past)
    assert ours.shape == theirs.shape == (3, 4, 1000)
    real = mask[:, 6:].astype(bool)
    assert np.abs(ours - theirs)[real].max() < 1e-4  # fp32, the project's logits tolerance
    keys = np.broadcast_to(mask.astype(bool)[:, None, :, None], presents[0].shape)
    assert max(np.abs(a - b)[keys].max() for a, b in zip(presents, their_presents)) < 1e-4


@pytest.mark.parametrize(
    "dtype, quantize", [("fp16", "none"), ("fp32", "int8"), ("fp32", "int4")], ids=["fp16", "int8", "int4"]
)
def test_precisions_on_the_shared_cache(gpt2_init_export, tmp_path, dtype, quantize):
    result = optimize(
        gpt2_init_export, tmp_path / "out", fusion="ort-shared-kv", dtype=dtype, quantization=QuantizeOptions(quantize)
    )
    assert result.manifest.cache_layout == "shared" and result.check.passed
    report = parity(tmp_path / "out", cases=4, seed=1, max_batch=4)
    assert report.passed, report.failures


def test_refuses_gpu_providers_with_the_reason(shared_export):
    for provider in ("cuda", "tensorrt"):
        with pytest.raises(RuntimeUnavailable, match="GroupQueryAttention.*cpu provider only"):
            check_host_provider(SHARED_LAYOUT, provider)
    result = runner.invoke(app, ["generate", str(shared_export), "--ids", "1,2", "--provider", "cuda"])
    assert result.exit_code == 3  # refused by what the layout declares, before any session (a provider: exit 3)
    assert_one_line_error(result, "cpu provider only")


def test_refuses_a_second_shared_rewrite(shared_export, tmp_path):
    result = runner.invoke(app, ["optimize", str(shared_export), "--out", str(tmp_path / "x"), "--fusion", "ort"])
    assert result.exit_code == 2
    assert_one_line_error(result, "is fused with the ort-shared-kv profile")


@pytest.mark.parametrize("layout", ["shared_export", "static_export"])  # the two preallocated layouts (conftest.py)
def test_bench_at_past_lengths(layout, tiny_export, tmp_path, request):
    """bench --past on a preallocated cache beside the growing one: a decode step timed at each past length; a past
    the buffer cannot hold is refused in one line."""
    folder = request.getfixturevalue(layout)
    result = runner.invoke(
        app,
        [
            "bench",
            str(tiny_export),
            str(folder),
            "--batch",
            "1,3",
            "--prompt-len",
            "4",
            "--new-tokens",
            "3",
            "--warmup",
            "0",
            "--repeat",
            "2",
            "--past",
            "8,120",
            "--json",
            str(tmp_path / "b.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    runs = json.loads((tmp_path / "b.json").read_text())["runs"]
    assert len(runs) == 4 and all([p for p, _ in r["decode_ms_at_past"]] == [8, 120] for r in runs)
    refused = runner.invoke(app, ["bench", str(folder), "--past", "128"])
    assert refused.exit_code == 2
    assert_one_line_error(refused, "at most 127")


def test_bench_capacity_is_the_buffer_of_a_preallocating_cache(shared_export, tiny_export, tmp_path):
    """--capacity: the shared cache's steps at each past run on a buffer of that many columns (the K/V cache the
    figures name), the concatenating one's on past + 1; the second folder's ratios to the first, round by round,
    at every past, in the JSON, the CSV and the Markdown; a capacity that cannot hold a step, or without --past,
    is refused in one line."""
    out = {k: tmp_path / f"b.{k}" for k in ("json", "csv", "md")}
    result = runner.invoke(
        app,
        [
            "bench",
            str(tiny_export),
            str(shared_export),
            "--batch",
            "2",
            "--prompt-len",
            "4",
            "--new-tokens",
            "3",
            "--warmup",
            "0",
            "--repeat",
            "3",
            "--past",
            "8,60",
            "--capacity",
            "100",
            *(a for k, path in out.items() for a in (f"--{k}", str(path))),
        ],
    )
    assert result.exit_code == 0, result.output
    concat, shared = json.loads(out["json"].read_text())["runs"]
    decoder = open_decoder(open_folder(shared_export), ProviderConfig())
    assert type(decoder) is SharedCacheDecoder and decoder.capabilities.preallocates
    assert concat["kv_cache_bytes_at_past"] == [[p, decoder.cache_bytes(2, p + 1)] for p in (8, 60)]
    assert shared["kv_cache_bytes_at_past"] == [[p, decoder.cache_bytes(2, 100)] for p in (8, 60)]
    ratios = shared["extra"]["rounds"]["ratio_to_baseline"]
    assert {"decode_ms_at_past_8", "decode_ms_at_past_60"} <= set(ratios)
    assert ratios["decode_ms_at_past_60"]["low"] <= ratios["decode_ms_at_past_60"]["median"]
    header = out["csv"].read_text().splitlines()[0].split(",")
    assert {"decode_ms_at_past_60", "kv_cache_mb_at_past_60", "decode_ms_at_past_60_ratio"} <= set(header)
    assert f"| {shared_export.name} | 2 | 60 |" in out["md"].read_text()

    timing.decode_step_at_past(decoder, 1, 8, vocab_size=decoder.vocab_size, capacity=100)
    assert decoder.capacity == 100  # the step ran on the buffer it was given
    for args, says in (
        (["--past", "60", "--capacity", "60"], "cannot hold past 60 and its new token: give at least 61"),
        (["--capacity", "100"], "give --past too"),
        (["--past", "60", "--capacity", "500"], "beyond the model's context of 128"),
    ):
        refused = runner.invoke(app, ["bench", str(shared_export), *args])
        assert refused.exit_code == 2, refused.output
        assert_one_line_error(refused, says)


@pytest.mark.parametrize("layout", ["shared_export", "static_export"])  # the two preallocated layouts (conftest.py)
def test_beam_search_reorders_the_preallocated_buffers_in_place(layout, tiny_export, request):
    """Beam search on a preallocated cache (rows picked inside the bound buffers) gives the concat graph's beams."""
    ids = np.array([[5, 17, 301, 44], [0, 0, 33, 402]])
    mask = (np.arange(4)[None] >= np.array([[0], [2]])).astype(np.int64)
    decoding = Decoding(num_beams=3, num_return_sequences=3, no_repeat_ngram_size=2)
    results = [
        decode(open_decoder(open_folder(f), ProviderConfig()), ids, mask, max_new_tokens=8, decoding=decoding)
        for f in (tiny_export, request.getfixturevalue(layout))
    ]
    np.testing.assert_array_equal(results[0].tokens, results[1].tokens)
    np.testing.assert_allclose(results[0].scores, results[1].scores, atol=1e-4)
