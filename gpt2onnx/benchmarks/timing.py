"""Benchmarks of an exported decoder: time to first token, decode latency and its growth with past length,
tokens per second, peak memory; optionally the same workload on PyTorch eager in the same run.

Every run is: a prompt of ``prompt_len`` random tokens per row (no padding), then ``new_tokens - 1`` decode
steps fed with greedy tokens. Figures are medians (and p90/p99) over ``repeat`` runs after ``warmup`` runs.

With a :class:`~gpt2onnx.decoding.speculative.Speculation` (``bench --prompt-lookup N`` or ``--draft DIR``), each
batch is also run with proposals checked several at a time, on the same prompt, right after its plain run: the rows
one after another at batch 1 (as speculative decoding runs them), greedy, so the same tokens as the plain run
(checked once per batch, untimed). A round's time covers the cut of the caches (the model's, and the draft's), its
proposals (the n-gram lookup, or the draft's steps) and the model's step of k + 1 positions; tokens/s is batch × new
tokens over the summed times, as for the plain run. The run also records its acceptance (proposals kept, tokens per
model step) and its tokens/s over the plain run's. The prompt is random ids, so prompt lookup finds only what the
model repeats of its own output (``scripts/bench_speculative.py`` measures real prompts).

Decode latency against past length up to the context (``pasts``, `gpt2onnx bench --past 128,512,1000`): one
decode step timed at each past length on a zero-filled cache, without running a prompt of that length first
(the values in the cache do not change the work a step does); ``warmup`` + ``repeat`` rounds per point.
"""

from __future__ import annotations

import os
import re
import resource
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnxruntime

from gpt2onnx.artifact.folder import ModelFolder, open_folder, versions
from gpt2onnx.artifact.report import Placement
from gpt2onnx.benchmarks.harness import Load, Rounds, Spread, check_runs, interleave
from gpt2onnx.decoding.generate import decode, speculation_draft
from gpt2onnx.decoding.results import MAX_BATCH_TOKENS
from gpt2onnx.decoding.speculative import Acceptance, Speculation
from gpt2onnx.errors import BadInput, OutputError
from gpt2onnx.files import new_file_mode
from gpt2onnx.generation_options import Decoding, Sampling
from gpt2onnx.machine import MachineInfo, machine_info
from gpt2onnx.precisions.all_precisions import precision_of
from gpt2onnx.records import OMIT_DEFAULT, Record, field
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, open_runtime
from gpt2onnx.runtimes.providers import gpu_library_versions


@dataclass(frozen=True)
class BenchConfig(Record):
    batches: tuple[int, ...] = (1, 8)
    prompt_len: int = 128
    new_tokens: int = 64
    warmup: int = 2
    repeat: int = 5
    seed: int = 0
    pasts: tuple[int, ...] = ()  # past lengths at which one decode step is also timed (decode_at_past)
    capacity: int | None = None  # the buffer of a preallocating cache at those steps (default: past + 1)

    def __post_init__(self) -> None:
        self.check()  # an invalid one cannot be built; the model's context is checked against it once known

    def check(self, n_positions: int | None = None) -> "BenchConfig":
        if not self.batches or any(b < 1 for b in self.batches):
            raise BadInput(f"batch sizes must be positive integers, got {','.join(map(str, self.batches))}")
        for name, value in (
            ("prompt length", self.prompt_len),
            ("new tokens", self.new_tokens),
            ("repeat", self.repeat),
        ):
            if value < 1:
                raise BadInput(f"{name} must be a positive integer, got {value}")
        if self.new_tokens < 2:
            raise BadInput(
                f"new tokens (--new-tokens) must be at least 2, got {self.new_tokens}: the prompt step gives the first,"
                " and decode latency needs at least one decode step"
            )
        check_runs(self.warmup, self.repeat)
        if max(self.batches) * (self.prompt_len + self.new_tokens) > MAX_BATCH_TOKENS:
            raise BadInput(
                f"batch {max(self.batches)} × {self.prompt_len + self.new_tokens} tokens is more than"
                f" {MAX_BATCH_TOKENS:,}"
                " tokens at once: use a smaller batch or shorter runs"
            )
        if any(p < 1 for p in self.pasts):
            raise BadInput(f"past lengths must be positive integers, got {','.join(map(str, self.pasts))}")
        if self.pasts and max(self.batches) * (max(self.pasts) + 1) > MAX_BATCH_TOKENS:
            raise BadInput(
                f"batch {max(self.batches)} × past {max(self.pasts)} is more than {MAX_BATCH_TOKENS:,} tokens: use a"
                " shorter past"
            )
        if self.capacity is not None and not self.pasts:
            raise BadInput("--capacity sets the cache buffer of the --past steps: give --past too, or drop --capacity")
        if self.capacity is not None and self.capacity < max(self.pasts) + 1:
            raise BadInput(
                f"--capacity {self.capacity} cannot hold past {max(self.pasts)} and its new token: give at least"
                f" {max(self.pasts) + 1}"
            )
        if n_positions and self.capacity is not None and self.capacity > n_positions:
            raise BadInput(
                f"--capacity {self.capacity} is beyond the model's context of {n_positions}: give at most {n_positions}"
            )
        if n_positions and self.pasts and max(self.pasts) >= n_positions:
            raise BadInput(
                f"past length {max(self.pasts)} leaves no room for a decode step in the model's context of"
                f" {n_positions}:"
                f" give at most {n_positions - 1}"
            )
        if n_positions and self.prompt_len + self.new_tokens > n_positions:
            raise BadInput(
                f"prompt length {self.prompt_len} plus new tokens {self.new_tokens} exceeds the model's context of"
                f" {n_positions}: shorten one of them"
            )
        return self


