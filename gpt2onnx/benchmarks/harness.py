"""The benchmark harness every measurement runs through: variants measured in interleaved rounds.

Decode times on a shared machine move by tens of percent between windows minutes apart, so two variants measured
one after the other compare their windows as much as themselves. Here every variant runs its warm-ups first (each
variant's back to back, so that what a first run allocates is its own), then ``rounds`` rounds in which every
variant runs once, in an order that rotates (A B C, B C A, C A B, ...): a slow window costs every variant alike.
Each figure is reported as its median over the rounds with its quartiles, and each variant's ratio to a named
baseline is computed round by round (the two runs of a round share their window) before its median is taken.
The machine's load and the CPU time other processes took are recorded around the rounds, with the machine.
(Modelled on llama-bench's repetitions and vLLM's benchmarks: one runner, many workloads.)"""

from __future__ import annotations

import csv
import io
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from gpt2onnx.errors import BadInput
from gpt2onnx.files import write_json_atomic, write_text_atomic
from gpt2onnx.machine import MachineRecord, describe_machine
from gpt2onnx.records import Record, computed, field, to_json

Figures = Mapping[str, float]  # one run's figures by name ("decode_ms": 4.1, "tokens_per_s": 240.0)


@dataclass(frozen=True)
class Spread(Record):
    """A figure over the rounds: its median and quartiles (the 25th and 75th percentiles), and how many values."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values) -> "Spread":
        values = np.asarray(list(values), np.float64)
        low, median, high = np.percentile(values, [25, 50, 75])
        return cls(float(median), float(low), float(high), int(values.size))

    def shown(self, digits: int = 3) -> str:
        """'4.13 (4.05–4.30)'."""
        return f"{self.median:.{digits}g} ({self.low:.{digits}g}–{self.high:.{digits}g})"


@dataclass(frozen=True)
class Load(Record):
    """The machine around the rounds: the 1-minute load average before and after, and the share of all CPUs'
    time that other processes used while the rounds ran (0: the machine was ours; 0.5 on 2 CPUs: one was busy)."""

    before: float = field(key="load_before")
    after: float = field(key="load_after")
    others: float | None = field(key="other_processes_cpu")  # None where /proc/stat cannot be read

    def summary(self) -> str:
        others = "" if self.others is None else f", other processes {100 * self.others:.0f} % of the CPUs"
        return f"load {self.before:.2f} → {self.after:.2f}{others}"


def processes_cpu_seconds(pids) -> float:
    """User and system CPU seconds of the processes ``pids`` so far (/proc; one that is gone counts 0)."""
    ticks, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
        except (OSError, ValueError, IndexError):
            continue
    return total


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (/proc: children, their children, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += parents.get(current, [])
    return found


class _CpuTime:
    """All CPUs' busy and total time (/proc/stat) and this process's own (children included, and the helper
    processes ``own_pids`` names: workers it asks), to tell what other processes used between two readings."""

    def __init__(self, own_pids: Callable[[], list[int]] | None = None):
        self.own_pids = own_pids
        self.start = self._read()

    def _read(self) -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as fh:
                fields = [float(v) for v in fh.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle and iowait
        own = sum(os.times()[:4])  # user and system time, this process and its waited-for children (seconds)
        own += processes_cpu_seconds(self.own_pids()) if self.own_pids else 0.0
        return sum(fields) / ticks, (sum(fields) - idle) / ticks, own

    def others(self) -> float | None:
        end = self._read()
        if self.start is None or end is None:
            return None
        total, busy, own = (b - a for a, b in zip(self.start, end))
        return max(0.0, busy - own) / total if total > 0 else None


@dataclass(frozen=True)
class Series(Record):
    """One variant's values of one figure, a value per round (in round order)."""

    variant: str
    figure: str
    values: tuple[float, ...]


@dataclass(frozen=True)
class Rounds(Record):
    """What :func:`interleave` measured: every variant's figures round by round, the order each round ran the
    variants in, the baseline of the ratios, the load around the rounds and the machine."""

    variants: tuple[str, ...]
    baseline: str | None
    warmup: int
    orders: tuple[tuple[str, ...], ...]
    series: tuple[Series, ...]
    load: Load
    machine: MachineRecord

    json_computed = (computed("rounds", "count", after="baseline"), computed("summary", "rows", after="series"))

    @property
    def count(self) -> int:
        """How many rounds ran."""
        return len(self.orders)

    def values(self, variant: str, figure: str) -> tuple[float, ...]:
        found = next((s.values for s in self.series if s.variant == variant and s.figure == figure), None)
        if found is None:
            raise KeyError(f"{variant}: no figure {figure}")
        return found

    @property
    def figures(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.figure for s in self.series))

    def spread(self, variant: str, figure: str) -> Spread:
        return Spread.of(self.values(variant, figure))

    def ratio(self, variant: str, figure: str) -> Spread | None:
        """The variant's figure over the baseline's, round by round (each pair ran in the same round), as a
        spread; None without a baseline."""
        if self.baseline is None:
            return None
        ours, theirs = np.asarray(self.values(variant, figure)), np.asarray(self.values(self.baseline, figure))
        with np.errstate(divide="ignore", invalid="ignore"):
            return Spread.of(ours / theirs)

    def rows(self) -> list[dict]:
        """A row per variant and figure: the median, quartiles and, with a baseline, the ratio's."""
        rows = []
        for variant in self.variants:
            for figure in self.figures:
                spread, ratio = self.spread(variant, figure), self.ratio(variant, figure)
                row = {"variant": variant, "figure": figure, **to_json(spread)}
                if ratio is not None:
                    row.update(ratio=ratio.median, ratio_low=ratio.low, ratio_high=ratio.high)
                rows.append(row)
        return rows

    def csv(self) -> str:
        return csv_of(self.rows())

    def markdown(self) -> str:
        """A table, a variant a row and a figure a column (median and quartiles; × the baseline's, round by round),
        then where and under what load it ran."""
        head = ["variant", *self.figures]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for variant in self.variants:
            cells = []
            for figure in self.figures:
                cell = self.spread(variant, figure).shown()
                ratio = self.ratio(variant, figure)
                if ratio is not None and variant != self.baseline:
                    cell += f", ×{ratio.median:.3g}"
                cells.append(cell)
            lines.append("| " + " | ".join([variant, *cells]) + " |")
        lines.append("")
        lines.append(
            f"{len(self.orders)} rounds in rotating order after {self.warmup} warm-up runs each"
            + (f"; ratios to {self.baseline}, round by round" if self.baseline else "")
            + f"; {self.machine.summary()}; {self.load.summary()}."
        )
        return "\n".join(lines) + "\n"


