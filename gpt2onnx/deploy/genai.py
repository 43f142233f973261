"""onnxruntime-genai: genai_config.json next to model.onnx, so that ``og.Model(folder)`` runs the folder.

The config describes our IO contract to genai's "decoder" model type: per-layer past/present names as
printf patterns, the sizes, the token ids, and the search defaults of generation_config.json.
Field names as onnxruntime-genai 0.18 reads them (src/config.cpp; unknown keys are rejected there).
Also used by the genai runtime (gpt2onnx/runtimes), which writes the config into a temporary folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpt2onnx.artifact.contract import decoder_shape, graph_io
from gpt2onnx.artifact.folder import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    MODEL_FILE,
    read_json_file,
    read_manifest,
    read_n_positions,
)
from gpt2onnx.artifact.graph import load_graph
from gpt2onnx.errors import ContractError

CONFIG_NAME = "genai_config.json"
# transformers' defaults, used where generation_config.json does not say (as transformers would)
SEARCH_DEFAULTS = {"do_sample": False, "top_k": 50, "top_p": 1.0, "temperature": 1.0, "repetition_penalty": 1.0}


def _token_ids(folder: Path, vocab_size: int) -> dict[str, int]:
    """bos, eos and pad ids from generation_config.json, else config.json; pad falls back to eos.
    genai refuses an id outside the vocabulary, so that is an error here too."""
    sources = [
        read_json_file(folder / name, name)
        for name in (GENERATION_CONFIG_FILE, CONFIG_FILE)
        if (folder / name).is_file()
    ]

    def first(key: str) -> int | None:
        for source in sources:
            value = source.get(key)
            if isinstance(value, list):
                value = value[0] if value else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    eos = first("eos_token_id")
    eos = vocab_size - 1 if eos is None else eos
    ids = {"bos_token_id": first("bos_token_id"), "eos_token_id": eos, "pad_token_id": first("pad_token_id")}
    ids["bos_token_id"] = eos if ids["bos_token_id"] is None else ids["bos_token_id"]
    ids["pad_token_id"] = eos if ids["pad_token_id"] is None else ids["pad_token_id"]
    for key, value in ids.items():
        if not 0 <= value < vocab_size:
            raise ContractError(
                f"{key} {value} is outside the vocabulary (size {vocab_size}): onnxruntime-genai refuses it;"
                f" fix {GENERATION_CONFIG_FILE} or {CONFIG_FILE} in '{folder}'"
            )
    return ids


def _search(folder: Path, n_positions: int, shared_kv: bool) -> dict:
    generation = (
        read_json_file(folder / GENERATION_CONFIG_FILE, GENERATION_CONFIG_FILE)
        if (folder / GENERATION_CONFIG_FILE).is_file()
        else {}
    )
    search = {key: generation.get(key, default) for key, default in SEARCH_DEFAULTS.items()}
    search = {
        key: (type(SEARCH_DEFAULTS[key])(value) if value is not None else SEARCH_DEFAULTS[key])
        for key, value in search.items()
    }
    max_length = generation.get("max_length")
    max_length = max_length if isinstance(max_length, int) and 0 < max_length <= n_positions else n_positions
    return {
        **search,
        "num_beams": 1,
        "num_return_sequences": 1,
        "length_penalty": 1.0,
        "early_stopping": True,
        "min_length": 0,
        "max_length": max_length,
        # one buffer for past and present needs a graph that writes into it (GroupQueryAttention's shared
        # cache); our Concat graph grows present from past, which fails with a shared buffer
        "past_present_share_buffer": shared_kv,
    }


def genai_config(folder: str | Path, *, filename: str = MODEL_FILE) -> dict:
    """The genai_config.json for an exported decoder folder (any precision; read from its graph and configs)."""
    folder = Path(folder)
    n_positions = read_n_positions(folder)
    shape = decoder_shape(*graph_io(load_graph(folder / filename)), n_positions)
    if shape.vocab_size is None:
        raise ContractError(f"'{folder / filename}' has no fixed vocabulary size on its logits: genai needs it")
    manifest = read_manifest(folder)
    return {
        "model": {
            "type": "decoder",
            "vocab_size": shape.vocab_size,
            "context_length": n_positions,
            **_token_ids(folder, shape.vocab_size),
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
        "search": _search(folder, n_positions, manifest is not None and manifest.kv_cache == "shared"),
    }


def write_genai_config(folder: str | Path, out: str | Path) -> Path:
    """Write the folder's genai_config.json into the folder ``out`` (the folder itself, or a copy of it)."""
    path = Path(out) / CONFIG_NAME
    path.write_text(json.dumps(genai_config(folder), indent=2) + "\n")
    return path
