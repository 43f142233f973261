"""gpt2onnx: GPT-2 from a PyTorch checkpoint to a verified, fast ONNX decoder with past key/values.

The Python API does what the CLI does, one function per command::

    import gpt2onnx
    result = gpt2onnx.export("gpt2", "models/gpt2", random_init=True, options=gpt2onnx.ExportOptions(logits="last"))
    print(gpt2onnx.inspect(result.folder).manifest.check_summary)
    report = gpt2onnx.parity(result.folder, cases=20)          # a CheckReport
    text = gpt2onnx.generate(result.folder, ids=["464,3290"]).texts
    figures = gpt2onnx.bench([result.folder], baseline="torch")  # a BenchReport; .as_dict() is its JSON
    quality = gpt2onnx.eval([result.folder], text="held-out.txt")   # an EvalReport: perplexity, KL, top-1

Errors are subclasses of :class:`Gpt2OnnxError` (:mod:`gpt2onnx.errors`). Importing the package is cheap:
each name loads its module on first use, and nothing on the run path (inspect, generate, bench without a
torch baseline) imports torch.
"""

import os
from importlib import import_module

# onnxruntime (1.31 on Linux) starts its telemetry when it is imported: it writes a device id and an event database
# under ~/.cache/Microsoft/DeveloperTools/ and, where it cannot (a home that is not writable: another user's, a
# read-only one), prints "Failed to persist telemetry device ID" on stderr before anything we say. Off unless the
# user chose otherwise (ORT_DISABLE_TELEMETRY=0), set here because the package is imported before any module that
# imports onnxruntime, and inherited by the processes gpt2onnx starts (the genai worker).
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

__version__ = "0.1.0"

_HOMES = {
    # the commands
    "export": ("gpt2onnx.exporters.export", "export"),
    "optimize": ("gpt2onnx.exporters.optimize", "optimize"),
    "inspect": ("gpt2onnx.artifact.inspect", "inspect"),
    "generate": ("gpt2onnx.decoding.generate", "generate"),
    "parity": ("gpt2onnx.verify.parity", "parity"),
    "bench": ("gpt2onnx.benchmarks.bench", "bench"),
    "deploy": ("gpt2onnx.targets.deploy", "deploy"),
    "eval": ("gpt2onnx.verify.evaluate", "evaluate"),
    # their options and results
    "ExportOptions": ("gpt2onnx.exporters.export", "ExportOptions"),
    "ExportResult": ("gpt2onnx.exporters.export", "ExportResult"),
    "OptimizeResult": ("gpt2onnx.exporters.optimize", "OptimizeResult"),
    "DeployResult": ("gpt2onnx.targets.deploy", "DeployResult"),
    "ModelDescription": ("gpt2onnx.artifact.inspect", "ModelDescription"),
    "BenchReport": ("gpt2onnx.benchmarks.bench", "BenchReport"),
    "Manifest": ("gpt2onnx.artifact.manifest", "Manifest"),
    "QuantizeOptions": ("gpt2onnx.precisions.quantize_options", "QuantizeOptions"),
    "ProviderConfig": ("gpt2onnx.runtimes.providers", "ProviderConfig"),
    "RuntimeOptions": ("gpt2onnx.runtimes.all_runtimes", "RuntimeOptions"),
    "Sampling": ("gpt2onnx.generation_options", "Sampling"),
    "Decoding": ("gpt2onnx.generation_options", "Decoding"),
    "TextGeneration": ("gpt2onnx.decoding.generate", "TextGeneration"),
    "Speculation": ("gpt2onnx.decoding.speculative", "Speculation"),  # generate(speculation=): prompt lookup, a draft
    "Constraint": ("gpt2onnx.decoding.constraints", "Constraint"),  # generate(constraint=): JSON schema, regex, grammar
    "Acceptance": ("gpt2onnx.decoding.speculative", "Acceptance"),
    "BenchConfig": ("gpt2onnx.benchmarks.timing", "BenchConfig"),
    "CheckReport": ("gpt2onnx.artifact.report", "CheckReport"),
    "EvalGates": ("gpt2onnx.verify.gates", "EvalGates"),
    "EvalReport": ("gpt2onnx.verify.evaluate", "EvalReport"),
    # lower level: a folder, a decoder on it, the decode loop, a checkpoint
    "open_folder": ("gpt2onnx.artifact.folder", "open_folder"),
    "open_decoder": ("gpt2onnx.runtimes.decoder", "open_decoder"),
    "open_runtime": ("gpt2onnx.runtimes.all_runtimes", "open_runtime"),
    "decode": ("gpt2onnx.decoding.generate", "decode"),
    "BatchingEngine": ("gpt2onnx.serving.engine", "BatchingEngine"),  # continuous batching, in-process
    "load_checkpoint": ("gpt2onnx.pytorch.checkpoint", "load_checkpoint"),
    # errors
    "Gpt2OnnxError": ("gpt2onnx.errors", "Gpt2OnnxError"),
    "BadInput": ("gpt2onnx.errors", "BadInput"),
    "CheckpointError": ("gpt2onnx.errors", "CheckpointError"),
    "ContractError": ("gpt2onnx.errors", "ContractError"),
    "IntegrityError": ("gpt2onnx.errors", "IntegrityError"),
    "CheckFailed": ("gpt2onnx.errors", "CheckFailed"),
    "RuntimeUnavailable": ("gpt2onnx.errors", "RuntimeUnavailable"),
    "OutputError": ("gpt2onnx.errors", "OutputError"),
}

__all__ = sorted(_HOMES)


def __getattr__(name):  # lazy: `gpt2onnx --version` and `import gpt2onnx` stay fast
    if name not in _HOMES:
        raise AttributeError(f"module 'gpt2onnx' has no attribute {name!r}")
    module, attribute = _HOMES[name]
    return getattr(import_module(module), attribute)
