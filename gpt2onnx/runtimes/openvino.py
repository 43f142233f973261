"""The OpenVINO runtime: the folder's model.onnx compiled for one device (CPU, GPU, …), run one step at a time.

- Precision: f32 unless asked (``INFERENCE_PRECISION_HINT``). OpenVINO's own default on a CPU with bf16
  units is bf16, which moves fp32 logits by ~4e-3 and would fail the fp32 gates.
- Outputs are looked up by name (``logits``, ``present.i.key``): OpenVINO's ``get_any_name()`` of the logits
  is an internal tensor name (``/MatMul_output_0``).
- One infer request, created once and reused for every step.
- int4 (MatMulNBits with accuracy_level 4): onnxruntime quantizes activations to int8 there and OpenVINO does
  not by the same rule, so the two differ by ~4e-3 on logits; the int4 gates (KL, top-5 against PyTorch)
  are the ones that apply.
"""

from __future__ import annotations

import numpy as np

from gpt2onnx.artifact.folder import ModelFolder
from gpt2onnx.errors import RuntimeUnavailable
from gpt2onnx.runtimes.base import Runtime
from gpt2onnx.runtimes.decoder import file_shape

INSTALL = "pip install openvino (or: bash scripts/setup.sh)"


def _openvino():
    try:
        import openvino
    except ImportError:
        raise RuntimeUnavailable(f"the openvino runtime is not installed: {INSTALL}") from None
    return openvino


def open_runtime(model: ModelFolder, options) -> "OpenVinoDecoder":
    ov = _openvino()
    core = ov.Core()
    devices = list(core.available_devices)
    if options.device not in devices:
        raise RuntimeUnavailable(
            f"OpenVINO cannot use device '{options.device}' here: it lists {', '.join(devices) or 'none'}"
        )
    config = {"INFERENCE_PRECISION_HINT": options.ov_precision}
    if options.provider.threads:
        config["INFERENCE_NUM_THREADS"] = options.provider.threads
    try:
        compiled = core.compile_model(core.read_model(str(model.model_path)), options.device, config)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RuntimeUnavailable(
            f"OpenVINO cannot compile '{model.model_path}' for {options.device}: {first}"
        ) from None
    return OpenVinoDecoder(
        compiled, model, device=options.device, precision=options.ov_precision, version=ov.__version__
    )


class OpenVinoDecoder(Runtime):
    """The :class:`~gpt2onnx.runtimes.base.Stepper` interface on an OpenVINO compiled model (host arrays in and out)."""

    runtime = "openvino"

    def __init__(self, compiled, model: ModelFolder, *, device: str, precision: str, version: str):
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        self.shape = file_shape(model.model_path, model.n_positions)
        self.past_names = list(self.shape.past_names)
        self.present_names = list(self.shape.present_names)
        self.n_layer, self.n_head, self.head_dim = self.shape.n_layer, self.shape.n_head, self.shape.head_dim
        self.n_positions = model.n_positions
        self.vocab_size = self.shape.vocab_size
        self.kv_dtype = np.float16 if self.shape.kv_dtype == "float16" else np.float32
        self.uses_position_ids = self.shape.uses_position_ids
        self.provider = device
        self.device, self.device_id = "cpu" if device == "CPU" else device.lower(), 0
        self.dummy_past = 0
        self.precision, self.version = precision, version
        names = {n for output in compiled.outputs for n in output.get_names()}
        missing = [n for n in ["logits", *self.present_names] if n not in names]
        if missing:
            raise RuntimeUnavailable(f"OpenVINO's compiled model has no output named {missing[0]}")

    def empty_past(self, batch: int, capacity: int | None = None) -> list[np.ndarray]:
        return [np.zeros((batch, self.n_head, 0, self.head_dim), self.kv_dtype) for _ in self.past_names]

    def prompt_mask(self, attention_mask: np.ndarray) -> np.ndarray:
        return attention_mask.astype(np.int64)

    def run(self, input_ids, attention_mask, position_ids, past, *, last_logits_only: bool = True):
        """One step; returns (logits: last position only unless asked otherwise, presents as numpy arrays)."""
        feed = {
            "input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
            "attention_mask": np.ascontiguousarray(attention_mask, dtype=np.int64),
        }
        if self.uses_position_ids:
            feed["position_ids"] = np.ascontiguousarray(position_ids, dtype=np.int64)
        feed.update({name: np.ascontiguousarray(value) for name, value in zip(self.past_names, past)})
        self.request.infer(feed)
        logits = self.request.get_tensor("logits").data
        logits = (logits[:, -1:] if last_logits_only else logits).copy()
        # copies: the request's output buffers are overwritten by the next step
        return logits, [self.request.get_tensor(name).data.copy() for name in self.present_names]

    def step(self, input_ids, attention_mask, position_ids, past):
        return self.run(input_ids, attention_mask, position_ids, past, last_logits_only=False)
