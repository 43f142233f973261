"""Benchmarks side by side: exported folders on an onnxruntime provider, and PyTorch eager (the reference) on the
same workload in the same run. Measurement itself is :mod:`gpt2onnx.benchmarks.timing`; without a torch baseline
nothing here imports torch."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.lora import adapter_declared, adapter_of
from gpt2onnx.artifact.paths import check_output_files, folder_labels
from gpt2onnx.benchmarks.harness import csv_of
from gpt2onnx.benchmarks.timing import (
    TORCH_DEVICE_MEMORY,
    BenchConfig,
    ModelBench,
    PeakMemory,
    RunStats,
    Speedup,
    check_plot_path,
    measure_folders,
    open_subject,
    plot_decode_latency,
    random_prompt,
    summarize_runs,
)
from gpt2onnx.decoding.generate import speculation_draft
from gpt2onnx.decoding.speculative import Speculation
from gpt2onnx.errors import BadInput
from gpt2onnx.files import write_json_atomic, write_text_atomic
from gpt2onnx.generation_options import Decoding, Sampling
from gpt2onnx.machine import MachineRecord, describe_machine
from gpt2onnx.precisions.all_precisions import PRECISIONS
from gpt2onnx.records import OMIT_DEFAULT, Record, field
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, check_combination
from gpt2onnx.runtimes.providers import TF32_OVERRIDE, ProviderConfig

BASELINES = ("torch",)


@dataclass(frozen=True)
class BenchReport(Record):
    """What :func:`bench` returns (its ``as_dict()`` is ``bench --json``): every folder on every runtime (with
    its runs), and every run in order, the torch baseline's included."""

    models: tuple[ModelBench, ...]
    runs: tuple[RunStats, ...]
    # where it ran: the CPU (model, features), the GPU
    machine: MachineRecord | None = field(default=None, omit=OMIT_DEFAULT)

    def rows(self) -> list[dict]:
        """A row per run: its figures (ms medians, tokens/s, peak MB) and, measured with others, its ratios to the
        first folder taken round by round (median and quartiles)."""
        rows = []
        for run in self.runs:
            row = {
                "label": run.label,
                "runtime": run.runtime or run.engine,
                "batch": run.batch,
                "prompt_ms": round(run.prompt_ms.p50, 4),
                "decode_ms_p50": round(run.decode_ms.p50, 4) if run.decode_ms else None,
                "decode_ms_p90": round(run.decode_ms.p90, 4) if run.decode_ms else None,
                "tokens_per_s": round(run.tokens_per_s, 2),
                "peak_mb": round(run.peak_host_bytes / 1e6, 1),
            }
            for past, ms in run.decode_ms_at_past:
                row[f"decode_ms_at_past_{past}"] = round(ms, 4)
            for past, held in run.kv_cache_bytes_at_past:
                row[f"kv_cache_mb_at_past_{past}"] = round(held / 1e6, 3)
            for figure, ratio in (run.rounds.ratio_to_baseline if run.rounds else {}).items():
                row.update({f"{figure}_ratio": ratio.median, f"{figure}_ratio_low": ratio.low})
                row[f"{figure}_ratio_high"] = ratio.high
            rows.append(row)
        return rows

    def csv(self) -> str:
        return csv_of(self.rows())

    def markdown(self) -> str:
        """The table of ``bench --md``: a run a row (ratios to the first folder, round by round, where several were
        measured), then the workload, the machine and the load it ran under."""
        ratios = any(run.rounds is not None for run in self.runs)
        head = ["model", "runtime", "batch", "prompt ms", "decode ms p50", "tok/s", "peak MB"]
        head += ["decode ×first (quartiles)", "tok/s ×first (quartiles)"] if ratios else []
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for run in self.runs:
            cells = [run.label, run.runtime or run.engine, str(run.batch), f"{run.prompt_ms.p50:.2f}"]
            cells += [f"{run.decode_ms.p50:.3f}" if run.decode_ms else "-", f"{run.tokens_per_s:.1f}"]
            cells.append(f"{run.peak_host_bytes / 1e6:.0f}")
            if ratios:
                for key in ("decode_ms", "tokens_per_s"):
                    r = run.ratio(key)
                    cells.append(r.shown() if r else "-")
            lines.append("| " + " | ".join(cells) + " |")
        config = self.models[0].config if self.models else None
        lines += self._markdown_at_past(ratios)
        where = self.machine.summary() if self.machine is not None else "an unrecorded machine"
        loads = [run.load for run in self.runs if run.load is not None]
        load = f"; load {loads[0].before:.2f} → {loads[-1].after:.2f}" if loads else ""
        if config is not None:
            lines += [
                "",
                f"Prompt {config.prompt_len}, {config.new_tokens} new tokens; {config.warmup} warm-ups, then"
                f" {config.repeat} rounds in rotating order; {where}{load}; {time.strftime('%Y-%m-%d %H:%M %Z')}.",
            ]
        return "\n".join(lines) + "\n"

    def _markdown_at_past(self, ratios: bool) -> list[str]:
        """``--past``: one decode step at each past length, with the K/V cache it holds (and, several folders
        measured, the ratio to the first, round by round)."""
        runs = [run for run in self.runs if run.decode_ms_at_past]
        if not runs:
            return []
        head = ["model", "batch", "past", "decode ms", "K/V cache MB", *(["×first (quartiles)"] if ratios else [])]
        lines = ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for run in runs:
            for (past, ms), (_, held) in zip(run.decode_ms_at_past, run.kv_cache_bytes_at_past):
                cells = [run.label, str(run.batch), str(past), f"{ms:.3f}", f"{held / 1e6:.3g}"]
                if ratios:
                    r = run.ratio(f"decode_ms_at_past_{past}")
                    cells.append(r.shown() if r else "-")
                lines.append("| " + " | ".join(cells) + " |")
        return lines


