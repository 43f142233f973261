"""Rendering: each command's typed result as tables and lines on stdout (errors go to stderr, in app.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from gpt2onnx.artifact.paths import folder_labels
from gpt2onnx.cli.app import console, err_console
from gpt2onnx.precisions.all_precisions import PRECISIONS

if TYPE_CHECKING:  # the results' types only: rendering imports no library module that would pull in torch
    from gpt2onnx.artifact.inspect import ModelDescription
    from gpt2onnx.artifact.report import CheckReport, EvalReport, EvalRow
    from gpt2onnx.benchmarks.bench import BenchReport
    from gpt2onnx.decoding.generate import TextGeneration
    from gpt2onnx.exporters.export import ExportResult
    from gpt2onnx.targets.deploy import DeployResult


PASS, FAIL = Text("pass", "green"), Text("FAIL", "red")  # the consoles take no markup: user text prints as it is


def line(text: str) -> None:
    """One line as it is: no markup, no highlighting, never wrapped (scripts and tests read it)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def size(n: int | None) -> str:
    if n is None:
        return "missing"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1000
    return str(n)


@contextlib.contextmanager
def progress(description: str, total: int | None = None) -> Iterator[Callable[..., None]]:
    """A transient progress bar on stderr, on a terminal only (a bar on a pipe would leave a blank line before a
    one-line error); yields ``step(done=None, total=None, what=None)``: one step more, or ``done`` of ``total``;
    ``what``: the description, as the work goes (what is being built or measured)."""
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err_console, transient=True, disable=not err_console.is_terminal) as bar:
        task = bar.add_task(description, total=total)

        def step(done: int | None = None, of: int | None = None, what: str | None = None) -> None:
            if what is not None:
                bar.update(task, description=what)
            if done is None:
                bar.advance(task)
            else:
                bar.update(task, completed=done, total=of)

        yield step


def _table(title: str, columns: tuple[str, ...], *, left: tuple[str, ...] = ()) -> Table:
    """A table whose columns are right-aligned figures, but those named in ``left``."""
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right")
    return table


def _checks(report: CheckReport | None, quality: EvalReport | None) -> None:
    """The check a folder passed before it was written, on one line of its own (never cut by a table)."""
    line("check: " + (report.summary() if report else "skipped (--no-validate)"))
    if quality is not None:
        line("real text: " + quality.summary())


def exported(result: ExportResult, block: int | None) -> None:
    manifest = result.manifest
    table = Table(title=f"{manifest.name} → {result.folder}", show_header=False)
    table.add_row("kind", manifest.kind + (f" {block}" if block is not None else ""))
    table.add_row("opset", str(manifest.opset))
    for name, info in manifest.files.items():
        table.add_row(name, size(info.bytes))
    if manifest.fusion:
        table.add_row("fusion", manifest.fusion.summary())
    if manifest.quantization:
        table.add_row("quantization", manifest.quantization.summary())
    if manifest.fp16:
        table.add_row("precision", f"float16; fp32 kept for {', '.join(manifest.fp16.kept_fp32) or 'nothing'}")
    if manifest.adapter:
        table.add_row("adapter", manifest.adapter.summary())
    for name, record in manifest.adapters.items():
        table.add_row(f"adapter {name}", record.summary())
    table.add_row("time", ", ".join(f"{k.removesuffix('_seconds')} {v:.1f} s" for k, v in result.timings.items()))
    console.print(table)
    _checks(result.check, result.quality)


def optimized(result: ExportResult, source: Path) -> None:
    manifest = result.manifest
    table = Table(title=f"{source} → {result.folder}", show_header=False)
    if manifest.fusion:
        table.add_row("fusion", manifest.fusion.summary())
        for check, g in manifest.fusion.golden.items():
            table.add_row(f"  {check}", f"{g.found} of {g.expected} ({', '.join(g.ops)})")
    for name, info in manifest.files.items():
        table.add_row(name, size(info.bytes))
    if manifest.quantization:
        ops = ", ".join(f"{n} {op}" for op, n in manifest.quantization.ops.items())
        table.add_row("quantization", f"{manifest.quantization.summary()}; {ops}")
    console.print(table)
    _checks(result.check, result.quality)


