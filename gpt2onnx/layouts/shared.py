"""The shared layout: MultiHeadAttention with past → com.microsoft.GroupQueryAttention, whose past and present can
share one preallocated buffer per layer (the rewrite runs after the com.microsoft fusions of a profile).

    MultiHeadAttention(q, k, v, -, -, bias, past_key, past_value)               → (y, present_key, present_value)
 ⇒ GroupQueryAttention(q, k, v, past_key, past_value, seqlens_k, total_len, -, -, -, bias) → the same outputs
    num_heads = kv_num_heads = H, the scale kept, do_rotary = 0 (GPT-2's positions are the wpe Gather upstream).

GroupQueryAttention writes the S new K/V rows of every row b at columns [seqlens_k[b] + 1 − S, seqlens_k[b] + 1)
of present and attends to the columns before seqlens_k[b] + 1. When past and present are bound to the same
buffer (same address: onnxruntime infers the sharing, there is no flag) it writes in place and copies nothing;
otherwise it copies past into a new present, like MultiHeadAttention does.

The contract's left-padded layout stays: buffer column j holds the K/V of attention_mask column j, in every row.
So the two length inputs come from the mask's *width* T, the same for every row:

    total_sequence_length = int32(Shape(attention_mask)[1])                                  (scalar)
    seqlens_k             = Expand(total_sequence_length − 1, Shape(attention_mask)[0:1])    ([B])

and padding is excluded by the additive [B, 1, S, T] bias (causal + padding) the graph already builds, as
attention_bias. (onnxruntime-genai's model builder uses ReduceSum(mask) − 1: right-padding semantics, which
would write a left-padded row's new token at the wrong column.)

The onnxruntime 1.31 kernels: the CPU provider runs it in fp32 and fp16; the CUDA provider has fp16/bf16 kernels
only and rejects attention_bias, so a graph from this pass runs on the CPU provider only. The head size must be a
multiple of 8 (GPT-2's is 64): the pass refuses other models.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from gpt2onnx.capabilities import Need
from gpt2onnx.errors import BadInput
from gpt2onnx.layouts.layout import SHARED_BUFFER, CacheLayout, attribute, name_buffer_io

MS = "com.microsoft"
MASK = "attention_mask"  # layout.MASK
SEQLENS_K = "shared_kv/seqlens_k"
TOTAL_LEN = "shared_kv/total_sequence_length"
HEAD_DIM_MULTIPLE = 8  # onnxruntime's GroupQueryAttention: "head_size must be a multiple of 8"
# MultiHeadAttention's input slots (com.microsoft, version 1)
_Q, _K, _V, _BIAS, _KEY_PADDING_MASK, _ATTN_BIAS, _PAST_K, _PAST_V = range(8)


def _length_nodes() -> list[onnx.NodeProto]:
    """seqlens_k ([B] int32) and total_sequence_length (int32 scalar), from the mask's width."""

    def const(name: str, array: np.ndarray) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name), name=name)

    return [
        const("shared_kv/axis0", np.array([0], np.int64)),
        const("shared_kv/one", np.array(1, np.int32)),
        helper.make_node("Shape", [MASK], ["shared_kv/width"], start=1, end=2, name="shared_kv/width"),
        helper.make_node("Shape", [MASK], ["shared_kv/batch"], start=0, end=1, name="shared_kv/batch"),
        helper.make_node(
            "Cast", ["shared_kv/width"], ["shared_kv/width_i32"], to=TensorProto.INT32, name="shared_kv/cast"
        ),
        helper.make_node("Squeeze", ["shared_kv/width_i32", "shared_kv/axis0"], [TOTAL_LEN], name="shared_kv/total"),
        helper.make_node("Sub", [TOTAL_LEN, "shared_kv/one"], ["shared_kv/last"], name="shared_kv/last"),
        helper.make_node("Expand", ["shared_kv/last", "shared_kv/batch"], [SEQLENS_K], name="shared_kv/seqlens_k"),
    ]


def _past_shape_nodes(node: onnx.NodeProto, heads: int, head_dim: int, index: int) -> list[onnx.NodeProto]:
    """A Shape read of a past input (optimum's graph takes the past length from it), computed from the contract
    instead: [batch, heads, mask width − sequence length, head_dim]. With a shared buffer, the past input's own
    length is the buffer's, not the past's."""
    p = f"shared_kv/past_shape{index}/"

    def const(name: str, value: int) -> onnx.NodeProto:
        array = np.array([value], np.int64)
        return helper.make_node("Constant", [], [p + name], value=numpy_helper.from_array(array, p + name))

    nodes = [
        const("heads", heads),
        const("head_dim", head_dim),
        helper.make_node("Shape", ["input_ids"], [p + "batch"], start=0, end=1),
        helper.make_node("Shape", ["input_ids"], [p + "sequence"], start=1, end=2),
        helper.make_node("Sub", ["shared_kv/width", p + "sequence"], [p + "past"]),
        helper.make_node("Concat", [p + "batch", p + "heads", p + "past", p + "head_dim"], [p + "shape"], axis=0),
    ]
    start, end = attribute(node, "start", 0), attribute(node, "end")
    if start == 0 and end is None:
        return nodes + [helper.make_node("Identity", [p + "shape"], list(node.output), name=node.name or None)]
    nodes += [const("start", start), const("end", end if end is not None else 4)]
    return nodes + [
        helper.make_node("Slice", [p + "shape", p + "start", p + "end"], list(node.output), name=node.name or None)
    ]


