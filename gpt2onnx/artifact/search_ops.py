"""onnxruntime's generation ops in a deployed folder (the ort-generate target writes them, the ort-generate runtime
runs them): where the files are, and the search settings fixed in them as attributes, read from the files.

    ort-generate/greedy_search.onnx   com.microsoft GreedySearch
    ort-generate/beam_search.onnx     com.microsoft BeamSearch
    ort-generate/sampling.onnx        com.microsoft Sampling
    ort-generate/weights.onnx_data    the decoder's weights, one copy that all three files point at
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from onnx import helper

from gpt2onnx.artifact.graph import load_graph
from gpt2onnx.errors import ContractError
from gpt2onnx.records import Record

SUBFOLDER = "ort-generate"
DATA_NAME = "weights.onnx_data"
SEARCHES = {"greedy": "GreedySearch", "beam": "BeamSearch", "sampling": "Sampling"}
FILES = {"greedy": "greedy_search.onnx", "beam": "beam_search.onnx", "sampling": "sampling.onnx"}
MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class FixedSettings(Record):
    """The settings the ops take as attributes: fixed in the files when the folder is deployed."""

    eos_token_id: int
    pad_token_id: int
    no_repeat_ngram_size: int = 0
    early_stopping: bool = False
    temperature: float = 1.0
    top_p: float = 1.0


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
