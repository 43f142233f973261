"""The onnxruntime runtime: the folder's graph in an InferenceSession on a provider (cpu, cuda, tensorrt), run
one step at a time through :class:`~gpt2onnx.runtimes.decoder.OnnxDecoder` (IO binding, presents kept where the
provider put them). The stepper itself lives in decoder.py, where export and optimize use it too."""

from __future__ import annotations

from gpt2onnx.runtimes.decoder import OnnxDecoder, open_decoder


def open_runtime(model, options) -> OnnxDecoder:
    return open_decoder(model, options.provider)