def deployed(result: DeployResult, folder: Path) -> None:
    table = Table(title=f"{folder} → {result.folder} ({result.record.precision})", show_header=False)
    for name, files in result.targets.items():
        table.add_row(name, ", ".join(files))
    console.print(table)
    if "web" in result.targets:
        line(f"open the page with: gpt2onnx serve {result.folder}")
    for text in result.record.records.get("mobile", {}).get("summary", []):  # what the mobile target found
        line(text)


def inspected(info: ModelDescription) -> None:
    console.print(
        Text.assemble((str(info.path), "bold"), f"  IR {info.ir_version}, {info.producer or 'unknown producer'}")
    )
    console.print("opsets: " + ", ".join(f"{d} {v}" for d, v in info.opset_imports.items()))
    io = _table("inputs and outputs", ("", "name", "dtype", "dims"), left=("", "name", "dtype", "dims"))
    for kind, tensors in (("input", info.inputs), ("output", info.outputs)):
        for t in tensors:
            io.add_row(kind, t.name, t.dtype, "[" + ", ".join(map(str, t.dims)) + "]")
    console.print(io)
    ops = _table(f"ops ({info.node_count} nodes)", ("domain", "op", "count"), left=("domain", "op"))
    for row in info.op_histogram:
        ops.add_row(row.domain, row.op_type, str(row.count))
    console.print(ops)
    params = info.parameters
    acc = _table("parameters", ("component", "per instance", "instances", "total"), left=("component",))
    for c in params.components:
        acc.add_row(c.component, f"{c.params_per_instance:,}", str(c.instances), f"{c.total:,}")
    for u in params.unnamed:
        acc.add_row(f"{u.name} (unnamed)", f"{u.params:,}", "1", f"{u.params:,}")
    acc.add_row(Text("total", "bold"), "", "", Text(f"{params.total:,}", "bold"))
    console.print(acc)
    console.print("files: " + ", ".join(f"{name} {size(n)}" for name, n in info.files.items()))
    if info.manifest and info.manifest.fusion:
        console.print("fusion: " + info.manifest.fusion.summary())
    if info.manifest:
        line("checked at export: " + info.manifest.check_summary)


def streamed(kind: str, text: str) -> None:
    """generate's text as it comes: the prompt dimmed, then each new piece."""
    console.print(text, end="", markup=False, highlight=False, style="dim" if kind == "prompt" else None)


def generated(result: TextGeneration) -> None:
    """stdout: the text alone. One sequence: its prompt and continuation (a line break after the stream); several:
    each continuation labelled (prompt.sequence). stderr: the beams' scores and how many proposals were kept."""
    beams, per_prompt = result.settings["num_beams"], result.settings["num_return_sequences"]
    notes = []
    if len(result.texts) == 1:
        if beams > 1:  # not streamed: beam search chooses its sequence at the end
            streamed("prompt", result.prompts[0])
            console.print(result.texts[0], end="", markup=False, highlight=False)
        console.print()
    labels = [
        f"{result.prompt_index[row]}.{row % per_prompt}" if per_prompt > 1 else f"{row}"
        for row in range(len(result.texts))
    ]
    for label, text in zip(labels, result.texts) if len(result.texts) > 1 else ():
        console.print(f"{label}: ", end="", markup=False, highlight=False)
        console.print(text, markup=False, highlight=False)
    if beams > 1:
        notes += [f"score of {label}: {score:.4f}" for label, score in zip(labels, result.scores) if score is not None]
    if result.speculation is not None:  # with --prompt-lookup or --draft
        notes.append(result.speculation.summary())
    for note in notes:
        err_console.print(note, style="dim", markup=False, highlight=False, soft_wrap=True)


def parity_report(report: CheckReport) -> None:
    worst = sorted(report.parity_cases(), key=lambda case: -case.logits.max)[:10]
    title = f"parity on {report.runtime}/{report.provider}: {len(report.cases)} cases (worst {len(worst)} shown)"
    columns = ("batch", "past", "prompt", "steps", "Δlogits max", "Δlogits p99", "Δpresent max", "top-1", "tokens")
    table = _table(title, columns)
    for case in worst:
        table.add_row(
            str(case.batch),
            str(case.past),
            str(case.prompt),
            str(case.steps),
            f"{case.logits.max:.1e}",
            f"{case.logits.p99:.1e}",
            f"{case.present.max:.1e}" if case.present else "-",
            f"{100 * case.top1_agreement:.1f}%",
            "equal" if case.tokens_equal else Text("differ", "red"),
        )
    console.print(table)
    console.print(_parity_totals(report))