def _as_group_query_attention(node: onnx.NodeProto) -> onnx.NodeProto:
    ins = list(node.input) + [""] * (8 - len(node.input))
    if ins[_BIAS] or ins[_KEY_PADDING_MASK] or not ins[_ATTN_BIAS] or not ins[_PAST_K] or not ins[_PAST_V]:
        raise BadInput(
            f"MultiHeadAttention '{node.name}' is not q, k, v + attention_bias + past K/V: it cannot share its cache"
        )
    if len(node.output) != 3 or not all(node.output):
        raise BadInput(f"MultiHeadAttention '{node.name}' has no present K/V outputs: it cannot share its cache")
    if attribute(node, "unidirectional", 0):
        raise BadInput(f"MultiHeadAttention '{node.name}' is unidirectional (its own causal mask): not handled")
    heads = attribute(node, "num_heads")
    attributes = {"num_heads": heads, "kv_num_heads": heads, "do_rotary": 0}
    if attribute(node, "scale") is not None:
        attributes["scale"] = attribute(node, "scale")
    return helper.make_node(
        "GroupQueryAttention",
        [ins[_Q], ins[_K], ins[_V], ins[_PAST_K], ins[_PAST_V], SEQLENS_K, TOTAL_LEN, "", "", "", ins[_ATTN_BIAS]],
        list(node.output),  # cos_cache, sin_cache, position_ids left out: no rotary
        name=(node.name.replace("MultiHeadAttention", "GroupQueryAttention") or None),
        domain=MS,
        **attributes,
    )


def share_kv_cache(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """``model`` (changed in place) with every MultiHeadAttention replaced by GroupQueryAttention, and the
    number replaced. The cache and mask dims get the buffer contract's names (gpt2onnx.layouts.layout)."""
    graph = model.graph
    if MASK not in {i.name for i in graph.input}:
        raise BadInput(f"the graph has no '{MASK}' input: a shared cache needs the mask")
    pasts = {v.name: v for v in graph.input if v.name.startswith("past_key_values.")}
    first = next(iter(pasts.values()))
    heads, head_dim = (first.type.tensor_type.shape.dim[axis].dim_value for axis in (1, 3))
    nodes, replaced = [], 0
    for node in graph.node:
        if node.op_type == "MultiHeadAttention" and node.domain == MS:
            nodes.append(_as_group_query_attention(node))
            replaced += 1
        elif node.op_type == "Shape" and node.input[0] in pasts and "input_ids" in {i.name for i in graph.input}:
            nodes.extend(_past_shape_nodes(node, heads, head_dim, len(nodes)))
        else:
            nodes.append(node)
    if not replaced:
        return model, 0
    readers = sorted({n.op_type for n in nodes if set(n.input) & set(pasts) and n.op_type != "GroupQueryAttention"})
    if readers:
        raise BadInput(
            f"the graph reads its past K/V outside attention ({', '.join(readers)}): it cannot share its cache"
        )
    if head_dim % HEAD_DIM_MULTIPLE:
        raise BadInput(
            f"a shared K/V cache needs a head size that is a multiple of {HEAD_DIM_MULTIPLE} (onnxruntime's"
            f" GroupQueryAttention), this model's is {head_dim}: choose a profile with the concatenating cache"
        )
    del graph.node[:]
    graph.node.extend(_length_nodes() + nodes)  # the length nodes read only a graph input
    name_buffer_io(graph, {o for n in nodes if n.op_type == "GroupQueryAttention" for o in n.output})
    if not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))
    return model, replaced


LAYOUT = CacheLayout(
    name="shared",
    summary="one buffer per layer for the whole sequence, written in place by GroupQueryAttention (cpu provider)",
    binding=SHARED_BUFFER,
    marks=frozenset({"GroupQueryAttention"}),
    rewrite=share_kv_cache,
    reads=(MS, "MultiHeadAttention"),
    keeps_reads=False,
    check="shared_kv",
    makes=((MS, "GroupQueryAttention"), 1),
    ensures={"cache_in_place": True, "host_buffers": True, "quantizable_cache": True},
    requires=(
        Need(
            "device_memory",
            allowed={False},
            why="runs on the cpu provider only (onnxruntime's CUDA GroupQueryAttention has no fp32 kernel and no"
            " attention_bias; the stepper binds host buffers)",
        ),
    ),
    says={"quantizable_cache": "stores the cache as GroupQueryAttention's int8 or int4"},
)
