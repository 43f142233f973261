"""The environment of scripts/gpu_check.sh, as JSON: the GPU and its driver, the versions of Python packages, of
onnxruntime's build and of the CUDA, cuDNN and TensorRT libraries it loaded, the providers that really load (each
refusal with onnxruntime's reason), and what torch sees.

    python scripts/gpu_check_env.py environment.json

onnxruntime is probed first, the way `gpt2onnx bench` meets it (GPU libraries preloaded, torch not imported):
torch loads its own CUDA libraries when imported, which would hide a library onnxruntime cannot find.
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGES = (
    "gpt2onnx",
    "torch",
    "transformers",
    "onnx",
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxscript",
    "optimum-onnx",
    "tensorrt",
    "tensorrt-cu13-libs",
    "tensorrt-cu12-libs",
)


def installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def gpus() -> list[dict]:
    """The GPUs nvidia-smi lists (name, driver, memory); empty without a driver."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = [line.split(", ") for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    return [{"name": r[0], "driver": r[1], "memory": r[2]} for r in rows if len(r) == 3]


def provider_reasons(working: list[str]) -> dict[str, str]:
    """Why each GPU provider that does not work here was refused: gpt2onnx's one line, onnxruntime's reason in it."""
    from onnx import TensorProto, helper, save

    from gpt2onnx.errors import Gpt2OnnxError
    from gpt2onnx.runtimes.providers import ProviderConfig, create_session

    reasons = {}
    with tempfile.TemporaryDirectory() as tmp:
        graph = helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            "probe",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        )
        path = Path(tmp) / "probe.onnx"
        save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
        for name in ("cuda", "tensorrt"):
            if name in working:
                continue
            try:
                create_session(path, ProviderConfig(name=name))
                reasons[name] = "loads here, but not on the probe graph"
            except Gpt2OnnxError as err:
                reasons[name] = str(err)
    return reasons


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    import onnxruntime as ort

    from gpt2onnx.runtimes.providers import gpu_library_versions, working_providers

    working = working_providers()  # preloads the GPU libraries first, as a session would
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpus": gpus(),
        "versions": {name: installed(name) for name in PACKAGES},
        "onnxruntime": {
            "version": ort.__version__,
            "path": str(Path(ort.__file__).parent),
            "build": ort.get_build_info() if hasattr(ort, "get_build_info") else None,
            "available_providers": ort.get_available_providers(),
        },
        "working_providers": working,
        "refused_providers": provider_reasons(working),
    }
    env["gpu_libraries"] = gpu_library_versions()  # what onnxruntime loaded, before torch loads its own
    env["cuda_provider"] = "cuda" in working
    try:
        import torch

        cuda = torch.cuda.is_available()
        env["torch"] = {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None,
            "sees_cuda": cuda,
            "device": torch.cuda.get_device_name(0) if cuda else None,
        }
    except ImportError:
        env["torch"] = {"version": None, "sees_cuda": False}
    # a GPU by any sign: nvidia-smi, the driver's device node, or torch (so that a missing nvidia-smi cannot turn
    # a GPU machine's check into a CPU rehearsal that passes)
    env["gpu_present"] = bool(env["gpus"]) or Path("/dev/nvidia0").exists() or bool(env["torch"]["sees_cuda"])
    Path(argv[0]).write_text(json.dumps(env, indent=2))
    where = ", ".join(g["name"] for g in env["gpus"]) or "no GPU"
    print(f"  {where}; providers that load: {', '.join(working)}; torch sees CUDA: {env['torch']['sees_cuda']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
