"""`gpt2onnx inspect`: what an ONNX file holds, read without running it (weights are not loaded)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from gpt2onnx.errors import Gpt2OnnxError
from gpt2onnx.exporters.io_spec import ONNX_DTYPES

_BLOCK_PARAM = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(.+)\.(weight|bias)$")
_TOP_PARAM = re.compile(r"^(?:transformer\.)?(wte|wpe|ln_f|lm_head)(?:\.(weight|bias))?$")
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


def resolve_model_path(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise Gpt2OnnxError(f"'{path}': no such file or folder")
    if path.is_dir():
        candidates = sorted(path.glob("*.onnx"))
        if (path / "model.onnx").is_file():
            return path / "model.onnx"
        if len(candidates) == 1:
            return candidates[0]
        raise Gpt2OnnxError(f"'{path}' holds no model.onnx{' (and several .onnx files)' if candidates else ''}: give the file")
    return path


def load_graph(path: Path) -> onnx.ModelProto:
    """The graph without its weights; a clear error for anything that is not ONNX."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as err:
        raise Gpt2OnnxError(f"'{path}' is not an ONNX model ({type(err).__name__}); give a .onnx file or an exported folder") from None
    if not model.graph.node and not model.graph.input:
        raise Gpt2OnnxError(f"'{path}' is not an ONNX model (it holds no graph); give a .onnx file or an exported folder")
    return model


def _dims(value) -> list[str | int]:
    shape = value.type.tensor_type.shape
    return [d.dim_param if d.dim_param else d.dim_value for d in shape.dim]


def _io(values) -> list[dict]:
    return [
        {"name": v.name, "dtype": ONNX_DTYPES.get(v.type.tensor_type.elem_type, str(v.type.tensor_type.elem_type)), "dims": _dims(v)}
        for v in values
    ]


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


def inspect_model(path: str | Path) -> dict:
    """Inputs/outputs with dynamic dims, opset and domains, op histogram, file sizes, parameter accounting."""
    from gpt2onnx.exporters.export import read_manifest

    model_path = resolve_model_path(path)
    model = load_graph(model_path)
    data_files = sorted(
        {
            entry.value
            for init in model.graph.initializer
            if init.data_location == onnx.TensorProto.EXTERNAL
            for entry in init.external_data
            if entry.key == "location"
        }
    )
    files = {model_path.name: model_path.stat().st_size}
    for name in data_files:
        data_path = model_path.parent / name
        files[name] = data_path.stat().st_size if data_path.is_file() else None
    histogram = Counter((n.domain or "ai.onnx", n.op_type) for n in model.graph.node)
    manifest = read_manifest(model_path.parent)
    return {
        "path": str(model_path),
        "ir_version": model.ir_version,
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "opset_imports": {imp.domain or "ai.onnx": imp.version for imp in model.opset_import},
        "inputs": _io(model.graph.input),
        "outputs": _io(model.graph.output),
        "op_histogram": [
            {"domain": domain, "op_type": op, "count": count} for (domain, op), count in histogram.most_common()
        ],
        "node_count": len(model.graph.node),
        "files": files,
        "parameters": parameter_accounting(model),
        "manifest": (
            {k: manifest.get(k) for k in ("kind", "name", "source", "dtype", "opset", "parity", "options", "fusion")}
            if manifest
            else None
        ),
    }
