"""The per-token cost of a constraint's mask beside an unconstrained decode step (`gpt2onnx bench constraint`,
issue 57), in the harness's rotating rounds.

requires: a folder with its tokenizer files (the constraint is bound to its tokens), a runtime whose steps this
package runs (onnxruntime: a runtime with a loop of its own takes no constraint). ensures: at batch 1, greedy, on
one fixed prompt of PROMPT_TOKENS ids, per round and in rotating order: the unconstrained decode loop (no
end-of-sequence: it writes ``new_tokens``), and per constraint the same loop with it (until the constraint is
complete and ends the row, or ``new_tokens``) and its mask and advance alone, replayed on the tokens that loop
wrote (llguidance's mask, unpacked and applied to a row of logits, then the matcher taking the token: what the
loop adds to each step). Each run's figure is milliseconds per token: a decode loop's the mean time between two
of its new tokens (each a decode step, the prompt's step left out), the replay's its time over its tokens. The
mask's share of a decode step is the replay's over the unconstrained step's, round by round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.generation import read_generation_config
from gpt2onnx.artifact.paths import check_output_files
from gpt2onnx.benchmarks.harness import Rounds, Spread, check_runs, interleave, write_outputs
from gpt2onnx.decoding.constraints import Constraint, TokenConstraint, vocabulary_of
from gpt2onnx.decoding.generate import decode
from gpt2onnx.errors import BadInput
from gpt2onnx.records import Record, computed, field, to_json
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, open_runtime

PROMPT_TOKENS = 16  # ids 1..16: the same prompt for every variant (the step's cost does not depend on its ids)
UNCONSTRAINED = "unconstrained"
FIGURE = "ms_per_token"


def default_constraints() -> dict[str, Constraint]:
    """The set measured when none is given: a JSON schema, any JSON object, a regex that admits most tokens at
    every step (llguidance walks most of the token trie), a choice among three words."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "tags"],
    }
    return {
        "JSON schema": Constraint.json_schema(schema),
        "any JSON object": Constraint.json_object(),
        "regex": Constraint.regex(r"[A-Za-z ,.]{1,400}"),
        "choice": Constraint.choice(["yes", "no", "maybe"]),
    }


@dataclass(frozen=True)
class ConstraintRun(Record):
    """One constraint's untimed pass: what it is, the tokens the constrained loop wrote, whether they complete it."""

    name: str
    label: str
    tokens: int
    complete: bool

    @property
    def mask_variant(self) -> str:
        return f"{self.name}: mask + advance"


def _constraints(report: ConstraintCostReport) -> list[dict]:
    """Each constraint's run with its step, its mask and advance, and their ratios (written, never read back)."""
    return [
        {
            **to_json(run),
            "constrained_step_ms": to_json(report.constrained(run)),
            "mask_and_advance_ms": to_json(report.mask(run)),
            "mask_share_of_step": to_json(report.share(run)),
            "constrained_over_unconstrained": to_json(report.overhead(run)),
        }
        for run in report.runs
    ]


@dataclass(frozen=True)
class ConstraintCostReport(Record):
    folder: str
    new_tokens: int
    threads: int | None
    runs: tuple[ConstraintRun, ...] = field(key="constraints", write=_constraints)
    rounds: Rounds  # ms_per_token of every variant, ratios to the unconstrained step

    batch = 1
    prompt_tokens = PROMPT_TOKENS
    json_computed = (
        computed("batch", after="folder"),
        computed("prompt_tokens", after="batch"),
        computed("decode_step_ms", "step", after="threads"),
    )

    def step(self) -> Spread:
        """The unconstrained decode step, ms per token."""
        return self.rounds.spread(UNCONSTRAINED, FIGURE)

    def constrained(self, run: ConstraintRun) -> Spread:
        return self.rounds.spread(run.name, FIGURE)

    def mask(self, run: ConstraintRun) -> Spread:
        return self.rounds.spread(run.mask_variant, FIGURE)

    def share(self, run: ConstraintRun) -> Spread:
        """The mask and advance over the unconstrained decode step, round by round."""
        return self.rounds.ratio(run.mask_variant, FIGURE)

    def overhead(self, run: ConstraintRun) -> Spread:
        """The constrained decode step over the unconstrained one, round by round."""
        return self.rounds.ratio(run.name, FIGURE)

    def markdown(self) -> str:
        step = self.step()
        lines = [
            f"Decode step without a constraint: {step.shown()} ms per token.",
            "",
            "| constraint | tokens | constrained step, ms | mask + advance, ms | of a step |",
            "|---|---|---|---|---|",
        ]
        for run in self.runs:
            share = self.share(run)
            lines.append(
                f"| {run.name} | {run.tokens}{'' if run.complete else ' (incomplete)'} |"
                f" {self.constrained(run).shown()} | {self.mask(run).shown()} |"
                f" {100 * share.median:.2g} % ({100 * share.low:.2g}–{100 * share.high:.2g}) |"
            )
        r = self.rounds
        lines += [
            "",
            f"Batch 1, greedy, a {PROMPT_TOKENS}-token prompt, at most {self.new_tokens} new tokens"
            f"{f', {self.threads} threads' if self.threads else ''}; medians (quartiles) over {len(r.orders)} rounds"
            f" in rotating order after {r.warmup} warm-up runs each, shares round by round; {r.machine.summary()};"
            f" {r.load.summary()}.",
        ]
        return "\n".join(lines) + "\n"


