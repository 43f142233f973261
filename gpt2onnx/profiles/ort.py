"""onnxruntime's contrib ops: layer_norm, attention, gelu, skip_layer_norm → MultiHeadAttention, FastGelu,
SkipLayerNormalization (com.microsoft). Golden for n_layer = L: L attention, L GELU, 2L + 1 LayerNorm-type."""

from gpt2onnx.profiles.profile import (
    ATTENTION,
    CONTRIB_GELU_OPS,
    FAST_GELU,
    LAYER_NORM,
    LAYER_NORM_OP,
    MS,
    SKIP_LAYER_NORM,
    SKIP_LAYER_NORM_OP,
    Golden,
    Profile,
)

PROFILE = Profile(
    name="ort",
    summary="com.microsoft MultiHeadAttention, FastGelu, SkipLayerNormalization: onnxruntime's fused kernels",
    fusions=(LAYER_NORM, ATTENTION, FAST_GELU, SKIP_LAYER_NORM),
    golden=(
        Golden("attention", ((MS, "MultiHeadAttention"),)),
        Golden("gelu", None),
        Golden("layer_norm", (LAYER_NORM_OP, SKIP_LAYER_NORM_OP), 2, 1),
    ),
    gelu_ops=CONTRIB_GELU_OPS,
    opset=17,
    marks=frozenset({(MS, "MultiHeadAttention"), SKIP_LAYER_NORM_OP, *CONTRIB_GELU_OPS.values()}),
)
