"""int4: 4-bit block-wise weights (onnxruntime's MatMulNBitsQuantizer: MatMulNBits, and GatherBlockQuantized for
the embeddings), chosen by a weight algorithm (gpt2onnx.precisions.algorithms: round to nearest, HQQ, k-quant,
GPTQ), with measured 8-bit layers (--mixed-int8) and the recipe's head and embeddings."""

from __future__ import annotations

import onnx

from gpt2onnx.precisions import weights  # by module: tests swap matmul_nbits to damage a file
from gpt2onnx.precisions.algorithms.all_algorithms import ALGORITHMS
from gpt2onnx.precisions.precision import FLOAT_LAYER, Precision
from gpt2onnx.precisions.prompt_path import PROMPT_KERNELS, without_prompt_path
from gpt2onnx.precisions.weights import QuantizeContext

BITS = 4
LAYER = "int4"  # --lm-head / --embeddings at this precision's width
EIGHT_BIT_LAYER = "int8"  # --lm-head at 8 bits (MatMulNBits with 8 bits)


def _quantize(context: QuantizeContext) -> tuple[onnx.ModelProto, dict]:
    recipe, model, graph = context.recipe, context.model, context.model.graph
    algorithm = ALGORITHMS[recipe.algorithm]
    if algorithm.calibrated and context.calibration is None:
        raise ValueError(f"int4 algorithm {algorithm.name} needs calibration token sequences")
    graph_names = {n.name: n.input[1] for n in graph.node if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1}
    gathers, head_apart = context.gathers, context.head_apart
    other_gathers = {n.name for n in graph.node if n.op_type == "Gather"} - gathers
    mixed = None
    if recipe.mixed_int8 is not None:  # measured 8-bit layers: kept out of the 4-bit pass, then 8 bits
        from gpt2onnx.precisions.mixed_int8 import choose_int8_layers

        stored = {init.name for init in graph.initializer}
        candidates = [
            n.name
            for n in graph.node
            if n.op_type == "MatMul" and n.name not in head_apart and len(n.input) > 1 and n.input[1] in stored
        ]
        mixed = choose_int8_layers(
            model,
            candidates,
            budget=recipe.mixed_int8 / 100,
            block_size=recipe.block_size,
            calibration=context.calibration,
        )
        head_apart = head_apart | set(mixed.int8_nodes)
    if algorithm.weight_error is None:  # round to nearest: the embeddings in the same pass
        quantized = weights.matmul_nbits(
            model,
            recipe,
            bits=BITS,
            exclude=head_apart | other_gathers | (gathers if recipe.embeddings != LAYER else set()),
            gathers=recipe.embeddings == LAYER,
        )
    else:  # the algorithm on the MatMuls, then the embeddings rounded to nearest (GatherBlockQuantized)
        gather_names = {n.name for n in graph.node if n.op_type == "Gather"}
        quantized = weights.matmul_nbits(
            model,
            recipe,
            bits=BITS,
            exclude=head_apart | gather_names,
            gathers=False,
            algorithm=algorithm,
            calibration=context.calibration,
        )
        if recipe.embeddings == LAYER:
            others = {n.name for n in quantized.graph.node} - gathers
            quantized = weights.matmul_nbits(quantized, recipe, bits=BITS, exclude=others, gathers=True)
    eight_bit = set(mixed.int8_nodes) if mixed is not None else set()
    if context.head is not None and recipe.lm_head == EIGHT_BIT_LAYER:
        eight_bit.add(context.head.name)
    if eight_bit:
        others = {n.name for n in quantized.graph.node} - eight_bit
        quantized = weights.matmul_nbits(quantized, recipe, bits=8, exclude=others, gathers=False)
    calibrated = context.calibration is not None and (algorithm.calibrated or mixed is not None)
    return quantized, {
        "algorithm": algorithm.name,
        "calibration": context.calibration.source if calibrated else None,
        **_mixed_record(mixed, graph_names),
    }


def _mixed_record(mixed, weight_of: dict[str, str]) -> dict:
    """The manifest's record of measured 8-bit layers: by weight name (the file check's), with every candidate's
    sensitivity."""
    if mixed is None:
        return {}
    return {
        "int8_layers": [weight_of[name] for name in mixed.int8_nodes],
        "sensitivity": {weight_of[name]: kl for name, kl in mixed.sensitivity.items()},
        "int8_share": mixed.int8_share,
    }


