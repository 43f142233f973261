"""What a decode loop gives back (a :class:`Generation`), the rows a runtime-owned loop returned made into one,
and the limits every strategy applies to a request's size. The options a loop is asked for (Sampling, Decoding)
are a request's, :mod:`gpt2onnx.generation_options`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from gpt2onnx.errors import BadInput
from gpt2onnx.generation_options import Decoding


@dataclass
class Generation:
    """New tokens per returned sequence: rows = batch × num_return_sequences (row r continues prompt
    r // num_return_sequences, best beam first)."""

    tokens: np.ndarray  # [rows, steps] new token ids; a row that stopped is filled with the pad id
    finished: np.ndarray  # [rows] True where the row ended (end-of-sequence or a stop string)
    step_seconds: list[float] = field(default_factory=list)  # [0] is the prompt step
    # [rows] beam search: transformers' sequences_scores (sum of log-probs / new length ** length_penalty);
    # greedy and sampling: the sum of the new tokens' log-probs under the processed distribution; None: not known
    scores: np.ndarray | None = None
    num_return_sequences: int = 1
    lengths: np.ndarray | None = None  # [rows] new tokens in each row, up to and including its last real one
    speculation: object | None = None  # speculative decoding: its Acceptance (gpt2onnx.decoding.speculative)
    # [rows] with a constraint: True where the row's tokens are a complete match (None: no constraint)
    complete: np.ndarray | None = None


def loop_generation(
    prompts: list[list[int]],
    sequences: list[list[list[int]]],
    *,
    eos_token_ids: tuple[int, ...],
    pad_token_id: int | None,
    stop: Callable[[list[int]], bool] | None,
    decoding: Decoding,
    step_seconds: list[float],
    on_step: Callable[[int, np.ndarray], None] | None = None,
) -> Generation:
    """What a runtime that owns its loop returned (per prompt, the new tokens of its sequences, best first) as the
    decode loop returns it: ``num_return_sequences`` rows per prompt, each cut after its first end-of-sequence id
    or where a stop string ends (what stopping there would have given), padded with the pad id. ``on_step`` is
    called after the loop, not while it runs (not with beam search)."""
    fill = pad_token_id if pad_token_id is not None else 0
    rows, finished = [], []
    for prompt, found in zip(prompts, sequences):
        for tokens in found[: decoding.num_return_sequences]:
            ended = False
            for i, token in enumerate(tokens):
                if token in eos_token_ids or (stop is not None and stop(prompt + tokens[: i + 1])):
                    tokens, ended = tokens[: i + 1], True
                    break
            finished.append(ended)
            rows.append(tokens)
    width = max(len(r) for r in rows)
    tokens = np.array([r + [fill] * (width - len(r)) for r in rows], dtype=np.int64)
    if on_step is not None and not decoding.beams:
        for step in range(width):
            on_step(step, tokens[:, step])
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    return Generation(tokens, np.array(finished), step_seconds, None, decoding.num_return_sequences, lengths)


MAX_BATCH_TOKENS = 1 << 20  # rows × total length: beyond this the logits and cache would not fit in memory


def check_new_tokens(max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise BadInput(f"max_new_tokens must be at least 1 (a whole number), got {max_new_tokens!r}")


def check_request_size(batch: int, prompt_length: int, max_new_tokens: int, decoding: Decoding) -> int:
    """The rows a request takes (prompts × beams or returned sequences), refused past MAX_BATCH_TOKENS tokens at
    once; returns the rows."""
    rows = batch * decoding.rows_per_prompt
    if rows * (prompt_length + max_new_tokens) > MAX_BATCH_TOKENS:
        raise BadInput(
            f"{rows} rows (batch × beams) × {prompt_length + max_new_tokens} tokens is more than"
            f" {MAX_BATCH_TOKENS:,} tokens at once: use a smaller batch, fewer beams or fewer tokens"
        )
    return rows
