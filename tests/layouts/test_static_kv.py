"""The onnx profiles: the standard Attention (onnx) and its fixed-size K/V cache (onnx-static-kv: TensorScatter
writes each step's K/V in place into one buffer per layer, bound as past and present by StaticCacheDecoder),
against transformers on left-padded cases; generate and the batching engine on it (beams and bench at past lengths:
test_shared_kv.py, on both preallocated layouts); OpenVINO and the providers that refuse it, in one line."""

import json
import random

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.cli import app
from gpt2onnx.decoding.generate import decode
from gpt2onnx.errors import RuntimeUnavailable
from gpt2onnx.exporters.export import ExportOptions, export
from gpt2onnx.exporters.optimize import optimize
from gpt2onnx.layouts.static import LAYOUT as STATIC_LAYOUT
from gpt2onnx.pytorch.checkpoint import load_checkpoint
from gpt2onnx.pytorch.reference import reference_model
from gpt2onnx.runtimes.decoder import OnnxDecoder, StaticCacheDecoder, check_host_provider, open_decoder
from gpt2onnx.runtimes.providers import ProviderConfig, unsupported_nodes
from gpt2onnx.serving.engine import BatchingEngine
from gpt2onnx.verify.lockstep import left_padded_batch, reference_greedy
from gpt2onnx.verify.parity import parity
from tests.cli.test_cli import assert_one_line_error

runner = CliRunner()
NO_COPY = "in-place optimization not activated"  # onnxruntime's warning when TensorScatter copies its buffer


@pytest.fixture(scope="module")
def onnx_export(tiny_folder, tmp_path_factory):
    return export(
        str(tiny_folder), tmp_path_factory.mktemp("onnx") / "onnx", options=ExportOptions(fusion="onnx")
    ).folder


def test_graph_manifest_and_contract(static_export, onnx_export):
    model = onnx.load(str(static_export / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Attention") == 2 and ops.count("TensorScatter") == 4 and ops.count("Pad") == 1
    assert not any(n.domain for n in model.graph.node) and {i.domain: i.version for i in model.opset_import} == {"": 24}
    manifest = json.loads((static_export / "gpt2onnx.json").read_text())
    assert manifest["kv_cache"] == "static" and manifest["fusion"]["profile"] == "onnx-static-kv"
    assert manifest["fusion"]["golden"]["static_kv"] == {"expected": 4, "found": 4, "ops": ["TensorScatter"]}
    dims = {t["name"]: t["dims"] for t in manifest["io"]["inputs"] + manifest["io"]["outputs"]}
    assert dims["past_key_values.0.key"] == ["batch_size", 4, "past_buffer_length", 16]
    assert (
        dims["present.1.value"][2] == "present_buffer_length" and dims["attention_mask"][1] == "total_sequence_length"
    )
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kind}" for i in range(2) for kind in ("key", "value")
    ]  # the Hugging Face names, nothing added: the write column comes from the mask's width
    plain = json.loads((onnx_export / "gpt2onnx.json").read_text())
    assert plain["kv_cache"] == "concat" and plain["fusion"]["op_counts"] == {
        "Attention": 2,
        "Gelu": 2,
        "LayerNormalization": 5,
    }


@pytest.mark.parametrize("profile", ["onnx", "onnx-static-kv"])
def test_randomized_parity_with_chunks_at_batch_8(static_export, onnx_export, profile):
    """Prefix chunks at batch > 1 too: TensorScatter writes S rows at any batch, no token-by-token fallback."""
    report = parity(static_export if profile == "onnx-static-kv" else onnx_export, cases=10, seed=3, max_batch=8)
    assert report.passed, report.failures
    assert any(c["case"]["prefix_length"] and c["case"]["batch"] > 1 for c in report.cases)
    assert max(c["logits"]["max"] for c in report.cases) < 1e-4
    assert all(c["tokens_equal"] for c in report.cases)


