"""SkipLayerNorm: residual Add + LayerNormalization → com.microsoft.SkipLayerNormalization.

The fused op also returns the sum (its fourth output), which the next residual Add needs. When the Add's
other operand is a MatMul + bias Add (the attention or MLP projection), the bias is folded in too.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern


def _layer_norm(op, total, gamma, beta):
    return op.LayerNormalization(total, gamma, beta, _allow_other_attributes=True, _outputs=["normalized"])


def _attributes(normalized) -> dict:
    node = normalized.producer()
    if node.attributes.get_int("axis", -1) != -1:
        return {}
    return {"epsilon": node.attributes.get_float("epsilon", 1e-5)}


def _check(normalized, gamma, beta) -> pattern.MatchResult:
    result = pattern.MatchResult()
    if not _attributes(normalized):
        return result.fail("LayerNormalization does not normalize the last axis", normalized.producer())
    if beta is None or beta.const_value is None:
        return result.fail("LayerNormalization has no constant bias", normalized.producer())
    return result


class SkipLayerNormWithBias(pattern.RewriteRuleClassBase):
    def pattern(self, op, matmul, bias, skip, gamma, beta):
        total = op.Add(skip, op.Add(matmul, bias))
        return _layer_norm(op, total, gamma, beta), total

    def check(self, context, normalized, gamma, beta, matmul, bias, **_):
        result = _check(normalized, gamma, beta)
        if result and (matmul.producer() is None or matmul.producer().op_type != "MatMul"):
            return result.fail("the residual branch is not a MatMul + bias", matmul)
        if result and (bias.const_value is None or len(bias.shape or ()) != 1):
            return result.fail("the projection bias is not a 1-D initializer", bias)
        return result

    def rewrite(self, op, matmul, skip, gamma, beta, bias, normalized, **_):
        out, _, _, total = op.SkipLayerNormalization(
            matmul, skip, gamma, beta, bias, _domain="com.microsoft", _outputs=4, **_attributes(normalized)
        )
        return out, total


class SkipLayerNorm(pattern.RewriteRuleClassBase):
    def pattern(self, op, a, skip, gamma, beta):
        total = op.Add(a, skip)
        return _layer_norm(op, total, gamma, beta), total

    def check(self, context, normalized, gamma, beta, a, skip, **_):
        result = _check(normalized, gamma, beta)
        if result and (a.shape is not None and skip.shape is not None and len(a.shape) != len(skip.shape)):
            return result.fail("the residual operands do not have the same rank", a)
        return result

    def rewrite(self, op, a, skip, gamma, beta, normalized, **_):
        out, _, _, total = op.SkipLayerNormalization(
            a, skip, gamma, beta, _domain="com.microsoft", _outputs=4, **_attributes(normalized)
        )
        return out, total


class LayerNormBeforeReshape(pattern.RewriteRuleClassBase):
    """LayerNormalization(Reshape(x)) → Reshape(LayerNormalization(x)) where the reshape only merges the leading
    axes (x's last axis is the one normalized, of gamma's length): the same values, since LayerNorm works per
    row. Our exporter flattens [B, T, C] to [B*T, C] before ln_f (so that onnxruntime's own optimizer can run
    on the plain export); moved after ln_f, the final residual Add and ln_f fuse like every other pair."""

    def pattern(self, op, x, shape, gamma, beta):
        flat = op.Reshape(x, shape, _allow_other_attributes=True, _outputs=["flat"])
        return op.LayerNormalization(flat, gamma, beta, _allow_other_attributes=True, _outputs=["normalized"])

    def check(self, context, x, gamma, normalized, **_):
        result = pattern.MatchResult()
        if not _attributes(normalized):
            return result.fail("LayerNormalization does not normalize the last axis", normalized.producer())
        width = gamma.shape[0] if gamma.shape is not None and len(gamma.shape) == 1 else None
        if not isinstance(width, int) or x.shape is None or len(x.shape) < 2 or x.shape[-1] != width:
            return result.fail("the reshape may change the normalized axis", x)
        return result

    def rewrite(self, op, x, shape, gamma, beta, normalized, flat, **_):
        node = normalized.producer()
        stash = node.attributes.get_int("stash_type", 1)
        allowzero = flat.producer().attributes.get_int("allowzero", 0)
        out = op.LayerNormalization(x, gamma, beta, axis=-1, stash_type=stash, **_attributes(normalized))
        # typed like x (a LayerNorm keeps type and shape): the fp16 pass casts only tensors it has a type for
        out.type, out.shape = x.type, x.shape
        return op.Reshape(out, shape, allowzero=allowzero)


layer_norm_before_reshape_rule = LayerNormBeforeReshape.rule()
skip_layer_norm_with_bias_rule = SkipLayerNormWithBias.rule()
skip_layer_norm_rule = SkipLayerNorm.rule()


RULES = (layer_norm_before_reshape_rule, skip_layer_norm_with_bias_rule, skip_layer_norm_rule)
