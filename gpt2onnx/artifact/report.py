"""The record of a check: what was compared with what, the gates applied, what was measured, and the verdict.

Every check has this one shape, fp32 tolerances and reduced-precision gates alike: export validation,
optimize's check against the source graph, ``gpt2onnx parity``. It is written into the manifest and read
back by ``inspect``; :mod:`gpt2onnx.verify` produces it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gpt2onnx.machine import MachineRecord


# -- what a check measured ----------------------------------------------------------------------------------
def _number(value, kind=float):
    """A figure read back: a JSON number (an int where ``kind`` is int), never a bool or a string."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise TypeError(f"not a number: {value!r}")
    return value


def _compact(record) -> dict:
    """A record's figures as written: the ones measured, in field order (the order every release wrote)."""
    return {k: v for k, v in asdict(record).items() if v is not None}


def _read(cls, data, kinds: dict[str, type] | None = None):
    """``cls`` from its written dict; every key must be one of its fields and every figure a number (``kinds``
    names the fields of another type), so a damaged record is refused whole rather than half read."""
    if not isinstance(data, dict) or not data.keys() <= cls.__dataclass_fields__.keys():
        raise ValueError(f"not a {cls.__name__} record: {data!r}")
    kinds = kinds or {}

    def figure(name, value):
        kind = kinds.get(name, float)
        return value if kind is str and isinstance(value, str) else _number(value, int if kind is int else float)

    return cls(**{k: figure(k, v) for k, v in data.items()})


@dataclass(frozen=True)
class DiffStats:
    """max / p50 / p99 of an absolute difference (a fixed-batch check measures the max only)."""

    max: float
    p50: float | None = None
    p99: float | None = None

    @classmethod
    def from_dict(cls, data: dict | None) -> "DiffStats | None":
        return None if not data else _read(cls, data)


@dataclass(frozen=True)
class KlStats:
    """KL(reference ‖ this) of the next-token distributions, per scored token (parity measures mean and max)."""

    mean: float
    stderr: float | None = None
    p99: float | None = None  # from a log-spaced histogram (2.3 % resolution)
    max: float | None = None

    @classmethod
    def from_dict(cls, data: dict) -> "KlStats | None":
        return _read(cls, data) if data else None


@dataclass(frozen=True)
class MeanMax:
    mean: float
    max: float


@dataclass(frozen=True)
class Divergence:
    """Greedy tokens generated before the first one that differs: the worst case and the mean."""

    min: int
    mean: float


@dataclass(frozen=True)
class WeightRounding:
    """A quantized file's weights against the declared rounding of the source's (verify.rounding)."""

    max_steps: float  # the largest error, in declared quantization steps
    worst: str | None  # that tensor
    tensors: int  # how many were compared
    # the largest RMS error of a tensor over round-to-nearest's at the declared width (the weight_error gate of an
    # algorithm that moves weights on purpose: HQQ, k-quant, GPTQ); files before it was measured have none
    rms_ratio: float | None = None
    rms_worst: str | None = None  # that tensor


# the fields of Figures that hold a record, and how each is read
_FIGURE_RECORDS = {
    "logits": DiffStats,
    "present": DiffStats,
    "kl": KlStats,
    "relative_error": MeanMax,
    "tokens_before_divergence": Divergence,
    "weights": WeightRounding,
}
_FIGURE_KINDS = {
    "tokens_before_divergence": {"min": int},
    "weights": {"worst": str, "tensors": int, "rms_worst": str},
}
_INT_FIGURES = {
    "positions_compared",
    "nonfinite",
    "cases",
    "tokens_equal_cases",
    "batch",
    "prompt_length",
    "decode_steps",
    "tokens",
}


