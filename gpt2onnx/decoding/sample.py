"""Greedy decoding and sampling on a stepper: one token per row per step, the logits processors applied in
transformers' order (gpt2onnx.decoding.processors), each row stopping at its end-of-sequence id or stop string."""

from __future__ import annotations

import time

import numpy as np

from gpt2onnx.artifact.contract import position_ids_for
from gpt2onnx.decoding import processors as logits
from gpt2onnx.decoding.processors import draw, process_scores
from gpt2onnx.decoding.results import Generation
from gpt2onnx.decoding.strategy import Request, Strategy


def _run(decoder, request: Request) -> Generation:
    return _steps(
        decoder,
        request.input_ids,
        request.mask,
        sampling=request.sampling,
        on_step=request.on_step,
        **request.stopping(),
    )


def _steps(
    decoder,
    input_ids,
    mask,
    *,
    max_new_tokens,
    sampling,
    decoding,
    eos_token_ids,
    pad_token_id,
    stop,
    on_step,
    constraint=None,
):
    """Greedy or sampled decoding on a stepper, one token per row per step, the logits processors applied; with a
    ``constraint`` (gpt2onnx.decoding.constraints.TokenConstraint) each row's matcher masks its logits first, and
    takes the chosen token."""
    eos_ids, pad = eos_token_ids, pad_token_id
    copies = decoding.num_return_sequences
    if copies > 1:  # transformers expands the inputs: each prompt once per returned sequence
        input_ids, mask = np.repeat(input_ids, copies, axis=0), np.repeat(mask, copies, axis=0)
    rng = np.random.default_rng(sampling.seed)
    batch, prompt_length = input_ids.shape
    full_mask = decoder.prompt_mask(mask)
    positions = position_ids_for(mask)
    sequences = input_ids.copy()
    real = [row[m > 0].tolist() for row, m in zip(input_ids, mask)]  # for stop strings
    finished = np.zeros(batch, dtype=bool)
    scores = np.zeros(batch, dtype=np.float64)
    lengths = np.zeros(batch, dtype=np.int64)
    tokens, seconds = [], []
    start = time.perf_counter()
    past = decoder.empty_past(batch, capacity=full_mask.shape[1] + max_new_tokens)
    out, past = decoder.run(input_ids, full_mask, positions, past)
    seconds.append(time.perf_counter() - start)
    processed = sampling.sample or decoding.processors_on()
    matchers = constraint.start(batch) if constraint is not None else None
    padding = (mask == 0).sum(axis=1)  # left padding: transformers 5's (mask != 0).argmax(1)
    for step in range(max_new_tokens):
        last = out[:, -1].astype(np.float32)
        if matchers is not None:
            last = allowed = matchers.mask(last, ~finished)
        if processed:
            last = process_scores(
                last,
                sequences,
                prompt_length=prompt_length,
                decoding=decoding,
                sampling=sampling,
                eos_token_ids=eos_ids,
                padding=padding,
            )
        if matchers is not None:  # a processor that removed every token the constraint allows: the constraint wins
            last = np.where(np.isneginf(last).all(axis=-1, keepdims=True), allowed, last)
        ids = draw(last, rng) if sampling.sample else last.argmax(-1)
        chosen = np.take_along_axis(logits.log_softmax(last), ids[:, None], axis=1)[:, 0]
        scores += np.where(finished, 0.0, chosen)
        lengths += ~finished
        if matchers is not None:
            matchers.advance(ids, ~finished)
        if pad is not None:
            ids = np.where(finished, pad, ids)
        sequences = np.concatenate([sequences, ids[:, None]], axis=1)
        ended = np.isin(ids, eos_ids) if eos_ids else np.zeros(batch, dtype=bool)
        if stop is not None:
            for row in np.flatnonzero(~finished):
                real[row].append(int(ids[row]))
                ended[row] |= stop(real[row])
        finished |= ended
        tokens.append(ids)
        if on_step is not None:
            on_step(step, ids)
        if step == max_new_tokens - 1 or finished.all():
            break
        next_ids = ids[:, None].astype(np.int64)
        full_mask = np.concatenate([full_mask, np.ones((batch, 1), np.int64)], axis=1)
        positions = positions[:, -1:] + 1
        start = time.perf_counter()
        out, past = decoder.run(next_ids, full_mask, positions, past)
        seconds.append(time.perf_counter() - start)
    return Generation(np.stack(tokens, axis=1), finished, seconds, scores, copies, lengths)


STRATEGY = Strategy(
    name="greedy or sampling",
    summary="one token per row per step on a stepper (greedy, or drawn from the processed distribution)",
    applies=lambda runtime, request: True,
    run=_run,
)
