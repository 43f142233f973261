"""What a runtime is to gpt2onnx, and the registry of runtimes: adding one is one new module plus one line here.

A runtime is opened on an exported folder with :class:`RuntimeOptions` and gives one of two things:

- a :class:`Stepper`: the decoder as one forward pass at a time (prompt with an empty past, then one token per
  step with its cache). generate, parity's lockstep comparison and bench drive it; onnxruntime and OpenVINO
  are steppers.
- a :class:`LoopRunner`: the runtime owns the whole generation loop and its cache (onnxruntime-genai). It
  takes a prompt, optionally tokens to force, and returns the new tokens, the logits it exposes and the time
  of each step. It exposes no presents, so parity compares logits, KL, top-k and tokens only.

Every runtime is a :class:`Runtime`: it declares what it can do in :class:`Capabilities` (owns its loop,
times a step at a given past, shares one cache buffer, checks memory first), and callers dispatch on that;
nothing probes a runtime for attributes. Every runtime refuses what it cannot do with
:class:`~gpt2onnx.errors.RuntimeUnavailable` (one line, with the command that installs it); nothing falls back
to another runtime.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from gpt2onnx.errors import BadInput
from gpt2onnx.runtimes.providers import ProviderConfig

# name → module under gpt2onnx.runtimes with an ``open_runtime(model, options)`` function.
RUNTIMES = {"onnxruntime": "onnxruntime", "openvino": "openvino", "genai": "genai"}
OV_PRECISIONS = ("f32", "bf16", "f16")


@dataclass(frozen=True)
class Capabilities:
    """What a runtime can do, declared by the runtime; callers dispatch on it."""

    owns_loop: bool = False  # a LoopRunner (run_loop): the runtime runs the generation loop and keeps the cache
    presents: bool = True  # the presents come back (parity compares them)
    past_of_length: bool = False  # a step can be timed at any past length on a zero-filled cache (bench --past)
    shared_cache: bool = False  # past and present are one preallocated buffer (GroupQueryAttention)
    memory_check: bool = False  # check_memory refuses, before allocating, a run this machine cannot hold


@dataclass(frozen=True)
class RuntimeOptions:
    """The runtime and its options. ``provider`` is onnxruntime's; ``device`` and ``ov_precision`` OpenVINO's."""

    name: str = "onnxruntime"
    provider: ProviderConfig = field(default_factory=ProviderConfig)
    device: str = "CPU"  # openvino: a device core.available_devices lists
    ov_precision: str = "f32"  # openvino: INFERENCE_PRECISION_HINT (f32 unless asked)

    def __post_init__(self) -> None:
        self.check()  # an invalid one cannot be built

    def check(self) -> "RuntimeOptions":
        if self.name not in RUNTIMES:
            raise BadInput(f"runtime '{self.name}' is unknown: choose one of {', '.join(RUNTIMES)}")
        precision = {"fp16": "f16", "fp32": "f32"}.get(self.ov_precision, self.ov_precision)
        if precision not in OV_PRECISIONS:
            raise BadInput(f"OpenVINO precision '{self.ov_precision}' is unknown: choose f32, bf16 or fp16")
        object.__setattr__(self, "ov_precision", precision)
        if self.name != "openvino" and (self.device != "CPU" or self.ov_precision != "f32"):
            raise BadInput(f"--device and --ov-precision apply to the openvino runtime, not '{self.name}': drop them")
        if self.name != "onnxruntime" and self.provider.name != "cpu":
            raise BadInput(f"--provider applies to the onnxruntime runtime, not '{self.name}': drop it")
        self.provider.check()
        return self

    def as_dict(self) -> dict:
        data = asdict(self)
        if self.name != "openvino":
            data.pop("device"), data.pop("ov_precision")
        return data


@runtime_checkable
class Stepper(Protocol):
    """One forward pass at a time, the cache handed back and forth by the caller (:class:`OnnxDecoder`'s shape)."""

    runtime: str  # the registry name
    provider: str  # where it runs, as a label: "cpu", "cuda", "tensorrt", "CPU" (an OpenVINO device)
    device: str  # "cpu" or "cuda" for device-memory readings
    device_id: int
    dummy_past: int  # masked past slots in front of the prompt step (TensorRT); 0 elsewhere
    vocab_size: int | None
    n_layer: int
    n_positions: int | None

    def check_ids(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> None: ...
    def check_length(self, total_length: int) -> None: ...
    def empty_past(
        self, batch: int, capacity: int | None = None
    ) -> list: ...  # capacity: prompt + new tokens (preallocating steppers)
    def prompt_mask(self, attention_mask: np.ndarray) -> np.ndarray: ...
    def run(
        self, input_ids, attention_mask, position_ids, past, *, last_logits_only: bool = True
    ) -> tuple[np.ndarray, list]: ...
    def step(self, input_ids, attention_mask, position_ids, past) -> tuple[np.ndarray, list[np.ndarray]]: ...


@dataclass
class LoopResult:
    """One run of a runtime-owned loop on a single prompt."""

    tokens: list[int]  # new tokens (forced ones included when forcing)
    step_seconds: list[float]  # [0] is the prompt step
    logits: list[np.ndarray] = field(default_factory=list)  # per forward pass: [positions, vocab]
    peak_bytes: int | None = None  # peak resident memory of the process that ran it (a worker's own)
    sequences: list[list[int]] = field(default_factory=list)  # beam search: new tokens per returned beam, best first


@runtime_checkable
class LoopRunner(Protocol):
    """A runtime that owns the generation loop and its cache (no presents are exposed)."""

    runtime: str
    provider: str
    device: str
    device_id: int
    vocab_size: int | None
    n_layer: int
    n_positions: int | None

    def run_loop(
        self,
        prompt: list[int],
        *,
        max_new_tokens: int,
        forced: list[int] | None = None,
        return_logits: bool = False,
        search: dict[str, Any] | None = None,
    ) -> LoopResult: ...
    def close(self) -> None: ...


def open_runtime(model, options: RuntimeOptions) -> Runtime:
    """Open ``model`` (an opened :class:`~gpt2onnx.artifact.folder.ModelFolder`) on the runtime ``options`` names."""
    options = options.check()
    module = importlib.import_module(f"gpt2onnx.runtimes.{RUNTIMES[options.name]}")
    return module.open_runtime(model, options)


def parse_runtimes(value: str) -> list[str]:
    """'onnxruntime,openvino' → ['onnxruntime', 'openvino']; each known, none twice."""
    names = [v.strip() for v in value.split(",")]
    for name in names:
        if name not in RUNTIMES:
            raise BadInput(
                f"runtime '{name}' is unknown: choose from {', '.join(RUNTIMES)} (comma-separated for bench)"
            )
    if len(set(names)) != len(names):
        raise BadInput(f"runtimes '{value}' name one twice: give each once")
    return names


class Runtime:
    """What every runtime is: its labels, the model's numbers, its capabilities, and the prompt checks.

    Subclasses set the class attributes that apply and implement the Stepper (run, step, empty_past,
    prompt_mask) or LoopRunner (run_loop) methods their capabilities promise."""

    runtime: str  # the registry name
    provider: str  # where it runs, as a label: "cpu", "cuda", "tensorrt", "CPU" (an OpenVINO device)
    device: str = "cpu"  # "cpu" or "cuda" for device-memory readings
    device_id: int = 0
    dummy_past: int = 0  # masked past slots in front of the prompt step (TensorRT); 0 elsewhere
    capabilities: Capabilities = Capabilities()
    placement = None  # onnxruntime: which provider got each node (an artifact.report.Placement); None elsewhere
    version: str | None = None  # the runtime library's version
    mode: str = "in-process"  # or "worker (<python>)" where the runtime runs in another process
    vocab_size: int | None
    n_layer: int
    n_positions: int | None

    def session_providers(self) -> list[str]:
        """The providers the session really runs on, in order (onnxruntime's own names where it has them)."""
        return [self.provider]

    def check_memory(
        self, batch: int, prompt_len: int, total_len: int, *, what: str = "batch", extra_bytes: int = 0
    ) -> None:
        """Refuse a run this machine cannot hold (where ``capabilities.memory_check``); others check nothing.
        ``extra_bytes``: what the caller's loop allocates beside the runtime (beam search's arrays)."""

    def close(self) -> None:
        """Free what the runtime holds (a worker process, temporary files); a no-op where it holds nothing."""

    def reorder_past(self, past: list, rows: np.ndarray) -> list:
        """Beam search's reorder: the cache with its batch rows picked (``rows``, repeats allowed). This default
        gathers host arrays (OpenVINO); onnxruntime's steppers keep it on their device."""
        return [np.ascontiguousarray(p[np.asarray(rows, dtype=np.int64)]) for p in past]

    def check_ids(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> None:
        """Token ids outside the vocabulary would make CUDA's Gather read garbage without an error."""
        ids = input_ids if attention_mask is None else input_ids[attention_mask[:, -input_ids.shape[1] :] > 0]
        if self.vocab_size is not None and ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
            raise BadInput(f"token id {bad} is outside the vocabulary (0 to {self.vocab_size - 1})")

    def check_length(self, total_length: int) -> None:
        if self.n_positions and total_length > self.n_positions:
            raise BadInput(
                f"prompt plus new tokens is {total_length} tokens, beyond the model's context of {self.n_positions}:"
                " shorten the prompt or ask for fewer new tokens"
            )
