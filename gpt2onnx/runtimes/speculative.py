"""Speculative decoding: tokens proposed cheaply, checked by the target model in one step, kept where it agrees.

Two proposers, as transformers' ``generate()`` has them (4.57, ``generation/candidate_generator.py``):

- **prompt lookup** (``prompt_lookup_num_tokens``, ``max_matching_ngram_size``; PromptLookupCandidateGenerator): the
  sequence's last n-gram (the longest first, ``max_ngram`` down to 1) is looked for earlier in the sequence, left
  to right; the first match with tokens after it proposes up to ``num_tokens`` of them, cut before an
  end-of-sequence id. No match: a plain step.
- **a draft folder** (``assistant_model``; AssistedCandidateGenerator): a smaller export with the same vocabulary
  proposes k tokens (greedy, or sampled), one step each on its own cache; k fixed
  (``num_assistant_tokens_schedule="constant"``) or adaptive (``"heuristic"``: from transformers' default 20, +2
  after a round where every proposal was kept, -1 otherwise, at least 1). transformers' draft also stops early
  below a confidence it tunes with scikit-learn (``assistant_confidence_threshold``); this one does not.

A round: the target runs the sequence's last token and the k proposals in one step on its past (k + 1 positions),
the logits processors are applied to each position as plain decoding would have them (the sequence with the
proposals before it), and the proposals are kept up to the first the target does not keep; the token chosen there
(or after the last proposal, where all were kept) is the round's own. The target's cache is cut back to the kept
tokens: a concatenating cache (present = past + new) is sliced, a shared buffer (ort-shared-kv) keeps its columns
and the mask shrinks (the next step writes over the columns it drops).

- Greedy: a proposal is kept where it is the target's argmax, so every token is plain greedy's, token for token;
  only where two logits are within float rounding of each other can the (k + 1)-token step, whose matmuls have
  other shapes, pick the other.
- Sampling, as transformers' ``_assisted_decoding`` does it: with prompt lookup each position is drawn from the
  target's processed distribution and a proposal is kept where the draw equals it (one draw per token, in order:
  a seed gives plain sampling's tokens for a single row); with a draft, transformers' ``_speculative_sampling``
  (the draft samples from its own processed distribution q; a proposal x is kept with probability
  min(1, p(x) / q(x)), else the token is drawn from max(p - q, 0)): the same distribution as plain sampling, not
  the same draws. Draws come from numpy's seeded generator, never torch's.

Rows of a batch run one after another, each at batch 1 (``num_return_sequences`` rows per prompt when sampling).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from gpt2onnx.capabilities import Declared, Lacks, Need, resolve
from gpt2onnx.errors import BadInput
from gpt2onnx.runtimes import logits
from gpt2onnx.runtimes.base import StepRuntime, runtime_spec
from gpt2onnx.runtimes.decoding import BEAMS, Decoding, Generation, Sampling, process_scores, request_declared

ADAPTIVE = "adaptive"
ASSISTANT_TOKENS = 20  # transformers' num_assistant_tokens: where the adaptive schedule starts
PROMPT_LOOKUP_NGRAM = 2  # transformers' max_matching_ngram_size default
MAX_PROPOSED = 64  # proposals per round: more only lengthens the step that checks them


def _count(name: str, flag: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PROPOSED:
        raise BadInput(f"{name} ({flag}) must be a whole number from 1 to {MAX_PROPOSED}, got {value!r}")
    return value


@dataclass(frozen=True)
class Speculation:
    """How tokens are proposed: prompt lookup (``prompt_lookup`` tokens per round from n-grams of the sequence, up
    to ``max_ngram`` long) or a draft folder (``draft``, ``draft_tokens`` per round: a number, or "adaptive").
    Checked when built: exactly one proposer, and only its own options."""

    prompt_lookup: int | None = None
    max_ngram: int | None = None  # default PROMPT_LOOKUP_NGRAM
    draft: str | Path | None = None
    draft_tokens: int | str | None = None  # default "adaptive"

    def __post_init__(self) -> None:  # an invalid one cannot be built
        if self.prompt_lookup is not None and self.draft is not None:
            raise BadInput("speculative decoding takes one proposer: --prompt-lookup N or --draft FOLDER, not both")
        if self.max_ngram is not None and self.prompt_lookup is None:
            raise BadInput("--max-ngram applies to prompt lookup: give --prompt-lookup N, or drop it")
        if self.draft_tokens is not None and self.draft is None:
            raise BadInput("--draft-tokens applies to a draft folder: give --draft FOLDER, or drop it")
        if self.prompt_lookup is None and self.draft is None:
            raise BadInput("speculative decoding takes one proposer: --prompt-lookup N or --draft FOLDER")
        if self.prompt_lookup is not None:
            _count("prompt_lookup_num_tokens", "--prompt-lookup", self.prompt_lookup)
            ngram = PROMPT_LOOKUP_NGRAM if self.max_ngram is None else self.max_ngram
            object.__setattr__(self, "max_ngram", _count("max_matching_ngram_size", "--max-ngram", ngram))
            return
        if not str(self.draft).strip():
            raise BadInput("the draft folder (--draft) is empty: give an exported folder")
        tokens = ADAPTIVE if self.draft_tokens is None else self.draft_tokens
        if isinstance(tokens, str):
            text = tokens.strip().lower()
            if text != ADAPTIVE and not text.isdigit():
                raise BadInput(
                    f"--draft-tokens must be a number from 1 to {MAX_PROPOSED} or 'adaptive', got {tokens!r}"
                )
            tokens = ADAPTIVE if text == ADAPTIVE else int(text)
        if tokens != ADAPTIVE:
            _count("num_assistant_tokens", "--draft-tokens", tokens)
        object.__setattr__(self, "draft_tokens", tokens)
        object.__setattr__(self, "draft", Path(self.draft))

    @property
    def kind(self) -> str:
        return "prompt-lookup" if self.prompt_lookup is not None else "draft"

    @property
    def label(self) -> str:
        """Short, for a table row: "prompt-lookup 10", "draft NAME 4", "draft NAME adaptive"."""
        if self.kind == "prompt-lookup":
            return f"prompt-lookup {self.prompt_lookup}"
        return f"draft {Path(self.draft).name or self.draft} {self.draft_tokens}"

    @property
    def declared(self) -> Declared:
        """What speculative decoding needs: a stepper that runs a step of several new tokens on its cache and crops
        it, every position's logits, no beam search (gpt2onnx.capabilities)."""
        flag = f"--prompt-lookup {self.prompt_lookup}" if self.kind == "prompt-lookup" else "--draft"
        return Declared(
            "strategy",
            f"speculative ({self.kind})",
            flag,
            requires=(
                Need("checks_proposals", allowed={True}, why="checks proposals in one step of several tokens"),
                Need(
                    "logits",
                    allowed={"all"},
                    why="checks each proposal against its position's logits",
                    fix="export it with --logits all",
                ),
                Lacks("features", {BEAMS: "does not take"}, fix="drop --num-beams"),
            ),
            label=f"speculative decoding ({flag})",
        )

    def as_dict(self) -> dict:
        if self.kind == "prompt-lookup":
            return {"kind": self.kind, "prompt_lookup_num_tokens": self.prompt_lookup, "max_ngram": self.max_ngram}
        return {"kind": self.kind, "draft": str(self.draft), "draft_tokens": self.draft_tokens}


