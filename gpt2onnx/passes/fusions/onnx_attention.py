"""Attention with past → one standard ai.onnx ``Attention`` (opset 23) with past_key/past_value inputs and
present_key/present_value outputs: the same subgraph the ``attention`` fusion matches (attention.py), written
in the standard domain instead of com.microsoft.

    Attention(q, k, v, attn_mask = bias, past_key, past_value) → (y, present_key, present_value)
    q, k, v: [B, S, E] (3-D: q_num_heads = kv_num_heads = H)      past_key, past_value: [B, H, P, D]
    bias: the additive [B, 1, S, P + S] mask (causal and left padding) the graph builds once for every layer
    y: [B, S, E], present_* = Concat(past_*, heads(k or v)) on the sequence axis, scale: the layer's own

is_causal stays 0: the graph's mask already holds the causal part, aligned to the end of the past (the spec's
own causal mask is aligned to the upper left, which is not what a decode step with a past needs). The -inf of
the SDPA form (optimum's export) is clamped to the lowest finite value, as for MultiHeadAttention: onnxruntime's
CPU kernel has no NaN guard either.
"""

from __future__ import annotations

from gpt2onnx.artifact.graph_tools import static_dim
from gpt2onnx.passes.fusions.attention import AttentionWithPastDivScale, AttentionWithPastSplitScale


class _StandardAttention:
    """The rewrite of an attention rule into ai.onnx Attention (mixed into the rules of attention.py, which keep
    their patterns and checks)."""

    def rewrite(self, op, q, k, v, past_key, past_value, attn_bias, **bindings):
        heads = static_dim(past_key, 1)
        return op.Attention(
            q,
            k,
            v,
            self._mask(op, attn_bias),
            past_key,
            past_value,
            q_num_heads=heads,
            kv_num_heads=heads,
            scale=self._scale(**bindings),
            _outputs=3,
        )


class OnnxAttentionDivScale(_StandardAttention, AttentionWithPastDivScale):
    """scores = (q · kᵀ) / c (our exporter) → Attention."""


class OnnxAttentionSplitScale(_StandardAttention, AttentionWithPastSplitScale):
    """torch's SDPA decomposition (optimum's export) → Attention, -inf clamped."""


onnx_attention_div_rule = OnnxAttentionDivScale.rule()
onnx_attention_split_scale_rule = OnnxAttentionSplitScale.rule()


RULES = (onnx_attention_div_rule, onnx_attention_split_scale_rule)
