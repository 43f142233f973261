"""The decode loop: prompt step with empty past, then one token per step with presents fed back as past.

Greedy, or sampling with temperature, top-k, top-p and a seed; stops at end-of-sequence (per row) or after
max_new_tokens; refuses a total length beyond the model's context.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from gpt2onnx.errors import Gpt2OnnxError
from gpt2onnx.runtimes.decoder import OnnxDecoder, position_ids_for


@dataclass(frozen=True)
class Sampling:
    """Greedy unless ``sample`` is set."""

    sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int | None = None

    def check(self) -> None:
        if self.temperature <= 0:
            raise Gpt2OnnxError(f"--temperature must be positive, got {self.temperature}")
        if self.top_k < 0:
            raise Gpt2OnnxError(f"--top-k must be 0 (off) or positive, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise Gpt2OnnxError(f"--top-p must be in (0, 1], got {self.top_p}")


@dataclass
class Generation:
    tokens: np.ndarray  # [batch, steps] new token ids (rows that stopped are padded with eos)
    finished: np.ndarray  # [batch] True where the row produced eos
    step_seconds: list[float] = field(default_factory=list)  # [0] is the prompt step


def next_tokens(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> np.ndarray:
    """[batch, vocab] logits of the last position → [batch] token ids."""
    if not sampling.sample:
        return logits.argmax(-1)
    scores = logits.astype(np.float64) / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        kth = np.partition(scores, -sampling.top_k, axis=-1)[:, -sampling.top_k][:, None]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    if sampling.top_p < 1.0:
        order = np.argsort(-probs, axis=-1)
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the most likely token)
        drop_sorted = np.cumsum(sorted_probs, axis=-1) - sorted_probs >= sampling.top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(-1, keepdims=True)
    return np.array([rng.choice(probs.shape[-1], p=row) for row in probs])


def generate(
    decoder: OnnxDecoder,
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None = None,
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_token_id: int | None = None,
    on_step: Callable[[int, np.ndarray], None] | None = None,
) -> Generation:
    """Continue a (left-padded) batch. ``on_step(step, ids)`` is called with each step's new ids, for streaming."""
    input_ids = np.asarray(input_ids, dtype=np.int64)
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise Gpt2OnnxError("the prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise Gpt2OnnxError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
    if (mask.sum(-1) == 0).any():
        raise Gpt2OnnxError("a prompt row is all padding: every row needs at least one token")
    sampling.check()
    decoder.check_ids(input_ids, mask)
    decoder.check_length(input_ids.shape[1] + max_new_tokens)
    rng = np.random.default_rng(sampling.seed)
    batch = input_ids.shape[0]
    full_mask = decoder.prompt_mask(mask)
    positions = position_ids_for(mask)
    finished = np.zeros(batch, dtype=bool)
    tokens, seconds = [], []
    start = time.perf_counter()
    logits, past = decoder.run(input_ids, full_mask, positions, decoder.empty_past(batch))
    seconds.append(time.perf_counter() - start)
    for step in range(max_new_tokens):
        ids = next_tokens(logits[:, -1], sampling, rng)
        if eos_token_id is not None:
            ids = np.where(finished, eos_token_id, ids)
            finished |= ids == eos_token_id
        tokens.append(ids)
        if on_step is not None:
            on_step(step, ids)
        if step == max_new_tokens - 1 or finished.all():
            break
        next_ids = ids[:, None].astype(np.int64)
        full_mask = np.concatenate([full_mask, np.ones((batch, 1), np.int64)], axis=1)
        positions = positions[:, -1:] + 1
        start = time.perf_counter()
        logits, past = decoder.run(next_ids, full_mask, positions, past)
        seconds.append(time.perf_counter() - start)
    return Generation(np.stack(tokens, axis=1), finished, seconds)
