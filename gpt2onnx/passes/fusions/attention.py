"""Attention with past: head split, concat with past K/V, scaled scores, additive mask, softmax, weighted sum,
head merge → one com.microsoft.MultiHeadAttention with past_key/past_value inputs and present outputs.

    q, k, v: [B, S, E] (the Split of the QKV projection)    past_key, past_value: [B, H, P, D]
    present_key = Concat(past_key, heads(k)); present_value = Concat(past_value, heads(v))
    y = Softmax(heads(q) · present_keyᵀ · scale + bias) · present_value → [B, S, E]

MultiHeadAttention keeps the projections as they are (MatMul + Add), takes the additive mask
[B, 1, S, P+S] that the graph builds once, and returns present_key / present_value under the contract's
names. The scale may be a Div by √D (our exporter), or a Mul of each side by D^-¼ (SDPA as optimum exports it).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from gpt2onnx.artifact.graph_tools import constant_value, static_dim


def _heads(op, x, shape):
    return op.Transpose(op.Reshape(x, shape, _allow_other_attributes=True), perm=[0, 2, 1, 3])


def _merge_heads(op, y, shape):
    return op.Reshape(op.Transpose(y, perm=[0, 2, 1, 3]), shape, _allow_other_attributes=True)


class _AttentionBase(pattern.RewriteRuleClassBase):
    def _scale(self, **bindings) -> float | None:
        raise NotImplementedError

    def check(self, context, q, past_key, past_value, **bindings) -> pattern.MatchResult:
        result = pattern.MatchResult()
        heads, head_dim = static_dim(past_key, 1), static_dim(past_key, 3)
        if heads is None or head_dim is None:
            return result.fail("past_key has no static [*, heads, *, head_dim] shape", past_key)
        if static_dim(past_value, 1) != heads or static_dim(past_value, 3) != head_dim:
            return result.fail("past_value does not have past_key's heads and head_dim", past_value)
        embed = static_dim(q, -1)
        if embed is not None and embed != heads * head_dim:
            return result.fail(f"the query width {embed} is not heads × head_dim = {heads * head_dim}", q)
        scale = self._scale(**bindings)
        if scale is None:
            return result.fail("the attention scale is not a constant", bindings.get("scale"))
        return result

    def _mask(self, op, attn_bias):
        return attn_bias

    def rewrite(self, op, q, k, v, past_key, past_value, attn_bias, **bindings):
        return op.MultiHeadAttention(
            q,
            k,
            v,
            None,  # bias: the projection keeps its own Add
            None,  # key_padding_mask: the additive mask below covers padding
            self._mask(op, attn_bias),
            past_key,
            past_value,
            num_heads=static_dim(past_key, 1),
            scale=self._scale(**bindings),
            _domain="com.microsoft",
            _outputs=3,
        )


class AttentionWithPastDivScale(_AttentionBase):
    """scores = (q · kᵀ) / c, as the TorchScript exporter writes our module."""

    def pattern(self, op, q, k, v, q_shape, k_shape, v_shape, out_shape, past_key, past_value, scale, attn_bias):
        present_key = op.Concat(past_key, _heads(op, k, k_shape), axis=2)
        present_value = op.Concat(past_value, _heads(op, v, v_shape), axis=2)
        scores = op.Div(op.MatMul(_heads(op, q, q_shape), op.Transpose(present_key, perm=[0, 1, 3, 2])), scale)
        probs = op.Softmax(op.Add(scores, attn_bias), axis=-1)
        return _merge_heads(op, op.MatMul(probs, present_value), out_shape), present_key, present_value

    def _scale(self, scale=None, **_):
        divisor = constant_value(scale)
        return None if not divisor else 1.0 / divisor


class AttentionWithPastSplitScale(_AttentionBase):
    """scores = (q · s) · (kᵀ · s), NaN-guarded softmax: torch's SDPA decomposition (optimum's export)."""

    def pattern(
        self, op, q, k, v, q_shape, k_shape, v_shape, out_shape, past_key, past_value, q_scale, k_scale, attn_bias, zero
    ):
        present_key = op.Concat(past_key, _heads(op, k, k_shape), axis=-2)
        present_value = op.Concat(past_value, _heads(op, v, v_shape), axis=-2)
        scores = op.MatMul(
            op.Mul(_heads(op, q, q_shape), q_scale), op.Mul(op.Transpose(present_key, perm=[0, 1, 3, 2]), k_scale)
        )
        probs = op.Softmax(op.Add(scores, attn_bias), axis=-1)
        probs = op.Where(op.IsNaN(probs), zero, probs)
        return _merge_heads(op, op.MatMul(probs, present_value), out_shape), present_key, present_value

    def _scale(self, q_scale=None, k_scale=None, **_):
        a, b = constant_value(q_scale), constant_value(k_scale)
        return None if a is None or b is None else a * b

    def _mask(self, op, attn_bias):
        # This export masks with -inf and turns the NaN of a fully masked (padding) row into 0 after the
        # softmax. MultiHeadAttention has no such guard, so -inf is clamped to the lowest finite value: padding
        # rows then average instead of returning 0, and no real token ever attends to them, so every real
        # logit is unchanged and no NaN can leak into the K/V cache.
        dtype = attn_bias.dtype.numpy() if attn_bias.dtype is not None else np.float32
        lowest = ir.tensor(np.array(np.finfo(dtype).min, dtype=dtype))
        return op.Max(attn_bias, op.Constant(value=lowest))


attention_div_rule = AttentionWithPastDivScale.rule()
attention_split_scale_rule = AttentionWithPastSplitScale.rule()


RULES = (attention_div_rule, attention_split_scale_rule)
