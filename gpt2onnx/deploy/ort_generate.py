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
``generate`` (below) runs a file with transformers' option names and refuses, in one line, a setting the op
cannot express as transformers means it: top-k (no op has it), sampling with beams, an attribute other than the
deployed one, and a length_penalty other than 0 with beams (BeamSearch divides by the whole length, prompt and
padding included, where transformers divides by the generated length).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from gpt2onnx.artifact.contract import DecoderShape, decoder_shape, graph_io
from gpt2onnx.artifact.folder import GENERATION_CONFIG_FILE, MODEL_FILE, read_n_positions
from gpt2onnx.artifact.generation import COUNT_MAX, check_option, read_generation_config
from gpt2onnx.artifact.graph import load_graph
from gpt2onnx.errors import BadInput, ContractError, RuntimeUnavailable

log = logging.getLogger(__name__)

SUBFOLDER = "ort-generate"
DATA_NAME = "weights.onnx_data"
SEARCHES = {"greedy": "GreedySearch", "beam": "BeamSearch", "sampling": "Sampling"}
FILES = {"greedy": "greedy_search.onnx", "beam": "beam_search.onnx", "sampling": "sampling.onnx"}
MS_DOMAIN = "com.microsoft"
_ONNX_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


@dataclass(frozen=True)
class FixedSettings:
    """The settings the ops take as attributes: fixed in the files when the folder is deployed."""

    eos_token_id: int
    pad_token_id: int
    no_repeat_ngram_size: int = 0
    early_stopping: bool = False
    temperature: float = 1.0
    top_p: float = 1.0

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def fixed_settings(folder: str | Path, vocab_size: int) -> FixedSettings:
    """The attributes from generation_config.json, as transformers' generate() would read them there (its
    defaults where the file says nothing; each value checked by its rule); pad falls back to eos (GPT-2 has no
    pad token)."""
    folder = Path(folder)
    generation = read_generation_config(folder, vocab_size=vocab_size)
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
    outputs = {v.name: v for v in g.output}
    logits = outputs["logits"]
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

    nodes: list[onnx.NodeProto] = []
    for name, inner in own.items():  # the op feeds int32; our graph takes int64
        if name != "position_ids":
            nodes.append(helper.make_node("Cast", [name], [inner], to=TensorProto.INT64, name=f"cast_{name}"))
    if "position_ids" in own:
        # The ops derive position_ids from input_ids == pad_token_id, even with an attention_mask
        # (generation_device_helper.cc CreateGptInputs): a real pad/eos id inside a prompt would get position 0
        # and shift the rest. Positions from the mask instead, as transformers does: cumsum(mask) - 1, 1 on
        # padding, the last sequence_length columns (the whole prompt, then one per step).
        mask, position = own["attention_mask"], own["position_ids"]
        nodes += [
            helper.make_node("CumSum", [mask, "gpt2onnx.axis_1"], ["gpt2onnx.mask_cumsum"], name="positions_cumsum"),
            helper.make_node(
                "Sub", ["gpt2onnx.mask_cumsum", "gpt2onnx.one"], ["gpt2onnx.counted"], name="positions_sub"
            ),
            helper.make_node("Equal", [mask, "gpt2onnx.zero"], ["gpt2onnx.is_padding"], name="positions_padding"),
            helper.make_node(
                "Where",
                ["gpt2onnx.is_padding", "gpt2onnx.one", "gpt2onnx.counted"],
                ["gpt2onnx.all_positions"],
                name="positions_where",
            ),
            helper.make_node("Shape", [own["input_ids"]], ["gpt2onnx.ids_shape"], name="positions_shape"),
            helper.make_node(
                "Gather",
                ["gpt2onnx.ids_shape", "gpt2onnx.axis_1"],
                ["gpt2onnx.step_length"],
                axis=0,
                name="positions_len",
            ),
            helper.make_node("Neg", ["gpt2onnx.step_length"], ["gpt2onnx.step_start"], name="positions_start"),
            helper.make_node(
                "Slice",
                ["gpt2onnx.all_positions", "gpt2onnx.step_start", "gpt2onnx.big", "gpt2onnx.axis_1"],
                [position],
                name="positions_slice",
            ),
        ]
    for layer in range(shape.n_layer):
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
    for node in g.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        for i, name in enumerate(copy.input):
            if name in own:
                copy.input[i] = own[name]
        nodes.append(copy)
    for layer in range(shape.n_layer):
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

    constants = [
        helper.make_tensor("gpt2onnx.index_0", TensorProto.INT64, [], [0]),
        helper.make_tensor("gpt2onnx.index_1", TensorProto.INT64, [], [1]),
        helper.make_tensor("gpt2onnx.axis_0", TensorProto.INT64, [1], [0]),
        helper.make_tensor("gpt2onnx.axis_1", TensorProto.INT64, [1], [1]),
        helper.make_tensor("gpt2onnx.zero", TensorProto.INT64, [], [0]),
        helper.make_tensor("gpt2onnx.one", TensorProto.INT64, [], [1]),
        helper.make_tensor("gpt2onnx.big", TensorProto.INT64, [1], [2**62]),
    ]
    nodes = [helper.make_node("Constant", [], [t.name], value=t, name=f"const_{t.name}") for t in constants] + nodes
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