def speculation_from(
    prompt_lookup: int | None, max_ngram: int | None, draft: str | Path | None, draft_tokens: str | None
) -> Speculation | None:
    """The options as given: None where no proposer and none of its options is given (plain decoding)."""
    if all(v is None for v in (prompt_lookup, max_ngram, draft, draft_tokens)):
        return None
    return Speculation(prompt_lookup=prompt_lookup, max_ngram=max_ngram, draft=draft, draft_tokens=draft_tokens)


@dataclass(frozen=True)
class Acceptance:
    """How the proposals fared: over every round of every row."""

    kind: str  # "prompt-lookup" or "draft"
    rounds: int  # target steps after the prompt's
    proposed: int  # tokens proposed
    accepted: int  # proposals the target kept
    tokens: int  # new tokens made by those rounds and the prompt step
    draft_steps: int = 0  # the draft's own steps

    @property
    def rate(self) -> float | None:
        """Kept proposals / proposals (None: nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def tokens_per_step(self) -> float:
        """New tokens per target step, the prompt step included (plain decoding: 1)."""
        return self.tokens / (self.rounds + 1)

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "rounds": self.rounds,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.rate,
            "tokens": self.tokens,
            "tokens_per_target_step": self.tokens_per_step,
            "draft_steps": self.draft_steps,
        }

    def summary(self) -> str:
        rate = "nothing proposed" if self.rate is None else f"{100 * self.rate:.1f}% of {self.proposed} proposed"
        return (
            f"{self.kind}: accepted {rate}, {self.tokens_per_step:.2f} tokens per target step"
            f" ({self.tokens} tokens in {self.rounds + 1} steps"
            + (f", {self.draft_steps} draft steps)" if self.kind == "draft" else ")")
        )


# -- proposers ---------------------------------------------------------------------------------------------------
def lookup(sequence: list[int], num_tokens: int, max_ngram: int, eos_token_ids: tuple[int, ...] = ()) -> list[int]:
    """transformers' PromptLookupCandidateGenerator.get_candidates on one row: the sequence's last n-gram (longest
    first) found earlier in it, left to right; the first match followed by any token proposes up to ``num_tokens``
    of what followed, cut before an end-of-sequence id. [] where nothing matches."""
    length = len(sequence)
    for size in range(min(max_ngram, length - 1), 0, -1):
        tail = sequence[-size:]
        for start in range(length - size + 1):
            if sequence[start : start + size] != tail:
                continue
            begin = start + size
            end = min(begin + num_tokens, length)
            if begin < end:
                chosen = sequence[begin:end]
                for i, token in enumerate(chosen):
                    if token in eos_token_ids:
                        return chosen[:i]
                return chosen
    return []


class PromptLookup:
    """Proposals copied from the sequence itself; no distribution of its own (``probs`` stays None)."""

    probs = None

    def __init__(self, num_tokens: int, max_ngram: int, eos_token_ids: tuple[int, ...]):
        self.num_tokens, self.max_ngram, self.eos_token_ids = num_tokens, max_ngram, eos_token_ids
        self.steps = 0

    def start(self, prompt: list[int], capacity: int) -> None:
        """A new row."""

    def propose(self, sequence: list[int], limit: int) -> list[int]:
        return lookup(sequence, min(self.num_tokens, limit), self.max_ngram, self.eos_token_ids)[:limit]

    def update(self, sequence: list[int], proposed: int, accepted: int) -> None:
        """After a round: ``sequence`` with its kept tokens."""


class Draft:
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
        self.past = self.decoder.empty_past(1, capacity=capacity)

    def propose(self, sequence: list[int], limit: int) -> list[int]:
        k = min(int(self.k), limit)
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


# -- the loop ------------------------------------------------------------------------------------------------------
def speculative_decode(
    decoder: StepRuntime,
    input_ids: np.ndarray,
    mask: np.ndarray,
    *,
    speculation: Speculation,
    draft: StepRuntime | None,
    max_new_tokens: int,
    sampling: Sampling,
    decoding: Decoding,
    eos_token_ids: tuple[int, ...],
    pad_token_id: int | None,
    stop: Callable[[list[int]], bool] | None,
    on_step: Callable[[int, np.ndarray], None] | None,
) -> Generation:
    """Greedy or sampled decoding of a (left-padded, checked) batch with proposals checked in one target step, a
    row at a time (``num_return_sequences`` rows per prompt when sampling). ``draft``: the opened draft folder
    (with ``speculation.draft``). Greedy: the plain loop's tokens. Sampling: the plain loop's distribution; with
    prompt lookup on a single row, also its tokens for a seed (one draw per token from the same distributions)."""
    check_speculative(decoder, draft, sampling, decoding, speculation)
    rng = np.random.default_rng(sampling.seed)
    if speculation.kind == "prompt-lookup":
        proposer = PromptLookup(speculation.prompt_lookup, speculation.max_ngram, eos_token_ids)
    else:
        proposer = Draft(draft, speculation.draft_tokens, decoding, eos_token_ids, sampling, rng)
    copies = decoding.num_return_sequences
    rows = [row[m > 0].tolist() for row, m in zip(input_ids, mask) for _ in range(copies)]
    single = len(rows) == 1
    results = [
        _row(
            decoder,
            proposer,
            prompt,
            max_new_tokens,
            decoding,
            sampling,
            rng,
            eos_token_ids,
            stop,
            on_step if single else None,
        )
        for prompt in rows
    ]
    fill = pad_token_id if pad_token_id is not None else 0
    width = max(len(r.tokens) for r in results)
    tokens = np.array([r.tokens + [fill] * (width - len(r.tokens)) for r in results], dtype=np.int64)
    if on_step is not None and not single:
        for step in range(width):
            on_step(step, tokens[:, step])
    seconds = [
        sum(r.seconds[i] for r in results if i < len(r.seconds)) for i in range(max(len(r.seconds) for r in results))
    ]
    acceptance = Acceptance(
        kind=speculation.kind,
        rounds=sum(r.rounds for r in results),
        proposed=sum(r.proposed for r in results),
        accepted=sum(r.accepted for r in results),
        tokens=sum(len(r.tokens) for r in results),
        draft_steps=proposer.steps,
    )
    return Generation(
        tokens,
        np.array([r.finished for r in results]),
        seconds,
        np.array([r.score for r in results]),
        copies,
        np.array([len(r.tokens) for r in results], dtype=np.int64),
        speculation=acceptance,
    )


def check_speculative(decoder, draft, sampling: Sampling, decoding: Decoding, speculation: Speculation) -> None:
    """The opened runtimes and the request against what speculative decoding declares it needs, in one line."""
    request = request_declared(sampling, decoding)
    for runtime in (decoder, draft):
        if runtime is not None:
            resolve([runtime_spec(runtime.runtime).declared, request, speculation.declared]).check()
    if (speculation.kind == "draft") != (draft is not None):
        raise BadInput("a draft folder (--draft) goes with an opened draft runtime, and only then")


@dataclass
class _Row:
    tokens: list[int]
    finished: bool
    seconds: list[float]
    score: float
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0


def _choose(scores: np.ndarray, proposal: int | None, q: np.ndarray | None, sampling: Sampling, rng) -> int:
    """The token at one position from its processed [vocab] scores, given the proposal there (None past the last).

    Greedy: the argmax. Sampling without the proposer's distribution (prompt lookup): a draw from the scores, as
    the plain loop draws; the proposal is kept where the draw equals it (transformers, candidate_logits None).
    Sampling with the draft's distribution ``q``: transformers' _speculative_sampling (Leviathan et al. 2023,
    algorithm 1): the proposal x is kept with probability min(1, p(x) / q(x)); otherwise the token is drawn from
    max(p - q, 0), renormalised. Either way each token follows p, the plain loop's distribution."""
    if not sampling.sample:
        return int(scores.argmax())
    p = logits.softmax(scores.astype(np.float64))
    if proposal is None or q is None:
        return int(rng.choice(len(p), p=p / p.sum()))
    if rng.random() * q[proposal] <= p[proposal]:
        return proposal
    residual = np.maximum(p - q, 0.0)
    residual = residual if residual.sum() > 0 else p
    return int(rng.choice(len(p), p=residual / residual.sum()))


