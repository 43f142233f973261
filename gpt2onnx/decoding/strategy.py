"""What a decoding strategy declares: one :class:`Strategy` per module of this package, listed in
:mod:`gpt2onnx.decoding.all_strategies`, the first whose ``applies`` is true for a request running it. A strategy
turns a runtime's steps (or its own loop) into a :class:`~gpt2onnx.decoding.results.Generation`, and declares what
it needs of the runtime and the folder (gpt2onnx.capabilities), so that a combination it cannot serve is refused
before anything runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpt2onnx.capabilities import Declared
from gpt2onnx.generation_options import Decoding, Sampling


@dataclass(frozen=True)
class Request:
    """What a strategy runs: the left-padded batch (checked), the options, the stop conditions, where each step's
    ids go (``on_step``), and speculative decoding's proposer and draft runtime where asked for."""

    input_ids: np.ndarray
    mask: np.ndarray
    max_new_tokens: int
    sampling: Sampling
    decoding: Decoding
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    stop: Callable[[list[int]], bool] | None = None
    on_step: Callable[[int, np.ndarray], None] | None = None
    speculation: Any = None  # gpt2onnx.decoding.speculative.Speculation
    draft: Any = None  # the draft's opened runtime (a StepRuntime)
    constraint: Any = None  # gpt2onnx.decoding.constraints.TokenConstraint: what the rows may write

    def stopping(self) -> dict:
        """What every loop takes besides its batch: how many tokens, the options, the ids and the stop strings."""
        return dict(
            max_new_tokens=self.max_new_tokens,
            decoding=self.decoding,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            stop=self.stop,
            constraint=self.constraint,
        )


@dataclass(frozen=True)
class Strategy:
    """One decoding strategy: its name, one line for the docs, when it applies (the runtime and the request), how
    it runs, and what it needs (Need, Lacks)."""

    name: str
    summary: str
    applies: Callable[[Any, Request], bool]  # (the runtime, the request)
    run: Callable[[Any, Request], Any]  # (the runtime, the request) → Generation
    requires: tuple = ()

    @property
    def declared(self) -> Declared:
        return Declared("strategy", self.name, requires=self.requires, label=f"{self.name} decoding")
