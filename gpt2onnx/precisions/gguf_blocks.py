"""A GGUF file's quantized blocks kept as they are stored: Q8_0, Q4_0 and Q6_K become MatMulNBits (and the tied
token embedding a GatherBlockQuantized reading the head's weights), holding exactly the file's codes and scales,
so the ONNX file computes llama.cpp's weights.

Each kept type is a symmetric block format MatMulNBits holds without loss (no zero points: the op's default,
2^(bits-1), is subtracted before the scale):

- Q8_0: 32 int8 codes q and an fp16 scale d; w = d·q. 8 bits, blocks of 32, code q + 128.
- Q4_0: 32 4-bit codes q and an fp16 scale d; w = d·(q − 8). 4 bits, blocks of 32, the codes repacked from
  llama.cpp's order (element j in the low nibble of byte j, element j + 16 in its high nibble) to MatMulNBits'
  (element 2i low, 2i + 1 high).
- Q6_K: super-blocks of 256, each 16 sub-blocks of 16 six-bit codes with an int8 scale, times an fp16 scale d;
  w = (d·sc)·(q − 32). 8 bits, blocks of 16, scale d·sc (exact in fp32: 11 × 8 significant bits), code q + 96.

The others are refused by the reader (gpt2onnx.pytorch.gguf_checkpoint): Q4_1 and Q5_1 add a float minimum per
block, which MatMulNBits' integer zero point (subtracted before the scale) cannot hold bit for bit; Q5_0 needs 5
bits; the other K-quants and the i-quants have nested scales or codebooks.

This module is numpy and onnx only: the blocks come in as raw bytes (:class:`FileBlocks`), the graph is rewritten
after the quantizing precision's own pass made its MatMulNBits nodes (export runs that pass with the options
:func:`kept_quantization` gives).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from gpt2onnx.artifact.graph import quantized_op_counts
from gpt2onnx.artifact.manifest import QuantizationRecord
from gpt2onnx.errors import BadInput
from gpt2onnx.precisions.all_precisions import NO_QUANTIZATION
from gpt2onnx.precisions.precision import FLOAT_LAYER
from gpt2onnx.precisions.quantize_options import QuantizeOptions

log = logging.getLogger(__name__)

# ggml type → (bits, block size of the MatMulNBits that holds it, bytes of one stored block, values per stored block)
KEPT = {"Q8_0": (8, 32, 34, 32), "Q4_0": (4, 32, 18, 32), "Q6_K": (8, 16, 210, 256)}
FILE_BLOCK_SIZE = 32  # the block size the quantizing precision's own pass is asked for (rewritten per node after)
TOKEN_EMBEDDING = "wte.weight"
HEAD_NAMES = ("lm_head", "lm_head.weight")


@dataclass(frozen=True)
class FileBlocks:
    """One quantized GGUF tensor as stored: its ggml type, ``rows`` rows of ``width`` values (a MatMulNBits weight's
    N and K), and its raw bytes, [rows, bytes per row] uint8 (a view of the file's memory map)."""

    type: str
    rows: int
    width: int
    raw: np.ndarray

    def __post_init__(self) -> None:
        _, _, block_bytes, values = KEPT[self.type]
        if self.width % values or self.raw.shape != (self.rows, self.width // values * block_bytes):
            raise ValueError(f"{self.type} blocks of shape {self.raw.shape} do not hold {self.rows}×{self.width}")


def nbits_blocks(blocks: FileBlocks) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The file's blocks as MatMulNBits stores them: (codes [N, blocks, block·bits/8] uint8, scales [N, blocks]
    float32, bits, block size); the same codes and scales, repacked."""
    bits, block, block_bytes, values = KEPT[blocks.type]
    rows = blocks.rows
    raw = np.ascontiguousarray(blocks.raw).reshape(rows, -1, block_bytes)
    if blocks.type == "Q8_0":
        scales = raw[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
        codes = (raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    elif blocks.type == "Q4_0":
        scales = raw[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
        packed = raw[..., 2:]
        values4 = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # the 32 codes in order
        codes = (values4[..., 0::2] | (values4[..., 1::2] << 4)).astype(np.uint8)
    else:  # Q6_K: ql[128], qh[64], scales int8[16], d fp16 (llama.cpp's block_q6_K; gguf.quants.Q6_K's reading)
        n = raw.shape[1]
        ql, qh = raw[..., :128], raw[..., 128:192]
        sc = raw[..., 192:208].view(np.int8).astype(np.float32)
        d = raw[..., 208:210].copy().view(np.float16).astype(np.float32)
        low = (ql.reshape(rows, n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
        high = (qh.reshape(rows, n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
        q6 = low.reshape(rows, n, 2, 4, 32) | (high.reshape(rows, n, 2, 4, 32) << 4)  # 0..63, llama.cpp's order
        codes = (q6.reshape(rows, n * values // block, block).astype(np.int16) + 96).astype(np.uint8)
        scales = (d * sc).reshape(rows, n * values // block)
    return np.ascontiguousarray(codes), np.ascontiguousarray(scales, dtype=np.float32), bits, block


def dequantized(codes: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' own dequantization of symmetric blocks (no zero points): (code − 2^(bits−1))·scale, [N, K]."""
    if bits == 4:
        q = np.empty(codes.shape[:-1] + (codes.shape[-1] * 2,), np.float32)
        q[..., 0::2], q[..., 1::2] = codes & 0x0F, codes >> 4
    else:
        q = codes.astype(np.float32)
    q -= 2 ** (bits - 1)
    return (q * scales[..., None]).reshape(codes.shape[0], -1)


def kept_quantization(blocks: dict[str, FileBlocks], given: QuantizeOptions) -> QuantizeOptions:
    """The quantizing precision whose MatMulNBits nodes hold the file's blocks: int4 where any block weight is
    4-bit, else int8-weights; the head at the token embedding's width (fp32 where it is not quantized), the
    embeddings fp32 (the token table is then shared with the head, the position table kept as the file has it).
    ``given``: the user's --quantize options, of which only --accuracy-level applies (and --quantize naming the
    same precision)."""
    widths = {KEPT[b.type][0] for b in blocks.values()}
    method = "int4" if 4 in widths else "int8-weights"
    if given.method not in (NO_QUANTIZATION, method):
        raise BadInput(
            f"this GGUF's quantized blocks are kept as they are ({method}); --quantize {given.method} would round"
            " them again: drop --quantize (or convert the model to F16 with llama.cpp and quantize that)"
        )
    others = [f for f in ("block_size", "lm_head", "embeddings", "algorithm", "mixed_int8", "prompt_kernel")]
    for name in others:
        if getattr(given, name) is not None:
            raise BadInput(
                f"--{name.replace('_', '-')} does not apply to a quantized GGUF: its blocks are kept as the file has"
                " them; drop it"
            )
    head = next((blocks[n] for n in (*HEAD_NAMES, TOKEN_EMBEDDING) if n in blocks), None)
    lm_head = FLOAT_LAYER if head is None else ("int4" if KEPT[head.type][0] == 4 else "int8")
    return QuantizeOptions(
        method=method,
        block_size=FILE_BLOCK_SIZE,
        accuracy_level=given.accuracy_level,
        lm_head=lm_head,
        embeddings=FLOAT_LAYER,
    )


def _source(weight: str) -> str:
    """The exported weight a quantizer's initializer was made from: 'h.0.attn.c_attn.weight_Q4' → its name,
    'wte.weight_for_matmul_Q8' → 'wte.weight'."""
    for suffix in ("_Q4", "_Q8"):
        weight = weight.removesuffix(suffix)
    return weight.removesuffix("_for_matmul")


def _set(model: onnx.ModelProto, name: str, array: np.ndarray) -> None:
    for index, init in enumerate(model.graph.initializer):
        if init.name == name:
            model.graph.initializer[index].CopyFrom(numpy_helper.from_array(array, name))
            return
    model.graph.initializer.append(numpy_helper.from_array(array, name))


def _attrs(node: onnx.NodeProto, **values: int) -> None:
    kept = [a for a in node.attribute if a.name not in values]
    del node.attribute[:]
    node.attribute.extend([*kept, *(onnx.helper.make_attribute(k, v) for k, v in values.items())])


def keep_file_blocks(
    model: onnx.ModelProto, blocks: dict[str, FileBlocks], record: QuantizationRecord | None
) -> QuantizationRecord:
    """Every MatMulNBits of ``model`` given its weight's file blocks (codes, scales, bits and block size, no zero
    points), in place, and the token embedding's Gather made a GatherBlockQuantized on the same blocks (the head's,
    where they are tied). A MatMulNBits whose weight the file does not store quantized is refused (a file mixing
    float and quantized block weights). Returns the record with the ops counted again."""
    graph = model.graph
    done: dict[str, str] = {}  # source weight → the MatMulNBits weight holding its codes
    for node in graph.node:
        if node.op_type != "MatMulNBits":
            continue
        source = _source(node.input[1])
        found = blocks.get(source)
        if found is None:
            raise BadInput(
                f"the GGUF stores weight '{source}' unquantized beside quantized ones: such mixed files are not"
                " exported; convert the model again with one --outtype"
            )
        codes, scales, bits, block = nbits_blocks(found)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if (attrs.get("N"), attrs.get("K")) != (found.rows, found.width):
            raise ValueError(f"MatMulNBits {node.name} is {attrs.get('N')}×{attrs.get('K')}, the file's {source} not")
        _set(model, node.input[1], codes)
        _set(model, node.input[2], scales)
        del node.input[3:]  # no zero points: the op's default 2^(bits-1)
        _attrs(node, bits=bits, block_size=block)
        done[source] = node.input[1]
    shared = _quantized_embedding(model, blocks, done)
    used = {name for node in graph.node for name in node.input}
    kept = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    types = sorted({b.type for b in blocks.values()})
    log.info("kept the GGUF's %s blocks as they are: %d weights", "/".join(types), len(done) + bool(shared))
    record = record or QuantizationRecord("gguf")
    return dataclasses.replace(record, ops=quantized_op_counts(model), shared_embedding=shared or None)


def _quantized_embedding(model: onnx.ModelProto, blocks: dict[str, FileBlocks], done: dict[str, str]) -> str:
    """The token embedding's Gather → GatherBlockQuantized on the file's blocks (quantize_axis 2 on [vocab, blocks,
    block bytes], then a Reshape to the width): the head's MatMulNBits weights where it holds the same tensor (one
    stored copy), else a copy of its own. Returns the token embedding's name where it was done, else ''."""
    found = blocks.get(TOKEN_EMBEDDING)
    gather = next((n for n in model.graph.node if n.op_type == "Gather" and n.input[0] == TOKEN_EMBEDDING), None)
    if found is None or gather is None:
        return ""
    codes, scales, bits, block = nbits_blocks(found)
    data = done.get(TOKEN_EMBEDDING)
    if data is None:
        data = f"{TOKEN_EMBEDDING}_gguf"
        _set(model, data, codes)
    scales_name, shape_name = f"{data}_gather_scales", f"{data}_gather_shape"
    _set(model, scales_name, scales.reshape(found.rows, -1, 1))
    _set(model, shape_name, np.array([0, 0, found.width], np.int64))
    blocks_out = f"{gather.output[0]}_blocks"
    reshape = onnx.helper.make_node("Reshape", [blocks_out, shape_name], [gather.output[0]], name=f"{gather.name}/w")
    ids = gather.input[1]
    del gather.input[:], gather.attribute[:]
    gather.input.extend([data, ids, scales_name])
    gather.output[0] = blocks_out
    gather.op_type, gather.domain = "GatherBlockQuantized", "com.microsoft"
    _attrs(gather, bits=bits, block_size=block, gather_axis=0, quantize_axis=2)
    nodes = list(model.graph.node)
    nodes.insert(nodes.index(gather) + 1, reshape)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return TOKEN_EMBEDDING