def _row(decoder, proposer, prompt, max_new_tokens, decoding, sampling, rng, eos_ids, stop, on_step) -> _Row:
    """One row at batch 1: the prompt step, then rounds of proposals until max_new_tokens, eos or a stop string."""
    total = len(prompt) + max_new_tokens
    dummy = decoder.dummy_past
    processed = sampling.sample or decoding.processors_on()
    sequence = list(prompt)
    new: list[int] = []
    score = 0.0
    row = _Row(new, False, [], 0.0)
    proposer.start(prompt, total)
    past = decoder.empty_past(1, capacity=total)
    start = time.perf_counter()
    mask = decoder.prompt_mask(np.ones((1, len(prompt)), np.int64))
    out, past = decoder.run(np.array([prompt], np.int64), mask, np.arange(len(prompt))[None], past)
    row.seconds.append(time.perf_counter() - start)
    pending = out[:, -1]  # [1, vocab]: the logits that choose the next token
    proposed: list[int] = []
    while True:
        # choose from each position's logits, in order, until one differs from its proposal
        kept = 0
        for i in range(len(pending)):
            scores = pending[i : i + 1].astype(np.float32)
            if processed:
                scores = process_scores(
                    scores,
                    np.array([sequence]),
                    prompt_length=len(prompt),
                    decoding=decoding,
                    sampling=sampling,
                    eos_token_ids=eos_ids,
                )
            proposal = proposed[i] if i < len(proposed) else None
            q = proposer.probs[i] if proposal is not None and proposer.probs is not None else None
            token = _choose(scores[0], proposal, q, sampling, rng)
            score += float(logits.log_softmax(scores)[0, token])
            sequence.append(token)
            new.append(token)
            if on_step is not None:
                on_step(len(new) - 1, np.array([token]))
            matched = i < len(proposed) and token == proposed[i]
            kept += matched
            ended = token in eos_ids or (stop is not None and stop(sequence))
            if ended or len(new) == max_new_tokens:
                row.finished, row.score = ended, score
                row.accepted += kept
                return row
            if not matched:
                break
        start = time.perf_counter()  # the round: the caches cut back, the proposals, the model's step
        row.accepted += kept
        if proposed:
            proposer.update(sequence, len(proposed), kept)
        # the cache holds every token but the last: cut what the target saw past that
        cached = len(sequence) - 1
        past = decoder.crop_past(past, dummy + cached)
        # at most what keeps the round within prompt + max_new_tokens (transformers: max_length - length - 1), and
        # within the rows a step computes on the model's own weights (int4's prompt path: more run int8 kernels,
        # whose other logits would change the tokens)
        limit = total - len(sequence) - 1
        if decoder.exact_step_rows is not None:
            limit = min(limit, decoder.exact_step_rows - 1)
        proposed = proposer.propose(sequence, limit)
        step_ids = [sequence[-1], *proposed]
        mask = np.ones((1, dummy + cached + len(step_ids)), np.int64)
        if dummy:
            mask[:, :dummy] = 0
        positions = np.arange(cached, cached + len(step_ids), dtype=np.int64)[None]
        out, past = decoder.run(np.array([step_ids], np.int64), mask, positions, past, last_logits_only=False)
        row.seconds.append(time.perf_counter() - start)
        row.rounds += 1
        row.proposed += len(proposed)
        pending = out[0]