def _per_token(times: list[float], what: str) -> float:
    """Milliseconds per decode step from the times each new token came (the first follows the prompt's step)."""
    if len(times) < 2:
        raise BadInput(
            f"{what} wrote {len(times)} token(s): a decode step's time needs two or more; give a constraint that"
            " writes more (or more --new-tokens)"
        )
    return 1e3 * (times[-1] - times[0]) / (len(times) - 1)


def bench_constraint_cost(
    folder: str | Path,
    *,
    constraints: dict[str, Constraint] | None = None,
    files: tuple = (),
    runtime: RuntimeOptions | None = None,
    new_tokens: int = 64,
    warmup: int = 1,
    repeat: int = 3,
    verify_files: bool = True,
    json_path: str | Path | None = None,
    markdown_path: str | Path | None = None,
    progress: Callable[[], None] | None = None,
    before_writing: Callable[[], None] | None = None,
) -> ConstraintCostReport:
    """Time each of ``constraints`` (by name; default: :func:`default_constraints`) on ``folder``'s decode loop at
    batch 1 against the unconstrained loop, and its mask and advance alone, in interleaved rounds. ``files``: the
    schema or grammar files they were read from (no output may overwrite them)."""
    check_runs(warmup, repeat)
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or not 2 <= new_tokens <= 4096:
        raise BadInput(f"--new-tokens must be an integer from 2 to 4,096 (two make one decode step), got {new_tokens}")
    constraints = default_constraints() if constraints is None else dict(constraints)
    if not constraints:
        raise BadInput("nothing to measure: give a constraint")
    check_output_files({"--json": json_path, "--md": markdown_path}, inputs=(folder,), files=files)
    model = open_folder(folder, verify_files=verify_files)
    if model.n_positions < PROMPT_TOKENS + new_tokens:
        raise BadInput(
            f"a {PROMPT_TOKENS}-token prompt and {new_tokens} new tokens run past the model's context of"
            f" {model.n_positions}: ask for fewer new tokens (--new-tokens)"
        )
    options = runtime or RuntimeOptions()
    eos = read_generation_config(model.folder, vocab_size=model.facts.vocab_size).eos_token_ids
    vocabulary = vocabulary_of(model.folder, vocab_size=model.facts.vocab_size, eos_token_ids=eos)
    bound: dict[str, TokenConstraint] = {name: c.bind(vocabulary) for name, c in constraints.items()}
    decoder = open_runtime(model, options)
    prompt = np.arange(1, PROMPT_TOKENS + 1, dtype=np.int64)[None]
    try:

        def loop(constraint: TokenConstraint | None):
            """The decode loop, timed from one new token to the next; returns the tokens and ms per token."""
            times: list[float] = []
            out = decode(
                decoder,
                prompt,
                max_new_tokens=new_tokens,
                eos_token_id=eos if constraint is not None else None,
                on_step=lambda step, ids: times.append(time.perf_counter()),
                constraint=constraint,
            )
            tokens = out.tokens[0][: out.lengths[0]].tolist()
            return tokens, out, times

        def decoding(constraint: TokenConstraint | None, what: str):
            return lambda: {FIGURE: _per_token(loop(constraint)[2], what)}

        def replay(constraint: TokenConstraint, tokens: list[int]):
            scores = np.zeros((1, model.facts.vocab_size), np.float32)  # the mask's cost does not depend on values

            def run():
                matchers = constraint.start(1)
                start = time.perf_counter()
                for token in tokens:
                    matchers.mask(scores)
                    matchers.advance([token])
                return {FIGURE: 1e3 * (time.perf_counter() - start) / len(tokens)}

            return run

        found: list[ConstraintRun] = []
        variants = {UNCONSTRAINED: decoding(None, "the unconstrained loop")}
        for name, constraint in bound.items():
            tokens, out, times = loop(constraint)  # untimed: the tokens the replay takes
            _per_token(times, f"{name} ({constraint.label})")
            found.append(ConstraintRun(name, constraint.label, len(tokens), bool(out.complete[0])))
            variants[name] = decoding(constraint, name)
            variants[found[-1].mask_variant] = replay(constraint, tokens)
        rounds = interleave(variants, rounds=repeat, warmup=warmup, baseline=UNCONSTRAINED, on_run=progress)
    finally:
        decoder.close()
    report = ConstraintCostReport(str(folder), new_tokens, options.threads, tuple(found), rounds)
    return write_outputs(report, json_path=json_path, markdown_path=markdown_path, before_writing=before_writing)
