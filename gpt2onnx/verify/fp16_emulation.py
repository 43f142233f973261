"""fp16 arithmetic as a GPU does it, emulated on ONNX Runtime's CPU provider.

The CPU provider has few fp16 kernels on x86: it runs an fp16 graph's other nodes in fp32 and drops the
casts between them (measured: Pow(3000, 2) then Sqrt gives 3000 there, where fp16 gives inf). So an fp16
graph that overflows on a GPU passes on the CPU, and a CPU-only check of fp16 would prove nothing.

:func:`emulate_fp16` rewrites an fp16 model into an fp32 one that rounds every tensor the graph declares
fp16 to fp16 (a Cast to fp16 and back after the node that makes it): each node computes from fp16 values
and its result is stored with fp16's range and precision, as GPU kernels do (fp32 accumulation, fp16
storage). Past 65504 a value becomes inf, as it would there. What the graph keeps in fp32 stays fp32.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from gpt2onnx.artifact.graph import load_model

log = logging.getLogger(__name__)

_ORT_TYPES = {"tensor(float16)": TensorProto.FLOAT16, "tensor(float)": TensorProto.FLOAT}


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """The element type of every node output, as ONNX Runtime infers it (contrib ops included): a session on
    the weightless skeleton of the model with every node output made a graph output."""
    import onnxruntime as ort

    from gpt2onnx.artifact.graph_tools import skeleton

    probe = skeleton(model)
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.ValueInfoProto(name=out) for node in probe.graph.node for out in node.output if out)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every node output
    options.log_severity_level = 3
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return {out.name: _ORT_TYPES.get(out.type, TensorProto.UNDEFINED) for out in session.get_outputs()}


def _to_fp32(tensor: TensorProto) -> TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name)


def emulate_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """An fp32 model that computes what ``model`` (fp16) computes on fp16 hardware; ``model`` is changed."""
    types = tensor_types(model)
    graph = model.graph
    for index, init in enumerate(graph.initializer):
        if init.data_type == TensorProto.FLOAT16:
            graph.initializer[index].CopyFrom(_to_fp32(init))
    for value in (*graph.input, *graph.output):
        if value.type.tensor_type.elem_type == TensorProto.FLOAT16:
            value.type.tensor_type.elem_type = TensorProto.FLOAT
    del graph.value_info[:]  # ONNX Runtime infers the new types
    nodes, rounded = [], 0
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT16:
                attr.t.CopyFrom(_to_fp32(attr.t))
            elif node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT16:
                attr.i = TensorProto.FLOAT
        nodes.append(node)
        for i, out in enumerate(node.output):
            if out and types.get(out) == TensorProto.FLOAT16:
                node.output[i] = f"{out}/fp32"
                nodes.append(helper.make_node("Cast", [f"{out}/fp32"], [f"{out}/fp16"], to=TensorProto.FLOAT16))
                nodes.append(helper.make_node("Cast", [f"{out}/fp16"], [out], to=TensorProto.FLOAT))
                rounded += 1
    del graph.node[:]
    graph.node.extend(nodes)
    log.info("fp16 emulation: %d tensors rounded to fp16", rounded)
    return model


def write_emulated_fp16(model_path: Path, out_path: Path) -> Path:
    """:func:`emulate_fp16` of the model at ``model_path``, saved (weights as external data) at ``out_path``."""
    model = emulate_fp16(load_model(model_path))
    onnx.save_model(model, str(out_path), save_as_external_data=True, location=out_path.name + "_data")
    return out_path
