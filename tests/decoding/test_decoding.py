"""Decoding options as transformers' generate() has them: greedy and beam search token for token equal to
GPT2LMHeadModel.generate on a left-padded batch of three prompts of different lengths, with end-of-sequence
reached (the folder's eos is a token the model produces often); penalties, n-grams, minimum new tokens, stop
strings; the sampling warpers compared as filtered distributions; the K/V reorder on the device side.

The model: the trained test checkpoint (conftest's trained_checkpoint: 2 layers trained on docstrings, its own
512-token BPE), whose next-token distributions are spread as a trained model's are, so beams and penalties
change the tokens; the tiny random checkpoints serve the checks that need no reference."""

import contextlib
import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from typer.testing import CliRunner

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.generation import read_generation_config
from gpt2onnx.cli import app
from gpt2onnx.decoding import processors
from gpt2onnx.decoding.generate import decode, generate
from gpt2onnx.decoding.processors import warp
from gpt2onnx.errors import BadInput
from gpt2onnx.generation_options import Decoding, Sampling
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, open_runtime
from gpt2onnx.runtimes.decoder import open_decoder
from gpt2onnx.runtimes.providers import ProviderConfig

# three prompts of different lengths, left-padded with the pad id (= eos) as a transformers user pads them
PROMPTS = [[5, 17, 301, 44, 9, 470, 12], [33, 402, 7], [410, 2, 75, 19]]  # ids of both test vocabularies
NEW = 12
PAD = 0


def _token_ids(folder):
    """(eos ids, pad id) as generate reads them (generation_config.json, then config.json)."""
    config = read_generation_config(folder, vocab_size=None)
    return config.eos_token_ids, config.pad_token_id


def padded(pad: int):
    width = max(map(len, PROMPTS))
    ids = np.array([[pad] * (width - len(p)) + p for p in PROMPTS], dtype=np.int64)
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS], dtype=np.int64)
    return ids, mask


@pytest.fixture(scope="module")
def reference(trained_checkpoint):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(str(trained_checkpoint)).eval()


@pytest.fixture(scope="module")
def eos_export(trained_export, reference, tmp_path_factory):
    """The tiny export with its eos (config.json and generation_config.json) moved to the token that greedy and
    beam search produce most often early on, so that rows and beams finish before max_new_tokens; its pad id is
    0 (a pad id of its own, as many folders have)."""
    ids, mask = padded(PAD)
    found = []
    for beams in (1, 4):
        with torch.no_grad(), one_torch_thread():
            out = reference.generate(
                torch.tensor(ids),
                attention_mask=torch.tensor(mask),
                num_beams=beams,
                num_return_sequences=beams,
                max_new_tokens=6,
                do_sample=False,
                pad_token_id=PAD,
                eos_token_id=reference.config.eos_token_id,
            )
        found.append(out[:, ids.shape[1] + 1 :].numpy())
    greedy, beams = found
    eos = max(set(greedy.flatten().tolist()), key=lambda t: ((beams == t).sum(), (greedy == t).sum(), -t))
    folder = tmp_path_factory.mktemp("eos") / "model"
    shutil.copytree(trained_export, folder)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((folder / name).read_text())
        data.update(eos_token_id=eos, bos_token_id=eos, pad_token_id=PAD)
        (folder / name).write_text(json.dumps(data))
    return folder


