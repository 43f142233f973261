"""A row's arithmetic independent of its batch: the same logits alone, batched and left-padded (issue 54).

Two things in onnxruntime's CPU kernels made a row's sums depend on its neighbours, measured with 1.31 on an
AVX-512 Xeon (tests/serving/test_batch_invariance.py holds the bitwise checks):

1. **Left padding.** A left-padded row's scores and values sit ``pad`` columns further right than alone. Softmax
   and MatMul sum along that axis in an order tied to the column index and the row's address: their results
   change unless ``pad`` is a multiple of 4 there (the period is the kernels' vector width and unrolling, so it
   differs between CPUs). The first rewrite puts columns in front of both, in the graph, to a multiple of ALIGN::

       Softmax(scores) → P;  MatMul(P, V)
    ⇒ Softmax(Concat(lowest [B, H, S, pad], scores)) → P';  MatMul(P', Concat(zeros [B, H, pad, D], V))
       pad = (−T) mod ALIGN

   T is the mask's width (the scores' last axis). Whatever a row's own padding, its real columns then sit at the
   same index modulo ALIGN as alone, every row starts aligned, and a batch adds whole blocks of ALIGN masked
   columns in front (exp(lowest − max) = 0 and 0 × v add exact zeros). ALIGN = 16 is a multiple of every CPU
   vector width in floats (4 NEON, 8 AVX2, 16 AVX-512). A fused attention op (MultiHeadAttention,
   GroupQueryAttention, Attention) sums inside its kernel, which no rewrite reaches: its profile declares so
   (the capability ``padding_dependent``) and the batching engine runs such rows in groups by their padding.
2. **Odd row counts.** ``MatMulNBits`` (int4, int8-weights) computes rows in pairs, and a lone row (a step of
   one row, or the last of an odd count) through another kernel whose rounding differs. The second rewrite pads
   its input to an even number of rows (one zero row, sliced off its output), so every row goes through the
   pair kernel.

:func:`make_batch_invariant` writes both, the last pass (after the fusions, fp16 and quantization): two small nodes
per attention and per ``MatMulNBits``, the lengths and fills computed once per graph. :func:`strip` undoes them
(fuse() and optimize read a folder's graph, and the fusion rules match the plain patterns).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from gpt2onnx.artifact.graph import ALIGNED, PADDING_PERIOD, PAIRED, all_nodes
from gpt2onnx.artifact.graph_tools import constant_node

ALIGN = PADDING_PERIOD
MASK, IDS = "attention_mask", "input_ids"  # the contract's inputs the shared lengths come from
_FLOATS = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def _dims(source: str, out: str, start: int, end: int | None = None) -> list[onnx.NodeProto]:
    """Shape(source)[start:end] as ``out``, by Shape and Slice (Shape's own start and end need opset 15)."""
    bounds = [out + "/start", out + "/end"]
    return [
        helper.make_node("Shape", [source], [out + "/shape"], name=out + "/shape"),
        constant_node(bounds[0], np.array([start], np.int64)),
        constant_node(bounds[1], np.array([end if end is not None else 2**62], np.int64)),
        helper.make_node("Slice", [out + "/shape", *bounds], [out], name=out),
    ]


def _subgraphs(node: onnx.NodeProto):
    for attr in node.attribute:
        yield from [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs


def _shapes(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every value's inferred type (weights left out while inferring: only their shapes matter)."""
    held = [(t, t.raw_data) for t in model.graph.initializer if t.raw_data]
    for t, _ in held:
        t.ClearField("raw_data")
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except onnx.shape_inference.InferenceError:  # an fp16 graph's declared types can disagree with onnx's
        inferred = model
    finally:
        for t, data in held:
            t.raw_data = data
    types = {}

    def collect(graph):
        for value in (*graph.value_info, *graph.input, *graph.output):
            types[value.name] = value.type
        for node in graph.node:
            for sub in _subgraphs(node):
                collect(sub)

    collect(inferred.graph)
    return types


def _rank(types, name: str) -> int | None:
    t = types.get(name)
    return len(t.tensor_type.shape.dim) if t is not None and t.tensor_type.HasField("shape") else None


def _logits_chain(graph: onnx.GraphProto, logits: str | None) -> list[str]:
    """The names from ``logits`` back through each producer's first input (the head's output among them: onnx's
    inference stops at contrib ops, so ranks past the first MatMulNBits are unknown, and the head's is 2)."""
    producer = {o: n for n in graph.node for o in n.output}
    chain, name = [], logits
    while name in producer:
        chain.append(name)
        node = producer[name]
        if node.op_type == "MatMulNBits":
            break
        name = node.input[0] if node.input else ""
    else:
        if name:
            chain.append(name)
    return chain


def _probs_matmul(softmax: onnx.NodeProto, consumers) -> tuple[onnx.NodeProto | None, list[str]]:
    """The MatMul whose first input is this Softmax's output (through Casts, as fp16 keeps the scores fp32), and
    the tensors on the way (their widths change)."""
    name, path = softmax.output[0], [softmax.output[0]]
    while True:
        users = consumers.get(name, [])
        if len(users) != 1:
            return None, path
        (user,) = users
        if user.op_type == "MatMul" and user.input[0] == name:
            return user, path
        if user.op_type != "Cast":
            return None, path
        name = user.output[0]
        path.append(name)


def _shared_nodes() -> list[onnx.NodeProto]:
    """The padding both rewrites share, from the graph inputs: the attention's front pad ((−T) mod ALIGN, T the
    mask's width) as score and value pads, and whether the step's rows (batch × tokens) are odd."""
    a, p = ALIGNED, PAIRED
    return [
        *_dims(MASK, a + "width", -1),
        constant_node(a + "align", np.array([ALIGN], np.int64)),
        helper.make_node("Neg", [a + "width"], [a + "minus_width"], name=a + "minus_width"),
        helper.make_node("Mod", [a + "minus_width", a + "align"], [a + "pad"], name=a + "pad"),
        *_dims(IDS, p + "batch", 0, 1),
        helper.make_node("Shape", [IDS], [p + "shape"], name=p + "shape"),
        helper.make_node("ReduceProd", [p + "shape"], [p + "rows"], keepdims=1, name=p + "rows"),
        constant_node(p + "two", np.array([2], np.int64)),
        helper.make_node("Mod", [p + "rows", p + "two"], [p + "odd"], name=p + "odd"),
        constant_node(p + "zero", np.zeros(1, np.int64)),
        constant_node(p + "zeros2", np.zeros(2, np.int64)),
        # [B, S, K] gains a row of batch where B × S is odd (B and S are then odd: (B + 1) × S is even)
        helper.make_node(
            "Concat", [p + "zero", p + "zeros2", p + "odd", p + "zeros2"], [p + "pads3"], axis=0, name=p + "pads3"
        ),
    ]


def _fills(scores: str, values: str, types, cache_dtype: int, g: int) -> list[onnx.NodeProto]:
    """The masked score columns [B, H, S, pad] and zero value rows [B, H, pad, D] every attention of one graph
    puts in front (its attentions' scores and values have one shape), made from its first attention's."""
    p = f"{ALIGNED}fill{g}/"
    dtype = _FLOATS.get(types[scores].tensor_type.elem_type if scores in types else TensorProto.FLOAT, np.float32)
    lowest = numpy_helper.from_array(np.array([np.finfo(dtype).min], dtype))
    zero = numpy_helper.from_array(np.zeros(1, _FLOATS.get(cache_dtype, np.float32)))
    return [
        *_dims(scores, p + "scores_lead", 0, 3),
        helper.make_node(
            "Concat", [p + "scores_lead", ALIGNED + "pad"], [p + "scores_shape"], axis=0, name=p + "scores_shape"
        ),
        helper.make_node("ConstantOfShape", [p + "scores_shape"], [p + "scores"], value=lowest, name=p + "scores"),
        *_dims(values, p + "values_lead", 0, 2),
        *_dims(values, p + "values_dim", 3),
        helper.make_node(
            "Concat",
            [p + "values_lead", ALIGNED + "pad", p + "values_dim"],
            [p + "values_shape"],
            axis=0,
            name=p + "values_shape",
        ),
        helper.make_node("ConstantOfShape", [p + "values_shape"], [p + "values"], value=zero, name=p + "values"),
    ]


def _aligned(node, matmul, fill: str, i: int) -> list[onnx.NodeProto]:
    """Scores and values of one attention with the fills in front (the Softmax and MatMul rewired to them)."""
    p = f"{ALIGNED}{i}/"
    scores, values = node.input[0], matmul.input[1]
    node.input[0], matmul.input[1] = p + "scores", p + "values"
    return [
        helper.make_node("Concat", [fill + "scores", scores], [p + "scores"], axis=-1, name=p + "scores"),
        helper.make_node("Concat", [fill + "values", values], [p + "values"], axis=2, name=p + "values"),
    ]


def _paired(node, rank: int | None, i: int) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]]:
    """One MatMulNBits fed an even number of rows: (the nodes before it, the nodes after it)."""
    p = f"{PAIRED}{i}/"
    a, y = node.input[0], node.output[0]
    node.input[0], node.output[0] = p + "a", p + "y"
    if rank == 3:  # a block's [B, S, K]: the shared pads
        before = [helper.make_node("Pad", [a, PAIRED + "pads3"], [p + "a"], name=p + "a")]
        ends = PAIRED + "batch"
    else:  # the head's [rows, K] (every position's, or the last only): its own
        before = [
            *_dims(a, p + "rows", 0, 1),
            helper.make_node("Mod", [p + "rows", PAIRED + "two"], [p + "odd"], name=p + "odd"),
            helper.make_node(
                "Concat",
                [PAIRED + "zero", PAIRED + "zero", p + "odd", PAIRED + "zero"],
                [p + "pads"],
                axis=0,
                name=p + "pads",
            ),
            helper.make_node("Pad", [a, p + "pads"], [p + "a"], name=p + "a"),
        ]
        ends = p + "rows"
    after = [helper.make_node("Slice", [p + "y", PAIRED + "zero", ends, PAIRED + "zero"], [y], name=p + "y")]
    return before, after


def _rewrite(graph: onnx.GraphProto, types, counts: list[int], cache_dtype: int, logits: str | None) -> None:
    """counts: [attentions aligned, MatMulNBits paired, graphs with fills] so far; ``logits``: the name the graph's
    logits have (a branch's output where the If's output is on the logits' way)."""
    chain = _logits_chain(graph, logits)
    fill = None
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    nodes: list[onnx.NodeProto] = []
    widened: set[str] = set()
    for node in graph.node:
        for sub in _subgraphs(node):  # int4's prompt path keeps the blocks inside an If
            outputs = [sub.output[j].name for j, name in enumerate(node.output) if name in chain]
            _rewrite(sub, types, counts, cache_dtype, outputs[0] if outputs else None)
        if node.op_type == "Softmax" and not node.input[0].startswith(ALIGNED):
            matmul, path = _probs_matmul(node, consumers)
            if matmul is not None:
                if fill is None:
                    nodes += _fills(node.input[0], matmul.input[1], types, cache_dtype, counts[2])
                    fill = f"{ALIGNED}fill{counts[2]}/"
                    counts[2] += 1
                nodes += _aligned(node, matmul, fill, counts[0])
                counts[0] += 1
                widened.update(path)
        if node.op_type == "MatMulNBits":
            rank = _rank(types, node.input[0]) or (2 if node.output[0] in chain else 3)  # a block's [B, S, K]
            before, after = _paired(node, rank, counts[1])
            counts[1] += 1
            nodes += [*before, node, *after]
            continue
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [v for v in graph.value_info if v.name not in widened]  # their declared widths were T's
    del graph.value_info[:]
    graph.value_info.extend(kept)


def make_batch_invariant(model: onnx.ModelProto) -> tuple[onnx.ModelProto, tuple[int, int]]:
    """Both rewrites, in place; returns the model and (attentions aligned, MatMulNBits paired). A graph that has
    them already is returned as it is."""
    if rewritten(model) or not {MASK, IDS} <= {i.name for i in model.graph.input}:
        return model, (0, 0)  # rewritten already, or one block's graph (its parity check only)
    types = _shapes(model)
    counts = [0, 0, 0]
    past = [i for i in model.graph.input if i.name.startswith("past_key_values")]
    cache_dtype = past[0].type.tensor_type.elem_type if past else TensorProto.FLOAT
    _rewrite(model.graph, types, counts, cache_dtype, "logits")
    if any(counts):
        shared = _shared_nodes()
        nodes = [*shared, *model.graph.node]
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return model, (counts[0], counts[1])


def rewritten(model: onnx.ModelProto) -> bool:
    """Whether the graph holds these rewrites."""
    return any(n.name.startswith((ALIGNED, PAIRED)) for n in all_nodes(model.graph, prompt_body=True))


def _strip_graph(graph: onnx.GraphProto) -> None:
    source, renamed = {}, {}
    for node in graph.node:
        for sub in _subgraphs(node):
            _strip_graph(sub)
        if not node.name.startswith((ALIGNED, PAIRED)):
            continue
        if node.op_type == "Concat" and node.name.endswith(("/scores", "/values")):  # fill in front of the input
            source[node.output[0]] = node.input[1]
        elif node.op_type == "Pad" and node.name.endswith("/a"):  # a MatMulNBits' rows
            source[node.output[0]] = node.input[0]
        elif node.op_type == "Slice" and node.name.endswith("/y"):  # its output's
            renamed[node.input[0]] = node.output[0]
    kept = [n for n in graph.node if not n.name.startswith((ALIGNED, PAIRED))]
    for node in kept:
        node.input[:] = [source.get(name, name) for name in node.input]
        node.output[:] = [renamed.get(name, name) for name in node.output]
    del graph.node[:]
    graph.node.extend(kept)


def strip(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph as it was before :func:`make_batch_invariant` (in place)."""
    _strip_graph(model.graph)
    return model
