"""fp16: weights, activations and the K/V cache in float16 (onnxruntime's float16 converter), with the groups that
overflow in fp16 kept in fp32 (--keep-fp32). Checked against its gates, and again with fp16 arithmetic emulated
as a GPU computes it."""

from __future__ import annotations

import logging
from collections import Counter

import onnx

from gpt2onnx.artifact.graph import ALIGNED, sort_topologically
from gpt2onnx.artifact.manifest import Fp16Record
from gpt2onnx.errors import BadInput
from gpt2onnx.precisions.precision import Precision

log = logging.getLogger(__name__)

# What an fp16 model keeps in fp32 (--keep-fp32), by default all of it:
#   layernorm: each LayerNorm, as a fused op (LayerNormalization, SkipLayerNormalization) or written out (opsets
#              below 17, --fusion none). Its statistics are what overflow: trained GPT-2 has residual-stream
#              channels near 3000, and the variance squares them (3000² > fp16's 65504).
#   softmax:   the attention softmax (no measurable effect on the 124M outlier model, docs/benchmarks.md; kept
#              for the peaked attention of trained checkpoints);
#   logits:    the logits output, so callers sample from fp32 (the projection itself runs in fp16).
FP16_KEEP_GROUPS = ("layernorm", "softmax", "logits")
FP16_KEEP_OPS = {"layernorm": ("LayerNormalization", "SkipLayerNormalization"), "softmax": ("Softmax",)}
# Not a --keep-fp32 choice but the architecture's: with reorder_and_upcast_attn (BioMedLM, Mistral's GPT-2 runs)
# transformers computes the attention scores in fp32 whatever the model's dtype (Q·Kᵀ, its scale, the mask, the
# softmax; the probabilities are cast back before they weigh V), so an fp16 export keeps them fp32 too, whatever
# --keep-fp32 says. Where attention is written out (fusion none, portable, tensorrt) those nodes stay fp32 here.
# Where it is fused (ort: MultiHeadAttention, ort-shared-kv: GroupQueryAttention) the scores live inside the op:
# onnxruntime 1.31's CPU kernels compute them and the softmax in fp32 from fp16 inputs (measured:
# tests/precisions/test_upcast_fp16.py), its CUDA kernels in fp32 when they run flash or memory-efficient attention, but
# its unfused CUDA kernel (onnxruntime's attention_impl.cu, read, not run here) stores Q·Kᵀ in fp16 before the
# softmax. The standard Attention of the onnx profiles does not: onnxruntime 1.31's CPU kernel computes the scores
# of fp16 inputs in fp16 (two scores 1 apart near 2048 get 0.5 and 0.5, past 65504 NaN; softmax_precision = 1
# changes nothing: tests/precisions/test_upcast_fp16.py), so to_fp16 refuses an upcast architecture there.
ATTENTION_SCORES = "attention_scores"
FUSED_ATTENTION = ("MultiHeadAttention", "GroupQueryAttention")