class PeakMemory:
    """Peak resident memory of this process while the block runs (sampled from /proc, else ru_maxrss)."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak_bytes, self._stop = interval, 0, threading.Event()

    @staticmethod
    def current() -> int:
        try:
            with open("/proc/self/statm") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def _sample(self):
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self.current())
            time.sleep(self.interval)

    def __enter__(self):
        self.peak_bytes = self.current()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self.current())


@dataclass(frozen=True)
class Percentiles(Record):
    """Milliseconds: the median, p90 and p99 of a set of timings."""

    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class Speedup(Record):
    """How many times faster a run is than PyTorch eager on the same workload (> 1: faster)."""

    prompt: float
    decode: float
    tokens_per_s: float


@dataclass(frozen=True)
class RoundsNote(Record):
    """How a run was measured beside other folders: the rounds, in rotating order, and its ratios to the baseline
    per figure, taken round by round (median and quartiles)."""

    rounds: int
    order: str
    baseline: str | None
    ratio_to_baseline: dict[str, Spread]


def _note():
    """A note on a run, written under "extra" (where bench --json has always had them) where it is set."""
    return field(default=None, within="extra", omit=OMIT_DEFAULT)


@dataclass(frozen=True)
class RunStats(Record):
    """One measured run (a folder on a runtime, or PyTorch eager) at one batch size."""

    engine: str  # the runtime ("onnxruntime", "openvino", "genai") or "torch"
    batch: int
    prompt_ms: Percentiles  # the prompt step (time to first token)
    # one decode step, over all steps and repeats (None: one new token only; written {})
    decode_ms: Percentiles | None = field(empty=True)
    decode_growth_ms_per_100_past: float  # slope of decode latency against past length
    decode_ms_by_past: tuple[tuple[int, float], ...]  # (past length, median ms), for plots
    tokens_per_s: float  # batch × new tokens / (prompt + decode time), median run
    decode_tokens_per_s: float  # batch / median decode step
    peak_host_bytes: int
    peak_device_bytes: int | None = None
    # (past, median ms): BenchConfig.pasts; (past, the cache the step holds)
    decode_ms_at_past: tuple[tuple[int, float], ...] = ()
    kv_cache_bytes_at_past: tuple[tuple[int, int], ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)  # other labels of the run; the notes below go in it too
    label: str = ""  # the folder's name (with the runtime when several), or "torch eager"
    runtime: str = ""
    # -- notes, under "extra" --
    device: str | None = _note()  # torch: where it ran, and its dtype
    dtype: str | None = _note()
    rows: str | None = _note()  # a runtime that owns its loop: "single", or "one at a time"
    peak_memory_of: str | None = _note()  # genai: its worker process or this one
    device_memory: str | None = _note()  # what peak_device_bytes is (ONNX_DEVICE_MEMORY, TORCH_DEVICE_MEMORY)
    device_allocated_peak_bytes: int | None = _note()  # torch on a GPU
    tf32: bool | None = _note()  # TF32 matmuls, where the provider has them
    rounds: RoundsNote | None = _note()  # measured beside other folders
    load: Load | None = _note()  # the machine around the rounds
    proposer: dict[str, Any] | None = _note()  # a speculative run: its proposer and options (Speculation.as_dict)
    same_tokens: bool | None = _note()  # a speculative run: whether it made the plain run's tokens
    note: str | None = _note()  # something the reader of the figures must know
    speedup_of_onnx: Speedup | None = _note()  # torch baseline: the first folder's speed-up over it
    # torch baseline: every run's speed-up over it
    speedup_by_label: dict[str, Speedup] = field(default_factory=dict, within="extra", omit=OMIT_DEFAULT)
    speculation: Acceptance | None = _note()  # a speculative run: how its proposals fared (one timed run, every row)
    speedup_over_plain: float | None = _note()  # a speculative run: its tokens/s over the plain run's (same batch)

    def ratio(self, figure: str) -> Spread | None:
        """Its ratio to the baseline on ``figure``, measured beside other folders; None where it was not."""
        return self.rounds.ratio_to_baseline.get(figure) if self.rounds is not None else None


def _percentiles(values_ms) -> Percentiles:
    values = np.asarray(values_ms, dtype=np.float64)
    return Percentiles(float(np.median(values)), float(np.percentile(values, 90)), float(np.percentile(values, 99)))


def summarize_runs(
    engine: str, batch: int, prompt_len: int, runs: list[list[float]], peak: int, device_peak=None
) -> RunStats:
    """``runs``: per repeat, the step times in seconds ([0] is the prompt step)."""
    prompt = [r[0] * 1e3 for r in runs]
    steps = np.array([r[1:] for r in runs]) * 1e3  # (repeat, decode steps)
    pasts = prompt_len + np.arange(steps.shape[1])
    by_past = np.median(steps, axis=0) if steps.size else np.zeros(0)
    slope = float(np.polyfit(pasts, by_past, 1)[0] * 100) if len(by_past) >= 2 else 0.0
    totals = [sum(r) for r in runs]
    new_tokens = len(runs[0])
    decode_p50 = float(np.median(steps)) if steps.size else float("nan")
    return RunStats(
        engine=engine,
        batch=batch,
        prompt_ms=_percentiles(prompt),
        decode_ms=_percentiles(steps.ravel()) if steps.size else None,
        decode_growth_ms_per_100_past=slope,
        decode_ms_by_past=tuple((int(p), float(v)) for p, v in zip(pasts, by_past)),
        tokens_per_s=batch * new_tokens / float(np.median(totals)),
        decode_tokens_per_s=batch * 1e3 / decode_p50 if steps.size else float("nan"),
        peak_host_bytes=int(peak),
        peak_device_bytes=device_peak,
    )


def random_prompt(batch: int, length: int, vocab_size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, size=(batch, length), dtype=np.int64)


def parse_batches(value: str, *, what: str = "batch sizes (--batch)") -> tuple[int, ...]:
    """'1,8' → (1, 8); refuses empty items ('1,,8') and anything that is not an integer."""
    try:  # digits only: int() also reads '1_0' (10) and ' 8'
        return tuple(int(v) if re.fullmatch(r"[+-]?[0-9]+", v) else int("not a number") for v in value.split(","))
    except ValueError:
        raise BadInput(f"{what} '{value}' are not a comma-separated list of integers (e.g. 1,8)") from None


def decode_step_at_past(
    decoder, batch: int, past: int, *, vocab_size: int, seed: int = 0, capacity: int | None = None
) -> float:
    """Seconds of one decode step at ``past`` tokens of cache (zeros, no prompt step): a fresh cache of
    past - 1, one untimed step (so both steppers start from their own outputs), then the timed step.
    ``capacity``: the buffer length of a stepper that preallocates one (default: past + 1, what the run needs)."""
    rng = np.random.default_rng(seed)

    def ids():
        return rng.integers(0, vocab_size, size=(batch, 1), dtype=np.int64)

    cache = decoder.past_of_length(batch, past - 1, capacity=capacity or past + 1)
    mask = np.ones((batch, past), np.int64)
    _, cache = decoder.run(ids(), mask, np.full((batch, 1), past - 1, np.int64), cache)
    mask = np.ones((batch, past + 1), np.int64)
    start = time.perf_counter()
    decoder.run(ids(), mask, np.full((batch, 1), past, np.int64), cache)
    return time.perf_counter() - start


def held_cache_bytes(decoder, batch: int, past: int, capacity: int | None = None) -> int:
    """The key/value cache a decode step at ``past`` holds: past + 1 tokens, or the whole buffer a preallocating
    stepper was given (``capacity``), in the folder's cache dtype (a quantized cache: its scales aside)."""
    held = capacity if capacity and decoder.capabilities.preallocates else past + 1
    return decoder.cache_bytes(batch, held)


