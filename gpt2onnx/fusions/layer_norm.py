"""LayerNorm: the decomposed mean / variance / normalize / scale / shift subgraph → LayerNormalization (opset 17+).

Exporters below opset 17 (and some others) write LayerNorm out as
    (x - mean(x)) / sqrt(mean((x - mean(x))²) + ε) · γ + β
This rule puts it back together, keeping ε.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from gpt2onnx.fusions._common import constant_value


class LayerNormFusion(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, gamma, beta, axes1, axes2, two, epsilon):
        mean = op.ReduceMean(x, axes1, _allow_other_inputs=True, _allow_other_attributes=True)
        centered = op.Sub(x, mean)
        variance = op.ReduceMean(op.Pow(centered, two), axes2, _allow_other_inputs=True, _allow_other_attributes=True)
        normalized = op.Div(centered, op.Sqrt(op.Add(variance, epsilon)))
        return op.Add(op.Mul(normalized, gamma), beta)

    def check(self, context, x, gamma, two, epsilon, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if constant_value(two) != 2.0:
            return result.fail("the variance does not square the centered input", two)
        if constant_value(epsilon) is None:
            return result.fail("epsilon is not a constant", epsilon)
        if gamma.const_value is None or len(gamma.shape or ()) != 1:
            return result.fail("the scale is not a 1-D initializer", gamma)
        return result

    def rewrite(self, op, x, gamma, beta, epsilon, **_):
        return op.LayerNormalization(x, gamma, beta, axis=-1, epsilon=float(constant_value(epsilon)))


layer_norm_rule = LayerNormFusion.rule()
