"""For TensorRT's ONNX parser: layer_norm → LayerNormalization (opset 17), nothing else. TensorRT takes no
com.microsoft op and fuses GELU and attention itself; 10.16 rejects an opset-23 Attention with present K/V, so the
profile stays standard and below opset 20. Golden: 2L + 1 LayerNormalization. A graph fused with it holds nothing
an unfused export lacks, so it has no marks (a folder of it reads back as none). Its need: no op TensorRT's parser
lacks, so that what it is for is what it can run (quantized weights are com.microsoft ops, or MatMulInteger)."""

from gpt2onnx.capabilities import Lacks, Need
from gpt2onnx.profiles.profile import LAYER_NORM, LAYER_NORM_OP, Golden, Profile

PROFILE = Profile(
    name="tensorrt",
    summary="standard LayerNormalization only (opset 17): TensorRT's parser, which fuses the rest itself",
    fusions=(LAYER_NORM,),
    golden=(Golden("layer_norm", (LAYER_NORM_OP,), 2, 1),),
    opset=17,
    requires=(
        Need("contrib_ops", allowed={False}, why="is made for TensorRT's parser, which takes no com.microsoft op"),
        Lacks(
            "ops",
            {("", "MatMulInteger"): "is made for TensorRT's parser, which has no", ("", "DynamicQuantizeLinear"): ""},
            why="is made for TensorRT's parser, which has no",
        ),
    ),
)
