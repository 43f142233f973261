"""Standard ONNX attention: layer_norm, attention, gelu → LayerNormalization, Attention (opset 23, past and present
K/V), Gelu; no com.microsoft op. Golden: L Attention, 2L + 1 LayerNormalization, L Gelu.

Its need: onnxruntime 1.31's CPU Attention computes an fp16 graph's scores in fp16, so an architecture whose
attention scores are fp32 (reorder_and_upcast_attn) cannot be fp16 in it (docs/precision.md)."""

from gpt2onnx.capabilities import Need
from gpt2onnx.profiles.profile import (
    LAYER_NORM,
    LAYER_NORM_OP,
    ONNX_ATTENTION,
    STANDARD_GELU,
    STANDARD_GELU_OPS,
    Golden,
    Profile,
)

ATTENTION_OPSET = 23  # the first opset with Attention; onnxruntime 1.31's CPU provider has kernels for 23 and 24

PROFILE = Profile(
    name="onnx",
    summary="standard Attention with past K/V (opset 23), LayerNormalization, Gelu: no com.microsoft op",
    fusions=(LAYER_NORM, ONNX_ATTENTION, STANDARD_GELU),
    golden=(
        Golden("attention", (("", "Attention"),)),
        Golden("gelu", None),
        Golden("layer_norm", (LAYER_NORM_OP,), 2, 1),
    ),
    gelu_ops=STANDARD_GELU_OPS,
    opset=ATTENTION_OPSET,
    marks=frozenset({("", "Attention")}),
    requires=(
        Need(
            "upcast_attention",
            allowed={False},
            when={"activations": "float16"},
            why="computes fp16 attention scores in fp16 (onnxruntime's standard Attention)",
        ),
    ),
)
