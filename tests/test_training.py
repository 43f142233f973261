"""The trained models' recipe (scripts/training.py): the tied-tail softmax gives an ordinary GPT-2 whose
full softmax is the one trained, training is deterministic, and the corpus split is by module."""

import math

import numpy as np
import pytest
import torch

from gpt2onnx.errors import BadInput
from scripts.training import Recipe, heldout_quality, stdlib_docstrings, train_gpt2

TINY = Recipe(n_layer=1, n_head=2, n_embd=16, n_positions=32, block=16, batch=4, steps=6, warmup=2, threads=1)


def stream(vocab_used: int, length: int, seed: int = 0) -> np.ndarray:
    """Token ids that use only every 7th id below 7 × vocab_used: most of a 1,000-token vocabulary is tail."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, vocab_used, length) * 7).astype(np.int64)


def test_tied_tail_model_is_an_ordinary_gpt2_with_the_trained_softmax():
    ids = stream(40, 4000)
    result = train_gpt2(ids, vocab_size=1000, eos_id=999, recipe=TINY)  # checks its own loss on one batch
    model = result.model
    assert result.rows_trained == len(np.unique(ids)) == 40
    assert model.config.vocab_size == 1000 and model.config.eos_token_id == 999
    wte = model.transformer.wte.weight.detach()
    assert model.lm_head.weight.data_ptr() == wte.data_ptr()  # tied, as GPT-2
    tail = np.setdiff1d(np.arange(1000), np.unique(ids))
    assert torch.equal(wte[tail], wte[tail[:1]].expand(len(tail), -1))  # the tail shares one row
    assert not torch.equal(wte[0], wte[7])  # trained rows are their own
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.from_numpy(ids[None, :32])).logits[0], -1)
    torch.testing.assert_close(probs.sum(-1), torch.ones(32))
    # each tail token gets the same share: the shared row's mass spread evenly
    torch.testing.assert_close(probs[:, tail].std(-1), torch.zeros(32), atol=1e-9, rtol=0)
    quality = heldout_quality(model, stream(40, 300, seed=1), context=32)
    assert quality.perplexity < 1000 and math.isfinite(quality.perplexity)  # learned the 40 used ids


def test_training_is_deterministic():
    ids = stream(40, 4000)
    first = train_gpt2(ids, vocab_size=1000, eos_id=999, recipe=TINY)
    again = train_gpt2(ids, vocab_size=1000, eos_id=999, recipe=TINY)
    assert first.losses == again.losses
    for (name, a), (_, b) in zip(first.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_corpus_is_split_by_module_and_smaller_corpora_keep_the_heldout_modules():
    full = stdlib_docstrings(heldout_percent=2, train_percent=3)
    small = stdlib_docstrings(heldout_percent=2, train_percent=1)
    assert full.heldout and full.train and not set(full.train) & set(full.heldout)
    assert small.heldout == full.heldout and set(small.train) < set(full.train)
    assert "Python" in full.source
    text = full.heldout_text(max_chars=100)
    assert text == next(iter(full.heldout.values())) or len(text) >= 100


def test_a_text_shorter_than_one_row_is_refused():
    with pytest.raises(BadInput, match="the training text has 10 tokens: give more than 17"):
        train_gpt2(stream(5, 10), vocab_size=1000, eos_id=999, recipe=TINY)


def test_training_stops_when_the_heldout_perplexity_stops_falling_and_keeps_the_best_weights():
    ids = stream(40, 4000)
    recipe = Recipe(**{**TINY.__dict__, "steps": 40, "eval_every": 2, "patience": 2})
    scores = iter([50.0, 40.0, 45.0, 41.0, 30.0])  # improves, improves, then two evaluations without
    seen = []

    def evaluate(model):
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        return next(scores)

    result = train_gpt2(ids, vocab_size=1000, eos_id=999, recipe=recipe, evaluate=evaluate)
    assert result.stopped == "early stop" and result.steps_run == 8 and result.best_step == 4
    assert [point["step"] for point in result.curve] == [2, 4, 6, 8]
    assert [point["heldout_ppl"] for point in result.curve] == [50.0, 40.0, 45.0, 41.0]
    for name, value in result.model.state_dict().items():  # the returned model is the one evaluated at step 4
        assert torch.equal(value, seen[1][name]), name


def test_a_time_budget_stops_training():
    result = train_gpt2(stream(40, 4000), vocab_size=1000, eos_id=999, recipe=TINY, max_seconds=0)
    assert result.stopped == "time budget" and result.steps_run == 1 and result.curve == []


def test_the_learning_rate_decays_to_the_budget_when_it_comes_first():
    from scripts.training import _lr

    recipe = Recipe(**{**TINY.__dict__, "steps": 100, "warmup": 10, "lr": 1.0})
    assert _lr(55, recipe) == pytest.approx(0.55)  # half-way through the steps: the cosine's middle
    assert _lr(55, recipe, time_progress=1.0) == pytest.approx(0.1)  # the budget spent: the floor
    assert _lr(55, recipe, time_progress=0.2) == _lr(55, recipe)  # the steps are ahead: they lead
