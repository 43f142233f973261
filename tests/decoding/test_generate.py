"""The decode runner: greedy equals transformers' generate(), sampling, end-of-sequence, limits."""

import numpy as np
import pytest

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.decoding.generate import decode
from gpt2onnx.errors import Gpt2OnnxError
from gpt2onnx.generation_options import Sampling
from gpt2onnx.pytorch.checkpoint import load_checkpoint
from gpt2onnx.pytorch.reference import reference_model
from gpt2onnx.runtimes.decoder import open_decoder
from gpt2onnx.runtimes.providers import ProviderConfig
from gpt2onnx.verify.lockstep import left_padded_batch, reference_greedy


@pytest.fixture(scope="module")
def decoder(tiny_export):
    return open_decoder(open_folder(tiny_export), ProviderConfig())


@pytest.fixture(scope="module")
def reference(tiny_folder):
    return reference_model(load_checkpoint(str(tiny_folder)))


def test_greedy_reproduces_transformers_generate(decoder, reference):
    ids, mask = left_padded_batch(1000, batch=4, length=9, seed=11)
    ours = decode(decoder, ids, mask, max_new_tokens=20)
    theirs = reference_greedy(reference, ids, mask, 20)
    np.testing.assert_array_equal(ours.tokens, theirs)
    assert len(ours.step_seconds) == 20 and not ours.finished.any()


def test_sampling_is_seeded(decoder):
    ids = np.array([[5, 6, 7]])
    a = decode(decoder, ids, max_new_tokens=12, sampling=Sampling(sample=True, seed=1)).tokens
    b = decode(decoder, ids, max_new_tokens=12, sampling=Sampling(sample=True, seed=1)).tokens
    c = decode(decoder, ids, max_new_tokens=12, sampling=Sampling(sample=True, seed=2)).tokens
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_top_k_1_and_tiny_top_p_are_greedy(decoder):
    ids, mask = left_padded_batch(1000, batch=2, length=5, seed=3)
    greedy = decode(decoder, ids, mask, max_new_tokens=8).tokens
    for sampling in (Sampling(sample=True, top_k=1, seed=0), Sampling(sample=True, top_p=1e-6, seed=0)):
        np.testing.assert_array_equal(decode(decoder, ids, mask, max_new_tokens=8, sampling=sampling).tokens, greedy)


def test_low_temperature_is_greedy_and_top_k_limits_choices(decoder):
    ids = np.array([[1, 2, 3, 4]])
    greedy = decode(decoder, ids, max_new_tokens=6).tokens
    cold = decode(decoder, ids, max_new_tokens=6, sampling=Sampling(sample=True, temperature=1e-4, seed=0)).tokens
    np.testing.assert_array_equal(cold, greedy)
    logits, _ = decoder.run(ids, np.ones_like(ids), np.arange(4)[None], decoder.empty_past(1))
    top3 = set(np.argsort(-logits[0, -1])[:3])
    from gpt2onnx.decoding.processors import next_tokens

    rng = np.random.default_rng(0)
    draws = {
        int(next_tokens(logits[:, -1], Sampling(sample=True, top_k=3, temperature=5.0), rng)[0]) for _ in range(200)
    }
    assert draws <= top3 and len(draws) > 1


def test_stops_at_end_of_sequence(decoder):
    ids, mask = left_padded_batch(1000, batch=2, length=6, seed=4)
    free = decode(decoder, ids, mask, max_new_tokens=10).tokens
    eos = int(free[0, 2])  # the third token of row 0 plays end-of-sequence
    stopped = decode(decoder, ids, mask, max_new_tokens=10, eos_token_id=eos)
    assert stopped.finished[0]
    row0 = list(stopped.tokens[0])
    assert row0[: row0.index(eos) + 1] == list(free[0, : list(free[0]).index(eos) + 1])
    if not stopped.finished.all():
        assert stopped.tokens.shape[1] == 10


def test_streaming_callback_sees_every_step(decoder):
    seen = []
    result = decode(
        decoder, np.array([[9, 8, 7]]), max_new_tokens=5, on_step=lambda step, ids: seen.append((step, int(ids[0])))
    )
    assert [s for s, _ in seen] == list(range(5)) and [t for _, t in seen] == list(result.tokens[0])


@pytest.mark.parametrize(
    "ids, kwargs, message",
    [
        (np.array([[1, 2, 1000]]), {}, "token id 1000 is outside the vocabulary"),
        (np.array([[1, -1]]), {}, "token id -1 is outside"),
        (np.zeros((1, 0), np.int64), {}, "the prompt is empty"),
        (np.array([[1] * 120]), {"max_new_tokens": 9}, "129 tokens, beyond the model's context of 128"),
        (np.array([[1]]), {"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
    ],
)
def test_bad_generation_inputs(decoder, ids, kwargs, message):
    with pytest.raises(Gpt2OnnxError, match=message):
        decode(decoder, ids, **{"max_new_tokens": 4, **kwargs})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sample": True, "top_p": 0.0}, r"top_p 0.0 \(--top-p\) is not a finite number above 0 and at most 1"),
        ({"sample": True, "temperature": 0}, r"temperature 0 \(--temperature\) is not a finite number from 1e-06"),
        ({"top_k": 5}, r"top_k only apply when sampling"),
    ],
)
def test_invalid_sampling_cannot_be_built(kwargs, message):
    with pytest.raises(Gpt2OnnxError, match=message):
        Sampling(**kwargs)


def test_optimum_export_runs_through_the_runner(tiny_folder, tmp_path, reference):
    """A folder exported by optimum (its own names, its own graph) works with generate and parity."""
    import warnings

    from conftest import import_optimum

    main_export = import_optimum("optimum.exporters.onnx", "main_export")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main_export(
            str(tiny_folder), output=tmp_path / "optimum", task="text-generation-with-past", no_post_process=True
        )
    decoder = open_decoder(open_folder(tmp_path / "optimum"), ProviderConfig())
    ids, mask = left_padded_batch(1000, batch=3, length=6, seed=8)
    np.testing.assert_array_equal(
        decode(decoder, ids, mask, max_new_tokens=10).tokens, reference_greedy(reference, ids, mask, 10)
    )
    from gpt2onnx.verify.parity import parity

    with pytest.raises(Gpt2OnnxError, match="no gpt2onnx.json manifest.*--reference"):
        parity(tmp_path / "optimum", cases=1)
    report = parity(tmp_path / "optimum", cases=4, reference=str(tiny_folder))
    assert report.passed, report.measured