def csv_of(rows: list[dict]) -> str:
    """Rows as CSV: a column for every key any row has, in the order they first appear."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(dict.fromkeys(k for row in rows for k in row)), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def timed(run: Callable[[], object], per_second: Mapping[str, float]) -> Callable[[], Figures]:
    """A variant for :func:`interleave`: ``run`` timed, its figures the seconds and, for each rate named in
    ``per_second``, that amount of work over the seconds (``{"tokens_per_s": 96}``: 96 tokens a run)."""

    def figures() -> Figures:
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
        return {"seconds": seconds, **{name: amount / seconds for name, amount in per_second.items()}}

    return figures


def rotated(names: tuple[str, ...], round_index: int) -> tuple[str, ...]:
    """Round r's order: the names rotated left by r (A B C, B C A, C A B, A B C, ...)."""
    shift = round_index % len(names) if names else 0
    return names[shift:] + names[:shift]


PAUSE = 0.05  # seconds before every timed run (interleave's default)
MAX_WARMUP, MAX_REPEAT = 1000, 10_000  # untimed and timed runs a benchmark may ask for (more: a typo, or hours)


def check_runs(warmup: object, repeat: object) -> None:
    """--warmup and --repeat of every benchmark, checked once before any work: 0 to MAX_WARMUP warm-ups, 1 to
    MAX_REPEAT rounds."""
    for flag, value, low, high in (("--warmup", warmup, 0, MAX_WARMUP), ("--repeat", repeat, 1, MAX_REPEAT)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise BadInput(f"{flag} must be an integer from {low} to {high:,}, got {value!r}")


def interleave(
    variants: Mapping[str, Callable[[], Figures]],
    *,
    rounds: int,
    warmup: int = 1,
    baseline: str | None = None,
    machine: MachineRecord | None = None,
    on_run: Callable[[], None] | None = None,
    own_pids: Callable[[], list[int]] | None = None,
    pause: float = PAUSE,
) -> Rounds:
    """Run each variant ``warmup`` times (its own back to back), then ``rounds`` rounds of one run each in rotating
    order; every run returns its figures by name (the same names each time). ``baseline``: the variant the ratios
    are taken to. ``on_run``: called after every run (progress). ``own_pids``: the worker processes the variants
    run in (their CPU time is the measurement's own, not other processes'). ``pause``: seconds slept before every
    run, untimed (onnxruntime's threads spin a while after a run; with many sessions or processes open, the last
    one's spinning threads would take the cores from the next)."""
    names = tuple(variants)
    if not names:
        raise BadInput("nothing to measure: give at least one variant")
    check_runs(warmup, rounds)
    if baseline is not None and baseline not in variants:
        raise BadInput(f"the baseline '{baseline}' is not one of the variants: {', '.join(names)}")

    def run(name: str) -> Figures:
        time.sleep(pause)
        figures = variants[name]()
        if on_run:
            on_run()
        return figures

    for name in names:
        for _ in range(warmup):
            run(name)
    machine = machine or describe_machine()
    before, cpu = os.getloadavg()[0], _CpuTime(own_pids)
    measured: dict[str, list[Figures]] = {name: [] for name in names}
    orders = []
    for index in range(rounds):
        order = rotated(names, index)
        orders.append(order)
        for name in order:
            measured[name].append(dict(run(name)))
    load = Load(before, os.getloadavg()[0], cpu.others())
    series = []
    for name in names:
        keys = list(measured[name][0])
        if any(list(figures) != keys for figures in measured[name]):
            raise ValueError(f"{name}: its runs gave different figures")
        series += [Series(name, key, tuple(float(f[key]) for f in measured[name])) for key in keys]
    return Rounds(
        variants=names,
        baseline=baseline,
        warmup=warmup,
        orders=tuple(orders),
        series=tuple(series),
        load=load,
        machine=machine,
    )


def write_outputs(report, *, json_path=None, markdown_path=None, before_writing: Callable[[], None] | None = None):
    """A measurement's files, its last work: ``before_writing`` first (the CLI stops heeding Ctrl-C there), then
    ``report.markdown()`` and ``report.as_dict()``, each written atomically where asked for. Returns ``report``."""
    if before_writing is not None and (json_path is not None or markdown_path is not None):
        before_writing()
    if markdown_path is not None:
        write_text_atomic(markdown_path, report.markdown())
    if json_path is not None:
        write_json_atomic(json_path, report.as_dict())
    return report
