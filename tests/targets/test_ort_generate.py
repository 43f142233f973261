"""The ort-generate deploy target: onnxruntime's GreedySearch / BeamSearch / Sampling op around our decoder, one
session.run per generation, proven token for token against GPT2LMHeadModel.generate() (fp32) and against the
Python onnxruntime loop on the same file (fp16), on a left-padded batch of four prompts; from Python and from
Node's onnxruntime-node (tests/js, installed by scripts/setup.sh; skips, failing under CI=1, where absent).

The tiny test model's end-of-sequence id is set to a token its beams produce mid-sequence, so that rows and
beams finish at different lengths and the stopping rules (min_new_tokens, early stopping) are exercised."""

import json
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gpt2onnx.artifact import search_ops
from gpt2onnx.cli import app
from gpt2onnx.errors import BadInput
from gpt2onnx.generation_options import Decoding, Sampling
from gpt2onnx.runtimes import ort_generate as og

ROOT = Path(__file__).resolve().parents[2]
JS = ROOT / "tests" / "js"
PROMPTS = [[5, 17, 42, 123, 7, 300], [9, 11, 400], [1, 2, 3, 4, 5, 6, 7, 8, 9], [77, 78]]
WIDTH = max(len(p) for p in PROMPTS)
NEW = 20
SCORE_TOLERANCE = 1e-4  # beam scores (sums of fp32 log-probabilities over 20 steps) against transformers'


