"""The record of a check: what was compared with what, the gates applied, what was measured, and the verdict.

Every check has this one shape, fp32 tolerances and reduced-precision gates alike: export validation,
optimize's check against the source graph, ``gpt2onnx parity``. It is written into the manifest and read
back by ``inspect``; :mod:`gpt2onnx.verify` produces it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gpt2onnx.machine import MachineRecord


@dataclass
class KvPathCheck:
    """One consistency check of a model against itself along the K/V path (:mod:`gpt2onnx.verify.kv_path`)."""

    name: str  # past, batch or chunks
    description: str
    measured: dict[str, Any]  # logits {max}, top1_agreement, top5_agreement, kl {mean, max}, positions_compared
    gates: dict[str, Any]
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def figures(self) -> str:
        """Its measured figures on one line."""
        m = self.measured
        return (
            f"max |Δlogits| {m['logits']['max']:.2e}, top-1 {100 * m['top1_agreement']:.1f}%,"
            f" KL mean {m['kl']['mean']:.2e} ({m['positions_compared']} positions)"
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
            f"{c.name} {c.measured['logits']['max']:.1e} (top-1 {100 * c.measured['top1_agreement']:.0f}%,"
            f" KL {c.measured['kl']['mean']:.1e})"
            for c in self.checks
        ]
        return "K/V path, max |Δlogits|: " + ", ".join(parts) + (" — pass" if not self.failures else " — FAIL")

    def as_dict(self) -> dict:
        return {"skipped": self.skipped, "checks": [{**asdict(c), "passed": c.passed} for c in self.checks]}

    @classmethod
    def from_dict(cls, data) -> "KvPathReport | None":
        if not isinstance(data, dict):
            return None
        fields = KvPathCheck.__dataclass_fields__
        checks = [KvPathCheck(**{k: c[k] for k in fields if k in c}) for c in data.get("checks") or []]
        return cls(checks=checks, skipped=data.get("skipped"))


@dataclass(frozen=True)
class Spread:
    """max / p50 / p99 of an absolute difference."""

    max: float
    p50: float | None = None
    p99: float | None = None

    @classmethod
    def from_dict(cls, data: dict | None) -> "Spread | None":
        return None if not data else cls(data["max"], data.get("p50"), data.get("p99"))


@dataclass(frozen=True)
class ParityCase:
    """One case of a parity run (a typed view of a ``CheckReport.cases`` record)."""

    batch: int
    past: int
    prompt: int
    steps: int
    logits: Spread
    present: Spread | None  # None where the runtime exposes no presents
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
            Spread.from_dict(data["logits"]),
            Spread.from_dict(data.get("present")),
            data["top1_agreement"],
            bool(data["tokens_equal"]),
        )


@dataclass(frozen=True)
class ParityTotals:
    """The figures of a parity run over all its cases (a typed view of ``CheckReport.measured``)."""

    logits: Spread
    present: Spread | None
    top1_agreement: float
    top5_agreement: float
    positions_compared: int
    kl_mean: float
    kl_max: float
    tokens_before_divergence_min: int
    tokens_before_divergence_mean: float
    nonfinite: int
    prompts: str
    tokens_equal_cases: int
    cases: int

    @classmethod
    def from_dict(cls, data: dict) -> "ParityTotals":
        before = data["tokens_before_divergence"]
        return cls(
            Spread.from_dict(data["logits"]),
            Spread.from_dict(data.get("present")),
            data["top1_agreement"],
            data["top5_agreement"],
            data["positions_compared"],
            data["kl"]["mean"],
            data["kl"]["max"],
            before["min"],
            before["mean"],
            data["nonfinite"],
            str(data.get("prompts", "random token ids")),
            data["tokens_equal_cases"],
            data["cases"],
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


@dataclass
class CheckReport:
    precision: str  # the gate family: float32, float16, int8, int4; tf32 (fp32 with TF32 matmuls)
    against: str  # what the model was compared with: "PyTorch" (GPT2LMHeadModel) or "source ONNX model"
    gates: dict[str, Any]  # name → threshold (logits, present, top1, top5, kl_mean, tokens_equal)
    measured: dict[str, Any]  # logits/present {max, p50, p99}, top1_agreement, top5_agreement, kl {mean, max}, ...
    failures: list[str] = field(default_factory=list)
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
    def passed(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        """One line: the verdict and the figures that decide it."""
        m, parts = self.measured, []
        if "logits" in m:
            parts.append(f"max |Δlogits| {m['logits']['max']:.2e}")
        if "present" in m:
            parts.append(f"max |Δpresent| {m['present']['max']:.2e}")
        if "delta_ppl_percent" in m:
            parts.append(f"ΔPPL {m['delta_ppl_percent']:+.2f} %")
        if "kl" in m and "kl_mean" in self.gates:
            parts.append(f"mean KL {m['kl']['mean']:.2e}")
        if "top5_agreement" in m and "top5" in self.gates:
            parts.append(f"top-5 {100 * m['top5_agreement']:.1f}%")
        if "top1_agreement" in m and "top1" in self.gates:
            parts.append(f"top-1 {100 * m['top1_agreement']:.1f}%")
        if "relative_error" in m and "relative_error" in self.gates:
            parts.append(f"relative logits error {100 * m['relative_error']['mean']:.2f}%")
        if "weights" in m and "weight_steps" in self.gates:
            parts.append(f"weights within {m['weights']['max_steps']:.2f} quantization steps")
        if self.fp16_emulated is not None and "kl" in self.fp16_emulated.measured:
            parts.append(f"fp16 as on a GPU: mean KL {self.fp16_emulated.measured['kl']['mean']:.2e}")
        if self.rounded is not None:
            file_check = self.rounded
            parts.append(
                f"the file against its own rounded weights: weights within"
                f" {file_check.measured['weights']['max_steps']:.2f} steps, relative logits error"
                f" {100 * file_check.measured['relative_error']['mean']:.2f}%"
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

    def parity_totals(self) -> ParityTotals:
        """The figures of a parity run, typed."""
        return ParityTotals.from_dict(self.measured)

    def as_dict(self) -> dict:
        data = asdict(self)
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
        """A report read back from a manifest; None for a folder written without one (or by an older version)."""
        if not isinstance(data, dict) or not {"precision", "gates", "measured"} <= data.keys():
            return None
        emulated = cls.from_dict(data.get("fp16_emulated"))
        nested = ("fp16_emulated", "kv_path", "rounded", "machine", "placement")
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data and k not in nested}
        kv_path = KvPathReport.from_dict(data.get("kv_path"))
        machine = MachineRecord.from_dict(data["machine"]) if isinstance(data.get("machine"), dict) else None
        return cls(
            **{"against": "?", **known},
            fp16_emulated=emulated,
            kv_path=kv_path,
            rounded=cls.from_dict(data.get("rounded")),
            machine=machine,
            placement=Placement.from_dict(data.get("placement")),
        )


# -- quality on real text (gpt2onnx eval; export's and optimize's --eval-text) ------------------------------
@dataclass(frozen=True)
class KlStats:
    """KL(reference ‖ this) of the next-token distributions, per scored token."""

    mean: float
    stderr: float
    p99: float  # from a log-spaced histogram (2.3 % resolution)
    max: float

    @classmethod
    def from_dict(cls, data: dict) -> "KlStats | None":
        return cls(**{k: float(data[k]) for k in ("mean", "stderr", "p99", "max")}) if data else None


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
