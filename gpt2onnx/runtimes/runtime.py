"""What a runtime is to gpt2onnx (gpt2onnx.runtimes.all_runtimes registers them: adding one is one new module plus
one line there).

A runtime is one module under ``gpt2onnx.runtimes`` that defines ``SPEC``, a :class:`RuntimeSpec`: its name, what it
can do (:class:`Capabilities`), its own settings (a frozen dataclass validated when it is built, whose ``FLAGS``
name the command-line options it takes) and ``open(model, settings)``, which opens an exported folder as one of
two interfaces, every method a caller uses declared on it:

- a :class:`StepRuntime`: the decoder as one forward pass at a time (prompt with an empty past, then one token per
  step with its cache); the decode loop, parity's lockstep comparison and bench drive it (onnxruntime, OpenVINO);
- a :class:`LoopRuntime`: the runtime owns the whole generation loop and its cache; it generates with the same
  :class:`~gpt2onnx.generation_options.Sampling` and :class:`~gpt2onnx.generation_options.Decoding` as the decode
  loop, refusing in one line what it cannot do as transformers does (onnxruntime-genai, onnxruntime's generation
  ops). It exposes no presents; where it can force tokens it also gives each forward pass's logits and time
  (``run_loop``), so parity compares logits, KL, top-k and tokens.

Callers dispatch on the capabilities, never by probing attributes. A runtime refuses what it cannot do with
:class:`~gpt2onnx.errors.RuntimeUnavailable` (one line, with the command that installs it); nothing falls back to
another runtime.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from gpt2onnx.artifact.folder import ModelFolder
from gpt2onnx.capabilities import Declared, Need
from gpt2onnx.errors import BadInput, RuntimeUnavailable
from gpt2onnx.generation_options import Decoding, Sampling
from gpt2onnx.params import param
from gpt2onnx.records import Record

MAX_THREADS = 256
# What each command that runs a folder needs of its runtime beyond a request's options, declared once: the command
# refuses what it cannot run (RuntimeOptions.requires) and check --command answers the same
_STEPS = "step_logits"
COMMANDS = {
    "generate": (),
    "bench": (Need(_STEPS, allowed={True}, why="times each step"),),
    "parity": (Need(_STEPS, allowed={True}, why="compares each step's logits"),),
    "eval": (Need(_STEPS, allowed={True}, why="compares each window's logits"),),
}


def command_declared(name: str) -> Declared:
    """What the command ``name`` needs of its runtime (COMMANDS), as a choice of the resolver's."""
    if name not in COMMANDS:
        raise BadInput(f"command '{name}' is unknown: choose one of {', '.join(COMMANDS)}")
    return Declared("command", name, f"--command {name}", requires=COMMANDS[name], label=f"gpt2onnx {name}")


@dataclass(frozen=True)
class Capabilities:
    """What a runtime can do, declared by the runtime; callers dispatch on it."""

    owns_loop: bool = False  # a LoopRuntime: it runs the generation loop and keeps the cache
    presents: bool = True  # the presents come back (parity compares them)
    steps: bool = True  # each forward pass's logits and time, tokens forced (parity, eval, bench)
    past_of_length: bool = False  # a step can be timed at any past length on a zero-filled cache (bench --past)
    memory_check: bool = False  # check_memory refuses, before allocating, a run this machine cannot hold
    proposals: bool = False  # runs a step of several new tokens on a past and crops its cache (speculative decoding)
    batches: bool = False  # its steppers take rows that join and leave a running batch (the batching engine)
    preallocates: bool = False  # its cache is one buffer per sequence, allocated once at a capacity (bench --capacity)
    adapters: bool = False  # binds a switchable LoRA adapter's factors to the graph's slots on its runs (--adapter)


@dataclass(frozen=True)
class RuntimeSpec:
    """One runtime, declared by its module."""

    name: str
    summary: str  # one line: what it is
    settings: type  # its settings: a frozen dataclass, validated when built, its options declared (gpt2onnx.params)
    open: Callable[[ModelFolder, Any], Runtime]  # opens a folder with its settings
    capabilities: Capabilities
    requires: tuple = ()  # what it needs of a folder and a request (gpt2onnx.capabilities: Need, Lacks)
    declare_settings: Callable[[Any], list[Declared]] | None = None  # what its settings declare (a provider)
    # what a folder's own deployment for it declares (ort-generate: whether its files are there, and the settings
    # its ops were deployed with, which a request must keep), read from the folder's files; None: nothing
    declare_folder: Callable[[Path], list[Declared]] | None = None
    # by axis, every choice its settings may take, declared (the providers): what a refusal's advice may name
    setting_alternatives: Callable[[], dict[str, list[Declared]]] | None = None

    @property
    def declared(self) -> Declared:
        """What it ensures (its capabilities) and needs (gpt2onnx.capabilities)."""
        caps = self.capabilities
        return Declared(
            "runtime",
            self.name,
            f"--runtime {self.name}",
            ensures={
                "owns_loop": caps.owns_loop,
                "step_logits": caps.steps,
                "checks_proposals": caps.proposals,
                "batches_rows": caps.batches,
                "binds_adapters": caps.adapters,
            },
            requires=self.requires,
            says={
                "owns_loop": "runs a generation loop of its own" if caps.owns_loop else "runs one step at a time",
                "checks_proposals": "runs no step of several proposals on its cache",
                "batches_rows": "keeps no batch that rows join and leave",
                "step_logits": "gives no per-step logits",
                "binds_adapters": "binds no LoRA adapter's factors to a graph's slots",
            },
        )


def check_threads(threads: int | None) -> None:
    """The rule of every runtime's thread count (None: the runtime's default, all cores)."""
    if threads is not None and (isinstance(threads, bool) or not 1 <= threads <= MAX_THREADS):
        raise BadInput(f"threads must be 1 to {MAX_THREADS} (this machine has {os.cpu_count()} cores), got {threads}")