def _loop_run(runner, ids: np.ndarray, config: BenchConfig) -> tuple[list[float], int]:
    """One run on a runtime that owns its loop (genai): the rows one after the other, each step's time summed over
    the rows; and the peak memory of the worker it runs in (0: it runs in this process)."""
    seconds, worker_peak = [0.0] * config.new_tokens, 0
    for row in ids:
        result = runner.run_loop(row.tolist(), max_new_tokens=config.new_tokens)
        worker_peak = max(worker_peak, result.peak_bytes or 0)
        if len(result.step_seconds) != config.new_tokens:
            raise BadInput(
                f"genai stopped after {len(result.step_seconds)} of {config.new_tokens} tokens (end-of-sequence):"
                " use fewer new tokens or another --seed"
            )
        seconds = [a + b for a, b in zip(seconds, result.step_seconds)]
    return seconds, worker_peak


@dataclass
class _Record:
    """What one folder's runs of one batch left: every run's step times (warm-ups first), the most memory a run
    added, a loop runtime's worker peak, and the device memory in use before its first run and at its peak."""

    steps: list = field(default_factory=list)
    growth: int = 0
    worker_peak: int = 0
    device_before: int | None = None
    device_peak: int | None = None


def _timed_run(subject: "Subject", ids: np.ndarray, config: BenchConfig, record: _Record):
    """The harness's variant for one folder: one generation of the batch, timed step by step; its figures."""
    decoder = subject.decoder

    def run() -> dict[str, float]:
        if record.device_before is None:
            record.device_before = _device_used(decoder.device, decoder.device_id)
        with PeakMemory() as memory:
            start = memory.peak_bytes
            if decoder.capabilities.owns_loop:
                steps, worker = _loop_run(decoder, ids, config)
                record.worker_peak = max(record.worker_peak, worker)
            else:
                steps = decode(decoder, ids, max_new_tokens=config.new_tokens).step_seconds
        record.growth = max(record.growth, memory.peak_bytes - start)
        if record.device_before is not None:
            used = _device_used(decoder.device, decoder.device_id) or 0
            record.device_peak = max(record.device_peak or 0, used - record.device_before)
        record.steps.append(steps)
        figures = {"prompt_ms": steps[0] * 1e3, "tokens_per_s": len(ids) * len(steps) / sum(steps)}
        if len(steps) > 1:
            figures["decode_ms"] = float(np.median(steps[1:])) * 1e3
        return figures

    return run


