"""GELU, tanh form: 0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³))).

ort profile: → com.microsoft.FastGelu, with the bias of the MatMul + Add that feeds it folded in.
portable profile: → Gelu(approximate="tanh") (opset 20).
"""

from __future__ import annotations

import math

from onnxscript.rewriter import pattern

from gpt2onnx.artifact.graph_tools import constant_value

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _tanh_gelu(op, x, half, cube, coeff, sqrt_2_over_pi, one):
    inner = op.Mul(op.Add(x, op.Mul(op.Pow(x, cube), coeff)), sqrt_2_over_pi)
    return op.Mul(op.Mul(x, half), op.Add(op.Tanh(inner), one))


def _check_constants(half, cube, coeff, sqrt_2_over_pi, one) -> pattern.MatchResult:
    result = pattern.MatchResult()
    expected = {
        "0.5": (half, 0.5),
        "3": (cube, 3.0),
        "0.044715": (coeff, 0.044715),
        "√(2/π)": (sqrt_2_over_pi, _SQRT_2_OVER_PI),
        "1": (one, 1.0),
    }
    for label, (value, target) in expected.items():
        found = constant_value(value)
        if found is None or not math.isclose(found, target, rel_tol=1e-5):
            return result.fail(f"constant {label} of the tanh GELU is {found}", value)
    return result


class FastGeluWithBias(pattern.RewriteRuleClassBase):
    """MatMul + bias Add + tanh GELU → MatMul + FastGelu(x, bias)."""

    def pattern(self, op, matmul, bias, half, cube, coeff, sqrt_2_over_pi, one):
        x = op.Add(matmul, bias)
        return _tanh_gelu(op, x, half, cube, coeff, sqrt_2_over_pi, one)

    def check(self, context, matmul, bias, half, cube, coeff, sqrt_2_over_pi, one, **_):
        result = _check_constants(half, cube, coeff, sqrt_2_over_pi, one)
        if result and (matmul.producer() is None or matmul.producer().op_type != "MatMul"):
            return result.fail("the GELU input is not a MatMul + bias", matmul)
        if result and (bias.const_value is None or len(bias.shape or ()) != 1):
            return result.fail("the bias is not a 1-D initializer", bias)
        return result

    def rewrite(self, op, matmul, bias, **_):
        return op.FastGelu(matmul, bias, _domain="com.microsoft")


class FastGelu(pattern.RewriteRuleClassBase):
    """tanh GELU without a foldable bias → FastGelu(x)."""

    def pattern(self, op, x, half, cube, coeff, sqrt_2_over_pi, one):
        return _tanh_gelu(op, x, half, cube, coeff, sqrt_2_over_pi, one)

    def check(self, context, half, cube, coeff, sqrt_2_over_pi, one, **_):
        return _check_constants(half, cube, coeff, sqrt_2_over_pi, one)

    def rewrite(self, op, x, **_):
        return op.FastGelu(x, _domain="com.microsoft")


class StandardGelu(FastGelu):
    """tanh GELU → the standard Gelu(approximate="tanh") of opset 20."""

    def rewrite(self, op, x, **_):
        return op.Gelu(x, approximate="tanh")


fast_gelu_with_bias_rule = FastGeluWithBias.rule()
fast_gelu_rule = FastGelu.rule()
standard_gelu_rule = StandardGelu.rule()


# GELU, exact (erf) form: 0.5 · x · (1 + erf(x / √2)) (transformers' "gelu": Cerebras-GPT).
# ort profile: → com.microsoft.Gelu; portable: → the standard Gelu (approximate="none", opset 20).
_SQRT_2 = math.sqrt(2.0)


class ErfGelu(pattern.RewriteRuleClassBase):
    """exact GELU → com.microsoft.Gelu(x)."""

    def pattern(self, op, x, half, sqrt_2, one):
        return op.Mul(op.Mul(x, half), op.Add(op.Erf(op.Div(x, sqrt_2)), one))

    def check(self, context, half, sqrt_2, one, **_):
        result = pattern.MatchResult()
        for label, (value, target) in {"0.5": (half, 0.5), "√2": (sqrt_2, _SQRT_2), "1": (one, 1.0)}.items():
            found = constant_value(value)
            if found is None or not math.isclose(found, target, rel_tol=1e-5):
                return result.fail(f"constant {label} of the exact GELU is {found}", value)
        return result

    def rewrite(self, op, x, **_):
        return op.Gelu(x, _domain="com.microsoft")


class StandardErfGelu(ErfGelu):
    """exact GELU → the standard Gelu (approximate="none") of opset 20."""

    def rewrite(self, op, x, **_):
        return op.Gelu(x)


# quick GELU: x · sigmoid(1.702 · x) (transformers' "quick_gelu") → com.microsoft.QuickGelu(alpha=1.702).
QUICK_GELU_ALPHA = 1.702


class QuickGelu(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, alpha):
        return op.Mul(x, op.Sigmoid(op.Mul(x, alpha)))

    def check(self, context, alpha, **_):
        found = constant_value(alpha)
        if found is None or not math.isclose(found, QUICK_GELU_ALPHA, rel_tol=1e-5):
            return pattern.MatchResult().fail(f"the quick GELU's factor is {found}, not {QUICK_GELU_ALPHA}", alpha)
        return pattern.MatchResult()

    def rewrite(self, op, x, alpha, **_):
        return op.QuickGelu(x, alpha=constant_value(alpha), _domain="com.microsoft")


erf_gelu_rule = ErfGelu.rule()
standard_erf_gelu_rule = StandardErfGelu.rule()
quick_gelu_rule = QuickGelu.rule()


FAST_GELU_RULES = (fast_gelu_with_bias_rule, fast_gelu_rule, erf_gelu_rule, quick_gelu_rule)
STANDARD_GELU_RULES = (standard_gelu_rule, standard_erf_gelu_rule)
