"""The compatibility matrix: every combination of the registered choices, each answered by the resolver from the
declarations alone, written as Markdown (docs/compatibility.md is this module's output, never edited by hand:
tests/test_combinations.py compares them). Two tables: what an export can be (profile × K/V cache × precision),
and where each export that can be runs, deploys and is served."""

from __future__ import annotations

from dataclasses import dataclass

from gpt2onnx.capabilities import Unsupported
from gpt2onnx.decoding.proposers.all_proposers import PROPOSERS
from gpt2onnx.decoding.speculative import Speculation
from gpt2onnx.errors import BadInput
from gpt2onnx.passes.pipeline import GraphPasses
from gpt2onnx.precisions.all_precisions import FLOAT, FP32, QUANTIZED
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE, KV_CACHES
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.preflight.check import preflight
from gpt2onnx.profiles.all_profiles import PROFILES
from gpt2onnx.runtimes.all_runtimes import RUNTIMES, RuntimeOptions, runtime_spec
from gpt2onnx.runtimes.providers import PROVIDERS, ProviderConfig
from gpt2onnx.targets.all_targets import TARGETS

YES = "✓"


@dataclass(frozen=True)
class Precision:
    """A precision column: its label and the passes' keywords."""

    label: str
    dtype: str = FP32.short
    quantization: QuantizeOptions = QuantizeOptions()


def precisions() -> list[Precision]:
    """Every float precision, every quantizing one at its recipe, and each other prompt kernel of one that has them."""
    found = [Precision(p.short, dtype=p.short) for p in FLOAT.values()]
    for method, precision in QUANTIZED.items():
        found.append(Precision(precision.short, quantization=QuantizeOptions(method)))
        for kernel in precision.prompt_kernels[1:]:
            label = f"{precision.short}, --prompt-kernel {kernel}"
            found.append(Precision(label, quantization=QuantizeOptions(method, prompt_kernel=kernel)))
    return found


def plans() -> list[tuple[str, str, Precision, GraphPasses | None, str | None]]:
    """Every (profile, K/V cache, precision), with its passes where they work, else the refusal's line."""
    found = []
    for profile in PROFILES:
        for cache in (FLOAT_CACHE, *KV_CACHES):
            for precision in precisions():
                try:
                    passes = GraphPasses(
                        profile, dtype=precision.dtype, quantization=precision.quantization, kv_dtype=cache
                    )
                    found.append((profile, cache, precision, passes, None))
                except (Unsupported, BadInput) as refused:
                    found.append((profile, cache, precision, None, str(refused)))
    return found


def run_columns() -> list[tuple[str, dict]]:
    """The run-side questions, each a label and preflight's keywords: every runtime (the onnxruntime runtime on
    each provider), speculative decoding, the batching engine, every deployment target."""
    columns = []
    for name in RUNTIMES:
        spec = runtime_spec(name)
        if spec.declare_settings is not None:  # the onnxruntime runtime: one column per provider
            for provider in PROVIDERS:
                columns.append((f"{name} {provider}", {"runtime": RuntimeOptions(name, ProviderConfig(provider))}))
        else:
            columns.append((name, {"runtime": RuntimeOptions(name)}))
    cpu = RuntimeOptions()
    for spec in PROPOSERS.values():  # each proposer that opens no model of its own (a draft needs a folder)
        if spec.folder is None:
            speculation = Speculation(**{spec.switch.field: 8})
            columns.append((f"speculative ({spec.name})", {"runtime": cpu, "speculation": speculation}))
    columns.append(("batching engine", {"runtime": cpu, "engine": True}))
    columns += [(f"→ {target}", {"targets": target}) for target in TARGETS]
    return columns


class Notes:
    """The refusals' lines, numbered in the order met."""

    def __init__(self):
        self.lines: dict[str, int] = {}

    def mark(self, line: str) -> str:
        number = self.lines.setdefault(line, len(self.lines) + 1)
        return f"✗ {number}"


def markdown() -> str:
    """The whole page."""
    notes = Notes()
    columns = precisions()
    every = plans()
    out = [
        "# Compatibility",
        "",
        "What works together, as the resolver answers it from what each choice declares",
        "(`gpt2onnx/capabilities.py`). This page is generated: `gpt2onnx check --matrix > docs/compatibility.md`",
        "writes it, and a test fails where it differs. ✓: supported; ✗ n: refused before any work, for the reason",
        "numbered n below. `gpt2onnx check` answers the same question for one folder or one planned export (and, for",
        "a GPU provider, from the folder's own ops against its kernel table). An architecture that computes its",
        "attention scores in fp32 (`reorder_and_upcast_attn`) adds one more refusal: fp16 with the onnx profiles.",
        "",
        "## What an export can be",
        "",
        "| profile | K/V cache | " + " | ".join(p.label for p in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    rows: dict[tuple[str, str], list[str]] = {}
    for profile, cache, _, passes, refused in every:
        rows.setdefault((profile, cache), []).append(YES if passes is not None else notes.mark(refused))
    for (profile, cache), cells in rows.items():
        out.append(f"| {profile} | {cache} | " + " | ".join(cells) + " |")
    run = run_columns()
    out += [
        "",
        "## Where each export runs, is served and deploys",
        "",
        "Each export the table above allows, on every runtime (onnxruntime on each provider), with speculative",
        "decoding (prompt lookup) and the batching engine on onnxruntime's cpu provider, and deployed to each target.",
        "",
        "| export | " + " | ".join(label for label, _ in run) + " |",
        "|---|" + "---|" * len(run),
    ]
    for profile, cache, precision, passes, _ in every:
        if passes is None:
            continue
        cells = []
        for _, question in run:
            answer = preflight(plan=passes, **question)
            cells.append(YES if answer.ok else notes.mark(answer.conflicts[0]))
        name = f"{profile}, {precision.label}" + (f", --kv-cache {cache}" if cache != FLOAT_CACHE else "")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out += ["", "## Why", ""]
    out += [f"{number}. {line}" for line, number in notes.lines.items()]
    return "\n".join(out) + "\n"
