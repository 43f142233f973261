"""onnxruntime's generation ops: the whole decoding loop inside one ONNX file, run with one ``session.run``.

    ort-generate/greedy_search.onnx   com.microsoft GreedySearch
    ort-generate/beam_search.onnx     com.microsoft BeamSearch
    ort-generate/sampling.onnx        com.microsoft Sampling
    ort-generate/weights.onnx_data    the decoder's weights, one copy that all three files point at

Each file is one contrib op whose ``decoder`` attribute is our decoder, adapted by an ONNX wrapper (nothing is
exported again). The op's GPT-2 decoder type (``model_type`` 0, onnxruntime's subgraph_gpt.cc) fixes its
subgraph's IO: int32 ``input_ids``, ``position_ids`` and ``attention_mask``, then one ``past_%d`` per layer
with key and value stacked ([2, batch, n_head, past, head_dim], the logits' dtype), and outputs ``logits``,
``present_%d``. The wrapper casts the int32 inputs to our int64, splits ``past_%d`` into our
``past_key_values.%d.key/value`` (casting when the cache dtype differs from the logits', as in our fp16 files
whose logits stay fp32) and stacks our presents back into ``present_%d``. The weights move to the outer graph
(the subgraph reads them as outer-scope values), so the three files share one data file.

The search settings the op takes as inputs are inputs here (max_length, min_length, num_beams,
num_return_sequences, length_penalty, repetition_penalty, attention_mask for left padding, seed); those it
takes as attributes (eos and pad ids, no_repeat_ngram_size, early_stopping, temperature, top_p) are fixed
when the folder is deployed, from its generation_config.json (transformers' defaults where it says nothing).
The ort-generate runtime (:mod:`gpt2onnx.runtimes.ort_generate`) runs the files with the decode loop's Sampling and
Decoding, refusing in one line a setting the op cannot express as transformers means it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from gpt2onnx.artifact.contract import DecoderShape, decoder_shape, graph_io
from gpt2onnx.artifact.folder import GENERATION_CONFIG_FILE, MODEL_FILE, read_n_positions
from gpt2onnx.artifact.generation import read_generation_config, refuse_eos_outside
from gpt2onnx.artifact.graph import load_model
from gpt2onnx.artifact.search_ops import DATA_NAME, FILES, MS_DOMAIN, SEARCHES, SUBFOLDER, FixedSettings
from gpt2onnx.capabilities import Need
from gpt2onnx.errors import BadInput, ContractError
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE
from gpt2onnx.targets.target import Deployment, TargetSpec, Written

log = logging.getLogger(__name__)

_ONNX_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


def fixed_settings(folder: str | Path, vocab_size: int, *, outside_vocabulary: dict | None = None) -> FixedSettings:
    """The attributes from generation_config.json, as transformers' generate() would read them there (its
    defaults where the file says nothing; each value checked by its rule); pad falls back to eos (GPT-2 has no
    pad token). ``outside_vocabulary``: the source manifest's record, for a staging copy without its manifest."""
    folder = Path(folder)
    generation = read_generation_config(folder, vocab_size=vocab_size, outside_vocabulary=outside_vocabulary)
    refuse_eos_outside(generation, vocab_size, needs="onnxruntime's search ops (their eos_token_id attribute)")
    if not generation.eos_token_ids:
        raise ContractError(f"'{folder}' names no eos_token_id (generation_config.json or config.json): add one")
    eos = generation.eos_token_ids[0]
    if generation.early_stopping == "never":
        raise BadInput(
            f"early_stopping 'never' in '{folder / GENERATION_CONFIG_FILE}': onnxruntime's BeamSearch has only true"
            " or false; set one"
        )
    return FixedSettings(
        eos_token_id=eos,
        pad_token_id=eos if generation.pad_token_id is None else generation.pad_token_id,
        no_repeat_ngram_size=generation.no_repeat_ngram_size,
        early_stopping=bool(generation.early_stopping),
        temperature=generation.temperature,
        top_p=generation.top_p,
    )


# -- the decoder subgraph --------------------------------------------------------------------------------------
def _stacked_past_type(dtype: int, shape: DecoderShape, length: str) -> onnx.TypeProto:
    return helper.make_tensor_type_proto(dtype, [2, "batch_size", shape.n_head, length, shape.head_dim])