def torch_device(provider: ProviderConfig) -> str:
    """Where the PyTorch baseline runs: on the GPU the ONNX side uses (cuda, tensorrt) when this torch sees it,
    else on the CPU (a CPU-only torch beside onnxruntime-gpu; the run records it)."""
    if provider.name in ("cuda", "tensorrt"):
        import torch

        if torch.cuda.is_available():
            return f"cuda:{provider.device_id}"
    return "cpu"


@contextlib.contextmanager
def matmul_tf32(enabled: bool):
    """PyTorch's fp32 CUDA matmuls in TF32 or not, for the block (its default, 'highest', is not), then as before."""
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def synchronizer(device) -> Callable[[], None]:
    """What makes a timing honest on ``device``: on CUDA, wait for the queued kernels; on the CPU, nothing."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def bench_torch(
    model, config: BenchConfig, batch: int, *, vocab_size: int, progress: Callable[[], None] | None = None
) -> RunStats:
    """The same workload on PyTorch eager (transformers' GPT2LMHeadModel with its cache), on the device the
    model is on: on a GPU the prompt and the cache stay there, and each step is timed between synchronizations
    (the greedy pick included, as the ONNX runner's step includes copying the logits out)."""
    import torch

    from gpt2onnx.pytorch.reference import forward_with_cache, model_device

    device = model_device(model)
    sync = synchronizer(device)
    ids = torch.as_tensor(random_prompt(batch, config.prompt_len, vocab_size, config.seed), device=device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
        # the weights: the ONNX side's device figure leaves them out too
        resident, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    runs = []
    with PeakMemory() as memory, torch.inference_mode():
        for i in range(config.warmup + config.repeat):
            times, past, step_ids = [], None, ids
            for _ in range(config.new_tokens):
                sync()
                start = time.perf_counter()
                out, past = forward_with_cache(model, past, input_ids=step_ids)
                step_ids = out.logits[:, -1].argmax(-1, keepdim=True)
                sync()
                times.append(time.perf_counter() - start)
            if i >= config.warmup:
                runs.append(times)
            if progress:
                progress()
    # reserved, not allocated: onnxruntime's arena is measured the same way (what the allocator took and keeps)
    device_peak = int(torch.cuda.max_memory_reserved(device) - reserved) if on_gpu else None
    stats = summarize_runs("torch", batch, config.prompt_len, runs, memory.peak_bytes, device_peak)
    stats = replace(stats, device=str(device), dtype=str(next(model.parameters()).dtype).removeprefix("torch."))
    if on_gpu:
        stats = replace(
            stats,
            device_memory=TORCH_DEVICE_MEMORY,
            device_allocated_peak_bytes=int(torch.cuda.max_memory_allocated(device) - resident),
            tf32=bool(torch.backends.cuda.matmul.allow_tf32) and os.environ.get(TF32_OVERRIDE) != "0",
        )
    return stats


def bench(
    folders: list[str | Path] | str | Path,
    *,
    provider: ProviderConfig | None = None,
    runtimes: list[RuntimeOptions] | None = None,
    config: BenchConfig = BenchConfig(),
    baseline: str | None = None,
    reference: str | None = None,
    json_path: str | Path | None = None,
    plot: str | Path | None = None,
    verify_files: bool = True,
    progress: Callable[[], None] | None = None,
    speculation: Speculation | None = None,
    before_writing: Callable[[], None] | None = None,
    csv_path: str | Path | None = None,
    markdown_path: str | Path | None = None,
    adapter: str | None = None,
) -> BenchReport:
    """Measure exported folders side by side on one or several runtimes and one workload, and optionally
    PyTorch eager.

    Args:
        folders: one exported folder or several, all opened, then measured batch by batch in the harness's
            interleaved rounds (:mod:`gpt2onnx.benchmarks.harness`: ``config.warmup`` warm-ups each, then
            ``config.repeat`` rounds of one run each in rotating order; ratios to the first, round by round).
        provider: the onnxruntime provider and its options (default: cpu, all cores).
        runtimes: the runtimes, each with its options (default: onnxruntime on ``provider``); every folder is
            measured on each, in the same rounds. A run's label is the folder's name (with as much of its path as
            tells two folders named alike apart), with the runtime after it when there are several.
        config: batches, prompt length, new tokens, warm-up and timed runs.
        baseline: 'torch' also runs transformers' GPT2LMHeadModel (the first folder's reference) on the same workload.
        reference: the checkpoint for the baseline (default: the source the first folder's manifest records).
        json_path: also write the result there (atomically). plot: draw decode latency against past length (PNG).
        csv_path, markdown_path: the table of runs as CSV and as Markdown (with the workload, machine and load).
        verify_files: check each folder's model files against its manifest's sha256 first.
        progress: called after each warm-up or timed run.
        speculation: prompt lookup or a draft folder: each folder's every batch is also run with proposals checked
            several at a time, right after its plain run (greedy, rows one at a time), with its acceptance and its
            tokens/s over the plain run's. onnxruntime only, on folders that return every position's logits;
            checked for every folder (and the draft's vocabulary) before anything is measured.
        before_writing: called once everything is measured, right before ``plot`` and ``json_path`` are written
            (the CLI ignores Ctrl-C from there: an interrupted run writes nothing).
        adapter: a switchable LoRA adapter (export --adapters): each folder is measured twice in the same rounds,
            the base (no adapter) and with ``adapter`` active (labelled "+NAME"), so that the ratio is the decode
            cost of an active adapter; checked for every folder and runtime before anything is measured.

    Returns:
        BenchReport: ``models``, per folder and runtime (runtime, provider, node placement, machine, versions,
        precision, size, runs); ``runs``, every run, the baseline's included, each with its label and runtime. On
        a GPU, each run's ``extra`` states its TF32 setting (PyTorch's is matched to the session's) and what its
        ``peak_device_bytes`` measures (each framework's reserved growth, weights excluded).

    Raises:
        BadInput (options, folders, plot path), ContractError, IntegrityError, RuntimeUnavailable.
    """
    folders = [folders] if isinstance(folders, (str, Path)) else list(folders)
    if not folders:
        raise BadInput("give at least one exported folder to measure")
    if baseline not in (None, *BASELINES):
        raise BadInput(f"baseline '{baseline}' is not supported: the only baseline is 'torch'")
    runtimes = runtimes or [RuntimeOptions(settings=provider)]
    if len({r.name for r in runtimes}) != len(runtimes):
        raise BadInput("a runtime is named twice: give each once")
    if reference is not None and baseline != "torch":
        raise BadInput("--reference applies to the torch baseline: add --baseline torch, or drop --reference")
    inputs = (*folders, reference, speculation and speculation.folder)  # the draft's folder is read too
    outputs = {"--json": json_path, "--csv": csv_path, "--md": markdown_path, "--plot": plot}
    check_output_files(outputs, inputs=inputs)
    if plot is not None:
        check_plot_path(plot)  # before minutes of measuring, not after
    if speculation is not None:
        _check_speculation(folders, runtimes, speculation)
    adapters = _check_adapter(folders, runtimes, adapter) if adapter is not None else {}
    base = PeakMemory.current()  # before any model: each folder's memory is told from here
    subjects = []
    try:
        for folder, name in zip(folders, folder_labels(folders)):
            for active in (None, adapters[folder]) if adapters else (None,):
                for runtime in runtimes:
                    label = name + (f" +{adapter}" if active is not None else "")
                    label += f" {runtime.name}" if len(runtimes) > 1 else ""
                    subjects.append(
                        open_subject(
                            folder, runtime, config, label=label, speculation=speculation, verify_files=verify_files
                        )
                    )
                    if active is not None:  # the same graph, its slots bound to the adapter's factors
                        subjects[-1].decoder.activate_adapter(active)
        results = measure_folders(subjects, config, base_bytes=base, progress=progress, speculation=speculation)
    finally:
        for subject in subjects:
            subject.close()
    runs = [run for result in results for run in result.runs]
    first = runtimes[0]  # the baseline runs where it ran: its provider, or its thread count
    provider = first.settings if first.name == "onnxruntime" else ProviderConfig(threads=first.threads)
    if baseline == "torch":
        runs += _torch_baseline(folders[0], results, provider, config, reference, progress)
    # the machine that ran, not the one asked for: a GPU only where a run really used it (a fallback ran on the CPU)
    ran = [r.provider for r in results] + [run.device or "" for run in runs]
    on_gpu = any(str(where).lower() in ("cuda", "tensorrt") or str(where).startswith("cuda:") for where in ran)
    machine = describe_machine(provider.name if on_gpu else "cpu", provider.device_id)
    report = BenchReport(tuple(results), tuple(runs), machine)
    if before_writing is not None and any(p is not None for p in outputs.values()):
        before_writing()
    if plot is not None:  # first: the one more likely to fail, and then nothing is written
        plot_decode_latency(runs, plot)
    if json_path is not None:
        write_json_atomic(json_path, report.as_dict())
    if csv_path is not None:
        write_text_atomic(csv_path, report.csv())
    if markdown_path is not None:
        write_text_atomic(markdown_path, report.markdown())
    return report


def _check_adapter(folders, runtimes: list[RuntimeOptions], adapter: str) -> dict:
    """Before anything is measured: each folder has the adapter, each runtime binds its factors; its files."""
    found = {}
    for folder in folders:
        model = open_folder(folder, verify_files=False)
        found[folder] = adapter_of(model, adapter)
        for runtime in runtimes:
            check_combination(model, runtime, adapter_declared(adapter))
    return found


def _check_speculation(folders, runtimes: list[RuntimeOptions], speculation: Speculation) -> None:
    """Before minutes of measuring: each folder on each runtime with what speculative decoding declares it needs
    (a runtime that checks proposals, every position's logits), and a draft of the same vocabulary."""
    for folder in folders:
        for runtime in runtimes:
            speculation_draft(
                open_folder(folder, verify_files=False), speculation, Sampling(), Decoding(), runtime, False
            )


def _torch_baseline(
    folder, results: list[ModelBench], provider: ProviderConfig, config: BenchConfig, reference, progress
) -> list[RunStats]:
    """The same workload on PyTorch eager, with the speed-up over it of the first folder (``speedup_of_onnx``,
    on the first runtime) and of every folder and runtime (``speedup_by_label``) per batch."""
    import torch

    from gpt2onnx.pytorch.reference import reference_model
    from gpt2onnx.verify.parity import check_reference_matches, reference_checkpoint

    torch.set_num_threads(provider.threads or os.cpu_count() or 1)
    device = torch_device(provider)
    # On a GPU an fp16 folder is compared with torch in fp16 (fp32 there would flatter us); on the CPU torch
    # stays fp32, its fp16 kernels there are not what anyone would run.
    half = device.startswith("cuda") and PRECISIONS[results[0].precision].dtype == "float16"
    model = open_folder(folder, verify_files=False)
    ckpt = reference_checkpoint(model, reference)
    check_reference_matches(model, ckpt)  # the baseline must run the same architecture
    ref = reference_model(ckpt, device=device, dtype=torch.float16 if half else None)
    # TF32 as the ONNX session really has it (off unless --tf32), recorded on both sides per run
    tf32 = next((r.tf32 for r in results[0].runs if r.tf32 is not None), provider.tf32)
    runs = []
    for batch in config.batches:
        with matmul_tf32(tf32):
            stats = bench_torch(ref, config, batch, vocab_size=results[0].vocab_size, progress=progress)
        label = "torch eager" if device == "cpu" else f"torch eager ({device}, {'fp16' if half else 'fp32'})"
        note = None
        if provider.name != "cpu" and device == "cpu":
            note = f"torch sees no GPU here: the baseline ran on the CPU while onnxruntime ran on {provider.name}"

        def speedup(ours: RunStats) -> Speedup:
            return Speedup(
                prompt=stats.prompt_ms.p50 / ours.prompt_ms.p50,
                decode=stats.decode_ms.p50 / ours.decode_ms.p50 if stats.decode_ms and ours.decode_ms else float("nan"),
                tokens_per_s=ours.tokens_per_s / stats.tokens_per_s,
            )

        ours = [r for result in results for r in result.runs if r.batch == batch]
        by_label = {r.label: speedup(r) for r in ours}
        ran = replace(stats, label=label, runtime="torch", note=note, speedup_of_onnx=speedup(ours[0]))
        runs.append(replace(ran, speedup_by_label=by_label))
    return runs
