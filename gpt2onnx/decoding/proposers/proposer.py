"""What a proposer of speculative decoding is (transformers' ``CandidateGenerator``: ``get_candidates``,
``update_candidate_strategy``): a :class:`Proposer` proposes tokens for the model to check, and is told after each
round what it kept; a :class:`ProposerSpec` declares one (its name, its options, how it is made), listed in
:mod:`gpt2onnx.decoding.proposers.all_proposers`."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gpt2onnx.errors import BadInput

MAX_PROPOSED = 64  # proposals per round: more only lengthens the step that checks them


class Proposer(ABC):
    """Proposes tokens; ``probs``: each proposal's distribution where it samples its own (None: it has none, as
    prompt lookup), read by the acceptance rule; ``steps``: its own forward passes."""

    probs: list[np.ndarray] | None = None
    steps: int = 0

    def start(self, prompt: list[int], capacity: int) -> None:
        """A new row: its prompt, and the most tokens it will hold."""

    @abstractmethod
    def propose(self, sequence: list[int], limit: int) -> list[int]:
        """At most ``limit`` tokens to follow ``sequence`` (transformers' get_candidates); [] for none."""

    def update(self, sequence: list[int], proposed: int, accepted: int) -> None:
        """After a round: ``sequence`` with its kept tokens, how many were proposed and kept."""


@dataclass(frozen=True)
class Context:
    """What a proposer is made with: the decoding options, end-of-sequence ids, sampling and its generator, and the
    opened runtime of the folder its options name (a draft's), if any."""

    decoding: object
    eos_token_ids: tuple[int, ...]
    sampling: object
    rng: np.random.Generator | None
    runtime: object | None = None


@dataclass(frozen=True)
class ProposerSpec:
    """One proposer: its name, what it is (``says``: "prompt lookup"), its options (a frozen dataclass whose
    options are declared with gpt2onnx.params: the first one turns it on, ``transformers`` names each as
    generate() does), how it is made from them, the option that names a folder opened as its model (None: none),
    and its label in a table."""

    name: str
    says: str
    summary: str
    options: type
    make: Callable[[object, Context], Proposer]
    folder: str | None = None
    label: Callable[[object], str] = lambda options: ""
    also: tuple[str, ...] = ()  # transformers' other generate() names of how it proposes (the engine refuses them)
    # generate()'s arguments where its options are not passed one to one (a folder loaded as a model: ``load``)
    to_generate: Callable[[object, Callable], dict] | None = None

    def generate_kwargs(self, options, load: Callable) -> dict:
        """transformers' generate() arguments for the same proposals: ``to_generate``'s, else each option given
        under its transformers name. ``load(path)``: a folder's source as a transformers model."""
        if self.to_generate is not None:
            return self.to_generate(options, load)
        from gpt2onnx.params import options_of

        given = {o.key: getattr(options, o.field) for o in options_of(self.options)}
        return {key: value for key, value in given.items() if value is not None}

    @property
    def transformers_names(self) -> tuple[str, ...]:
        """Every generate() name of its options: a served request naming one asks for speculative decoding."""
        from gpt2onnx.params import options_of

        return (*(o.key for o in options_of(self.options)), *self.also)

    @property
    def switch(self):
        """The option that turns it on (its options' first)."""
        from gpt2onnx.params import options_of

        return options_of(self.options)[0]


def count(name: str, flag: str, value) -> int:
    """A count of proposals: a whole number from 1 to MAX_PROPOSED (transformers' name and the flag in the message)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PROPOSED:
        raise BadInput(f"{name} ({flag}) must be a whole number from 1 to {MAX_PROPOSED}, got {value!r}")
    return value


def fields(spec: ProposerSpec) -> set[str]:
    return {f.name for f in dataclasses.fields(spec.options)}
