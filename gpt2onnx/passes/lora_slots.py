"""Switchable LoRA: slots in the base graph whose factors onnxruntime overrides at run time.

Each adapted weight's MatMul ``x @ W`` (the head's Gemm ``x @ Wᵀ``) becomes ``x @ W + (x @ A) @ B``, A [in, r]
and B [r, out] being overridable initializers (graph inputs with a default): rank 0 by default, so that with no
adapter active the branch adds zeros and the graph is the base. An adapter is a file in onnxruntime's adapter
format (``.onnx_adapter``, ``onnxruntime.AdapterFormat``) holding, per module, Aᵀ and the scale folded into Bᵀ
under the slot's names, of the slot's type; a run binds them as inputs (``RunOptions.add_active_adapter`` does the
same for ``session.run``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from gpt2onnx.artifact.lora import SLOT_ADD, LoraSlot, slot_inputs
from gpt2onnx.errors import ContractError

log = logging.getLogger(__name__)


def add_lora_slots(model: onnx.ModelProto, slots: list[LoraSlot]) -> int:
    """Add a LoRA branch to the MatMul of every slot's weight (in place); returns the count added."""
    graph = model.graph
    weights = {slot.reads or slot.weight: slot for slot in slots}
    nodes, added = [], 0
    for node in graph.node:
        nodes.append(node)
        if node.op_type not in ("MatMul", "Gemm") or node.input[1] not in weights:
            continue
        slot = weights.pop(node.input[1])
        out = node.output[0]
        base = f"{out}/base"
        node.output[0] = base
        nodes += [
            helper.make_node("MatMul", [node.input[0], slot.a], [f"{out}/lora_a"], name=f"{slot.a}/MatMul"),
            helper.make_node("MatMul", [f"{out}/lora_a", slot.b], [f"{out}/lora_b"], name=f"{slot.b}/MatMul"),
            helper.make_node("Add", [base, f"{out}/lora_b"], [out], name=f"{slot.weight}{SLOT_ADD}"),
        ]
        graph.initializer.extend(
            [
                numpy_helper.from_array(np.zeros((slot.fan_in, 0), np.float32), slot.a),
                numpy_helper.from_array(np.zeros((0, slot.fan_out), np.float32), slot.b),
            ]
        )
        graph.input.extend(
            [
                helper.make_tensor_value_info(slot.a, TensorProto.FLOAT, [slot.fan_in, slot.rank_dim]),
                helper.make_tensor_value_info(slot.b, TensorProto.FLOAT, [slot.rank_dim, slot.fan_out]),
            ]
        )
        added += 1
    if weights:
        raise ContractError(f"no MatMul reads {', '.join(sorted(weights))}: the graph has no place for its LoRA slot")
    del graph.node[:]
    graph.node.extend(nodes)
    log.info("added %d LoRA slots", added)
    return added


def slot_dtypes(model: onnx.ModelProto) -> dict[str, np.dtype]:
    """Each LoRA slot's element type as the passes left it: fp32, or fp16 in an fp16 graph (the factors an adapter
    file holds must be of that type)."""
    names = set(slot_inputs(model))
    return {
        i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        for i in model.graph.input
        if i.name in names
    }


def write_adapter_file(path: Path, factors: dict[str, np.ndarray], dtypes: dict[str, np.dtype]) -> None:
    """``factors`` (slot name → array) in onnxruntime's adapter format, each of its slot's type (``dtypes``)."""
    import onnxruntime as ort

    adapter = ort.AdapterFormat()
    adapter.set_adapter_version(1)
    adapter.set_model_version(1)
    # an OrtValue from numpy holds no copy: the typed arrays must live until the file is written
    arrays = {name: np.ascontiguousarray(v, dtypes[name]) for name, v in factors.items()}
    adapter.set_parameters({name: ort.OrtValue.ortvalue_from_numpy(v) for name, v in arrays.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    adapter.export_adapter(str(path))
