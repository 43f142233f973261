"""Memory of a run (`gpt2onnx bench memory`): how much host memory one greedy decode grows by at its peak, beside
the estimate that refuses runs this machine cannot hold (the stepper's ``run_bytes``), each run in a process of
its own.

requires: Linux (the peak is the kernel's VmHWM, reset through /proc/self/clear_refs), an exported folder the
onnxruntime stepper opens. ensures: per (folder, batch) the growth, the estimate and the final K/V cache, in bytes,
measured in a fresh process: the session opened and warmed on one short row (its lazy allocations go into the
baseline), the peak reset, the batch decoded greedily, the growth the peak less the resident size before.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gpt2onnx.artifact.paths import check_output_files, folder_labels
from gpt2onnx.benchmarks.harness import write_outputs
from gpt2onnx.errors import BadInput, RuntimeUnavailable
from gpt2onnx.machine import MachineInfo, machine_info
from gpt2onnx.records import Record, computed, from_json, to_json

CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class MemoryRun(Record):
    """One greedy decode of ``rows`` × ``prompt`` + ``new`` tokens, in bytes."""

    folder: str
    rows: int
    prompt: int
    new: int
    grown_bytes: int  # the peak resident size less the resident size before
    estimate_bytes: int  # what the stepper's check expects it to grow by at most
    cache_bytes: int  # the K/V cache at the end, for scale
    label: str = ""  # the folder as the table names it (folder_labels: 'a/model' and 'b/model' kept apart)

    json_computed = (computed("of_estimate"),)

    @property
    def of_estimate(self) -> float:
        """Growth over the estimate: under 1 where the estimate holds."""
        return self.grown_bytes / self.estimate_bytes


@dataclass(frozen=True)
class MemoryReport(Record):
    machine: MachineInfo
    runs: tuple[MemoryRun, ...]

    def markdown(self) -> str:
        lines = [
            "| folder | rows × prompt + new | grew by MB | estimate MB | grown / estimate | final cache MB |",
            "|---|---|---|---|---|---|",
        ]
        for r in self.runs:
            lines.append(
                f"| {r.label or Path(r.folder).name} | {r.rows} × {r.prompt} + {r.new} | {r.grown_bytes / 1e6:,.1f} |"
                f" {r.estimate_bytes / 1e6:,.1f} | {r.of_estimate:.2f} | {r.cache_bytes / 1e6:,.1f} |"
            )
        where, cores = self.machine.record.summary(), self.machine.cpu_count
        lines += ["", f"Greedy decode, onnxruntime cpu, each run in its own process; {where}, {cores} cores."]
        return "\n".join(lines) + "\n"


def _resident(key: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key))


def measure_here(folder: str, rows: int, prompt: int, new: int) -> MemoryRun:
    """One run in this process (a fresh one: what ran before stays in its resident size)."""
    import numpy as np

    from gpt2onnx.artifact.folder import open_folder
    from gpt2onnx.decoding.generate import decode
    from gpt2onnx.runtimes.decoder import open_decoder
    from gpt2onnx.runtimes.providers import ProviderConfig

    decoder = open_decoder(open_folder(folder), ProviderConfig())
    ids = np.random.default_rng(0).integers(0, decoder.vocab_size, (rows, prompt))
    decode(decoder, ids[:1, :2], max_new_tokens=2)  # the session's lazy allocations go into the baseline
    before = _resident("VmRSS")
    CLEAR_REFS.write_text("5")  # resets VmHWM to the current resident size
    decode(decoder, ids, max_new_tokens=new)
    return MemoryRun(
        folder=str(folder),
        rows=rows,
        prompt=prompt,
        new=new,
        grown_bytes=_resident("VmHWM") - before,
        estimate_bytes=decoder.run_bytes(rows, prompt, prompt + new),
        cache_bytes=decoder.cache_bytes(rows, prompt + new),
    )


def measure_memory(
    folders: list[str | Path],
    batches: tuple[int, ...],
    prompt_len: int = 128,
    new_tokens: int = 64,
    *,
    json_path: str | Path | None = None,
    markdown_path: str | Path | None = None,
    progress: Callable[[], None] | None = None,
    before_writing: Callable[[], None] | None = None,
) -> MemoryReport:
    """Every folder at every batch size, each run in a new Python process (this module as its main). json_path,
    markdown_path: the report written there (atomically), checked before any run as every output is."""
    from gpt2onnx.artifact.folder import open_folder

    if not CLEAR_REFS.exists():
        raise RuntimeUnavailable("bench memory reads a run's peak from /proc (Linux): run it on Linux")
    if prompt_len < 1 or new_tokens < 1 or not batches or min(batches) < 1:
        raise BadInput("batch sizes, the prompt length and new tokens must be positive integers")
    labels = folder_labels(folders)  # a folder given twice is refused; two named 'model' keep their parents
    for folder in folders:
        open_folder(folder)  # a bad folder is refused here, in one line, before any process starts
    outputs = {"--json": json_path, "--md": markdown_path}
    check_output_files(outputs, inputs=tuple(Path(f) for f in folders))
    runs = []
    for folder, label in zip(folders, labels):
        for rows in batches:
            command = [sys.executable, "-m", "gpt2onnx.benchmarks.memory", str(folder), str(rows)]
            done = subprocess.run(
                [*command, str(prompt_len), str(new_tokens)], capture_output=True, text=True, check=False
            )
            try:
                answer = json.loads((done.stdout.strip().splitlines() or ["null"])[-1])
            except ValueError:  # not the worker's answer: what it said on stderr tells why
                answer = None
            if done.returncode != 0 or not isinstance(answer, dict) or "error" in answer:
                said = answer.get("error") if isinstance(answer, dict) else None
                said = said or (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise BadInput(f"the run of '{folder}' at batch {rows} failed: {said}")
            runs.append(from_json(MemoryRun, {**answer, "label": label}))
            if progress is not None:
                progress()
    report = MemoryReport(machine=machine_info(), runs=tuple(runs))
    return write_outputs(report, json_path=json_path, markdown_path=markdown_path, before_writing=before_writing)


def _main(argv: list[str]) -> None:
    """The child: one run, its figures as one JSON line on stdout (a refusal as {"error": ...})."""
    from gpt2onnx.errors import Gpt2OnnxError

    folder, rows, prompt, new = argv[0], *map(int, argv[1:4])
    try:
        found = to_json(measure_here(folder, rows, prompt, new))
    except Gpt2OnnxError as err:
        found = {"error": str(err)}
    print(json.dumps(found))


if __name__ == "__main__":
    _main(sys.argv[1:])
