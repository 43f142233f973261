"""int4's prompt path on int8 kernels (``--prompt-kernel int8``): one graph, two bodies, one set of weights.

onnxruntime 1.31's MatMulNBits is fast on a few rows (decode reads 4-bit weights) and slow on many (the prompt
step: about 3× MatMulInteger's time on 128 rows of GPT-2's matmuls, a research script, docs/benchmarks.md). This pass
puts every node that depends on a 4-bit MatMulNBits (the block stack, the head and what follows) inside one ``If``
on whether the step is a prompt step (its rows start their sequences: empty past). The condition reads neither the
batch nor the step's length, so a request's prompt runs the same kernels alone, in a batch, left-padded beside a
longer prompt, and in an engine step of any size (a row-count threshold did not: issue 54):

- the decode body (else): the nodes as they were, MatMulNBits on the 4-bit weights;
- the prompt body (then): the same nodes, each 4-bit MatMulNBits replaced by int8's form (activations quantized
  per token, MatMulInteger, the scales; gpt2onnx.precisions.activations) on an int8 [K, N] weight that standard
  ops compute from the MatMulNBits initializers (the nibbles unpacked, the block scales applied, rounded again to 7
  bits per output column as int8 stores its weights). Those ops read only initializers, so onnxruntime's constant
  folding computes each int8 weight once, when the session is created: the file keeps the 4-bit weights only.

Both bodies read the same initializers (outer scope) and write the graph's outputs. The nodes that do not depend
on a 4-bit weight (embeddings, the attention mask's bias, the first layer norm) stay outside, computed once.

Costs, measured in docs/benchmarks.md: the session's creation folds the weights (seconds on the 124M model, and a
transient peak of about 28 bytes per folded weight, since constant folding keeps each intermediate until its pass
ends); the int8 copy stays in memory beside the 4-bit one (1 byte per weight). The prompt's logits carry int8's
7-bit re-rounding of the 4-bit weights on top of int4's rounding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from gpt2onnx.artifact.graph import PROMPT_IF, PROMPT_PATH_MARK
from gpt2onnx.artifact.graph_tools import constant_node
from gpt2onnx.capabilities import Declared, Need
from gpt2onnx.precisions.activations import row_quantize_nodes, zero_point_nodes
from gpt2onnx.registry import Registry

log = logging.getLogger(__name__)

INT8_STEPS = 64  # int8's 7-bit weights ([-64, 64], gpt2onnx.precisions.int8.INT8_SCHEME)
BITS = 4


@dataclass(frozen=True)
class PromptKernel:
    """What --prompt-kernel takes: the kernels a prompt step runs on, and what that declares (whether a row's
    kernels depend on its batch among it: ``batch_dependent``, none for either)."""

    name: str
    summary: str
    declared: Declared


# batch_dependent: the If reads whether the step starts its rows' sequences, never the batch or the step's
# length (a threshold on batch × tokens ran a row's prompt on other kernels beside neighbours: issue 54)
NBITS = PromptKernel(
    "nbits",
    "MatMulNBits, as a decode step",
    Declared("prompt kernel", "nbits", "--prompt-kernel nbits", ensures={"batch_dependent": frozenset()}),
)
INT8 = PromptKernel(
    "int8",
    "int8 kernels for prompt steps, folded from the 4-bit weights at session creation",
    Declared(
        "prompt kernel",
        "int8",
        "--prompt-kernel int8",
        ensures={
            "body_in_if": True,
            "ops": {("", "If"), ("", "MatMulInteger")},
            "batch_dependent": frozenset(),
        },
        requires=(
            Need("weight_bits", allowed={BITS}, why="folds 4-bit weights to int8"),
            Need("zero_points", allowed={False}, why="folds symmetric round-to-nearest weights (no zero points)"),
        ),
        says={
            "body_in_if": "holds the block stack in an If (int8 kernels for prompt steps)",
        },
    ),
)
PROMPT_KERNELS: Registry[PromptKernel] = Registry("prompt kernel", (NBITS, INT8), option="--prompt-kernel")


def kernel_of(quantized_ops) -> PromptKernel:
    """The prompt kernel of a graph, from its quantized ops (gpt2onnx.artifact.graph.quantized_op_counts' names):
    INT8 where it holds int4's prompt path, else NBITS."""
    return INT8 if PROMPT_PATH_MARK in set(quantized_ops) else NBITS


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def foldable(node: onnx.NodeProto) -> bool:
    """A 4-bit MatMulNBits this pass can rewrite: symmetric (no zero points, no group index, no bias)."""
    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
        return False
    return _attrs(node).get("bits", 4) == BITS and not any(node.input[3:])


def int8_weight_nodes(node: onnx.NodeProto, p: str, *, opset: int) -> tuple[list[onnx.NodeProto], str, str]:
    """Standard ops computing, from a symmetric 4-bit MatMulNBits' packed weight [N, blocks, block/2] and scales,
    an int8 [K, N] weight at 7 bits per output column and its column scales [N]; returns (nodes, weight, scales).

    A column's scale is its largest block scale × 8 / 64: round to nearest gives every block a value of -8 (its
    largest |w|), so that is the column's largest |w| / 64, what int8's 7-bit per-column rounding chooses. Then
    w8 = round((q - 8) × 8 × block scale / largest block scale), within [-64, 56]. Few tensors of the weight's
    size are float: constant folding keeps every intermediate until its pass ends. Ops of opset 13 and later
    (``opset``: the graph's; ReduceMax takes its axes as an input from 18)."""
    attrs = _attrs(node)
    k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
    blocks = -(-k // block)
    packed, scales = node.input[1], node.input[2]

    def op(op_type, inputs, suffix, **kwargs):
        return helper.make_node(op_type, inputs, [f"{p}/{suffix}"], name=f"{p}/{suffix}", **kwargs)

    nodes = [
        # int32 Div and Mul, not uint8 BitShift or Div: OpenVINO 2026.4 rounds both on uint8 (143 >> 4 and 143 / 16
        # gave 9), and BitwiseAnd needs opset 18
        op("Cast", [packed], "packed32", to=TensorProto.INT32),
        constant_node(f"{p}/sixteen", np.int32(16)),
        op("Div", [f"{p}/packed32", f"{p}/sixteen"], "high32"),
        op("Mul", [f"{p}/high32", f"{p}/sixteen"], "high_back"),
        op("Sub", [f"{p}/packed32", f"{p}/high_back"], "low32"),
        op("Cast", [f"{p}/high32"], "high", to=TensorProto.UINT8),
        op("Cast", [f"{p}/low32"], "low", to=TensorProto.UINT8),
        constant_node(f"{p}/last", np.array([-1], np.int64)),
        op("Unsqueeze", [f"{p}/low", f"{p}/last"], "low1"),
        op("Unsqueeze", [f"{p}/high", f"{p}/last"], "high1"),
        op("Concat", [f"{p}/low1", f"{p}/high1"], "pairs", axis=-1),  # the low nibble first
        constant_node(f"{p}/blocked", np.array([n, blocks, block], np.int64)),
        op("Reshape", [f"{p}/pairs", f"{p}/blocked"], "q"),  # [N, blocks, block], 0..15
        op("Cast", [f"{p}/q"], "q8", to=TensorProto.INT8),
        constant_node(f"{p}/eight", np.int8(8)),
        op("Sub", [f"{p}/q8", f"{p}/eight"], "centred"),  # -8..7
        op("Cast", [f"{p}/centred"], "centred_float", to=TensorProto.FLOAT),
        constant_node(f"{p}/scale_shape", np.array([n, blocks, 1], np.int64)),
        op("Reshape", [scales, f"{p}/scale_shape"], "block_scales"),
        op("Abs", [f"{p}/block_scales"], "block_abs"),
        *(
            [constant_node(f"{p}/blocks_axis", np.array([1], np.int64))]
            + [op("ReduceMax", [f"{p}/block_abs", f"{p}/blocks_axis"], "largest0", keepdims=1)]  # [N, 1, 1]
            if opset >= 18
            else [op("ReduceMax", [f"{p}/block_abs"], "largest0", axes=[1], keepdims=1)]
        ),
        constant_node(f"{p}/tiny", np.float32(1e-30)),
        op("Max", [f"{p}/largest0", f"{p}/tiny"], "largest"),
        constant_node(f"{p}/eight_float", np.float32(8)),
        op("Mul", [f"{p}/block_scales", f"{p}/eight_float"], "block_scales8"),
        op("Div", [f"{p}/block_scales8", f"{p}/largest"], "ratio"),  # [N, blocks, 1], within [-8, 8]
        op("Mul", [f"{p}/centred_float", f"{p}/ratio"], "steps"),
        op("Round", [f"{p}/steps"], "rounded"),
        op("Cast", [f"{p}/rounded"], "int8_blocked", to=TensorProto.INT8),
        constant_node(f"{p}/rows", np.array([n, blocks * block], np.int64)),
        op("Reshape", [f"{p}/int8_blocked", f"{p}/rows"], "int8_nk"),
        constant_node(f"{p}/columns", np.array([n], np.int64)),
        op("Reshape", [f"{p}/largest", f"{p}/columns"], "largest_n"),
        constant_node(f"{p}/column_steps", np.float32(INT8_STEPS / 8)),
        op("Div", [f"{p}/largest_n", f"{p}/column_steps"], "column_scales"),  # largest × 8 / 64
    ]
    weight = f"{p}/int8_nk"
    if blocks * block != k:  # the last block padded: keep K columns
        nodes += [
            constant_node(f"{p}/start", np.array([0], np.int64)),
            constant_node(f"{p}/k", np.array([k], np.int64)),
            constant_node(f"{p}/axis1", np.array([1], np.int64)),
            op("Slice", [weight, f"{p}/start", f"{p}/k", f"{p}/axis1"], "int8_nk_cut"),
        ]
        weight = f"{p}/int8_nk_cut"
    nodes.append(op("Transpose", [weight], "int8_kn", perm=[1, 0]))  # [K, N]
    return nodes, f"{p}/int8_kn", f"{p}/column_scales"


def int8_matmul_nodes(x: str, weight: str, scales: str, y: str, p: str, *, opset: int) -> list[onnx.NodeProto]:
    """int8's matmul as --quantize int8 writes it: activations quantized to uint8 per token
    (gpt2onnx.precisions.activations), MatMulInteger, each token's zero point taken off, then token scale ×
    column scales."""
    quantize, q, x_scale, x_zero = row_quantize_nodes(x, f"{p}/quantize", opset=opset)
    matmul = helper.make_node("MatMulInteger", [q, weight, ""], [f"{p}/int32"], name=f"{p}/matmul")
    before, after, _ = zero_point_nodes(matmul, x_zero, f"{p}/zero")  # its weight is computed: sums too
    return [
        *quantize,
        *before,
        matmul,
        *after,
        helper.make_node("Cast", [f"{p}/int32"], [f"{p}/float"], name=f"{p}/cast", to=TensorProto.FLOAT),
        helper.make_node("Mul", [x_scale, scales], [f"{p}/scale"], name=f"{p}/scale"),
        helper.make_node("Mul", [f"{p}/float", f"{p}/scale"], [y], name=f"{p}/scaled"),
    ]


def _body_nodes(graph: onnx.GraphProto, starts: list[onnx.NodeProto]) -> list[int]:
    """Indices of ``starts`` and every node that depends on them, in the graph's order."""
    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            consumers.setdefault(name, []).append(i)
    index = {id(node): i for i, node in enumerate(graph.node)}
    body, todo = set(), [index[id(node)] for node in starts]
    while todo:
        i = todo.pop()
        if i in body:
            continue
        body.add(i)
        for name in graph.node[i].output:
            todo.extend(consumers.get(name, ()))
    return sorted(body)


def _renamed(node: onnx.NodeProto, names: dict[str, str], prefix: str) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    for i, name in enumerate(copy.input):
        copy.input[i] = names.get(name, name)
    for i, name in enumerate(copy.output):
        copy.output[i] = names.get(name, name)
    copy.name = f"{prefix}/{node.name}" if node.name else ""
    return copy


def _starts_a_sequence(graph: onnx.GraphProto, ids: str) -> list[onnx.NodeProto]:
    """Nodes computing the If's condition: the step starts its rows' sequences (a prompt step, empty past). Read
    from the positions where the graph takes them (a prompt's first real token is at 0 in every row, a later
    step's at 1 or more, padding at 1), else from the mask (no past columns); never from the batch or the
    sequence's length, so a row runs the same kernels alone, beside others, and left-padded to a longer one."""
    inputs = {i.name for i in graph.input}
    c = f"{PROMPT_IF}"
    if "position_ids" in inputs:
        return [
            helper.make_node("ReduceMin", ["position_ids"], [f"{c}/first"], name=f"{c}/first", keepdims=0),
            constant_node(f"{c}/zero", np.int64(0)),
            helper.make_node("Equal", [f"{c}/first", f"{c}/zero"], [f"{c}/many"], name=f"{c}/many"),
        ]
    mask = next(i.name for i in graph.input if i.name == "attention_mask")
    return [
        helper.make_node("Shape", [ids], [f"{c}/ids_shape"], name=f"{c}/ids_shape"),
        helper.make_node("Shape", [mask], [f"{c}/mask_shape"], name=f"{c}/mask_shape"),
        helper.make_node("Equal", [f"{c}/ids_shape", f"{c}/mask_shape"], [f"{c}/same"], name=f"{c}/same"),
        constant_node(f"{c}/one", np.int64(1)),
        helper.make_node("Gather", [f"{c}/same", f"{c}/one"], [f"{c}/many"], name=f"{c}/many", axis=0),
    ]


def int8_prompt_path(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (an int4 graph, changed in place) with its 4-bit MatMulNBits' dependents in one If: a prompt step
    (empty past) runs them on int8 kernels, others on MatMulNBits (see the module's docstring)."""
    graph = model.graph
    matmuls = [n for n in graph.node if foldable(n)]
    if not matmuls:
        raise ValueError("--prompt-kernel int8 needs 4-bit round-to-nearest MatMulNBits weights: the graph has none")
    others = [
        n.name for n in graph.node if n.op_type == "MatMulNBits" and not foldable(n) and _attrs(n).get("bits") == 4
    ]
    if others:
        raise ValueError(f"--prompt-kernel int8 takes symmetric 4-bit weights (no zero points): {others[0]} has them")
    inside = _body_nodes(graph, matmuls)
    body = [graph.node[i] for i in inside]
    outside = [n for i, n in enumerate(graph.node) if i not in set(inside)]
    produced = {name for node in body for name in node.output if name}
    outputs = [o for o in graph.output if o.name in produced]
    ids = next((i.name for i in graph.input if i.name == "input_ids"), graph.input[0].name)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 13:
        raise ValueError(f"--prompt-kernel int8 needs opset 13 or later: the graph has {opset}")

    branches = {}
    for prefix in ("prompt", "decode"):
        names = {name: f"{prefix}/{name}" for name in produced}
        nodes = []
        for node in body:
            if prefix == "prompt" and foldable(node):
                p = f"prompt/{node.name or node.output[0]}"
                weight_nodes, weight, scales = int8_weight_nodes(node, p, opset=opset)
                x = names.get(node.input[0], node.input[0])
                nodes += weight_nodes + int8_matmul_nodes(x, weight, scales, names[node.output[0]], p, opset=opset)
            else:
                nodes.append(_renamed(node, names, prefix))
        branch_outputs = []
        for out in outputs:
            info = onnx.ValueInfoProto()
            info.CopyFrom(out)
            info.name = names[out.name]
            branch_outputs.append(info)
        branches[prefix] = helper.make_graph(nodes, f"{PROMPT_IF}_{prefix}", [], branch_outputs)
    condition = _starts_a_sequence(graph, ids)
    choice = helper.make_node(
        "If",
        [f"{PROMPT_IF}/many"],
        [o.name for o in outputs],
        name=PROMPT_IF,
        then_branch=branches["prompt"],
        else_branch=branches["decode"],
    )
    del graph.node[:]
    graph.node.extend([*outside, *condition, choice])
    kept = [v for v in graph.value_info if v.name not in produced]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    log.info("int8 prompt path: %d MatMulNBits also on int8 kernels in prompt steps", len(matmuls))
    return model


def without_prompt_path(model: onnx.ModelProto) -> bool:
    """``model`` (changed in place) with int4's prompt path taken out: the If replaced by its decode body, every
    step on the 4-bit MatMulNBits, as the graph was before the pass; returns whether it held one. The files made
    for runtimes whose kernels the prompt body does not suit are made so: fp16's (DynamicQuantizeLinear takes
    float32 only) and the browser's (its MatMulNBits is what it runs well)."""
    graph = model.graph
    node = next((n for n in graph.node if n.op_type == "If" and n.name == PROMPT_IF), None)
    if node is None:
        return False
    body = next(a.g for a in node.attribute if a.name == "else_branch")
    prefix = "decode/"

    def plain(name: str) -> str:
        return name[len(prefix) :] if name.startswith(prefix) else name

    inlined = []
    for inner in body.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(inner)
        for i, name in enumerate(copy.input):
            copy.input[i] = plain(name)
        for i, name in enumerate(copy.output):
            copy.output[i] = plain(name)
        copy.name = plain(copy.name)
        inlined.append(copy)
    if [plain(o.name) for o in body.output] != list(node.output):
        raise ValueError(f"the {PROMPT_IF} If's decode body does not write its outputs: the graph is damaged")
    kept = [n for n in graph.node if n is not node and not n.name.startswith(f"{PROMPT_IF}/")]
    del graph.node[:]
    graph.node.extend(kept + inlined)
    log.info("int4 prompt path taken out: the decode body's %d nodes inlined", len(inlined))
    return True
