"""Beam search on a stepper, as transformers' ``GenerationMixin._beam_search`` (4.57) does it, in numpy.

The port keeps transformers' vectorised algorithm step for step (its names in the comments): per prompt, the
``num_beams`` running beams and the ``num_beams`` best finished ones; each step takes the top
``max(2, 1 + n_eos) * num_beams`` continuations over all beams of a prompt, continues the best unfinished ones,
keeps a finished one when it beats the worst kept (its score divided by ``new_length ** length_penalty``), and
stops a prompt by ``early_stopping`` (True: once num_beams are finished; False: transformers' heuristic on the
current length; "never": the best possible length). Same scores in float32, so the same tokens.

The K/V cache has one row per beam. The prompt runs once per prompt (not per beam) and its cache is spread over
the beams; after each step the cache rows are picked by the surviving beams' parents through the stepper's
``reorder_past`` (a Gather on the provider's device for onnxruntime, in place for the shared cache), skipped
when every beam continues its own row.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from gpt2onnx.artifact.contract import position_ids_for
from gpt2onnx.decoding import processors as logits
from gpt2onnx.decoding.processors import process_scores
from gpt2onnx.decoding.results import Generation
from gpt2onnx.decoding.strategy import Request, Strategy
from gpt2onnx.generation_options import Sampling

NEG = np.float32(-1.0e9)  # transformers' "impossible" score


# Host bytes beam search holds per beam and vocabulary entry at its peak within a step: the step's logits (the
# runtime's buffer and its numpy copy), their float32 copy, log_softmax's shifted and exp arrays and its result,
# the scores plus the beams' running scores, and the top-k's negated copy and its int64 argpartition indices
# (4 + 4 + 4 + 12 + 4 + 12 = 40, the processors' copies included in the margin).
VOCAB_BYTES = 40


def beam_search_bytes(
    batch: int, decoding, total_len: int, new_tokens: int, vocab_size: int | None, eos_token_ids=()
) -> int:
    """What :func:`beam_search` allocates beyond the runtime's logits and cache, at its peak (0 without beams):
    the vocabulary-wide arrays of a step over every beam, and the int64 sequences and parent indices it keeps
    (running, finished, the top continuations and their concatenation, each for the whole length). Callers add
    it to the runtime's own estimate before anything runs (``check_memory(..., extra_bytes=...)``)."""
    if decoding.num_beams <= 1:
        return 0
    beams = decoding.num_beams
    keep = max(2, 1 + len(eos_token_ids)) * beams
    per_length = 8 * batch * (4 * beams + 2 * keep)  # running, sequences, two gathers; top and concatenated
    return VOCAB_BYTES * batch * beams * (vocab_size or 50257) + per_length * (total_len + new_tokens)


