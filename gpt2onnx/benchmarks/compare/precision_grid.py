"""What each precision costs (`gpt2onnx bench precision`): every variant of one checkpoint built, scored on real
text against PyTorch fp32, held to the export gates' statistics, and timed in the harness's rotating rounds.

requires: a checkpoint (a folder or Hub id, or an architecture with seeded random weights, ``outliers`` too), a
text, and ``work`` to build in (kept; a variant built before is reused). ensures, per variant:

- quality: eval's statistics (:func:`gpt2onnx.verify.evaluate.evaluate`) on the text's first ``max_chars``
  characters, every folder in one pass against PyTorch fp32: perplexity, ΔPPL %, mean and p99 KL, same top-1 %,
  and the first new token where greedy continuation of the text's first tokens diverges;
- the export gates' own figures (gpt2onnx parity: randomized token ids against PyTorch), gates open: mean KL,
  top-1 and top-5;
- the model files' size;
- speed on onnxruntime's cpu provider (``threads``): the decode step at batch 1 with ``past`` tokens of cache and
  the prompt step at batch 1 × ``prompt_len`` (all positions' logits), every variant once a round in rotating
  order, medians with quartiles and each variant's ratio to fp32-ort taken round by round.

fp32 is exported from the checkpoint (validated against PyTorch); every other variant is optimized from fp32-ort
(the recommended CPU profile) or, for a fusion profile alone, from fp32, with the gates wide open: a variant that
would fail them is measured all the same (the figures say whether it should). One that its own file check refuses
is left out, with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from gpt2onnx.artifact.folder import MANIFEST_NAME
from gpt2onnx.artifact.paths import check_output_files, check_output_path
from gpt2onnx.artifact.report import EvalReport
from gpt2onnx.benchmarks.harness import Rounds, check_runs, csv_of, interleave, write_outputs
from gpt2onnx.errors import BadInput, CheckFailed, RuntimeUnavailable
from gpt2onnx.files import write_text_atomic
from gpt2onnx.machine import CpuRecord
from gpt2onnx.precisions.all_precisions import FP16, FP32, INT4, INT8, INT8_WEIGHTS, NO_QUANTIZATION
from gpt2onnx.profiles import portable
from gpt2onnx.profiles.all_profiles import OPTIMIZE_DEFAULT, UNFUSED
from gpt2onnx.records import Record, computed, field, from_json

log = logging.getLogger(__name__)

SOURCE_RECORD = "grid-source.json"  # what the folders under --work were built from

# the precisions and profiles by their registries' names (the grid's rows spell recipes of them)
F32, F16 = FP32.short, FP16.short
I8, I4, I8W = INT8.method, INT4.method, INT8_WEIGHTS.method
ORT, PORTABLE, NONE = OPTIMIZE_DEFAULT.name, portable.PROFILE.name, UNFUSED.name
BASELINE = f"{F32}-{ORT}"  # the ratios' baseline, and the source of every reduced precision


@dataclass(frozen=True)
class PrecisionVariant:
    """One row of the grid: a fusion profile, a dtype, or a quantization with its options (None: the recipe's)."""

    name: str
    fusion: str = ORT
    dtype: str = F32
    quantize: str = NO_QUANTIZATION
    block_size: int | None = None
    accuracy_level: int | None = None
    lm_head: str | None = None
    embeddings: str | None = None
    algorithm: str | None = None
    mixed_int8: float | None = None
    prompt_kernel: str | None = None

    def quantization(self, calibration: str | None = None):
        from gpt2onnx.precisions.quantize_options import QuantizeOptions

        options = QuantizeOptions(
            self.quantize,
            self.block_size,
            self.accuracy_level,
            self.lm_head,
            self.embeddings,
            algorithm=self.algorithm,
            mixed_int8=self.mixed_int8,
            prompt_kernel=self.prompt_kernel,
        )
        if calibration is not None and options.needs_calibration:
            options = dataclasses.replace(options, calibration_text=calibration)
        return options

    def recipe(self) -> str:
        """The variant in words, its recipe filled in."""
        if self.quantize == NO_QUANTIZATION:
            return f"{self.dtype}, fusion {self.fusion}"
        q = self.quantization().recipe
        text = q.method + (f" bs{q.block_size}" if q.method == I4 or q.embeddings == I8 else "")
        text += f" acc{q.accuracy_level}" if q.accuracy_level is not None else ""
        text += f" {q.algorithm}" if q.algorithm not in (None, "rtn") else ""
        text += f", {q.mixed_int8:g} % measured 8-bit" if q.mixed_int8 is not None else ""
        text += f", prompt on {q.prompt_kernel}" if q.prompt_kernel not in (None, "nbits") else ""
        return text + f", lm_head {q.lm_head}, emb {q.embeddings}"


V = PrecisionVariant
GRID = (
    V(F32, fusion=NONE),
    V(f"{F32}-{ORT}"),
    V(f"{F32}-{PORTABLE}", fusion=PORTABLE),
    V(F16, dtype=F16),
    V(I8, quantize=I8),
    V(f"{I8}-head32", quantize=I8, lm_head=F32, embeddings=F32),
    V(f"{I8}-emb32", quantize=I8, embeddings=F32),
    V(I8W, quantize=I8W),
    V(I4, quantize=I4),
    V(f"{I4}-prompt-{I8}", quantize=I4, prompt_kernel=I8),
    V(f"{I4}-bs32", quantize=I4, block_size=32, lm_head=I4, embeddings=I4),
    V(f"{I4}-bs64", quantize=I4, block_size=64, lm_head=I4, embeddings=I4),
    V(f"{I4}-bs128", quantize=I4, block_size=128, lm_head=I4, embeddings=I4),
    V(f"{I4}-acc0", quantize=I4, accuracy_level=0),
    V(f"{I4}-bs32-acc0", quantize=I4, block_size=32, lm_head=I4, embeddings=I4, accuracy_level=0),
    V(f"{I4}-head32", quantize=I4, lm_head=F32),
    V(f"{I4}-emb32", quantize=I4, embeddings=F32),
    # int4 in blocks of 32 with each choice of head and embeddings (the recipe before issue 34)
    V(f"{I4}-bs32-head8", quantize=I4, block_size=32, lm_head=I8, embeddings=I4),
    V(f"{I4}-bs32-emb8", quantize=I4, block_size=32, lm_head=I4, embeddings=I8),
    V(f"{I4}-bs32-head8-emb8", quantize=I4, block_size=32, lm_head=I8, embeddings=I8),
    V(f"{I4}-bs32-head8-acc0", quantize=I4, block_size=32, lm_head=I8, embeddings=I4, accuracy_level=0),
    V(f"{I4}-bs128-head8", quantize=I4, block_size=128, lm_head=I8, embeddings=I4),
    V(f"{I4}-hqq", quantize=I4, algorithm="hqq"),
    V(f"{I4}-kquant", quantize=I4, algorithm="k-quant"),
    V(f"{I4}-gptq", quantize=I4, algorithm="gptq"),
    V(f"{I4}-mixed10", quantize=I4, mixed_int8=10),
    V(f"{I4}-mixed25", quantize=I4, mixed_int8=25),
    V(f"{I4}-kquant-mixed10", quantize=I4, algorithm="k-quant", mixed_int8=10),
    V(f"{I4}-gptq-mixed10", quantize=I4, algorithm="gptq", mixed_int8=10),
)
DEFAULT = tuple(v.name for v in GRID if v.name in (F32, f"{F32}-{ORT}", F16, I8, I8W, I4)) + tuple(
    f"{I4}-{row}" for row in ("bs32", "acc0", "hqq", "kquant", "gptq", "mixed10")
)
BY_NAME = {v.name: v for v in GRID}
# gates wide open while building: the table measures each variant (a figure says whether it should pass)
OPEN_GATES = {"kl_mean": 1e9, "top1": 1e-9, "top5": 1e-9}


def _calibration_source(calibration: str | None) -> dict | None:
    """The calibration text in the work folder's record: its name and, for a file, its bytes' sha256."""
    from gpt2onnx.files import sha256_file

    if calibration is None:
        return None
    path = Path(calibration)
    return {"sha256": sha256_file(path)} if path.is_file() else {"name": calibration}


def variants_of(only: list[str] | None) -> tuple[PrecisionVariant, ...]:
    """The grid rows named (default: DEFAULT; "all": every row), fp32 always first: the others are made from it."""
    names = DEFAULT if not only else tuple(n for item in only for n in item.split(",") if n)
    if names == ("all",):
        names = tuple(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise BadInput(f"--only '{unknown[0]}' is not a variant of the grid: choose from all, {', '.join(BY_NAME)}")
    return tuple(BY_NAME[n] for n in dict.fromkeys((F32, *names)))


def build(
    model: str,
    work: Path,
    variants,
    *,
    random_init: bool,
    seed: int,
    outliers: float,
    calibration: str | None,
    progress,
) -> tuple[dict[str, Path], dict[str, str]]:
    """fp32 exported from the checkpoint, every other variant optimized from fp32-ort (a precision) or fp32 (a
    profile); a folder built before is reused. Returns the folders and the variants their own check refused."""
    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.exporters.optimize import optimize

    folders, refused = {}, {}
    say = progress or (lambda what, done, total: None)
    base = work / F32
    say(f"building {F32}", 0, len(variants))
    if not (base / MANIFEST_NAME).is_file():
        export(model, base, random_init=random_init, seed=seed, outliers=outliers, options=ExportOptions(force=True))
    folders[F32] = base
    ordered = sorted(variants[1:], key=lambda v: v.name != BASELINE)  # fp32-ort before what is made from it
    for done, variant in enumerate(ordered, start=1):
        out = work / variant.name
        say(f"building {variant.name}", done, len(variants))
        if not (out / MANIFEST_NAME).is_file():
            reduced = variant.quantize != NO_QUANTIZATION or variant.dtype != F32
            if reduced and BASELINE not in folders:
                optimize(base, work / BASELINE, fusion=ORT, force=True)
                folders[BASELINE] = work / BASELINE
            source = folders[BASELINE] if reduced else base
            try:
                optimize(
                    source,
                    out,
                    fusion=NONE if reduced else variant.fusion,
                    dtype=variant.dtype,
                    quantization=variant.quantization(calibration),
                    gates=OPEN_GATES if reduced else None,
                    force=True,
                )
            except CheckFailed as failure:
                refused[variant.name] = str(failure)
                log.warning("%s refused by its own check, left out: %s", variant.name, failure)
                continue
        folders[variant.name] = out
    say("built", len(variants), len(variants))
    return folders, refused


@dataclass(frozen=True)
class GridSettings(Record):
    """What bench precision was asked to do (its --json's "settings")."""

    text: str
    chars: int  # of the text, scored
    threads: int | None
    past: int
    prompt_len: int
    gate_cases: int
    calibration: str | None
    random_init: bool
    seed: int
    outliers: float
    cpus: tuple[str, ...]
    cpu_tokens: int


@dataclass(frozen=True)
class GateFigures(Record):
    """A variant's gate statistics on randomized ids (parity's, the gates opened)."""

    kl_mean: float
    top1: float
    top5: float


@dataclass(frozen=True)
class CpuFigures(Record):
    """A variant on this CPU against another: mean KL(this ‖ that), the share with the same top-1, greedy equal."""

    kl_mean: float
    same_top1: float
    greedy_equal: bool


def _in_rows():
    """A figure written only in the summary rows (--json has never had its own key for it)."""
    return field(omit=lambda report: True)


@dataclass(frozen=True)
class PrecisionReport(Record):
    """What bench precision measured; its --json is written, never read back (recipes, sizes and gate figures
    are in its summary rows only)."""

    model: str
    settings: GridSettings
    recipes: dict[str, str] = _in_rows()  # name → the recipe in words
    sizes: dict[str, int] = _in_rows()  # name → model file bytes
    quality: EvalReport = field(key="eval")  # one row per variant, in order
    gates: dict[str, GateFigures] = _in_rows()  # name → the gate statistics on randomized ids
    rounds: Rounds  # decode_ms, prompt_ms
    refused: dict[str, str]  # name → why its own check refused it
    # name → emulated CPU → KL, top-1, greedy equal
    portability: dict[str, dict[str, CpuFigures]] = field(default_factory=dict)
    cpus_seen: dict[str, CpuRecord] = field(default_factory=dict, key="cpus")  # each CPU as its process saw itself

    json_computed = (computed("summary", "rows", after="settings"),)

    def rows(self) -> list[dict]:
        """A row per variant (--csv, and --json's "summary"): its recipe, quality, size, speed and gate figures."""
        rows = []
        for name, q in zip(self.recipes, self.quality.rows):
            row = {
                "variant": name,
                "recipe": self.recipes[name],
                "ppl": q.ppl,
                "delta_ppl_percent": q.delta_ppl_percent,
                "kl_mean": q.kl.mean,
                "kl_p99": q.kl.p99,
                "same_top1": q.same_top1,
                "greedy_diverges_at": q.greedy.first_divergence if q.greedy else None,
                "file_mb": self.sizes[name] / 1e6,
            }
            for figure in self.rounds.figures:
                row[figure] = self.rounds.spread(name, figure).median
                ratio = self.rounds.ratio(name, figure)
                row[f"{figure}_ratio"] = ratio.median if ratio is not None else None
            row.update({f"gate_{k}": v for k, v in self.gates[name].as_dict().items()})
            for cpu, figures in self.portability.get(name, {}).items():
                row.update({f"{cpu}_{k}": v for k, v in figures.as_dict().items()})
            rows.append(row)
        return rows

    def csv(self) -> str:
        return csv_of(self.rows())

    def markdown(self) -> str:
        s, p = self.settings, self.quality.protocol
        head = [
            "variant",
            "recipe",
            "PPL",
            "ΔPPL %",
            "mean KL",
            "p99 KL",
            "same top-1",
            "greedy diverges at",
            "file MB",
            f"decode b1 @{s.past} ms",
            f"prompt b1×{s.prompt_len} ms",
            "gate KL (random ids)",
            "gate top-5",
        ]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        ref = self.quality.reference
        lines.append(f"| PyTorch fp32 | reference | {ref.ppl:.3f} |" + " – |" * (len(head) - 3))
        for row in self.rows():
            g = next(q.greedy for n, q in zip(self.recipes, self.quality.rows) if n == row["variant"])
            diverges = "–" if g is None else "never" if g.first_divergence is None else str(g.first_divergence)
            timing = []
            for figure in ("decode_ms", "prompt_ms"):
                spread = self.rounds.spread(row["variant"], figure)
                ratio = row[f"{figure}_ratio"]
                extra = f", ×{ratio:.2f}" if ratio is not None and row["variant"] != self.rounds.baseline else ""
                timing.append(spread.shown() + extra)
            lines.append(
                "| "
                + " | ".join(
                    [
                        row["variant"],
                        row["recipe"],
                        f"{row['ppl']:.3f}",
                        f"{row['delta_ppl_percent']:+.2f}",
                        f"{row['kl_mean']:.2e}",
                        f"{row['kl_p99']:.2e}",
                        f"{100 * row['same_top1']:.2f} %",
                        diverges,
                        f"{row['file_mb']:.1f}",
                        *timing,
                        f"{row['gate_kl_mean']:.2e}",
                        f"{100 * row['gate_top5']:.1f} %",
                    ]
                )
                + " |"
            )
        lines.append("")
        lines.append(
            f"Quality: the first {s.chars:,} characters of {s.text}, {p.scored_tokens} scored tokens in windows"
            f" of {p.context} (stride {p.stride}) against PyTorch fp32; greedy: {p.greedy_new_tokens} new tokens from"
            f" the text's first {p.greedy_prompt_tokens}. Gate figures: {s.gate_cases} randomized cases. Calibration"
            f" (gptq, mixed): {s.calibration or 'gpt2onnx default (the standard library docstrings)'}."
        )
        lines.append(f"Speed: onnxruntime cpu, {s.threads} threads; " + self.rounds.markdown().splitlines()[-1])
        lines += [f"{name}: refused by its own check, not measured: {why}" for name, why in self.refused.items()]
        if self.portability:
            lines += ["", self._portability_markdown()]
        return "\n".join(lines) + "\n"

    def _portability_markdown(self) -> str:
        cpus = list(next(iter(self.portability.values())))
        head = ["variant", *(f"{label} {cpu}" for cpu in cpus for label in ("KL this‖", "top-1 =", "greedy ="))]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, by_cpu in self.portability.items():
            cells = [name]
            for cpu in cpus:
                f = by_cpu[cpu]
                cells += [f"{f.kl_mean:.1e}", f"{100 * f.same_top1:.2f} %", "yes" if f.greedy_equal else "**no**"]
            lines.append("| " + " | ".join(cells) + " |")
        seen = "; ".join(f"{label}: {cpu.model} (int8: {cpu.int8_path})" for label, cpu in self.cpus_seen.items())
        lines += ["", f"The same windows and greedy tokens on each CPU, one thread, emulated by QEMU: {seen}."]
        return "\n".join(lines)


def time_steps(
    decoders: dict,
    *,
    past: int,
    prompt_len: int,
    repeat: int,
    warmup: int,
    baseline: str | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> Rounds:
    """Each opened decoder's decode step at batch 1 with ``past`` tokens of cache and its prompt step at batch 1 ×
    ``prompt_len`` (all positions' logits, from an empty past), in the harness's rotating rounds (figures
    ``decode_ms``, ``prompt_ms``), each run after the harness's pause (30 sessions open: the last one's threads
    spinning would take the cores from the next)."""
    from gpt2onnx.benchmarks.timing import decode_step_at_past

    def timed(decoder) -> Callable[[], dict]:
        calls = iter(range(1 << 30))

        def run() -> dict:
            seed = next(calls)
            vocab = decoder.vocab_size
            decode_s = decode_step_at_past(decoder, 1, past, vocab_size=vocab, seed=seed)
            ids = np.random.default_rng(seed).integers(0, vocab, size=(1, prompt_len), dtype=np.int64)
            mask = np.ones((1, prompt_len), np.int64)
            start = time.perf_counter()
            decoder.run(
                ids, decoder.prompt_mask(mask), np.arange(prompt_len)[None], decoder.empty_past(1, prompt_len + 1)
            )
            return {"decode_ms": 1e3 * decode_s, "prompt_ms": 1e3 * (time.perf_counter() - start)}

        return run

    total = len(decoders) * (warmup + repeat)
    runs = iter(range(1, total + 1))
    return interleave(
        {n: timed(d) for n, d in decoders.items()},
        rounds=repeat,
        warmup=warmup,
        baseline=baseline,
        on_run=(lambda: progress("timing", next(runs), total)) if progress else None,
    )


CPU_CONTEXT, CPU_NEW_TOKENS = 128, 16


def portability(folders: dict[str, Path], ids: np.ndarray, cpus: tuple[str, ...], work: Path) -> tuple[dict, dict]:
    """Every folder on this CPU and on each of ``cpus`` emulated by QEMU's user-mode emulator (its kernels chosen
    for that CPU's features), in parallel: sliding windows over ``ids`` and greedy tokens from two prompts
    (:mod:`gpt2onnx.verify.cpu_worker`, one thread). Returns, per folder and CPU, mean KL(this CPU ‖ that CPU), the
    share of positions with the same top-1 and whether the greedy tokens are equal; and each CPU as it saw itself."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from gpt2onnx.verify.cpu_worker import emulated_env
    from gpt2onnx.verify.metrics import kl_divergence

    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        raise RuntimeUnavailable("--cpus runs the folders under QEMU: install qemu-user (apt-get install qemu-user)")
    context = min(CPU_CONTEXT, len(ids))
    np.save(work / "cpu-ids.npy", ids)
    (work / "cpu-prompts.json").write_text(json.dumps([ids[:32].tolist(), ids[len(ids) // 2 :][:16].tolist()]))
    args = ["-m", "gpt2onnx.verify.cpu_worker", *map(str, folders.values()), "--ids", str(work / "cpu-ids.npy")]
    args += ["--prompts", str(work / "cpu-prompts.json"), "--context", str(context), "--stride", str(context // 2)]
    args += ["--new-tokens", str(CPU_NEW_TOKENS)]
    commands = {"this CPU": [sys.executable, *args, "--out", str(work / "cpu-host.npz")]}
    for cpu in cpus:
        commands[cpu] = [qemu, "-cpu", cpu, sys.executable, *args, "--out", str(work / f"cpu-{cpu}.npz")]
    env = dict(os.environ)
    running = {
        name: subprocess.Popen(
            command,
            env=emulated_env(env, name) if name in cpus else env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, command in commands.items()
    }
    results = {}
    for name, process in running.items():
        _, stderr = process.communicate()
        if process.returncode != 0:
            lines = stderr.strip().splitlines()
            why = lines[-1] if lines else f"exit {process.returncode}"
            raise RuntimeUnavailable(f"the folders could not run on {name} (qemu-x86_64 -cpu {name}): {why}")
        out = "cpu-host.npz" if name == "this CPU" else f"cpu-{name}.npz"
        results[name] = dict(np.load(work / out))
    host = results.pop("this CPU")
    seen = {name: from_json(CpuRecord, json.loads(str(r["cpu"]))) for name, r in {"this CPU": host, **results}.items()}
    figures = {}
    for index, name in enumerate(folders):
        ours = host[f"logits_{index}"]
        figures[name] = {
            cpu: CpuFigures(
                kl_mean=float(kl_divergence(ours, other[f"logits_{index}"]).mean()),
                same_top1=float((ours.argmax(-1) == other[f"logits_{index}"].argmax(-1)).mean()),
                greedy_equal=bool(np.array_equal(host[f"tokens_{index}"], other[f"tokens_{index}"])),
            )
            for cpu, other in results.items()
        }
    return figures, seen


SCORED = "scored.txt"  # the text's first max_chars characters, as scored, in --work


def _check_not_written(work: Path, texts: tuple[Path, ...]) -> None:
    """Before any work: no text read (--text, --calibration) is a file the grid writes in ``work`` (the scored
    text, its record, the emulated CPUs' files, a variant's folder), by its path or as a hard link of one."""
    ours = {SCORED, SOURCE_RECORD, *(v.name for v in GRID)}
    for text in texts:
        try:
            real, root = text.resolve(), work.resolve()
            seen = os.stat(text)
        except (OSError, RuntimeError):
            continue  # read later, and refused there in one line
        parts = real.relative_to(root).parts if real.is_relative_to(root) else ()
        written = work / parts[0] if parts and (parts[0] in ours or parts[0].startswith("cpu-")) else None
        for name in ours if written is None else ():  # a hard link of a file the grid replaces
            with contextlib.suppress(OSError):
                if os.path.samestat(seen, os.stat(work / name)):
                    written = work / name
        if written is not None:
            raise BadInput(
                f"the text '{text}' is read, but bench precision writes '{written}' (--work '{work}'): move the text"
                " out of --work, or choose another --work"
            )


def bench_precision(
    model: str,
    *,
    text: str | Path,
    work: str | Path = "models/precision",
    only: list[str] | None = None,
    random_init: bool = False,
    seed: int = 0,
    outliers: float = 0.0,
    max_chars: int = 60_000,
    calibration: str | None = None,
    threads: int | None = 2,
    past: int = 128,
    prompt_len: int = 128,
    warmup: int = 3,
    repeat: int = 20,
    gate_cases: int = 10,
    greedy_tokens: int = 64,
    cpus: tuple[str, ...] = (),
    cpu_tokens: int = 512,
    json_path=None,
    markdown_path=None,
    csv_path=None,
    rebuild: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
    before_writing: Callable[[], None] | None = None,
) -> PrecisionReport:
    """Build, score, hold to the gates and time every variant named (the module's docstring says how). ``work``
    is claimed as compare's is (:mod:`gpt2onnx.benchmarks.compare.work_folder`; ``rebuild``); ``progress`` is
    called with (what, done, total) as each build, stage and timed run goes."""
    from gpt2onnx.artifact.folder import open_folder
    from gpt2onnx.benchmarks.compare.work_folder import build_source, claim_work
    from gpt2onnx.precisions.all_precisions import precision_of
    from gpt2onnx.pytorch.checkpoint import load_checkpoint
    from gpt2onnx.runtimes.all_runtimes import RuntimeOptions
    from gpt2onnx.runtimes.decoder import open_decoder
    from gpt2onnx.runtimes.providers import ProviderConfig
    from gpt2onnx.verify.evaluate import check_greedy_tokens, evaluate
    from gpt2onnx.verify.parity import parity

    inputs = (Path(model),) if Path(model).exists() else ()
    texts = tuple(Path(t) for t in (text, calibration) if t is not None)  # read, never written
    check_output_files({"--json": json_path, "--md": markdown_path, "--csv": csv_path}, inputs=inputs, files=texts)
    check_output_path(work, option="--work", kind="folder", folders=inputs, replaced=False)  # written into, kept
    variants = variants_of(only)
    _check_not_written(Path(work), texts)
    for name, value, least in (
        ("max chars (--max-chars)", max_chars, 100),
        ("past (--past)", past, 2),
        ("prompt length (--prompt-len)", prompt_len, 1),
        ("gate cases", gate_cases, 1),
        ("CPU tokens", cpu_tokens, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise BadInput(f"{name} must be an integer of at least {least}, got {value!r}")
    check_greedy_tokens(greedy_tokens)
    check_runs(warmup, repeat)
    provider = ProviderConfig(threads=threads)  # every option checked before the first file is written
    if not Path(text).is_file():
        raise BadInput(f"--text '{text}' is not a file: give a UTF-8 text file")
    for cpu in cpus:
        if not cpu or not all(c.isalnum() or c in "-_.+" for c in cpu):
            raise BadInput(f"--cpus: '{cpu}' is not a CPU model name (qemu-x86_64 -cpu help lists them)")
    content = Path(text).read_text(encoding="utf-8")
    work = Path(work)
    ckpt = load_checkpoint(model, random_init=random_init, seed=seed)
    source = build_source(ckpt, outliers=outliers, calibration=_calibration_source(calibration))
    claim_work(work, source, SOURCE_RECORD, built=tuple(v.name for v in GRID), rebuild=rebuild)
    if len(content) > max_chars:
        cut = content.rfind("\n", 0, max_chars)
        content = content[: cut if cut > 0 else max_chars]
    scored = work / SCORED
    write_text_atomic(scored, content)  # by rename; never an input (_check_not_written)
    folders, refused = build(
        model,
        work,
        variants,
        random_init=random_init,
        seed=seed,
        outliers=outliers,
        calibration=calibration,
        progress=progress,
    )
    variants = [v for v in variants if v.name in folders]
    say = progress or (lambda what, done, total: None)
    quality = evaluate(
        [folders[v.name] for v in variants],
        text=scored,
        greedy_tokens=greedy_tokens,
        runtime=RuntimeOptions(settings=provider),
        on_window=lambda done, total: say("scoring on the text (windows)", done, total),
    )
    gates = {}
    for k, v in enumerate(variants):
        say(f"gate figures of {v.name}", k, len(variants))
        precision = precision_of(open_folder(folders[v.name]).facts).name
        opened = {"logits": 1e9, "present": 1e9} if precision == "float32" else OPEN_GATES
        measured = parity(folders[v.name], cases=gate_cases, gates=opened, provider=provider).measured
        gates[v.name] = GateFigures(measured.kl.mean, measured.top1_agreement, measured.top5_agreement)
    n_positions = quality.protocol.context
    past, prompt_len = min(past, n_positions - 2), min(prompt_len, n_positions - 1)
    decoders = {v.name: open_decoder(open_folder(folders[v.name]), provider) for v in variants}
    baseline = BASELINE if BASELINE in decoders else variants[0].name
    rounds = time_steps(
        decoders, past=past, prompt_len=prompt_len, repeat=repeat, warmup=warmup, baseline=baseline, progress=progress
    )
    sizes = {
        v.name: sum(p.stat().st_size for p in folders[v.name].iterdir() if p.name.startswith("model.onnx"))
        for v in variants
    }
    moved, seen = {}, {}
    if cpus:
        say("on the emulated CPUs", 0, 1)
        from gpt2onnx.decoding.prompts import load_tokenizer

        head = content[: 16 * cpu_tokens]  # enough characters for the tokens (a whole text would only be cut)
        ids = np.asarray(load_tokenizer(folders[F32]).encode(head)[:cpu_tokens], np.int64)
        moved, seen = portability({v.name: folders[v.name] for v in variants}, ids, tuple(cpus), work)
    settings = GridSettings(
        text=str(text),
        chars=len(content),
        threads=threads,
        past=past,
        prompt_len=prompt_len,
        gate_cases=gate_cases,
        calibration=calibration,
        random_init=random_init,
        seed=seed,
        outliers=outliers,
        cpus=tuple(cpus),
        cpu_tokens=cpu_tokens,
    )
    recipes = {v.name: v.recipe() for v in variants}
    report = PrecisionReport(
        model=str(model),
        settings=settings,
        recipes=recipes,
        sizes=sizes,
        quality=quality,
        gates=gates,
        rounds=rounds,
        refused=refused,
        portability=moved,
        cpus_seen=seen,
    )
    write_outputs(report, json_path=json_path, markdown_path=markdown_path, before_writing=before_writing)
    if csv_path is not None:
        write_text_atomic(csv_path, report.csv())
    return report