def _parity_totals(report: CheckReport) -> Table:
    t = report.measured
    summary = Table(title="total", show_header=False)
    summary.add_row("|Δlogits| max / p50 / p99", f"{t.logits.max:.2e} / {t.logits.p50:.2e} / {t.logits.p99:.2e}")
    if t.present is not None:
        summary.add_row(
            "|Δpresent| max / p50 / p99", f"{t.present.max:.2e} / {t.present.p50:.2e} / {t.present.p99:.2e}"
        )
    else:
        summary.add_row("|Δpresent|", f"not exposed by {report.runtime}")
    summary.add_row("top-1 agreement", f"{100 * t.top1_agreement:.3f}% of {t.positions_compared:,} positions")
    summary.add_row("top-5 agreement", f"{100 * t.top5_agreement:.3f}%")
    summary.add_row("KL(reference ‖ onnx) mean / max", f"{t.kl.mean:.2e} / {t.kl.max:.2e}")
    summary.add_row(
        "greedy tokens before divergence",
        f"min {t.tokens_before_divergence.min}, mean {t.tokens_before_divergence.mean:.1f}",
    )
    summary.add_row("NaN/Inf", str(t.nonfinite))
    summary.add_row("prompts", t.prompts or "random token ids")
    if report.placement is not None:
        summary.add_row("node placement", report.placement.summary())
    summary.add_row("greedy tokens equal", f"{t.tokens_equal_cases} of {t.cases} cases")
    if report.kv_path is not None and report.kv_path.skipped:
        summary.add_row("K/V path", f"not checked: {report.kv_path.skipped}")
    for check in report.kv_path.checks if report.kv_path is not None else []:
        summary.add_row(
            f"K/V path: {check.description}", Text.assemble(check.figures(), ("" if check.passed else (" FAIL", "red")))
        )
    summary.add_row("verdict", PASS if report.passed else Text.assemble(FAIL, ": " + "; ".join(report.failures)))
    return summary


def benched(report: BenchReport, plot: Path | None) -> None:
    models = report.models
    config = models[0].config
    runtimes = len({m.runtime for m in models})
    where = ", ".join(f"{m.runtime}/{m.provider}" for m in models[:runtimes])
    title = f"on {where}: prompt {config.prompt_len}, {config.new_tokens} new tokens, ms, median of {config.repeat}"
    columns = ("model", "batch", "TTFT ms", "decode p50", "p90", "p99", "+/100 past", "tok/s", "RAM MB")
    table = _table(title, columns, left=("model",))
    for run in report.runs:
        decode = run.decode_ms
        table.add_row(
            run.label,
            str(run.batch),
            f"{run.prompt_ms.p50:.1f}",
            *((f"{decode.p50:.2f}", f"{decode.p90:.2f}", f"{decode.p99:.2f}") if decode else ("-", "-", "-")),
            f"{run.decode_growth_ms_per_100_past:.2f}" if decode else "-",
            f"{run.tokens_per_s:.0f}",
            f"{run.peak_host_bytes / 1e6:.0f}",
        )
    console.print(table)
    if config.pasts:
        columns = ("model", "batch", *map(str, config.pasts), "K/V cache MB at the last")
        buffer = f", a buffer of {config.capacity} where it preallocates" if config.capacity else ""
        title = f"decode step (ms, median of {config.repeat}{buffer}) at past length"
        by_past = _table(title, columns, left=("model",))
        for run in report.runs:
            if run.decode_ms_at_past:
                cells = []
                for past, ms in run.decode_ms_at_past:
                    ratio = run.ratio(f"decode_ms_at_past_{past}")
                    shown = ratio is not None and run.label != run.rounds.baseline
                    cells.append(f"{ms:.2f}" + (f" (×{ratio.median:.2f})" if shown else ""))
                held = run.kv_cache_bytes_at_past[-1][1] / 1e6 if run.kv_cache_bytes_at_past else float("nan")
                by_past.add_row(run.label, str(run.batch), *cells, f"{held:.3g}")
        console.print(by_past)
    _bench_notes(report, runtimes, plot)


