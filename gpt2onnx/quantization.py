"""Reduced precision with onnxruntime's tools: fp16 (weights, activations and the K/V cache), dynamic int8
(MatMulInteger) and 4-bit block-wise (MatMulNBits, and GatherBlockQuantized for the embeddings).

On the CPU a decode step is bound by reading the weights, so fewer bytes per weight is where the speed is.
The logits projection is a Gemm on the tied token embedding (stored once in fp32 exports); both quantizers
only take MatMul, so the projection first becomes a MatMul on its own transposed copy of the embedding, which
is then quantized (the copy ends up 4 or 8 bits wide; the Gather keeps reading the embedding).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from gpt2onnx.errors import Gpt2OnnxError

log = logging.getLogger(__name__)

METHODS = ("none", "int8", "int4")
INT4_BLOCK_SIZES = (16, 32, 64, 128, 256)
DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16"}
# Kept in fp32 in an fp16 model: the LayerNorm statistics and the softmax (where large activations overflow or
# lose too much), and the logits the caller samples from.
FP16_KEEP_OPS = ("LayerNormalization", "SkipLayerNormalization", "Softmax")
FP16_KEEP_IO = ("logits",)


def check_dtype(dtype: str, method: str = "none") -> str:
    """The canonical dtype name; refuses an unknown one and fp16 with quantized weights."""
    if dtype not in DTYPES:
        raise Gpt2OnnxError(f"unknown --dtype '{dtype}': choose fp32 or fp16 (bf16 has no CPU kernels in ONNX Runtime)")
    if DTYPES[dtype] == "float16" and method != "none":
        raise Gpt2OnnxError(f"--dtype fp16 and --quantize {method} do not combine: choose one of them")
    return DTYPES[dtype]


def to_fp16(model: onnx.ModelProto, *, keep_ops=FP16_KEEP_OPS, keep_io=FP16_KEEP_IO) -> tuple[onnx.ModelProto, dict]:
    """fp16 weights, activations and K/V cache; ``keep_ops`` and the ``keep_io`` outputs stay fp32."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    ir_version = model.ir_version
    converted = convert_float_to_float16(model, keep_io_types=list(keep_io) or False, op_block_list=list(keep_ops))
    converted.ir_version = ir_version
    return converted, {"dtype": "float16", "kept_fp32_ops": list(keep_ops), "kept_fp32_io": list(keep_io)}


@dataclass(frozen=True)
class QuantizeOptions:
    method: str = "none"
    block_size: int = 32  # int4: weights per scale

    def check(self) -> None:
        if self.method not in METHODS:
            raise Gpt2OnnxError(f"unknown --quantize '{self.method}': choose one of {', '.join(METHODS)}")
        if self.method == "int4" and self.block_size not in INT4_BLOCK_SIZES:
            raise Gpt2OnnxError(
                f"--block-size {self.block_size} is not supported for int4: choose one of"
                f" {', '.join(map(str, INT4_BLOCK_SIZES))}"
            )

    def as_dict(self) -> dict:
        return {"method": self.method, "block_size": self.block_size if self.method == "int4" else None}


def _logits_gemm_to_matmul(model: onnx.ModelProto) -> int:
    """Gemm(x, W, transB=1) without bias → MatMul(x, Wᵀ) on a transposed copy (in place); returns how many."""
    initializers = {init.name: init for init in model.graph.initializer}
    changed = 0
    for node in model.graph.node:
        if node.op_type != "Gemm" or len(node.input) != 2 or node.input[1] not in initializers:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0:
            continue
        weight = numpy_helper.to_array(initializers[node.input[1]])
        if attrs.get("transB", 0):
            weight = np.ascontiguousarray(weight.T)
        name = f"{node.input[1]}_for_matmul"
        model.graph.initializer.append(numpy_helper.from_array(weight, name))
        node.op_type, node.input[1] = "MatMul", name
        del node.attribute[:]
        changed += 1
    return changed


def quantize(model: onnx.ModelProto, options: QuantizeOptions) -> tuple[onnx.ModelProto, dict]:
    """Quantize ``model`` (changed in place on the way); returns the new model and what was done."""
    options.check()
    if options.method == "none":
        return model, options.as_dict()
    ir_version = model.ir_version
    _logits_gemm_to_matmul(model)
    if options.method == "int4":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(
            model,
            block_size=options.block_size,
            is_symmetric=True,
            accuracy_level=4,  # int8 arithmetic on the CPU (VNNI/AVX2), the fast path
            op_types_to_quantize=("MatMul", "Gather"),
        )
        quantizer.process()
        quantized = quantizer.model.model
    else:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        with tempfile.TemporaryDirectory(prefix="gpt2onnx-int8-") as tmp:
            out = Path(tmp) / "model.onnx"
            quantize_dynamic(model, out, op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8, use_external_data_format=True)
            quantized = onnx.load(str(out))
    opset = next((i.version for i in quantized.opset_import if i.domain in ("", "ai.onnx")), 0)
    # the int4 quantizer may raise the opset (GatherBlockQuantized); keep the IR version in step with it
    quantized.ir_version = max(ir_version, 10 if opset >= 21 else ir_version)
    ops = {}
    for node in quantized.graph.node:
        if node.op_type in ("MatMulNBits", "GatherBlockQuantized", "MatMulInteger", "DynamicQuantizeLinear"):
            ops[node.op_type] = ops.get(node.op_type, 0) + 1
    log.info("quantized (%s): %s", options.method, ops)
    return quantized, {**options.as_dict(), "ops": ops}