@contextlib.contextmanager
def one_torch_thread():
    """torch's small ops on 2 shared, busy cores: one thread is several times faster than two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def transformers_generate(reference, ids, mask, eos, **settings):
    with torch.no_grad(), one_torch_thread():
        out = reference.generate(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=eos,
            return_dict_in_generate=True,
            output_scores=True,
            **settings,
        )
    return out


SETTINGS = [
    {},
    {"repetition_penalty": 1.4, "min_new_tokens": 5},
    {"no_repeat_ngram_size": 2, "min_new_tokens": 5},
    {"num_beams": 4, "num_return_sequences": 4},
    {"num_beams": 3, "num_return_sequences": 2, "early_stopping": True, "length_penalty": 0.5},
    {"num_beams": 3, "early_stopping": "never", "length_penalty": -0.5, "repetition_penalty": 1.2},
    {"num_beams": 2, "no_repeat_ngram_size": 3, "min_new_tokens": 3, "length_penalty": 2.0},
]
# transformers 4 penalises the pad ids of the left padding too; 5 leaves them out, as we do: each row run alone
# (no padding) is what both versions agree on, so under 4.x a repetition penalty is checked row by row
PENALISES_PADDING = int(transformers.__version__.split(".")[0]) < 5


def reference_rows(reference, ids, mask, eos, settings, width):
    """transformers' new tokens per returned sequence, each row filled to ``width`` as decode() fills it, and
    its sequence scores (beam search) or per-step processed scores (greedy)."""
    if PENALISES_PADDING and settings.get("repetition_penalty", 1.0) != 1.0:
        fill = eos if settings.get("num_beams", 1) > 1 and not PAD else PAD  # transformers' `pad or eos`
        rows, scores = [], []
        for row in range(len(ids)):
            real = ids[row, mask[row] > 0][None]
            out = transformers_generate(reference, real, np.ones_like(real), eos, **settings)
            new = out.sequences[:, real.shape[1] :].numpy()
            rows += [r + [fill] * (width - len(r)) for r in new.tolist()]
            scores.append(out.sequences_scores.numpy() if settings.get("num_beams", 1) > 1 else None)
        return np.array(rows), (np.concatenate(scores) if scores[0] is not None else None), None
    out = transformers_generate(reference, ids, mask, eos, **settings)
    beam = settings.get("num_beams", 1) > 1
    new = out.sequences[:, ids.shape[1] :].numpy()
    return new, (out.sequences_scores.numpy() if beam else None), (None if beam else out.scores)


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "greedy")
def test_equal_to_transformers_generate(eos_export, reference, settings):
    eos_ids, pad = _token_ids(eos_export)
    assert pad == PAD
    eos = eos_ids[0]
    ids, mask = padded(pad)
    decoder = open_decoder(open_folder(eos_export), ProviderConfig())
    ours = decode(
        decoder, ids, mask, max_new_tokens=NEW, decoding=Decoding(**settings), eos_token_id=eos_ids, pad_token_id=pad
    )
    want, sequence_scores, step_scores = reference_rows(reference, ids, mask, eos, settings, ours.tokens.shape[1])
    np.testing.assert_array_equal(ours.tokens, want)
    if sequence_scores is not None:
        np.testing.assert_allclose(ours.scores, sequence_scores, rtol=1e-4, atol=1e-4)
    if step_scores is not None:  # greedy: the sum of the chosen tokens' log-probs (processed distribution) to eos
        steps = torch.stack(step_scores, 1).log_softmax(-1)  # [batch, steps, vocab]
        chosen = steps.gather(-1, torch.tensor(want[:, : steps.shape[1], None])).squeeze(-1).numpy()
        alive = np.arange(want.shape[1])[None] < ours.lengths[:, None]
        np.testing.assert_allclose(ours.scores, np.where(alive, chosen, 0).sum(1), rtol=1e-4, atol=1e-4)
    if "repetition_penalty" not in settings and "no_repeat_ngram_size" not in settings:  # penalties avoid eos
        assert ours.finished.any(), "eos is reached by some row: the finishing logic is exercised"


def test_the_batch_finishes_beams_at_different_lengths(eos_export):
    """The equality above covers returned beams of several lengths (not all max_new_tokens)."""
    eos_ids, _ = _token_ids(eos_export)
    decoder = open_decoder(open_folder(eos_export), ProviderConfig())
    ids, mask = padded(PAD)
    decoding = Decoding(num_beams=4, num_return_sequences=4)
    result = decode(decoder, ids, mask, max_new_tokens=NEW, decoding=decoding, eos_token_id=eos_ids)
    assert len(set(result.lengths.tolist())) > 1 and result.finished.any()


def test_processors_equal_transformers_classes():
    from transformers.generation import logits_process as lp

    rng = np.random.default_rng(0)
    scores = (rng.standard_normal((4, 50)) * 3).astype(np.float32)
    sequences = rng.integers(0, 50, size=(4, 9))
    sequences[1, 5:] = sequences[1, 1:5]  # a repeated 4-gram, so n-grams are banned
    s, q = torch.tensor(scores), torch.tensor(sequences)
    pairs = [
        (processors.repetition_penalty(scores, sequences, 1.7), lp.RepetitionPenaltyLogitsProcessor(1.7)(q, s)),
        (processors.no_repeat_ngram(scores, sequences, 2), lp.NoRepeatNGramLogitsProcessor(2)(q, s)),
        (processors.no_repeat_ngram(scores, sequences, 4), lp.NoRepeatNGramLogitsProcessor(4)(q, s)),
        (processors.min_new_tokens(scores, 3, 5, (7, 9)), lp.MinNewTokensLengthLogitsProcessor(6, 5, [7, 9])(q, s)),
    ]
    for ours, theirs in pairs:
        np.testing.assert_array_equal(ours, theirs.numpy())
    assert np.isinf(pairs[2][0]).any(), "the repeated 4-gram bans a token"


@pytest.mark.parametrize(
    "sampling, keep",
    [
        (Sampling(sample=True, temperature=0.7, top_k=5), 1),
        (Sampling(sample=True, top_p=0.6), 1),
        (Sampling(sample=True, temperature=1.3, top_k=20, top_p=0.8), 1),
        (Sampling(sample=True, top_p=0.05), 3),
        (Sampling(sample=True, top_k=1), 2),
    ],
)
def test_warpers_filter_the_distribution_as_transformers(sampling, keep):
    """Not random draws: the filtered distributions themselves (the same tokens dropped, the same probabilities)."""
    from transformers.generation import logits_process as lp

    rng = np.random.default_rng(1)
    scores = (rng.standard_normal((3, 200)) * 4).astype(np.float32)
    theirs = torch.tensor(scores)
    if sampling.temperature != 1.0:
        theirs = lp.TemperatureLogitsWarper(sampling.temperature)(None, theirs)
    if sampling.top_k:
        theirs = lp.TopKLogitsWarper(sampling.top_k, min_tokens_to_keep=keep)(None, theirs)
    if sampling.top_p < 1.0:
        theirs = lp.TopPLogitsWarper(sampling.top_p, min_tokens_to_keep=keep)(None, theirs)
    ours = warp(scores, sampling, min_tokens_to_keep=keep)
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(theirs.numpy()))
    np.testing.assert_allclose(processors.softmax(ours), theirs.softmax(-1).numpy(), atol=1e-6)
    assert 0 < np.isfinite(ours).sum(1).min() < 200


def test_sampling_returns_seeded_sequences_per_prompt(tiny_export):
    decoder = open_decoder(open_folder(tiny_export), ProviderConfig())
    ids, mask = padded(0)
    options = dict(max_new_tokens=8, decoding=Decoding(num_return_sequences=3, repetition_penalty=1.3))
    a = decode(decoder, ids, mask, sampling=Sampling(sample=True, top_k=20, seed=3), **options)
    b = decode(decoder, ids, mask, sampling=Sampling(sample=True, top_k=20, seed=3), **options)
    assert a.tokens.shape == (9, 8) and a.num_return_sequences == 3
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert len({tuple(row) for row in a.tokens[:3].tolist()}) > 1, "three draws of one prompt differ"


def test_stop_strings_as_transformers(tokenized_export):
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

    folder, source = tokenized_export
    prompts = ["the quick brown", "hello", "this is"]
    free = generate(folder, prompts=prompts, max_new_tokens=10)
    # a printable ASCII character of a continuation, past its first token (a byte-level token can be half a
    # character, whose text the two transformers versions clean differently)
    candidates = [
        (-len(t), -i, r, t[i])
        for r, t in enumerate(free.texts)
        for i in range(1, len(t))
        if t[i].isascii() and t[i].isprintable() and not t[i].isspace()
    ]
    assert candidates, free.texts
    *_, longest, stop = min(candidates)
    ours = generate(folder, prompts=prompts, max_new_tokens=10, decoding=Decoding(stop=(stop,)))
    eos_ids, pad = _token_ids(folder)
    pad = eos_ids[0] if pad is None else pad
    ids, mask = _left_pad(ours.prompt_ids, pad)
    with torch.no_grad(), one_torch_thread():
        out = GPT2LMHeadModel.from_pretrained(str(source)).generate(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            max_new_tokens=10,
            do_sample=False,
            stop_strings=[stop],
            tokenizer=PreTrainedTokenizerFast.from_pretrained(str(folder)),
            pad_token_id=pad,
        )
    want = out[:, ids.shape[1] :].tolist()
    for row, tokens in enumerate(ours.tokens):
        assert tokens == want[row][: len(tokens)] and all(t == pad for t in want[row][len(tokens) :]), (want, stop)
    assert ours.finished[longest] and len(ours.tokens[longest]) < len(free.tokens[longest])


def _left_pad(rows, pad):
    width = max(map(len, rows))
    ids = np.array([[pad] * (width - len(r)) + r for r in rows], dtype=np.int64)
    return ids, (np.arange(width)[None] >= np.array([width - len(r) for r in rows])[:, None]).astype(np.int64)


def test_reorder_past_stays_an_ortvalue_and_picks_rows(tiny_export):
    import onnxruntime as ort

    decoder = open_decoder(open_folder(tiny_export), ProviderConfig())
    ids, mask = padded(0)
    _, past = decoder.run(ids, mask, np.cumsum(mask, 1) - 1, decoder.empty_past(3))
    rows = np.array([2, 0, 0, 1])
    picked = decoder.reorder_past(past, rows)
    assert all(isinstance(p, ort.OrtValue) for p in picked) and len(picked) == len(past)
    for before, after in zip(past, picked):
        np.testing.assert_array_equal(after.numpy(), before.numpy()[rows])


def _runtime_or_skip(folder, name):
    from gpt2onnx.runtimes import genai

    if name == "genai" and not (genai.in_process() or genai.genai_python()):
        pytest.skip("onnxruntime-genai is not installed (bash scripts/setup.sh creates .venv-genai)")
    if name == "openvino":
        pytest.importorskip("openvino", reason="openvino is not installed (bash scripts/setup.sh installs it)")
    return open_runtime(open_folder(folder), RuntimeOptions(name=name))


def test_openvino_beam_search_equals_transformers(eos_export, reference):
    runner = _runtime_or_skip(eos_export, "openvino")
    eos = _token_ids(eos_export)[0][0]
    ids, mask = padded(PAD)
    settings = {"num_beams": 3, "num_return_sequences": 3, "repetition_penalty": 1.2}
    decoding = Decoding(**settings)
    ours = decode(runner, ids, mask, max_new_tokens=NEW, decoding=decoding, eos_token_id=eos, pad_token_id=PAD)
    want, scores, _ = reference_rows(reference, ids, mask, eos, settings, ours.tokens.shape[1])
    np.testing.assert_array_equal(ours.tokens, want)
    np.testing.assert_allclose(ours.scores, scores, rtol=1e-4, atol=1e-4)


def test_genai_beam_search_equals_transformers_where_comparable(eos_export, reference):
    """genai's own beam loop normalises and stops finished beams differently: with length_penalty 0 (no
    normalisation) and early_stopping False every returned beam is transformers'; the other settings are
    measured in README (Decoding options). Greedy with a repetition penalty is transformers' too."""
    runner = _runtime_or_skip(eos_export, "genai")
    try:
        eos = _token_ids(eos_export)[0][0]
        ids, mask = padded(PAD)
        settings = {"num_beams": 3, "num_return_sequences": 3, "length_penalty": 0.0}
        ours = decode(runner, ids, mask, max_new_tokens=NEW, decoding=Decoding(**settings), eos_token_id=eos)
        theirs = transformers_generate(reference, ids, mask, eos, **settings).sequences[:, ids.shape[1] :].numpy()
        assert ours.finished.any()
        for row, length in enumerate(ours.lengths):
            assert ours.tokens[row, :length].tolist() == theirs[row, :length].tolist()
            assert (theirs[row, length:] == eos).all()
        settings = {"repetition_penalty": 1.3}
        ours = decode(runner, ids, mask, max_new_tokens=NEW, decoding=Decoding(**settings), eos_token_id=eos)
        want, _, _ = reference_rows(reference, ids, mask, eos, settings, ours.tokens.shape[1])
        for row, length in enumerate(ours.lengths):
            assert ours.tokens[row, :length].tolist() == want[row, :length].tolist()
        for refused, option in (
            (dict(no_repeat_ngram_size=2), "--no-repeat-ngram-size"),
            (dict(num_beams=2, repetition_penalty=1.2), "--repetition-penalty with beam search"),
        ):
            with pytest.raises(BadInput, match=f"runtime genai .*cannot do as transformers does: {option}"):
                decode(runner, ids, mask, max_new_tokens=4, decoding=Decoding(**refused))
    finally:
        runner.close()


