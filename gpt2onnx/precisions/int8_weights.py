"""int8-weights: the near-lossless tier. 8-bit block-wise weights (MatMulNBits with 8 bits, one scale per block
of 32 along the input, symmetric) for every block weight; the recipe keeps the tied head and embeddings in fp32
(one stored table): at 8 bits they were most of the tier's error (docs/precision.md);
activations stay float: on the CPU, accuracy level 4 quantizes them to int8 per block inside the kernel (VNNI,
AVX2, AMX), level 0 keeps fp32 arithmetic (on this CPU class about 100 times slower: onnxruntime dequantizes
8-bit weights whole at every step there). A quarter of fp32's bytes; CUDA runs it (8-bit MatMulNBits has CUDA
kernels; int8's MatMulInteger has none)."""

from __future__ import annotations

import onnx

from gpt2onnx.precisions import weights  # by module: tests swap matmul_nbits to damage a file
from gpt2onnx.precisions.precision import FLOAT_LAYER, Precision
from gpt2onnx.precisions.weights import QuantizeContext

BITS = 8
LAYER = "int8"  # --lm-head / --embeddings at 8 bits


def _quantize(context: QuantizeContext) -> tuple[onnx.ModelProto, dict]:
    head = {context.head.name} if context.head is not None and context.recipe.lm_head == LAYER else set()
    # MatMuls only (gathers=False): the embeddings' 8-bit tables are written by the frame
    exclude = context.head_apart - head
    return weights.matmul_nbits(context.model, context.recipe, bits=BITS, exclude=exclude, gathers=False), {}


PRECISION = Precision(
    name="int8-weights",
    short="int8-weights",
    summary="8-bit weights, float activations (MatMulNBits): near-lossless, a quarter of fp32's size, runs on CUDA",
    # set to catch a broken file, as the others (fp16's): on the GPT-2-shaped reference's held-out text the recipe
    # measured KL 5.3e-6, top-1 99.8 % (docs/precision.md); 4-bit weights declared 8 fail the file check first
    gates={"kl_mean": 1e-4, "top1": 0.98, "top5": 0.99},
    file_gates={"weight_steps": 1.001, "relative_error": 0.05},
    method="int8-weights",
    weight_bits=BITS,
    marks=frozenset({"MatMulNBits (8-bit)"}),
    writes=frozenset({("com.microsoft", "MatMulNBits")}),
    options=frozenset({"block_size", "accuracy_level", "lm_head", "embeddings"}),
    # measured on the reference (held-out text, mean KL against PyTorch fp32): the head and embeddings at 8 bits
    # 1.8e-5 (8.7e-6 at accuracy level 0, too slow on the CPU), in fp32 5.3e-6 for 1.5x the file (still under half
    # of fp32's for GPT-2 124M: 247 MB of 498)
    recipe={"lm_head": FLOAT_LAYER, "embeddings": FLOAT_LAYER, "accuracy_level": 4},
    layer_choices=(LAYER, FLOAT_LAYER),
    accuracy_levels=(0, 4),
    block_sizes=(16, 32, 64, 128, 256),
    block_wise=True,
    quantize=_quantize,
)
