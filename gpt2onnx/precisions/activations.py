"""Activations quantized one token at a time, for MatMulInteger (int8, and int4's int8 prompt body).

onnxruntime's quantize_dynamic writes DynamicQuantizeLinear, whose one scale and zero point span the whole step: a
row's quantized values, and so its logits, depended on the other rows of its batch (issue 54). Here each token's
activations (a row of the last axis) are quantized on their own, as DynamicQuantizeLinear quantizes a tensor
(uint8 over [min, 0, max], a zero point of its own): MatMulInteger keeps its u8s8 kernels (with int8's 7-bit
weights no pair sum can saturate AVX2's 16-bit VPMADDUBSW: 255 × 64 × 2 < 32768). onnxruntime's CPU MatMulInteger
takes only a scalar zero point, so it runs with 0 and each token's zero point is taken off its int32 products
after it (zero × the weight's column sums, exact in int32); the per-token scale is applied where the column
scales are. A symmetric per-token scale around a fixed 128 kept MatMulInteger's own zero point but lost a bit on
one-sided activations (after GELU): mean KL 2.7e-3 against 3.1e-5 on the trained test fixture. A token's values
are the same alone, in a batch and left-padded."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROW_LEVELS = 255  # a token's range [min(x, 0), max(x, 0)] in 255 steps, as DynamicQuantizeLinear spans a tensor's


def row_quantize_nodes(
    x: str, p: str, *, opset: int, outputs: tuple[str, str, str] | None = None
) -> tuple[list[onnx.NodeProto], str, str, str]:
    """Nodes quantizing ``x`` [..., K] to uint8 one token (last-axis row) at a time, as DynamicQuantizeLinear does a
    whole tensor: scale = (max(x_row, 0) - min(x_row, 0)) / 255 (a row of zeros gets a tiny one), zero point =
    round(-min / scale), q = clip(round(x / scale) + zero point, 0, 255). Returns (nodes, q, scale [..., 1] float,
    zero point [..., 1] int32: MatMulInteger takes only a scalar one, so :func:`zero_point_nodes` subtracts it
    after the integer matmul). Standard ops of opset 13 and later (ReduceMax takes its axes as an input from 18).
    ``outputs``: the names to write q, scale and zero point as (default: under ``p``)."""
    q_name, scale_name, zero_name = outputs or (f"{p}/q", f"{p}/scale", f"{p}/zero")

    def op(op_type, inputs, suffix, out=None, **kwargs):
        return helper.make_node(op_type, inputs, [out or f"{p}/{suffix}"], name=f"{p}/{suffix}", **kwargs)

    def const(suffix, value):
        name = f"{p}/{suffix}"
        return helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(value, name))

    def reduce(kind, suffix):
        if opset >= 18:
            return [op(kind, [x, f"{p}/last_axis"], suffix)]
        return [op(kind, [x], suffix, axes=[-1])]

    nodes = [
        *([const("last_axis", np.array([-1], np.int64))] if opset >= 18 else []),
        *reduce("ReduceMax", "max0"),  # keepdims: [..., 1]
        *reduce("ReduceMin", "min0"),
        const("zero_float", np.float32(0)),
        op("Max", [f"{p}/max0", f"{p}/zero_float"], "max"),
        op("Min", [f"{p}/min0", f"{p}/zero_float"], "min"),
        op("Sub", [f"{p}/max", f"{p}/min"], "range0"),
        const("tiny", np.float32(1e-30)),
        op("Max", [f"{p}/range0", f"{p}/tiny"], "range"),
        const("levels", np.float32(ROW_LEVELS)),
        op("Div", [f"{p}/range", f"{p}/levels"], "scale", scale_name),
        op("Div", [f"{p}/levels", f"{p}/range"], "inverse"),
        op("Mul", [f"{p}/min", f"{p}/inverse"], "min_steps"),
        op("Neg", [f"{p}/min_steps"], "zero_steps"),
        op("Round", [f"{p}/zero_steps"], "zero_float_point"),  # within [0, 255]
        op("Mul", [x, f"{p}/inverse"], "steps_x"),
        op("Round", [f"{p}/steps_x"], "rounded"),
        op("Add", [f"{p}/rounded", f"{p}/zero_float_point"], "shifted"),
        const("low", np.float32(0)),
        const("high", np.float32(ROW_LEVELS)),
        op("Clip", [f"{p}/shifted", f"{p}/low", f"{p}/high"], "clipped"),
        op("Cast", [f"{p}/clipped"], "q", q_name, to=TensorProto.UINT8),
        op("Cast", [f"{p}/zero_float_point"], "zero", zero_name, to=TensorProto.INT32),
    ]
    return nodes, q_name, scale_name, zero_name


def zero_point_nodes(
    matmul: onnx.NodeProto, zero: str, p: str, initializers: dict[str, onnx.TensorProto] | None = None
) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto], list[onnx.TensorProto]]:
    """``matmul`` (a MatMulInteger on per-token q, changed in place) run with a zero point of 0, and the nodes that
    take each token's zero point off its integer products after it: y = q·w' - zero × Σ_k w', in int32 (exact),
    where w' is the weight less its own zero point. Where the weight is one of ``initializers``, Σ_k w' is computed
    here and stored ([N] int32): computed in the graph, onnxruntime's constant folding makes an int32 copy of the
    weight while loading (the 124M int8 file peaked at 1.3 GB, 0.34 GB without). A weight the graph computes
    (int4's int8 prompt body) gets the sums in the graph, folded with it. Returns (the nodes to place before the
    matmul, those after it, the initializers to add)."""
    weight, weight_zero = matmul.input[1], (matmul.input[3] if len(matmul.input) > 3 else "")
    out = matmul.output[0]

    def op(op_type, inputs, suffix, outputs=None, **kwargs):
        return helper.make_node(op_type, inputs, outputs or [f"{p}/{suffix}"], name=f"{p}/{suffix}", **kwargs)

    def const(suffix, value):
        name = f"{p}/{suffix}"
        return helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(value, name))

    nodes, added = [const("no_zero", np.uint8(0))], []
    initializers = initializers or {}
    if weight in initializers and (not weight_zero or weight_zero in initializers):
        w = np.asarray(numpy_helper.to_array(initializers[weight]), np.int64)  # [K, N]
        if weight_zero:
            w = w - np.asarray(numpy_helper.to_array(initializers[weight_zero]), np.int64)
        added.append(numpy_helper.from_array(w.sum(axis=0).astype(np.int32), f"{p}/column_sums"))  # |Σ| ≤ K × 255
    else:
        column = f"{p}/w32"
        nodes.append(op("Cast", [weight], "w32", to=TensorProto.INT32))
        if weight_zero:
            nodes += [op("Cast", [weight_zero], "wz32", to=TensorProto.INT32), op("Sub", [column, f"{p}/wz32"], "wc")]
            column = f"{p}/wc"
        nodes += [
            const("k_axis", np.array([0], np.int64)),
            op("ReduceSum", [column, f"{p}/k_axis"], "column_sums", keepdims=0),  # [N]
        ]
    after = [
        op("Mul", [zero, f"{p}/column_sums"], "offsets"),
        op("Sub", [f"{p}/products", f"{p}/offsets"], "corrected", [out]),
    ]
    matmul.input[2] = f"{p}/no_zero"
    matmul.output[0] = f"{p}/products"
    return nodes, after, added


def per_token_activations(model: onnx.ModelProto) -> int:
    """``model`` (changed in place) with each DynamicQuantizeLinear (one scale for the whole step) replaced by
    row_quantize_nodes (one per token), each MatMulInteger reading it followed by zero_point_nodes; the scales'
    Mul reads the same name, the scale now [..., 1], which broadcasts against the weights' column scales.
    Returns how many it replaced."""
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    zeros = {}  # a replaced DynamicQuantizeLinear's q → its per-token zero point
    initializers = {t.name: t for t in graph.initializer}
    nodes, replaced, sums = [], set(), []
    for node in graph.node:
        if node.op_type == "DynamicQuantizeLinear" and node.domain in ("", "ai.onnx"):
            p = f"{node.name or node.output[0]}/per_token"
            outputs = tuple(out or f"{p}/unused_{i}" for i, out in enumerate([*node.output, "", ""][:3]))
            nodes += row_quantize_nodes(node.input[0], p, opset=opset, outputs=outputs)[0]
            zeros[outputs[0]] = outputs[2]
            replaced.update(node.output)
        elif node.op_type == "MatMulInteger" and node.input[0] in zeros:
            p = f"{node.name or node.output[0]}/per_token"
            before, after, added = zero_point_nodes(node, zeros[node.input[0]], p, initializers)
            nodes += [*before, node, *after]
            sums += added
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(sums)
    kept = [v for v in graph.value_info if v.name not in replaced]  # the scale is [..., 1] now, not a scalar
    del graph.value_info[:]
    graph.value_info.extend(kept)
    return len(zeros)
