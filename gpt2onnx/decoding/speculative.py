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
from gpt2onnx.decoding import processors as logits
from gpt2onnx.decoding.processors import process_scores
from gpt2onnx.decoding.proposers.all_proposers import PROPOSERS
from gpt2onnx.decoding.proposers.proposer import Context, fields
from gpt2onnx.decoding.results import Generation
from gpt2onnx.decoding.strategy import Request, Strategy
from gpt2onnx.errors import BadInput
from gpt2onnx.generation_options import BEAMS, Decoding, Sampling, request_declared
from gpt2onnx.params import options_of
from gpt2onnx.records import Record, computed
from gpt2onnx.runtimes.all_runtimes import runtime_spec
from gpt2onnx.runtimes.runtime import StepRuntime

# what speculative decoding needs of the runtime, the folder and the request
NEEDS = (
    Need("checks_proposals", allowed={True}, why="checks proposals in one step of several tokens"),
    Need(
        "logits",
        allowed={"all"},
        why="checks each proposal against its position's logits",
        fix="export it with --logits all",
    ),
    Lacks("features", {BEAMS: "does not take"}, fix="drop --num-beams"),
)


class Speculation:
    """How tokens are proposed: one registered proposer (gpt2onnx.decoding.proposers.all_proposers) and its options,
    given by their names (``Speculation(prompt_lookup=10)``, ``Speculation(draft="d", draft_tokens=4)``). Checked
    when built: exactly one proposer, and only its own options; immutable."""

    __slots__ = ("proposer", "options")

    def __init__(self, **given):
        given = {name: value for name, value in given.items() if value is not None}
        specs = list(PROPOSERS.values())
        turned_on = [spec for spec in specs if spec.switch.field in given]
        choices = " or ".join(f"{spec.switch.flag} {spec.switch.param.metavar}" for spec in specs)
        if len(turned_on) > 1:
            raise BadInput(f"speculative decoding takes one proposer: {choices}, not both")
        for name in given:
            owner = next((spec for spec in specs if name in fields(spec)), None)
            if owner is None:
                raise BadInput(f"speculative decoding has no option '{name}': the proposers take {choices}")
            if owner not in turned_on:
                flag = next(o.flag for o in options_of(owner.options) if o.field == name)
                raise BadInput(
                    f"{flag} applies to {owner.says}: give {owner.switch.flag} {owner.switch.param.metavar}, or drop it"
                )
        if not turned_on:
            raise BadInput(f"speculative decoding takes one proposer: {choices}")
        object.__setattr__(self, "proposer", turned_on[0])
        object.__setattr__(self, "options", turned_on[0].options(**given))

    def __setattr__(self, name, value):
        raise AttributeError("a Speculation is immutable")

    def __getattr__(self, name: str):
        """Its options by name (``draft_tokens``); None for another proposer's."""
        for spec in PROPOSERS.values():
            if name in fields(spec):
                return getattr(self.options, name) if spec is self.proposer else None
        raise AttributeError(name)

    def __eq__(self, other) -> bool:
        return isinstance(other, Speculation) and (self.proposer, self.options) == (other.proposer, other.options)

    def __hash__(self) -> int:
        return hash((self.proposer.name, self.options))

    def __repr__(self) -> str:
        return f"Speculation({self.options!r})"

    @property
    def kind(self) -> str:
        return self.proposer.name

    @property
    def folder(self):
        """The folder its proposer opens as its model (a draft's), None where it has none."""
        return getattr(self.options, self.proposer.folder) if self.proposer.folder else None

    @property
    def label(self) -> str:
        """Short, for a table row: "prompt-lookup 10", "draft NAME 4", "draft NAME adaptive"."""
        return self.proposer.label(self.options)

    @property
    def declared(self) -> Declared:
        """What speculative decoding needs: a stepper that runs a step of several new tokens on its cache and crops
        it, every position's logits, no beam search (gpt2onnx.capabilities)."""
        flag = self.proposer.switch.flag
        return Declared(
            "strategy", f"speculative ({self.kind})", flag, requires=NEEDS, label=f"speculative decoding ({flag})"
        )

    def as_dict(self) -> dict:
        """For --json: its proposer, and each option by transformers' name."""
        options = {o.key: getattr(self.options, o.field) for o in options_of(self.proposer.options)}
        return {"kind": self.kind, **{k: str(v) if isinstance(v, Path) else v for k, v in options.items()}}


def speculation_from(**given) -> Speculation | None:
    """The options as given (by name): None where no proposer and none of its options is given (plain decoding)."""
    if all(value is None for value in given.values()):
        return None
    return Speculation(**given)