def padded(pad_id: int, prompts=PROMPTS) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def cut(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.fixture(scope="module")
def torch_model(tiny_folder):
    import torch
    from transformers import GPT2LMHeadModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend with onnxruntime's (7x slower here)
    yield GPT2LMHeadModel.from_pretrained(tiny_folder).eval()
    torch.set_num_threads(threads)


def ort_generate(folder, prompts=PROMPTS, **settings):
    """The ort-generate runtime with transformers' generate() keywords, as the decode loop's Sampling and Decoding."""
    import transformers

    # transformers 4 counts the left padding in the repetition penalty, transformers 5 does not: the reference
    # is the installed one
    penalize_padding = int(transformers.__version__.split(".")[0]) < 5
    sampled = {k: settings.pop(k) for k in ("temperature", "top_k", "top_p", "seed") if k in settings}
    sampling = Sampling(sample=settings.pop("do_sample", False), **sampled)
    return og.generate(
        folder,
        prompts,
        max_new_tokens=NEW,
        sampling=sampling,
        decoding=Decoding(**settings),
        settings=og.OrtGenerateSettings(threads=1, penalize_padding=penalize_padding),
    )


def hf_generate(model, eos: int, prompts=PROMPTS, **settings):
    import torch

    ids, mask = padded(eos, prompts)
    width = ids.shape[1]
    with torch.no_grad():
        out = model.generate(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
            output_scores=True,
            return_dict_in_generate=True,
            **settings,
        )
    n = settings.get("num_return_sequences", 1)
    tokens = out.sequences[:, width:].reshape(len(prompts), n, -1).tolist()
    scores = out.sequences_scores.reshape(len(prompts), n).numpy() if settings.get("num_beams", 1) > 1 else None
    return [[cut(seq, eos) for seq in row] for row in tokens], scores


def with_eos(export: Path, out: Path, eos: int, **generation) -> Path:
    """A copy of the export whose generation_config.json names ``eos`` (and pad) and ``generation``."""
    folder = Path(shutil.copytree(export, out))
    path = folder / "generation_config.json"
    config = {**json.loads(path.read_text()), "eos_token_id": eos, "pad_token_id": eos, **generation}
    path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def eos(torch_model, tiny_export):
    """The token the reference's beams produce most often: as end-of-sequence, beams finish at different lengths."""
    vocab_eos = json.loads((tiny_export / "config.json").read_text())["eos_token_id"]
    tokens, _ = hf_generate(torch_model, vocab_eos, num_beams=4, num_return_sequences=4, length_penalty=0.0)
    eos = Counter(t for row in tokens for seq in row for t in seq[1:-1]).most_common(1)[0][0]
    for settings in (dict(num_beams=1), dict(num_beams=4, num_return_sequences=4, length_penalty=0.0)):
        lengths = [len(seq) for row in hf_generate(torch_model, eos, **settings)[0] for seq in row]
        assert min(lengths) < NEW and len(set(lengths)) > 1, lengths  # sequences stop, at different steps
    return eos


@pytest.fixture(scope="module")
def deployed(tiny_export, eos, tmp_path_factory):
    """The tiny export deployed to ort-generate through the CLI."""
    base = tmp_path_factory.mktemp("ort-generate")
    source = with_eos(tiny_export, base / "source", eos)
    result = CliRunner().invoke(app, ["deploy", str(source), "--target", "ort-generate", "--out", str(base / "dep")])
    assert result.exit_code == 0, result.output
    return base / "dep"


def test_deploy_writes_three_ops_sharing_one_data_file(deployed, eos):
    import onnx

    manifest = json.loads((deployed / "gpt2onnx.json").read_text())
    files = manifest["deploy"]["targets"]["ort-generate"]
    ops = search_ops
    assert sorted(files) == sorted(f"ort-generate/{n}" for n in (*ops.FILES.values(), ops.DATA_NAME))
    assert manifest["deploy"]["ort_generate"]["eos_token_id"] == eos
    for kind, name in ops.FILES.items():
        model = onnx.load(str(deployed / ops.SUBFOLDER / name), load_external_data=False)
        assert [n.op_type for n in model.graph.node] == [ops.SEARCHES[kind]]
        locations = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
        assert locations == {ops.DATA_NAME}
    # one copy of the weights, not three: the data file is about the size of the decoder's own model.onnx
    assert (deployed / ops.SUBFOLDER / ops.DATA_NAME).stat().st_size < 1.05 * (deployed / "model.onnx").stat().st_size


@pytest.mark.parametrize(
    "settings",
    [
        dict(num_beams=1),
        dict(num_beams=1, repetition_penalty=1.3, min_new_tokens=10),
        dict(num_beams=4, num_return_sequences=4, length_penalty=0.0),
        dict(num_beams=3, length_penalty=0.0, repetition_penalty=1.3, min_new_tokens=8),
    ],
    ids=["greedy", "greedy-penalty-min", "beam4x4", "beam3-penalty-min"],
)
def test_equal_to_transformers_generate(deployed, torch_model, eos, settings):
    expected, scores = hf_generate(torch_model, eos, **settings)
    got = ort_generate(deployed, **settings)
    assert got.tokens == expected
    assert got.inputs["attention_mask"].sum(1).tolist() == [len(p) for p in PROMPTS]  # left padding, masked
    if scores is not None:
        np.testing.assert_allclose(got.scores, scores, atol=SCORE_TOLERANCE, rtol=0)


def test_a_real_pad_id_inside_a_prompt(deployed, torch_model, eos):
    """GPT-2's pad id is its end-of-sequence id, which real text holds between documents. The ops number
    positions by input_ids != pad_token_id; the wrapper numbers them from the attention_mask, as transformers."""
    prompts = [[5, 17, eos, 123, 7, 300], [9, eos, 400], PROMPTS[2]]
    for settings in (dict(num_beams=1), dict(num_beams=3, length_penalty=0.0)):
        assert (
            ort_generate(deployed, prompts, **settings).tokens == hf_generate(torch_model, eos, prompts, **settings)[0]
        )


def test_deployed_attributes_equal_transformers(tiny_export, torch_model, eos, tmp_path):
    """early_stopping and no_repeat_ngram_size are attributes: set in generation_config.json, fixed at deploy."""
    from gpt2onnx.targets.deploy import deploy

    source = with_eos(tiny_export, tmp_path / "source", eos, early_stopping=True, no_repeat_ngram_size=2)
    deploy(source, "ort-generate", out=tmp_path / "dep")
    for settings in (dict(num_beams=4, num_return_sequences=2, length_penalty=0.0), dict(num_beams=1)):
        fixed = dict(no_repeat_ngram_size=2, **({"early_stopping": True} if settings["num_beams"] > 1 else {}))
        expected, scores = hf_generate(torch_model, eos, **settings, **fixed)
        got = ort_generate(tmp_path / "dep", **settings, **fixed)
        assert got.tokens == expected
        if scores is not None:
            np.testing.assert_allclose(got.scores, scores, atol=SCORE_TOLERANCE, rtol=0)
    with pytest.raises(BadInput, match="no_repeat_ngram_size=3 at run time.*deployed as 2"):
        ort_generate(tmp_path / "dep", no_repeat_ngram_size=3)


@pytest.mark.parametrize("variant", ["fp16", "ort-shared-kv"])
def test_equal_to_the_python_loop_on_the_same_file(tiny_folder, eos, tmp_path, variant):
    """fp16 (the K/V cache cast to the logits' fp32 in the wrapper) and a GroupQueryAttention graph: greedy
    tokens equal to gpt2onnx's own onnxruntime loop on the same model.onnx; beams equal to the fp32 file's."""
    from gpt2onnx.decoding.generate import decode
    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.runtimes.decoder import cpu_decoder
    from gpt2onnx.targets.deploy import deploy

    # validate=False: this test compares the file with itself run by two loops, not with PyTorch
    options = ExportOptions(dtype="fp16", validate=False) if variant == "fp16" else None
    options = options or ExportOptions(fusion="ort-shared-kv", logits="last", validate=False)
    exported = export(str(tiny_folder), tmp_path / "export", options=options).folder
    source = with_eos(exported, tmp_path / "source", eos)
    deploy(source, "ort-generate", out=tmp_path / "dep")
    ids, mask = padded(eos)
    loop = decode(cpu_decoder(source / "model.onnx"), ids, mask, max_new_tokens=NEW, eos_token_id=eos)
    got = ort_generate(tmp_path / "dep")
    assert [row[0] for row in got.tokens] == [cut(row.tolist(), eos) for row in loop.tokens]
    assert any(row[0][-1] == eos for row in got.tokens)


def test_sampling_seeded_and_filtered(deployed, tiny_export, eos, tmp_path):
    from gpt2onnx.targets.deploy import deploy

    first = ort_generate(deployed, do_sample=True, seed=3)
    assert first.tokens == ort_generate(deployed, do_sample=True, seed=3).tokens
    assert first.tokens != ort_generate(deployed, do_sample=True, seed=4).tokens
    # top_p that keeps one token is greedy decoding: the filter is applied, on the right distribution
    deploy(with_eos(tiny_export, tmp_path / "source", eos, top_p=1e-6), "ort-generate", out=tmp_path / "dep")
    greedy = ort_generate(deployed)
    assert ort_generate(tmp_path / "dep", do_sample=True, seed=3, top_p=1e-6).tokens == greedy.tokens


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(num_beams=4), "length_penalty=1.0 as transformers does: BeamSearch divides .* by its whole length"),
        (dict(do_sample=True, top_k=50), "top_k=50: no onnxruntime generation op has top-k"),
        (dict(num_beams=2, early_stopping="never", length_penalty=0.0), "early_stopping='never'"),
        (dict(temperature=0.7, do_sample=True), "temperature=0.7 at run time: the op takes it as an attribute"),
        # the decode loop's own rules, in its words (one message per rule)
        (dict(num_beams=4, top_k=5, length_penalty=0.0), "top_k only apply when sampling"),
        (dict(num_beams=2, do_sample=True, length_penalty=0.0), "beam sampling"),
        (
            dict(num_beams=2, num_return_sequences=3, length_penalty=0.0),
            r"num_return_sequences \(--num-return-sequences\) 3",
        ),
    ],
)
def test_refuses_what_the_op_cannot_express(deployed, settings, message):
    with pytest.raises(BadInput, match=message) as err:
        ort_generate(deployed, **settings)
    assert "\n" not in str(err.value)