def decoder_subgraph(model: onnx.ModelProto, shape: DecoderShape) -> tuple[onnx.GraphProto, list[TensorProto]]:
    """Our decoder (weights loaded) as the GPT-2 subgraph the generation ops accept; returns the subgraph and
    its initializers, which the caller puts in the outer graph."""
    g = model.graph
    names = [v.name for v in g.input]
    logits = next(v for v in g.output if v.name == "logits")
    logits_type = logits.type.tensor_type.elem_type
    if logits_type not in _ONNX_DTYPES.values():
        raise ContractError(f"the decoder's logits are {logits_type}: the generation ops take float32 or float16")
    kv_type = _ONNX_DTYPES.get(shape.kv_dtype)
    if kv_type is None:
        raise ContractError(f"the decoder's K/V cache is {shape.kv_dtype}: the generation ops take float32 or float16")
    own = {n: f"gpt2onnx.{n}" for n in ("input_ids", "position_ids", "attention_mask") if n in names}
    if set(names) - set(own) - set(shape.past_names):
        extra = sorted(set(names) - set(own) - set(shape.past_names))
        raise ContractError(f"the decoder has inputs {extra} the generation ops cannot feed")
    nodes = [helper.make_node("Constant", [], [c.name], value=c, name=f"const_{c.name}") for c in _CONSTANTS]
    nodes += [  # the op feeds int32; our graph takes int64 (positions: computed from the mask, below)
        helper.make_node("Cast", [name], [inner], to=TensorProto.INT64, name=f"cast_{name}")
        for name, inner in own.items()
        if name != "position_ids"
    ]
    if "position_ids" in own:
        nodes += _position_nodes(own["attention_mask"], own["input_ids"], own["position_ids"])
    nodes += _past_nodes(shape.n_layer, kv_type, logits_type)
    for node in g.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        for i, name in enumerate(copy.input):
            if name in own:
                copy.input[i] = own[name]
        nodes.append(copy)
    nodes += _present_nodes(shape.n_layer, kv_type, logits_type)
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT32, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT32, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT32, ["batch_size", "total_sequence_length"]),
    ] + [
        helper.make_value_info(f"past_{i}", _stacked_past_type(logits_type, shape, "past_sequence_length"))
        for i in range(shape.n_layer)
    ]
    graph_outputs = [logits] + [
        helper.make_value_info(f"present_{i}", _stacked_past_type(logits_type, shape, "total_sequence_length"))
        for i in range(shape.n_layer)
    ]
    # no value_info: the fp16 converter leaves entries whose types disagree with the nodes (onnx strict
    # inference says so), which the ops' subgraph check rejects; onnxruntime infers the types itself
    subgraph = helper.make_graph(nodes, "gpt2onnx decoder", inputs, graph_outputs)
    return subgraph, list(g.initializer)


_CONSTANTS = (
    helper.make_tensor("gpt2onnx.index_0", TensorProto.INT64, [], [0]),
    helper.make_tensor("gpt2onnx.index_1", TensorProto.INT64, [], [1]),
    helper.make_tensor("gpt2onnx.axis_0", TensorProto.INT64, [1], [0]),
    helper.make_tensor("gpt2onnx.axis_1", TensorProto.INT64, [1], [1]),
    helper.make_tensor("gpt2onnx.zero", TensorProto.INT64, [], [0]),
    helper.make_tensor("gpt2onnx.one", TensorProto.INT64, [], [1]),
    helper.make_tensor("gpt2onnx.big", TensorProto.INT64, [1], [2**62]),
)


def _position_nodes(mask: str, input_ids: str, position: str) -> list[onnx.NodeProto]:
    """The ops derive position_ids from input_ids == pad_token_id, even with an attention_mask
    (generation_device_helper.cc CreateGptInputs): a real pad/eos id inside a prompt would get position 0 and shift
    the rest. Positions from the mask instead, as transformers does: cumsum(mask) - 1, 1 on padding, the last
    sequence_length columns (the whole prompt, then one per step)."""
    return [
        helper.make_node("CumSum", [mask, "gpt2onnx.axis_1"], ["gpt2onnx.mask_cumsum"], name="positions_cumsum"),
        helper.make_node("Sub", ["gpt2onnx.mask_cumsum", "gpt2onnx.one"], ["gpt2onnx.counted"], name="positions_sub"),
        helper.make_node("Equal", [mask, "gpt2onnx.zero"], ["gpt2onnx.is_padding"], name="positions_padding"),
        helper.make_node(
            "Where",
            ["gpt2onnx.is_padding", "gpt2onnx.one", "gpt2onnx.counted"],
            ["gpt2onnx.all_positions"],
            name="positions_where",
        ),
        helper.make_node("Shape", [input_ids], ["gpt2onnx.ids_shape"], name="positions_shape"),
        helper.make_node(
            "Gather", ["gpt2onnx.ids_shape", "gpt2onnx.axis_1"], ["gpt2onnx.step_length"], axis=0, name="positions_len"
        ),
        helper.make_node("Neg", ["gpt2onnx.step_length"], ["gpt2onnx.step_start"], name="positions_start"),
        helper.make_node(
            "Slice",
            ["gpt2onnx.all_positions", "gpt2onnx.step_start", "gpt2onnx.big", "gpt2onnx.axis_1"],
            [position],
            name="positions_slice",
        ),
    ]


