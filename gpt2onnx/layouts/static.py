"""ai.onnx Attention with past → the same attention over one fixed-size K/V buffer per layer, updated in place by
``TensorScatter`` (opset 24): the static layout (its rewrite runs after a profile's standard Attention fusion).

    Attention(q, k, v, bias, past_key, past_value)                          → (y, present_key, present_value)
 ⇒ present_key   = TensorScatter(past_key,   heads(k), write_indices, axis=2)
   present_value = TensorScatter(past_value, heads(v), write_indices, axis=2)
   y             = merge(Attention(heads(q), present_key, present_value, Pad(bias to the buffer's length)))

past_key_values.{i}.* and present.{i}.* are then one buffer of M columns (``past_buffer_length``, whatever the
caller allocates: prompt + new tokens, or the whole context). Buffer column j holds the K/V of attention_mask
column j in every row (the contract's left padding), so nothing new is asked of the caller:

    write_indices = Expand(T − S, [B])        T: the mask's width, S: the step's tokens (input_ids' width)

TensorScatter writes row b's S new K/V at columns [T − S, T) (the same column for every row: left padding
lines the rows up at the right). The [B, 1, S, T] additive mask the graph builds once for every layer
(causal + padding) is padded once with the lowest finite value to [B, 1, S, M], so columns T..M − 1 (zeros,
or what an earlier sequence left) are never attended; onnxruntime's Attention wants the mask's last dim to be
the K/V length (it refuses a shorter one, which the spec would pad). Attention takes 4-D q/k/v here (its
kernel wants q and k of one rank): the heads are split before it and merged after it, as in the exporter's
graph.

onnxruntime 1.31's TensorScatter kernel writes in place when its past and present are one buffer (IO binding
of the same OrtValue to both; otherwise it logs a warning and copies), so a decode step moves no cache at all;
Attention reads all M columns, so its cost follows the buffer's length, not the past's.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from gpt2onnx.errors import BadInput
from gpt2onnx.layouts.layout import HOST_MEMORY, STATIC_BUFFER, CacheLayout, attribute, name_buffer_io

STATIC_KV_OPSET = 24  # TensorScatter's first opset
MASK, IDS = "attention_mask", "input_ids"  # layout.MASK
WRITE_INDICES = "static_kv/write_indices"
P = "static_kv/"
# ai.onnx Attention's input slots (opset 23)
_Q, _K, _V, _MASK, _PAST_K, _PAST_V = range(6)


def _const(name: str, array: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name), name=name)


def _shared_nodes(first_past: str) -> list[onnx.NodeProto]:
    """write_indices ([B] int64) and the mask padding ([8] int64: the buffer's length − T at the end of the last
    axis), computed once from the graph inputs."""
    return [
        helper.make_node("Shape", [MASK], [P + "width"], start=1, end=2, name=P + "width"),
        helper.make_node("Shape", [IDS], [P + "sequence"], start=1, end=2, name=P + "sequence"),
        helper.make_node("Shape", [IDS], [P + "batch"], start=0, end=1, name=P + "batch"),
        helper.make_node("Sub", [P + "width", P + "sequence"], [P + "write"], name=P + "write"),
        helper.make_node("Expand", [P + "write", P + "batch"], [WRITE_INDICES], name=P + "write_indices"),
        helper.make_node("Shape", [first_past], [P + "buffer"], start=2, end=3, name=P + "buffer"),
        helper.make_node("Sub", [P + "buffer", P + "width"], [P + "unwritten"], name=P + "unwritten"),
        _const(P + "no_pads", np.zeros(7, np.int64)),
        helper.make_node("Concat", [P + "no_pads", P + "unwritten"], [P + "pads"], axis=0, name=P + "pads"),
    ]


class _Rewriter:
    def __init__(self, heads: int, head_dim: int):
        self.heads, self.head_dim = heads, head_dim
        self.padded: dict[str, str] = {}  # mask value → its padded copy (one Pad per distinct mask)
        self.nodes: list[onnx.NodeProto] = [
            _const(P + "heads_shape", np.array([0, 0, heads, head_dim], np.int64)),
            _const(P + "embed_shape", np.array([0, 0, heads * head_dim], np.int64)),
            _const(P + "lowest", np.array(np.finfo(np.float32).min, np.float32)),
        ]

    def _heads(self, x: str, tag: str) -> str:
        self.nodes += [
            helper.make_node("Reshape", [x, P + "heads_shape"], [f"{tag}/split"], name=f"{tag}/split"),
            helper.make_node("Transpose", [f"{tag}/split"], [f"{tag}/heads"], perm=[0, 2, 1, 3], name=f"{tag}/heads"),
        ]
        return f"{tag}/heads"

    def _mask(self, mask: str) -> str:
        if mask not in self.padded:
            name = f"{P}padded_mask{len(self.padded)}"
            self.nodes.append(helper.make_node("Pad", [mask, P + "pads", P + "lowest"], [name], name=name))
            self.padded[mask] = name
        return self.padded[mask]

    def rewrite(self, node: onnx.NodeProto, index: int) -> None:
        ins = list(node.input) + [""] * (6 - len(node.input))
        if not ins[_MASK] or not ins[_PAST_K] or not ins[_PAST_V] or len(node.output) < 3 or not all(node.output[:3]):
            raise BadInput(
                f"Attention '{node.name}' is not q, k, v + mask + past K/V → present K/V: it cannot use a static cache"
            )
        if attribute(node, "is_causal", 0) or attribute(node, "softcap", 0.0):
            raise BadInput(f"Attention '{node.name}' is causal or soft-capped on its own: not handled")
        tag = f"{P}layer{index}"
        present_key, present_value = node.output[1], node.output[2]
        q = self._heads(ins[_Q], tag + "/q")
        k = self._heads(ins[_K], tag + "/k")
        v = self._heads(ins[_V], tag + "/v")
        scale = attribute(node, "scale")
        self.nodes += [
            helper.make_node(
                "TensorScatter", [ins[_PAST_K], k, WRITE_INDICES], [present_key], axis=2, name=f"{tag}/write_key"
            ),
            helper.make_node(
                "TensorScatter", [ins[_PAST_V], v, WRITE_INDICES], [present_value], axis=2, name=f"{tag}/write_value"
            ),
            helper.make_node(
                "Attention",
                [q, present_key, present_value, self._mask(ins[_MASK])],
                [f"{tag}/y_heads"],
                name=node.name or f"{tag}/attention",
                **({"scale": scale} if scale is not None else {}),
            ),
            helper.make_node(
                "Transpose", [f"{tag}/y_heads"], [f"{tag}/y_merged"], perm=[0, 2, 1, 3], name=f"{tag}/merge"
            ),
            helper.make_node("Reshape", [f"{tag}/y_merged", P + "embed_shape"], [node.output[0]], name=f"{tag}/y"),
        ]


def _past_shape(node: onnx.NodeProto, rewriter: _Rewriter, index: int) -> list[onnx.NodeProto]:
    """A Shape read of a past input (optimum's graph takes the past length from it), computed from the contract
    instead: [batch, heads, T − S, head_dim] (the buffer's own length is not the past's)."""
    p = f"{P}past_shape{index}/"
    nodes = [
        _const(p + "heads", np.array([rewriter.heads], np.int64)),
        _const(p + "head_dim", np.array([rewriter.head_dim], np.int64)),
        helper.make_node("Concat", [P + "batch", p + "heads", P + "write", p + "head_dim"], [p + "shape"], axis=0),
    ]
    start, end = attribute(node, "start", 0), attribute(node, "end")
    if start == 0 and end is None:
        return nodes + [helper.make_node("Identity", [p + "shape"], list(node.output), name=node.name or None)]
    nodes += [
        _const(p + "start", np.array([start], np.int64)),
        _const(p + "end", np.array([end if end is not None else 4], np.int64)),
    ]
    return nodes + [
        helper.make_node("Slice", [p + "shape", p + "start", p + "end"], list(node.output), name=node.name or None)
    ]


def static_kv_cache(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """``model`` (changed in place) with every ai.onnx Attention reading a fixed-size K/V buffer that TensorScatter
    updates, and the number rewritten. The cache and mask dims get the buffer contract's names
    (gpt2onnx.layouts.layout); the model's ai.onnx opset must be 24 or more."""
    graph = model.graph
    names = {i.name for i in graph.input}
    if MASK not in names or IDS not in names:
        raise BadInput(f"the graph has no '{MASK}' or '{IDS}' input: a static cache needs both")
    pasts = {v.name: v for v in graph.input if v.name.startswith("past_key_values.")}
    first = next(iter(pasts.values()))
    heads, head_dim = (first.type.tensor_type.shape.dim[axis].dim_value for axis in (1, 3))
    rewriter = _Rewriter(heads, head_dim)
    kept, replaced = [], 0
    for node in graph.node:
        if node.op_type == "Attention" and node.domain in ("", "ai.onnx"):
            rewriter.rewrite(node, replaced)
            replaced += 1
        elif node.op_type == "Shape" and node.input[0] in pasts:
            rewriter.nodes.extend(_past_shape(node, rewriter, len(rewriter.nodes)))
        else:
            rewriter.nodes.append(node)
        kept.append(node)
    if not replaced:
        return model, 0
    nodes = rewriter.nodes
    readers = sorted(
        {n.op_type for n in nodes if set(n.input) & set(pasts) and n.op_type != "TensorScatter"}
        - {"Shape"}  # the buffer length read (static_kv/buffer)
    )
    if readers:
        raise BadInput(
            f"the graph reads its past K/V outside attention ({', '.join(readers)}): it cannot use a static cache"
        )
    del graph.node[:]
    graph.node.extend(_shared_nodes(first.name) + nodes)  # the shared nodes read only graph inputs
    name_buffer_io(graph, {o for n in kept if n.op_type == "Attention" for o in n.output})
    return model, replaced


LAYOUT = CacheLayout(
    name="static",
    summary="one fixed-size buffer per layer, written in place by TensorScatter (standard ONNX, opset 24)",
    binding=STATIC_BUFFER,
    marks=frozenset({"TensorScatter"}),
    rewrite=static_kv_cache,
    reads=("", "Attention"),
    check="static_kv",
    makes=(("", "TensorScatter"), 2),
    opset=STATIC_KV_OPSET,
    ensures={"cache_grows": False, "cache_in_place": True, "host_buffers": True},
    requires=(HOST_MEMORY,),
    says={
        "cache_grows": "keeps one fixed-size K/V buffer per layer (TensorScatter), which a growing past does not fit",
        "quantizable_cache": "keeps a float buffer (TensorScatter and Attention store no quantized cache)",
    },
)