def measure_batches(
    subjects: list["Subject"],
    config: BenchConfig,
    batch: int,
    *,
    base_bytes: int,
    progress: Callable[[], None] | None = None,
) -> tuple[list[RunStats], Rounds]:
    """Every folder at one batch size, in the harness's interleaved rounds (:func:`gpt2onnx.benchmarks.harness.
    interleave`: each folder's warm-ups, then ``config.repeat`` rounds of one run each in rotating order, the
    ratios to the first folder round by round), then each one's steps at ``config.pasts`` the same way. A run's
    peak memory is what a process running that folder alone would reach: ``base_bytes`` (this process before any
    model was opened), what opening the folder's session added, and the most one of its runs added."""
    for subject in subjects:
        if config.pasts and not subject.decoder.capabilities.past_of_length:
            raise BadInput(
                "decode steps at a given past (--past) are timed on the onnxruntime runtime only, not"
                f" {subject.decoder.runtime}: drop --past"
            )
    # one prompt for every folder: ids every one of their vocabularies holds
    ids = random_prompt(batch, config.prompt_len, min(s.vocab_size for s in subjects), config.seed)
    records = {s.label: _Record() for s in subjects}
    variants = {s.label: _timed_run(s, ids, config, records[s.label]) for s in subjects}
    rounds = interleave(
        variants, rounds=config.repeat, warmup=config.warmup, baseline=subjects[0].label, on_run=progress
    )
    found = []
    for subject in subjects:
        decoder, record = subject.decoder, records[subject.label]
        peak = record.worker_peak or base_bytes + subject.load_bytes + record.growth
        stats = summarize_runs(
            decoder.runtime, batch, config.prompt_len, record.steps[config.warmup :], peak, record.device_peak
        )
        notes: dict[str, Any] = dict(tf32=decoder.tf32, load=rounds.load)
        if decoder.capabilities.owns_loop:
            notes["rows"] = "one at a time" if batch > 1 else "single"
            notes["peak_memory_of"] = "genai worker process" if record.worker_peak else "this process"
        if record.device_peak is not None:
            notes["device_memory"] = ONNX_DEVICE_MEMORY
        if len(subjects) > 1:
            ratios = {f: rounds.ratio(subject.label, f) for f in rounds.figures}
            notes["rounds"] = RoundsNote(config.repeat, "rotating", rounds.baseline, ratios)
        found.append(replace(stats, **notes))
    for past in config.pasts:
        seeds = {s.label: iter(range(config.seed, config.seed + config.warmup + config.repeat)) for s in subjects}

        def at_past(subject, past=past):
            return lambda: {
                "ms": 1e3
                * decode_step_at_past(
                    subject.decoder,
                    batch,
                    past,
                    vocab_size=subject.vocab_size,
                    seed=next(seeds[subject.label]),
                    capacity=config.capacity,
                )
            }

        timed = interleave(
            {s.label: at_past(s) for s in subjects},
            rounds=config.repeat,
            warmup=config.warmup,
            baseline=subjects[0].label,
            machine=rounds.machine,
        )
        for index, (subject, stats) in enumerate(zip(subjects, found)):
            held = held_cache_bytes(subject.decoder, batch, past, config.capacity)
            ratio, note = timed.ratio(subject.label, "ms"), stats.rounds
            if ratio is not None and note is not None:
                note = replace(note, ratio_to_baseline={**note.ratio_to_baseline, f"decode_ms_at_past_{past}": ratio})
            found[index] = replace(
                stats,
                decode_ms_at_past=(*stats.decode_ms_at_past, (past, timed.spread(subject.label, "ms").median)),
                kv_cache_bytes_at_past=(*stats.kv_cache_bytes_at_past, (past, held)),
                rounds=note,
            )
    return found, rounds