def generation(report) -> None:
    """bench generate: each side's seconds per run and beams × steps per second, gpt2onnx's ratio round by round."""
    rounds = report.rounds
    title = (
        f"generation, batch {report.batch} × {report.beams} beams, prompt {report.prompt_len},"
        f" {'' if report.exact_length else 'up to '}{report.new_tokens} new tokens"
        f" (median of {len(rounds.orders)} rounds)"
    )
    table = _table(title, ("run", "s per run", "beams × steps / s", "× transformers"), left=("run",))
    for variant in rounds.variants:
        ratio = rounds.ratio(variant, "beam_steps_per_s")
        table.add_row(
            variant,
            rounds.spread(variant, "seconds").shown(),
            f"{rounds.spread(variant, 'beam_steps_per_s').median:.1f}",
            f"{ratio.median:.2f} ({ratio.low:.2f}–{ratio.high:.2f})" if ratio is not None else "-",
        )
    console.print(table)
    line(f"the same tokens as transformers: {'yes' if report.same_tokens else 'NO'}; torch on {report.torch_device}")
    line(f"{rounds.machine.summary()}; {rounds.load.summary()}")


def speculative(report) -> None:
    """bench speculative: each run's new tokens per second by kind of prompt, its ratio to gpt2onnx's greedy."""
    columns = ("prompts", "run", "tok/s", "× greedy", "tokens/step", "kept", "same tokens")
    table = _table(f"speculative decoding ({report.proposer}), batch 1", columns, left=("prompts", "run"))
    by_kind = dict(report.rounds)
    for run in report.runs:
        rounds = by_kind[run.kind]
        ratio = rounds.ratio(run.run, "tokens_per_s")
        table.add_row(
            run.kind,
            run.run,
            f"{rounds.spread(run.run, 'tokens_per_s').median:.0f}",
            f"{ratio.median:.2f}",
            f"{run.tokens_per_target_step:.2f}",
            "-" if run.acceptance is None else f"{100 * run.acceptance:.0f} %",
            "yes" if run.same_tokens else "NO",
        )
    console.print(table)
    first = report.rounds[0][1]
    line(f"{first.machine.summary()}; {first.load.summary()}")


def constraint_cost(report) -> None:
    """bench constraint: per constraint, ms per token of the decode step without and with it and of its mask and
    advance alone (medians), and the mask's share of the unconstrained step (round by round)."""
    step = report.step()
    title = f"constraint cost, batch 1, {len(report.rounds.orders)} rounds: decode step {step.median:.3g} ms/token"
    columns = ("constraint", "tokens", "constrained ms", "mask + advance ms", "of a step")
    table = _table(title, columns, left=("constraint",))
    for run in report.runs:
        share = report.share(run)
        table.add_row(
            run.name,
            f"{run.tokens}{'' if run.complete else ' (incomplete)'}",
            f"{report.constrained(run).median:.3g}",
            f"{report.mask(run).median:.3g}",
            f"{100 * share.median:.2g} %",
        )
    console.print(table)
    line(f"decode step without a constraint: {step.shown()} ms per token (median, quartiles)")
    line(f"{report.rounds.machine.summary()}; {report.rounds.load.summary()}")


def compared(report) -> None:
    """compare: a variant a row, the speed figures' medians and, scored, the quality figures (the ratios to the
    baseline, round by round, are in --md, --json and --csv)."""
    s, speed = report.settings, report.speed
    names = {"prompt_ms": "prompt ms", "decode_ms": "decode ms", "tokens_per_s": "tok/s"}
    figures = speed.figures
    columns = ("variant", *(names.get(f, f"b{s.batch} ms") for f in figures), "RSS MB", "MB")
    if report.quality is not None:
        columns += ("ΔPPL %", "KL", "top-1 %")
    title = f"{report.checkpoint}: b1×{s.prompt_len} + {s.new_tokens}, {s.threads} threads, {len(speed.orders)} rounds"
    table = _table(title, columns, left=("variant",))
    table.columns[0].no_wrap = True
    for record in report.variants:
        cells = [record.name, *(f"{speed.spread(record.name, f).median:.3g}" for f in figures)]
        cells += [f"{record.peak_bytes / 1e6:.0f}", f"{record.file_bytes / 1e6:.0f}"]
        q = report.quality_row(record.name)
        if q is not None:
            cells += [f"{q.delta_ppl_percent:+.2g}", f"{q.kl.mean:.2g}", f"{100 * q.same_top1:.1f}"]
        table.add_row(*cells)
    console.print(table)
    line(f"{speed.machine.summary()}; {speed.load.summary()}")
    for missing in report.missing:
        line(f"not compared: {missing}")


