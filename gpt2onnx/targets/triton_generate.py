"""Triton Inference Server: the generation models beside the ONNX Runtime backend's decoder (gpt2onnx.targets.triton).

    triton/NAME-generate/config.pbtxt   Python backend, decoupled: text in, tokens and text streamed out
    triton/NAME-generate/1/model.py     one import of gpt2onnx.serving.triton_models.GenerateModel
    triton/NAME-generate/1/...          the decoder folder's files (hard-linked): model.onnx, config.json,
                                        generation_config.json, the tokenizer files, gpt2onnx.json
    triton/NAME-infer/config.pbtxt      Python backend, not decoupled: the unary infer of HTTP and gRPC,
    triton/NAME-infer/1/model.py        forwarded to NAME-generate (one engine for both)

The models run gpt2onnx's continuous-batching engine inside the server (:mod:`gpt2onnx.serving.engine`), so
the server's Python needs gpt2onnx (``pip install --no-deps gpt2onnx``) with onnxruntime, onnx, numpy and
tokenizers; ``model.py`` imports it and runs nothing else from the folder. A folder without tokenizer files gets
no generation models (they take text), only the decoder.
"""

from __future__ import annotations

import logging
from pathlib import Path

from gpt2onnx.artifact.folder import CONFIG_FILE, GENERATION_CONFIG_FILE, MANIFEST_NAME, TOKENIZER_FILES
from gpt2onnx.artifact.graph import external_data_files, load_graph
from gpt2onnx.artifact.manifest import MODEL_FILE, Manifest
from gpt2onnx.artifact.paths import file_in_folder
from gpt2onnx.files import link_or_copy
from gpt2onnx.targets.formats import json_text, pbtxt_string

log = logging.getLogger(__name__)

GENERATE_SUFFIX, INFER_SUFFIX = "-generate", "-infer"
DEFAULT_MAX_BATCH = 16
MODEL_PY = '''"""Written by gpt2onnx deploy --target triton. Triton's Python backend runs this file; it runs gpt2onnx's
{what} (installed in the server's Python: pip install --no-deps gpt2onnx). Nothing else in this folder is code:
the folder leaves sys.path before anything is imported, so no file here can stand in for a module."""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) not in (_here, os.path.dirname(_here))]

from gpt2onnx.serving.triton_models import {cls} as TritonPythonModel  # noqa: E402,F401
'''


def generate_config(name: str, *, kind: str, max_batch: int = DEFAULT_MAX_BATCH) -> str:
    """config.pbtxt of NAME-generate: decoupled, one instance (one engine batches every request)."""
    return "\n".join(
        [
            f"name: {pbtxt_string(name + GENERATE_SUFFIX)}",
            'backend: "python"',
            "max_batch_size: 0  # the engine batches requests itself, joining them at each decode step",
            "model_transaction_policy { decoupled: true }",
            "input [",
            '  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },',
            '  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true },',
            '  { name: "stop" data_type: TYPE_STRING dims: [ -1 ] optional: true }',
            "]",
            "output [",
            '  { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] },',
            '  { name: "output_ids" data_type: TYPE_INT64 dims: [ -1 ] },',
            '  { name: "finish_reason" data_type: TYPE_STRING dims: [ 1 ] }',
            "]",
            f"instance_group [ {{ kind: {_kind(kind)} count: 1 }} ]",
            f'parameters: {{ key: "max_batch" value: {{ string_value: {pbtxt_string(str(int(max_batch)))} }} }}',
            "",
        ]
    )


def infer_config(name: str, *, max_batch: int = DEFAULT_MAX_BATCH) -> str:
    """config.pbtxt of NAME-infer: Triton's dynamic batcher hands it the requests that wait, two instances so
    that new requests are taken while others decode (all of them join the same engine)."""
    return "\n".join(
        [
            f"name: {pbtxt_string(name + INFER_SUFFIX)}",
            'backend: "python"',
            f"max_batch_size: {int(max_batch)}",
            "dynamic_batching { max_queue_delay_microseconds: 2000 }",
            "input [",
            '  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },',
            '  { name: "stop" data_type: TYPE_STRING dims: [ -1 ] optional: true }',
            "]",
            "output [",
            '  { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] },',
            '  { name: "finish_reason" data_type: TYPE_STRING dims: [ 1 ] }',
            "]",
            "instance_group [ { kind: KIND_CPU count: 2 } ]",
            f'parameters: {{ key: "generate_model" value: {{ string_value: {pbtxt_string(name + GENERATE_SUFFIX)} }}'
            " }",
            "",
        ]
    )


def _kind(kind: str) -> str:
    """An instance kind is one of Triton's enum names, written bare."""
    if kind not in ("KIND_CPU", "KIND_GPU"):
        raise ValueError(f"unknown Triton instance kind {kind!r}")
    return kind


def has_tokenizer_files(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (
        (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()
    )


def write_generate_models(
    folder: Path, out: Path, *, name: str, kind: str, manifest: Manifest, repository: str
) -> list[str]:
    """Write NAME-generate and NAME-infer into ``out/repository``; returns the files written (relative to
    ``out``), none where the folder has no tokenizer."""
    if not has_tokenizer_files(folder):
        log.warning(
            "'%s' has no tokenizer files: the Triton generation models (they take text) are not written", folder
        )
        return []
    graph = load_graph(folder / MODEL_FILE)
    data_files = external_data_files(graph)
    del graph
    written = []
    generate = out / repository / f"{name}{GENERATE_SUFFIX}"
    version = generate / "1"
    version.mkdir(parents=True)
    (generate / "config.pbtxt").write_text(generate_config(name, kind=kind))
    (version / "model.py").write_text(MODEL_PY.format(what="generation engine", cls="GenerateModel"))
    companions = [CONFIG_FILE, GENERATION_CONFIG_FILE, *TOKENIZER_FILES]
    present = [c for c in companions if (folder / c).exists() or (folder / c).is_symlink()]
    for file in (MODEL_FILE, *data_files, *present):  # each a regular file inside the folder (a link out: refused)
        link_or_copy(file_in_folder(folder, file, what="file", where=folder), version / file)
    # the manifest the folder was opened with: the engine checks the model files against its sha256 at load
    (version / MANIFEST_NAME).write_text(json_text(manifest.as_dict()))
    written += [f"{repository}/{generate.name}/config.pbtxt"]
    written += sorted(f"{repository}/{generate.name}/1/{p.name}" for p in version.iterdir())
    infer = out / repository / f"{name}{INFER_SUFFIX}"
    (infer / "1").mkdir(parents=True)
    (infer / "config.pbtxt").write_text(infer_config(name))
    (infer / "1" / "model.py").write_text(MODEL_PY.format(what="forwarder to the generation model", cls="InferModel"))
    written += [f"{repository}/{infer.name}/config.pbtxt", f"{repository}/{infer.name}/1/model.py"]
    return written
