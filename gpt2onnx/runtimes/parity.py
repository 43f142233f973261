"""Parity with the PyTorch reference: the ONNX chain and transformers' chain run side by side on the same
left-padded batch, prompt with empty past then decode steps, and their logits and presents are compared."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from gpt2onnx.reference import cache_as_arrays, reference_step
from gpt2onnx.runtimes.decoder import OnnxDecoder, position_ids_for


@dataclass
class ParityResult:
    max_abs_logits: float
    max_abs_present: float
    tolerance: float
    batch: int
    prompt_length: int
    decode_steps: int

    @property
    def passed(self) -> bool:
        return bool(self.max_abs_logits <= self.tolerance and self.max_abs_present <= self.tolerance)

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


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


def _max_diff(a: np.ndarray, b: np.ndarray, rows: np.ndarray | None = None) -> float:
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    if rows is not None:
        diff = diff[rows]
    return float(diff.max()) if diff.size else 0.0


def _max_diff_kv(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    """K/V compared on real positions only: a padding slot's K/V is never attended to, and implementations
    legitimately differ there (what a query that may see nothing returns is a convention)."""
    real = np.broadcast_to(mask[:, None, :, None].astype(bool), a.shape)
    return _max_diff(a, b, real)


def compare_decoder(
    decoder: OnnxDecoder,
    reference,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    *,
    decode_steps: int,
    tolerance: float,
    last_logits_only: bool = False,
) -> ParityResult:
    """Prompt (empty past) then ``decode_steps`` greedy steps (the reference's tokens feed both chains);
    logits compared on real (unpadded) positions, presents everywhere."""
    mask = attention_mask.astype(np.int64)
    positions = position_ids_for(mask)
    ref_logits, ref_past = reference_step(reference, input_ids, mask, positions)
    logits, past = decoder.step(input_ids, mask, positions, decoder.empty_past(input_ids.shape[0]))
    worst_logits = worst_present = 0.0
    for step in range(decode_steps + 1):
        if last_logits_only:
            worst_logits = max(worst_logits, _max_diff(logits[:, -1], ref_logits[:, -1]))
        else:
            real = mask[:, -logits.shape[1] :].astype(bool)
            worst_logits = max(worst_logits, _max_diff(logits, ref_logits, real))
        for ours, theirs in zip(past, cache_as_arrays(ref_past)):
            worst_present = max(worst_present, _max_diff_kv(ours, theirs, mask))
        if step == decode_steps:
            break
        next_ids = ref_logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones_like(next_ids)], axis=1)
        positions = position_ids_for(mask)[:, -1:]
        ref_logits, ref_past = reference_step(reference, next_ids, mask, positions, ref_past)
        logits, past = decoder.step(next_ids, mask, positions, past)
    return ParityResult(
        worst_logits, worst_present, tolerance, int(input_ids.shape[0]), int(input_ids.shape[1]), decode_steps
    )


def compare_block(
    session, reference, block_index: int, input_ids, attention_mask, *, decode_steps: int, tolerance: float
) -> ParityResult:
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
        for step in range(decode_steps + 1):
            ref_logits, ref_past = reference_step(reference, ids, mask, positions, ref_past)
            hidden_in, hidden_out = (captured[k].detach().numpy() for k in ("in", "out"))
            out, key, value = session.run(
                None, {"hidden_states": hidden_in, "attention_mask": mask, "past_key": past[0], "past_value": past[1]}
            )
            real = mask[:, -ids.shape[1] :].astype(bool)
            worst_hidden = max(worst_hidden, _max_diff(out, hidden_out, real))
            ref_kv = cache_as_arrays(ref_past)[2 * block_index : 2 * block_index + 2]
            worst_present = max(worst_present, _max_diff_kv(key, ref_kv[0], mask), _max_diff_kv(value, ref_kv[1], mask))
            past = [key, value]
            ids = ref_logits[:, -1].argmax(-1)[:, None].astype(np.int64)
            mask = np.concatenate([mask, np.ones_like(ids)], axis=1)
            positions = position_ids_for(mask)[:, -1:]
    finally:
        pre.remove()
        post.remove()
    return ParityResult(
        worst_hidden, worst_present, tolerance, int(input_ids.shape[0]), int(input_ids.shape[1]), decode_steps
    )


def reference_greedy(reference, input_ids: np.ndarray, attention_mask: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """transformers' own generate(), greedy: [batch, max_new_tokens] new token ids."""
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
