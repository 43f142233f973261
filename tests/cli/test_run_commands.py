"""generate, parity and bench through the CLI: what they print and write, and every bad input."""

import json
import shutil

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from gpt2onnx.cli import app
from gpt2onnx.pytorch.checkpoint import load_checkpoint
from gpt2onnx.pytorch.reference import reference_model
from gpt2onnx.runtimes.providers import working_providers
from gpt2onnx.verify.lockstep import reference_greedy
from tests.cli.test_cli import assert_one_line_error

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


# -- generate ------------------------------------------------------------------------------------------------
def test_generate_ids_greedy_matches_transformers(tiny_export, tiny_folder):
    result = run("generate", tiny_export, "--ids", "5,6,7,8", "--max-new-tokens", 12)
    assert result.exit_code == 0, result.output
    printed = [int(t) for t in result.output.split()]
    expected = reference_greedy(
        reference_model(load_checkpoint(str(tiny_folder))), np.array([[5, 6, 7, 8]]), np.ones((1, 4), int), 12
    )
    assert printed == [5, 6, 7, 8, *expected[0]]


def test_generate_batch_of_id_prompts(tiny_export):
    result = run(
        "generate", tiny_export, "--ids", "5,6,7,8", "--ids", "9", "--max-new-tokens", 4, "--sample", "--seed", 3
    )
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["0", "1"] and all(len(line.split(",")) == 4 for line in lines)


def test_generate_text_streams_with_the_folder_tokenizer(tokenized_export):
    folder, source = tokenized_export
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    result = run("generate", folder, "--prompt", "the quick brown fox", "--max-new-tokens", 10)
    assert result.exit_code == 0, result.output
    ids = tokenizer.encode("the quick brown fox")
    expected = reference_greedy(
        reference_model(load_checkpoint(str(source))), np.array([ids]), np.ones((1, len(ids)), int), 10
    )
    eos = tokenizer.eos_token_id
    tokens = list(expected[0])
    tokens = tokens[: tokens.index(eos)] if eos in tokens else tokens
    assert result.output.strip() == ("the quick brown fox" + tokenizer.decode(tokens, skip_special_tokens=True)).strip()


def test_generate_bad_inputs(tiny_export, tmp_path, tokenized_export):
    folder, _ = tokenized_export
    assert_one_line_error(run("generate", tiny_export, "--prompt", "hello"), "has no tokenizer files")
    assert_one_line_error(run("generate", tiny_export, "--ids", "1,2,5000"), "token id 5000 is outside the vocabulary")
    assert_one_line_error(run("generate", folder, "--prompt", ""), "is empty")
    assert_one_line_error(run("generate", tiny_export, "--ids", ""), "token ids (--ids) are empty")
    assert_one_line_error(run("generate", tiny_export, "--ids", "a,b"), "not a comma-separated list of integers")
    assert_one_line_error(run("generate", tiny_export), "give the prompt as text (--prompt) or as token ids")
    assert_one_line_error(
        run("generate", tiny_export, "--ids", ",".join(["1"] * 100), "--max-new-tokens", 100),
        "beyond the model's context of 128",
    )
    assert_one_line_error(run("generate", tiny_export, "--ids", "1", "--provider", "npu"), "unknown provider 'npu'")
    assert_one_line_error(run("generate", tmp_path / "nothing", "--ids", "1"), "does not exist")
    assert_one_line_error(run("generate", tmp_path, "--ids", "1"), "holds no model.onnx")


@pytest.mark.parametrize("provider", ["cuda", "tensorrt"])
def test_provider_that_cannot_load(tiny_export, provider):
    if provider in working_providers():
        pytest.skip(f"{provider} loads here")
    assert_one_line_error(
        run("generate", tiny_export, "--ids", "1,2", "--provider", provider), f"provider '{provider}'"
    )
    assert_one_line_error(run("parity", tiny_export, "--cases", 1, "--provider", provider), "could not be used")
    assert_one_line_error(
        run("bench", tiny_export, "--provider", provider, "--prompt-len", 8, "--new-tokens", 4),
        "providers that work here: cpu",
    )


def test_model_that_breaks_the_io_contract(tiny_export, tmp_path):
    folder = shutil.copytree(tiny_export, tmp_path / "broken")
    model = onnx.load(str(folder / "model.onnx"))
    # drop the last layer's value output: the graph no longer returns present.1.value
    output = next(o for o in model.graph.output if o.name == "present.1.value")
    model.graph.output.remove(output)
    onnx.save(model, str(folder / "model.onnx"))
    assert_one_line_error(run("generate", folder, "--ids", "1,2"), "model.onnx' differs from what the manifest")
    assert_one_line_error(run("generate", folder, "--ids", "1,2", "--no-verify-files"), "no output 'present.1.value'")


