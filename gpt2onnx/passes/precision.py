"""Reduced precision with onnxruntime's tools: fp16 (weights, activations and the K/V cache), dynamic int8
(MatMulInteger) and 4-bit block-wise (MatMulNBits, and GatherBlockQuantized for the embeddings).

On the CPU a decode step is bound by reading the weights, so fewer bytes per weight is where the speed is.
The logits projection is a Gemm on the tied token embedding (stored once in fp32 exports); both quantizers
only take MatMul, so a quantized projection first becomes a MatMul on its own transposed copy of the embedding
(the copy ends up 4 or 8 bits wide; the Gather keeps reading the embedding, or its own quantized copy).
Which width the projection and the embeddings get, and int4's arithmetic, are options (QuantizeOptions) whose
defaults, the recipes, come from the measured precision table in docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from gpt2onnx.artifact.graph import sort_topologically
from gpt2onnx.artifact.manifest import Fp16Record, QuantizationRecord
from gpt2onnx.errors import BadInput
from gpt2onnx.passes.int4.algorithm import Calibration, Int4Algorithm
from gpt2onnx.passes.int4.all_algorithms import ALGORITHMS, DEFAULT_ALGORITHM

log = logging.getLogger(__name__)

METHODS = ("none", "int8", "int4")
INT4_BLOCK_SIZES = (16, 32, 64, 128, 256)
DEFAULT_BLOCK_SIZE = 32
DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16"}
# What an fp16 model keeps in fp32 (--keep-fp32), by default all of it:
#   layernorm: each LayerNorm, as a fused op (LayerNormalization, SkipLayerNormalization) or written out (opsets
#              below 17, --fusion none). Its statistics are what overflow: trained GPT-2 has residual-stream
#              channels near 3000, and the variance squares them (3000² > fp16's 65504).
#   softmax:   the attention softmax (no measurable effect on the 124M outlier model, docs/benchmarks.md; kept
#              for the peaked attention of trained checkpoints);
#   logits:    the logits output, so callers sample from fp32 (the projection itself runs in fp16).
FP16_KEEP_GROUPS = ("layernorm", "softmax", "logits")
FP16_KEEP_OPS = {"layernorm": ("LayerNormalization", "SkipLayerNormalization"), "softmax": ("Softmax",)}


def check_dtype(dtype: str, method: str = "none") -> str:
    """The canonical dtype name; refuses an unknown one and fp16 with quantized weights."""
    if dtype not in DTYPES:
        raise BadInput(f"unknown --dtype '{dtype}': choose fp32 or fp16 (bf16 has no CPU kernels in ONNX Runtime)")
    if DTYPES[dtype] == "float16" and method != "none":
        raise BadInput(f"--dtype fp16 and --quantize {method} do not combine: choose one of them")
    return DTYPES[dtype]


def parse_keep_fp32(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """--keep-fp32: a comma-separated subset of FP16_KEEP_GROUPS, or 'none' (also: a tuple of groups, () for none)."""
    if not isinstance(value, str):
        names = list(value)
    else:
        names = [v.strip() for v in value.split(",") if v.strip()]
        if names == ["none"]:
            return ()
        if not names:
            names = ["?"]
    unknown = [n for n in names if n not in FP16_KEEP_GROUPS]
    if unknown:
        shown = value if isinstance(value, str) else ",".join(map(str, value))
        raise BadInput(
            f"--keep-fp32 '{shown}' is not valid: give a comma-separated subset of {','.join(FP16_KEEP_GROUPS)}, or"
            " 'none'"
        )
    return tuple(g for g in FP16_KEEP_GROUPS if g in names)


def written_out_layer_norms(graph: onnx.GraphProto) -> list[list[onnx.NodeProto]]:
    """The nodes of every written-out LayerNorm, (x - mean(x)) / sqrt(mean((x - mean(x))²) + ε) · γ + β, with the
    Constants they read (one list per LayerNorm)."""
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def made_by(name: str, op_type: str):
        node = producer.get(name)
        return node if node is not None and node.op_type == op_type else None

    def sole_consumer(node: onnx.NodeProto, op_type: str):
        users = consumers.get(node.output[0], [])
        return users[0] if len(users) == 1 and users[0].op_type == op_type else None

    found = []
    for div in graph.node:
        if div.op_type != "Div" or len(div.input) != 2:
            continue
        centered, root = made_by(div.input[0], "Sub"), made_by(div.input[1], "Sqrt")
        shifted = root and made_by(root.input[0], "Add")
        variance = shifted and next((v for v in (made_by(i, "ReduceMean") for i in shifted.input) if v), None)
        square = variance and made_by(variance.input[0], "Pow")
        mean = centered and made_by(centered.input[1], "ReduceMean")
        if not (square and mean and square.input[0] == centered.output[0] and mean.input[0] == centered.input[0]):
            continue
        nodes = [mean, centered, square, variance, shifted, root, div]
        scale = sole_consumer(div, "Mul")
        shift = scale and sole_consumer(scale, "Add")
        nodes += [n for n in (scale, shift) if n]
        constants = [producer[i] for n in nodes for i in n.input if i in producer and producer[i].op_type == "Constant"]
        found.append(nodes + constants)
    return found


def to_fp16(
    model: onnx.ModelProto, *, keep_fp32: tuple[str, ...] = FP16_KEEP_GROUPS
) -> tuple[onnx.ModelProto, Fp16Record]:
    """fp16 weights, activations and K/V cache; the ``keep_fp32`` groups (FP16_KEEP_GROUPS) stay fp32.

    onnxruntime's converter keeps nodes in fp32 one by one: it casts every tensor between two kept nodes to
    fp16 and back, which would store a written-out LayerNorm's squares (and overflow) in fp16 all the same.
    So the tensors inside a kept LayerNorm lose their type information before the conversion (the converter
    leaves tensors it has no type for as they are), and it runs on our own shape inference, which also works
    past protobuf's 2 GB limit.
    """
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from gpt2onnx.passes.graph_tools import infer_value_info

    keep_ops = {op for group in keep_fp32 for op in FP16_KEEP_OPS.get(group, ())}
    kept_nodes: list[onnx.NodeProto] = []
    known = list(model.graph.value_info)  # a fused graph's contrib ops are typed by the fusion pass only
    infer_value_info(model)
    inferred = {v.name for v in model.graph.value_info}
    model.graph.value_info.extend(v for v in known if v.name not in inferred)
    if "layernorm" in keep_fp32:
        kept_nodes = [node for nodes in written_out_layer_norms(model.graph) for node in nodes]
    for index, node in enumerate(kept_nodes):
        node.name = node.name or f"kept_fp32_{index}"  # the converter blocks nodes by name
    names = {n.name for n in kept_nodes}
    _untype_inner_tensors(model.graph, names)
    keep_io = ["logits"] if "logits" in keep_fp32 else []
    kept = Counter(n.op_type for n in model.graph.node if n.op_type in keep_ops or n.name in names)
    ir_version = model.ir_version
    converted = convert_float_to_float16(
        model,
        keep_io_types=keep_io or False,
        op_block_list=sorted(keep_ops),
        node_block_list=sorted(names),
        disable_shape_infer=True,
    )
    _drop_repeated_casts(converted.graph)
    sort_topologically(converted.graph)  # the converter appends its Casts at the end of the node list
    converted.ir_version = ir_version
    log.info("fp16; kept in fp32: %s", dict(kept) or "nothing")
    return converted, Fp16Record(list(keep_fp32), dict(kept), keep_io)


def _untype_inner_tensors(graph: onnx.GraphProto, kept: set[str]) -> None:
    """Drop the type information of the tensors that kept nodes make and only kept nodes read, so that the
    converter leaves them fp32 instead of casting them to fp16 and back between two kept nodes."""
    readers: dict[str, set[str]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.name)
    outputs = {o.name for o in graph.output}
    inner = {
        out
        for node in graph.node
        if node.name in kept
        for out in node.output
        if out not in outputs and readers.get(out, set()) <= kept
    }
    if inner:
        value_info = [v for v in graph.value_info if v.name not in inner]
        del graph.value_info[:]
        graph.value_info.extend(value_info)


def _drop_repeated_casts(graph: onnx.GraphProto) -> None:
    """The converter gives a tensor read by two kept nodes one Cast per reader, each with the same name and
    output: keep the first (they are identical), and one value_info per name."""
    seen: set[str] = set()
    nodes = []
    for node in graph.node:
        if node.op_type == "Cast" and node.output[0] in seen:
            continue
        seen.update(node.output)
        nodes.append(node)
    if len(nodes) != len(graph.node):
        del graph.node[:]
        graph.node.extend(nodes)
    names: set[str] = set()
    infos = [v for v in graph.value_info if not (v.name in names or names.add(v.name))]
    del graph.value_info[:]
    graph.value_info.extend(infos)


# What each quantization method does with the two layers that read vocabulary-sized tensors, the logits projection
# (lm_head) and the token and position embeddings, and its MatMulNBits arithmetic (accuracy_level). None in
# QuantizeOptions means the method's recipe below, chosen from the precision table in docs/benchmarks.md ("What each
# precision costs"): int8's 8-bit embeddings halve its file at the same quality and speed; int4 with everything at
# 4 bits meets its ΔPPL aim (+0.22 %) at the best speed (an 8-bit head, --lm-head int8, cuts KL 5× for size/time).
LAYER_PRECISIONS = ("int4", "int8", "fp32")
ACCURACY_LEVELS = (0, 4)  # MatMulNBits: 0 = fp32 activations, 4 = activations quantized to int8 (VNNI/AVX2/AMX)
RECIPES = {
    "int8": {"lm_head": "int8", "embeddings": "int8", "accuracy_level": None},
    "int4": {"lm_head": "int4", "embeddings": "int4", "accuracy_level": 4},
}
# int8 is MatMulInteger, which has no 4-bit form; int4 may keep either layer at 8 bits or in fp32
LAYER_CHOICES = {"int8": ("int8", "fp32"), "int4": LAYER_PRECISIONS}


@dataclass(frozen=True)
class Int8Scheme:
    """How int8's weights are stored for MatMulInteger (onnxruntime ``quantize_dynamic``'s options); activations are
    always quantized at run time by DynamicQuantizeLinear (uint8, per tensor).

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
SHAPE_OPS = ("Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze", "Flatten")