def test_cli_beam_search_writes_json(eos_export, tmp_path):
    out = tmp_path / "gen.json"
    result = CliRunner().invoke(
        app,
        ["generate", str(eos_export), "--ids", "5,17,301", "--ids", "33,402", "--num-beams", "3"]
        + ["--num-return-sequences", "2", "--max-new-tokens", "6", "--json", str(out)],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [p["prompt_ids"] for p in data["prompts"]] == [[5, 17, 301], [33, 402]]
    sequences = data["prompts"][0]["sequences"]
    assert len(sequences) == 2 and sequences[0]["score"] >= sequences[1]["score"]
    assert sequences[0]["text"] == ",".join(map(str, sequences[0]["token_ids"]))
    assert result.stdout.startswith("0.0: ") and "\n1.1: " in result.stdout and "score" not in result.stdout
    assert "score of 0.1: " in result.stderr  # figures on stderr and in --json; stdout is the text alone


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-return-sequences", "2"], "num_return_sequences .* must be 1 to num_beams"),
        (["--length-penalty", "2"], "length_penalty .* only applies to beam search"),
        (["--num-beams", "2", "--early-stopping", "maybe"], "--early-stopping must be true, false or never"),
        (["--num-beams", "2", "--sample"], "beam sampling"),
        (["--stop", "x"], "stop strings .* need the tokenizer files"),
        (["--repetition-penalty", "0"], r"repetition_penalty 0.0 \(--repetition-penalty\) is not a finite number from"),
    ],
)
def test_cli_refuses_bad_decoding_options(tiny_export, args, message):
    result = CliRunner().invoke(app, ["generate", str(tiny_export), "--ids", "1,2"] + args)
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1
    import re

    assert re.search(message, result.output), result.output
