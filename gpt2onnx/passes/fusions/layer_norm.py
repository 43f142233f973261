"""LayerNorm: the decomposed mean / variance / normalize / scale / shift subgraph → LayerNormalization (opset 17+).

Exporters below opset 17 (and some others) write LayerNorm out as
    (x - mean(x)) / sqrt(mean((x - mean(x))²) + ε) · γ + β
over the last axis. This rule puts it back together, keeping ε.
"""

from __future__ import annotations

import numpy as np
from onnxscript.rewriter import pattern

from gpt2onnx.artifact.graph_tools import constant_value


def _reduces_last_axis(mean_value, rank: int | None) -> bool:
    node = mean_value.producer()
    axes = node.attributes.get_ints("axes", None)
    if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None and node.inputs[1].const_value is not None:
        axes = [int(a) for a in np.atleast_1d(node.inputs[1].const_value.numpy())]
    if axes is None or len(axes) != 1:
        return False
    return axes[0] == -1 or (rank is not None and axes[0] == rank - 1)


class LayerNormFusion(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, gamma, beta, two, epsilon):
        mean = op.ReduceMean(x, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["mean"])
        centered = op.Sub(x, mean)
        variance = op.ReduceMean(
            op.Pow(centered, two), _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["variance"]
        )
        normalized = op.Div(centered, op.Sqrt(op.Add(variance, epsilon)))
        return op.Add(op.Mul(normalized, gamma), beta)

    def check(self, context, x, mean, variance, gamma, two, epsilon, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        rank = len(x.shape) if x.shape is not None else None
        if not (_reduces_last_axis(mean, rank) and _reduces_last_axis(variance, rank)):
            return result.fail("the means are not taken over the last axis", mean)
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


RULES = (layer_norm_rule,)
