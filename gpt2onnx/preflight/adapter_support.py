"""Where switchable LoRA adapters work, answered by the resolver from the declarations alone: each runtime with an
adapter active (a runtime's ``binds_adapters``), the batching engine with an adapter per request, and each deploy
target given a folder with adapter files (a target's ``carries_adapters``). docs/adapters.md holds this module's
:func:`markdown` between its markers, never edited by hand (tests/exporters/test_adapters.py compares them)."""

from __future__ import annotations

from gpt2onnx.artifact.graph import GraphFacts
from gpt2onnx.artifact.lora import adapter_declared, adapter_files_choice
from gpt2onnx.capabilities import resolve
from gpt2onnx.choices.of_folder import folder_choices
from gpt2onnx.runtimes.all_runtimes import RUNTIMES, runtime_alternatives, runtime_spec
from gpt2onnx.serving.engine import ADAPTER_REQUEST, ENGINE
from gpt2onnx.targets.all_targets import target_specs

BEGIN = "<!-- generated: gpt2onnx.preflight.adapter_support.markdown() -->"
END = "<!-- end of generated -->"


def _cell(verdict) -> str:
    return "yes" if verdict.ok else f"no: {verdict.line}"


def markdown() -> str:
    """The table, between its markers: a row per runtime, the engine, a row per deploy target."""
    # a switchable export: an fp32 unfused graph (GraphFacts' defaults) with adapter files beside it
    folder = [*folder_choices(GraphFacts(), "FOLDER"), adapter_files_choice("FOLDER", ("NAME",))]
    alternatives = runtime_alternatives()
    lines = [BEGIN, "", "| runtime, engine or target | a switchable folder with `--adapter NAME` |", "|---|---|"]
    for name in RUNTIMES:
        verdict = resolve([*folder, runtime_spec(name).declared, adapter_declared("NAME")], alternatives=alternatives)
        lines.append(f"| runtime {name} | {_cell(verdict)} |")
    engine = resolve([*folder, runtime_spec("onnxruntime").declared, ENGINE, ADAPTER_REQUEST])
    lines.append(f"| the batching engine (an adapter per request) | {_cell(engine)} |")
    targets = [spec.declared for spec in target_specs()]
    for spec in target_specs():
        verdict = resolve([*folder, spec.declared], alternatives={"target": targets})
        lines.append(f"| deploy --target {spec.name} | {_cell(verdict)} |")
    return "\n".join([*lines, "", END]) + "\n"