def measure_speculative(
    decoder,
    draft,
    speculation: Speculation,
    config: BenchConfig,
    batch: int,
    *,
    vocab_size: int,
    progress: Callable[[], None] | None = None,
) -> RunStats:
    """The plain run's workload with proposals checked several at a time (``draft``: the opened draft folder, for
    a draft): greedy, rows one after another at batch 1. Per timed run, the rounds' times summed over the rows; no
    per-step decode latency (a round makes one to k + 1 tokens). ``extra["same_tokens"]``: the tokens equal the
    plain loop's (one untimed plain run)."""
    ids = random_prompt(batch, config.prompt_len, vocab_size, config.seed)
    runs, acceptance, tokens = [], None, None
    with PeakMemory() as memory:
        for i in range(config.warmup + config.repeat):
            result = decode(decoder, ids, max_new_tokens=config.new_tokens, speculation=speculation, draft=draft)
            if i >= config.warmup:
                runs.append(result.step_seconds)
                acceptance, tokens = result.speculation, result.tokens
            if progress:
                progress()
    plain = decode(decoder, ids, max_new_tokens=config.new_tokens).tokens
    totals = [sum(r) for r in runs]
    decode_totals = [sum(r[1:]) for r in runs]
    stats = RunStats(
        engine=decoder.runtime,
        batch=batch,
        prompt_ms=_percentiles([r[0] * 1e3 for r in runs]),  # the rows' prompt steps, one after another
        decode_ms=None,
        decode_growth_ms_per_100_past=0.0,
        decode_ms_by_past=(),
        tokens_per_s=batch * config.new_tokens / float(np.median(totals)),
        decode_tokens_per_s=batch * (config.new_tokens - 1) / float(np.median(decode_totals)),
        peak_host_bytes=int(memory.peak_bytes),
        speculation=acceptance,
        rows="one at a time" if batch > 1 else "single",
        proposer=speculation.as_dict(),
        same_tokens=bool(np.array_equal(tokens, plain)),
    )
    return stats


