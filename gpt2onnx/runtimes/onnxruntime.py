"""The onnxruntime runtime: the folder's graph in an InferenceSession on a provider (cpu, cuda, tensorrt), run
one step at a time through :class:`~gpt2onnx.runtimes.decoder.OnnxDecoder` (IO binding, presents kept where the
provider put them). Its settings are the provider's (:class:`~gpt2onnx.runtimes.providers.ProviderConfig`); the
stepper itself lives in decoder.py, where export and optimize use it too."""

from __future__ import annotations

from gpt2onnx.runtimes.decoder import OnnxDecoder, open_decoder
from gpt2onnx.runtimes.providers import ProviderConfig, provider_alternatives, provider_declared
from gpt2onnx.runtimes.runtime import RuntimeSpec

SPEC = RuntimeSpec(
    name="onnxruntime",
    summary="onnxruntime on an execution provider (cpu, cuda, tensorrt), one step at a time",
    settings=ProviderConfig,
    open=open_decoder,
    capabilities=OnnxDecoder.capabilities,
    declare_settings=lambda settings: [provider_declared(settings)],
    setting_alternatives=lambda: {"provider": provider_alternatives()},
)