def _past_nodes(n_layer: int, kv_type: int, logits_type: int) -> list[onnx.NodeProto]:
    """Each stacked ``past_%d`` split into our past_key_values.%d.key/value (cast where the cache dtype differs)."""
    nodes = []
    for layer in range(n_layer):
        for index, kind in enumerate(("key", "value")):
            target = f"past_key_values.{layer}.{kind}"
            picked = f"gpt2onnx.past_{layer}.{kind}" if kv_type != logits_type else target
            nodes.append(
                helper.make_node(
                    "Gather", [f"past_{layer}", f"gpt2onnx.index_{index}"], [picked], axis=0, name=f"split_{target}"
                )
            )
            if kv_type != logits_type:
                nodes.append(helper.make_node("Cast", [picked], [target], to=kv_type, name=f"cast_{target}"))
    return nodes


def _present_nodes(n_layer: int, kv_type: int, logits_type: int) -> list[onnx.NodeProto]:
    """Our present.%d.key/value stacked back into the op's ``present_%d`` (in the logits' dtype)."""
    nodes = []
    for layer in range(n_layer):
        parts = []
        for kind in ("key", "value"):
            source = f"present.{layer}.{kind}"
            if kv_type != logits_type:
                cast = f"gpt2onnx.{source}.cast"
                nodes.append(helper.make_node("Cast", [source], [cast], to=logits_type, name=f"cast_{source}"))
                source = cast
            parts.append(f"gpt2onnx.{source}.stacked")
            nodes.append(
                helper.make_node("Unsqueeze", [source, "gpt2onnx.axis_0"], [parts[-1]], name=f"stack_{source}")
            )
        nodes.append(helper.make_node("Concat", parts, [f"present_{layer}"], axis=0, name=f"concat_present_{layer}"))
    return nodes


# -- the search models -----------------------------------------------------------------------------------------
def _scalar(name: str, dtype: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, [1])


