"""Standard ops any ONNX runtime reads: layer_norm, gelu → LayerNormalization, Gelu (opset 20). Golden: 2L + 1
LayerNormalization, L Gelu."""

from gpt2onnx.profiles.profile import (
    LAYER_NORM,
    LAYER_NORM_OP,
    STANDARD_GELU,
    STANDARD_GELU_OPS,
    Golden,
    Profile,
)

PROFILE = Profile(
    name="portable",
    summary="standard LayerNormalization and Gelu (opset 20): any ONNX runtime",
    fusions=(LAYER_NORM, STANDARD_GELU),
    golden=(Golden("layer_norm", (LAYER_NORM_OP,), 2, 1), Golden("gelu", None)),
    gelu_ops=STANDARD_GELU_OPS,
    opset=20,
    marks=frozenset({("", "Gelu")}),
)
