"""ONNX files on disk: finding the model in a folder, loading its graph without the weights, saving it
(with external data past protobuf's 2 GB limit), and the facts the manifest records of a graph."""

from __future__ import annotations

import contextlib
import heapq
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.json_format import ParseError
from google.protobuf.message import DecodeError

from gpt2onnx.artifact.contract import graph_io
from gpt2onnx.artifact.paths import file_in_folder
from gpt2onnx.errors import BadInput, ContractError
from gpt2onnx.files import open_regular, require_regular
from gpt2onnx.layouts.all_layouts import layout_of
from gpt2onnx.layouts.layout import CacheLayout

log = logging.getLogger(__name__)

PROMPT_IF = "int4_prompt_path"  # the If of int4's prompt path on int8 kernels (gpt2onnx.precisions.prompt_path)
PROMPT_PATH_MARK = "If (int8 prompt path)"  # its name among a graph's quantized ops
PROTOBUF_LIMIT = 2**31  # a single ONNX protobuf file cannot exceed 2 GB
DATA_FILE_SUFFIX = "_data"


def resolve_model_path(path: str | Path) -> Path:
    """The .onnx file ``path`` names: the file itself, or a folder's model.onnx (or its only .onnx file)."""
    path = Path(path)
    if not path.exists():
        raise BadInput(f"'{path}': no such file or folder")
    if path.is_dir():
        candidates = sorted(path.glob("*.onnx"))
        if (path / "model.onnx").is_file():
            return path / "model.onnx"
        if len(candidates) == 1:
            return candidates[0]
        raise ContractError(
            f"'{path}' holds no model.onnx{' (and several .onnx files)' if candidates else ''}: give the file"
        )
    return path


def _check_regular_file(path: Path) -> None:
    """Only regular files are read, and none past protobuf's limit."""
    size = require_regular(path, f"'{path}'", "give an .onnx file or an exported folder").st_size
    if size >= PROTOBUF_LIMIT:
        raise ContractError(f"'{path}' is {size:,} bytes, past protobuf's 2 GB limit: it is not an ONNX graph")


def load_graph(path: Path) -> onnx.ModelProto:
    """The graph without its weights; a clear error for anything that is not ONNX."""
    path = Path(path)
    _check_regular_file(path)
    try:
        # format="protobuf": onnx would otherwise pick a parser from the extension (a .json file as JSON text).
        model = onnx.load(str(path), format="protobuf", load_external_data=False)
    except (DecodeError, ParseError, RuntimeError, ValueError, OSError, UnicodeDecodeError) as err:
        raise ContractError(
            f"'{path}' is not an ONNX model ({type(err).__name__}); give a .onnx file or an exported folder"
        ) from None
    if not model.graph.node and not model.graph.input:
        raise ContractError(
            f"'{path}' is not an ONNX model (it holds no graph); give a .onnx file or an exported folder"
        )
    return model


def load_model(path: Path) -> onnx.ModelProto:
    """The graph with its weights. gpt2onnx reads the external data itself: each file a plain name inside the
    model's folder and a regular file, each tensor's bytes inside it. (onnx's loader refuses a data file with more
    than one hard link, which is how deploy keeps one copy of the weights for every target.)"""
    model = load_graph(Path(path))
    with _ExternalData(path) as data:
        for tensor in _tensors(model.graph):
            data.fill(tensor)
    return model


class _ExternalData(contextlib.ExitStack):
    """The external data files beside the model file ``path``, each opened once, when a tensor first names it."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = Path(path)
        self.opened: dict[str, object] = {}

    def fill(self, tensor: onnx.TensorProto) -> None:
        """Move the tensor's external bytes (if it has any) into it."""
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            return
        info = {entry.key: entry.value for entry in tensor.external_data}
        name = info.get("location", "")
        if name not in self.opened:
            file = file_in_folder(self.path.parent, name, what="external data file", where=self.path)
            self.opened[name] = self.enter_context(open_regular(file, "external data file"))
        handle, offset = self.opened[name], int(info.get("offset") or 0)
        length = int(info["length"]) if info.get("length") else -1
        handle.seek(offset)
        data = handle.read(length)
        if length >= 0 and len(data) != length:
            raise ContractError(
                f"'{self.path}': the weight '{tensor.name}' is bytes {offset:,} to {offset + length:,} of '{name}',"
                " which ends before them: export the folder again"
            )
        tensor.raw_data = data
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]


