"""`gpt2onnx inspect`: what an ONNX file holds, read without running it (weights are not loaded)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import onnx

from gpt2onnx.artifact.contract import graph_io
from gpt2onnx.artifact.folder import check_integrity, read_manifest
from gpt2onnx.artifact.graph import external_data_files, load_graph, resolve_model_path
from gpt2onnx.artifact.paths import file_in_folder
from gpt2onnx.artifact.report import CheckReport
from gpt2onnx.errors import ContractError

_BLOCK_PARAM = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(.+)\.(weight|bias)$")
_TOP_PARAM = re.compile(r"^(?:transformer\.)?(wte|wpe|ln_f|lm_head)(?:\.(weight|bias))?$")
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


def parameter_accounting(model: onnx.ModelProto) -> dict:
    """Parameters per component, read from the initializers: per instance, number of instances, total."""
    per_component: dict[str, dict[int | None, int]] = {}
    unnamed: list[dict] = []
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
            unnamed.append({"name": init.name, "dims": list(init.dims), "params": count})
            continue
        slot = per_component.setdefault(key, {})
        slot[instance] = slot.get(instance, 0) + count
    components = []
    for key, instances in per_component.items():
        sizes = set(instances.values())
        components.append(
            {
                "component": key,
                "params_per_instance": max(sizes),
                "instances": len(instances),
                "total": sum(instances.values()),
                "uniform": len(sizes) == 1,
            }
        )
    total = sum(c["total"] for c in components) + sum(u["params"] for u in unnamed)
    return {"components": components, "unnamed": unnamed, "total": total, "constant_elements": constants}


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


# What inspect shows of a manifest, with the type each section must have; a section of another type (a
# hand-edited or damaged manifest) is shown as None and listed under "unreadable", never rendered.
_SECTIONS = {
    "kind": str,
    "name": str,
    "source": dict,
    "dtype": str,
    "opset": int,
    "options": dict,
    "fusion": dict,
    "quantization": dict,
    "fp16": dict,
    "targets": (list, dict),
}


def _manifest_sections(manifest: dict) -> dict:
    shown, unreadable = {}, []
    for key, kind in _SECTIONS.items():
        value = manifest.get(key)
        fusion_ok = key != "fusion" or (
            isinstance(value, dict)
            and isinstance(value.get("op_counts"), dict)
            and isinstance(value.get("profile"), str)
        )
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool) or not fusion_ok):
            unreadable.append(key)
            value = None
        shown[key] = value
    return {**shown, "unreadable": unreadable}


def inspect_model(path: str | Path, *, verify_files: bool = True) -> dict:
    """What an ONNX file (or an exported folder's model) holds, read without running it or loading its weights.

    Args:
        path: an .onnx file, or a folder holding model.onnx (gpt2onnx's or optimum's).
        verify_files: check the model files against the sha256 of the folder's manifest, if it has one.

    Returns:
        A JSON-ready dict: path, IR version, producer, opsets, inputs and outputs with their dims, op histogram,
        node count, file sizes, parameter accounting, and the manifest's record (kind, source, dtype, options,
        fusion, quantization, and ``checks``: the export's check report, for every precision).

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
    report = CheckReport.from_dict((manifest or {}).get("parity"))
    return {
        "path": str(model_path),
        "ir_version": model.ir_version,
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "opset_imports": {imp.domain or "ai.onnx": imp.version for imp in model.opset_import},
        "inputs": [t.as_dict() for t in inputs],
        "outputs": [t.as_dict() for t in outputs],
        "op_histogram": [
            {"domain": domain, "op_type": op, "count": count} for (domain, op), count in histogram.most_common()
        ],
        "node_count": len(model.graph.node),
        "files": files,
        "external_data": external_data_files(model),
        "parameters": parameter_accounting(model),
        "manifest": (
            {
                **_manifest_sections(manifest),
                "checks": report.as_dict() if report else None,
                "check_summary": report.summary()
                if report
                else ("not validated" if manifest.get("parity") is None else "unreadable"),
            }
            if manifest
            else None
        ),
    }