# What each side's peak_device_bytes is: the memory its allocator took for the runs, beyond the weights, so that
# the two compare like for like (onnxruntime's CUDA arena keeps what it takes, as PyTorch's caching allocator does).
ONNX_DEVICE_MEMORY = "growth of the device memory in use during the runs: onnxruntime's CUDA arena (weights excluded)"
TORCH_DEVICE_MEMORY = (
    "growth of PyTorch's reserved device memory (caching allocator) during the runs (weights excluded)"
)


def _device_used(device: str, device_id: int) -> int | None:
    """Bytes in use on the GPU (whole device), where torch can see it; None on the CPU."""
    if device != "cuda":
        return None
    try:
        import torch  # lazy: the run path has no torch; where torch is there, it reads the GPU's memory

        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info(device_id)
        return int(total - free)
    except Exception:  # a CPU-only torch, or no driver
        return None


def require_matplotlib():
    try:
        import matplotlib  # lazy: an optional extra, imported only for --plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInput("a plot needs matplotlib: pip install 'gpt2onnx[plot]' (or pip install matplotlib)") from None
    return plt


def check_plot_path(path) -> None:
    """Before minutes of measuring: matplotlib is there, the name is a PNG, the folder is writable."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise BadInput(f"plot '{path}' must be a .png file: give a name ending in .png")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise BadInput(
            f"plot '{path}' cannot be written (the folder does not exist or is not writable): choose another path"
        )
    require_matplotlib()  # after the path: a bad path is bad input (exit 2) whether or not matplotlib is here


def plot_decode_latency(runs: list[RunStats], path) -> None:
    """Decode latency against past length, one line per run (needs matplotlib: pip install gpt2onnx[plot])."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        if not run.decode_ms_by_past:  # a speculative run: rounds, not one step per token
            continue
        pasts, ms = zip(*run.decode_ms_by_past)
        ax.plot(pasts, ms, label=f"{run.label or run.engine} batch {run.batch}")
    ax.set_xlabel("past length (tokens)")
    ax.set_ylabel("decode step (ms, median)")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(plt, fig, path)


def save_figure(plt, fig, path) -> None:
    """``fig`` as a PNG at ``path``, written beside it and renamed (a reader sees the old plot or the new one,
    never half a PNG), then closed."""
    fig.tight_layout()
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent if str(path.parent) else ".")
        try:
            with os.fdopen(fd, "wb") as fh:
                fig.savefig(fh, dpi=120, format="png")
            os.chmod(tmp, new_file_mode())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as err:
        raise OutputError(
            f"cannot write --plot '{path}' ({err.strerror or err}); free space or choose another path"
        ) from None
    finally:
        plt.close(fig)


@dataclass(frozen=True)
class ModelBench(Record):
    """One folder measured on one runtime: what ran where, and one run per batch size."""

    model: str  # the model file
    runtime: str
    runtime_options: dict
    runtime_mode: str  # "in-process", or the worker genai runs in
    provider: str  # where it really ran
    provider_options: dict
    session_providers: tuple[str, ...]
    config: BenchConfig
    machine: MachineInfo
    versions: dict
    model_bytes: int
    precision: str
    n_positions: int
    vocab_size: int
    runs: tuple[RunStats, ...]
    placement: Placement | None = None  # onnxruntime: nodes per provider, and compute nodes on the CPU


@dataclass
class Subject:
    """One folder on one runtime, opened for measuring (its draft too, with speculative decoding)."""

    label: str
    model: ModelFolder
    runtime: RuntimeOptions
    decoder: object
    draft: object | None
    vocab_size: int
    load_bytes: int  # what opening its session added to this process's memory

    def close(self) -> None:
        self.decoder.close()
        if self.draft is not None:
            self.draft.close()