def test_generate_greedy_equals_transformers_in_place(static_export, tiny_folder):
    """One buffer per layer for the whole run (prompt + new tokens), never moved."""
    decoder = open_decoder(open_folder(static_export), ProviderConfig())
    assert isinstance(decoder, StaticCacheDecoder)
    ids, mask = left_padded_batch(1000, batch=5, length=9, seed=4)
    addresses = []
    tokens = decode(
        decoder, ids, mask, max_new_tokens=12, on_step=lambda *_: addresses.append(decoder._buffers[0].ctypes.data)
    ).tokens
    assert decoder._buffers[0].shape == (5, 4, 9 + 12, 16) and len(set(addresses)) == 1 and len(addresses) >= 12
    expected = reference_greedy(reference_model(load_checkpoint(str(tiny_folder))), ids, mask, 12)
    np.testing.assert_array_equal(tokens, expected)


def test_the_kernel_writes_in_place_and_copies_when_it_cannot(static_export, capfd):
    """onnxruntime's TensorScatter logs a warning (severity 2; our sessions log errors only) each time it copies its
    past into a new present: none through StaticCacheDecoder's bound buffers, one per node with separate ones."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 2
    session = ort.InferenceSession(str(static_export / "model.onnx"), options, providers=["CPUExecutionProvider"])
    decoder = StaticCacheDecoder(session, n_positions=128)
    ids, mask = left_padded_batch(1000, batch=3, length=6, seed=2)
    capfd.readouterr()
    decode(decoder, ids, mask, max_new_tokens=5)
    assert NO_COPY not in capfd.readouterr().err
    binding = session.io_binding()  # the same step with a past and a present of their own: the kernel copies
    binding.bind_cpu_input("input_ids", ids)
    binding.bind_cpu_input("attention_mask", mask)
    binding.bind_cpu_input("position_ids", np.where(mask == 0, 1, np.cumsum(mask, -1) - 1))
    for name in decoder.past_names:
        binding.bind_cpu_input(name, np.zeros((3, 4, 8, 16), np.float32))
    for name in ["logits", *decoder.present_names]:
        binding.bind_output(name, "cpu")
    session.run_with_iobinding(binding)
    assert capfd.readouterr().err.count(NO_COPY) == 4


def test_a_step_reads_the_whole_buffer_whatever_the_past(static_export, tiny_export):
    """Decode steps at past 3 and 40 in one 64-column buffer give the concat graph's logits: the mask padded to the
    buffer's length keeps the unwritten columns (here filled with noise) out."""
    static = open_decoder(open_folder(static_export), ProviderConfig())
    classic = open_decoder(open_folder(tiny_export), ProviderConfig())
    assert type(classic) is OnnxDecoder
    rng = np.random.default_rng(0)
    for past in (3, 40):
        ids, mask = left_padded_batch(1000, batch=3, length=past + 1, seed=past)
        positions = np.where(mask == 0, 1, np.cumsum(mask, -1) - 1)
        views = static.past_of_length(3, 0, capacity=64)
        for buffer in static._buffers:
            buffer[...] = rng.normal(size=buffer.shape)  # what an earlier sequence could have left
        _, views = static.run(ids[:, :past], mask[:, :past], positions[:, :past], views)
        ours, _ = static.run(ids[:, past:], mask, positions[:, past:], views, last_logits_only=False)
        _, cache = classic.step(ids[:, :past], mask[:, :past], positions[:, :past], classic.empty_past(3))
        theirs, _ = classic.step(ids[:, past:], mask, positions[:, past:], cache)
        assert np.abs(ours - theirs)[mask[:, past:].astype(bool)].max() < 1e-4