def _topk(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest per row, largest first (ties: the lower index first, as torch.topk on cpu)."""
    if k >= values.shape[1]:
        return np.argsort(-values, axis=1, kind="stable")
    part = np.argpartition(-values, k - 1, axis=1)[:, :k]
    part.sort(axis=1)  # index order first, so the stable sort below breaks ties by index
    order = np.argsort(-np.take_along_axis(values, part, axis=1), axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1)


def _gather(array: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """transformers' _gather_beams: array[b, indices[b, j], ...]."""
    index = indices.reshape(indices.shape + (1,) * (array.ndim - 2))
    return np.take_along_axis(array, index, axis=1)


# 146 lines, on purpose: transformers' _beam_search ported step for step (its names in the comments), kept in one
# piece so that it reads beside its source; split, the two could no longer be compared line by line.
def beam_search(
    decoder,
    input_ids: np.ndarray,
    mask: np.ndarray,
    *,
    max_new_tokens: int,
    decoding,
    eos_token_ids: tuple[int, ...],
    pad_token_id: int | None,
    stop: Callable[[list[int]], bool] | None = None,
    sampling=None,
    constraint=None,
):
    """Beam search over a left-padded batch (checked by the caller): a :class:`Generation` with
    ``num_return_sequences`` rows per prompt, best first, and transformers' sequence scores. ``constraint``
    (gpt2onnx.decoding.constraints.TokenConstraint): each beam its own matcher, masking its log-probabilities
    after the processors (where transformers applies a logits processor in beam search), handed on to the beams
    that continue it."""
    sampling = sampling or Sampling()
    batch, prompt_length = input_ids.shape
    beams = decoding.num_beams
    max_length = prompt_length + max_new_tokens
    keep = max(2, 1 + len(eos_token_ids)) * beams  # beams_to_keep
    top_beams = np.arange(keep) < beams  # top_num_beam_mask
    penalty, early = decoding.length_penalty, decoding.early_stopping
    # transformers' output_fill_value: `pad or eos[0]` (a pad id of 0 counts as none there too)
    fill = pad_token_id if pad_token_id else (eos_token_ids[0] if eos_token_ids else -1)

    running = np.full((batch, beams, max_length), fill, dtype=np.int64)  # running_sequences
    running[:, :, :prompt_length] = input_ids[:, None]
    sequences = running.copy()
    running_scores = np.zeros((batch, beams), np.float32)
    running_scores[:, 1:] = NEG
    beam_scores = np.full((batch, beams), NEG, np.float32)
    is_finished = np.zeros((batch, beams), dtype=bool)  # is_sent_finished
    improvable = np.ones((batch, 1), dtype=bool)  # is_early_stop_heuristic_unsatisfied
    running_parents = np.full((batch, beams, max_new_tokens), -1, dtype=np.int64)  # running_beam_indices
    parents = running_parents.copy()
    real = [row[m > 0].tolist() for row, m in zip(input_ids, mask)]  # each prompt's real tokens (stop strings)

    # the prompt once per prompt, then its cache and logits spread over the beams
    full_mask = decoder.prompt_mask(mask)
    positions = position_ids_for(mask)
    start = time.perf_counter()
    past = decoder.empty_past(batch, capacity=full_mask.shape[1] + max_new_tokens)
    out, past = decoder.run(input_ids, full_mask, positions, past)
    spread = np.repeat(np.arange(batch), beams)
    past = decoder.reorder_past(past, spread)
    out = out[spread]
    full_mask, positions = full_mask[spread], positions[spread]
    seconds = [time.perf_counter() - start]
    identity = np.arange(batch * beams)
    padding = np.repeat((mask == 0).sum(axis=1), beams)  # each beam's left padding (the repetition penalty's skip)
    vocab = None
    matchers = constraint.start(batch * beams) if constraint is not None else None
    cur_len = prompt_length
    while True:
        flat = running[:, :, :cur_len].reshape(batch * beams, cur_len)
        log_probs = logits.log_softmax(out[:, -1].astype(np.float32))
        log_probs = process_scores(
            log_probs,
            flat,
            prompt_length=prompt_length,
            decoding=decoding,
            sampling=sampling,
            eos_token_ids=eos_token_ids,
            padding=padding,
        )
        if matchers is not None:
            log_probs = matchers.mask(log_probs)
        vocab = log_probs.shape[-1]
        log_probs = log_probs.reshape(batch, beams, vocab) + running_scores[:, :, None]
        log_probs = log_probs.reshape(batch, beams * vocab)

        # c. the top-k continuations over all beams of each prompt (_get_top_k_continuations)
        top = _topk(log_probs, keep)
        top_scores = np.take_along_axis(log_probs, top, axis=1)
        top_parent = top // vocab
        top_ids = top % vocab
        top_sequences = _gather(running, top_parent)
        top_sequences[:, :, cur_len] = top_ids
        top_parents = _gather(running_parents, top_parent)
        top_parents[:, :, cur_len - prompt_length] = top_parent + np.arange(batch)[:, None] * beams

        # d. which continuations stop here: max length, end-of-sequence, a stop string
        hits = np.full((batch, keep), cur_len + 1 >= max_length)
        if eos_token_ids:
            hits |= np.isin(top_ids, eos_token_ids)
        if stop is not None:
            new = top_sequences[:, :, prompt_length : cur_len + 1]
            for b in range(batch):
                for j in range(keep):
                    if not hits[b, j]:
                        hits[b, j] = stop(real[b] + new[b, j].tolist())

        # e. the unfinished best num_beams continue (_get_running_beams_for_next_iteration)
        top_running_scores = top_scores + hits.astype(np.float32) * NEG
        chosen = _topk(top_running_scores, beams)
        running = _gather(top_sequences, chosen)
        running_scores = _gather(top_running_scores, chosen)
        running_parents = _gather(top_parents, chosen)

        # f. the finished ones that beat the kept ones (_update_finished_beams)
        just_finished = hits & top_beams[None, :]
        finals = top_scores / np.float32((cur_len + 1 - prompt_length) ** penalty)
        full = is_finished.all(axis=-1, keepdims=True) & (early is True)
        finals = finals + full.astype(np.float32) * NEG
        finals = finals + (~improvable).astype(np.float32) * NEG
        finals = finals + (~just_finished).astype(np.float32) * NEG
        merged = np.concatenate([beam_scores, finals], axis=1)
        best = _topk(merged, beams)
        sequences = _gather(np.concatenate([sequences, top_sequences], axis=1), best)
        beam_scores = _gather(merged, best)
        parents = _gather(np.concatenate([parents, top_parents], axis=1), best)
        is_finished = _gather(np.concatenate([is_finished, just_finished], axis=1), best)

        # g. the stopping condition of the whole search (_check_early_stop_heuristic and the loop's test)
        rows = running_parents[:, :, cur_len - prompt_length].reshape(-1)
        cur_len += 1
        if early == "never" and penalty > 0.0:
            hypothetical = max_length - prompt_length
        else:
            hypothetical = cur_len - prompt_length
        best_running = running_scores[:, :1] / np.float32(hypothetical**penalty)
        worst_finished = np.where(is_finished, beam_scores.min(axis=1, keepdims=True), NEG)
        improvable = improvable & (best_running > worst_finished).any(axis=-1, keepdims=True)
        open_beam = not (is_finished.all() and early is True)
        if not (improvable.any() and open_beam and not hits.all()):
            break

        if not np.array_equal(rows, identity):
            past = decoder.reorder_past(past, rows)
        next_ids = running[:, :, cur_len - 1].reshape(-1, 1)
        if matchers is not None:  # each running beam: its parent's matcher, then its new token
            matchers.reorder(rows)
            matchers.advance(next_ids)
        full_mask = np.concatenate([full_mask, np.ones((batch * beams, 1), np.int64)], axis=1)
        positions = positions[:, -1:] + 1
        start = time.perf_counter()
        out, past = decoder.run(next_ids, full_mask, positions, past)
        seconds.append(time.perf_counter() - start)

    # 5. the best num_return_sequences per prompt, cut to the longest returned
    count = decoding.num_return_sequences
    sequences = sequences[:, :count].reshape(batch * count, max_length)
    scores = beam_scores[:, :count].reshape(-1)
    lengths = (parents[:, :count].reshape(batch * count, -1) >= 0).sum(axis=1)
    width = int(lengths.max())
    tokens = sequences[:, prompt_length : prompt_length + width]
    finished = np.zeros(batch * count, dtype=bool)
    for row, length in enumerate(lengths):
        last = int(tokens[row, length - 1])
        finished[row] = last in eos_token_ids or (
            stop is not None and stop(real[row // count] + tokens[row, :length].tolist())
        )
    return Generation(tokens, finished, seconds, scores.astype(np.float64), count, lengths)


def _run(decoder, request: Request):
    return beam_search(decoder, request.input_ids, request.mask, **request.stopping())


STRATEGY = Strategy(
    name="beam search",
    summary="transformers' beam search on a stepper: num_beams rows per prompt, the cache reordered each step",
    applies=lambda runtime, request: request.decoding.beams,
    run=_run,
)
