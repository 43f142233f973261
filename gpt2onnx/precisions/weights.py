"""What the weight precisions share: finding the logits projection and the embeddings, onnxruntime's
MatMulNBitsQuantizer, 8-bit embedding tables, one stored copy of a quantized tied embedding, and the frame every
quantizing precision runs in (:func:`quantize`: the head made a MatMul, the precision's own pass, the embeddings,
the record).

The logits projection is a Gemm on the tied token embedding (stored once in fp32 exports); the quantizers only
take MatMul, so a quantized projection first becomes a MatMul on its own transposed copy of the embedding (the
copy ends up 4 or 8 bits wide; the Gather keeps reading the embedding, or its own quantized copy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from gpt2onnx.artifact.graph import quantized_op_counts
from gpt2onnx.artifact.lora import SLOT_ADD, SLOT_PREFIX
from gpt2onnx.artifact.manifest import QuantizationRecord
from gpt2onnx.errors import BadInput
from gpt2onnx.precisions.algorithms.algorithm import Calibration, Int4Algorithm
from gpt2onnx.precisions.precision import EIGHT_BIT_TABLES, FLOAT_LAYER
from gpt2onnx.precisions.prompt_path import int8_prompt_path

log = logging.getLogger(__name__)

SHAPE_OPS = ("Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze", "Flatten")


def logits_projection(graph: onnx.GraphProto) -> onnx.NodeProto | None:
    """The MatMul or Gemm on a weight that makes the ``logits`` output (through reshapes and casts, and a LoRA
    slot's Add on the head), if any."""
    weights = {init.name for init in graph.initializer}
    node = _head_node(graph)
    if node is not None and node.op_type in ("MatMul", "Gemm") and len(node.input) >= 2 and node.input[1] in weights:
        return node
    return None


def _head_node(graph: onnx.GraphProto) -> onnx.NodeProto | None:
    """The node that projects the ``logits`` output: its producer, through reshapes, casts and a LoRA slot's Add."""
    producer = {out: node for node in graph.node for out in node.output}
    node = producer.get("logits")
    while node is not None and (node.op_type in SHAPE_OPS or node.name.endswith(SLOT_ADD)):
        node = producer.get(node.input[0])
    return node


def embedding_gathers(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The Gathers that read a 2-D float weight: the token and position embeddings."""
    weights = {
        init.name: init
        for init in graph.initializer
        if len(init.dims) == 2 and init.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    }
    return [n for n in graph.node if n.op_type == "Gather" and n.input[0] in weights]


def gemm_to_matmul(model: onnx.ModelProto, node: onnx.NodeProto) -> bool:
    """Gemm(x, W, transB=1) without bias → MatMul(x, Wᵀ) on a transposed copy (in place): both quantizers take
    MatMul only. Returns whether it changed the node."""
    if node.op_type != "Gemm" or len(node.input) != 2:
        return False
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0:
        return False
    initializers = {init.name: init for init in model.graph.initializer}
    weight = numpy_helper.to_array(initializers[node.input[1]])
    if attrs.get("transB", 0):
        weight = np.ascontiguousarray(weight.T)
    name = f"{node.input[1]}_for_matmul"
    model.graph.initializer.append(numpy_helper.from_array(weight, name))
    node.op_type, node.input[1] = "MatMul", name
    del node.attribute[:]
    return True


def matmul_nbits(
    model: onnx.ModelProto,
    options,  # a QuantizeRecipe (block_size, accuracy_level)
    *,
    bits: int,
    exclude: set[str],
    gathers: bool,
    algorithm: Int4Algorithm | None = None,
    calibration: Calibration | None = None,
) -> onnx.ModelProto:
    """onnxruntime's MatMulNBitsQuantizer over every MatMul on a weight (and the embedding Gathers with
    ``gathers``) whose node is not in ``exclude``, its weights chosen by ``algorithm`` (None: round to nearest)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    class _Quantizer(MatMulNBitsQuantizer):
        """onnxruntime 1.31's quantizer, with nodes_to_exclude honoured on its GPTQ path too: its RTN and k-quant
        paths mark them "fp32" (the vendored code's word for leave alone), its GPTQ path does not and quantizes
        them at 4 bits (a head or a measured layer meant for 8 bits, then refused by the file check)."""

        def _generate_q4_node_config(self):
            config = super()._generate_q4_node_config()
            config.update({name: "fp32" for name in self.nodes_to_exclude})
            return config

    weights = {init.name for init in model.graph.initializer}
    nodes = [
        n.name
        for n in model.graph.node
        if n.op_type == "MatMul" and n.name not in exclude and len(n.input) > 1 and n.input[1] in weights
    ]
    config = (
        algorithm.config(bits=bits, block_size=options.block_size, nodes=nodes, calibration=calibration, model=model)
        if algorithm
        else None
    )
    if config is not None and gathers:
        raise ValueError("the int4 algorithms write MatMulNBits only: quantize the embeddings apart")
    if config is not None and not nodes:
        return model
    quantizer = _Quantizer(
        model,
        bits=bits,
        block_size=options.block_size,
        is_symmetric=True,
        accuracy_level=options.accuracy_level or None,  # 0 leaves the attribute out (the op's default)
        nodes_to_exclude=sorted(exclude),
        op_types_to_quantize=("MatMul", "Gather") if gathers else ("MatMul",),
        algo_config=config,
    )
    with quiet_quantizer():
        quantizer.process()
    quantized = quantizer.model
    return quantized.model if hasattr(quantized, "model") else quantized


@contextlib.contextmanager
def quiet_quantizer():
    """The vendored neural-compressor path (GPTQ) prints a progress bar on stdout, and HQQ warns about
    non-writable arrays: neither is ours to show (the CLI's output is its own)."""
    import io
    import warnings

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore", UserWarning)
        yield


def gathers_to_8bit(model: onnx.ModelProto, names: set[str], block_size: int) -> int:
    """Each named Gather on a [rows, width] weight → GatherBlockQuantized with 8 bits (uint8, zero point 128),
    one fp32 scale per ``block_size`` values of a row (symmetric; the last block of a row may be shorter).
    onnxruntime's quantizer writes only 4-bit GatherBlockQuantized. Returns how many were rewritten."""
    initializers = {init.name: init for init in model.graph.initializer}
    changed = 0
    for node in model.graph.node:
        if node.name not in names or node.op_type != "Gather":
            continue
        weight = numpy_helper.to_array(initializers[node.input[0]]).astype(np.float32)
        rows, width = weight.shape
        blocks = -(-width // block_size)
        padded = np.zeros((rows, blocks * block_size), np.float32)
        padded[:, :width] = weight
        padded = padded.reshape(rows, blocks, block_size)
        scales = np.abs(padded).max(axis=-1) / 127.0
        safe = np.where(scales == 0, 1.0, scales)
        values = np.clip(np.rint(padded / safe[..., None]), -127, 127).astype(np.int16) + 128
        data = values.reshape(rows, -1)[:, :width].astype(np.uint8)
        base = node.input[0]
        model.graph.initializer.extend(
            [
                numpy_helper.from_array(data, f"{base}_Q8"),
                numpy_helper.from_array(scales.astype(np.float32), f"{base}_Q8_scales"),
                numpy_helper.from_array(np.full(scales.shape, 128, np.uint8), f"{base}_Q8_zero_points"),
            ]
        )
        axis = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
        ids = node.input[1]
        del node.input[:], node.attribute[:]
        node.input.extend([f"{base}_Q8", ids, f"{base}_Q8_scales", f"{base}_Q8_zero_points"])
        node.op_type, node.domain = "GatherBlockQuantized", "com.microsoft"
        node.attribute.extend(
            [
                onnx.helper.make_attribute("bits", 8),
                onnx.helper.make_attribute("block_size", block_size),
                onnx.helper.make_attribute("gather_axis", axis),
                onnx.helper.make_attribute("quantize_axis", 1),
            ]
        )
        changed += 1
    if changed:
        used = {name for n in model.graph.node for name in n.input}
        kept = [init for init in model.graph.initializer if init.name in used]
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return changed


def name_nodes(graph: onnx.GraphProto) -> None:
    """Give every node a name: the quantizers select nodes by name."""
    names = {n.name for n in graph.node if n.name}
    for index, node in enumerate(graph.node):
        if not node.name:
            name = f"{node.op_type}_{index}"
            while name in names:
                name += "_"
            node.name = name
            names.add(name)


def share_tied_embedding(model: onnx.ModelProto) -> str | None:
    """One stored copy of a quantized tied embedding: the token embedding's GatherBlockQuantized reads the logits
    projection's MatMulNBits weights (as onnxruntime-genai's builder does), so the file holds the table once.

    MatMulNBits stores the head's weight as [vocab, blocks, block bytes] uint8, each row's blocks along the
    embedding width: the token table, quantized the same way. The Gather reads it with quantize_axis 2 (its block
    the last axis) and a Reshape gives [batch, sequence, width]. Its scales are a [vocab, blocks, 1] copy: the
    MatMulNBits kernel takes only [vocab, blocks] or [vocab·blocks], the Gather's must have the data's rank (a
    Reshape of the weights between them makes OpenVINO refuse the Gather). Only where the two are the same width
    and block size and the head has no zero points (round to nearest; an algorithm with zero points keeps two
    copies). Returns the shared weight's name, or None where nothing was shared."""
    inits = {init.name: init for init in model.graph.initializer}
    head = _head_node(model.graph)
    if head is None or head.op_type != "MatMulNBits" or len([i for i in head.input if i]) != 3:
        return None
    head_attrs = {a.name: onnx.helper.get_attribute_value(a) for a in head.attribute}
    source = head.input[1].removesuffix(f"_Q{head_attrs.get('bits', 4)}").removesuffix("_for_matmul")
    gather = next(
        (
            n
            for n in model.graph.node
            if n.op_type == "GatherBlockQuantized"
            and n.input[0] in inits
            and n.input[0].split("_Q")[0] == source
            and n.output[0] not in {o.name for o in model.graph.output}
        ),
        None,
    )
    if gather is None or head.input[1] not in inits or head.input[2] not in inits:
        return None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gather.attribute}
    bits, block = head_attrs.get("bits", 4), head_attrs["block_size"]
    if attrs.get("bits", 4) != bits or attrs.get("block_size") != block or attrs.get("gather_axis", 0) != 0:
        return None
    vocab, width = head_attrs["N"], head_attrs["K"]
    if width % block:  # the head's last block is padded: the Gather's blocks would not reshape to the width
        return None
    table = inits[gather.input[0]]
    if list(table.dims) != [vocab, width if bits == 8 or table.data_type == onnx.TensorProto.INT4 else width // 2]:
        return None
    scales = numpy_helper.to_array(inits[head.input[2]]).astype(np.float32).reshape(vocab, -1, 1)
    scales_name = f"{head.input[1]}_gather_scales"
    shape_name = f"{head.input[1]}_gather_shape"
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(scales, scales_name),
            numpy_helper.from_array(np.array([0, 0, width], np.int64), shape_name),
        ]
    )
    blocks_out = f"{gather.output[0]}_blocks"
    reshape = onnx.helper.make_node(
        "Reshape", [blocks_out, shape_name], [gather.output[0]], name=f"{gather.name}/to_width"
    )
    ids = gather.input[1]
    del gather.input[:], gather.attribute[:]
    gather.input.extend([head.input[1], ids, scales_name])
    gather.output[0] = blocks_out
    gather.attribute.extend(
        [
            onnx.helper.make_attribute("bits", bits),
            onnx.helper.make_attribute("block_size", block),
            onnx.helper.make_attribute("gather_axis", 0),
            onnx.helper.make_attribute("quantize_axis", 2),
        ]
    )
    nodes = list(model.graph.node)
    nodes.insert(nodes.index(gather) + 1, reshape)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {name for node in model.graph.node for name in node.input}
    kept = [init for init in model.graph.initializer if init.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    log.info("the token embedding reads the logits projection's %d-bit weights (one stored copy)", bits)
    return source


def _block_widths(model: onnx.ModelProto) -> set[int]:
    """The widths that blocks run along: each MatMul weight's input width (rows of a [K, N] weight; a Gemm's
    transposed tied head reads the embedding's width) and each embedding table's row width."""
    shapes = {
        init.name: list(init.dims)
        for init in model.graph.initializer
        if len(init.dims) == 2 and not init.name.startswith(SLOT_PREFIX)  # LoRA slots stay fp32
    }
    widths = set()
    for node in model.graph.node:
        if node.op_type == "MatMul" and len(node.input) > 1 and node.input[1] in shapes:
            widths.add(shapes[node.input[1]][0])
        elif node.op_type in ("Gather", "Gemm") and len(node.input) > 1:
            weight = node.input[0] if node.op_type == "Gather" else node.input[1]
            if weight in shapes:
                widths.add(shapes[weight][1])
    return widths


def fitted_block_size(model: onnx.ModelProto, recipe, allowed, *, given: int | None, algorithm=None) -> int:
    """The block size: the recipe's (``given`` None) fitted to the model, the largest allowed size up to it that
    divides every width blocks run along (the tied table can then be stored once), into an even number of blocks
    where ``algorithm`` needs it (Int4Algorithm.even_blocks), else the largest that fits in the narrowest width.
    A size the user gave is kept (round to nearest pads a short last block), or refused in one line where the
    algorithm cannot take it."""
    widths = _block_widths(model)
    even = algorithm is not None and algorithm.even_blocks

    def fits(size: int) -> bool:
        return all(width % (2 * size if even else size) == 0 for width in widths)

    if given is not None:
        if even and not fits(given):
            smaller = [b for b in allowed if fits(b)]
            advice = f"choose --block-size {max(smaller)} or less" if smaller else "choose another --algorithm"
            raise BadInput(
                f"--block-size {given} does not split this model's widths {sorted(widths)} into an even number of"
                f" blocks, which {algorithm.name} needs (onnxruntime packs its zero points two a byte): {advice}"
            )
        return given
    if not widths:
        return recipe
    candidates = sorted((b for b in allowed if b <= recipe), reverse=True)
    size = next((b for b in candidates if fits(b)), None)
    if size is None:
        size = next((b for b in candidates if b <= min(widths)), candidates[-1])
    if size != recipe:
        log.info("blocks of %d (the recipe's %d, fitted to widths %s)", size, recipe, sorted(widths))
    return size


@dataclass
class QuantizeContext:
    """What a precision's weight pass works on (Precision.quantize): the model with its nodes named and a
    quantized head already a MatMul, the recipe, the logits projection (None where the graph has none), the nodes
    its pass must leave alone (a head stored at another width), the embedding Gathers, and the calibration
    sequences of a calibrated algorithm (None otherwise)."""

    model: onnx.ModelProto
    recipe: object  # gpt2onnx.precisions.quantize_options.QuantizeRecipe
    head: onnx.NodeProto | None
    head_apart: set[str]
    gathers: set[str]
    calibration: Calibration | None
    int8_scheme: object | None = None  # int8's weight scheme (gpt2onnx.precisions.int8.Int8Scheme); None: its own


def quantize(
    model: onnx.ModelProto,
    options,  # gpt2onnx.precisions.quantize_options.QuantizeOptions
    *,
    int8_scheme=None,
    calibration: Calibration | None = None,
) -> tuple[onnx.ModelProto, QuantizationRecord | None]:
    """Quantize ``model`` (changed in place on the way) as ``options``' precision declares; returns the new model
    and what was done. ``int8_scheme``: how int8 stores its MatMulInteger weights (its INT8_SCHEMES; benchmarks
    choose another). ``calibration``: the token sequences of a calibrated algorithm (required by it)."""
    precision = options.precision
    if precision.quantize is None:
        return model, None
    record = options.as_dict()
    recipe = options.recipe
    ir_version = model.ir_version
    graph = model.graph
    if options.block_wise:
        block_size = fitted_block_size(
            model,
            recipe.block_size,
            precision.block_sizes,
            given=options.block_size,
            algorithm=options.weight_algorithm,
        )
        recipe = dataclasses.replace(recipe, block_size=block_size)
        record["block_size"] = block_size
    name_nodes(graph)
    head = logits_projection(graph)
    if head is None and recipe.lm_head != recipe.method:
        log.warning("no logits projection found (a MatMul or Gemm making 'logits'): --lm-head has no effect")
    gathers = {n.name for n in embedding_gathers(graph)}
    if head is not None and recipe.lm_head != FLOAT_LAYER:
        gemm_to_matmul(model, head)
    # the head is quantized with the other MatMuls only at the precision's own width
    head_apart = {head.name} if head is not None and recipe.lm_head != recipe.method else set()
    # a switchable LoRA slot's branch (gpt2onnx.passes.lora_slots) stays fp32 beside its quantized MatMul
    head_apart |= {n.name for n in graph.node if any(i.startswith(SLOT_PREFIX) for i in n.input)}
    context = QuantizeContext(model, recipe, head, head_apart, gathers, calibration, int8_scheme)
    quantized, extra = precision.quantize(context)
    if recipe.embeddings == EIGHT_BIT_TABLES:
        gathers_to_8bit(quantized, gathers, recipe.block_size)
    shared = share_tied_embedding(quantized) if head is not None else None
    prompt_kernel = None
    if precision.prompt_kernels and recipe.prompt_kernel != precision.prompt_kernels[0]:
        int8_prompt_path(quantized)
        prompt_kernel = recipe.prompt_kernel
    opset = next((i.version for i in quantized.opset_import if i.domain in ("", "ai.onnx")), 0)
    # the quantizers may raise the opset (GatherBlockQuantized); keep the IR version in step with it
    quantized.ir_version = max(ir_version, 10 if opset >= 21 else ir_version)
    ops = quantized_op_counts(quantized)
    log.info("quantized (%s): %s", recipe.method, ops)
    return quantized, QuantizationRecord(
        record["method"],
        record["block_size"],
        ops,
        record["accuracy_level"],
        record["lm_head"],
        record["embeddings"],
        shared_embedding=shared,
        prompt_kernel=prompt_kernel,
        **extra,
    )