def test_the_batching_engine_runs_the_static_cache(static_export, tiny_export):
    """Rows that join and leave: the engine's past is copied into the buffers on a join or leave, and each request
    gets the tokens the concat graph gives it alone."""
    rng = random.Random(1)
    prompts = [[rng.randrange(999) for _ in range(rng.randrange(1, 15))] for _ in range(8)]
    lengths = [rng.randrange(2, 14) for _ in prompts]
    concat = open_decoder(open_folder(tiny_export), ProviderConfig())
    with BatchingEngine.open(static_export, max_batch=4) as engine:
        assert isinstance(engine.stepper, StaticCacheDecoder)
        streams = [engine.submit(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
        for prompt, n, stream in zip(prompts, lengths, streams):
            alone = decode(concat, np.asarray([prompt]), max_new_tokens=n).tokens[0].tolist()
            assert stream.result(timeout=60).tokens == alone[: len(stream.result().tokens)]


def test_refusals_in_one_line(static_export, tmp_path):
    for provider in ("cuda", "tensorrt"):
        with pytest.raises(RuntimeUnavailable, match="TensorScatter.*cpu provider only"):
            check_host_provider(STATIC_LAYOUT, provider)
    result = runner.invoke(app, ["generate", str(static_export), "--ids", "1,2", "--provider", "cuda"])
    assert result.exit_code == 3  # refused by what the layout declares, before any session (a provider: exit 3)
    assert_one_line_error(result, "runs on the host only")
    result = runner.invoke(app, ["optimize", str(static_export), "--out", str(tmp_path / "x"), "--fusion", "ort"])
    assert result.exit_code == 2
    assert_one_line_error(result, "is fused with the onnx-static-kv profile")


def test_onnx_then_static_and_optimize_from_the_plain_export(onnx_export, tiny_export, tmp_path):
    """optimize makes onnx-static-kv from an onnx folder (the Attention nodes rewritten) and from an unfused one."""
    for source in (onnx_export, tiny_export):
        result = optimize(source, tmp_path / source.name, fusion="onnx-static-kv")
        assert result.check.passed and result.manifest.cache_layout == "static"
        assert result.manifest.fusion.golden["static_kv"].found == 4


def test_tensorrt_preflight_names_the_attention_op(onnx_export):
    graph = onnx.load(str(onnx_export / "model.onnx"), load_external_data=False)
    found = unsupported_nodes(graph, "tensorrt")
    assert found["Attention"][0] == 2 and "TensorRT" in found["Attention"][1]
    assert "Attention" not in unsupported_nodes(graph, "cuda")


@pytest.mark.parametrize("profile", ["onnx", "onnx-static-kv"])
def test_openvino_runs_onnx_and_refuses_the_static_cache_in_one_line(static_export, onnx_export, profile):
    pytest.importorskip("openvino", reason="openvino is not installed (bash scripts/setup.sh installs it)")
    folder = static_export if profile == "onnx-static-kv" else onnx_export
    result = runner.invoke(app, ["parity", str(folder), "--runtime", "openvino", "--cases", "3"])
    if profile == "onnx":
        assert result.exit_code == 0, result.output
        assert "parity on openvino/CPU" in result.output
    else:
        assert result.exit_code == 3  # refused by what OpenVINO declares, before it reads the file (exit 3)
        assert_one_line_error(result, "has no conversion rule (its ONNX frontend, 2026.4) for TensorScatter")


def test_genai_config_shares_the_static_buffer(static_export, onnx_export):
    """genai binds one buffer of the context as past and present where the flag is set, and passes the mask of the
    tokens so far: the static graph's write column (tests/runtimes/test_runtimes.py runs it, where genai is
    installed)."""
    from gpt2onnx.artifact.genai_config import genai_config

    assert genai_config(static_export)["search"]["past_present_share_buffer"] is True
    assert genai_config(onnx_export)["search"]["past_present_share_buffer"] is False


def test_deploy_refuses_the_targets_that_feed_a_growing_past(static_export, tmp_path):
    for target in ("transformers-js", "web", "ort-generate"):
        result = runner.invoke(app, ["deploy", str(static_export), "--target", target, "-o", str(tmp_path / target)])
        assert result.exit_code == 2, result.output
        assert_one_line_error(result, "fixed-size K/V buffer per layer (TensorScatter)")
        assert not (tmp_path / target).exists()


def test_the_browsers_wasm_kernels_run_the_onnx_profile(onnx_export):
    """onnxruntime-web's wasm build (the browser's kernels, tests/js/wasm_greedy.mjs in Node) has the standard
    Attention: the onnx profile's graph (what the web target copies for fp32) writes the greedy tokens gpt2onnx's
    own loop writes on onnxruntime."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    from gpt2onnx.decoding.generate import generate

    script = Path(__file__).parents[1] / "js" / "wasm_greedy.mjs"
    node = shutil.which("node")
    if node is None or not (script.parent / "node_modules" / "onnxruntime-web").is_dir():
        message = "Node.js or tests/js/node_modules is missing: run scripts/setup.sh"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    prompt = "1,2,3,4,5,6"
    expected = generate(onnx_export, ids=[prompt], max_new_tokens=8).tokens[0]
    run = subprocess.run(
        [node, str(script), str(onnx_export / "model.onnx"), prompt, "8"],
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1])["ids"] == expected
