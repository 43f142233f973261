"""int8: onnxruntime's dynamic quantization: MatMulInteger on int8 weights (7-bit, one scale per output column:
INT8_SCHEME), activations quantized to uint8 at every step, one scale and zero point per token
(gpt2onnx.precisions.activations); the recipe's embeddings at 8 bits (GatherBlockQuantized). The fastest on CPUs
with VNNI; CUDA has no kernel for it (providers' kernel facts).

Per token, not per tensor: onnxruntime's quantize_dynamic writes DynamicQuantizeLinear, whose one scale and zero
point span the whole step, so a row's arithmetic depended on the other rows of its batch (issue 54). Each token's
activations are quantized on their own instead (its zero point taken off after the integer matmul, its scale
applied there): a token's values are the same alone, in a batch and left-padded."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx

from gpt2onnx.precisions.activations import per_token_activations
from gpt2onnx.precisions.precision import FLOAT_LAYER, Precision
from gpt2onnx.precisions.weights import QuantizeContext


@dataclass(frozen=True)
class Int8Scheme:
    """How int8's weights are stored for MatMulInteger (onnxruntime ``quantize_dynamic``'s options); activations are
    always quantized at run time, to uint8 per token (gpt2onnx.precisions.activations).

    weights: "int8" (U8S8 products) or "uint8" (U8U8).
    per_channel: one scale per output column instead of one per tensor.
    reduce_range: 7-bit weights ([-64, 64]). x86 CPUs without VNNI (AVX2, AVX-512 without VNNI) compute U8S8 with
        VPMADDUBSW, which adds two uint8 × int8 products in 16 bits and saturates (255 × 127 × 2 > 32767); VNNI and
        AMX accumulate in 32 bits. With 7-bit weights no pair sum can exceed 255 × 64 × 2 = 32640, so every kernel
        path computes the same integers (onnxruntime's quantization guide, "When and why do I need to try U8U8?").
    """

    weights: str = "int8"
    per_channel: bool = True
    reduce_range: bool = True

    @property
    def name(self) -> str:
        pairs = "u8s8" if self.weights == "int8" else "u8u8"
        return f"{pairs} {'per-channel' if self.per_channel else 'per-tensor'}{' 7-bit' if self.reduce_range else ''}"

    @property
    def portable(self) -> bool:
        """Whether every CPU kernel path computes the same integer products (no 16-bit saturation possible)."""
        return self.weights == "uint8" or self.reduce_range


# The int8 schemes measured (docs/benchmarks.md, "int8 on every CPU"); INT8_SCHEME is the one written, chosen there:
# the only U8S8 schemes whose products cannot saturate on AVX2 are the 7-bit ones, and per channel wins back the
# bit that 7-bit weights lose.
INT8_SCHEMES = {
    "u8s8-tensor": Int8Scheme("int8", per_channel=False, reduce_range=False),
    "u8s8-tensor-7bit": Int8Scheme("int8", per_channel=False, reduce_range=True),
    "u8s8-channel": Int8Scheme("int8", per_channel=True, reduce_range=False),
    "u8s8-channel-7bit": Int8Scheme("int8", per_channel=True, reduce_range=True),
    "u8u8-tensor": Int8Scheme("uint8", per_channel=False, reduce_range=False),
    "u8u8-channel": Int8Scheme("uint8", per_channel=True, reduce_range=False),
}
INT8_SCHEME = INT8_SCHEMES["u8s8-channel-7bit"]
HELD_DOMAIN = "gpt2onnx.held"  # a node the int8 quantizer must not see (see quantize)


def _quantize_dynamic(model: onnx.ModelProto, head, head_apart: set[str], scheme: Int8Scheme) -> onnx.ModelProto:
    """onnxruntime's quantize_dynamic on every MatMul but ``head_apart`` (MatMulInteger, weights stored by
    ``scheme``); a head kept fp32 is hidden from it (see below)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # quantize_dynamic turns every Gemm into a MatMul by transposing its weight in place, which would break
    # the Gather that shares the tied embedding: a head kept fp32 is hidden from it in a domain of its own
    held = head is not None and head.op_type == "Gemm"
    if held:
        head.domain, head.op_type = HELD_DOMAIN, "HeldGemm"
        model.opset_import.append(onnx.helper.make_opsetid(HELD_DOMAIN, 1))
    with tempfile.TemporaryDirectory(prefix="gpt2onnx-int8-") as tmp:
        out = Path(tmp) / "model.onnx"
        # quantize_dynamic logs a pre-processing hint on the root logger (logging.warning), which would be a
        # second line on stderr: the tool's output is one line per error, and the hint is not one
        hint = logging.Filter()
        hint.filter = lambda record: "pre-processing before quantization" not in record.getMessage()
        logging.getLogger().addFilter(hint)
        try:
            quantize_dynamic(
                model,
                out,
                op_types_to_quantize=["MatMul"],
                nodes_to_exclude=sorted(head_apart),
                weight_type=QuantType.QInt8 if scheme.weights == "int8" else QuantType.QUInt8,
                per_channel=scheme.per_channel,
                reduce_range=scheme.reduce_range,
                use_external_data_format=True,
            )
        finally:
            logging.getLogger().removeFilter(hint)
        quantized = onnx.load(str(out))
    if held:
        for node in quantized.graph.node:
            if node.domain == HELD_DOMAIN:
                node.domain, node.op_type = "", "Gemm"
        opsets = [o for o in quantized.opset_import if o.domain != HELD_DOMAIN]
        del quantized.opset_import[:]
        quantized.opset_import.extend(opsets)
    return quantized


def _quantize(context: QuantizeContext) -> tuple[onnx.ModelProto, dict]:
    scheme = context.int8_scheme or INT8_SCHEME
    model = _quantize_dynamic(context.model, context.head, context.head_apart, scheme)
    per_token_activations(model)
    return model, {"int8_weights": scheme.name}


PRECISION = Precision(
    name="int8",
    short="int8",
    summary="int8 weights and int8 activations quantized at each step (MatMulInteger): fast on CPUs with VNNI",
    # recalibrated on a trained model (docs/benchmarks.md, "What each precision costs"): the recipe passes with a
    # margin (trained test model: KL 5.9e-5, top-1 98.6 %; random 124M: KL 4.1e-4, top-1 93.5 %) and the same
    # method with 4-bit weights fails (KL 8.2e-4, top-1 89.6 %), tests/precisions/test_precision_recipes.py
    gates={"kl_mean": 7e-4, "top1": 0.92, "top5": 0.99},
    file_gates={"weight_steps": 1.001, "relative_error": 0.05},
    method="int8",
    weight_bits=8,
    marks=frozenset({"MatMulInteger"}),
    writes=frozenset({("", "MatMulInteger")}),
    transformers_js=("q8", "_quantized"),
    options=frozenset({"block_size", "lm_head", "embeddings"}),
    # the 8-bit embeddings halve the file at the same quality and speed
    recipe={"lm_head": "int8", "embeddings": "int8", "accuracy_level": None},
    layer_choices=("int8", FLOAT_LAYER),  # MatMulInteger has no 4-bit form
    block_sizes=(16, 32, 64, 128, 256),
    quantize=_quantize,
)