def _tensors(graph: onnx.GraphProto):
    """Every tensor a graph holds: its initializers and its nodes' tensor attributes, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
            yield from attr.tensors
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _tensors(attr.g)
            for g in attr.graphs:
                yield from _tensors(g)


_POSITION_TABLE = re.compile(r"^(?:transformer\.)?wpe(?:\.weight)?$")


def position_table_rows(model: onnx.ModelProto) -> int | None:
    """Rows of the graph's learned position table (wpe): the most positions the graph can embed. The table is
    the initializer a Gather (or int4's GatherBlockQuantized) reads with the ``position_ids`` input, else
    the initializer named wpe. None when the graph has neither (a folded table)."""
    inits = {init.name: init for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type in ("Gather", "GatherBlockQuantized") and len(node.input) > 1:
            table = inits.get(node.input[0])
            if node.input[1] == "position_ids" and table is not None and len(table.dims) >= 2:
                return int(table.dims[0])
    for init in model.graph.initializer:
        if _POSITION_TABLE.match(init.name) and len(init.dims) == 2:
            return int(init.dims[0])
    return None


def external_data_files(model: onnx.ModelProto) -> list[str]:
    """The external data files the graph's initializers point at (names relative to the model file)."""
    return sorted(
        {
            entry.value
            for init in model.graph.initializer
            if init.data_location == onnx.TensorProto.EXTERNAL
            for entry in init.external_data
            if entry.key == "location"
        }
    )


QUANTIZED_CACHE_OP = "GroupQueryAttention"  # the attention op whose k_scale and v_scale a quantized cache has


@dataclass(frozen=True)
class GraphFacts:
    """What a command needs to know about a decoder, read from its graph (never from a manifest, which is a
    claim about the graph: a hand-edited one could say anything). ``dtype``: the K/V cache's (float16 for an
    fp16 export, whose logits may stay float32); ``quantization``: int4 (4-bit MatMulNBits), int8
    (MatMulInteger) or none; ``logits_last``: the logits output has one position (exported with --logits
    last); ``vocab_size``: the logits' last dimension, when fixed; ``data_files``: the external data files its
    weights are read from; ``kv_dtype``: the cache's element type (``dtype``, or int8/uint8 for a quantized
    cache: --kv-cache); ``ops``: (domain, op type) of every node, subgraphs included (ai.onnx's domain is "");
    ``layout``: its K/V cache layout (gpt2onnx.layouts), told by its ops; ``padding_dependent``: its attention
    sums follow a row's left padding (a fused attention op, or attention the batch-invariance pass did not align);
    ``batch_dependent``: what else of a row's arithmetic depends on its batch (gpt2onnx.passes.batch_invariance)."""

    dtype: str = "float32"
    quantized_ops: frozenset[str] = frozenset()
    logits_last: bool = False
    vocab_size: int | None = None
    data_files: tuple[str, ...] = ()
    position_rows: int | None = None
    kv_dtype: str = "float32"
    ops: frozenset[tuple[str, str]] = frozenset()
    padding_dependent: bool = False
    batch_dependent: frozenset[str] = frozenset()

    @property
    def layout(self) -> CacheLayout:
        """The graph's K/V cache layout, told by its ops (a manifest's kv_cache is the layout's name)."""
        return layout_of(op for _, op in self.ops)


# the names of the nodes gpt2onnx.passes.batch_invariance writes (a graph read here says whether it has them), and
# the padding, in columns, its alignment makes every row's (a multiple of every CPU's vector width in floats)
ALIGNED, PAIRED = "aligned_attention/", "paired_rows/"
PADDING_PERIOD = 16
FUSED_ATTENTION = {
    ("", "Attention"),
    ("com.microsoft", "Attention"),
    ("com.microsoft", "MultiHeadAttention"),
    ("com.microsoft", "GroupQueryAttention"),
}
LONE_ROWS = "MatMulNBits' one-row kernel, which a lone row of a step goes through (a graph exported before 2026-12-07)"


def all_nodes(graph: onnx.GraphProto, *, prompt_body: bool = False):
    """The graph's nodes and those of its subgraphs (If, Loop, Scan bodies), depth first. int4's prompt path
    (PROMPT_IF) holds its nodes twice: only the decode body's (MatMulNBits) unless ``prompt_body``."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if node.op_type == "If" and node.name == PROMPT_IF and attr.name == "then_branch" and not prompt_body:
                continue
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(attr.g, prompt_body=prompt_body)
            for g in attr.graphs:
                yield from all_nodes(g, prompt_body=prompt_body)


def quantized_op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """The quantized ops of a graph by kind, with their width where it is not 4 bits ('MatMulNBits (8-bit)'): the
    manifest's record, and what tells a graph's precision (gpt2onnx.precisions.all_precisions.precision_of)."""
    ops: dict[str, int] = {}
    for node in all_nodes(model.graph):
        if node.op_type == "If" and node.name == PROMPT_IF:
            ops[PROMPT_PATH_MARK] = ops.get(PROMPT_PATH_MARK, 0) + 1
        elif node.op_type in ("MatMulNBits", "GatherBlockQuantized"):
            bits = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "bits"), 4)
            key = f"{node.op_type}" if bits == 4 else f"{node.op_type} ({bits}-bit)"
            ops[key] = ops.get(key, 0) + 1
        elif node.op_type in ("MatMulInteger", "DynamicQuantizeLinear"):
            ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return ops


def graph_facts(model: onnx.ModelProto) -> GraphFacts:
    """The :class:`GraphFacts` of a graph (loaded without its weights)."""
    inputs, outputs = graph_io(model)
    presents = [t for t in outputs if t.name.startswith("present")]
    logits = next((t for t in outputs if t.name == "logits"), None)
    kv_dtype = presents[0].dtype if presents else (logits.dtype if logits is not None else "float32")
    # a quantized cache (integer presents) is written on fp32 graphs only (gpt2onnx.precisions.kv_cache)
    dtype = kv_dtype if kv_dtype.startswith(("float", "bfloat")) else "float32"
    ops = {
        ("" if node.domain == "ai.onnx" else node.domain, node.op_type)
        for node in all_nodes(model.graph, prompt_body=True)
    }
    dims = logits.dims if logits is not None else ()
    names = [node.name for node in all_nodes(model.graph, prompt_body=True)]
    aligned = any(name.startswith(ALIGNED) for name in names)
    paired = any(name.startswith(PAIRED) for name in names)
    softmax = ("", "Softmax") in ops
    return GraphFacts(
        dtype=dtype,
        quantized_ops=frozenset(quantized_op_counts(model)),
        logits_last=len(dims) == 3 and dims[1] == 1,
        vocab_size=dims[-1] if dims and isinstance(dims[-1], int) else None,
        data_files=tuple(external_data_files(model)),
        position_rows=position_table_rows(model),
        kv_dtype=kv_dtype,
        ops=frozenset(ops),
        padding_dependent=bool(ops & FUSED_ATTENTION) or (softmax and not aligned),
        batch_dependent=frozenset([LONE_ROWS] if ("com.microsoft", "MatMulNBits") in ops and not paired else []),
    )


def graph_summary(model: onnx.ModelProto) -> dict:
    """What the manifest records of a graph: opset, domains, node count."""
    opset_imports = {imp.domain or "ai.onnx": imp.version for imp in model.opset_import}
    return {"opset": opset_imports.get("ai.onnx"), "opset_imports": opset_imports, "node_count": len(model.graph.node)}


def tensor_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer)


def save_onnx(model: onnx.ModelProto, path: Path, *, external_data: bool | None) -> list[str]:
    """Save ``model``; weights go to ``<name>_data`` when asked, or automatically past the 2 GB limit.
    Returns the names of the files written."""
    if external_data is None:
        external_data = tensor_bytes(model) > PROTOBUF_LIMIT - 2**26  # leave room for the graph itself
        if external_data:
            log.info("model exceeds protobuf's 2 GB limit: writing weights to an external data file")
    if not external_data:
        onnx.save_model(model, str(path))
        return [path.name]
    data_name = path.name + DATA_FILE_SUFFIX
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data_name,
        size_threshold=1024,
    )
    return [path.name, data_name]


def sort_topologically(graph: onnx.GraphProto) -> bool:
    """Reorder ``graph.node`` so that every node comes after the nodes that make its inputs (ONNX requires it;
    check_model(full_check=True) and onnxsim reject a graph that is not sorted). Stable: nodes already in
    order keep their order. One pass over the nodes and their inputs (Kahn's algorithm), so it is cheap even
    for the 124M graph. A cycle or an input nobody makes leaves the rest in its old order. Returns whether
    the order changed."""
    nodes = list(graph.node)
    made_by = {out: index for index, node in enumerate(nodes) for out in node.output if out}
    waiting_on = [0] * len(nodes)
    consumers: list[list[int]] = [[] for _ in nodes]
    for index, node in enumerate(nodes):
        producers = {made_by[name] for name in node.input if name in made_by and made_by[name] != index}
        waiting_on[index] = len(producers)
        for producer in producers:
            consumers[producer].append(index)
    ready = [index for index, count in enumerate(waiting_on) if count == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for consumer in consumers[index]:
            waiting_on[consumer] -= 1
            if waiting_on[consumer] == 0:
                heapq.heappush(ready, consumer)
    placed = set(order)
    order += [index for index in range(len(nodes)) if index not in placed]
    if order == list(range(len(nodes))):
        return False
    del graph.node[:]
    graph.node.extend(nodes[index] for index in order)
    return True


def cache_scales(model: onnx.ModelProto, model_path: Path) -> dict | None:
    """A quantized K/V cache's scales (GroupQueryAttention's k_scale and v_scale inputs, each [1, heads, 1,
    head_dim] float32) by the name of the past input each scales; None for a float cache.
    ``model``: the graph of ``model_path``, loaded with or without its weights (external ones are read beside it)."""
    import numpy as np
    from onnx import numpy_helper

    initializers = {init.name: init for init in model.graph.initializer}
    by_past = {}
    with _ExternalData(model_path) as data:
        for node in all_nodes(model.graph, prompt_body=True):  # int4's prompt path holds them in its If
            if node.op_type != QUANTIZED_CACHE_OP or len(node.input) < 14 or not node.input[12]:
                continue
            for past, scale in ((node.input[3], node.input[12]), (node.input[4], node.input[13])):
                tensor = onnx.TensorProto()
                tensor.CopyFrom(initializers[scale])
                data.fill(tensor)
                by_past[past] = np.asarray(numpy_helper.to_array(tensor), np.float32)
    return by_past or None
