"""gpt2onnx: GPT-2 from a PyTorch checkpoint to a verified, fast ONNX decoder with past key/values.

The Python API does what the CLI does::

    from gpt2onnx import ExportOptions, export, inspect_model, check_parity, benchmark
    result = export("gpt2", "models/gpt2", random_init=True, options=ExportOptions(logits="last"))
    report = check_parity(result.folder, cases=20)
"""

__version__ = "0.1.0"

__all__ = [
    "BenchConfig",
    "ExportOptions",
    "Gpt2OnnxError",
    "ProviderConfig",
    "Sampling",
    "benchmark",
    "check_parity",
    "export",
    "generate",
    "inspect_model",
    "load_checkpoint",
    "open_decoder",
    "open_folder",
]


def __getattr__(name):  # lazy: `gpt2onnx --version` and `import gpt2onnx` stay fast, torch loads on use
    from importlib import import_module

    homes = {
        "BenchConfig": "gpt2onnx.runtimes.bench",
        "benchmark": "gpt2onnx.runtimes.bench",
        "ExportOptions": "gpt2onnx.exporters.export",
        "export": "gpt2onnx.exporters.export",
        "Gpt2OnnxError": "gpt2onnx.errors",
        "ProviderConfig": "gpt2onnx.runtimes.providers",
        "Sampling": "gpt2onnx.runtimes.generate",
        "generate": "gpt2onnx.runtimes.generate",
        "check_parity": "gpt2onnx.runtimes.parity",
        "inspect_model": "gpt2onnx.inspection",
        "load_checkpoint": "gpt2onnx.checkpoint",
        "open_decoder": "gpt2onnx.runtimes.model_folder",
        "open_folder": "gpt2onnx.runtimes.model_folder",
    }
    if name not in homes:
        raise AttributeError(f"module 'gpt2onnx' has no attribute {name!r}")
    return getattr(import_module(homes[name]), name)
