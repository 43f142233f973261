"""Rendering the measuring commands' results (bench's subcommands and compare) as tables and lines on stdout; the
other commands' are in render.py, whose helpers these share."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gpt2onnx.artifact.paths import folder_labels
from gpt2onnx.cli.app import console
from gpt2onnx.cli.render import _table, line, size

if TYPE_CHECKING:  # the results' types only: rendering imports no library module that would pull in torch
    from gpt2onnx.benchmarks.bench import BenchReport


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