@dataclass(frozen=True)
class Acceptance(Record):
    """How the proposals fared: over every round of every row."""

    kind: str  # "prompt-lookup" or "draft"
    rounds: int  # target steps after the prompt's
    proposed: int  # tokens proposed
    accepted: int  # proposals the target kept
    tokens: int  # new tokens made by those rounds and the prompt step
    draft_steps: int = 0  # the draft's own steps

    json_computed = (
        computed("acceptance_rate", "rate", after="accepted"),
        computed("tokens_per_target_step", "tokens_per_step", after="tokens"),
    )

    @property
    def rate(self) -> float | None:
        """Kept proposals / proposals (None: nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def tokens_per_step(self) -> float:
        """New tokens per target step, the prompt step included (plain decoding: 1)."""
        return self.tokens / (self.rounds + 1)

    def summary(self) -> str:
        rate = "nothing proposed" if self.rate is None else f"{100 * self.rate:.1f}% of {self.proposed} proposed"
        return (
            f"{self.kind}: accepted {rate}, {self.tokens_per_step:.2f} tokens per target step"
            f" ({self.tokens} tokens in {self.rounds + 1} steps"
            + (f", {self.draft_steps} draft steps)" if self.kind == "draft" else ")")
        )


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
    constraint=None,
) -> Generation:
    """Greedy or sampled decoding of a (left-padded, checked) batch with proposals checked in one target step, a
    row at a time (``num_return_sequences`` rows per prompt when sampling). ``draft``: the opened draft folder
    (with ``speculation.draft``). Greedy: the plain loop's tokens. Sampling: the plain loop's distribution; with
    prompt lookup on a single row, also its tokens for a seed (one draw per token from the same distributions).
    ``constraint`` (gpt2onnx.decoding.constraints.TokenConstraint): proposals are cut where the row's matcher
    refuses one, before the target's step (a draft's sampled ones are left to the acceptance rule), and each
    position's logits are masked as the plain loop masks them, so that greedy writes the plain loop's constrained
    tokens."""
    check_speculative(decoder, draft, sampling, decoding, speculation)
    rng = np.random.default_rng(sampling.seed)
    proposer = speculation.proposer.make(
        speculation.options, Context(decoding, eos_token_ids, sampling, rng, runtime=draft)
    )
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
            constraint,
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
    if (speculation.proposer.folder is not None) != (draft is not None):
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


def _row(
    decoder, proposer, prompt, max_new_tokens, decoding, sampling, rng, eos_ids, stop, on_step, constraint=None
) -> _Row:
    """One row at batch 1: the prompt step, then rounds of proposals until max_new_tokens, eos or a stop string."""
    total = len(prompt) + max_new_tokens
    dummy = decoder.dummy_past
    processed = sampling.sample or decoding.processors_on()
    sequence = list(prompt)
    new: list[int] = []
    score = 0.0
    row = _Row(new, False, [], 0.0)
    proposer.start(prompt, total)
    matcher = constraint.start(1) if constraint is not None else None
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
            if matcher is not None:
                scores = allowed = matcher.mask(scores)
            if processed:
                scores = process_scores(
                    scores,
                    np.array([sequence]),
                    prompt_length=len(prompt),
                    decoding=decoding,
                    sampling=sampling,
                    eos_token_ids=eos_ids,
                )
            if matcher is not None:  # as the plain loop: where a processor removed every allowed token
                scores = allowed if np.isneginf(scores).all() else scores
            proposal = proposed[i] if i < len(proposed) else None
            q = proposer.probs[i] if proposal is not None and proposer.probs is not None else None
            token = _choose(scores[0], proposal, q, sampling, rng)
            score += float(logits.log_softmax(scores)[0, token])
            if matcher is not None:
                matcher.advance([token])
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
        # checked against the constraint first, the refused tail dropped; not where the draft sampled them (its
        # acceptance rule must see the refused one to keep the distribution: p(x) = 0 rejects it)
        if matcher is not None and proposed and proposer.probs is None:
            proposed = proposed[: matcher.valid_prefix(proposed)]
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


def _run(decoder, request: Request) -> Generation:
    # a draft with a shorter context than the model's proposes while the sequence fits it, then stops proposing
    return speculative_decode(
        decoder,
        request.input_ids,
        request.mask,
        speculation=request.speculation,
        draft=request.draft,
        sampling=request.sampling,
        on_step=request.on_step,
        **request.stopping(),
    )


STRATEGY = Strategy(
    name="speculative",
    summary="proposals (prompt lookup, a draft folder) checked by the model in one step, kept where it agrees",
    applies=lambda runtime, request: request.speculation is not None,
    run=_run,
    requires=NEEDS,
)