@dataclass(frozen=True)
class QuantizeOptions:
    """Weight quantization: the method, and what it does with the logits projection and the embeddings.

    method: none, int8 (onnxruntime's quantize_dynamic: MatMulInteger, weights as INT8_SCHEME says: 7-bit, per
        output channel; activations quantized at each step) or int4 (MatMulNBitsQuantizer: symmetric,
        ``block_size`` weights per scale).
    block_size: weights per scale of every block-wise tensor (int4 weights, an 8-bit head under int4, 8-bit
        embeddings); None: DEFAULT_BLOCK_SIZE.
    accuracy_level: int4's MatMulNBits arithmetic (ACCURACY_LEVELS); int4 only.
    lm_head: the logits projection: int4 (MatMulNBits), int8 (MatMulNBits with 8 bits under int4, MatMulInteger
        under int8) or fp32 (the exported Gemm on the tied embedding, left as it is).
    embeddings: the token and position embeddings: int4 or int8 (GatherBlockQuantized) or fp32 (Gather).
    algorithm: how int4 chooses its weights (gpt2onnx.passes.int4.all_algorithms.ALGORITHMS: rtn, hqq, k-quant, gptq);
        int4 only. The embeddings' GatherBlockQuantized is always round to nearest (the other algorithms write
        MatMulNBits only).
    calibration_text: the text a calibrated algorithm (gptq) is calibrated on: a file, or 'dataset:NAME[:CONFIG]
        [:SPLIT]' (the datasets library); None: the standard library's docstrings (offline on every machine).
    mixed_int8: int4 only: the share (percent, above 0 and at most 100) of the 4-bit MatMul weights' parameters
        that may be stored at 8 bits instead, given to the weights measured most sensitive on the calibration text
        (gpt2onnx.passes.mixed_precision); None: every block weight at 4 bits.
    None (accuracy_level, lm_head, embeddings, algorithm): the method's recipe (RECIPES).
    """

    method: str = "none"
    block_size: int | None = None
    accuracy_level: int | None = None
    lm_head: str | None = None
    embeddings: str | None = None
    algorithm: str | None = None
    calibration_text: str | None = None
    mixed_int8: float | None = None

    def __post_init__(self) -> None:  # an invalid one cannot be built: checked here, and only here
        if self.method not in METHODS:
            raise BadInput(f"unknown --quantize '{self.method}': choose one of {', '.join(METHODS)}")
        if self.method == "none":
            if self.block_size is not None:
                raise BadInput("--block-size applies to quantized weights: add --quantize int8 or int4, or drop it")
            for flag, value in (
                ("--accuracy-level", self.accuracy_level),
                ("--lm-head", self.lm_head),
                ("--embeddings", self.embeddings),
                ("--algorithm", self.algorithm),
                ("--calibration", self.calibration_text),
                ("--mixed-int8", self.mixed_int8),
            ):
                if value is not None:
                    raise BadInput(f"{flag} applies to quantized weights: add --quantize int8 or int4, or drop it")
            return
        if self.block_size is not None and self.block_size not in INT4_BLOCK_SIZES:
            raise BadInput(
                f"--block-size {self.block_size} is not supported for {self.method}: choose one of"
                f" {', '.join(map(str, INT4_BLOCK_SIZES))}"
            )
        if self.accuracy_level is not None:
            if self.method != "int4":
                raise BadInput("--accuracy-level applies to int4 (MatMulNBits): drop it, or use --quantize int4")
            if self.accuracy_level not in ACCURACY_LEVELS:
                raise BadInput(
                    f"--accuracy-level {self.accuracy_level} is not supported: choose 0 (fp32 arithmetic) or 4"
                    " (int8 arithmetic)"
                )
        if self.algorithm is not None and self.method != "int4":
            raise BadInput("--algorithm applies to int4 (MatMulNBits): drop it, or use --quantize int4")
        if self.algorithm is not None and self.algorithm not in ALGORITHMS:
            raise BadInput(f"unknown --algorithm '{self.algorithm}': choose one of {', '.join(ALGORITHMS)}")
        if self.mixed_int8 is not None:
            if self.method != "int4":
                raise BadInput(
                    "--mixed-int8 applies to int4 (8-bit layers among 4-bit ones): drop it, or use --quantize int4"
                )
            value = self.mixed_int8
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 100:
                raise BadInput(f"--mixed-int8 {value} is out of range: give a percent above 0 and at most 100")
        if self.calibration_text is not None and not self.needs_calibration:
            calibrated = [a.name for a in ALGORITHMS.values() if a.calibrated]
            raise BadInput(
                f"--calibration applies to a calibrated int4 algorithm ({', '.join(calibrated)}) or to"
                f" --mixed-int8: add --algorithm {calibrated[0]} or --mixed-int8 PERCENT, or drop it"
            )
        choices = LAYER_CHOICES[self.method]
        for flag, value in (("--lm-head", self.lm_head), ("--embeddings", self.embeddings)):
            if value is not None and value not in choices:
                raise BadInput(
                    f"{flag} '{value}' is not valid with --quantize {self.method}: choose {' or '.join(choices)}"
                )

    @property
    def int4_algorithm(self) -> Int4Algorithm:
        """The algorithm int4 uses (the recipe's where none is given); round to nearest for other methods."""
        return ALGORITHMS[self.algorithm or DEFAULT_ALGORITHM]

    @property
    def needs_calibration(self) -> bool:
        """Whether quantizing needs calibration text: a calibrated int4 algorithm, or measured 8-bit layers."""
        return self.method == "int4" and (self.int4_algorithm.calibrated or self.mixed_int8 is not None)

    @property
    def recipe(self) -> "QuantizeRecipe":
        """The options with the method's recipe filled in where they are None."""
        recipe = RECIPES.get(self.method, {"accuracy_level": None, "lm_head": None, "embeddings": None})
        return QuantizeRecipe(
            self.method,
            self.block_size or DEFAULT_BLOCK_SIZE,
            self.accuracy_level if self.accuracy_level is not None else recipe["accuracy_level"],
            self.lm_head or recipe["lm_head"],
            self.embeddings or recipe["embeddings"],
            self.int4_algorithm.name if self.method == "int4" else None,
            self.mixed_int8,
        )

    @property
    def block_wise(self) -> bool:
        """Whether any tensor is quantized block by block (so that block_size matters)."""
        recipe = self.recipe
        return recipe.method == "int4" or recipe.embeddings == "int8"

    def as_dict(self) -> dict:
        if self.method == "none":
            return {"method": "none", "block_size": None}
        recipe = self.recipe
        return {
            "method": recipe.method,
            "block_size": recipe.block_size if self.block_wise else None,
            "accuracy_level": recipe.accuracy_level,
            "lm_head": recipe.lm_head,
            "embeddings": recipe.embeddings,
            **({"algorithm": recipe.algorithm} if recipe.algorithm else {}),
            **({"calibration_text": self.calibration_text} if self.calibration_text else {}),
            **({"mixed_int8": self.mixed_int8} if self.mixed_int8 is not None else {}),
        }


