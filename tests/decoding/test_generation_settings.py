"""Generation settings (issue 30): one typed reader for generation_config.json and the decoding options, the same
words for the same rule from generate, deploy (genai, ort-generate) and the runtimes; beam search's memory
estimate counts what it allocates; text is read in bounded pieces whose tokens are the whole text's. Cheap: the
session's tiny export (tiny_export), tokenizers trained in-process, no model downloads."""

from __future__ import annotations

import json
import random
import shutil
import tracemalloc

import numpy as np
import pytest
from conftest import write_tokenizer

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.genai_config import genai_config
from gpt2onnx.artifact.generation import read_generation_config
from gpt2onnx.decoding.beam import beam_search_bytes
from gpt2onnx.decoding.generate import decode, generate
from gpt2onnx.errors import BadInput
from gpt2onnx.generation_options import Decoding, Sampling
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, open_runtime
from gpt2onnx.targets.ort_generate import fixed_settings
from gpt2onnx.verify import text as text_module


@pytest.fixture
def folder(tiny_export, tmp_path):
    return shutil.copytree(tiny_export, tmp_path / "m")


def _set(folder, **values):
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def _messages(folder) -> list[str]:
    """The refusal from each entry point that reads generation_config.json."""
    found = []
    for call in (
        lambda: genai_config(folder),  # deploy --target genai, and the genai runtime (its overlay config)
        lambda: fixed_settings(folder, 1000),  # deploy --target ort-generate
        lambda: generate(folder, ids=["1,2"], max_new_tokens=1),  # generate on onnxruntime
    ):
        with pytest.raises(BadInput) as err:
            call()
        found.append(str(err.value))
    return found


@pytest.mark.parametrize(
    "key, value, option, rule",
    [
        ("temperature", -1, {"sample": True}, "is not a finite number from 1e-06 to 1e+06"),
        ("top_p", 2, {"sample": True}, "is not a finite number above 0 and at most 1"),
        ("top_k", 2**40, {"sample": True}, "is not an integer from 0 to 2,147,483,647"),
    ],
)
def test_the_same_rule_in_the_same_words_everywhere(folder, key, value, option, rule):
    _set(folder, **{key: value, "do_sample": True})
    messages = _messages(folder) if key != "top_k" else [str(pytest.raises(BadInput, genai_config, folder).value)]
    with pytest.raises(BadInput) as err:
        Sampling(**option, **{key: value})  # generate --temperature / --top-p / --top-k
    for message in [*messages, str(err.value)]:
        assert rule in message and key in message and "\n" not in message, message


@pytest.mark.parametrize("value", [5000, -1, 10**30, 1.5, "999", True])
def test_token_ids_stay_in_the_vocabulary(folder, value):
    _set(folder, eos_token_id=value)
    for message in _messages(folder):
        assert "eos_token_id" in message and "is not a token id: an integer from 0 to 999" in message, message


def test_generation_config_reads_nan_and_huge_numbers_as_refusals(folder):
    path = folder / "generation_config.json"
    for raw, shown in (("NaN", "NaN"), ("Infinity", "Infinity"), (str(2**64), str(2**64)), ("1e30", r"1e\+30")):
        path.write_text('{"eos_token_id": 999, "no_repeat_ngram_size": ' + raw + "}")
        with pytest.raises(BadInput, match=f"no_repeat_ngram_size {shown} in '.*' is not an integer from 0 to"):
            read_generation_config(folder, vocab_size=1000)


def test_beam_search_estimate_counts_its_own_arrays(tiny_export):
    """Beam search's arrays (vocabulary-wide per beam, sequences per length) are in the estimate: numpy's peak
    while it runs (tracemalloc) stays under it, and is most of it (the estimate is not a blanket)."""
    runner = open_runtime(open_folder(tiny_export), RuntimeOptions())
    decoding = Decoding(num_beams=3000)
    estimate = beam_search_bytes(1, decoding, 5, 3, runner.vocab_size, (999,))
    tracemalloc.start()
    try:
        decode(runner, np.array([[1, 2]]), max_new_tokens=3, decoding=decoding, eos_token_id=999)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert estimate / 4 < peak < estimate, (peak, estimate)
    assert beam_search_bytes(1, Decoding(), 5, 3, 1000) == 0


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("bpe"))


def test_text_pieces_give_the_whole_texts_tokens(tokenizer, monkeypatch):
    """Cut into small pieces (the sizes scaled down 4000×), any text gives the whole text's tokens: words and
    spaces, runs of one letter or of spaces with no place to cut, CJK punctuation, contractions, added tokens."""
    monkeypatch.setattr(text_module, "PIECE_CHARS", 64)
    monkeypatch.setattr(text_module, "CUT_SEARCH", 32)
    monkeypatch.setattr(text_module, "CUT_CONTEXT", 24)
    monkeypatch.setattr(text_module, "MAX_PIECE", 128)
    rng = random.Random(0)
    alphabet = list("abc xyz  \n\t'.,!?0123456789") + ["é", "中", "。", "’", "<|endoftext|>", "\r\n", "'s", "\u00a0"]
    texts = ["a" * 1000, " " * 700, "word " * 300, "don't " * 100, "a" * 500 + " b" + "c" * 500]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.choice([50, 400]))) for _ in range(300)]
    for text in texts:
        chunks, i = [], 0
        while i < len(text):
            step = rng.randint(1, 90)
            chunks.append(text[i : i + step])
            i += step
        pieces = list(text_module.text_pieces(tokenizer, iter(chunks)))
        assert "".join(p for p, _ in pieces) == text
        assert [t for _, ids in pieces for t in ids] == tokenizer.encode(text, add_special_tokens=False), text[:80]
        assert max(len(p) for p, _ in pieces) <= 128 + 90, [len(p) for p, _ in pieces]  # a piece and a chunk


def test_float_settings_are_checked_in_float32_the_type_the_runtimes_store():
    """issue 37: top_p 1e-46 passes (0, 1] as a double but is 0.0 in float32 (sampling.onnx's attribute, the
    processors' scores): refused. The bounds themselves stay valid (1e-6 is below 1e-6 once rounded, as its
    bound is)."""
    from gpt2onnx.generation_options import check_option

    with pytest.raises(BadInput, match="top_p 1e-46 .* is 0 as a float32"):
        check_option("top_p", 1e-46)
    assert check_option("temperature", 1e-6) == 1e-6
    assert check_option("top_p", 1.0) == 1.0 and check_option("temperature", 1e6) == 1e6
