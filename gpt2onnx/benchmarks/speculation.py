"""Speculative decoding on real prompts (`gpt2onnx bench speculative`): gpt2onnx's proposer (prompt lookup or a
draft folder) against its plain greedy loop, beside transformers' own ``generate()`` with the same proposer on
the same weights, in the harness's rotating rounds.

requires: a target folder with every position's logits and its tokenizer, its source checkpoint (the
manifest's; a draft's too), torch; the proposer as ``--prompt-lookup N`` or ``--draft DIR``, refused by the
resolver before anything loads. ensures: per kind of prompt (standard-library source, standard-library
docstrings, free text; each cut to ``prompt_tokens``), batch 1, greedy, at most ``new_tokens`` new tokens (a row
stops at end-of-sequence on both sides alike): every run's seconds over the kind's prompts and its new tokens
per second, medians with quartiles and the ratio to gpt2onnx's greedy round by round; from one untimed pass, new
tokens per forward pass of the target, the share of proposals kept (gpt2onnx's count; transformers does not
report its own) and whether the tokens equal gpt2onnx's greedy.
"""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.generation import read_generation_config
from gpt2onnx.artifact.paths import check_output_files
from gpt2onnx.benchmarks.harness import Rounds, check_runs, interleave, timed, write_outputs
from gpt2onnx.decoding.generate import decode, open_draft
from gpt2onnx.decoding.speculative import Speculation
from gpt2onnx.errors import BadInput
from gpt2onnx.generation_options import Decoding, Sampling, request_declared
from gpt2onnx.records import Record, RecordError, field, from_json
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, open_runtime

FREE_TEXT = (
    "The village stood at the edge of the forest, and every winter the river froze so hard that the children"
    " walked across it to the mill on the other side.",
    "She opened the letter slowly, read the first line twice, and then put it down on the table without a word.",
    "In the morning the market fills with carts of apples, bread and cheese, and by noon the square is empty"
    " again except for the pigeons.",
    "The committee met on Tuesday to discuss the budget for next year, but the meeting ended before any"
    " decision was made.",
)
OURS_PLAIN = "gpt2onnx greedy"


def real_prompts() -> dict[str, list[str]]:
    """Real English and code: the standard library's source and docstrings, and plain sentences."""
    import collections
    import functools
    import json
    import string

    objects = [textwrap.dedent, json.dumps, functools.lru_cache, collections.Counter.most_common, string.capwords]
    return {
        "stdlib code": [inspect.getsource(o) for o in objects],
        "stdlib docstrings": [inspect.getdoc(o) for o in objects],
        "free text": list(FREE_TEXT),
    }


@dataclass(frozen=True)
class SpeculativeRun(Record):
    """One run's untimed pass over one kind of prompts."""

    kind: str
    run: str
    new_tokens: int
    tokens_per_target_step: float
    acceptance: float | None  # proposals kept (gpt2onnx's runs that propose)
    same_tokens: bool  # the tokens of gpt2onnx's greedy


def _rounds_by_kind(data) -> tuple[tuple[str, Rounds], ...]:
    if not isinstance(data, dict):
        raise RecordError(f"rounds: not an object of kinds: {data!r}")
    return tuple((str(kind), from_json(Rounds, rounds)) for kind, rounds in data.items())


@dataclass(frozen=True)
class SpeculativeReport(Record):
    proposer: str
    prompt_tokens: int
    new_tokens: int
    runs: tuple[SpeculativeRun, ...]
    # per kind of prompt: seconds, tokens_per_s (written as an object, kind -> rounds)
    rounds: tuple[tuple[str, Rounds], ...] = field(write=lambda r: dict(r.rounds), read=_rounds_by_kind)

    def markdown(self) -> str:
        head = "| prompts | run | new tokens / s | × gpt2onnx greedy | tokens per target step | kept | same tokens |"
        lines = [head, "|---|---|---|---|---|---|---|"]
        by_kind = dict(self.rounds)
        for run in self.runs:
            rounds = by_kind[run.kind]
            ratio = rounds.ratio(run.run, "tokens_per_s")
            kept = "-" if run.acceptance is None else f"{100 * run.acceptance:.0f} %"
            lines.append(
                f"| {run.kind} | {run.run} | {rounds.spread(run.run, 'tokens_per_s').shown()} |"
                f" {ratio.median:.2f} ({ratio.low:.2f}–{ratio.high:.2f}) | {run.tokens_per_target_step:.2f} |"
                f" {kept} | {'yes' if run.same_tokens else 'no'} |"
            )
        first = self.rounds[0][1]
        lines += [
            "",
            f"Batch 1, greedy, prompts of at most {self.prompt_tokens} tokens, at most {self.new_tokens} new tokens;"
            f" {len(first.orders)} rounds in rotating order after {first.warmup} warm-up runs each, per kind of"
            f" prompt; {first.machine.summary()}; {first.load.summary()}.",
        ]
        return "\n".join(lines) + "\n"