def write_ort_generate(folder: Path, out: Path) -> tuple[list[str], FixedSettings]:
    """Write ort-generate/ into ``out`` (a staging copy of ``folder``); returns the files written, relative to it,
    and the attributes fixed in them (the manifest records them)."""
    # a shared-K/V-cache folder (GroupQueryAttention) runs too: the ops feed it a growing past, which
    # GroupQueryAttention concatenates (their past_present_share_buffer mode needs a past_sequence_length
    # input and, for beams, DecoderMaskedMultiHeadAttention, which this graph does not have)
    model = onnx.load(str(folder / MODEL_FILE))  # with its weights: they move into the outer graphs
    shape = decoder_shape(*graph_io(model), read_n_positions(folder))
    if shape.vocab_size is None:
        raise ContractError(f"'{folder / MODEL_FILE}' has no fixed vocabulary size on its logits: the ops need it")
    settings = fixed_settings(folder, shape.vocab_size)
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


def deployed_settings(folder: str | Path) -> FixedSettings:
    """The attributes an ort-generate folder was deployed with, read from its files (what the ops will use;
    the manifest's record of them is a claim a hand edit could change): eos, pad, no_repeat_ngram_size and
    early_stopping from BeamSearch, temperature and top_p from Sampling."""
    folder = Path(folder)
    found: dict = {}
    for kind, keys in (
        ("beam", ("eos_token_id", "pad_token_id", "no_repeat_ngram_size", "early_stopping")),
        ("sampling", ("temperature", "top_p")),
    ):
        path = folder / SUBFOLDER / FILES[kind]
        if not path.exists():
            raise ContractError(f"'{path}' is missing: run gpt2onnx deploy {folder} --target ort-generate")
        nodes = [n for n in load_graph(path).graph.node if n.op_type == SEARCHES[kind] and n.domain == MS_DOMAIN]
        if len(nodes) != 1:
            raise ContractError(f"'{path}' is not an ort-generate file (no {SEARCHES[kind]} op): deploy it again")
        attributes = {a.name: helper.get_attribute_value(a) for a in nodes[0].attribute if a.name in keys}
        found.update({key: attributes[key] for key in keys if key in attributes})
    found["early_stopping"] = bool(found.get("early_stopping", 0))
    for key in ("temperature", "top_p"):  # float32 attributes: the shortest decimal that reads back the same
        if key in found:
            found[key] = float(str(np.float32(found[key])))
    try:
        return FixedSettings(**found)
    except TypeError:
        raise ContractError(f"the ort-generate files in '{folder}' lack their attributes: deploy it again") from None


