"""The ONNX chain and a reference chain side by side on the same left-padded batches (an optional earlier chunk
as past, a prompt chunk, decode steps fed by the reference's greedy tokens, then free greedy generation on both
sides), and their outputs compared. The reference is transformers' GPT2LMHeadModel, or another ONNX decoder
(:class:`OnnxReference`, for optimize's check of a rewritten graph against its source)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from gpt2onnx.artifact.contract import position_ids_for
from gpt2onnx.artifact.report import CheckReport, DiffStats, Figures
from gpt2onnx.decoding.generate import decode
from gpt2onnx.machine import describe_machine
from gpt2onnx.precisions.all_precisions import FP32
from gpt2onnx.pytorch.reference import cache_as_arrays, reference_step
from gpt2onnx.records import Record, field
from gpt2onnx.runtimes.decoder import OnnxDecoder
from gpt2onnx.verify.gates import apply_gates
from gpt2onnx.verify.metrics import (
    Diffs,
    abs_diff,
    information,
    kl_divergence,
    relative_error,
    tokens_before_divergence,
    top5_hits,
)


def greedy(decoder: OnnxDecoder, input_ids: np.ndarray, attention_mask: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """Greedy continuation of a left-padded batch: [batch, max_new_tokens] new token ids."""
    return decode(decoder, input_ids, attention_mask, max_new_tokens=max_new_tokens).tokens


def _fixed_batch_report(worst_logits, worst_present, tolerance, shape, decode_steps, *, against) -> CheckReport:
    measured = Figures(
        logits=DiffStats(worst_logits),
        present=DiffStats(worst_present),
        batch=int(shape[0]),
        prompt_length=int(shape[1]),
        decode_steps=decode_steps,
    )
    gates = {"logits": tolerance, "present": tolerance}
    # export and optimize validate on the cpu provider (compare_decoder, compare_block)
    return CheckReport(
        FP32.name, against, gates, measured, tuple(apply_gates(measured, gates)), machine=describe_machine()
    )


@dataclass(frozen=True)
class Case(Record):
    batch: int
    prefix_length: int  # tokens run first with an empty past, so the prompt step starts with a real past
    prompt_length: int
    decode_steps: int
    generate_tokens: int
    seed: int


@dataclass(frozen=True)
class CaseResult(Record):
    """One case of a lockstep check; written per case into a parity report's cases (its samples are not)."""

    case: Case
    logits: dict[str, float]  # max, p50, p99 of |Δlogits| on real positions
    present: dict[str, float]  # max, p50, p99 of |Δpresent| on real positions
    top1_agreement: float
    positions_compared: int
    nonfinite: int
    tokens_equal: bool
    top5_agreement: float = 1.0  # share of positions where the reference's top-1 is in our top-5
    # KL(reference ‖ ours) of the next-token distributions: mean, max
    kl: dict[str, float] = field(default_factory=dict)
    tokens_before_divergence: int = 0  # greedy tokens generated before the first one that differs (min over rows)
    # subsampled |Δ| values (arrays), for pooled percentiles: kept in memory, never written
    samples: dict = field(default_factory=dict, repr=False, compare=False, omit=lambda result: True)
    # ‖Δlogits‖ / ‖logits − mean‖ per position: mean, max
    relative_error: dict[str, float] = field(default_factory=dict)
    reference_information: float | None = None  # the reference's ln V − entropy, nats, mean over positions


