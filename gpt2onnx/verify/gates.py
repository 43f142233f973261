"""Gates: the thresholds a model must meet against its reference, per precision, and how they are applied.

The same gates, validated the same way, serve export, optimize and ``gpt2onnx parity``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

from gpt2onnx.artifact.report import Figures
from gpt2onnx.errors import BadInput, ContractError
from gpt2onnx.passes.int4.all_algorithms import ALGORITHMS, DEFAULT_ALGORITHM

# Tolerances per dtype: largest |Δlogits| and |Δpresent|, and the top-1 agreement required. In fp32 the ONNX
# graph and PyTorch differ only by summation order: ~1e-6 is typical for the 124M model, 1e-4 leaves headroom.
# Quantized weights change every logit a little, so their gates measure what matters for generation instead:
# the mean KL divergence of the next-token distributions, and how often the reference's choice stays in our
# top 5. They are set to catch a broken quantization (KL far above 0.1, top-5 near chance), not to rank good
# ones: with random weights the 124M model's next-token distributions are nearly flat (logit std 0.55 over
# 50,257 tokens), which makes top-k agreement a harsh measure. Measured there (20 cases): int8 KL 2e-4,
# top-5 100 %; int4 (block 32) top-5 88 %.
TOLERANCES = {
    "float32": {"logits": 1e-4, "present": 1e-4, "top1": 1.0, "tokens_equal": True},
    # fp16 on the 124M model (random weights): KL 7e-8, top-1 99.6 %, top-5 100 %.
    "float16": {"kl_mean": 1e-4, "top1": 0.98, "top5": 0.99},
    # fp32 weights with TF32 matmuls (cuda/tensorrt --tf32): the inputs of each product rounded to a 10-bit
    # mantissa, as fp16 stores them, sums kept in fp32; fp32's 1e-4 cannot hold, so fp16's gates apply.
    "tf32": {"kl_mean": 1e-4, "top1": 0.98, "top5": 0.99},
    # int8 and int4: recalibrated on a trained model (docs/benchmarks.md, "What each precision costs"): each
    # recipe passes with a margin (trained test model: int8 KL 5.9e-5, top-1 98.6 %; int4 KL 1.4e-3, top-1 90.7 %;
    # random 124M: int8 KL 4.1e-4, top-1 93.5 %; int4 KL 7.8e-3, top-1 77 %, top-5 96 %), and the same method
    # with fewer bits per weight fails (int8 with 4-bit weights: KL 8.2e-4, top-1 89.6 %; int4 with 2-bit
    # weights: KL 1.75e-2, top-1 63.8 %), tests/test_precision_recipes.py.
    "int8": {"kl_mean": 7e-4, "top1": 0.92, "top5": 0.99},
    "int4": {"kl_mean": 0.012, "top1": 0.72, "top5": 0.94},
}
# A quantized file judged by itself (verify.rounding), the same on any weights, random or trained:
# weight_steps: the largest distance of a dequantized weight from its source, in quantization steps of the declared
#   width (round to nearest gives 0.5; onnxruntime's symmetric 4-bit range [-8, 7] clamps some values by up to 1).
# relative_error: the mean over positions of ‖Δlogits‖ / ‖logits − mean‖ against the reference run with the file's
#   own rounded weights, so only the activation path is left (measured in docs/benchmarks.md, "A quantized file
#   judged by itself"): it does not depend on how peaked the predictions are.
# weight_error: for an int4 algorithm that moves weights on purpose (HQQ, k-quant, GPTQ), weight_steps gives way to
#   the largest RMS error of a tensor over round-to-nearest's at the declared width, at most the algorithm's own
#   bound (gpt2onnx.passes.int4: Int4Algorithm.weight_error).
FILE_GATES = {
    "int8": {"weight_steps": 1.001, "relative_error": 0.05},
    "int4": {"weight_steps": 1.001, "relative_error": 0.05},
}
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


def tolerances_for(precision: str, overrides: dict[str, float] | None = None) -> dict:
    """The precision's default gates, with ``overrides`` (from --gate NAME=VALUE) on top, each checked; the file
    gates (FILE_GATES) are overridden by the same --gate but kept apart (file_gates_for)."""
    if precision not in TOLERANCES:
        raise BadInput(f"no parity gates are defined for precision '{precision}'")
    checked = {name: check_gate(name, value) for name, value in (overrides or {}).items()}
    file_gates = FILE_GATES.get(precision, {})
    allowed = {*file_gates, *(("weight_error",) if precision == "int4" else ())}
    unused = [name for name in checked if name in FILE_GATE_NAMES and name not in allowed]
    if unused:
        raise BadInput(f"gate {unused[0]} applies to int8 and int4 files, not to {precision}: drop it")
    return {**TOLERANCES[precision], **{k: v for k, v in checked.items() if k not in FILE_GATE_NAMES}}


def file_gates_for(precision: str, overrides: dict[str, float] | None = None, *, algorithm: str | None = None) -> dict:
    """The gates of a quantized file judged by itself (FILE_GATES), with the --gate overrides that name them.
    ``algorithm``: int4's, from the manifest (None: round to nearest, as every file before it was recorded); one
    that moves weights is judged by its weight_error bound instead of weight_steps."""
    gates = dict(FILE_GATES.get(precision, {}))
    if precision == "int4":
        name = algorithm or DEFAULT_ALGORITHM
        if name not in ALGORITHMS:
            raise ContractError(
                f"the manifest's int4 algorithm '{name}' is unknown: choose one of {', '.join(ALGORITHMS)}"
            )
        bound = ALGORITHMS[name].weight_error
        if bound is not None:
            del gates["weight_steps"]
            gates = {"weight_error": bound, **gates}
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
class EvalGates:
    """Thresholds on the figures against the reference: the most ΔPPL (percent) and mean KL accepted; checked
    when built."""

    max_ppl_increase: float | None = None
    max_kl: float | None = None

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

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}
