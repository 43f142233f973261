"""onnxruntime-genai: genai_config.json next to model.onnx, so that ``og.Model(folder)`` runs the folder.

The config itself is written by :mod:`gpt2onnx.artifact.genai_config` (the genai runtime writes the same one
into a temporary overlay for every run); genai reads only tokenizer.json of the tokenizer files.
A switchable folder's NAME.onnx_adapter files stay beside model.onnx (the staged copy holds every file of the
source): an application loads one with genai's multi-LoRA API, ``og.Adapters(model).load(path, NAME)`` and
``generator.set_active_adapter(adapters, NAME)``, as the genai runtime does for ``--adapter``.
"""

from __future__ import annotations

from pathlib import Path

from gpt2onnx.artifact.genai_config import CONFIG_NAME, genai_config
from gpt2onnx.artifact.lora import adapter_file
from gpt2onnx.capabilities import Need
from gpt2onnx.errors import ContractError
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE
from gpt2onnx.targets.formats import json_text
from gpt2onnx.targets.target import Deployment, TargetSpec, Written


def write_genai_config(folder: str | Path, out: str | Path, *, outside_vocabulary: dict | None = None) -> Path:
    """Write the folder's genai_config.json into the folder ``out`` (the folder itself, or a copy of it);
    ``outside_vocabulary``: the source manifest's record, for a folder without its manifest."""
    path = Path(out) / CONFIG_NAME
    path.write_text(json_text(genai_config(folder, outside_vocabulary=outside_vocabulary)))
    return path


def _write(deployment: Deployment, options) -> Written:
    # read from the source (the staged copies are the same files): an error names the user's file, not a copy
    outside = deployment.source.manifest.outside_vocabulary
    write_genai_config(deployment.source.folder, deployment.staging, outside_vocabulary=outside)
    missing = [n for n in deployment.source.manifest.adapters if not adapter_file(deployment.staging, n).is_file()]
    if missing:  # a switchable folder's adapter files are the deployment's too (genai's Adapters load them)
        raise ContractError(
            f"'{deployment.source.folder}' lists adapter files it does not hold ({', '.join(missing)}): export the"
            " folder again"
        )
    return Written([CONFIG_NAME])


SPEC = TargetSpec(
    name="genai",
    summary="onnxruntime-genai: genai_config.json beside model.onnx",
    write=_write,
    paths=(CONFIG_NAME,),
    tokenizer_json=True,
    requires=(Need("kv_dtype", allowed={FLOAT_CACHE}, why="has not been checked on a quantized K/V cache"),),
    carries_adapters=True,  # NAME.onnx_adapter beside model.onnx: og.Adapters loads them (the genai runtime does)
)