def open_subject(
    folder, runtime: RuntimeOptions, config: BenchConfig, *, label: str, speculation=None, verify_files=True
) -> Subject:
    """The folder opened on the runtime, checked for the workload (context, memory, speculative decoding)."""
    runtime.requires("bench")
    model = open_folder(folder, verify_files=verify_files)
    config.check(model.n_positions)
    draft_model = speculation_draft(model, speculation, Sampling(), Decoding(), runtime, verify_files)
    before = PeakMemory.current()
    decoder = open_runtime(model, runtime)
    load = max(0, PeakMemory.current() - before)
    draft = None
    try:
        decoder.check_memory(
            max(config.batches), config.prompt_len, config.prompt_len + config.new_tokens, what="--batch"
        )
        if draft_model is not None:
            draft = open_runtime(draft_model, runtime)
    except BaseException:
        decoder.close()
        raise
    return Subject(label, model, runtime, decoder, draft, decoder.vocab_size or 50257, load)


def measure_folders(
    subjects: list[Subject],
    config: BenchConfig = BenchConfig(),
    *,
    base_bytes: int | None = None,
    progress: Callable[[], None] | None = None,
    speculation: Speculation | None = None,
) -> list[ModelBench]:
    """Measure opened folders side by side, batch by batch, in interleaved rounds (:func:`measure_batches`); with
    ``speculation``, each folder's batch is then run with proposals checked several at a time
    (:func:`measure_speculative`), after its plain runs. ``base_bytes``: this process's memory before the first
    folder was opened (default: now)."""
    base_bytes = PeakMemory.current() if base_bytes is None else base_bytes
    runs: dict[str, list[RunStats]] = {s.label: [] for s in subjects}
    for batch in config.batches:
        plain, _ = measure_batches(subjects, config, batch, base_bytes=base_bytes, progress=progress)
        for subject, stats in zip(subjects, plain):
            stats = replace(stats, label=subject.label)
            runs[subject.label].append(stats)
            if speculation is not None:
                run = measure_speculative(
                    subject.decoder,
                    subject.draft,
                    speculation,
                    config,
                    batch,
                    vocab_size=subject.vocab_size,
                    progress=progress,
                )
                label, over_plain = f"{subject.label} {speculation.label}", run.tokens_per_s / stats.tokens_per_s
                runs[subject.label].append(replace(run, label=label, speedup_over_plain=over_plain))
    machine = machine_info()
    found = []
    for subject in subjects:
        decoder, runtime = subject.decoder, subject.runtime
        runs[subject.label] = [replace(run, runtime=runtime.name) for run in runs[subject.label]]
        found.append(
            ModelBench(
                model=str(subject.model.model_path),
                runtime=runtime.name,
                runtime_options=runtime.as_dict(),
                runtime_mode=decoder.mode,
                provider=decoder.provider,
                provider_options=runtime.settings.as_dict(),
                session_providers=tuple(decoder.session_providers()),
                config=config,
                machine=machine,
                versions={**versions(), **_runtime_versions(runtime.name, decoder)},
                model_bytes=sum(p.stat().st_size for p in subject.model.folder.glob("model.onnx*")),
                precision=precision_of(subject.model.facts).name,
                n_positions=subject.model.n_positions,
                vocab_size=subject.vocab_size,
                runs=tuple(runs[subject.label]),
                placement=decoder.placement,
            )
        )
    return found


def measure_folder(
    folder,
    *,
    provider=None,
    runtime=None,
    config: BenchConfig = BenchConfig(),
    verify_files: bool = True,
    progress: Callable[[], None] | None = None,
    label: str | None = None,
    speculation: Speculation | None = None,
) -> ModelBench:
    """One exported folder on one runtime (default: onnxruntime on ``provider``), measured as
    :func:`measure_folders` measures several: one run per batch size, labelled ``label`` (default the folder's
    name)."""
    runtime = runtime or RuntimeOptions(settings=provider)
    base = PeakMemory.current()
    subject = open_subject(
        folder, runtime, config, label=label or Path(folder).name, speculation=speculation, verify_files=verify_files
    )
    try:
        return measure_folders([subject], config, base_bytes=base, progress=progress, speculation=speculation)[0]
    finally:
        subject.close()


def _runtime_versions(name: str, decoder) -> dict[str, str]:
    """onnxruntime's version, the runtime's own, and on a GPU the CUDA, cuDNN and TensorRT libraries loaded."""
    found = {"onnxruntime": onnxruntime.__version__}
    if name != "onnxruntime":
        found[name] = decoder.version
    if decoder.device == "cuda":
        found.update(gpu_library_versions())
    return found