def test_single_block_folder_is_refused(tiny_folder, tmp_path):
    from gpt2onnx.exporters.export import ExportOptions, export

    folder = export(str(tiny_folder), tmp_path / "block", options=ExportOptions(block=0)).folder
    assert_one_line_error(run("generate", folder, "--ids", "1"), "single-block export")


# -- parity --------------------------------------------------------------------------------------------------
def test_parity_passes_and_writes_json(tiny_export, tmp_path):
    result = run("parity", tiny_export, "--cases", 8, "--seed", 1, "--json", tmp_path / "p.json")
    assert result.exit_code == 0, result.output
    assert "pass" in result.output and "greedy tokens equal" in result.output
    report = json.loads((tmp_path / "p.json").read_text())
    totals = {**report["measured"], "passed": report["passed"]}
    assert totals["passed"] and totals["cases"] == 8 and totals["top1_agreement"] == 1.0
    assert totals["logits"]["max"] <= 1e-4 and totals["nonfinite"] == 0 and totals["tokens_equal_cases"] == 8
    assert totals["top5_agreement"] == 1.0 and totals["kl"]["max"] < 1e-8
    assert totals["tokens_before_divergence"]["min"] == min(c["case"]["generate_tokens"] for c in report["cases"])
    assert {"max", "p50", "p99"} == set(totals["present"])
    cases = report["cases"]
    assert len(cases) == 8 and {c["case"]["batch"] for c in cases} <= set(range(1, 9))
    assert any(c["case"]["prefix_length"] > 0 for c in cases) and any(c["case"]["prefix_length"] == 0 for c in cases)


def test_parity_fails_against_another_model(tiny_export, tmp_path):
    """The gate can fail: checked against a checkpoint with other weights, parity exits non-zero."""
    from conftest import make_config, write_hf_folder

    other = write_hf_folder(tmp_path / "other", make_config("h4-v1000"), seed=99)
    result = run("parity", tiny_export, "--cases", 2, "--reference", other, "--json", tmp_path / "p.json")
    assert result.exit_code == 1 and "FAIL" in result.output
    report = json.loads((tmp_path / "p.json").read_text())
    totals = {**report["measured"], "passed": report["passed"]}
    assert not totals["passed"] and totals["kl"]["mean"] > 0.1 and totals["tokens_before_divergence"]["min"] == 0


def test_parity_of_a_random_init_export_rebuilds_its_reference(tmp_path):
    assert run("export", "-m", "tiny", "--random-init", "--seed", 5, "-o", tmp_path / "r").exit_code == 0
    result = run("parity", tmp_path / "r", "--cases", 3)
    assert result.exit_code == 0, result.output


def test_parity_bad_inputs(tiny_export):
    assert_one_line_error(run("parity", tiny_export, "--cases", 0), "cases must be 1 to")


# -- bench ---------------------------------------------------------------------------------------------------
def test_bench_json(tiny_export, tmp_path):
    result = run(
        "bench",
        tiny_export,
        "--batch",
        "1,3",
        "--prompt-len",
        16,
        "--new-tokens",
        6,
        "--warmup",
        1,
        "--repeat",
        2,
        "--threads",
        1,
        "--baseline",
        "torch",
        "--json",
        tmp_path / "b.json",
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "b.json").read_text())
    (data,) = report["models"]
    assert data["provider"] == "cpu" and data["precision"] == "float32" and data["model_bytes"] > 0
    assert data["provider"] == "cpu" and data["session_providers"] == ["CPUExecutionProvider"]
    assert data["provider_options"]["threads"] == 1 and data["config"]["batches"] == [1, 3]
    assert {"cpu_count", "platform"} <= set(data["machine"]) and {"onnxruntime", "torch"} <= set(data["versions"])
    runs = {(r["engine"], r["batch"]): r for r in report["runs"]}
    assert set(runs) == {("onnxruntime", 1), ("onnxruntime", 3), ("torch", 1), ("torch", 3)}
    for run_ in report["runs"]:
        assert 0 < run_["prompt_ms"]["p50"] <= run_["prompt_ms"]["p99"]
        assert run_["decode_ms"]["p50"] <= run_["decode_ms"]["p90"] <= run_["decode_ms"]["p99"]
        assert [p for p, _ in run_["decode_ms_by_past"]] == list(range(16, 21))  # 5 decode steps after the prompt
        assert run_["tokens_per_s"] > 0 and run_["peak_host_bytes"] > 0
    assert set(runs[("torch", 3)]["extra"]["speedup_of_onnx"]) == {"prompt", "decode", "tokens_per_s"}
    assert "vs torch eager" in result.output