def _declare_types(model: onnx.ModelProto) -> None:
    """Give every tensor an element type in value_info, in place. onnxruntime's float16 converter casts only the
    tensors it knows the type of, and onnx's inference stops at a contrib op (GatherBlockQuantized): the standard
    ops after it would stay untyped and an fp32 LayerNorm would get an fp16 input. So the types are carried
    forward node by node: a standard op's by onnx's own inference from its inputs' types, a contrib op's outputs
    as its float input's (GatherBlockQuantized: its scales'; MatMulNBits and the fused ops: their first input's)."""
    from onnx import shape_inference

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    types = {v.name: v.type for v in (*model.graph.input, *model.graph.value_info, *model.graph.output)}
    types.update({i.name: onnx.helper.make_tensor_type_proto(i.data_type, None) for i in model.graph.initializer})
    added = []
    for node in model.graph.node:
        outputs = [o for o in node.output if o and o not in types]
        if not outputs:
            continue
        found = {}
        if node.domain in ("", "ai.onnx") and all(not i or i in types for i in node.input):
            try:
                schema = onnx.defs.get_schema(node.op_type, opset, "")
                found = shape_inference.infer_node_outputs(schema, node, {i: types[i] for i in node.input if i})
            except Exception:  # an op onnx cannot infer alone (a subgraph, a missing attribute): left untyped
                found = {}
        elif node.domain == "com.microsoft":
            source = node.input[2] if node.op_type == "GatherBlockQuantized" else node.input[0]
            if source in types:
                found = {node.output[0]: onnx.helper.make_tensor_type_proto(types[source].tensor_type.elem_type, None)}
        for name, kind in found.items():
            if name in outputs and kind.tensor_type.elem_type:
                types[name] = kind
                added.append(onnx.helper.make_value_info(name, kind))
    model.graph.value_info.extend(added)


def to_q4f16(model: onnx.ModelProto, *, upcast_attention: bool = False) -> onnx.ModelProto:
    """An int4 graph with its float parts in fp16 (the fp16 precision's converter and its default groups kept in
    fp32: every LayerNorm, the softmax, the logits output): transformers.js's q4f16, 4-bit MatMulNBits and
    GatherBlockQuantized with fp16 scales and activations, the K/V cache in fp16. onnxruntime's CPU kernels run it
    (MatMulNBits and GatherBlockQuantized take fp16); measured in docs/precision.md ("q4f16"). Made from the
    decode body where the graph has int4's prompt path (its int8 body takes float32 only).
    ``upcast_attention``: the architecture's reorder_and_upcast_attn (the scores stay fp32, or BadInput where the
    attention op cannot keep them so)."""
    from gpt2onnx.precisions.fp16 import to_fp16

    without_prompt_path(model)
    _declare_types(model)
    return to_fp16(model, upcast_attention=upcast_attention)[0]


PRECISION = Precision(
    name="int4",
    short="int4",
    summary="4-bit block-wise weights (MatMulNBits), chosen by --algorithm, with measured 8-bit layers",
    # recalibrated on a trained model (docs/benchmarks.md): the recipe passes with a margin (trained test model: KL
    # 1.4e-3, top-1 90.7 %; random 124M: KL 7.8e-3, top-1 77 %, top-5 96 %) and 2-bit weights fail (KL 1.75e-2,
    # top-1 63.8 %), tests/precisions/test_precision_recipes.py
    gates={"kl_mean": 0.012, "top1": 0.72, "top5": 0.94},
    file_gates={"weight_steps": 1.001, "relative_error": 0.05},
    method="int4",
    weight_bits=BITS,
    marks=frozenset({"MatMulNBits", "GatherBlockQuantized"}),
    writes=frozenset({("com.microsoft", "MatMulNBits")}),
    transformers_js=("q4", "_q4"),
    transformers_js_derived=(("q4f16", "_q4f16", to_q4f16),),
    options=frozenset(
        {
            "block_size",
            "accuracy_level",
            "lm_head",
            "embeddings",
            "algorithm",
            "calibration_text",
            "mixed_int8",
            "prompt_kernel",
        }
    ),
    # chosen on the GPT-2-shaped reference's held-out text (docs/precision.md, "int4 recipes"): the tied head and
    # embeddings at 8 bits (stored once) with blocks of 128 give mean KL 2.5e-4 at the file size of everything at
    # 4 bits in blocks of 32 (2.3e-3, the recipe before): the tied table's width, not the block algorithm, is what
    # int4's error comes from; blocks of 128 pay for it in size and run faster. The block size is fitted to
    # narrower models (weights.fitted_block_size: blocks of 64 on a 64-wide one)
    recipe={"lm_head": EIGHT_BIT_LAYER, "embeddings": EIGHT_BIT_LAYER, "accuracy_level": 4, "block_size": 128},
    layer_choices=(LAYER, EIGHT_BIT_LAYER, FLOAT_LAYER),
    accuracy_levels=(0, 4),  # MatMulNBits: 0 = fp32 activations, 4 = activations quantized to int8 (VNNI/AVX2/AMX)
    block_sizes=(16, 32, 64, 128, 256),
    # the prompt step's matmuls: nbits, MatMulNBits as decode; int8, the 4-bit weights folded to int8 at session
    # creation for steps of many rows (gpt2onnx.precisions.prompt_path; docs/benchmarks.md, "As fast as the
    # engines": onnxruntime 1.31's MatMulNBits takes about 3× MatMulInteger's time on 128 rows)
    prompt_kernels=tuple(PROMPT_KERNELS),
    block_wise=True,
    algorithms=ALGORITHMS,
    quantize=_quantize,
)
