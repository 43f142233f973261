"""The preflight: will this folder (or this planned export) run on that runtime and provider, deploy to those
targets, decode with that strategy, be served by the batching engine? Answered from the declarations alone
(gpt2onnx.capabilities), with the folder's own read from its graph, and for a GPU provider from the graph's ops
against the provider's kernel table; no session is made, no weights are read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.graph import load_graph
from gpt2onnx.artifact.lora import adapter_declared, adapter_files_declared, adapter_of
from gpt2onnx.capabilities import Declared, Need, RefusedOptions, Unsupported, resolve
from gpt2onnx.choices.of_folder import folder_choices
from gpt2onnx.decoding.generate import open_draft
from gpt2onnx.decoding.speculative import Speculation
from gpt2onnx.errors import BadInput
from gpt2onnx.generation_options import Decoding, Sampling, request_declared
from gpt2onnx.passes.pipeline import GraphPasses
from gpt2onnx.records import Record, field
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, runtime_alternatives
from gpt2onnx.runtimes.runtime import command_declared
from gpt2onnx.serving.engine import ENGINE
from gpt2onnx.targets.all_targets import parse_targets, target_specs


@dataclass(frozen=True)
class Preflight(Record):
    """The answer: the choices asked about (as the resolver names them), whether they work together, each conflict
    in one line, and what a GPU provider's kernel table says of the folder's ops."""

    question: tuple[str, ...]
    ok: bool = field(key="supported")
    conflicts: tuple[str, ...] = ()
    kernels: tuple[str, ...] = ()  # ops a GPU provider has no kernel for (op ×count: reason)
    facts: dict[str, Any] = field(default_factory=dict)  # what the choices make (the resolver's facts, as text)

    @property
    def line(self) -> str:
        return "supported" if self.ok else self.conflicts[0]


def architecture_of(model: str | None) -> Declared | None:
    """What a planned export's checkpoint declares (its attention scores' precision), read from its config alone
    (a local folder or file, or a named architecture; checked as export checks it, no weights); None for a Hub id
    (not fetched) or no checkpoint."""
    from gpt2onnx.pytorch.checkpoint import local_config

    config = local_config(model) if model is not None else None
    if config is None:
        return None
    upcast = bool(getattr(config, "reorder_and_upcast_attn", False))
    return Declared(
        "architecture",
        "checkpoint",
        ensures={"upcast_attention": upcast},
        says={"upcast_attention": "computes its attention scores in fp32 (reorder_and_upcast_attn)"},
        label="the checkpoint's architecture",
    )


def preflight(
    folder: str | Path | None = None,
    *,
    plan: GraphPasses | dict | None = None,
    logits: str = "all",
    model: str | None = None,
    runtime: RuntimeOptions | None = None,
    targets: str | list[str] | None = None,
    sampling: Sampling | None = None,
    decoding: Decoding | None = None,
    speculation: Speculation | None = None,
    engine: bool = False,
    command: str | None = None,
    verify_files: bool = False,
    constraint=None,
    adapter: str | None = None,
) -> Preflight:
    """Whether the choices work together, answered from their declarations before any work.

    Args:
        folder: an exported folder (its own declarations are read from its graph); or
        plan: an export's planned passes (``GraphPasses``, or its keywords: a combination they refuse is the
            answer) with ``logits`` and, optionally, the checkpoint ``model`` whose config.json says what its
            architecture needs. Give exactly one of the two.
        runtime: the runtime and its settings (the onnxruntime runtime's: the provider) it would run on; None:
            onnxruntime's defaults where decoding or the engine is asked, else the folder or export alone.
        targets: deployment targets (with those they need).
        sampling, decoding, speculation: a request's decoding options and speculative proposer (a draft folder is
            opened and its vocabulary compared with the folder's).
        engine: served by the batching engine (the Triton generation models run it).
        command: the command that will run it (bench, parity, eval need per-step logits: runtimes.base.COMMANDS).
        constraint: what a request may write (gpt2onnx.decoding.constraints.Constraint): a decoding feature that
            runtimes with a loop of their own (genai, ort-generate) lack.
        adapter: a switchable LoRA adapter of the folder, active (a runtime that binds its factors: onnxruntime).

    Returns: Preflight. Raises: BadInput (a choice that does not exist, a folder or a draft that is not one)."""
    if (folder is None) == (plan is None) or (folder is not None and (model is not None or logits != "all")):
        raise BadInput("give a folder to check, or an export's planned options (--model/--fusion/...), one of them")
    if adapter is not None and folder is None:
        raise BadInput("--adapter names a switchable adapter of an exported folder: give the folder")
    chosen: list[Declared] = []
    kernels: tuple[str, ...] = ()
    if isinstance(plan, dict):
        try:
            for value in plan.values():  # planned options whose own choices conflict: that is the answer
                if isinstance(value, RefusedOptions):
                    raise value.refused
            plan = GraphPasses(**plan)
        except Unsupported as refused:  # the passes alone do not work together: that is the answer
            conflicts = tuple(c.line for c in refused.verdict.conflicts)
            return Preflight(refused.verdict.choices, False, conflicts)
    if folder is not None:
        opened = open_folder(folder, verify_files=verify_files)
        chosen += [*folder_choices(opened.facts, str(opened.folder)), *adapter_files_declared(opened)]
        if adapter is not None:  # a name the folder has (else one line, exit 2), then what it needs of a runtime
            adapter_of(opened, adapter)
            chosen.append(adapter_declared(adapter))
    else:
        chosen += [*plan.choices(), Declared("logits", logits, f"--logits {logits}", ensures={"logits": logits})]
        architecture = architecture_of(model)
        chosen += [architecture] if architecture is not None else []
    asks_a_run = (
        adapter is not None
        or engine
        or command is not None
        or speculation is not None
        or sampling is not None
        or decoding is not None
        or constraint is not None
    )
    if asks_a_run and runtime is None:
        runtime = RuntimeOptions()  # what generate and the engine run on unless told
    if runtime is not None:  # with a folder: what its deployment for the runtime declares too (ort-generate's files)
        chosen += runtime.declared_on(opened.folder) if folder is not None else runtime.declared
        if folder is not None and runtime.name == "onnxruntime":
            kernels = _kernels(opened, runtime)
    if targets:
        chosen += [spec.declared for spec in parse_targets(targets)]
    if sampling is not None or decoding is not None:
        chosen.append(request_declared(sampling or Sampling(), decoding or Decoding()))
    if speculation is not None:
        chosen.append(speculation.declared)
        draft = open_draft(speculation, None, verify_files)  # one that is not a folder: an error
        if draft is not None and folder is not None:  # another vocabulary: a conflict, the verdict
            chosen += vocabularies(opened, draft)
    if constraint is not None:
        chosen.append(constraint.declared)
    if engine:
        chosen.append(ENGINE)
    if command is not None:
        chosen.append(command_declared(command))
    alternatives = {**runtime_alternatives(), "target": [spec.declared for spec in target_specs()]}
    verdict = resolve(chosen, alternatives=alternatives)
    conflicts = tuple(c.line for c in verdict.conflicts)
    if kernels and not runtime.settings.allow_fallback:
        conflicts += (f"provider '{runtime.settings.name}' has no kernel for {'; '.join(kernels)}",)
    facts = {k: _shown(v) for k, v in verdict.facts.items()}
    return Preflight(tuple(c.shown for c in chosen), not conflicts, conflicts, kernels, facts)


def vocabularies(model, draft) -> list[Declared]:
    """The folder's vocabulary, and the draft's need of it (a draft proposes the model's tokens)."""
    ours, theirs = model.facts.vocab_size, draft.facts.vocab_size
    return [
        Declared(
            "vocabulary",
            str(ours),
            ensures={"vocab_size": ours},
            says={"vocab_size": f"has one of {ours} tokens"},
            origin="folder",
            label=f"the model '{model.folder}'",
        ),
        Declared(
            "draft",
            "vocabulary",
            requires=(
                Need(
                    "vocab_size",
                    allowed={theirs},
                    why=f"has a vocabulary of {theirs} tokens",
                    fix="a draft must share the model's tokenizer: give a draft exported from a checkpoint with it",
                ),
            ),
            label=f"the draft '{draft.folder}'",
        ),
    ]


def _kernels(opened, runtime: RuntimeOptions) -> tuple[str, ...]:
    """The folder's ops its GPU provider has no kernel for, from the kernel table (the graph, no weights)."""
    from gpt2onnx.runtimes.providers import unsupported_nodes

    missing = unsupported_nodes(load_graph(opened.model_path), runtime.settings.name)
    return tuple(f"{op} ×{n} ({reason})" for op, (n, reason) in missing.items())


def _shown(value) -> str | bool | int | None:
    if isinstance(value, frozenset):
        return ", ".join(sorted("::".join(filter(None, v)) if isinstance(v, tuple) else str(v) for v in value))
    return value
