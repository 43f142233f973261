"""Gates: the thresholds a model must meet against its reference, per precision, and how they are applied.

The same gates, validated the same way, serve export, optimize and ``gpt2onnx parity``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gpt2onnx.artifact.report import Figures
from gpt2onnx.errors import BadInput, ContractError
from gpt2onnx.precisions.all_precisions import PRECISIONS, precision
from gpt2onnx.precisions.kv_cache import cache_format_of
from gpt2onnx.records import OMIT_DEFAULT, Record, field

# Each precision's gates are declared by its module (gpt2onnx.precisions: Precision.gates and .file_gates, with
# the measurements that set them); the tables below are views of the registry, by precision name.
# Quality gates (KL, top-1, top-5) are set to catch a broken quantization, not to rank good ones.
# A quantized file judged by itself (verify.rounding), the same on any weights, random or trained:
# weight_steps: the largest distance of a dequantized weight from its source, in quantization steps of the declared
#   width (round to nearest gives 0.5; onnxruntime's symmetric 4-bit range [-8, 7] clamps some values by up to 1).
# relative_error: the mean over positions of ‖Δlogits‖ / ‖logits − mean‖ against the reference run with the file's
#   own rounded weights, so only the activation path is left (measured in docs/benchmarks.md, "A quantized file
#   judged by itself"): it does not depend on how peaked the predictions are.
# weight_error: for a weight algorithm that moves weights on purpose (HQQ, k-quant, GPTQ), weight_steps gives way to
#   the largest RMS error of a tensor over round-to-nearest's at the declared width, at most the algorithm's own
#   bound (gpt2onnx.precisions.algorithms: Int4Algorithm.weight_error).
TOLERANCES = {name: dict(p.gates) for name, p in PRECISIONS.items()}
FILE_GATES = {name: dict(p.file_gates) for name, p in PRECISIONS.items() if p.file_gates}
FILE_GATE_NAMES = ("weight_steps", "weight_error", "relative_error")
# The quality gates judge predictions that carry information. Where the reference's next-token distributions lie
# within FLAT_NATS of uniform (ln V − entropy, the mean over the compared positions), the weights are random in
# effect, wherever they came from, and only the file gates apply. Measured on random token ids (the checks' own
# prompts): GPT-2 initialized as transformers does it (std 0.02) gives 0.013 nats (tiny), 0.153 (124M), 0.205
# (355M) and 0.322 (1.5B), as n_embd · 0.02² / 2 predicts; the weakest trained model here, the test fixture (2
# layers of 64, held-out PPL 184 on a vocabulary of 512), gives 1.2–1.3. 0.6 lies between, with room on both sides.
FLAT_NATS = 0.6
QUALITY_GATES = ("kl_mean", "top1", "top5")


@dataclass(frozen=True)
class Gate:
    """One gate: its name (--gate NAME=X), what it bounds, the range it may be set to (a |Δ| is a positive number,
    an agreement a share in (0, 1], a KL ≥ 0), whether the figure must stay at most (``upper``) or at least the
    value, the figure of a check's Figures it reads (None where the check did not measure it), and the failure's
    words for the figure and the limit."""

    name: str
    description: str
    figure: Callable[[Figures], float | None]
    failure: Callable[[Figures, float], str]
    upper: bool = True
    low: float = 0.0
    high: float = math.inf

    def fails(self, measured: Figures, limit: float) -> bool:
        value = self.figure(measured)
        if value is None:
            return False  # a gate on a figure the check does not measure (present on a runtime without presents)
        return not value <= limit if self.upper else not value >= limit  # NaN fails either way


GATES = {
    gate.name: gate
    for gate in (
        Gate(
            "logits",
            "max |Δlogits|",
            lambda m: m.logits.max if m.logits is not None else None,
            lambda m, g: f"max |Δlogits| {m.logits.max:.3g} > {g:g}",
        ),
        Gate(
            "present",
            "max |Δpresent|",
            lambda m: m.present.max if m.present is not None else None,
            lambda m, g: f"max |Δpresent| {m.present.max:.3g} > {g:g}",
        ),
        Gate(
            "top1",
            "least top-1 agreement (0–1)",
            lambda m: m.top1_agreement,
            lambda m, g: f"top-1 agreement {100 * m.top1_agreement:.2f}% < {100 * g:g}%",
            upper=False,
            high=1.0,
        ),
        Gate(
            "top5",
            "least top-5 agreement (0–1)",
            lambda m: m.top5_agreement,
            lambda m, g: f"top-5 agreement {100 * m.top5_agreement:.2f}% < {100 * g:g}%",
            upper=False,
            high=1.0,
        ),
        Gate(
            "kl_mean",
            "largest mean KL divergence",
            lambda m: m.kl.mean if m.kl is not None else None,
            lambda m, g: f"mean KL divergence {m.kl.mean:.3g} > {g:g}",
        ),
        Gate(
            "weight_steps",
            "largest weight error in quantization steps of the declared width",
            lambda m: m.weights.max_steps if m.weights is not None else None,
            lambda m, g: (
                f"weights are not the declared rounding: '{m.weights.worst}' is {m.weights.max_steps:.3g}"
                f" quantization steps from its source > {g:g}"
            ),
        ),
        Gate(
            "weight_error",
            "largest RMS weight error of a tensor over round-to-nearest's (int4 algorithms that move weights)",
            lambda m: m.weights.rms_ratio if m.weights is not None else None,
            lambda m, g: (
                f"weights are not the declared algorithm's: '{m.weights.rms_worst}' has {m.weights.rms_ratio:.3g}"
                f" times the RMS error of round to nearest > {g:g}"
            ),
        ),
        Gate(
            "relative_error",
            "largest mean relative logits error against the file's own rounded weights",
            lambda m: m.relative_error.mean if m.relative_error is not None else None,
            lambda m, g: f"relative logits error {100 * m.relative_error.mean:.3g}% > {100 * g:g}%",
        ),
    )
}
GATE_NAMES = {name: gate.description for name, gate in GATES.items()}  # for the help and the errors


def check_gate(name: str, value: float) -> float:
    """A gate value within its range (a NaN, a negative |Δ| or an agreement above 1 would never fail or never pass)."""
    if name not in GATES:
        choices = ", ".join(f"{k} ({v})" for k, v in GATE_NAMES.items())
        raise BadInput(f"unknown gate '{name}': choose one of {choices}")
    low, high = GATES[name].low, GATES[name].high
    if not (
        isinstance(value, (int, float)) and not isinstance(value, bool) and low < value <= high and math.isfinite(value)
    ):
        raise BadInput(
            f"gate {name}={value} is out of range: {GATE_NAMES[name]} must be above {low:g} and at most {high:g}"
        )
    return float(value)


def tolerances_for(name: str, overrides: dict[str, float] | None = None) -> dict:
    """The precision's default gates, with ``overrides`` (from --gate NAME=VALUE) on top, each checked; the file
    gates (FILE_GATES) are overridden by the same --gate but kept apart (file_gates_for)."""
    declared = precision(name)  # refuses an unknown name
    checked = {gate: check_gate(gate, value) for gate, value in (overrides or {}).items()}
    allowed = {*FILE_GATES.get(name, {}), *(("weight_error",) if declared.algorithms else ())}
    unused = [gate for gate in checked if gate in FILE_GATE_NAMES and gate not in allowed]
    if unused:
        quantized = " and ".join(n for n, p in PRECISIONS.items() if p.file_gates)
        raise BadInput(f"gate {unused[0]} applies to {quantized} files, not to {name}: drop it")
    return {**TOLERANCES[name], **{k: v for k, v in checked.items() if k not in FILE_GATE_NAMES}}


def cache_tolerances(name: str, kv_dtype: str, overrides: dict[str, float] | None = None) -> dict | None:
    """The gates of a graph whose K/V cache is quantized (``kv_dtype``: its past inputs' element type), with
    ``overrides`` on top: its cache format's (gpt2onnx.precisions.kv_cache) in place of an exact precision's
    tolerances; None for a float cache, and for quantized weights, whose own gates and file check judge the graph
    with its cache (the cache's error is far below theirs: docs/precision.md)."""
    fmt = cache_format_of(kv_dtype)
    if fmt is None or not precision(name).exact:
        return None
    checked = tolerances_for(name, overrides)  # each override checked against the precision's table
    return {**fmt.gates, **{k: v for k, v in checked.items() if k in (overrides or {})}}


def with_cache(name: str, kv_dtype: str, tolerances: dict, overrides: dict[str, float] | None = None) -> dict:
    """Quantized weights over a quantized K/V cache: the two errors add, so each quality gate the cache format
    also sets is the sum of the two budgets (a KL bound plus the cache's; an agreement's shortfall plus the
    cache's), where --gate did not set it. Unchanged for a float cache and for an exact precision (whose gates
    the cache's replace: cache_tolerances)."""
    fmt = cache_format_of(kv_dtype)
    if fmt is None or precision(name).exact:
        return tolerances
    combined = dict(tolerances)
    for gate, value in fmt.gates.items():
        if gate in combined and gate not in (overrides or {}):
            combined[gate] = combined[gate] + value if GATES[gate].upper else combined[gate] + value - 1
    return combined


def file_gates_for(name: str, overrides: dict[str, float] | None = None, *, algorithm: str | None = None) -> dict:
    """The gates of a quantized file judged by itself (FILE_GATES), with the --gate overrides that name them.
    ``algorithm``: the weight algorithm the manifest records (None: the precision's default, as every file before
    it was recorded); one that moves weights is judged by its weight_error bound instead of weight_steps."""
    declared = precision(name)
    if algorithm is not None and declared.algorithms and algorithm not in declared.algorithms:
        raise ContractError(
            f"the manifest's {name} algorithm '{algorithm}' is unknown: choose one of {', '.join(declared.algorithms)}"
        )
    gates = declared.file_gates_for(algorithm)
    gates.update({k: check_gate(k, v) for k, v in (overrides or {}).items() if k in gates})
    return gates


def parse_gates(values: list[str] | None) -> dict[str, float]:
    """NAME=VALUE strings (--gate, repeatable): each overrides one default gate."""
    gates = {}
    for value in values or []:
        name, _, number = value.partition("=")
        try:
            number_value = float(number)
        except ValueError:
            raise BadInput(f"gate '{value}': '{number}' is not a number (e.g. --gate kl_mean=0.02)") from None
        gates[name] = check_gate(name, number_value)
    return gates


def apply_gates(measured: Figures, gates: dict, *, cases: int = 1) -> list[str]:
    """The failures of ``measured`` (the totals of a check) against ``gates``, in the table's order; NaN fails
    every gate it meets; a gate on a figure the check does not measure is not applied."""
    failures = [
        gate.failure(measured, gates[name])
        for name, gate in GATES.items()
        if name in gates and gate.fails(measured, gates[name])
    ]
    if measured.nonfinite:
        failures.append(f"{measured.nonfinite} NaN/Inf values")
    if gates.get("tokens_equal") and measured.tokens_equal_cases is not None and measured.tokens_equal_cases < cases:
        failures.append(f"greedy tokens differ in {cases - measured.tokens_equal_cases} cases")
    return failures


@dataclass(frozen=True)
class EvalGates(Record):
    """Thresholds on the figures against the reference: the most ΔPPL (percent) and mean KL accepted; checked
    when built."""

    max_ppl_increase: float | None = field(default=None, omit=OMIT_DEFAULT)
    max_kl: float | None = field(default=None, omit=OMIT_DEFAULT)

    def __post_init__(self) -> None:  # an invalid one cannot be built
        for name, value in (("max_ppl_increase", self.max_ppl_increase), ("max_kl", self.max_kl)):
            if value is not None and not (
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
            ):
                raise BadInput(f"{name.replace('_', '-')} must be a number ≥ 0, got {value!r}")

    def check(self) -> "EvalGates":  # built checked: kept for callers of the earlier API
        return self

    @property
    def active(self) -> bool:
        return self.max_ppl_increase is not None or self.max_kl is not None