@dataclass(frozen=True)
class Figures:
    """What a check measured, typed. Each check measures its own subset; the rest are None and not written.

    - randomized cases (parity; export's and optimize's reduced-precision checks): logits, present, agreements,
      kl, relative_error, positions_compared, nonfinite, cases, tokens_equal_cases, tokens_before_divergence;
      ``prompts`` (parity) and ``weights`` (a quantized file judged by itself) where they apply;
    - one fixed left-padded batch (fp32 export and optimize): logits and present max, batch, prompt_length,
      decode_steps;
    - quality on real text (eval's gates): ppl, delta_ppl_percent, kl, same_top1, rms_dp, tokens;
    - the K/V path (parity): logits max, agreements, kl, positions_compared, nonfinite.
    """

    logits: DiffStats | None = None  # |Δlogits| on real positions
    present: DiffStats | None = None  # |Δpresent|; None where the runtime exposes no presents
    top1_agreement: float | None = None
    top5_agreement: float | None = None  # share of positions where the reference's top-1 is in our top-5
    kl: KlStats | None = None
    relative_error: MeanMax | None = None  # ‖Δlogits‖ / ‖logits − mean‖ per position
    positions_compared: int | None = None
    nonfinite: int | None = None  # NaN/Inf values (eval: tokens with NaN/Inf figures)
    cases: int | None = None
    tokens_equal_cases: int | None = None
    tokens_before_divergence: Divergence | None = None
    weights: WeightRounding | None = None
    prompts: str | None = None  # "random token ids" or the text the cases were cut from
    # how far the reference's next-token distributions are from uniform (ln V − entropy, nats): near 0 on random
    # weights, where KL and top-k agreement measure nothing (verify.gates.FLAT_NATS)
    reference_information: float | None = None
    batch: int | None = None
    prompt_length: int | None = None
    decode_steps: int | None = None
    ppl: float | None = None
    delta_ppl_percent: float | None = None
    same_top1: float | None = None
    rms_dp: float | None = None
    tokens: int | None = None
    # figures this version does not know (a later release's), kept as read and written back
    extra: dict[str, Any] = field(default_factory=dict)
    # the order the keys were read in, so a record read back writes back byte-equal; new ones use field order
    key_order: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def as_dict(self) -> dict:
        known = {
            name: _compact(value) if name in _FIGURE_RECORDS else value
            for name, value in ((f, getattr(self, f)) for f in _FIGURE_FIELDS)
            if value is not None
        }
        known.update(self.extra)
        ordered = {k: known[k] for k in self.key_order if k in known}
        return {**ordered, **{k: v for k, v in known.items() if k not in ordered}}

    @classmethod
    def from_dict(cls, data: dict) -> "Figures":
        """Figures read back from a manifest or a report; ValueError/TypeError where a known one is damaged."""
        if not isinstance(data, dict):
            raise TypeError(f"not a record of figures: {data!r}")
        fields, extra = {}, {}
        for name, value in data.items():
            if name in _FIGURE_RECORDS:
                fields[name] = _read(_FIGURE_RECORDS[name], value, _FIGURE_KINDS.get(name))
            elif name == "prompts":
                if not isinstance(value, str):
                    raise TypeError(f"prompts: not a text: {value!r}")
                fields[name] = value
            elif name in _FIGURE_FIELDS:
                fields[name] = _number(value, int if name in _INT_FIGURES else float)
            else:
                extra[name] = value
        return cls(**fields, extra=extra, key_order=tuple(data))


_FIGURE_FIELDS = tuple(f for f in Figures.__dataclass_fields__ if f not in ("extra", "key_order"))


@dataclass
class KvPathCheck:
    """One consistency check of a model against itself along the K/V path (:mod:`gpt2onnx.verify.kv_path`)."""

    name: str  # past, batch or chunks
    description: str
    measured: Figures  # logits max, top1/top5 agreement, kl mean and max, positions_compared, nonfinite
    gates: dict[str, Any]
    failures: list[str] = field(default_factory=list)

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


@dataclass
class KvPathReport:
    """The three K/V-path checks of one precision, or why they were not run (a runtime with its own loop)."""

    checks: list[KvPathCheck] = field(default_factory=list)
    skipped: str | None = None

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

    def as_dict(self) -> dict:
        return {
            "skipped": self.skipped,
            "checks": [{**asdict(c), "measured": c.measured.as_dict(), "passed": c.passed} for c in self.checks],
        }

    @classmethod
    def from_dict(cls, data) -> "KvPathReport | None":
        if data is None:
            return None
        if not isinstance(data, dict):
            raise TypeError(f"not a K/V path record: {data!r}")
        fields = KvPathCheck.__dataclass_fields__
        checks = [
            KvPathCheck(
                **{k: c[k] for k in fields if k in c and k != "measured"}, measured=Figures.from_dict(c["measured"])
            )
            for c in data.get("checks") or []
        ]
        return cls(checks=checks, skipped=data.get("skipped"))


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
    def from_dict(cls, data: dict) -> "ParityCase":
        case = data["case"]
        return cls(
            case["batch"],
            case["prefix_length"],
            case["prompt_length"],
            case["decode_steps"],
            DiffStats.from_dict(data["logits"]),
            DiffStats.from_dict(data.get("present")),
            data["top1_agreement"],
            bool(data["tokens_equal"]),
        )