def bench_speculation(
    folder: str | Path,
    speculation: Speculation,
    *,
    runtime: RuntimeOptions | None = None,
    prompt_tokens: int = 64,
    new_tokens: int = 48,
    warmup: int = 1,
    repeat: int = 3,
    json_path: str | Path | None = None,
    markdown_path: str | Path | None = None,
    progress: Callable[[], None] | None = None,
    before_writing: Callable[[], None] | None = None,
) -> SpeculativeReport:
    """Time ``speculation`` on ``folder`` against its greedy loop, beside transformers' greedy and the same proposer
    in transformers' generate(), on real prompts, in interleaved rounds per kind of prompt."""
    import torch

    from gpt2onnx.decoding.prompts import load_tokenizer
    from gpt2onnx.pytorch.reference import reference_model
    from gpt2onnx.verify.parity import reference_checkpoint

    check_runs(warmup, repeat)
    if prompt_tokens < 1 or new_tokens < 1:
        raise BadInput(f"prompt and new tokens must be positive integers, got {prompt_tokens} and {new_tokens}")
    outputs = {"--json": json_path, "--md": markdown_path}
    check_output_files(outputs, inputs=(folder, speculation.folder))  # the draft's folder is read too
    model = open_folder(folder)
    options = runtime or RuntimeOptions()
    plain = request_declared(Sampling(), Decoding())
    decoder = open_runtime(model, options, plain, speculation.declared)
    draft_model = open_draft(speculation, model)
    draft = open_runtime(draft_model, options) if draft_model is not None else None
    tokenizer = load_tokenizer(model.folder)
    if options.threads:
        torch.set_num_threads(options.threads)
    eos_ids = read_generation_config(model.folder, vocab_size=model.facts.vocab_size).eos_token_ids
    eos = eos_ids[0] if eos_ids else None
    reference = reference_model(reference_checkpoint(model, None))
    forwards = [0]
    reference.register_forward_pre_hook(lambda module, inputs: forwards.__setitem__(0, forwards[0] + 1))
    # transformers' prompt lookup checks up to its N proposals past max_length (candidate_generator.py: end_idx
    # bounded by max_length, not max_length - 1): the prompts leave room for them inside the context
    lookahead = getattr(speculation.options, "prompt_lookup", None) or 0  # (a draft's are bounded there)
    budget = min(prompt_tokens, model.n_positions - new_tokens - lookahead)
    if budget < 1:
        raise BadInput(
            f"{new_tokens} new tokens{f' and {lookahead} proposed' if lookahead else ''} leave no room for a prompt in"
            f" the model's context of {model.n_positions}: ask for fewer new tokens (--new-tokens)"
        )
    prompts = {
        kind: [tokenizer(t, truncation=True, max_length=budget)["input_ids"] for t in texts]
        for kind, texts in real_prompts().items()
    }

    def ours(with_speculation: Speculation | None):
        def run(ids):
            out = decode(
                decoder,
                [ids],
                max_new_tokens=new_tokens,
                eos_token_id=eos_ids,
                speculation=with_speculation,
                draft=draft if with_speculation is not None else None,
            )
            tokens = out.tokens[0][: out.lengths[0]].tolist()
            spec = out.speculation
            return tokens, (spec.rounds + 1 if spec else len(tokens)), (spec.proposed, spec.accepted) if spec else None

        return run

    def theirs(**generate_options):
        def run(ids):
            forwards[0] = 0
            with torch.no_grad():
                out = reference.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    eos_token_id=eos,
                    pad_token_id=eos,
                    **generate_options,
                )
            tokens = out[0, len(ids) :].tolist()[:new_tokens]  # its prompt lookup can run past max_new_tokens
            if eos is not None and eos in tokens:
                tokens = tokens[: tokens.index(eos) + 1]
            return tokens, forwards[0], None

        return run

    label = speculation.proposer.label(speculation.options) or speculation.proposer.name
    loaded = speculation.proposer.generate_kwargs(
        speculation.options, lambda path: reference_model(reference_checkpoint(open_folder(path)))
    )
    runs = {
        OURS_PLAIN: ours(None),
        f"gpt2onnx {label}": ours(speculation),
        "transformers greedy": theirs(),
        f"transformers {label}": theirs(**loaded),
    }
    found, per_kind = [], []
    for kind, rows in prompts.items():
        results = {name: [run(ids) for ids in rows] for name, run in runs.items()}  # untimed: tokens, steps
        plain_tokens = [tokens for tokens, _, _ in results[OURS_PLAIN]]
        for name, result in results.items():
            made = sum(len(tokens) for tokens, _, _ in result)
            proposed = sum(p[0] for _, _, p in result if p)
            kept = sum(p[1] for _, _, p in result if p)
            found.append(
                SpeculativeRun(
                    kind,
                    name,
                    made,
                    made / max(1, sum(steps for _, steps, _ in result)),
                    kept / proposed if proposed else None,
                    [tokens for tokens, _, _ in result] == plain_tokens,
                )
            )
        made_by = {run.run: run.new_tokens for run in found if run.kind == kind}
        variants = {
            name: timed(lambda run=run, rows=rows: [run(ids) for ids in rows], {"tokens_per_s": made_by[name]})
            for name, run in runs.items()
        }
        per_kind.append(
            (kind, interleave(variants, rounds=repeat, warmup=warmup, baseline=OURS_PLAIN, on_run=progress))
        )
    report = SpeculativeReport(label, budget, new_tokens, tuple(found), tuple(per_kind))
    return write_outputs(report, json_path=json_path, markdown_path=markdown_path, before_writing=before_writing)