def test_bench_bad_inputs(tiny_export, tmp_path):
    assert_one_line_error(run("bench", tiny_export, "--batch", "0,1"), "batch sizes must be positive")
    assert_one_line_error(run("bench", tiny_export, "--batch", "x"), "not a comma-separated list of integers")
    assert_one_line_error(run("bench", tiny_export, "--prompt-len", 0), "prompt length must be a positive integer")
    assert_one_line_error(
        run("bench", tiny_export, "--prompt-len", 100, "--new-tokens", 64), "exceeds the model's context of 128"
    )
    assert_one_line_error(run("bench", tiny_export, "--baseline", "jax"), "the only baseline is 'torch'")
    assert_one_line_error(run("bench", tmp_path / "none"), "does not exist")


def test_bench_speculation_beside_plain_decoding(trained_export, tmp_path):
    """issue 39: --prompt-lookup and --draft add, per batch, a run with proposals right after the plain one: its
    acceptance, its tokens/s over plain decoding, the plain run's very tokens (greedy)."""
    common = ("--prompt-len", 16, "--new-tokens", 24, "--warmup", 0, "--repeat", 1, "--threads", 1)
    result = run(
        "bench", trained_export, "--batch", "1,2", *common, "--prompt-lookup", 10, "--json", tmp_path / "l.json"
    )
    assert result.exit_code == 0, result.output
    runs = json.loads((tmp_path / "l.json").read_text())["runs"]
    assert [(r["label"], r["batch"]) for r in runs] == [
        ("model", 1),
        ("model prompt-lookup 10", 1),
        ("model", 2),
        ("model prompt-lookup 10", 2),
    ]
    for plain, spec in (runs[:2], runs[2:]):
        extra = spec["extra"]
        assert extra["same_tokens"] and extra["proposer"]["prompt_lookup_num_tokens"] == 10
        assert extra["rows"] == ("single" if spec["batch"] == 1 else "one at a time")
        acceptance = extra["speculation"]
        assert acceptance["tokens"] == 24 * spec["batch"] and acceptance["tokens_per_target_step"] >= 1
        assert 0 <= acceptance["accepted"] <= acceptance["proposed"]
        assert extra["speedup_over_plain"] == pytest.approx(spec["tokens_per_s"] / plain["tokens_per_s"])
        assert spec["decode_ms"] == {} and plain["decode_ms"]["p50"] > 0 and "speculation" not in plain["extra"]
    assert "vs plain decoding" in result.output and "tokens per target step" in result.output
    # the model as its own draft: every proposal kept
    result = run("bench", trained_export, "--batch", 1, *common, "--draft", trained_export, "--draft-tokens", 4)
    assert result.exit_code == 0, result.output
    assert "draft: accepted 100.0% of 18 proposed, 4.00 tokens per target step" in " ".join(result.output.split())


def test_bench_speculation_is_refused_where_it_does_not_run(trained_export, tiny_export):
    lookup = ("--prompt-lookup", 3, "--batch", 1, "--prompt-len", 4, "--new-tokens", 4)
    for runtime in ("openvino", "onnxruntime,genai"):
        assert_one_line_error(
            run("bench", trained_export, *lookup, "--runtime", runtime), "runs no step of several proposals"
        )
    assert_one_line_error(
        run("bench", trained_export, "--batch", 1, "--draft", tiny_export), "a draft must share the model's tokenizer"
    )
    assert_one_line_error(run("bench", trained_export, "--max-ngram", 2), "--max-ngram applies to prompt lookup")
    assert_one_line_error(run("bench", trained_export, "--prompt-lookup", 0), "from 1 to 64")


def test_runs_beyond_available_memory_are_refused_before_they_start(tiny_export, monkeypatch):
    """batch × length within the token cap can still need more than the machine has (logits + key/value cache)."""
    import gpt2onnx.runtimes.decoder as decoder

    monkeypatch.setattr(decoder, "available_memory", lambda: 2_000_000)  # 2 MB: the tiny model's batch 8 needs ~4 MB
    args = ("--prompt-len", 100, "--new-tokens", 20, "--warmup", 0, "--repeat", 1)
    assert_one_line_error(run("bench", tiny_export, "--batch", 8, *args), "GB (logits and key/value cache)")
    assert_one_line_error(
        run("generate", tiny_export, *(["--ids", ",".join(["5"] * 100)] * 8), "--max-new-tokens", 20), "available"
    )
    monkeypatch.setattr(decoder, "available_memory", lambda: None)  # not Linux: no estimate, the run goes ahead
    assert run("generate", tiny_export, "--ids", "1,2", "--max-new-tokens", 1).exit_code == 0


