"""Helpers shared by the graph rewrites (the fusion rules, the cache layouts, the precisions' passes)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def constant_value(value) -> float | None:
    """The scalar a value holds when it is a constant (initializer or folded Constant), else None."""
    if value is None or value.const_value is None:
        return None
    array = np.asarray(value.const_value.numpy())
    if array.size != 1:
        return None
    return float(array.reshape(()))


def static_dim(value, axis: int) -> int | None:
    shape = value.shape if value is not None else None
    if shape is None or len(shape) <= abs(axis):
        return None
    dim = shape[axis]
    return dim if isinstance(dim, int) else None


def skeleton(model):
    """The model without its large weights: each initializer of more than ``SMALL`` elements becomes a typed
    graph input instead. Shape inference needs only types and the small constants, and this way it runs on
    models past protobuf's 2 GB limit (gpt2-xl) without copying gigabytes."""
    from onnx import helper

    small, typed = [], []
    for init in model.graph.initializer:
        count = int(np.prod(init.dims)) if len(init.dims) else 1
        if count <= SMALL:
            small.append(init)
        else:
            typed.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    graph = helper.make_graph(
        list(model.graph.node), model.graph.name, [*model.graph.input, *typed], list(model.graph.output), small
    )
    out = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    return out


SMALL = 1024


def infer_value_info(model) -> None:
    """Attach onnx's inferred shapes to ``model`` (in place), inferring on its skeleton."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(skeleton(model))
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)


def constant_node(name: str, value) -> onnx.NodeProto:
    """A Constant node named ``name`` whose output, also ``name``, holds ``value`` (an array or a scalar)."""
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name), name=name)