def threads_param():
    """The one declaration of --threads, which every runtime's settings take (intra-op threads; None: the
    runtime's default, all cores)."""
    return param(None, "cpu: threads \\[default: all cores].")


@dataclass(frozen=True)
class ThreadSettings(Record):
    """The settings of a runtime whose only option is its thread count (genai, ort-generate)."""

    threads: int | None = threads_param()

    def __post_init__(self) -> None:
        check_threads(self.threads)  # an invalid one cannot be built


class Runtime(ABC):
    """What every runtime is: its labels, the model's numbers, its capabilities, and the prompt checks."""

    runtime: str  # the registry name
    provider: str  # where it runs, as a label: "cpu", "cuda", "tensorrt", "CPU" (an OpenVINO device)
    device: str = "cpu"  # "cpu" or "cuda" for device-memory readings
    device_id: int = 0
    dummy_past: int = 0  # masked past slots in front of the prompt step (TensorRT); 0 elsewhere
    exact_step_rows: int | None = None  # a step of more rows computes on other weights (int4's prompt path)
    padding_period: int | None = None  # a row's sums as alone only where its left padding is a multiple of it
    capabilities: Capabilities = Capabilities()
    placement = None  # onnxruntime: which provider got each node (an artifact.report.Placement); None elsewhere
    tf32: bool | None = None  # onnxruntime on a GPU: whether fp32 matmuls may use TF32; None elsewhere
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

    def activate_adapter(self, path: Path | None) -> None:
        """Make a switchable LoRA adapter file active on every later run (where ``capabilities.adapters``: the
        resolver refuses the others first); None: the base."""
        raise RuntimeUnavailable(f"the {self.runtime} runtime binds no LoRA adapter: use --runtime onnxruntime")

    def close(self) -> None:
        """Free what the runtime holds (a worker process, temporary files); a no-op where it holds nothing."""

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


class StepRuntime(Runtime):
    """One forward pass at a time, the cache handed back and forth by the caller."""

    @abstractmethod
    def empty_past(self, batch: int, capacity: int | None = None) -> list:
        """The prompt step's past; ``capacity`` (prompt + new tokens) for steppers that preallocate."""

    @abstractmethod
    def prompt_mask(self, attention_mask: np.ndarray) -> np.ndarray:
        """The prompt's mask as the runtime takes it (masked dummy past slots in front where it needs them)."""

    @abstractmethod
    def run(self, input_ids, attention_mask, position_ids, past, *, last_logits_only: bool = True) -> tuple:
        """One step: (logits as numpy, the last position only unless asked otherwise; the presents)."""

    @abstractmethod
    def step(self, input_ids, attention_mask, position_ids, past) -> tuple[np.ndarray, list[np.ndarray]]:
        """One step with everything on the host: (all logits, presents as numpy arrays)."""

    def reorder_past(self, past: list, rows: np.ndarray) -> list:
        """Beam search's reorder: the cache with its batch rows picked (``rows``, repeats allowed). This default
        gathers host arrays (OpenVINO); onnxruntime's steppers keep it on their device."""
        return [np.ascontiguousarray(p[np.asarray(rows, dtype=np.int64)]) for p in past]

    def crop_past(self, past: list, length: int) -> list:
        """The cache cut back to its first ``length`` columns (speculative decoding drops the proposals the model
        did not keep). This default slices host arrays; onnxruntime's steppers override it."""
        return [p if p.shape[2] == length else np.ascontiguousarray(p[:, :, :length]) for p in past]

    def past_of_length(self, batch: int, length: int, *, capacity: int | None = None) -> list:
        """A zero-filled past of ``length`` tokens, for timing a step there (where ``capabilities.past_of_length``)."""
        raise BadInput(f"the {self.runtime} runtime cannot time a step at a given past (--past): drop --past")


@dataclass
class LoopResult:
    """One run of a runtime-owned loop on a single prompt, tokens forced or generated."""

    tokens: list[int]  # new tokens (forced ones included when forcing)
    step_seconds: list[float]  # [0] is the prompt step
    logits: list[np.ndarray] = field(default_factory=list)  # per forward pass: [positions, vocab]
    peak_bytes: int | None = None  # peak resident memory of the process that ran it (a worker's own)
    sequences: list[list[int]] = field(default_factory=list)  # beam search: new tokens per returned beam, best first


@dataclass
class Continuations:
    """What a runtime-owned loop gave a batch: per prompt, the new tokens of its sequences (best first), each step's
    seconds summed over the prompts, and the sequences' scores where the runtime gives transformers' ones."""

    sequences: list[list[list[int]]]
    step_seconds: list[float]
    scores: np.ndarray | None = None


class LoopRuntime(Runtime):
    """A runtime that owns the generation loop and its cache (no presents are exposed)."""

    capabilities = Capabilities(owns_loop=True, presents=False)

    @abstractmethod
    def continue_prompts(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        sampling: Sampling,
        decoding: Decoding,
        eos_token_ids: tuple[int, ...],
    ) -> Continuations:
        """Continue the prompts (their real tokens, checked by the caller) as transformers' generate() would,
        refusing in one line (BadInput) a setting the runtime cannot apply as transformers does."""

    def run_loop(
        self, prompt: list[int], *, max_new_tokens: int, forced: list[int] | None = None, return_logits: bool = False
    ) -> LoopResult:
        """One prompt, greedily or with ``forced`` tokens, with each forward pass's logits and time (where
        ``capabilities.steps``)."""
        raise RuntimeUnavailable(f"the {self.runtime} runtime gives no per-step logits or times: use onnxruntime")
