"""Rendering: each command's typed result as tables and lines on stdout (errors go to stderr, in app.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from gpt2onnx.capabilities import PADDING_SUMS
from gpt2onnx.cli.app import console, err_console
from gpt2onnx.precisions.all_precisions import PRECISIONS

if TYPE_CHECKING:  # the results' types only: rendering imports no library module that would pull in torch
    from gpt2onnx.artifact.inspect import ModelDescription
    from gpt2onnx.artifact.report import CheckReport, EvalReport, EvalRow
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
    beams, per_prompt = result.settings.decoding.num_beams, result.settings.decoding.num_return_sequences
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
        dependent = result.facts.get("batch_dependent") or ()
        reasons = [dependent] if isinstance(dependent, str) else sorted(dependent)
        if result.facts.get("padding_dependent"):
            reasons.append(f"{PADDING_SUMS} (the batching engine runs such rows in groups by their padding)")
        table.add_row(
            "batch",
            "invariant: a row computes the same alone, batched and left-padded"
            if result.facts["batch_invariant"]
            else "depends: " + "; ".join(reasons),
        )
    console.print(table)