@dataclass(frozen=True)
class QuantizeRecipe:
    """What a QuantizeOptions (already checked) does, its method's recipe filled in (QuantizeOptions.recipe)."""

    method: str
    block_size: int
    accuracy_level: int | None
    lm_head: str | None
    embeddings: str | None
    algorithm: str | None = None  # int4's (ALGORITHMS)
    mixed_int8: float | None = None  # int4: the percent of block weights' parameters that may get 8 bits

    @property
    def int4_algorithm(self) -> Int4Algorithm:
        return ALGORITHMS[self.algorithm or DEFAULT_ALGORITHM]


def logits_projection(graph: onnx.GraphProto) -> onnx.NodeProto | None:
    """The MatMul or Gemm on a weight that makes the ``logits`` output (through reshapes and casts), if any."""
    producer = {out: node for node in graph.node for out in node.output}
    weights = {init.name for init in graph.initializer}
    node = producer.get("logits")
    while node is not None and node.op_type in SHAPE_OPS:
        node = producer.get(node.input[0])
    if node is not None and node.op_type in ("MatMul", "Gemm") and len(node.input) >= 2 and node.input[1] in weights:
        return node
    return None


def embedding_gathers(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The Gathers that read a 2-D float weight: the token and position embeddings."""
    weights = {
        init.name: init
        for init in graph.initializer
        if len(init.dims) == 2 and init.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    }
    return [n for n in graph.node if n.op_type == "Gather" and n.input[0] in weights]


def _gemm_to_matmul(model: onnx.ModelProto, node: onnx.NodeProto) -> bool:
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


def _matmul_nbits(
    model: onnx.ModelProto,
    options: "QuantizeRecipe",
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
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=bits,
        block_size=options.block_size,
        is_symmetric=True,
        accuracy_level=options.accuracy_level or None,  # 0 leaves the attribute out (the op's default)
        nodes_to_exclude=sorted(exclude),
        op_types_to_quantize=("MatMul", "Gather") if gathers else ("MatMul",),
        algo_config=config,
    )
    with _quiet_quantizer():
        quantizer.process()
    quantized = quantizer.model
    return quantized.model if hasattr(quantized, "model") else quantized


@contextlib.contextmanager
def _quiet_quantizer():
    """The vendored neural-compressor path (GPTQ) prints a progress bar on stdout, and HQQ warns about
    non-writable arrays: neither is ours to show (the CLI's output is its own)."""
    import io
    import warnings

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore", UserWarning)
        yield


def _gathers_to_8bit(model: onnx.ModelProto, names: set[str], block_size: int) -> int:
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


def _int8(model: onnx.ModelProto, head, head_apart: set[str], scheme: Int8Scheme) -> onnx.ModelProto:
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


def _quantized_ops(model: onnx.ModelProto) -> dict[str, int]:
    """The quantized ops of a graph by type (with their width where it is not 4 bits): the manifest's record."""
    ops: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type in ("MatMulNBits", "GatherBlockQuantized"):
            bits = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "bits"), 4)
            key = f"{node.op_type}" if bits == 4 else f"{node.op_type} ({bits}-bit)"
            ops[key] = ops.get(key, 0) + 1
        elif node.op_type in ("MatMulInteger", "DynamicQuantizeLinear"):
            ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return ops