@dataclass(frozen=True)
class Placement:
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

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data) -> "Placement | None":
        if not isinstance(data, dict) or not isinstance(data.get("nodes"), dict):
            return None
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


# How a nested check's failures read among its report's (and how a report read back tells them from its own)
FP16_EMULATED = "fp16 arithmetic as on a GPU: "
ROUNDED = "the file against its own rounded weights: "
KV_PATH = "K/V path ("


@dataclass(frozen=True)
class CheckReport:
    """A check's verdict, frozen: its own gates' failures (computed from the gates and the figures by the check
    that built it, gpt2onnx.verify.gates.apply_gates) and those of the checks nested in it (fp16 emulated, the
    file against its own rounded weights, the K/V path), read from them: :attr:`failures`. A later step makes a
    new report (dataclasses.replace), never changes one."""

    precision: str  # the gate family: a precision's name (gpt2onnx.precisions), or tf32
    against: str  # what the model was compared with: "PyTorch" (GPT2LMHeadModel) or "source ONNX model"
    gates: dict[str, Any]  # name → threshold (logits, present, top1, top5, kl_mean, tokens_equal)
    measured: Figures
    gate_failures: tuple[str, ...] = ()  # its own gates' failures, in the gate table's order
    provider: str = "cpu"
    runtime: str = "onnxruntime"
    cases: list[dict] = field(default_factory=list)  # per case, where the check kept them (parity)
    fp16_emulated: "CheckReport | None" = None  # fp16: the same gates with fp16 arithmetic as a GPU does it
    kv_path: KvPathReport | None = None  # parity: the model against itself along the K/V path
    # int8/int4: the file judged by itself (verify.rounding): its weights against the declared rounding of the
    # source's, its logits against the reference run with its own rounded weights
    rounded: "CheckReport | None" = None
    quality_gates: str | None = None  # int8/int4: whether the quality gates (KL, top-k) were applied, and why
    machine: MachineRecord | None = None  # where it ran: the CPU's model and features, the GPU
    placement: Placement | None = None  # where the checked session's nodes ran (onnxruntime)

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
        return [ParityCase.from_dict(record) for record in self.cases]

    def as_dict(self) -> dict:
        # written as every release wrote it: all the failures after the figures (read back, the nested checks'
        # are told apart by their prefixes)
        fields = asdict(self)
        data = {}
        for key, value in fields.items():
            if key == "gate_failures":
                data["failures"] = self.failures
            else:
                data[key] = value
        data["measured"] = self.measured.as_dict()
        data["passed"] = self.passed
        data["fp16_emulated"] = self.fp16_emulated.as_dict() if self.fp16_emulated else None
        if self.kv_path is not None:  # parity's own checks; export and older releases never wrote the key
            data["kv_path"] = self.kv_path.as_dict()
        else:
            del data["kv_path"]
        # records added since: written where present, so earlier manifests write back unchanged
        for key, value in (("rounded", self.rounded), ("machine", self.machine)):
            if value is None:
                del data[key]
            else:
                data[key] = value.as_dict()
        if self.quality_gates is None:
            del data["quality_gates"]
        if self.placement is not None:  # written where it was recorded; earlier releases never wrote the key
            data["placement"] = self.placement.as_dict()
        else:
            del data["placement"]
        return data

    @classmethod
    def from_dict(cls, data: dict | None) -> "CheckReport | None":
        """A report read back from a manifest; None for a folder written without one (or by an older version),
        or whose figures are damaged (a hand-edited manifest: the caller keeps the record as it was)."""
        if not isinstance(data, dict) or not {"precision", "gates", "measured"} <= data.keys():
            return None
        try:
            return cls._from_dict(data)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    @classmethod
    def _from_dict(cls, data: dict) -> "CheckReport":
        """Raises where a part is damaged, nested reports included, so that nothing is dropped on a rewrite."""

        def nested_report(value) -> "CheckReport | None":
            return None if value is None else cls._from_dict(value)

        nested = ("measured", "fp16_emulated", "kv_path", "rounded", "machine", "placement", "gate_failures")
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data and k not in nested}
        own = [f for f in data.get("failures", []) if not str(f).startswith((FP16_EMULATED, ROUNDED, KV_PATH))]
        kv_path = KvPathReport.from_dict(data.get("kv_path"))
        machine = MachineRecord.from_dict(data["machine"]) if isinstance(data.get("machine"), dict) else None
        return cls(
            **{"against": "?", **known},
            gate_failures=tuple(own),
            measured=Figures.from_dict(data["measured"]),
            fp16_emulated=nested_report(data.get("fp16_emulated")),
            kv_path=kv_path,
            rounded=nested_report(data.get("rounded")),
            machine=machine,
            placement=Placement.from_dict(data.get("placement")),
        )


