"""A config whose special tokens lie outside its vocabulary (GPT-2's default eos/bos 50256 with a small vocabulary,
which transformers accepts: the token never comes): export records them in the manifest and says so once, and
every command accepts the folder it wrote; the targets that cannot represent an eos that never comes (genai,
ort-generate) refuse in one line naming it."""

import json
import logging

import pytest
import torch
from conftest import write_hf_folder, write_tokenizer
from typer.testing import CliRunner

from gpt2onnx.cli.app import app
from gpt2onnx.exporters.export import export

VOCAB = 1000
OUTSIDE = 50256  # GPT2Config's default eos_token_id and bos_token_id
runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import GPT2Config

    folder = tmp_path_factory.mktemp("outside") / "checkpoint"
    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=128, initializer_range=0.3)
    assert config.eos_token_id == config.bos_token_id == OUTSIDE
    write_hf_folder(folder, config)
    write_tokenizer(folder, VOCAB)
    return folder


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    return export(str(checkpoint), tmp_path_factory.mktemp("outside-export") / "model")


def test_export_records_the_ids_and_says_so_once(checkpoint, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="gpt2onnx"):
        result = export(str(checkpoint), tmp_path / "m")
    said = [r.getMessage() for r in caplog.records if "outside the vocabulary" in r.getMessage()]
    assert len(said) == 1 and f"eos_token_id {OUTSIDE}" in said[0] and f"of {VOCAB} tokens" in said[0], said
    expected = {"eos_token_id": [OUTSIDE], "bos_token_id": [OUTSIDE]}
    assert result.manifest.outside_vocabulary == expected
    assert json.loads((tmp_path / "m" / "gpt2onnx.json").read_text())["outside_vocabulary"] == expected
    assert json.loads((tmp_path / "m" / "generation_config.json").read_text())["eos_token_id"] == OUTSIDE  # as written


def test_generate_runs_to_the_end_as_transformers_does(exported, checkpoint):
    """The eos never comes: generate runs all new tokens, the same greedy tokens as transformers' generate()."""
    from transformers import GPT2LMHeadModel

    result = runner.invoke(app, ["generate", str(exported.folder), "--ids", "5,17,42", "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    ours = [int(t) for t in result.output.split()]
    model = GPT2LMHeadModel.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([[5, 17, 42]]), max_new_tokens=8, do_sample=False)[0].tolist()
    assert ours == theirs and len(ours) == 11


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "{m}", "--prompt", "the quick brown fox", "--max-new-tokens", "4"],
        ["parity", "{m}", "--cases", "2"],
        ["bench", "{m}", "--prompt-len", "8", "--new-tokens", "4"],
        ["eval", "{m}", "--text", "{text}", "--context", "16"],
        ["inspect", "{m}"],
        ["optimize", "{m}", "-o", "{tmp}/int8", "--quantize", "int8", "--no-validate"],
        ["deploy", "{m}", "-t", "transformers-js,triton,web", "-o", "{tmp}/deployed"],
    ],
    ids=lambda a: a[0],
)
def test_every_command_accepts_the_folder(exported, tmp_path, args):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. hello world, this is gpt2onnx speaking. " * 8)
    argv = [a.format(m=exported.folder, text=text, tmp=tmp_path) for a in args]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    if args[0] == "optimize":  # the record goes along, and the new folder runs too
        assert json.loads((tmp_path / "int8" / "gpt2onnx.json").read_text())["outside_vocabulary"]
        assert runner.invoke(app, ["generate", str(tmp_path / "int8"), "--ids", "1,2"]).exit_code == 0


@pytest.mark.parametrize("target", ["genai", "ort-generate"])
def test_targets_that_need_an_eos_in_the_vocabulary_refuse_in_one_line(exported, tmp_path, target):
    result = runner.invoke(app, ["deploy", str(exported.folder), "-t", target, "-o", str(tmp_path / "d")])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and line.startswith("error: eos_token_id 50256 is outside the model's vocabulary")
    assert "export again" in line and not (tmp_path / "d").exists()


def test_an_id_the_export_did_not_record_is_still_refused(exported, tmp_path):
    """Only what the export wrote and recorded is accepted: a hand-edited id outside the vocabulary is an error."""
    import shutil

    folder = tmp_path / "edited"
    shutil.copytree(exported.folder, folder)
    manifest = json.loads((folder / "gpt2onnx.json").read_text())
    del manifest["outside_vocabulary"]
    (folder / "gpt2onnx.json").write_text(json.dumps(manifest))
    result = runner.invoke(app, ["generate", str(folder), "--ids", "1,2"])
    assert result.exit_code == 2 and "is not a token id: an integer from 0 to 999" in result.output, result.output