def left_padded_batch(vocab_size: int, *, batch: int, length: int, seed: int = 0):
    """Random prompts of different lengths per row, left-padded to ``length`` (row 0 unpadded)."""
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, vocab_size, size=(batch, length), dtype=np.int64)
    attention_mask = np.ones((batch, length), dtype=np.int64)
    for row in range(1, batch):
        pad = int(rng.integers(1, max(2, length // 2 + 1)))
        attention_mask[row, :pad] = 0
        input_ids[row, :pad] = 0
    return input_ids, attention_mask


def random_cases(count: int, *, seed: int, n_positions: int, max_batch: int = 8) -> list[Case]:
    """Batches 1–max_batch, prompts of several lengths, past 0 or longer, a few decode steps, a greedy run."""
    rng = np.random.default_rng(seed)
    budget = min(n_positions, 96)
    cases = []
    for i in range(count):
        generate_tokens = int(rng.integers(2, 9))
        decode_steps = int(rng.integers(1, 5))
        room = budget - max(generate_tokens, decode_steps)
        prompt_length = int(rng.integers(1, max(2, min(32, room // 2) + 1)))
        prefix_length = 0 if i % 2 == 0 else int(rng.integers(1, max(2, room - prompt_length + 1)))
        cases.append(
            Case(
                int(rng.integers(1, max_batch + 1)),
                prefix_length,
                prompt_length,
                decode_steps,
                generate_tokens,
                seed * 100_003 + i,
            )
        )
    return cases


def _case_batch(case: Case, vocab_size: int, text_ids: np.ndarray | None = None):
    """ids and mask of prefix + prompt, each row left-padded differently (row 0 unpadded). The ids are random,
    or with ``text_ids`` (a tokenized text) each row is a stretch of that text from a seeded offset."""
    total = case.prefix_length + case.prompt_length
    rng = np.random.default_rng(case.seed)
    if text_ids is None:
        ids = rng.integers(0, vocab_size, size=(case.batch, total), dtype=np.int64)
    else:
        starts = rng.integers(0, len(text_ids) - total + 1, size=case.batch)
        ids = np.stack([text_ids[s : s + total] for s in starts]).astype(np.int64)
    mask = np.ones_like(ids)
    for row in range(1, case.batch):
        pad = int(rng.integers(0, total))  # at least one real token per row
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


@dataclass
class _Step:
    """One step of both chains: ours (ONNX) and the reference's outputs, and which positions are real."""

    logits: np.ndarray
    ref_logits: np.ndarray
    presents: list[np.ndarray]  # dummy past slots (TensorRT) already removed
    ref_presents: list[np.ndarray]
    real_queries: np.ndarray  # [batch, step length] bool
    real_keys: np.ndarray  # [batch, 1, total length, 1] bool, broadcastable over K/V

    def aligned_logits(self):
        """(ours, reference, real) on the positions the ONNX graph returns: all of them, or the last only
        for an export with --logits last."""
        n = self.logits.shape[1]
        return self.logits, self.ref_logits[:, -n:], self.real_queries[:, -n:]


def _lockstep(decoder: OnnxDecoder, reference, ids: np.ndarray, mask: np.ndarray, *, chunks, decode_steps: int):
    """Run the ONNX chain and the reference side by side: the prompt in ``chunks`` (the first with an empty
    past, later ones on the past the earlier built), then ``decode_steps`` steps fed with the reference's greedy
    tokens. Yields a _Step after every forward pass."""
    past, ref_past = decoder.empty_past(ids.shape[0], capacity=decoder.dummy_past + ids.shape[1] + decode_steps), None

    def both(step_ids, step_mask, positions):
        nonlocal past, ref_past
        ref_logits, ref_past = reference_step(reference, step_ids, step_mask, positions, ref_past)
        logits, past = decoder.step(step_ids, decoder.prompt_mask(step_mask), positions, past)
        return _Step(
            logits,
            ref_logits,
            [p[:, :, decoder.dummy_past :] for p in past],
            cache_as_arrays(ref_past),
            step_mask[:, -step_ids.shape[1] :].astype(bool),
            step_mask.astype(bool)[:, None, :, None],
        )

    for start, end in chunks:
        step_mask = mask[:, :end]
        step = both(ids[:, start:end], step_mask, position_ids_for(step_mask)[:, start:end])
        yield step
    step_mask = mask
    for _ in range(decode_steps):
        step_ids = step.ref_logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        step_mask = np.concatenate([step_mask, np.ones_like(step_ids)], axis=1)
        step = both(step_ids, step_mask, position_ids_for(step_mask)[:, -1:])
        yield step


def _kv_diffs(step: _Step):
    for ours, theirs in zip(step.presents, step.ref_presents):
        yield ours, abs_diff(ours, theirs)[np.broadcast_to(step.real_keys, ours.shape)]


def run_case(
    decoder: OnnxDecoder, reference, case: Case, *, vocab_size: int, text_ids: np.ndarray | None = None
) -> CaseResult:
    ids, mask = _case_batch(case, vocab_size, text_ids)
    rng = np.random.default_rng(case.seed + 1)
    logit_diffs, present_diffs = Diffs(rng), Diffs(rng)
    agree = top5 = compared = nonfinite = 0
    kls: list[np.ndarray] = []
    relative: list[np.ndarray] = []
    informed: list[np.ndarray] = []
    total = case.prefix_length + case.prompt_length
    chunks = [(0, case.prefix_length), (case.prefix_length, total)] if case.prefix_length else [(0, total)]
    for step in _lockstep(decoder, reference, ids, mask, chunks=chunks, decode_steps=case.decode_steps):
        logits, ref_logits, real = step.aligned_logits()
        nonfinite += int((~np.isfinite(logits)).sum())
        logit_diffs.add(abs_diff(logits, ref_logits)[real])
        agree += int((logits.argmax(-1) == ref_logits.argmax(-1))[real].sum())
        top5 += int(top5_hits(ref_logits, logits)[real].sum())
        kls.append(kl_divergence(ref_logits, logits)[real])
        relative.append(relative_error(ref_logits, logits)[real])
        informed.append(information(ref_logits)[real])
        compared += int(real.sum())
        for ours, diff in _kv_diffs(step):
            nonfinite += int((~np.isfinite(ours)).sum())
            present_diffs.add(diff)
    ours = greedy(decoder, ids, mask, case.generate_tokens)
    theirs = reference_greedy(reference, ids, mask, case.generate_tokens)
    logits_stats, logits_sample = logit_diffs.summary()
    present_stats, present_sample = present_diffs.summary()
    return CaseResult(
        case,
        logits_stats,
        present_stats,
        agree / max(compared, 1),
        compared,
        nonfinite,
        bool(np.array_equal(ours, theirs)),
        top5 / max(compared, 1),
        {"mean": float(np.concatenate(kls).mean()), "max": float(np.concatenate(kls).max())},
        tokens_before_divergence(ours, theirs),
        {"logits": logits_sample, "present": present_sample},
        _mean_max(relative),
        _mean_max(informed)["mean"],
    )


def _mean_max(values: list[np.ndarray]) -> dict:
    joined = np.concatenate(values) if values else np.zeros(1)
    return {"mean": float(joined.mean()), "max": float(joined.max())}


def run_loop_case(runner, reference, case: Case, *, vocab_size: int, text_ids: np.ndarray | None = None) -> CaseResult:
    """A case on a runtime that owns its loop (genai): one row, the prefix run as part of the prompt (the loop
    starts from an empty cache). The reference's greedy tokens are forced into the loop one step at a time, so
    the logits of the prompt and of every decode step are compared; then both run free greedy generation.
    No presents are exposed: the case has logits, KL, top-k and tokens only."""
    ids, mask = _case_batch(case, vocab_size, text_ids)
    ids, mask = ids[:1], mask[:1]  # row 0 is unpadded
    ref_steps, forced, ref_past, step_ids, step_mask = [], [], None, ids, mask
    for step in range(case.decode_steps + 1):
        positions = position_ids_for(step_mask)[:, -step_ids.shape[1] :]
        ref_logits, ref_past = reference_step(reference, step_ids, step_mask, positions, ref_past)
        ref_steps.append(ref_logits)
        if step < case.decode_steps:
            step_ids = ref_logits[:, -1].argmax(-1)[:, None].astype(np.int64)
            forced.append(int(step_ids[0, 0]))
            step_mask = np.concatenate([step_mask, np.ones_like(step_ids)], axis=1)
    ours_steps = runner.run_loop(ids[0].tolist(), max_new_tokens=0, forced=forced, return_logits=True).logits
    rng = np.random.default_rng(case.seed + 1)
    logit_diffs = Diffs(rng)
    agree = top5 = compared = nonfinite = 0
    kls, relative, informed = [], [], []
    for ours, ref_logits in zip(ours_steps, ref_steps):
        logits = ours[None]
        ref_logits = ref_logits[:, -logits.shape[1] :]  # --logits last: the last position only
        nonfinite += int((~np.isfinite(logits)).sum())
        logit_diffs.add(abs_diff(logits, ref_logits).ravel())
        agree += int((logits.argmax(-1) == ref_logits.argmax(-1)).sum())
        top5 += int(top5_hits(ref_logits, logits).sum())
        kls.append(kl_divergence(ref_logits, logits).ravel())
        relative.append(relative_error(ref_logits, logits).ravel())
        informed.append(information(ref_logits).ravel())
        compared += logits.shape[1]
    if len(ours_steps) != len(ref_steps):
        nonfinite += 1  # a missing step cannot pass: the loop stopped early
    ours = np.array([runner.run_loop(ids[0].tolist(), max_new_tokens=case.generate_tokens).tokens], dtype=np.int64)
    theirs = reference_greedy(reference, ids, mask, case.generate_tokens)
    # the loop stops at end-of-sequence (the reference does not): equal means equal up to where it stopped
    theirs_cut = theirs[:, : ours.shape[1]]
    logits_stats, logits_sample = logit_diffs.summary()
    kl = np.concatenate(kls)
    return CaseResult(
        dataclasses.replace(case, batch=1),
        logits_stats,
        {},
        agree / max(compared, 1),
        compared,
        nonfinite,
        bool(ours.shape[1] > 0 and np.array_equal(ours, theirs_cut)),
        top5 / max(compared, 1),
        {"mean": float(kl.mean()), "max": float(kl.max())},
        tokens_before_divergence(ours, theirs_cut),
        {"logits": logits_sample, "present": np.zeros(0, np.float32)},
        _mean_max(relative),
        _mean_max(informed)["mean"],
    )


def compare_decoder(
    decoder: OnnxDecoder,
    reference,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    *,
    decode_steps: int,
    tolerance: float,
    against: str = "PyTorch",
) -> CheckReport:
    """Prompt (empty past) then ``decode_steps`` greedy steps (the reference's tokens feed both chains);
    logits compared on the real (unpadded) positions the graph returns, presents on real positions."""
    mask = attention_mask.astype(np.int64)
    worst_logits = worst_present = 0.0
    steps = _lockstep(decoder, reference, input_ids, mask, chunks=[(0, input_ids.shape[1])], decode_steps=decode_steps)
    for step in steps:
        logits, ref_logits, real = step.aligned_logits()
        worst_logits = max(worst_logits, float(abs_diff(logits, ref_logits)[real].max()))
        for _, kv_diff in _kv_diffs(step):
            worst_present = max(worst_present, float(kv_diff.max()))
    return _fixed_batch_report(worst_logits, worst_present, tolerance, input_ids.shape, decode_steps, against=against)


def compare_block(
    session, reference, block_index: int, input_ids, attention_mask, *, decode_steps: int, tolerance: float
) -> CheckReport:
    """Feed the single-block graph the hidden states transformers' block ``block_index`` received, and compare
    what it returns with what that block returned (hidden states on real positions, and its cache)."""
    block = reference.transformer.h[block_index]
    captured = {}
    pre = block.register_forward_pre_hook(
        lambda m, args, kwargs: captured.__setitem__("in", args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True,
    )
    post = block.register_forward_hook(
        lambda m, args, out: captured.__setitem__("out", out[0] if isinstance(out, tuple) else out)
    )
    try:
        mask = attention_mask.astype(np.int64)
        n_head, head_dim = reference.config.n_head, reference.config.n_embd // reference.config.n_head
        past = [np.zeros((input_ids.shape[0], n_head, 0, head_dim), np.float32)] * 2
        ids, positions = input_ids, position_ids_for(mask)
        ref_past, worst_hidden, worst_present = None, 0.0, 0.0
        for _ in range(decode_steps + 1):
            ref_logits, ref_past = reference_step(reference, ids, mask, positions, ref_past)
            hidden_in, hidden_out = (captured[k].detach().numpy() for k in ("in", "out"))
            out, key, value = session.run(
                None, {"hidden_states": hidden_in, "attention_mask": mask, "past_key": past[0], "past_value": past[1]}
            )
            real = mask[:, -ids.shape[1] :].astype(bool)
            worst_hidden = max(worst_hidden, float(abs_diff(out, hidden_out)[real].max()))
            kv_real = mask.astype(bool)[:, None, :, None]
            ref_kv = cache_as_arrays(ref_past)[2 * block_index : 2 * block_index + 2]
            for ours, theirs in ((key, ref_kv[0]), (value, ref_kv[1])):
                worst_present = max(
                    worst_present, float(abs_diff(ours, theirs)[np.broadcast_to(kv_real, ours.shape)].max())
                )
            past = [key, value]
            ids = ref_logits[:, -1].argmax(-1)[:, None].astype(np.int64)
            mask = np.concatenate([mask, np.ones_like(ids)], axis=1)
            positions = position_ids_for(mask)[:, -1:]
    finally:
        pre.remove()
        post.remove()
    return _fixed_batch_report(
        worst_hidden, worst_present, tolerance, input_ids.shape, decode_steps, against="PyTorch (its block)"
    )


def reference_greedy(reference, input_ids: np.ndarray, attention_mask: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """transformers' own generate(), greedy: [batch, max_new_tokens] new token ids."""
    if isinstance(reference, OnnxReference):
        return greedy(reference.decoder, input_ids, attention_mask, max_new_tokens)
    with torch.no_grad():
        out = reference.generate(
            input_ids=torch.as_tensor(input_ids),
            attention_mask=torch.as_tensor(attention_mask),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,  # no early stop: the same number of tokens for every row
            pad_token_id=0,
        )
    return out[:, input_ids.shape[1] :].numpy()


class OnnxReference:
    """An ONNX decoder behind the reference model's interface, to check a rewritten graph against its source
    (gpt2onnx optimize) with the same comparison code that checks exports against PyTorch."""

    def __init__(self, decoder: OnnxDecoder):
        self.decoder = decoder

    def __call__(self, *, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=True):
        from types import SimpleNamespace

        batch = input_ids.shape[0]
        past = (
            self.decoder.empty_past(batch)
            if past_key_values is None
            else [t.numpy() for pair in past_key_values for t in pair]
        )
        logits, presents = self.decoder.step(input_ids.numpy(), attention_mask.numpy(), position_ids.numpy(), past)
        pairs = [(torch.from_numpy(presents[i]), torch.from_numpy(presents[i + 1])) for i in range(0, len(presents), 2)]
        return SimpleNamespace(logits=torch.from_numpy(logits), past_key_values=pairs)