def _name_nodes(graph: onnx.GraphProto) -> None:
    """Give every node a name: the quantizers select nodes by name."""
    names = {n.name for n in graph.node if n.name}
    for index, node in enumerate(graph.node):
        if not node.name:
            name = f"{node.op_type}_{index}"
            while name in names:
                name += "_"
            node.name = name
            names.add(name)


def quantize(
    model: onnx.ModelProto,
    options: QuantizeOptions,
    *,
    int8_scheme: Int8Scheme = INT8_SCHEME,
    calibration: Calibration | None = None,
) -> tuple[onnx.ModelProto, QuantizationRecord | None]:
    """Quantize ``model`` (changed in place on the way); returns the new model and what was done.
    ``int8_scheme``: how int8 stores its MatMulInteger weights (INT8_SCHEMES; benchmarks choose another).
    ``calibration``: the token sequences of a calibrated int4 algorithm (required by it, ignored otherwise)."""
    record = options.as_dict()
    options = options.recipe
    if options.method == "none":
        return model, None
    ir_version = model.ir_version
    graph = model.graph
    _name_nodes(graph)
    head = logits_projection(graph)
    if head is None and (options.lm_head != options.method):
        log.warning("no logits projection found (a MatMul or Gemm making 'logits'): --lm-head has no effect")
    gathers = {n.name for n in embedding_gathers(graph)}
    if head is not None and options.lm_head != "fp32":
        _gemm_to_matmul(model, head)
    # the head is quantized with the other MatMuls only at the method's own width
    head_apart = {head.name} if head is not None and options.lm_head != options.method else set()
    graph_names = {n.name: n.input[1] for n in graph.node if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1}
    mixed = None
    if options.method == "int4":
        algorithm = options.int4_algorithm
        if algorithm.calibrated and calibration is None:
            raise ValueError(f"int4 algorithm {algorithm.name} needs calibration token sequences")
        other_gathers = {n.name for n in graph.node if n.op_type == "Gather"} - gathers
        if options.mixed_int8 is not None:  # measured 8-bit layers: kept out of the 4-bit pass, then 8 bits
            from gpt2onnx.passes.mixed_precision import choose_int8_layers

            weights = {init.name for init in graph.initializer}
            candidates = [
                n.name
                for n in graph.node
                if n.op_type == "MatMul" and n.name not in head_apart and len(n.input) > 1 and n.input[1] in weights
            ]
            mixed = choose_int8_layers(
                model,
                candidates,
                budget=options.mixed_int8 / 100,
                block_size=options.block_size,
                calibration=calibration,
            )
            head_apart = head_apart | set(mixed.int8_nodes)
        if algorithm.weight_error is None:  # round to nearest: the embeddings in the same pass
            quantized = _matmul_nbits(
                model,
                options,
                bits=4,
                exclude=head_apart | other_gathers | (gathers if options.embeddings != "int4" else set()),
                gathers=options.embeddings == "int4",
            )
        else:  # the algorithm on the MatMuls, then the embeddings rounded to nearest (GatherBlockQuantized)
            gather_names = {n.name for n in graph.node if n.op_type == "Gather"}
            quantized = _matmul_nbits(
                model,
                options,
                bits=4,
                exclude=head_apart | gather_names,
                gathers=False,
                algorithm=algorithm,
                calibration=calibration,
            )
            if options.embeddings == "int4":
                others = {n.name for n in quantized.graph.node} - gathers
                quantized = _matmul_nbits(quantized, options, bits=4, exclude=others, gathers=True)
        eight_bit = set(mixed.int8_nodes) if mixed is not None else set()
        if head is not None and options.lm_head == "int8":
            eight_bit.add(head.name)
        if eight_bit:
            others = {n.name for n in quantized.graph.node} - eight_bit
            quantized = _matmul_nbits(quantized, options, bits=8, exclude=others, gathers=False)
    else:
        quantized = _int8(model, head, head_apart, int8_scheme)
    if options.embeddings == "int8":
        _gathers_to_8bit(quantized, gathers, options.block_size)
    shared = _share_tied_embedding(quantized) if head is not None and options.method == "int4" else None
    opset = next((i.version for i in quantized.opset_import if i.domain in ("", "ai.onnx")), 0)
    # the int4 quantizer may raise the opset (GatherBlockQuantized); keep the IR version in step with it
    quantized.ir_version = max(ir_version, 10 if opset >= 21 else ir_version)
    ops = _quantized_ops(quantized)
    log.info("quantized (%s): %s", options.method, ops)
    return quantized, QuantizationRecord(
        record["method"],
        record["block_size"],
        ops,
        record["accuracy_level"],
        record["lm_head"],
        record["embeddings"],
        int8_scheme.name if "MatMulInteger" in ops else None,
        options.algorithm,
        calibration.source if calibration is not None and options.method == "int4" else None,
        **_mixed_record(mixed, graph_names),
        shared_embedding=shared,
    )


def _mixed_record(mixed, weight_of: dict[str, str]) -> dict:
    """The manifest's record of measured 8-bit layers: by weight name (the file check's), with every candidate's
    sensitivity."""
    if mixed is None:
        return {}
    return {
        "int8_layers": [weight_of[name] for name in mixed.int8_nodes],
        "sensitivity": {weight_of[name]: kl for name, kl in mixed.sensitivity.items()},
        "int8_share": mixed.int8_share,
    }


def _share_tied_embedding(model: onnx.ModelProto) -> str | None:
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
    producer = {out: node for node in model.graph.node for out in node.output}
    head = producer.get("logits")
    while head is not None and head.op_type in SHAPE_OPS:
        head = producer.get(head.input[0])
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
