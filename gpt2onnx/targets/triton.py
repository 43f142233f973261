"""Triton Inference Server: a model repository for its ONNX Runtime backend.

    triton/NAME/config.pbtxt    platform "onnxruntime_onnx", every input and output of the graph
    triton/NAME/1/model.onnx    (+ model.onnx_data), hard-linked from the folder

Dims come from the graph's IO contract, -1 for every symbolic dim. ``max_batch_size: 0`` with the batch dim
written out as -1: Triton's own batcher would stack requests along a first dim it adds, but two requests
stack only when every input has the same shape, and the past key/values differ in length from one request
(and one step) to the next; the client sends whole batches, as it does to onnxruntime. Start the server
with ``tritonserver --model-repository FOLDER/triton``.

Beside it, the generation models (NAME-generate, NAME-infer: gpt2onnx.targets.triton_generate) run the whole
decode loop in the server with continuous batching, on any server with the Python backend.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gpt2onnx.artifact.contract import TensorSpec, graph_io
from gpt2onnx.artifact.folder import MODEL_FILE
from gpt2onnx.artifact.graph import external_data_files, load_graph
from gpt2onnx.artifact.manifest import Manifest
from gpt2onnx.errors import BadInput, ContractError, shown
from gpt2onnx.files import link_or_copy
from gpt2onnx.targets import kserve
from gpt2onnx.targets.formats import pbtxt_string
from gpt2onnx.targets.kserve import write_kserve
from gpt2onnx.targets.target import Deployment, TargetSpec, Written
from gpt2onnx.targets.triton_generate import DEFAULT_MAX_BATCH, write_generate_models

SUBFOLDER = "triton"
KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU"}
TRITON_DTYPES = {
    "float32": "TYPE_FP32",
    "float16": "TYPE_FP16",
    "bfloat16": "TYPE_BF16",
    "int64": "TYPE_INT64",
    "int32": "TYPE_INT32",
    "int8": "TYPE_INT8",  # a quantized K/V cache's (--kv-cache int8)
    "uint8": "TYPE_UINT8",  # a 4-bit K/V cache's, two values a byte (--kv-cache int4)
    "bool": "TYPE_BOOL",
}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def model_name(name: str) -> str:
    """A Triton model name (a folder name in the repository)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > 90:  # 90: room for "-generate"
        raise BadInput(
            f"Triton model name {shown(name)} is not a plain name of at most 90 characters (letters, digits, '_', '.',"
            " '-'): give --triton-name"
        )
    return name


def _tensor(t: TensorSpec) -> str:
    if t.dtype not in TRITON_DTYPES:
        raise ContractError(
            f"{shown(t.name)} is {t.dtype}, which gpt2onnx has no Triton type for: deploy a folder whose inputs and"
            f" outputs are {', '.join(TRITON_DTYPES)}"
        )
    dims = ", ".join(str(d) if isinstance(d, int) and d > 0 else "-1" for d in t.dims)
    return f"  {{ name: {pbtxt_string(t.name)} data_type: {TRITON_DTYPES[t.dtype]} dims: [ {dims} ] }}"


def config_pbtxt(name: str, inputs: list[TensorSpec], outputs: list[TensorSpec], *, device: str = "cpu") -> str:
    """Triton's model configuration (protobuf text format) for a graph with these inputs and outputs."""
    if device not in KINDS:
        raise BadInput(f"unknown Triton instance kind '{device}': choose cpu or gpu")
    return "\n".join(
        [
            f"name: {pbtxt_string(model_name(name))}",
            'platform: "onnxruntime_onnx"',
            "max_batch_size: 0  # the batch dim is explicit (-1): requests carry past key/values of their own length",
            "input [",
            ",\n".join(_tensor(t) for t in inputs),
            "]",
            "output [",
            ",\n".join(_tensor(t) for t in outputs),
            "]",
            f"instance_group [ {{ kind: {KINDS[device]} count: 1 }} ]",
            "",
        ]
    )


def write_triton(
    folder: Path, out: Path, *, name: str, device: str = "cpu", manifest: Manifest | None = None
) -> list[str]:
    """Write triton/NAME/{config.pbtxt, 1/model.onnx[, data]} into ``out``, and with the folder's ``manifest``
    the generation models beside it and KServe's InferenceService for the repository; returns the files written."""
    graph = load_graph(folder / MODEL_FILE)
    text = config_pbtxt(name, *graph_io(graph), device=device)
    version = out / SUBFOLDER / name / "1"
    version.mkdir(parents=True)
    (version.parent / "config.pbtxt").write_text(text)
    written = [f"{SUBFOLDER}/{name}/config.pbtxt"]
    for file in (MODEL_FILE, *external_data_files(graph)):
        link_or_copy(folder / file, version / file)
        written.append(f"{SUBFOLDER}/{name}/1/{file}")
    if manifest is not None:
        written += write_generate_models(
            folder, out, name=name, kind=KINDS[device], manifest=manifest, repository=SUBFOLDER
        )
        model_bytes = sum((folder / f).stat().st_size for f in (MODEL_FILE, *external_data_files(graph)))
        written += write_kserve(
            out, name=name, model_bytes=model_bytes, gpu=device == "gpu", max_batch=DEFAULT_MAX_BATCH
        )
    return written


@dataclass(frozen=True)
class TritonOptions:
    """deploy's options for Triton: the model's name (default: the deployed folder's) and where its instances run."""

    triton_name: str | None = None
    triton_device: str = "cpu"

    def __post_init__(self) -> None:  # an invalid one cannot be built
        object.__setattr__(self, "triton_device", self.triton_device.lower())
        if self.triton_device not in KINDS:
            raise BadInput(f"unknown Triton instance kind '{self.triton_device}': choose cpu or gpu")
        if self.triton_name is not None:
            model_name(self.triton_name)


def _write(deployment: Deployment, options: TritonOptions) -> Written:
    name = model_name(options.triton_name or deployment.name)
    staging = deployment.staging
    files = write_triton(staging, staging, name=name, device=options.triton_device, manifest=deployment.source.manifest)
    return Written(files, {"name": name, "instance_kind": KINDS[options.triton_device]})


SPEC = TargetSpec(
    name="triton",
    summary="Triton: a model repository (ONNX Runtime backend, the generation models) and KServe's InferenceService",
    write=_write,
    paths=(SUBFOLDER, kserve.SUBFOLDER),
    options=TritonOptions,
    record="triton",
)