def search_model(
    kind: str,
    subgraph: onnx.GraphProto,
    initializers: list[TensorProto],
    settings: FixedSettings,
    *,
    opset_imports: list[onnx.OperatorSetIdProto],
    ir_version: int,
) -> onnx.ModelProto:
    """One generation op (``kind``: greedy, beam or sampling) around the decoder subgraph."""
    i32, f32 = TensorProto.INT32, TensorProto.FLOAT
    ids = helper.make_tensor_value_info("input_ids", i32, ["batch_size", "sequence_length"])
    mask = helper.make_tensor_value_info("attention_mask", i32, ["batch_size", "sequence_length"])
    attributes = {
        "eos_token_id": settings.eos_token_id,
        "pad_token_id": settings.pad_token_id,
        "no_repeat_ngram_size": settings.no_repeat_ngram_size,
        "model_type": 0,  # decoder only (GPT-2)
        "decoder": subgraph,
    }
    if kind == "beam":
        inputs = [ids, _scalar("max_length", i32), _scalar("min_length", i32), _scalar("num_beams", i32)]
        inputs += [_scalar("num_return_sequences", i32), _scalar("length_penalty", f32)]
        inputs += [_scalar("repetition_penalty", f32), mask]
        # positions: input_ids, max_length, min_length, num_beams, num_return_sequences, length_penalty,
        # repetition_penalty, vocab_mask, prefix_vocab_mask, attention_mask
        node_inputs = [v.name for v in inputs[:7]] + ["", "", "attention_mask"]
        outputs = [
            helper.make_tensor_value_info("sequences", i32, ["batch_size", "num_return_sequences", "max_length"]),
            helper.make_tensor_value_info("sequences_scores", f32, ["batch_size", "num_return_sequences"]),
        ]
        attributes["early_stopping"] = int(settings.early_stopping)
    else:
        inputs = [ids, _scalar("max_length", i32), _scalar("min_length", i32), _scalar("repetition_penalty", f32), mask]
        # input_ids, max_length, min_length, repetition_penalty, vocab_mask, prefix_vocab_mask, attention_mask
        node_inputs = [v.name for v in inputs[:4]] + ["", "", "attention_mask"]
        if kind == "sampling":
            inputs.append(_scalar("seed", i32))
            node_inputs += ["", "seed"]  # presence_mask, seed
            attributes.update(temperature=settings.temperature, top_p=settings.top_p)
        outputs = [helper.make_tensor_value_info("sequences", i32, ["batch_size", "max_length"])]
    node = helper.make_node(
        SEARCHES[kind],
        node_inputs,
        [o.name for o in outputs],
        name=SEARCHES[kind],
        domain=MS_DOMAIN,
        **attributes,
    )
    graph = helper.make_graph([node], f"gpt2onnx {kind} search", inputs, outputs, initializer=initializers)
    imports = [o for o in opset_imports if o.domain != MS_DOMAIN] + [helper.make_opsetid(MS_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=imports, ir_version=ir_version, producer_name="gpt2onnx")


def write_ort_generate(
    folder: Path, out: Path, *, settings_from: Path | None = None, outside_vocabulary: dict | None = None
) -> tuple[list[str], FixedSettings]:
    """Write ort-generate/ into ``out`` (a staging copy of ``folder``); returns the files written, relative to it,
    and the attributes fixed in them (the manifest records them)."""
    # a shared-K/V-cache folder (GroupQueryAttention) runs too: the ops feed it a growing past, which
    # GroupQueryAttention concatenates (their past_present_share_buffer mode needs a past_sequence_length
    # input and, for beams, DecoderMaskedMultiHeadAttention, which this graph does not have)
    model = load_model(folder / MODEL_FILE)  # with its weights: they move into the outer graphs
    shape = decoder_shape(*graph_io(model), read_n_positions(folder))
    if shape.vocab_size is None:
        raise ContractError(f"'{folder / MODEL_FILE}' has no fixed vocabulary size on its logits: the ops need it")
    # errors name the file the user has
    settings = fixed_settings(settings_from or folder, shape.vocab_size, outside_vocabulary=outside_vocabulary)
    subgraph, initializers = decoder_subgraph(model, shape)
    target = out / SUBFOLDER
    target.mkdir()
    written = []
    for kind in SEARCHES:
        search = search_model(
            kind,
            subgraph,
            initializers,
            settings,
            opset_imports=list(model.opset_import),
            ir_version=model.ir_version,
        )
        path = target / FILES[kind]
        if not written:  # the first file writes the data; the others point at the same tensors in it
            onnx.save_model(
                search, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=DATA_NAME
            )
            initializers = list(search.graph.initializer)  # now external references
        else:
            onnx.save_model(search, str(path))
        written.append(f"{SUBFOLDER}/{FILES[kind]}")
    written.append(f"{SUBFOLDER}/{DATA_NAME}")
    log.info("ort-generate: %s with %d layers, settings %s", ", ".join(FILES.values()), shape.n_layer, settings)
    return written, settings


def _write(deployment: Deployment, options) -> Written:
    outside = deployment.source.manifest.outside_vocabulary  # the staging copy has no manifest yet
    files, fixed = write_ort_generate(
        deployment.staging, deployment.staging, settings_from=deployment.source.folder, outside_vocabulary=outside
    )
    return Written(files, fixed.as_dict())


SPEC = TargetSpec(
    name="ort-generate",
    summary="onnxruntime's generation ops: greedy, beam and sampling search inside the graph, one session.run each",
    write=_write,
    paths=(SUBFOLDER,),
    record="ort_generate",
    # onnxruntime's GreedySearch feeds a growing past and stacks it in float (measured on the tiny model)
    requires=(
        Need("cache_grows", allowed={True}, why="runs generation ops that feed a growing past"),
        Need("kv_dtype", allowed={FLOAT_CACHE}, why="runs generation ops that take a float K/V cache"),
    ),
)