def parse_keep_fp32(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """--keep-fp32: a comma-separated subset of FP16_KEEP_GROUPS, or 'none' (also: a tuple of groups, () for none)."""
    if not isinstance(value, str):
        names = list(value)
    else:
        names = [v.strip() for v in value.split(",") if v.strip()]
        if names == ["none"]:
            return ()
        if not names:
            names = ["?"]
    unknown = [n for n in names if n not in FP16_KEEP_GROUPS]
    if unknown:
        shown = value if isinstance(value, str) else ",".join(map(str, value))
        raise BadInput(
            f"--keep-fp32 '{shown}' is not valid: give a comma-separated subset of {','.join(FP16_KEEP_GROUPS)}, or"
            " 'none'"
        )
    return tuple(g for g in FP16_KEEP_GROUPS if g in names)


def written_out_layer_norms(graph: onnx.GraphProto) -> list[list[onnx.NodeProto]]:
    """The nodes of every written-out LayerNorm, (x - mean(x)) / sqrt(mean((x - mean(x))²) + ε) · γ + β, with the
    Constants they read (one list per LayerNorm)."""
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def made_by(name: str, op_type: str):
        node = producer.get(name)
        return node if node is not None and node.op_type == op_type else None

    def sole_consumer(node: onnx.NodeProto, op_type: str):
        users = consumers.get(node.output[0], [])
        return users[0] if len(users) == 1 and users[0].op_type == op_type else None

    found = []
    for div in graph.node:
        if div.op_type != "Div" or len(div.input) != 2:
            continue
        centered, root = made_by(div.input[0], "Sub"), made_by(div.input[1], "Sqrt")
        shifted = root and made_by(root.input[0], "Add")
        variance = shifted and next((v for v in (made_by(i, "ReduceMean") for i in shifted.input) if v), None)
        square = variance and made_by(variance.input[0], "Pow")
        mean = centered and made_by(centered.input[1], "ReduceMean")
        if not (square and mean and square.input[0] == centered.output[0] and mean.input[0] == centered.input[0]):
            continue
        nodes = [mean, centered, square, variance, shifted, root, div]
        scale = sole_consumer(div, "Mul")
        shift = scale and sole_consumer(scale, "Add")
        nodes += [n for n in (scale, shift) if n]
        constants = [producer[i] for n in nodes for i in n.input if i in producer and producer[i].op_type == "Constant"]
        found.append(nodes + constants)
    return found


def written_out_attention_scores(graph: onnx.GraphProto) -> list[list[onnx.NodeProto]]:
    """The nodes that make each written-out attention's probabilities, Softmax(Q·Kᵀ / c + mask): the MatMul, its
    scale (a Div or Mul by a constant; none where c is 1 and the exporter left it out), the mask's Add and the
    Softmax, with the Constants they read (one list per attention)."""
    producer = {out: node for node in graph.node for out in node.output}

    def made_by(name: str, *op_types: str):
        node = producer.get(name)
        return node if node is not None and node.op_type in op_types else None

    def constant(name: str) -> bool:
        node = producer.get(name)
        return (node is not None and node.op_type == "Constant") or name in initializers

    def scores(name: str):  # the mask's Add, or behind the columns a batch-invariant graph puts in front of it
        aligned = made_by(name, "Concat")
        if aligned is not None and aligned.name.startswith(ALIGNED):
            name = aligned.input[1]
        return made_by(name, "Add")

    initializers = {i.name for i in graph.initializer}
    found = []
    for softmax in graph.node:
        add = softmax.op_type == "Softmax" and scores(softmax.input[0])
        if not add:
            continue
        for name in add.input:
            scale = made_by(name, "Div", "Mul")
            if scale is not None and not constant(scale.input[1]):
                scale = None
            product = made_by(scale.input[0] if scale else name, "MatMul")
            if product is not None:
                break
        else:
            continue
        nodes = [product, *([scale] if scale else []), add, softmax]
        constants = [producer[i] for n in nodes for i in n.input if i in producer and producer[i].op_type == "Constant"]
        found.append(nodes + constants)
    return found


def to_fp16(
    model: onnx.ModelProto, *, keep_fp32: tuple[str, ...] = FP16_KEEP_GROUPS, upcast_attention: bool = False
) -> tuple[onnx.ModelProto, Fp16Record]:
    """fp16 weights, activations and K/V cache; the ``keep_fp32`` groups (FP16_KEEP_GROUPS) stay fp32, and with
    ``upcast_attention`` (the architecture's reorder_and_upcast_attn) the written-out attention scores too
    (ATTENTION_SCORES).

    onnxruntime's converter keeps nodes in fp32 one by one: it casts every tensor between two kept nodes to
    fp16 and back, which would store a written-out LayerNorm's squares (and overflow) in fp16 all the same.
    So the tensors inside a kept LayerNorm lose their type information before the conversion (the converter
    leaves tensors it has no type for as they are), and it runs on our own shape inference, which also works
    past protobuf's 2 GB limit.
    """
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from gpt2onnx.artifact.graph_tools import infer_value_info

    keep_ops = {op for group in keep_fp32 for op in FP16_KEEP_OPS.get(group, ())}
    kept_nodes: list[onnx.NodeProto] = []
    known = list(model.graph.value_info)  # a fused graph's contrib ops are typed by the fusion pass only
    infer_value_info(model)
    inferred = {v.name for v in model.graph.value_info}
    model.graph.value_info.extend(v for v in known if v.name not in inferred)
    if "layernorm" in keep_fp32:
        kept_nodes = [node for nodes in written_out_layer_norms(model.graph) for node in nodes]
    groups = list(keep_fp32)
    if upcast_attention and any(n.op_type == "Attention" and n.domain in ("", "ai.onnx") for n in model.graph.node):
        raise BadInput(
            "this architecture computes its attention scores in fp32 (reorder_and_upcast_attn), but the standard"
            " Attention of the onnx profiles computes them in fp16 from fp16 inputs (onnxruntime 1.31's CPU kernel;"
            " softmax_precision changes nothing): use --fusion none or portable with --dtype fp16, or stay fp32"
        )
    if upcast_attention:
        scores = written_out_attention_scores(model.graph)
        kept_nodes += [node for nodes in scores for node in nodes if node not in kept_nodes]
        if scores:
            groups.append(ATTENTION_SCORES)
            log.info("reorder_and_upcast_attn: the attention scores of %d layers stay fp32", len(scores))
        fused = sorted({n.op_type for n in model.graph.node if n.op_type in FUSED_ATTENTION})
        if fused:
            log.warning(
                "reorder_and_upcast_attn: the attention scores are inside %s, which computes them in fp32 on the CPU"
                " provider; on CUDA that depends on the kernel it picks (the unfused one stores them in fp16): use"
                " --fusion none or portable for fp32 scores on every provider",
                " and ".join(fused),
            )
    for index, node in enumerate(kept_nodes):
        node.name = node.name or f"kept_fp32_{index}"  # the converter blocks nodes by name
    names = {n.name for n in kept_nodes}
    _untype_inner_tensors(model.graph, names)
    keep_io = ["logits"] if "logits" in keep_fp32 else []
    kept = Counter(n.op_type for n in model.graph.node if n.op_type in keep_ops or n.name in names)
    ir_version = model.ir_version
    converted = convert_float_to_float16(
        model,
        keep_io_types=keep_io or False,
        op_block_list=sorted(keep_ops),
        node_block_list=sorted(names),
        disable_shape_infer=True,
    )
    _drop_repeated_casts(converted.graph)
    sort_topologically(converted.graph)  # the converter appends its Casts at the end of the node list
    converted.ir_version = ir_version
    log.info("fp16; kept in fp32: %s", dict(kept) or "nothing")
    return converted, Fp16Record(groups, dict(kept), keep_io)


def _untype_inner_tensors(graph: onnx.GraphProto, kept: set[str]) -> None:
    """Drop the type information of the tensors that kept nodes make and only kept nodes read, so that the
    converter leaves them fp32 instead of casting them to fp16 and back between two kept nodes."""
    readers: dict[str, set[str]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.name)
    outputs = {o.name for o in graph.output}
    inner = {
        out
        for node in graph.node
        if node.name in kept
        for out in node.output
        if out not in outputs and readers.get(out, set()) <= kept
    }
    if inner:
        value_info = [v for v in graph.value_info if v.name not in inner]
        del graph.value_info[:]
        graph.value_info.extend(value_info)


def _drop_repeated_casts(graph: onnx.GraphProto) -> None:
    """The converter gives a tensor read by two kept nodes one Cast per reader, each with the same name and
    output: keep the first (they are identical), and one value_info per name."""
    seen: set[str] = set()
    nodes = []
    for node in graph.node:
        if node.op_type == "Cast" and node.output[0] in seen:
            continue
        seen.update(node.output)
        nodes.append(node)
    if len(nodes) != len(graph.node):
        del graph.node[:]
        graph.node.extend(nodes)
    names: set[str] = set()
    infos = [v for v in graph.value_info if not (v.name in names or names.add(v.name))]
    del graph.value_info[:]
    graph.value_info.extend(infos)


PRECISION = Precision(
    name="float16",
    short="fp16",
    summary="fp16 weights, activations and K/V cache; LayerNorm, softmax and logits kept fp32 (--keep-fp32)",
    # the 124M model (random weights): KL 7e-8, top-1 99.6 %, top-5 100 %
    gates={"kl_mean": 1e-4, "top1": 0.98, "top5": 0.99},
    dtype="float16",
    emulate_fp16=True,
    transformers_js=("fp16", "_fp16"),
)