def precision_grid(report) -> None:
    """bench precision: a variant a row, its quality against PyTorch fp32, its size and speed (× fp32-ort's)."""
    s = report.settings
    columns = ("variant", "ΔPPL %", "KL mean", "KL p99", "top-1 %", "MB", "decode ms", "prompt ms")
    table = _table(f"precisions: {report.model}", columns, left=("variant",))
    rounds = report.rounds
    for name, q in zip(report.recipes, report.quality.rows):
        timing = []
        for figure in ("decode_ms", "prompt_ms"):
            ratio = rounds.ratio(name, figure)
            shown = f"{rounds.spread(name, figure).median:.3g}"
            timing.append(shown + (f" ×{ratio.median:.2f}" if ratio is not None and name != rounds.baseline else ""))
        table.add_row(
            name,
            f"{q.delta_ppl_percent:+.2f}",
            f"{q.kl.mean:.2e}",
            f"{q.kl.p99:.2e}",
            f"{100 * q.same_top1:.1f}",
            f"{report.sizes[name] / 1e6:.1f}",
            *timing,
        )
    console.print(table)
    line(f"decode b1 at past {s.past}, prompt b1×{s.prompt_len}; {rounds.machine.summary()}; {rounds.load.summary()}")
    for name, why in report.refused.items():
        line(f"{name}: refused by its own check, not measured: {why}")
    cpus = list(next(iter(report.portability.values()), {}))
    for cpu in cpus:
        by = {name: figures[cpu] for name, figures in report.portability.items()}
        differ = [name for name, f in by.items() if not f.greedy_equal]
        worst = max(by, key=lambda name: by[name].kl_mean)
        line(
            f"on {cpu} ({report.cpus_seen[cpu].model}): greedy tokens equal for {len(by) - len(differ)} of"
            f" {len(by)} variants{' (not ' + ', '.join(differ) + ')' if differ else ''}; largest KL against this CPU"
            f" {by[worst].kl_mean:.1e} ({worst})"
        )


def served(report) -> None:
    """bench served: a run a row (in-process, then each client count), tokens/s with its ratio to in-process."""
    rounds = report.rounds
    columns = ("run", "tok/s", "× in-process", "first token p50 / p99 ms", "per token p50 / p99 ms")
    table = _table(f"{report.folder}: {report.new_tokens} new tokens a request", columns, left=("run",))
    table.columns[0].no_wrap = True
    for run in rounds.variants:
        ratio = rounds.ratio(run, "tokens_per_s")
        pair = lambda a, b: f"{rounds.spread(run, a).median:.1f} / {rounds.spread(run, b).median:.1f}"  # noqa: E731
        table.add_row(
            run,
            f"{rounds.spread(run, 'tokens_per_s').median:.1f}",
            f"{ratio.median:.2f}",
            pair("first_token_p50_ms", "first_token_p99_ms"),
            pair("per_token_p50_ms", "per_token_p99_ms"),
        )
    console.print(table)
    line(f"{rounds.machine.summary()}; {rounds.load.summary()}")


def served_openai(report) -> None:
    """bench served --server openai: a concurrency and server a row (medians), then each server's memory."""
    rounds = report.rounds
    columns = ("clients", "server", "req/s", "tok/s", "first token p50 / p99 ms", "per token p50 / p99 ms", "peak MB")
    table = _table(f"{report.folder}: {report.new_tokens} new tokens a request", columns, left=("server",))
    for clients in report.concurrency:
        for server in report.servers:
            m = lambda f: rounds.spread(f"{server}, {clients} client{'s' if clients > 1 else ''}", f).median  # noqa: E731
            table.add_row(
                str(clients),
                server,
                f"{m('requests_per_s'):.2f}",
                f"{m('tokens_per_s'):.1f}",
                f"{m('first_token_p50_ms'):.0f} / {m('first_token_p99_ms'):.0f}",
                f"{m('per_token_p50_ms'):.1f} / {m('per_token_p99_ms'):.1f}",
                f"{m('peak_rss_mb'):.0f}",
            )
    console.print(table)
    for text in report.memory_lines() + report.ratio_lines():
        line(text)
    line(f"{rounds.machine.summary()}; {rounds.load.summary()}")


