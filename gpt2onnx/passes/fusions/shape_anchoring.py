"""A clean-up pass before the fusion rules: reads of intermediate shapes are re-anchored on the graph inputs.

Exporters read shapes from the middle of the attention subgraph (optimum's SDPA export takes the head size
from Shape(query heads) and the output shape from Shape(merged heads)). Those reads are "other uses" of
values inside the pattern, and a rewrite must not delete a value something else still reads. Symbolic shape
inference (onnxruntime's) tells what each read really is: a static number, or a dimension of a graph input
(batch_size, sequence_length, ...). The pass replaces such a Shape, or the Gather/Slice of it, by constants
and Shape(input, start, end) reads, after which the attention subgraph has no outside readers.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import helper, numpy_helper

from gpt2onnx.artifact.graph import sort_topologically
from gpt2onnx.artifact.graph_tools import skeleton

log = logging.getLogger(__name__)


def _dims(value_info) -> list[int | str | None]:
    shape = value_info.type.tensor_type.shape
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in shape.dim]


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    values = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer if len(init.dims) <= 1}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return values


def _select(dims: list, node: onnx.NodeProto, constants: dict) -> list | None:
    """The dims a Gather(shape, idx) or Slice(shape, starts, ends[, axes[, steps]]) picks, if its indices are
    constant."""
    if node.op_type == "Gather":
        idx = constants.get(node.input[1])
        if idx is None or idx.ndim > 1:
            return None
        return [dims[int(i)] for i in np.atleast_1d(idx)]  # a scalar index gives one dim, squeezed by the caller
    if node.op_type == "Slice":
        params = [constants.get(name) for name in node.input[1:]]
        if any(p is None for p in params):
            return None
        starts, ends = int(params[0][0]), int(params[1][0])
        axes = int(params[2][0]) if len(params) > 2 else 0
        steps = int(params[3][0]) if len(params) > 3 else 1
        if axes != 0 or steps != 1:
            return None
        return dims[starts:ends] if ends < 2**62 else dims[starts:]
    return None


class _Emitter:
    """Nodes that compute dims from the graph inputs' own shapes (``anchors``: dim name → (input, axis))."""

    def __init__(self, anchors: dict[str, tuple[str, int]]):
        self.anchors, self.count = anchors, 0

    def fresh(self, base: str) -> str:
        self.count += 1
        return f"{base}__anchored_{self.count}"

    def emit(self, dims: list, output: str, scalar: bool = False) -> list[onnx.NodeProto] | None:
        """Nodes computing the int64 vector of ``dims`` (or a scalar) into ``output``; None if a dim is unknown."""
        if any(not isinstance(d, int) and d not in self.anchors for d in dims):
            return None
        nodes, parts = [], []
        for dim in dims:
            part = self.fresh(output)
            if isinstance(dim, int):
                value = numpy_helper.from_array(np.array([dim], np.int64))
                nodes.append(helper.make_node("Constant", [], [part], value=value))
            else:
                source, axis = self.anchors[dim]
                nodes.append(helper.make_node("Shape", [source], [part], start=axis, end=axis + 1))
            parts.append(part)
        vector = self.fresh(output) if scalar else output
        if len(parts) == 1:
            nodes.append(helper.make_node("Identity", [parts[0]], [vector]))
        else:
            nodes.append(helper.make_node("Concat", parts, [vector], axis=0))
        if scalar:
            axes = self.fresh(output)
            value = numpy_helper.from_array(np.array([0], np.int64))
            nodes.append(helper.make_node("Constant", [], [axes], value=value))
            nodes.append(helper.make_node("Squeeze", [vector, axes], [output]))
        return nodes


# About 70 lines: one walk over the graph that rewrites a Shape's readers or the Shape itself; its cases share
# the walk's state (the nodes kept, dropped and replaced).
def anchor_shapes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Returns the model with intermediate shape reads replaced, and how many reads were replaced."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        inferred = SymbolicShapeInference.infer_shapes(skeleton(model), auto_merge=True)
    except Exception as err:  # symbolic inference gives up on some graphs; the pass is an optimization
        log.info("symbolic shape inference failed (%s); shape reads left as they are", err)
        return model, 0
    graph = model.graph
    shapes = {v.name: _dims(v) for v in (*inferred.graph.value_info, *inferred.graph.output)}
    graph_inputs = {i.name for i in graph.input}
    anchors: dict[str, tuple[str, int]] = {}
    for value in graph.input:
        for axis, dim in enumerate(_dims(value)):
            if isinstance(dim, str):
                anchors.setdefault(dim, (value.name, axis))
    constants = _constants(model)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    emit = _Emitter(anchors).emit

    new_nodes: list[onnx.NodeProto] = []
    replaced = 0
    dropped: set[int] = set()
    for node in graph.node:
        if id(node) in dropped:
            continue
        if node.op_type != "Shape" or node.input[0] in graph_inputs or node.input[0] not in shapes:
            new_nodes.append(node)
            continue
        dims = shapes[node.input[0]]
        attrs = {a.name: a.i for a in node.attribute}
        dims = dims[attrs.get("start", 0) : attrs.get("end", len(dims))]
        # Prefer replacing the Gather/Slice that reads this shape: it may select static dims only.
        readers = consumers.get(node.output[0], [])
        handled_all, replacement = True, []
        for reader in readers:
            picked = _select(dims, reader, constants)
            scalar = (
                reader.op_type == "Gather"
                and constants.get(reader.input[1]) is not None
                and constants[reader.input[1]].ndim == 0
            )
            nodes = emit(picked, reader.output[0], scalar=scalar) if picked is not None else None
            if nodes is None:
                handled_all = False
                continue
            replacement += nodes
            dropped.add(id(reader))
            replaced += 1
        if handled_all:
            new_nodes += replacement
            continue
        whole = emit(dims, node.output[0])
        if whole is None:
            new_nodes.append(node)
            new_nodes += replacement
        else:
            new_nodes += whole + replacement
            replaced += 1
    kept = [n for n in new_nodes if id(n) not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    sort_topologically(graph)  # the new shape nodes were placed where their readers were
    return model, replaced