# -- running a deployed folder ---------------------------------------------------------------------------------
@dataclass
class GenerateResult:
    """What one session.run returned: per prompt, per returned sequence, the generated tokens (the prompt and
    the padding after the end-of-sequence token removed; the end-of-sequence token kept, as transformers does)."""

    tokens: list[list[list[int]]]
    sequences: np.ndarray  # the op's own output: [batch, sequences, max_length], prompts left-padded
    scores: np.ndarray | None = None  # beam search: each returned sequence's score
    file: str = ""
    inputs: dict = field(default_factory=dict)


def _refuse(setting: str, reason: str) -> None:
    raise BadInput(f"ort-generate cannot {setting}: {reason}")


class OrtGenerator:
    """A deployed ort-generate folder, opened: one onnxruntime session per search kind, made on first use and
    kept, so that a caller generating many times pays the session set-up once."""

    def __init__(self, folder: str | Path, *, threads: int | None = None):
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            raise RuntimeUnavailable("onnxruntime is not installed: pip install onnxruntime") from None
        self.folder = Path(folder)
        self.fixed = deployed_settings(self.folder)
        self.n_positions = read_n_positions(self.folder)
        self.threads = threads
        self._sessions: dict[str, object] = {}

    def session(self, kind: str):
        if kind not in self._sessions:
            import onnxruntime as ort

            path = self.folder / SUBFOLDER / FILES[kind]
            if not path.is_file():
                raise ContractError(f"'{path}' is missing: run gpt2onnx deploy {self.folder} --target ort-generate")
            options = ort.SessionOptions()
            if self.threads:
                options.intra_op_num_threads = self.threads
            self._sessions[kind] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return self._sessions[kind]

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        min_new_tokens: int = 0,
        num_beams: int = 1,
        num_return_sequences: int = 1,
        length_penalty: float = 1.0,
        repetition_penalty: float = 1.0,
        do_sample: bool = False,
        top_k: int | None = None,
        seed: int | None = None,
        no_repeat_ngram_size: int | None = None,
        early_stopping: bool | str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        penalize_padding: bool = False,
    ) -> GenerateResult:
        """Generate in one session.run, with transformers' option names. Prompts of different lengths are
        left-padded and masked (the attention_mask input). Attribute settings (no_repeat_ngram_size,
        early_stopping, temperature, top_p) must equal the deployed ones.

        ``penalize_padding``: the ops' repetition penalty counts every id in the sequence, padding included, as
        transformers 4 does; transformers 5 leaves the padding out. By default (False, transformers 5) a row is
        padded with its own first token, which the penalty counts anyway (once per distinct id, as both do);
        True pads with the pad id (transformers 4)."""
        fixed = self.fixed
        for name, value in (  # the rules generate and generation_config.json are read by (artifact.generation)
            ("max_new_tokens", max_new_tokens),
            ("min_new_tokens", min_new_tokens),
            ("num_beams", num_beams),
            ("num_return_sequences", num_return_sequences),
            ("length_penalty", length_penalty),
            ("repetition_penalty", repetition_penalty),
            *((("seed", seed),) if seed is not None else ()),
        ):
            check_option(name, value)
        if seed is not None and seed > COUNT_MAX:
            raise BadInput(f"seed {seed} (--seed): the Sampling op takes a 32-bit seed; give one up to {COUNT_MAX:,}")
        if early_stopping == "never":
            _refuse("use early_stopping='never'", "BeamSearch's early_stopping attribute is true or false only")
        for name, value in (
            ("no_repeat_ngram_size", no_repeat_ngram_size),
            ("early_stopping", early_stopping),
            ("temperature", temperature),
            ("top_p", top_p),
        ):
            if value is not None and value != getattr(fixed, name):
                _refuse(
                    f"set {name}={value} at run time",
                    f"the op takes it as an attribute, deployed as {getattr(fixed, name)}; set it in"
                    f" {GENERATION_CONFIG_FILE} and deploy again",
                )
        if top_k:
            _refuse(
                f"use top_k={top_k}", "no onnxruntime generation op has top-k (Sampling has top_p only); pass top_k=0"
            )
        if num_beams < 1 or num_return_sequences < 1 or num_return_sequences > num_beams:
            raise BadInput(
                f"num_beams {num_beams} and num_return_sequences {num_return_sequences}: give 1 <= sequences <= beams"
            )
        if do_sample and num_beams > 1:
            _refuse("sample with beams", "BeamSearch has no sampling (beam-sample); use num_beams=1 or do_sample=False")
        if num_beams > 1 and length_penalty != 0:
            # BeamHypotheses::Add: score = sum_logprobs / total_length ** length_penalty, where transformers
            # divides by the generated length: with finished beams of different lengths they rank them otherwise
            _refuse(
                f"apply length_penalty={length_penalty} as transformers does",
                "BeamSearch divides a beam's score by its whole length (prompt and padding included), transformers by"
                " the generated length; pass length_penalty=0.0 (the same beams and scores), or run the file yourself",
            )
        if max_new_tokens < 1 or not 0 <= min_new_tokens <= max_new_tokens:
            raise BadInput(
                f"max_new_tokens {max_new_tokens}, min_new_tokens {min_new_tokens}: give 0 <= min <= max, max >= 1"
            )
        if repetition_penalty <= 0:
            raise BadInput(f"repetition_penalty {repetition_penalty}: give a value > 0 (1.0 is none)")
        if not prompts or any(not p for p in prompts):
            raise BadInput("give at least one prompt, none of them empty")
        kind = "sampling" if do_sample else ("beam" if num_beams > 1 else "greedy")
        width = max(len(p) for p in prompts)
        if width + max_new_tokens > self.n_positions:
            raise BadInput(
                f"prompt length {width} + {max_new_tokens} new tokens exceeds the context ({self.n_positions})"
            )
        own_padding = repetition_penalty != 1.0 and not penalize_padding
        padded = any(len(p) < width for p in prompts)
        if own_padding and padded and fixed.no_repeat_ngram_size:
            _refuse(
                "leave the padding out of repetition_penalty with no_repeat_ngram_size on a padded batch",
                "the ops count the padding in both (transformers 5 in the n-grams only); pass penalize_padding=True"
                " (transformers 4), or prompts of one length",
            )
        ids = np.full((len(prompts), width), fixed.pad_token_id, np.int32)
        mask = np.zeros((len(prompts), width), np.int32)
        for row, prompt in enumerate(prompts):
            if own_padding:
                ids[row] = prompt[0]  # an id the penalty counts anyway: the padding adds none
            ids[row, width - len(prompt) :] = prompt
            mask[row, width - len(prompt) :] = 1
        feed = {
            "input_ids": ids,
            "attention_mask": mask,
            "max_length": np.array([width + max_new_tokens], np.int32),
            # transformers' min_new_tokens, as the op's min_length: the whole (padded) length, as it counts
            "min_length": np.array([width + min_new_tokens if min_new_tokens else 0], np.int32),
            "repetition_penalty": np.array([repetition_penalty], np.float32),
        }
        if kind == "beam":
            feed["num_beams"] = np.array([num_beams], np.int32)
            feed["num_return_sequences"] = np.array([num_return_sequences], np.int32)
            feed["length_penalty"] = np.array([length_penalty], np.float32)
        if kind == "sampling":
            feed["seed"] = np.array([0 if seed is None else seed], np.int32)
        session = self.session(kind)
        results = session.run(None, feed)
        sequences = results[0] if kind == "beam" else results[0][:, None, :]
        tokens = [[_generated(seq[width:], fixed) for seq in row] for row in sequences]
        return GenerateResult(
            tokens, sequences, results[1] if kind == "beam" else None, str(self.folder / SUBFOLDER / FILES[kind]), feed
        )


def generate(folder: str | Path, prompts: list[list[int]], *, threads: int | None = None, **settings) -> GenerateResult:
    """One generation with a deployed ort-generate folder (see :meth:`OrtGenerator.generate` for ``settings``)."""
    return OrtGenerator(folder, threads=threads).generate(prompts, **settings)


def _generated(tail: np.ndarray, fixed: FixedSettings) -> list[int]:
    """Generated tokens up to and with the first end-of-sequence token (after it the op writes pad ids)."""
    out = []
    for token in tail.tolist():
        out.append(token)
        if token == fixed.eos_token_id:
            break
    return out
