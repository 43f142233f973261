"""A draft folder (transformers' ``assistant_model``; AssistedCandidateGenerator): a smaller export with the same
vocabulary proposes k tokens (greedy, or sampled), one step each on its own cache; k fixed
(``num_assistant_tokens_schedule="constant"``) or adaptive (``"heuristic"``: from transformers' default 20, +2
after a round where every proposal was kept, -1 otherwise, at least 1). transformers' draft also stops early below
a confidence it tunes with scikit-learn (``assistant_confidence_threshold``); this one does not."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from gpt2onnx.decoding import processors as logits
from gpt2onnx.decoding.processors import process_scores
from gpt2onnx.decoding.proposers.proposer import MAX_PROPOSED, Proposer, ProposerSpec, count
from gpt2onnx.errors import BadInput
from gpt2onnx.generation_options import Decoding, Sampling
from gpt2onnx.params import param
from gpt2onnx.runtimes.runtime import StepRuntime

log = logging.getLogger(__name__)
ADAPTIVE = "adaptive"
ASSISTANT_TOKENS = 20  # transformers' num_assistant_tokens: where the adaptive schedule starts


@dataclass(frozen=True)
class DraftOptions:
    """The draft folder, and its tokens per round: a number, or "adaptive" (checked when built)."""

    draft: Path | None = param(
        None, "A draft folder proposes tokens.", metavar="DIR", name="assistant_model", show_default=False
    )
    draft_tokens: int | str | None = param(
        None,
        "Draft: N or adaptive \\[adaptive].",
        metavar="N",
        name="num_assistant_tokens",
        cli=(Optional[str], None),
        show_default=False,
    )

    def __post_init__(self) -> None:
        if not str(self.draft).strip():
            raise BadInput("the draft folder (--draft) is empty: give an exported folder")
        tokens = ADAPTIVE if self.draft_tokens is None else self.draft_tokens
        if isinstance(tokens, str):
            text = tokens.strip().lower()
            whole = text.isascii() and text.isdigit()  # "²" is a digit to str.isdigit, and no number to int()
            if text != ADAPTIVE and not whole:
                raise BadInput(
                    f"--draft-tokens must be a number from 1 to {MAX_PROPOSED} or 'adaptive', got {tokens!r}"
                )
            tokens = ADAPTIVE if text == ADAPTIVE else int(text)
        if tokens != ADAPTIVE:
            count("num_assistant_tokens", "--draft-tokens", tokens)
        object.__setattr__(self, "draft_tokens", tokens)
        object.__setattr__(self, "draft", Path(self.draft))


class Draft(Proposer):
    """A draft model on its own stepper: k tokens a round, greedy or sampled from its own processed distribution
    (kept in ``probs`` for the acceptance rule), its cache cut back to what the target kept."""

    def __init__(
        self,
        decoder: StepRuntime,
        tokens: int | str,
        decoding: Decoding,
        eos_token_ids: tuple[int, ...],
        sampling: Sampling = Sampling(),
        rng: np.random.Generator | None = None,
    ):
        self.decoder, self.decoding, self.eos_token_ids = decoder, decoding, eos_token_ids
        self.sampling, self.rng = sampling, rng
        self.adaptive = tokens == ADAPTIVE
        self.k = ASSISTANT_TOKENS if self.adaptive else int(tokens)
        self.steps = 0
        self.probs: list[np.ndarray] | None = None  # sampling: each proposal's distribution (float64)

    def start(self, prompt: list[int], capacity: int) -> None:
        self.prompt_length = len(prompt)
        self.seen: list[int] = []  # the tokens in the draft's cache, in order
        self.context = self.decoder.n_positions or capacity  # a draft with a shorter context proposes within it
        self.full = False
        self.past = self.decoder.empty_past(1, capacity=min(capacity, self.context))

    def propose(self, sequence: list[int], limit: int) -> list[int]:
        # the i-th proposal runs the sequence and i - 1 proposals: all within the draft's context
        room = self.context - len(sequence) + 1
        if room < 1 and not self.full:
            log.info("the draft's context of %d tokens is full: the model decodes alone from here", self.context)
            self.full = True
        k = min(int(self.k), limit, room)
        if k < 1:
            return []
        new = sequence[len(self.seen) :]  # what the draft has not seen: at least the last token
        proposed: list[int] = []
        self.probs = [] if self.sampling.sample else None
        while True:
            width = len(self.seen) + len(new)
            mask = self.decoder.prompt_mask(np.ones((1, width), np.int64))
            positions = np.arange(len(self.seen), width, dtype=np.int64)[None]
            out, self.past = self.decoder.run(np.array([new], np.int64), mask, positions, self.past)
            self.steps += 1
            self.seen += new
            scores = out[:, -1].astype(np.float32)
            if self.sampling.sample or self.decoding.processors_on():
                scores = process_scores(
                    scores,
                    np.array([sequence + proposed]),
                    prompt_length=self.prompt_length,
                    decoding=self.decoding,
                    sampling=self.sampling,
                    eos_token_ids=self.eos_token_ids,
                )
            if self.sampling.sample:
                probs = logits.softmax(scores[0].astype(np.float64))
                token = int(self.rng.choice(len(probs), p=probs / probs.sum()))
                self.probs.append(probs)
            else:
                token = int(scores[0].argmax())
            proposed.append(token)
            if len(proposed) == k or token in self.eos_token_ids:
                return proposed
            new = [token]

    def update(self, sequence: list[int], proposed: int, accepted: int) -> None:
        """The draft's cache keeps the longest prefix it shares with ``sequence``, as transformers crops it."""
        keep = 0
        for mine, theirs in zip(self.seen, sequence):
            if mine != theirs:
                break
            keep += 1
        keep = min(keep, len(sequence) - 1)  # the last token is always run again: its logits propose the next
        if keep < len(self.seen):
            self.past = self.decoder.crop_past(self.past, self.decoder.dummy_past + keep)
            self.seen = self.seen[:keep]
        if self.adaptive and proposed:
            self.k = self.k + 2 if accepted == proposed else max(1, self.k - 1)


def _generate_kwargs(options: DraftOptions, load) -> dict:
    """transformers' assisted generation with the draft's source: a number of tokens per round is read from the
    assistant's generation config, at a constant schedule; "adaptive" is transformers' own heuristic one."""
    assistant = load(options.draft)
    if options.draft_tokens != ADAPTIVE:
        config = assistant.generation_config
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = options.draft_tokens, "constant"
    return {"assistant_model": assistant}


PROPOSER = ProposerSpec(
    name="draft",
    says="a draft folder",
    summary="a smaller export with the same vocabulary proposes k tokens on its own cache",
    options=DraftOptions,
    make=lambda options, context: Draft(
        context.runtime, options.draft_tokens, context.decoding, context.eos_token_ids, context.sampling, context.rng
    ),
    folder="draft",
    also=("num_assistant_tokens_schedule",),
    to_generate=_generate_kwargs,
    label=lambda options: f"draft {Path(options.draft).name or options.draft} {options.draft_tokens}",
)
