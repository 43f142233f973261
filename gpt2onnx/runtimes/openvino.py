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

import re
from dataclasses import dataclass

import numpy as np

from gpt2onnx.artifact.folder import ModelFolder
from gpt2onnx.capabilities import Lacks, Need
from gpt2onnx.errors import BadInput, RuntimeUnavailable
from gpt2onnx.params import param
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE
from gpt2onnx.records import Record
from gpt2onnx.runtimes.decoder import file_shape
from gpt2onnx.runtimes.runtime import Capabilities, RuntimeSpec, StepRuntime, check_threads, threads_param

INSTALL = "pip install openvino (or: bash scripts/setup.sh)"
PRECISIONS = ("f32", "bf16", "f16")
_SPELLINGS = {"fp16": "f16", "fp32": "f32"}
GROUPED_ATTENTION = ("com.microsoft", "GroupQueryAttention")  # OpenVINO runs it at batch 1 only


@dataclass(frozen=True)
class OpenVinoSettings(Record):
    """The device to compile for, the precision it may compute in (INFERENCE_PRECISION_HINT: f32 unless asked),
    and its thread count (None: OpenVINO's default)."""

    device: str = param("CPU", "openvino: CPU, GPU, …")  # a device core.available_devices lists
    precision: str = param("f32", "openvino: f32, bf16 or fp16.", flag="--ov-precision")  # fp16, fp32 accepted
    threads: int | None = threads_param()

    def __post_init__(self) -> None:  # an invalid one cannot be built
        precision = _SPELLINGS.get(self.precision, self.precision)
        if precision not in PRECISIONS:
            raise BadInput(f"OpenVINO precision '{self.precision}' is unknown: choose f32, bf16 or fp16")
        object.__setattr__(self, "precision", precision)
        check_threads(self.threads)


def _openvino():
    try:
        import openvino
    except ImportError:
        raise RuntimeUnavailable(f"the openvino runtime is not installed: {INSTALL}") from None
    return openvino


def open_runtime(model: ModelFolder, settings: OpenVinoSettings) -> "OpenVinoDecoder":
    if not model.facts.kv_dtype.startswith("float"):
        # measured: fed int8 pasts, OpenVINO 2026's GroupQueryAttention agreed with PyTorch on 84 % of top tokens
        # (mean KL 2.7e-2), and its presents were not the graph's scaled steps
        raise RuntimeUnavailable(
            f"OpenVINO does not read this model's {model.facts.kv_dtype} K/V cache (--kv-cache) as onnxruntime does:"
            " use --runtime onnxruntime, or the float-cache folder"
        )
    ov = _openvino()
    core = ov.Core()
    devices = list(core.available_devices)
    if settings.device not in devices:
        raise RuntimeUnavailable(
            f"OpenVINO cannot use device '{settings.device}' here: it lists {', '.join(devices) or 'none'}"
        )
    config = {"INFERENCE_PRECISION_HINT": settings.precision}
    if settings.threads:
        config["INFERENCE_NUM_THREADS"] = settings.threads
    try:
        # from the descriptors the folder check hashed; the data files copied (OpenVINO refuses one whose link leads
        # outside the model's folder): their size on disk, in a private temporary folder, until compiled
        with model.loading(copy=model.data_files) as model_path:
            compiled = core.compile_model(core.read_model(str(model_path)), settings.device, config)
    except RuntimeError as exc:
        unconverted = re.search(r"No conversion rule found for operations: (.+)", str(exc))
        if unconverted:  # the frontend cannot read an op: its own words, not the C++ location it starts with
            ops = unconverted.group(1).strip()
            hint = ": use --runtime onnxruntime"
            version = ov.__version__.split("-")[0]
            raise RuntimeUnavailable(
                f"OpenVINO {version}'s ONNX frontend cannot read '{model.model_path}': it has no conversion rule for"
                f" {ops}{hint}"
            ) from None
        raise RuntimeUnavailable(
            f"OpenVINO cannot compile '{model.model_path}' for {settings.device}: {_reason(exc)}"
        ) from None
    return OpenVinoDecoder(
        compiled, model, device=settings.device, precision=settings.precision, version=ov.__version__
    )


# the frames of OpenVINO's error text around the reason (where it was raised, which check, which node)
_FRAME = re.compile(
    r"^(Exception from |Check '.*' failed at |FrontEnd API failed|Model wasn't fully converted|Failed operations"
    r"|While validating |Summary:|-- )"
)


def _reason(exc: Exception) -> str:
    """The line of an OpenVINO error that says what is wrong (its text opens with where it was raised:
    "Exception from src/inference/src/cpp/core.cpp:84:"), else its first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reasons = [line for line in lines if not _FRAME.match(line)]
    return (reasons or lines or [type(exc).__name__])[0]


class OpenVinoDecoder(StepRuntime):
    """The :class:`~gpt2onnx.runtimes.runtime.StepRuntime` interface on an OpenVINO compiled model (host arrays)."""

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
        self.grouped_attention = GROUPED_ATTENTION in model.facts.ops
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
        if self.grouped_attention and len(input_ids) > 1:
            # OpenVINO's GroupQueryAttention breaks at batch > 1 ("the shape of input data (2)
            # conflicts with the reshape pattern (1)"): the rows are independent, so run them one at a time.
            rows = [
                self._run(
                    input_ids[i : i + 1],
                    attention_mask[i : i + 1],
                    position_ids[i : i + 1],
                    [p[i : i + 1] for p in past],
                    last_logits_only,
                )
                for i in range(len(input_ids))
            ]
            logits = np.concatenate([r[0] for r in rows])
            return logits, [np.concatenate([r[1][j] for r in rows]) for j in range(len(self.present_names))]
        return self._run(input_ids, attention_mask, position_ids, past, last_logits_only)

    def _run(self, input_ids, attention_mask, position_ids, past, last_logits_only):
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


SPEC = RuntimeSpec(
    name="openvino",
    summary="OpenVINO: the folder's model.onnx compiled for one device, one step at a time",
    settings=OpenVinoSettings,
    open=open_runtime,
    capabilities=Capabilities(),
    requires=(
        Lacks("ops", {("", "TensorScatter"): "has no conversion rule (its ONNX frontend, 2026.4) for"}),
        # measured: fed int8 pasts, OpenVINO 2026's GroupQueryAttention agreed with PyTorch on 84 % of top tokens
        Need("kv_dtype", allowed={FLOAT_CACHE}, why="does not read a quantized K/V cache as onnxruntime does"),
    ),
)
