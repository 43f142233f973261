"""The record of a check: what was compared with what, the gates applied, what was measured, and the verdict.

Every check has this one shape, fp32 tolerances and reduced-precision gates alike: export validation,
optimize's check against the source graph, ``gpt2onnx parity``. It is written into the manifest and read
back by ``inspect``; :mod:`gpt2onnx.verify` produces it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpt2onnx.machine import MachineRecord
from gpt2onnx.records import OMIT_DEFAULT, Record, RecordError, computed, field, from_json


# -- what a check measured ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiffStats(Record):
    """max / p50 / p99 of an absolute difference (a fixed-batch check measures the max only)."""

    max: float
    p50: float | None = field(default=None, omit=OMIT_DEFAULT)
    p99: float | None = field(default=None, omit=OMIT_DEFAULT)


@dataclass(frozen=True)
class KlStats(Record):
    """KL(reference ‖ this) of the next-token distributions, per scored token (parity measures mean and max)."""

    mean: float
    stderr: float | None = field(default=None, omit=OMIT_DEFAULT)
    p99: float | None = field(default=None, omit=OMIT_DEFAULT)  # from a log-spaced histogram (2.3 % resolution)
    max: float | None = field(default=None, omit=OMIT_DEFAULT)


@dataclass(frozen=True)
class MeanMax(Record):
    mean: float
    max: float


@dataclass(frozen=True)
class Divergence(Record):
    """Greedy tokens generated before the first one that differs: the worst case and the mean."""

    min: int
    mean: float


@dataclass(frozen=True)
class WeightRounding(Record):
    """A quantized file's weights against the declared rounding of the source's (verify.rounding)."""

    max_steps: float  # the largest error, in declared quantization steps
    worst: str | None = field(omit=lambda r: r.worst is None)  # that tensor
    tensors: int  # how many were compared
    # the largest RMS error of a tensor over round-to-nearest's at the declared width (the weight_error gate of an
    # algorithm that moves weights on purpose: HQQ, k-quant, GPTQ); files before it was measured have none
    rms_ratio: float | None = field(default=None, omit=OMIT_DEFAULT)
    rms_worst: str | None = field(default=None, omit=OMIT_DEFAULT)  # that tensor


def _figure():
    """A figure: written where it was measured."""
    return field(default=None, omit=OMIT_DEFAULT)


@dataclass(frozen=True)
class Figures(Record):
    """What a check measured, typed. Each check measures its own subset; the rest are None and not written.

    - randomized cases (parity; export's and optimize's reduced-precision checks): logits, present, agreements,
      kl, relative_error, positions_compared, nonfinite, cases, tokens_equal_cases, tokens_before_divergence;
      ``prompts`` (parity) and ``weights`` (a quantized file judged by itself) where they apply;
    - one fixed left-padded batch (fp32 export and optimize): logits and present max, batch, prompt_length,
      decode_steps;
    - quality on real text (eval's gates): ppl, delta_ppl_percent, kl, same_top1, rms_dp, tokens;
    - the K/V path (parity): logits max, agreements, kl, positions_compared, nonfinite.
    """

    logits: DiffStats | None = _figure()  # |Δlogits| on real positions
    present: DiffStats | None = _figure()  # |Δpresent|; None where the runtime exposes no presents
    top1_agreement: float | None = _figure()
    top5_agreement: float | None = _figure()  # share of positions where the reference's top-1 is in our top-5
    kl: KlStats | None = _figure()
    relative_error: MeanMax | None = _figure()  # ‖Δlogits‖ / ‖logits − mean‖ per position
    positions_compared: int | None = _figure()
    nonfinite: int | None = _figure()  # NaN/Inf values (eval: tokens with NaN/Inf figures)
    cases: int | None = _figure()
    tokens_equal_cases: int | None = _figure()
    tokens_before_divergence: Divergence | None = _figure()
    weights: WeightRounding | None = _figure()
    prompts: str | None = _figure()  # "random token ids" or the text the cases were cut from
    # how far the reference's next-token distributions are from uniform (ln V − entropy, nats): near 0 on random
    # weights, where KL and top-k agreement measure nothing (verify.gates.FLAT_NATS)
    reference_information: float | None = _figure()
    batch: int | None = _figure()
    prompt_length: int | None = _figure()
    decode_steps: int | None = _figure()
    ppl: float | None = _figure()
    delta_ppl_percent: float | None = _figure()
    same_top1: float | None = _figure()
    rms_dp: float | None = _figure()
    tokens: int | None = _figure()
    # figures this version does not know (a later release's), kept as read and written back
    extra: dict[str, Any] = field(default_factory=dict, extra=True)
    # the order the keys were read in, so a record read back writes back byte-equal; new ones use field order
    key_order: tuple[str, ...] = field(default=(), compare=False, repr=False, order=True)


@dataclass(frozen=True)
class KvPathCheck(Record):
    """One consistency check of a model against itself along the K/V path (:mod:`gpt2onnx.verify.kv_path`)."""

    name: str  # past, batch or chunks
    description: str
    measured: Figures  # logits max, top1/top5 agreement, kl mean and max, positions_compared, nonfinite
    gates: dict[str, Any]
    failures: tuple[str, ...] = ()

    json_computed = (computed("passed"),)

    @property
    def passed(self) -> bool:
        return not self.failures

    def figures(self) -> str:
        """Its measured figures on one line."""
        m = self.measured
        return (
            f"max |Δlogits| {m.logits.max:.2e}, top-1 {100 * m.top1_agreement:.1f}%,"
            f" KL mean {m.kl.mean:.2e} ({m.positions_compared} positions)"
        )


@dataclass(frozen=True)
class KvPathReport(Record):
    """The three K/V-path checks of one precision, or why they were not run (a runtime with its own loop)."""

    skipped: str | None = None
    checks: tuple[KvPathCheck, ...] = ()

    @property
    def failures(self) -> list[str]:
        return [f"K/V path ({c.name}): {f}" for c in self.checks for f in c.failures]

    def summary(self) -> str:
        if self.skipped:
            return f"K/V path: not checked ({self.skipped})"
        parts = [
            f"{c.name} {c.measured.logits.max:.1e} (top-1 {100 * c.measured.top1_agreement:.0f}%,"
            f" KL {c.measured.kl.mean:.1e})"
            for c in self.checks
        ]
        return "K/V path, max |Δlogits|: " + ", ".join(parts) + (" — pass" if not self.failures else " — FAIL")


@dataclass(frozen=True)
class ParityCase:
    """One case of a parity run (a typed view of a ``CheckReport.cases`` record)."""

    batch: int
    past: int
    prompt: int
    steps: int
    logits: DiffStats
    present: DiffStats | None  # None where the runtime exposes no presents
    top1_agreement: float
    tokens_equal: bool

    @classmethod
    def of(cls, data: dict) -> ParityCase:
        """The view of one case record (gpt2onnx.verify.lockstep.CaseResult, as written): {} where no presents."""
        case = data["case"]
        return cls(
            case["batch"],
            case["prefix_length"],
            case["prompt_length"],
            case["decode_steps"],
            from_json(DiffStats, data["logits"]),
            from_json(DiffStats, data["present"]) if data.get("present") else None,
            data["top1_agreement"],
            bool(data["tokens_equal"]),
        )


@dataclass(frozen=True)
class Placement(Record):
    """Where onnxruntime put a session's nodes (its graph-assignment record, after its basic optimizations).

    ``nodes``: per onnxruntime provider, how many nodes it runs. Where a GPU provider was asked for, ``cpu_ops``
    counts the nodes on the CPU by op, and ``fallback`` those of them that are compute: the shape and mask
    arithmetic onnxruntime keeps on the CPU on purpose (computed from graph inputs, small constants and shapes)
    is not. ``reported`` is False where this onnxruntime keeps no such record."""

    asked: str  # the provider asked for: cpu, cuda, tensorrt
    nodes: dict[str, int]  # onnxruntime's provider name → nodes assigned to it
    cpu_ops: dict[str, int] = field(default_factory=dict)  # op → nodes on the CPU, a GPU provider asked for
    fallback: dict[str, int] = field(default_factory=dict)  # op → compute nodes among cpu_ops
    reported: bool = True

    def summary(self) -> str:
        """One line: e.g. '412 nodes on CUDA, 38 on CPU (shape and mask arithmetic)'."""
        if not self.reported:
            return "node placement not reported by this onnxruntime"
        counts = sorted(self.nodes.items(), key=lambda item: -item[1])
        text = ", ".join(
            f"{n}{' nodes' if i == 0 else ''} on {name.removesuffix('ExecutionProvider')}"
            for i, (name, n) in enumerate(counts)
        )
        if self.fallback:
            text += "; compute on the CPU: " + ", ".join(f"{op} ×{n}" for op, n in self.fallback.items())
        elif self.cpu_ops:
            text += " (on the CPU: shape and mask arithmetic)"
        return text


def _own_failures(written) -> tuple[str, ...]:
    """A report's own failures, from all it wrote: the nested checks' have their prefixes."""
    if written is None:
        return ()
    if not isinstance(written, list) or not all(isinstance(f, str) for f in written):
        raise RecordError(f"failures: not a list of texts: {written!r}")
    return tuple(f for f in written if not f.startswith((FP16_EMULATED, ROUNDED, KV_PATH)))


# How a nested check's failures read among its report's (and how a report read back tells them from its own)
FP16_EMULATED = "fp16 arithmetic as on a GPU: "
ROUNDED = "the file against its own rounded weights: "
KV_PATH = "K/V path ("


@dataclass(frozen=True)
class CheckReport(Record):
    """A check's verdict, frozen: its own gates' failures (computed from the gates and the figures by the check
    that built it, gpt2onnx.verify.gates.apply_gates) and those of the checks nested in it (fp16 emulated, the
    file against its own rounded weights, the K/V path), read from them: :attr:`failures`. A later step makes a
    new report (dataclasses.replace), never changes one."""

    precision: str  # the gate family: a precision's name (gpt2onnx.precisions), or tf32
    against: str  # what the model was compared with: "PyTorch" (GPT2LMHeadModel) or "source ONNX model"
    gates: dict[str, Any]  # name → threshold (logits, present, top1, top5, kl_mean, tokens_equal)
    measured: Figures
    # its own gates' failures, in the gate table's order; written as every release wrote it, with all the
    # failures (read back, the nested checks' are told apart by their prefixes)
    gate_failures: tuple[str, ...] = field(default=(), key="failures", write=lambda r: r.failures, read=_own_failures)
    provider: str = "cpu"
    runtime: str = "onnxruntime"
    cases: tuple[dict, ...] = ()  # per case, where the check kept them (parity)
    fp16_emulated: CheckReport | None = None  # fp16: the same gates with fp16 arithmetic as a GPU does it
    # the records added since are written where present, so earlier manifests write back unchanged
    kv_path: KvPathReport | None = field(default=None, omit=OMIT_DEFAULT)  # parity: the model against itself
    # int8/int4: the file judged by itself (verify.rounding): its weights against the declared rounding of the
    # source's, its logits against the reference run with its own rounded weights
    rounded: CheckReport | None = field(default=None, omit=OMIT_DEFAULT)
    # int8/int4: whether the quality gates (KL, top-k) were applied, and why
    quality_gates: str | None = field(default=None, omit=OMIT_DEFAULT)
    # where it ran: the CPU's model and features, the GPU
    machine: MachineRecord | None = field(default=None, omit=OMIT_DEFAULT)
    # where the checked session's nodes ran (onnxruntime)
    placement: Placement | None = field(default=None, omit=OMIT_DEFAULT)

    json_computed = (computed("passed"),)

    @property
    def failures(self) -> list[str]:
        """Every failure: its own gates', then those of the checks nested in it."""
        found = list(self.gate_failures)
        if self.fp16_emulated is not None:
            found += [f"{FP16_EMULATED}{f}" for f in self.fp16_emulated.failures]
        if self.rounded is not None:
            found += [f"{ROUNDED}{f}" for f in self.rounded.failures]
        if self.kv_path is not None:
            found += self.kv_path.failures
        return found

    @property
    def passed(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        """One line: the verdict and the figures that decide it."""
        m, parts = self.measured, []
        if m.logits is not None:
            parts.append(f"max |Δlogits| {m.logits.max:.2e}")
        if m.present is not None:
            parts.append(f"max |Δpresent| {m.present.max:.2e}")
        if m.delta_ppl_percent is not None:
            parts.append(f"ΔPPL {m.delta_ppl_percent:+.2f} %")
        if m.kl is not None and "kl_mean" in self.gates:
            parts.append(f"mean KL {m.kl.mean:.2e}")
        if m.top5_agreement is not None and "top5" in self.gates:
            parts.append(f"top-5 {100 * m.top5_agreement:.1f}%")
        if m.top1_agreement is not None and "top1" in self.gates:
            parts.append(f"top-1 {100 * m.top1_agreement:.1f}%")
        if m.relative_error is not None and "relative_error" in self.gates:
            parts.append(f"relative logits error {100 * m.relative_error.mean:.2f}%")
        if m.weights is not None and "weight_steps" in self.gates:
            parts.append(f"weights within {m.weights.max_steps:.2f} quantization steps")
        if m.weights is not None and m.weights.rms_ratio is not None and "weight_error" in self.gates:
            parts.append(f"weight RMS error at most {m.weights.rms_ratio:.2f}× round-to-nearest's")
        if self.fp16_emulated is not None and self.fp16_emulated.measured.kl is not None:
            parts.append(f"fp16 as on a GPU: mean KL {self.fp16_emulated.measured.kl.mean:.2e}")
        file_figures = self.rounded.measured if self.rounded is not None else None
        if file_figures is not None and file_figures.weights is not None and file_figures.relative_error is not None:
            gates = self.rounded.gates
            weights = (
                f"weight RMS error at most {file_figures.weights.rms_ratio:.2f}× round-to-nearest's"
                if "weight_error" in gates and file_figures.weights.rms_ratio is not None
                else f"weights within {file_figures.weights.max_steps:.2f} steps"
            )
            parts.append(
                f"the file against its own rounded weights: {weights},"
                f" relative logits error {100 * file_figures.relative_error.mean:.2f}%"
            )
        if self.quality_gates:
            parts.append(self.quality_gates)
        gates = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in self.gates.items())
        gates = gates or "none of its own"
        verdict = "pass" if self.passed else "FAIL: " + "; ".join(self.failures)
        where = f"{self.precision} against {self.against} on {self.runtime}/{self.provider}"
        if self.machine is not None:
            where += f" ({self.machine.short()})"
        return f"{where}: {', '.join(parts)} (gates: {gates}) — {verdict}"

    def parity_cases(self) -> list[ParityCase]:
        """The per-case records of a parity run, typed."""
        return [ParityCase.of(record) for record in self.cases]

    @classmethod
    def from_dict(cls, data: dict | None) -> CheckReport | None:
        """A report read back from a manifest; None for a folder written without one (or by an older version),
        or whose figures are damaged (a hand-edited manifest: the caller keeps the record as it was)."""
        if not isinstance(data, dict) or not {"precision", "gates", "measured"} <= data.keys():
            return None
        try:
            return from_json(cls, {"against": "?", **data})
        except RecordError:
            return None


# -- quality on real text (gpt2onnx eval; export's and optimize's --eval-text) ------------------------------
@dataclass(frozen=True)
class GreedyComparison(Record):
    """Greedy continuation of the text's first tokens, against the reference's."""

    prompt_tokens: int
    new_tokens: int  # compared (genai may stop earlier, at end-of-sequence)
    matching_tokens: int
    first_divergence: int | None  # None: all new_tokens equal


@dataclass(frozen=True)
class GreedySettings(Record):
    """The greedy comparison's protocol: the text's first ``prompt_tokens``, ``new_tokens`` generated."""

    prompt_tokens: int
    new_tokens: int


@dataclass(frozen=True)
class EvalProtocol(Record):
    """How the figures were measured: stated beside them in every report."""

    method: str
    context: int
    stride: int
    tokens: int  # of the whole text
    scored_tokens: int
    windows: int
    text: dict  # where the text came from (file, or dataset, config, split) and its sha256
    tokenizer: str | None
    reference: str
    greedy: GreedySettings
    gates: dict
    machine: MachineRecord | None = field(default=None, omit=OMIT_DEFAULT)  # where the folders ran: CPU, GPU

    # the protocol's words, written beside the figures every time
    ppl_stderr = "PPL × standard error of the mean NLL, tokens taken as independent"
    kl = "KL(reference ‖ folder) of the next-token distributions; p99 from a log-spaced histogram (2.3 %)"
    json_computed = (computed("ppl_stderr", after="reference"), computed("kl", after="ppl_stderr"))

    @property
    def greedy_prompt_tokens(self) -> int:
        return self.greedy.prompt_tokens

    @property
    def greedy_new_tokens(self) -> int:
        return self.greedy.new_tokens

    @property
    def source(self) -> str:
        """The text's file, or dataset:config:split."""
        named = (self.text.get(k) for k in ("dataset", "config", "split"))
        return self.text.get("file") or ":".join(filter(None, named))


@dataclass(frozen=True)
class EvalRow(Record):
    """One folder's figures (the reference's own row has only the perplexity)."""

    label: str  # the folder
    precision: str
    runtime: str
    provider: str
    tokens: int  # scored tokens
    ppl: float
    ppl_stderr: float
    nll_mean: float
    delta_ppl_percent: float | None = None  # (PPL / PPL_ref - 1) × 100, from the mean paired NLL difference
    delta_ppl_stderr: float | None = None  # in percentage points
    # KL(reference ‖ this) per token (None on the reference's own row; written {})
    kl: KlStats | None = field(default=None, empty=True)
    same_top1: float | None = None  # share of scored tokens with the reference's top-1 token
    rms_dp: float | None = None  # RMS of p(correct token) − p_ref(correct token)
    mean_dp: float | None = None
    nonfinite: int = 0  # positions with a NaN or Inf figure
    greedy: GreedyComparison | None = field(default=None, empty=True)  # None: not compared (written {})
    token_by_token: bool = False  # a --logits last graph, run one token per step
    seconds: float = 0.0  # time spent computing this model's logits
    check: CheckReport | None = None  # the gates, when given


@dataclass(frozen=True)
class EvalReport(Record):
    """What :func:`evaluate` returns: the protocol, the reference's perplexity, one row per folder."""

    protocol: EvalProtocol
    reference: EvalRow
    rows: tuple[EvalRow, ...]

    json_computed = (computed("failures"), computed("passed"))

    @property
    def failures(self) -> list[str]:
        return [f for row in self.rows if row.check for f in row.check.failures]

    @property
    def passed(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        """One line per folder is too long for a manifest summary: the verdict and the worst figures."""
        parts = [
            f"{r.label}: PPL {r.ppl:.4g} ({r.delta_ppl_percent:+.2f} %), mean KL {r.kl.mean:.2e}, "
            f"top-1 {100 * r.same_top1:.1f} %"
            for r in self.rows
        ]
        verdict = "pass" if self.passed else "FAIL: " + "; ".join(self.failures)
        return (
            f"on {self.protocol.scored_tokens:,} tokens of real text against {self.reference.label} "
            f"(PPL {self.reference.ppl:.4g}): {'; '.join(parts)} — {verdict}"
        )