def test_node_onnxruntime_runs_the_beam_file(deployed, tmp_path):
    node = shutil.which("node")
    if node is None or not (JS / "node_modules" / "onnxruntime-node").is_dir():
        if os.environ.get("CI"):
            pytest.fail("node or tests/js/node_modules is missing: run scripts/setup.sh")
        pytest.skip("node or onnxruntime-node (tests/js/node_modules) is not installed: run scripts/setup.sh")
    got = ort_generate(deployed, num_beams=4, num_return_sequences=2, length_penalty=0.0)
    inputs = {k: (v.tolist() if v.ndim == 2 else v.item()) for k, v in got.inputs.items()}
    (tmp_path / "in.json").write_text(json.dumps(inputs))
    run = subprocess.run(
        [node, str(JS / "ort_generate.mjs"), got.file, str(tmp_path / "in.json"), str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads((tmp_path / "out.json").read_text())
    sequences = np.array(out["sequences"]["data"]).reshape(out["sequences"]["dims"])
    np.testing.assert_array_equal(sequences, got.sequences)
    scores = np.array(out["sequences_scores"]["data"]).reshape(got.scores.shape)
    np.testing.assert_allclose(scores, got.scores, atol=1e-6, rtol=0)


@pytest.mark.parametrize("settings", [dict(), dict(num_beams=3, num_return_sequences=2, length_penalty=0.0)])
def test_the_registered_runtime_generates_as_the_decode_loop(deployed, settings):
    """gpt2onnx.generate with --runtime ort-generate (a loop runtime of the registry, the decode loop's Decoding)
    gives the tokens of onnxruntime's step-by-step loop on the same folder, greedy and beams."""
    import gpt2onnx

    ids = [",".join(map(str, p)) for p in PROMPTS]
    ours = gpt2onnx.generate(deployed, ids=ids, max_new_tokens=8, decoding=Decoding(**settings))
    runtime = gpt2onnx.RuntimeOptions("ort-generate", og.OrtGenerateSettings(threads=1))
    theirs = gpt2onnx.generate(deployed, ids=ids, max_new_tokens=8, decoding=Decoding(**settings), runtime=runtime)
    assert theirs.tokens == ours.tokens and theirs.settings.runtime == "ort-generate"
    if settings:
        np.testing.assert_allclose(theirs.scores, ours.scores, atol=SCORE_TOLERANCE, rtol=0)


def test_bench_generate_times_the_op_against_transformers(deployed, tmp_path):
    """bench generate --runtime ort-generate: one session.run of the search op against transformers' generate()
    with the same options (beams at length_penalty 0, where the op's beams are transformers'), the same tokens,
    in rotating rounds."""
    from typer.testing import CliRunner

    from gpt2onnx.cli import app

    args = ["--num-beams", "2", "--length-penalty", "0", "--batch", "2", "--prompt-len", "5", "--new-tokens", "4"]
    out = tmp_path / "g.json"
    result = CliRunner().invoke(
        app,
        ["bench", "generate", str(deployed), "--runtime", "ort-generate", *args, "--repeat", "2", "--json", str(out)],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["runtime"] == "ort-generate" and report["same_tokens"] is True
    assert report["options"] == {"num_beams": 2, "length_penalty": 0.0}
    assert report["rounds"]["variants"] == ["gpt2onnx (ort-generate)", "transformers"]
    refused = CliRunner().invoke(
        app, ["bench", "generate", str(deployed), "--runtime", "ort-generate", "--num-beams", "2"]
    )
    assert refused.exit_code == 2 and "length_penalty" in refused.output
