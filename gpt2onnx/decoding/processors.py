"""transformers' logits processors and stopping criteria in numpy (the run path has no torch).

Each function mirrors one class of ``transformers/generation/logits_process.py`` (4.57), in the same order
``GenerationMixin._get_logits_processor`` applies them: repetition penalty, no-repeat n-grams, minimum new
tokens, then (sampling only) temperature, top-k and top-p. They work on float32 scores of shape [rows, vocab]
and on the rows' whole sequences so far ([rows, length]: the left-padded prompt, padding ids included, as
transformers sees them, then the new tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpt2onnx.errors import BadInput
from gpt2onnx.generation_options import Decoding, Sampling
from gpt2onnx.params import Rule, options_of, param

MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties
MAX_BIAS = 100.0  # OpenAI's range for a logit bias


def repetition_penalty(
    scores: np.ndarray, sequences: np.ndarray, penalty: float, *, skip: np.ndarray | None = None
) -> np.ndarray:
    """RepetitionPenaltyLogitsProcessor: every token already in the row has its score divided by ``penalty``
    where positive, multiplied where negative. ``skip``: per row, the leading positions left out (transformers
    5 passes each row's left padding, so the pad id is not penalised; transformers 4 penalised it too)."""
    if penalty == 1.0:
        return scores
    vocab = scores.shape[-1]
    ids = np.minimum(sequences, vocab)  # column ``vocab``: a sink for the positions left out
    if skip is not None:
        ids = np.where(np.arange(ids.shape[1])[None, :] < np.asarray(skip)[:, None], vocab, ids)
    out = np.concatenate([scores, np.zeros((scores.shape[0], 1), scores.dtype)], axis=1)
    seen = np.take_along_axis(out, ids, axis=1)
    seen = np.where(seen < 0, seen * np.float32(penalty), seen / np.float32(penalty)).astype(scores.dtype)
    np.put_along_axis(out, ids, seen, axis=1)
    return out[:, :vocab]


def banned_ngram_tokens(sequence: list[int], size: int) -> list[int]:
    """The tokens that would repeat an n-gram of ``size`` already in ``sequence`` (transformers'
    _calc_banned_ngram_tokens)."""
    if len(sequence) + 1 < size:
        return []
    prefix = tuple(sequence[len(sequence) + 1 - size :])
    return [
        sequence[i + size - 1] for i in range(len(sequence) - size + 1) if tuple(sequence[i : i + size - 1]) == prefix
    ]


def no_repeat_ngram(scores: np.ndarray, sequences: np.ndarray, size: int) -> np.ndarray:
    """NoRepeatNGramLogitsProcessor: -inf on every token that would complete an n-gram seen before in the row."""
    if size <= 0:
        return scores
    out = scores.copy()
    for row, sequence in enumerate(sequences.tolist()):
        banned = banned_ngram_tokens(sequence, size)
        if banned:
            out[row, banned] = -np.inf
    return out


def min_new_tokens(scores: np.ndarray, new_tokens: int, minimum: int, eos_token_ids: tuple[int, ...]) -> np.ndarray:
    """MinNewTokensLengthLogitsProcessor: end-of-sequence is impossible until ``minimum`` new tokens exist."""
    if new_tokens >= minimum or not eos_token_ids:
        return scores
    out = scores.copy()
    out[:, list(eos_token_ids)] = -np.inf
    return out


def temperature(scores: np.ndarray, value: float) -> np.ndarray:
    """TemperatureLogitsWarper."""
    return scores if value == 1.0 else (scores / np.float32(value)).astype(scores.dtype)


def top_k(scores: np.ndarray, k: int, *, min_tokens_to_keep: int = 1) -> np.ndarray:
    """TopKLogitsWarper: -inf below the k-th highest score (ties with it are kept)."""
    if k <= 0:
        return scores
    k = min(max(k, min_tokens_to_keep), scores.shape[-1])
    kth = np.partition(scores, -k, axis=-1)[:, -k][:, None]
    return np.where(scores < kth, -np.inf, scores).astype(scores.dtype)


def softmax(scores: np.ndarray) -> np.ndarray:
    shifted = scores - scores.max(-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(-1, keepdims=True)


def log_softmax(scores: np.ndarray) -> np.ndarray:
    shifted = scores - scores.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def top_p(scores: np.ndarray, p: float, *, min_tokens_to_keep: int = 1) -> np.ndarray:
    """TopPLogitsWarper: sorted ascending, the tokens whose cumulative probability is at most 1 - p are dropped,
    the last ``min_tokens_to_keep`` always kept."""
    if p >= 1.0:
        return scores
    order = np.argsort(scores, axis=-1, kind="stable")
    sorted_scores = np.take_along_axis(scores, order, axis=-1)
    cumulative = np.cumsum(softmax(sorted_scores), axis=-1)
    drop_sorted = cumulative <= (1 - p)
    drop_sorted[:, -min_tokens_to_keep:] = False
    drop = np.zeros_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, axis=-1)
    return np.where(drop, -np.inf, scores).astype(scores.dtype)


@dataclass(frozen=True)
class Bias:
    """OpenAI's adjustments of the logits, applied before transformers' processors (the batching engine and the
    OpenAI endpoint take them): ``logit_bias`` (token id, bias) pairs added to the logits; then, over the tokens
    generated so far, ``presence_penalty`` subtracted once from each token that appeared and ``frequency_penalty``
    times its count (OpenAI's definition; not transformers' repetition_penalty, which also counts the prompt)."""

    presence_penalty: float = param(
        0.0, "Subtract this from every token already generated.", rule=Rule("float", -MAX_PENALTY, MAX_PENALTY)
    )
    frequency_penalty: float = param(
        0.0, "Subtract this times a token's count so far.", rule=Rule("float", -MAX_PENALTY, MAX_PENALTY)
    )
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:  # an invalid one cannot be built
        for option in options_of(Bias):
            option.param.rule.check(getattr(self, option.field), name=option.key, source="(request)")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        rule = Rule("float", -MAX_BIAS, MAX_BIAS)
        for token, bias in self.logit_bias:
            rule.check(bias, name=f"logit_bias of token {token}", source="(request)")

    @property
    def on(self) -> bool:
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def check_vocabulary(self, vocab_size: int) -> None:
        bad = [t for t, _ in self.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise BadInput(
                f"logit_bias names token id {bad[0]}, outside the vocabulary (0 to {vocab_size - 1}): drop it"
            )

    def __call__(self, scores: np.ndarray, generated: list[int]) -> np.ndarray:
        """[1, vocab] scores adjusted for one row whose new tokens so far are ``generated``."""
        if not self.on:
            return scores
        out = scores.astype(np.float32, copy=True)
        if self.logit_bias:
            ids, biases = zip(*self.logit_bias)
            np.add.at(out, (slice(None), np.asarray(ids)), np.asarray(biases, dtype=np.float32))
        if generated and (self.presence_penalty or self.frequency_penalty):
            counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=out.shape[-1])[: out.shape[-1]]
            penalty = self.frequency_penalty * counts + self.presence_penalty * (counts > 0)
            out -= penalty.astype(np.float32)[None, :]
        return out


def top_logprobs(scores: np.ndarray, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """One row's log-probability of ``token`` under softmax(``scores``) ([vocab] float), and the ``k`` most
    likely tokens with theirs, most likely first."""
    logprobs = log_softmax(scores.astype(np.float32)[None, :])[0]
    top = ()
    if k > 0:
        k = min(k, logprobs.shape[-1])
        best = np.argpartition(-logprobs, k - 1)[:k]
        best = best[np.argsort(-logprobs[best], kind="stable")]
        top = tuple((int(i), float(logprobs[i])) for i in best)
    return float(logprobs[token]), top


class StopStrings:
    """StopStringCriteria: a row stops when a stop string appears in its text and overlaps its last token.

    The text is built from each token's own string (as transformers' criterion does, not by decoding the whole
    row), from the row's real tokens; the strings are cached per token id."""

    def __init__(self, tokenizer, strings: tuple[str, ...]):
        self.tokenizer, self.strings = tokenizer, tuple(strings)
        self.longest = max(len(s) for s in self.strings)
        self._cache: dict[int, str] = {}

    def token_text(self, token: int) -> str:
        if token not in self._cache:
            piece = self.tokenizer.convert_ids_to_tokens(token)  # None: an id beyond the tokenizer's vocabulary
            self._cache[token] = "" if piece is None else self.tokenizer.convert_tokens_to_string([piece])
        return self._cache[token]

    def __call__(self, tokens: list[int]) -> bool:
        """``tokens``: the row's real tokens so far (prompt and new); True where a stop string ends it."""
        if not tokens:
            return False
        last = self.token_text(tokens[-1])
        tail, i = last, len(tokens) - 1
        while len(tail) - len(last) < self.longest and i > 0:  # enough text before the last token
            i -= 1
            tail = self.token_text(tokens[i]) + tail
        before = len(tail) - len(last)
        return any(s in tail[max(0, before - len(s) + 1) :] for s in self.strings)


def process_scores(
    scores: np.ndarray,
    sequences: np.ndarray,
    *,
    prompt_length: int,
    decoding: Decoding,
    sampling: Sampling,
    eos_token_ids: tuple[int, ...],
    padding: np.ndarray | None = None,
    min_tokens_to_keep: int = 1,
) -> np.ndarray:
    """The logits processors of transformers' generate() in its order, on [rows, vocab] float32 scores and the
    rows' sequences so far (left-padded prompt included; ``padding``: each row's count of left padding, which the
    repetition penalty leaves out); the warpers only when sampling."""
    scores = repetition_penalty(scores, sequences, decoding.repetition_penalty, skip=padding)
    scores = no_repeat_ngram(scores, sequences, decoding.no_repeat_ngram_size)
    scores = min_new_tokens(scores, sequences.shape[1] - prompt_length, decoding.min_new_tokens, eos_token_ids)
    if sampling.sample:
        scores = warp(scores, sampling, min_tokens_to_keep=min_tokens_to_keep)
    return scores


def warp(scores: np.ndarray, sampling: Sampling, *, min_tokens_to_keep: int = 1) -> np.ndarray:
    """Temperature, top-k and top-p as transformers' warpers: filtered float32 scores (-inf where dropped)."""
    scores = temperature(scores.astype(np.float32), sampling.temperature)
    scores = top_k(scores, sampling.top_k, min_tokens_to_keep=min_tokens_to_keep)
    return top_p(scores, sampling.top_p, min_tokens_to_keep=min_tokens_to_keep)


def draw(scores: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row from softmax(scores) (float64, so the probabilities sum to 1 for numpy)."""
    probs = softmax(scores.astype(np.float64))
    return np.array([rng.choice(probs.shape[-1], p=row / row.sum()) for row in probs])


def next_tokens(logits_last: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> np.ndarray:
    """[batch, vocab] logits of the last position → [batch] token ids (no processors)."""
    if not sampling.sample:
        return logits_last.argmax(-1)
    return draw(warp(logits_last, sampling), rng)