def web(report) -> None:
    """bench web: a runtime and thread count a row, decode tokens/s (× Python's) and the first token."""
    rounds = report.rounds
    columns = ("run", "decode tok/s", f"× {rounds.baseline}", "first token ms")
    table = _table(f"{report.folder} ({report.precision}), {report.new_tokens} new tokens", columns, left=("run",))
    table.columns[0].no_wrap = True
    for run in rounds.variants:
        ratio = rounds.ratio(run, "decode_tokens_per_s")
        table.add_row(
            run,
            f"{rounds.spread(run, 'decode_tokens_per_s').median:.1f}",
            f"{ratio.median:.2f}",
            f"{rounds.spread(run, 'first_token_ms').median:.0f}",
        )
    console.print(table)
    line(
        f"the same tokens everywhere: {'yes' if report.same_tokens else 'NO'}; {rounds.machine.summary()};"
        f" {rounds.load.summary()}"
    )


def memory(report) -> None:
    """bench memory: a run a row, its growth beside the estimate (a MemoryReport)."""
    columns = ("folder", "rows × prompt + new", "grew MB", "estimate MB", "grown / estimate", "cache MB")
    table = _table("host memory of a greedy decode, each run in its own process", columns, left=("folder",))
    for r in report.runs:
        table.add_row(
            r.label or Path(r.folder).name,
            f"{r.rows} × {r.prompt} + {r.new}",
            f"{r.grown_bytes / 1e6:,.1f}",
            f"{r.estimate_bytes / 1e6:,.1f}",
            f"{r.of_estimate:.2f}",
            f"{r.cache_bytes / 1e6:,.1f}",
        )
    console.print(table)


def _bench_rounds(report: BenchReport) -> None:
    """Several folders: each one's ratios to the first, taken round by round (median and quartiles); the load."""
    shown = {"decode_ms": "decode", "prompt_ms": "prompt", "tokens_per_s": "tokens/s"}
    interleaved = [run for run in report.runs if run.rounds is not None]
    if interleaved:
        first = interleaved[0].rounds
        line(
            f"{first.rounds} rounds in rotating order; each folder against {first.baseline}, round by round"
            " (median, quartiles):"
        )
    for run in interleaved:
        if run.label == run.rounds.baseline:
            continue
        parts = [f"{name} ×{r.shown()}" for key, name in shown.items() if (r := run.ratio(key)) is not None]
        line(f"  {run.label} batch {run.batch}: " + ", ".join(parts))
    loads = [run.load for run in report.runs if run.load is not None]
    if loads:
        others = [x.others for x in loads if x.others is not None]
        busy = f", other processes up to {100 * max(others):.0f} % of the CPUs" if others else ""
        line(f"load {loads[0].before:.2f} → {loads[-1].after:.2f}{busy}")


def _bench_notes(report: BenchReport, runtimes: int, plot: Path | None) -> None:
    """Below the table: each folder's precision and size, TF32, the speed-ups over PyTorch, the plot."""
    models = list({model.model: model for model in report.models[::runtimes]}.values())  # bench --adapter: twice
    for model, name in zip(models, folder_labels([Path(model.model).parent for model in models])):
        text = f"{name}: {model.precision}, {size(model.model_bytes)}"
        line(text + (f"; {model.placement.summary()}" if model.placement is not None else ""))
    _bench_rounds(report)
    tf32 = {run.runtime or run.engine: run.tf32 for run in report.runs if run.tf32 is not None}
    if tf32:
        console.print("TF32 in fp32 matmuls: " + ", ".join(f"{k} {'on' if v else 'off'}" for k, v in tf32.items()))
    for run in report.runs:
        if run.speculation is not None:
            rows = " (rows one at a time)" if run.batch > 1 else ""
            same = "" if run.same_tokens in (True, None) else "; NOT the plain run's tokens"
            console.print(
                f"batch {run.batch}: {run.label}: tokens/s ×{run.speedup_over_plain:.2f} vs plain decoding{rows};"
                f" {run.speculation.summary()}{same}",
                highlight=False,
                markup=False,
            )
        for label, s in run.speedup_by_label.items():
            step = f", decode step ×{s.decode:.2f}" if s.decode == s.decode else ""  # nan: no per-token step
            console.print(
                f"batch {run.batch}: {label} vs torch eager: first token ×{s.prompt:.2f}{step},"
                f" tokens/s ×{s.tokens_per_s:.2f}",
                highlight=False,
            )
        if run.note:
            console.print(f"batch {run.batch}: {run.note}", highlight=False)
    if plot:
        console.print(f"plot written to {plot}")


