"""A quantized file judged by itself, whatever its weights.

Quality gates (KL, top-1 and top-5 agreement against fp32) measure what a user of a trained model loses. On random
weights they measure nothing: the next-token distributions are nearly flat, so a sound int4 file agrees on the
top token barely more than half the time. Two checks judge the file instead, and mean the same on any weights:

- **weights**: every weight the file stores quantized, dequantized from the file, is the declared rounding of the
  source's weight: within one quantization step of the declared width (round to nearest gives half a step;
  onnxruntime's symmetric 4-bit range [-8, 7] clamps a block's largest positive value when its largest magnitude
  is negative, which costs up to one step). A file with fewer bits than declared, or wrong scales, is far out.
- **activation path**: the file against the reference run with the file's own dequantized weights (PyTorch at
  export, the source graph at optimize): what is left is the quantization of activations at run time
  (DynamicQuantizeLinear, MatMulNBits' accuracy level 4) and the kernels' arithmetic, measured as the logits'
  relative error (:func:`gpt2onnx.verify.metrics.relative_error`), which does not depend on how peaked the
  predictions are. A kernel that saturates (int8's U8S8 on AVX2 with 8-bit weights) shows here.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from gpt2onnx.artifact.graph import all_nodes
from gpt2onnx.artifact.manifest import QuantizationRecord
from gpt2onnx.artifact.report import WeightRounding
from gpt2onnx.errors import ContractError
from gpt2onnx.precisions.all_precisions import layer_bits

HEAD_SUFFIX = "_for_matmul"  # precisions.weights.gemm_to_matmul's transposed copy of a Gemm head's weight
_NBITS_SUFFIX = re.compile(r"_Q\d+(G\d+)?$")  # _Q4; _Q4G32 from the calibrated algorithms' path


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight as the file stores it, dequantized, under its source name and in the fp32 graph's layout:
    [in, out] for a MatMul weight (a Gemm head's transposed copy keeps the ``_for_matmul`` suffix), [rows, width]
    for an embedding table."""

    name: str
    op: str  # the op that reads it: MatMulInteger, MatMulNBits, GatherBlockQuantized
    bits: int  # as the op declares it
    values: np.ndarray
    block: int | None = None  # MatMulNBits', GatherBlockQuantized's block_size attribute
    scheme: str | None = None  # MatMulInteger's storage as its tensors show it (precisions.int8's scheme names)

    @property
    def source_name(self) -> str:
        return self.name.removesuffix(HEAD_SUFFIX)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _unpack(data: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Values packed ``8 // bits`` per byte, low bits first, along the last axis, cut to ``count``."""
    if bits not in (1, 2, 4, 8):
        raise ContractError(f"{bits}-bit packed weights are not read: MatMulNBits packs 2, 4 or 8 bits per value")
    data = data.astype(np.int32)
    parts = [(data >> shift) & ((1 << bits) - 1) for shift in range(0, 8, bits)]
    return np.stack(parts, axis=-1).reshape(*data.shape[:-1], -1)[..., :count]


def _matmul_nbits(node: onnx.NodeProto, weights: dict[str, np.ndarray]) -> np.ndarray:
    """MatMulNBits' B as the [K, N] fp32 matrix it multiplies by."""
    a = _attrs(node)
    k, n, bits, block = a["K"], a["N"], a.get("bits", 4), a["block_size"]
    blocks = -(-k // block)
    packed = weights[node.input[1]].reshape(n, blocks, -1)
    q = _unpack(packed, bits, block).reshape(n, blocks * block)
    scales = weights[node.input[2]].astype(np.float32).reshape(n, blocks)
    if len(node.input) > 3 and node.input[3] and weights[node.input[3]].dtype.kind == "f":
        zero = weights[node.input[3]].astype(np.float32).reshape(n, blocks)  # HQQ: a real-valued zero point
    elif len(node.input) > 3 and node.input[3]:
        zero = _unpack(weights[node.input[3]].reshape(n, -1), bits, blocks).reshape(n, blocks)
    else:
        zero = np.full((n, blocks), 1 << (bits - 1), np.int32)
    values = (q.reshape(n, blocks, block) - zero[..., None]) * scales[..., None]
    return values.reshape(n, blocks * block)[:, :k].T.astype(np.float32)


def _gather_block_quantized(node: onnx.NodeProto, weights: dict[str, np.ndarray]) -> np.ndarray:
    """GatherBlockQuantized's data as the [rows, width] fp32 table it gathers from (blocks along the width)."""
    a = _attrs(node)
    bits, block = a.get("bits", 4), a["block_size"]
    if a.get("quantize_axis", 1) != 1 or a.get("gather_axis", 0) != 0:
        raise ContractError(f"{node.name}: only tables quantized along their width are read (quantize_axis 1)")
    data = weights[node.input[0]]
    rows, width = data.shape[0], data.shape[1] * (2 if bits == 4 and data.dtype == np.uint8 else 1)
    q = _unpack(data, bits, width) if data.dtype == np.uint8 and bits == 4 else data.astype(np.int32)
    blocks = -(-width // block)
    scales = weights[node.input[2]].astype(np.float32).reshape(rows, blocks)
    if len(node.input) > 3 and node.input[3]:
        zero = weights[node.input[3]].astype(np.int32).reshape(rows, -1)[:, :blocks]
    else:  # signed int4 data has no offset; unsigned data is centred on half its range
        signed = data.dtype.name.startswith("int")  # int4 (ml_dtypes) or int8
        zero = np.zeros((rows, blocks), np.int32) if signed else np.full((rows, blocks), 1 << (bits - 1))
    padded = np.zeros((rows, blocks * block), np.int32)
    padded[:, :width] = q
    values = (padded.reshape(rows, blocks, block) - zero[..., None]) * scales[..., None]
    return values.reshape(rows, -1)[:, :width].astype(np.float32)


def _matmul_integer(node: onnx.NodeProto, graph: onnx.GraphProto, weights: dict[str, np.ndarray]) -> np.ndarray:
    """MatMulInteger's quantized weight times its scale (onnxruntime's quantize_dynamic: Cast, then a Mul by
    activation scale × weight scale), as the [K, N] fp32 matrix."""
    q = weights[node.input[1]].astype(np.int32)
    zero = weights[node.input[3]].astype(np.int32) if len(node.input) > 3 and node.input[3] else np.zeros(1, np.int32)
    scale_name = node.input[1].removesuffix("_quantized") + "_scale"
    if scale_name not in weights:
        raise ContractError(f"{node.name}: the scale of '{node.input[1]}' ('{scale_name}') is not in the graph")
    scale = weights[scale_name].astype(np.float32)
    return ((q - zero.reshape(1, -1)) * scale.reshape(1, -1)).astype(np.float32)


def _int8_scheme(node: onnx.NodeProto, weights: dict[str, np.ndarray]) -> str:
    """How MatMulInteger's weight is stored, read from its tensors: signed (u8s8) or not (u8u8), a scale per
    column or one, and 7-bit where its integers span 7 bits (precisions.int8's scheme names)."""
    q = weights[node.input[1]]
    zero = weights[node.input[3]].astype(np.int32) if len(node.input) > 3 and node.input[3] else np.zeros(1, np.int32)
    scale = weights[node.input[1].removesuffix("_quantized") + "_scale"]
    signed = q.dtype == np.int8
    centred = q.astype(np.int32) - zero.reshape(1, -1)
    seven_bits = int(np.abs(centred).max(initial=0)) <= 64 if signed else int(np.ptp(q, initial=0)) <= 127
    per_channel = "per-channel" if scale.size > 1 else "per-tensor"
    return f"{'u8s8' if signed else 'u8u8'} {per_channel}{' 7-bit' if seven_bits else ''}"


def dequantized_weights(model: onnx.ModelProto) -> list[QuantizedWeight]:
    """Every weight the graph stores quantized, dequantized (see :class:`QuantizedWeight`)."""
    weights = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    found, seen = [], set()
    nodes = list(all_nodes(model.graph))  # int4's prompt path: the decode body's MatMulNBits, once
    for node in nodes:
        key = (node.op_type, tuple(node.input[:1] if node.op_type == "GatherBlockQuantized" else node.input[1:2]))
        if key in seen:
            continue
        seen.add(key)
        if node.op_type == "MatMulInteger" and node.input[1] in weights:
            name = node.input[1].removesuffix("_quantized")
            values = _matmul_integer(node, model.graph, weights)
            found.append(QuantizedWeight(name, node.op_type, 8, values, scheme=_int8_scheme(node, weights)))
        elif node.op_type == "MatMulNBits":
            name = _NBITS_SUFFIX.sub("", node.input[1])
            bits, block = _attrs(node).get("bits", 4), _attrs(node)["block_size"]
            found.append(QuantizedWeight(name, node.op_type, bits, _matmul_nbits(node, weights), block=block))
        elif node.op_type == "GatherBlockQuantized" and _attrs(node).get("quantize_axis", 1) == 2:
            # the tied embedding stored once: the head's MatMulNBits weights, read as the table (its name's)
            head = next((n for n in nodes if n.op_type == "MatMulNBits" and n.input[1] == node.input[0]), None)
            if head is None:
                raise ContractError(f"{node.name}: a GatherBlockQuantized on 3-D blocks reads no MatMulNBits weight")
            name = _NBITS_SUFFIX.sub("", node.input[0]).removesuffix(HEAD_SUFFIX)
            bits, block = _attrs(node).get("bits", 4), _attrs(head)["block_size"]
            values = _matmul_nbits(head, weights).T.copy()
            found.append(QuantizedWeight(name, node.op_type, bits, values, block=block))
        elif node.op_type == "GatherBlockQuantized":
            name = _NBITS_SUFFIX.sub("", node.input[0])
            bits, block = _attrs(node).get("bits", 4), _attrs(node)["block_size"]
            found.append(QuantizedWeight(name, node.op_type, bits, _gather_block_quantized(node, weights), block=block))
    return found


# -- what the file and its recipe declare, from the source weights -----------------------------------------------
def declared_step(source: np.ndarray, weight: QuantizedWeight, record: QuantizationRecord) -> np.ndarray:
    """The quantization step declared for each value of ``source`` (the weight in the file's layout): its group's
    largest magnitude over the declared width's largest level. Groups: a block of ``block_size`` values along the
    input (MatMulNBits) or the width (tables); int8's MatMulInteger: a column or the tensor.

    Declared by the graph (each op's bits and block size, MatMulInteger's tensors) and by the manifest's recipe;
    where they differ the finer step is the one judged: the manifest can make the check stricter, never looser,
    so a manifest whose entries were deleted or falsified cannot pass a file that has fewer bits than it runs."""
    if weight.op == "MatMulInteger":
        schemes = (weight.scheme, record.int8_weights)
        return _finest(_int8_step(source, scheme) for scheme in schemes if scheme is not None)
    steps = [_block_step(source, weight, weight.bits, weight.block or record.block_size or 32)]
    steps.append(_block_step(source, weight, _recipe_bits(weight, record), record.block_size or weight.block or 32))
    return _finest(steps)


def _finest(steps) -> np.ndarray:
    steps = list(steps)
    return functools.reduce(np.minimum, steps[1:], steps[0])


def _int8_step(source: np.ndarray, scheme: str) -> np.ndarray:
    levels = (64 if "7-bit" in scheme else 127) if scheme.startswith("u8s8") else (127 if "7-bit" in scheme else 255)
    per_channel = "per-channel" in scheme
    if scheme.startswith("u8u8"):  # asymmetric: the range, including 0, over the levels
        axis = 0 if per_channel else None
        low = np.minimum(source.min(axis=axis, keepdims=True), 0)
        high = np.maximum(source.max(axis=axis, keepdims=True), 0)
        return np.broadcast_to((high - low) / levels, source.shape)
    amax = np.abs(source).max(axis=0 if per_channel else None, keepdims=True)
    return np.broadcast_to(amax / levels, source.shape)


def _block_step(source: np.ndarray, weight: QuantizedWeight, bits: int, block: int) -> np.ndarray:
    # blocks run along the input of a MatMul ([in, out]: axis 0) and along the width of a table (axis 1)
    matrix = source.T if weight.op == "MatMulNBits" else source
    rows, width = matrix.shape
    blocks = -(-width // block)
    padded = np.zeros((rows, blocks * block), np.float32)
    padded[:, :width] = np.abs(matrix)
    amax = padded.reshape(rows, blocks, block).max(-1, keepdims=True)
    levels = 1 << (bits - 1) if bits == 4 or weight.op == "MatMulNBits" else (1 << (bits - 1)) - 1
    step = np.broadcast_to(amax / levels, (rows, blocks, block)).reshape(rows, -1)[:, :width]
    return step.T if weight.op == "MatMulNBits" else step


def _declared_bits(weight: QuantizedWeight, record: QuantizationRecord) -> int:
    """The width a weight is judged at: its op's, or the recipe's where that says more."""
    return max(weight.bits, _recipe_bits(weight, record))


def _recipe_bits(weight: QuantizedWeight, record: QuantizationRecord) -> int:
    """The width the manifest's recipe declares for this weight: the head's and the embeddings' own, else the
    method's."""
    if weight.op != "GatherBlockQuantized" and weight.name in (record.int8_layers or ()):
        return 8  # measured 8-bit layers (--mixed-int8)
    if weight.op == "GatherBlockQuantized":
        layer = record.embeddings
    elif weight.name.endswith(HEAD_SUFFIX) or weight.name == "lm_head.weight":
        layer = record.lm_head
    else:
        layer = record.method
    return layer_bits(layer or record.method)


def weight_rounding(
    model: onnx.ModelProto, source_weight, record: QuantizationRecord
) -> tuple[WeightRounding, list[QuantizedWeight]]:
    """How far each dequantized weight is from its source, in steps of the declared width.

    ``source_weight(name)``: the source's weight by its fp32 graph name (None if it has none). Returns the figures
    (the largest error in declared steps, that tensor, how many) and the weights read."""
    weights = dequantized_weights(model)
    worst, worst_name = 0.0, None
    rms_worst, rms_worst_name = 0.0, None
    for weight in weights:
        source = source_weight(weight.source_name)
        if source is None:
            raise ContractError(f"the quantized weight '{weight.name}' has no source weight '{weight.source_name}'")
        source = np.asarray(source, np.float32)
        if weight.name.endswith(HEAD_SUFFIX):
            source = source.T  # the head's copy is the transposed weight
        if source.shape != weight.values.shape:
            raise ContractError(
                f"the quantized weight '{weight.name}' is {list(weight.values.shape)}, its source {list(source.shape)}"
            )
        step = declared_step(source, weight, record)
        error = np.abs(weight.values - source)
        steps = float(np.max(error / np.maximum(step, 1e-30), initial=0.0))
        if not np.isfinite(weight.values).all():
            steps = float("inf")
        if steps > worst or worst_name is None:
            worst, worst_name = steps, weight.name
        bits = 8 if weight.op == "MatMulInteger" else _declared_bits(weight, record)
        ratio = _rms_ratio(source, weight, step, bits)
        if ratio > rms_worst or rms_worst_name is None:
            rms_worst, rms_worst_name = ratio, weight.name
    figures = WeightRounding(worst, worst_name, len(weights), rms_worst if weights else None, rms_worst_name)
    return figures, weights


def _rms_ratio(source: np.ndarray, weight: QuantizedWeight, step: np.ndarray, bits: int) -> float:
    """The RMS error of the file's weight over round-to-nearest's at the declared steps: the judge of algorithms
    that move weights off the nearest grid point on purpose (gpt2onnx.precisions.algorithms: weight_error).
    Round to nearest on the symmetric grid of the declared step, clamped to the op's range ([-8, 7] steps for
    4-bit MatMulNBits, as onnxruntime's quantizer), so a sound round-to-nearest file reads about 1."""
    safe = np.maximum(step, 1e-30)
    levels = 1 << (bits - 1)  # the declared width's, not the op's: 2-bit weights declared 4 read far above 1
    low, high = (-levels, levels - 1) if weight.op == "MatMulNBits" else (-np.inf, np.inf)
    nearest = np.clip(np.rint(source / safe), low, high) * step
    reference = float(np.sqrt(np.mean((nearest - source) ** 2)))
    error = float(np.sqrt(np.mean((weight.values - source) ** 2)))
    if not np.isfinite(error):
        return float("inf")
    return error / reference if reference > 0 else (0.0 if error == 0 else float("inf"))


def rounded_checkpoint(ckpt, weights: list[QuantizedWeight], *, keep_adapter: bool = False):
    """The checkpoint (gpt2onnx.pytorch's names: ``lm_head`` for an untied head) with every weight the file
    quantizes replaced by the file's dequantized values; untied when the file rounds its logits projection and its
    token embedding each its own way. ``keep_adapter``: the file holds the base rounded and the adapter fp32 in
    switchable slots: the base's weights rounded, the adapter kept (PEFT applies it on top)."""
    import torch

    base = ckpt.base_state_dict if keep_adapter else ckpt.state_dict
    state, spec, config = dict(base), ckpt.spec, ckpt.config
    for weight in weights:
        values = torch.from_numpy(np.ascontiguousarray(weight.values))
        if weight.name.endswith(HEAD_SUFFIX):
            state["lm_head"] = values.T.contiguous()  # [vocab, n_embd]
        else:
            state[weight.name] = values
    if spec.tie_word_embeddings and "lm_head" in state:
        spec = dataclasses.replace(spec, tie_word_embeddings=False)
        config = copy.deepcopy(config)
        config.tie_word_embeddings = False
    if keep_adapter:
        return dataclasses.replace(ckpt, base_state_dict=state, spec=spec, config=config)
    # the file holds an adapter merged: its rounded weights are the whole model (no PEFT on top)
    return dataclasses.replace(ckpt, state_dict=state, spec=spec, config=config, adapter=None, base_state_dict=None)


def rounded_source_graph(source: onnx.ModelProto, weights: list[QuantizedWeight]) -> onnx.ModelProto:
    """The source graph with the file's dequantized weights: each weight replaced, and a Gemm head that reads the
    tied embedding given its own rounded copy (the Gather keeps reading the table, rounded its own way)."""
    model = copy.deepcopy(source)
    initializers = {init.name: init for init in model.graph.initializer}
    for weight in weights:
        if weight.name.endswith(HEAD_SUFFIX):
            base = weight.source_name
            head = next(
                (
                    n
                    for n in model.graph.node
                    if n.op_type in ("Gemm", "MatMul") and len(n.input) > 1 and n.input[1] == base
                ),
                None,
            )
            if head is None:
                raise ContractError(f"the source graph has no logits projection on '{base}'")
            transposed = head.op_type == "Gemm" and _attrs(head).get("transB", 0)
            values = weight.values.T if transposed else weight.values
            name = f"{base}_rounded_head"
            model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(values), name))
            head.input[1] = name
        elif weight.name in initializers:
            initializers[weight.name].CopyFrom(numpy_helper.from_array(weight.values, weight.name))
        else:
            raise ContractError(f"the source graph has no weight '{weight.name}'")
    return model