def test_the_memory_estimate_is_above_what_a_real_run_grows_by(tiny_export, tmp_path):
    """The estimate that refuses runs (run_bytes) bounds what a real greedy run grows by: 2,000 rows, where the
    key/value cache dominates (measured here 0.82 of the estimate; the earlier estimate was 0.41 of the growth).
    Measured in a process of its own (gpt2onnx bench memory: peak resident size, reset after warm-up)."""
    out, table = tmp_path / "m.json", tmp_path / "m.md"
    args = ("--batch", "2000", "--prompt-len", 4, "--new-tokens", 100, "--json", out, "--md", table)
    result = run("bench", "memory", tiny_export, *args)
    assert result.exit_code == 0, result.output
    (figures,) = json.loads(out.read_text())["runs"]
    assert (figures["rows"], figures["prompt"], figures["new"]) == (2000, 4, 100)
    # the growth is real (past and present of the last step at least) and under the estimate
    assert 2 * figures["cache_bytes"] < figures["grown_bytes"] < figures["estimate_bytes"], figures
    assert f"| {tiny_export.name} | 2000 × 4 + 100 | {figures['grown_bytes'] / 1e6:,.1f} |" in table.read_text()
    assert_one_line_error(run("bench", "memory", tiny_export, "--batch", "0"), "positive")


def test_bench_generate_against_transformers(tiny_export, tmp_path):
    """bench generate: gpt2onnx's beam search and transformers' generate() with the same options on the folder's
    source weights, the same tokens, in rotating rounds with gpt2onnx's ratio to transformers round by round;
    written as JSON and Markdown."""
    out, table = tmp_path / "b.json", tmp_path / "b.md"
    args = ("--batch", 2, "--num-beams", 3, "--no-repeat-ngram-size", 2, "--prompt-len", 6, "--new-tokens", 5)
    result = run("bench", "generate", tiny_export, *args, "--warmup", 0, "--repeat", 3, "--json", out, "--md", table)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["same_tokens"] is True and (report["batch"], report["beams"], report["new_tokens"]) == (2, 3, 5)
    assert report["options"] == {"num_beams": 3, "no_repeat_ngram_size": 2} and report["runtime"] == "onnxruntime"
    rounds = report["rounds"]
    ours = "gpt2onnx (onnxruntime)"
    assert rounds["variants"] == [ours, "transformers"] and rounds["baseline"] == "transformers"
    assert rounds["orders"] == [[ours, "transformers"], ["transformers", ours], [ours, "transformers"]]
    seconds = next(s["values"] for s in rounds["series"] if s["variant"] == ours and s["figure"] == "seconds")
    steps = next(s["values"] for s in rounds["series"] if s["variant"] == ours and s["figure"] != "seconds")
    assert len(seconds) == 3 and all(abs(n * s - 2 * 3 * 5) < 1e-6 for n, s in zip(steps, seconds))
    assert "the same tokens as transformers: yes" in table.read_text()
    assert_one_line_error(run("bench", "generate", tiny_export, "--stop", "x"), "takes no --stop")
    same = run("bench", "generate", tiny_export, "--json", tmp_path / "x", "--md", tmp_path / "x")
    assert_one_line_error(same, "--json and --md both name")


def test_bench_plot(tiny_export, tmp_path):
    result = run(
        "bench",
        tiny_export,
        "--batch",
        1,
        "--prompt-len",
        8,
        "--new-tokens",
        6,
        "--repeat",
        1,
        "--plot",
        tmp_path / "p.png",
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plot_without_matplotlib(tiny_export, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert_one_line_error(run("bench", tiny_export, "--plot", tmp_path / "p.png"), "a plot needs matplotlib")
    assert not (tmp_path / "p.png").exists()


def test_parity_of_a_last_logits_export(tiny_folder, tmp_path):
    """Randomized cases compare the one position a --logits last graph returns."""
    assert run("export", "-m", tiny_folder, "-o", tmp_path / "last", "--logits", "last").exit_code == 0
    result = run("parity", tmp_path / "last", "--cases", 4, "--json", tmp_path / "p.json")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "p.json").read_text())
    totals = {**report["measured"], "passed": report["passed"]}
    assert totals["passed"] and totals["logits"]["max"] <= 1e-4


def test_bench_precisions_side_by_side(tmp_path):
    for name, extra in (("fp32", []), ("int4", ["--quantize", "int4"])):
        assert run("export", "-m", "tiny", "--random-init", "-o", tmp_path / name, *extra).exit_code == 0
    result = run(
        "bench",
        tmp_path / "fp32",
        tmp_path / "int4",
        "--batch",
        1,
        "--prompt-len",
        8,
        "--new-tokens",
        4,
        "--repeat",
        1,
        "--json",
        tmp_path / "b.json",
    )
    assert result.exit_code == 0, result.output
    models = json.loads((tmp_path / "b.json").read_text())["models"]
    assert [m["precision"] for m in models] == ["float32", "int4"]
    assert models[1]["model_bytes"] < models[0]["model_bytes"]
    assert "int4: int4" in result.output and "fp32: float32" in result.output