def evaluated(report: EvalReport) -> None:
    p = report.protocol
    line(
        f"{p.method}: {p.scored_tokens:,} scored tokens of {p.source} ({p.tokens:,} tokens), context"
        f" {p.context}, stride {p.stride}, {p.windows} windows; against {p.reference}"
    )
    ref, rows = report.reference, report.rows
    # one column per model, so that several folders fit a terminal
    table = Table(title=f"greedy: {p.greedy_prompt_tokens} prompt tokens from the text's start")
    table.add_column("")
    table.add_column("reference", justify="right")
    for r in rows:
        table.add_column(Path(r.label).name, justify="right")
    for name, ref_value, value in _EVAL_FIGURES:
        table.add_row(name, ref_value(ref), *(value(r) for r in rows))
    console.print(table)


def _short(name: str) -> str:
    """A precision as tables spell it (fp32, fp16, int8, ...)."""
    return PRECISIONS[name].short if name in PRECISIONS else name


def _greedy(r: EvalRow) -> str:
    if r.greedy is None:
        return "-"
    if r.greedy.first_divergence is None:
        return f"same {r.greedy.new_tokens} tokens"
    return f"differs at token {r.greedy.first_divergence}"


def _none(r: EvalRow) -> str:
    return ""


# eval's rows: name, the reference's cell, a folder's cell
_EVAL_FIGURES = (
    ("precision", lambda r: _short(r.precision), lambda r: _short(r.precision)),
    (
        "runtime",
        lambda r: r.runtime,
        lambda r: f"{r.runtime}/{r.provider}" + (", token by token" if r.token_by_token else ""),
    ),
    ("PPL ± se", lambda r: f"{r.ppl:.6g} ± {r.ppl_stderr:.2g}", lambda r: f"{r.ppl:.6g} ± {r.ppl_stderr:.2g}"),
    ("ΔPPL % ± se", _none, lambda r: f"{r.delta_ppl_percent:+.3f} ± {r.delta_ppl_stderr:.2g}"),
    ("mean KL ± se", _none, lambda r: f"{r.kl.mean:.3g} ± {r.kl.stderr:.2g}"),
    ("KL p99 / max", _none, lambda r: f"{r.kl.p99:.2g} / {r.kl.max:.2g}"),
    ("same top-1", _none, lambda r: f"{100 * r.same_top1:.2f} %"),
    ("RMS Δp", _none, lambda r: f"{r.rms_dp:.3g}"),
    ("greedy", _none, _greedy),
    ("verdict", _none, lambda r: "-" if r.check is None else PASS if r.check.passed else FAIL),
)


def preflighted(result) -> None:
    """check's answer: the choices asked about, the verdict, each conflict in one line, a GPU provider's kernels."""
    table = _table("preflight", ("", ""), left=("", ""))
    table.add_row("asked", "\n".join(result.question))
    table.add_row("verdict", "supported" if result.ok else f"not supported ({len(result.conflicts)})")
    for line_ in result.conflicts:
        table.add_row("conflict", line_)
    for kernel in result.kernels:
        table.add_row("kernels", kernel)
    if "batch_invariant" in result.facts:  # a row's tokens alone and among others (issue 54)
        invariant = result.facts["batch_invariant"]
        depends = result.facts.get("batch_dependent") or ""
        table.add_row(
            "batch", "invariant: a row computes the same alone and batched" if invariant else f"depends: {depends}"
        )
    console.print(table)
