"""Consistency along the K/V path: the model against itself on the same inputs, three ways users meet in
deployment (top tokens that change with and without a past after quantization; batches that differ from
batch 1). No reference model is needed: each check runs one stepper two ways.

- ``past``: decode steps fed one token at a time with the cache, against the same positions recomputed from
  scratch (the whole sequence so far, empty past);
- ``batch``: a left-padded batch (prompt, then decode steps), against each row run alone, unpadded;
- ``chunks``: a prompt fed in three chunks (each with the past of the ones before), against the whole prompt
  at once, at each chunk's last position.

Logits are compared at the last position of each run (so graphs exported with ``--logits last`` work too),
on real tokens only. The gates are the precision's: fp32 max |Δlogits| and top-1; reduced precisions mean KL
and top-5 (see kv_path_gates).
"""

from __future__ import annotations

import numpy as np

from gpt2onnx.artifact.contract import position_ids_for
from gpt2onnx.artifact.report import DiffStats, Figures, KlStats, KvPathCheck, KvPathReport
from gpt2onnx.verify.gates import apply_gates
from gpt2onnx.verify.lockstep import left_padded_batch
from gpt2onnx.verify.metrics import abs_diff, kl_divergence, top5_hits

CHECKS = {
    "past": "decode steps with a past vs the same positions recomputed without one",
    "batch": "a left-padded batch vs each row alone",
    "chunks": "a prompt fed in 3 chunks vs all at once",
}


def _run_sequence(decoder, ids: np.ndarray, mask: np.ndarray, splits: list[int], new_tokens: np.ndarray | None = None):
    """Run ids in chunks ending at ``splits`` (column indices, the last one = the width), then one decode step per
    column of ``new_tokens``; the last-position logits of each run, [runs, batch, vocab]."""
    batch = ids.shape[0]
    steps = 0 if new_tokens is None else new_tokens.shape[1]
    full_mask = decoder.prompt_mask(mask)
    past = decoder.empty_past(batch, capacity=full_mask.shape[1] + steps)
    offset = full_mask.shape[1] - mask.shape[1]  # dummy past slots (TensorRT)
    positions = position_ids_for(mask)
    out, start = [], 0
    for end in splits:
        logits, past = decoder.run(ids[:, start:end], full_mask[:, : offset + end], positions[:, start:end], past)
        out.append(logits[:, -1])
        start = end
    for step in range(steps):
        full_mask = np.concatenate([full_mask, np.ones((batch, 1), np.int64)], axis=1)
        step_positions = positions[:, -1:] + 1 + step
        logits, past = decoder.run(new_tokens[:, step : step + 1], full_mask, step_positions, past)
        out.append(logits[:, -1])
    return np.stack(out)


def _recomputed(decoder, ids: np.ndarray, mask: np.ndarray, ends: list[int]) -> np.ndarray:
    """The last-position logits of ids[:, :end] with an empty past, for each end: [len(ends), batch, vocab]."""
    return np.stack([_run_sequence(decoder, ids[:, :end], mask[:, :end], [end])[0] for end in ends])


def _measure(name: str, ours: np.ndarray, theirs: np.ndarray, gates: dict) -> KvPathCheck:
    """ours/theirs: [..., vocab] logits at the same real positions; theirs plays the reference."""
    ours = ours.reshape(-1, ours.shape[-1])
    theirs = theirs.reshape(-1, theirs.shape[-1])
    diff = abs_diff(ours, theirs)
    kl = kl_divergence(theirs, ours)
    measured = Figures(
        logits=DiffStats(float(diff.max())),
        top1_agreement=float((ours.argmax(-1) == theirs.argmax(-1)).mean()),
        top5_agreement=float(top5_hits(theirs, ours).mean()),
        kl=KlStats(float(kl.mean()), max=float(kl.max())),
        positions_compared=int(ours.shape[0]),
        nonfinite=int((~np.isfinite(ours)).sum()),
    )
    return KvPathCheck(name, CHECKS[name], measured, gates, tuple(apply_gates(measured, gates)))


def kv_path_gates(tolerances: dict) -> dict:
    """The precision's gates that apply to a model compared with itself (no present, no token runs). A reduced
    precision's top-1 share is left out: these checks compare a few positions (one per chunk or step), where one
    near-tie flipped by int8's per-call activation scales moves the share by a whole position (8 of 9 is 89 %)."""
    keep = ("logits", "top1", "top5", "kl_mean") if "logits" in tolerances else ("top5", "kl_mean")
    return {k: v for k, v in tolerances.items() if k in keep}


def check_kv_path(
    decoder,
    *,
    vocab_size: int,
    tolerances: dict,
    seed: int = 0,
    length: int = 12,
    steps: int = 4,
    text_ids: np.ndarray | None = None,
):
    """The three checks on one seeded left-padded batch of 3 (row 0 unpadded, the others padded differently):
    random token ids, or with ``text_ids`` (a tokenized text, as parity's cases use) stretches of that text
    from seeded offsets, the decode steps fed with the text's next tokens."""
    if decoder.capabilities.owns_loop:
        return KvPathReport(skipped=f"the {decoder.runtime} runtime owns its loop and cache: no past to check")
    length = max(4, min(length, (decoder.n_positions or 128) - steps - 1))
    ids, mask = left_padded_batch(vocab_size, batch=3, length=length, seed=seed)
    gates = kv_path_gates(tolerances)
    new = np.random.default_rng(seed + 1).integers(0, vocab_size, size=(3, steps))
    if text_ids is not None and len(text_ids) > length + steps:
        starts = np.random.default_rng(seed).integers(0, len(text_ids) - length - steps + 1, size=3)
        for row, start in enumerate(starts):
            real = int(mask[row].sum())  # the row's real tokens: a stretch of text, then its next tokens
            ids[row, length - real :] = text_ids[start : start + real]
            new[row] = text_ids[start + real : start + real + steps]

    # past: prompt + decode steps against each prefix recomputed without a past
    stepped = _run_sequence(decoder, ids, mask, [length], new)  # [1 + steps, batch, vocab]
    whole_ids = np.concatenate([ids, new], axis=1)
    whole_mask = np.concatenate([mask, np.ones_like(new)], axis=1)
    recomputed = _recomputed(decoder, whole_ids, whole_mask, [length + s for s in range(steps + 1)])
    checks = [_measure("past", stepped[1:], recomputed[1:], gates)]

    # batch: every row alone, unpadded, the same prompt and decode steps
    alone = []
    for row in range(3):
        real = ids[row, mask[row] > 0][None]
        alone.append(_run_sequence(decoder, real, np.ones_like(real), [real.shape[1]], new[row : row + 1])[:, 0])
    checks.append(_measure("batch", stepped, np.stack(alone, axis=1), gates))

    # chunks: the prompt in three uneven chunks against the whole prompt at once (each chunk end recomputed);
    # the first chunk reaches every row's first real token, so no chunk is all padding in any row
    first = int((mask == 0).sum(1).max()) + 1
    splits = sorted({first, (first + length) // 2, length})
    chunked = _run_sequence(decoder, ids, mask, splits)
    checks.append(_measure("chunks", chunked, _recomputed(decoder, ids, mask, splits), gates))
    return KvPathReport(checks=tuple(checks))
