"""onnxruntime-genai's genai_config.json for a decoder folder: what the genai deployment target writes beside
model.onnx, and what the genai runtime writes into its temporary overlay for every run (one writer for both).

The config describes our IO contract to genai's "decoder" model type: per-layer past/present names as
printf patterns, the sizes, the token ids, and the search defaults of generation_config.json.
Field names as onnxruntime-genai 0.18 reads them (src/config.cpp; unknown keys are rejected there).
Every field is written by us from the graph, config.json and generation_config.json (an allow-list, typed):
nothing of a folder's own genai_config.json is passed through (custom_ops_library, enable_profiling,
decoder.filename would load code, write files or run another model).
"""

from __future__ import annotations

from pathlib import Path

from gpt2onnx.artifact.contract import decoder_shape, graph_io
from gpt2onnx.artifact.folder import MODEL_FILE, read_n_positions
from gpt2onnx.artifact.generation import GenerationConfig, read_generation_config, refuse_eos_outside
from gpt2onnx.artifact.graph import graph_facts, load_graph
from gpt2onnx.errors import ContractError

CONFIG_NAME = "genai_config.json"


def _token_ids(generation: GenerationConfig, vocab_size: int) -> dict[str, int]:
    """bos, eos and pad ids (each checked inside the vocabulary, which genai requires); pad and bos fall back
    to eos, eos to the last id."""
    eos = generation.eos_token_ids[0] if generation.eos_token_ids else vocab_size - 1
    bos = eos if generation.bos_token_id is None else generation.bos_token_id
    pad = eos if generation.pad_token_id is None else generation.pad_token_id
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}


def _search(generation: GenerationConfig, n_positions: int, shared_kv: bool) -> dict:
    """genai's search defaults: generation_config.json's (typed and ranged by its reader), transformers' defaults
    where it says nothing; max_length at most the context."""
    max_length = generation.max_length if generation.max_length and generation.max_length <= n_positions else None
    return {
        "do_sample": generation.do_sample,
        "top_k": generation.top_k,
        "top_p": generation.top_p,
        "temperature": generation.temperature,
        "repetition_penalty": generation.repetition_penalty,
        "num_beams": 1,
        "num_return_sequences": 1,
        "length_penalty": 1.0,
        "early_stopping": True,
        "min_length": 0,
        "max_length": max_length or n_positions,
        # one buffer for past and present needs a graph that writes into it (a buffer layout: gpt2onnx.layouts);
        # a Concat graph grows present from past, which fails with a shared buffer
        "past_present_share_buffer": shared_kv,
    }


def genai_config(folder: str | Path, *, filename: str = MODEL_FILE, outside_vocabulary: dict | None = None) -> dict:
    """The genai_config.json for an exported decoder folder (any precision; read from its graph and configs).
    ``outside_vocabulary``: the manifest's record of special tokens outside the vocabulary, for a folder without
    its manifest (a staging copy); genai needs its eos inside the vocabulary (BadInput where it is not)."""
    folder = Path(folder)
    n_positions = read_n_positions(folder)
    graph = load_graph(folder / filename)
    shape = decoder_shape(*graph_io(graph), n_positions)
    if shape.vocab_size is None:
        raise ContractError(f"'{folder / filename}' has no fixed vocabulary size on its logits: genai needs it")
    if not shape.kv_dtype.startswith("float"):
        raise ContractError(
            f"'{folder / filename}' stores its K/V cache as {shape.kv_dtype} (--kv-cache): gpt2onnx has not checked"
            " onnxruntime-genai on it; deploy the float-cache folder"
        )
    # the graph says whether it shares its cache, not a manifest (a staging folder has none yet). Every buffer
    # layout is one for genai (the static one too: genai binds one buffer of the context as past and present and
    # passes the mask of the tokens so far, whose width is where the graph writes; measured: genai 0.18 on tiny
    # exports, parity 3e-7, tokens of onnxruntime's; without the flag it passes a growing past, refused)
    shared_kv = graph_facts(graph).layout.in_place
    del graph
    generation = read_generation_config(folder, vocab_size=shape.vocab_size, outside_vocabulary=outside_vocabulary)
    refuse_eos_outside(generation, shape.vocab_size, needs="onnxruntime-genai")
    return {
        "model": {
            "type": "decoder",
            "vocab_size": shape.vocab_size,
            "context_length": n_positions,
            **_token_ids(generation, shape.vocab_size),
            "decoder": {
                "filename": filename,
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},  # [] = CPU
                "hidden_size": shape.n_head * shape.head_dim,
                "num_attention_heads": shape.n_head,
                "num_key_value_heads": shape.n_head,
                "num_hidden_layers": shape.n_layer,
                "head_size": shape.head_dim,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    **({"position_ids": "position_ids"} if shape.uses_position_ids else {}),
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": _search(generation, n_positions, shared_kv),
    }
