"""`gpt2onnx inspect`: what an ONNX file holds, read without running it (weights are not loaded)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import onnx

from gpt2onnx.artifact.contract import TensorSpec, graph_io
from gpt2onnx.artifact.folder import check_integrity, read_manifest
from gpt2onnx.artifact.graph import external_data_files, load_graph, resolve_model_path
from gpt2onnx.artifact.manifest import Manifest
from gpt2onnx.artifact.paths import file_in_folder
from gpt2onnx.errors import ContractError
from gpt2onnx.records import Record, field, to_json

_BLOCK_PARAM = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(.+)\.(weight|bias)$")
_TOP_PARAM = re.compile(r"^(?:transformer\.)?(wte|wpe|ln_f|lm_head)(?:\.(weight|bias))?$")
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


@dataclass(frozen=True)
class ComponentParameters(Record):
    """The parameters of one component (h.attn.c_attn, wte, ...): per instance, instances, total."""

    component: str
    params_per_instance: int
    instances: int
    total: int
    uniform: bool  # every instance has the same count


@dataclass(frozen=True)
class UnnamedParameter(Record):
    """A float initializer whose name maps to no GPT-2 component."""

    name: str
    dims: list[int]
    params: int


@dataclass(frozen=True)
class ParameterAccounting(Record):
    components: list[ComponentParameters]
    unnamed: list[UnnamedParameter]
    total: int
    constant_elements: int  # elements of non-float or scalar initializers, not counted as parameters


@dataclass(frozen=True)
class OpCount(Record):
    domain: str
    op_type: str
    count: int


def _manifest_summary(description: ModelDescription) -> dict | None:
    """What inspect --json shows of the folder's manifest: its main records, the targets, the check."""
    manifest = description.manifest
    if manifest is None:
        return None
    recorded = to_json(manifest)
    return {
        **{k: recorded[k] for k in ("kind", "name", "source", "dtype", "opset", "options")},
        **{k: recorded[k] for k in ("fusion", "quantization", "fp16")},
        "targets": manifest.deploy.targets if manifest.deploy else None,
        "checks": to_json(manifest.check),
        "check_summary": manifest.check_summary,
        "unreadable": manifest.unreadable,  # records of a damaged manifest, not shown
    }


@dataclass(frozen=True)
class ModelDescription(Record):
    """What :func:`inspect` returns (its ``as_dict()`` is ``gpt2onnx inspect --json``): what an ONNX file holds,
    and its folder's manifest (None for a file outside a gpt2onnx folder, or an optimum folder), of which the
    JSON shows a summary."""

    path: str
    ir_version: int
    producer: str
    opset_imports: dict[str, int]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    op_histogram: list[OpCount]  # most common first
    node_count: int
    files: dict[str, int | None]  # file → bytes (None: missing)
    external_data: list[str]
    parameters: ParameterAccounting
    manifest: Manifest | None = field(write=_manifest_summary)


def parameter_accounting(model: onnx.ModelProto) -> ParameterAccounting:
    """Parameters per component, read from the initializers: per instance, number of instances, total."""
    per_component: dict[str, dict[int | None, int]] = {}
    unnamed: list[UnnamedParameter] = []
    constants = 0
    for init in model.graph.initializer:
        count = 1
        for d in init.dims:
            count *= d
        if init.data_type not in _FLOAT_TYPES or count <= 1:
            constants += count
            continue
        if m := _BLOCK_PARAM.match(init.name):
            key, instance = f"h.{m[2]}", int(m[1])
        elif m := _TOP_PARAM.match(init.name):
            key, instance = m[1], None
        else:
            unnamed.append(UnnamedParameter(init.name, list(init.dims), count))
            continue
        slot = per_component.setdefault(key, {})
        slot[instance] = slot.get(instance, 0) + count
    components = []
    for key, instances in per_component.items():
        sizes = set(instances.values())
        components.append(
            ComponentParameters(key, max(sizes), len(instances), sum(instances.values()), len(sizes) == 1)
        )
    total = sum(c.total for c in components) + sum(u.params for u in unnamed)
    return ParameterAccounting(components, unnamed, total, constants)


def _expected_data_bytes(model: onnx.ModelProto) -> dict[str, int]:
    """Per external data file, the bytes its tensors need (largest offset + length)."""
    needed: dict[str, int] = {}
    for init in model.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entry = {e.key: e.value for e in init.external_data}
        try:
            end = int(entry.get("offset", 0)) + int(entry.get("length", 0))
        except ValueError:
            raise ContractError(
                f"tensor '{init.name}' has an external-data offset or length that is not a number: export it again"
            ) from None
        needed[entry.get("location", "")] = max(needed.get(entry.get("location", ""), 0), end)
    return needed


def inspect(path: str | Path, *, verify_files: bool = True) -> ModelDescription:
    """What an ONNX file (or an exported folder's model) holds, read without running it or loading its weights.

    Args:
        path: an .onnx file, or a folder holding model.onnx (gpt2onnx's or optimum's).
        verify_files: check the model files against the sha256 of the folder's manifest, if it has one.

    Returns:
        ModelDescription: path, IR version, producer, opsets, inputs and outputs with their dims, op histogram,
        node count, file sizes, parameter accounting, and the folder's Manifest (its check included);
        ``as_dict()`` is the JSON of ``gpt2onnx inspect --json``.

    Raises:
        BadInput: no such path, or not a regular file. ContractError: not an ONNX model, or an external data
        file is missing or truncated. IntegrityError: a model file differs from its manifest.
    """
    model_path = resolve_model_path(path)
    model = load_graph(model_path)
    files: dict[str, int | None] = {model_path.name: model_path.stat().st_size}
    for name, needed in _expected_data_bytes(model).items():
        data_path = file_in_folder(
            model_path.parent, name, what="external data file", where=model_path, must_exist=False
        )
        files[name] = data_path.stat().st_size if data_path.is_file() else None
        if files[name] is None or files[name] < needed:
            state = "is missing" if files[name] is None else f"is {files[name]:,} bytes, its tensors need {needed:,}"
            raise ContractError(f"external data file '{data_path}' {state}: copy the whole exported folder again")
    histogram = Counter((n.domain or "ai.onnx", n.op_type) for n in model.graph.node)
    manifest = read_manifest(model_path.parent) if model_path.name == "model.onnx" else None
    if manifest is not None and verify_files:
        check_integrity(model_path.parent, manifest)
    inputs, outputs = graph_io(model)
    return ModelDescription(
        path=str(model_path),
        ir_version=model.ir_version,
        producer=f"{model.producer_name} {model.producer_version}".strip(),
        opset_imports={imp.domain or "ai.onnx": imp.version for imp in model.opset_import},
        inputs=list(inputs),
        outputs=list(outputs),
        op_histogram=[OpCount(domain, op, count) for (domain, op), count in histogram.most_common()],
        node_count=len(model.graph.node),
        files=files,
        external_data=external_data_files(model),
        parameters=parameter_accounting(model),
        manifest=manifest,
    )