# -- quality on real text (gpt2onnx eval; export's and optimize's --eval-text) ------------------------------
@dataclass(frozen=True)
class GreedyComparison:
    """Greedy continuation of the text's first tokens, against the reference's."""

    prompt_tokens: int
    new_tokens: int  # compared (genai may stop earlier, at end-of-sequence)
    matching_tokens: int
    first_divergence: int | None  # None: all new_tokens equal

    @classmethod
    def from_dict(cls, data: dict) -> "GreedyComparison | None":
        if not data:
            return None
        return cls(data["prompt_tokens"], data["new_tokens"], data["matching_tokens"], data["first_divergence"])


@dataclass(frozen=True)
class EvalProtocol:
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
    greedy_prompt_tokens: int
    greedy_new_tokens: int
    gates: dict
    machine: MachineRecord | None = None  # where the folders ran: the CPU (model, features), the GPU

    @property
    def source(self) -> str:
        """The text's file, or dataset:config:split."""
        named = (self.text.get(k) for k in ("dataset", "config", "split"))
        return self.text.get("file") or ":".join(filter(None, named))

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "context": self.context,
            "stride": self.stride,
            "tokens": self.tokens,
            "scored_tokens": self.scored_tokens,
            "windows": self.windows,
            "text": self.text,
            "tokenizer": self.tokenizer,
            "reference": self.reference,
            "ppl_stderr": "PPL × standard error of the mean NLL, tokens taken as independent",
            "kl": "KL(reference ‖ folder) of the next-token distributions; p99 from a log-spaced histogram (2.3 %)",
            "greedy": {"prompt_tokens": self.greedy_prompt_tokens, "new_tokens": self.greedy_new_tokens},
            "gates": self.gates,
            **({"machine": self.machine.as_dict()} if self.machine else {}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "EvalProtocol":
        machine = data.get("machine")
        return cls(
            **{k: data[k] for k in ("method", "context", "stride", "tokens", "scored_tokens", "windows", "text")},
            tokenizer=data["tokenizer"],
            reference=data["reference"],
            greedy_prompt_tokens=data["greedy"]["prompt_tokens"],
            greedy_new_tokens=data["greedy"]["new_tokens"],
            gates=data["gates"],
            machine=MachineRecord.from_dict(machine) if isinstance(machine, dict) else None,
        )


@dataclass
class EvalRow:
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
    kl: KlStats | None = None  # KL(reference ‖ this) per token (None on the reference's own row)
    same_top1: float | None = None  # share of scored tokens with the reference's top-1 token
    rms_dp: float | None = None  # RMS of p(correct token) − p_ref(correct token)
    mean_dp: float | None = None
    nonfinite: int = 0  # positions with a NaN or Inf figure
    greedy: GreedyComparison | None = None  # None: not compared
    token_by_token: bool = False  # a --logits last graph, run one token per step
    seconds: float = 0.0  # time spent computing this model's logits
    check: CheckReport | None = None  # the gates, when given

    def as_dict(self) -> dict:
        data = asdict(self)
        data["kl"], data["greedy"] = data["kl"] or {}, data["greedy"] or {}  # the JSON of earlier releases
        data["check"] = self.check.as_dict() if self.check else None
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "EvalRow":
        plain = {f: data[f] for f in cls.__dataclass_fields__ if f not in ("kl", "greedy", "check")}
        return cls(
            **plain,
            kl=KlStats.from_dict(data["kl"]),
            greedy=GreedyComparison.from_dict(data["greedy"]),
            check=CheckReport.from_dict(data["check"]),
        )


@dataclass
class EvalReport:
    """What :func:`evaluate` returns: the protocol, the reference's perplexity, one row per folder."""

    protocol: EvalProtocol
    reference: EvalRow
    rows: list[EvalRow]

    @property
    def failures(self) -> list[str]:
        return [f for row in self.rows if row.check for f in row.check.failures]

    @property
    def passed(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict:
        return {
            "protocol": self.protocol.as_dict(),
            "reference": self.reference.as_dict(),
            "rows": [r.as_dict() for r in self.rows],
            "failures": self.failures,
            "passed": self.passed,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "EvalReport":
        """A report read back from a manifest (export's and optimize's --eval-text)."""
        return cls(
            EvalProtocol.from_dict(data["protocol"]),
            EvalRow.from_dict(data["reference"]),
            [EvalRow.from_dict(row) for row in data["rows"]],
        )

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
