"""The gpt2onnx command line: parse options, call the library, print with rich. No logic lives here."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

from gpt2onnx import __version__
from gpt2onnx.errors import Gpt2OnnxError

console = Console()
err_console = Console(stderr=True)


class OneLineErrors(typer.core.TyperGroup):
    """Every failure the user can cause ends as one line on stderr and a non-zero exit, never a traceback."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except typer.TyperException as err:  # usage errors: bad option values, missing options
            if not standalone_mode:
                raise
            message = err.format_message() if hasattr(err, "format_message") else str(err)
            err_console.print(f"error: {message} (see --help)", markup=False, highlight=False, soft_wrap=True)
            sys.exit(getattr(err, "exit_code", 2))
        except typer.Abort:
            err_console.print("aborted", markup=False)
            sys.exit(1)
        except Gpt2OnnxError as err:
            if not standalone_mode:
                raise
            err_console.print(f"error: {err}", markup=False, highlight=False, soft_wrap=True)
            sys.exit(1)
        if standalone_mode:
            sys.exit(rv if isinstance(rv, int) else 0)
        return rv


app = typer.Typer(
    cls=OneLineErrors,
    help="GPT-2 from a PyTorch checkpoint to a verified, fast ONNX decoder with past key/values.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        console.print(f"gpt2onnx {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log each step.")] = False,
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = None,
) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err_console, show_path=False)],
        force=True,
    )
    for noisy in ("transformers", "huggingface_hub", "torch"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _size(n: int | None) -> str:
    if n is None:
        return "missing"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1000
    return str(n)


@app.command()
def export(
    model: Annotated[
        str,
        typer.Option(
            "--model", "-m", help="Local Hugging Face folder, Hub id, or (with --random-init) architecture name or config.json."
        ),
    ],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Output folder \\[default: models/<name>].")] = None,
    random_init: Annotated[
        bool, typer.Option("--random-init", help="Seeded random weights for a named architecture or a config.json.")
    ] = False,
    seed: Annotated[int, typer.Option(help="Seed for --random-init.")] = 0,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit).")] = None,
    opset: Annotated[Optional[int], typer.Option(help="ONNX opset, 14 to 20 \\[default: 17].")] = None,
    logits: Annotated[str, typer.Option(help="'all' positions, or 'last' only (\\[batch, 1, vocab]).")] = "all",
    block: Annotated[Optional[int], typer.Option(help="Export transformer block I alone.")] = None,
    external_data: Annotated[
        Optional[bool],
        typer.Option(
            "--external-data/--no-external-data",
            help="Weights in model.onnx_data \\[default: only past protobuf's 2 GB limit].",
            show_default=False,
        ),
    ] = None,
    validate: Annotated[bool, typer.Option(help="Check against PyTorch before writing.")] = True,
    tolerance: Annotated[Optional[float], typer.Option(help="Max |Δlogits| accepted \\[default: 1e-4 for fp32].")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output folder.")] = False,
) -> None:
    """Export a GPT-2 checkpoint to an ONNX decoder with past key/values, validated against PyTorch."""
    from gpt2onnx.exporters.export import ExportOptions
    from gpt2onnx.exporters.export import export as run_export
    from gpt2onnx.exporters.torch_export import DEFAULT_OPSET

    options = ExportOptions(
        opset=DEFAULT_OPSET if opset is None else opset,
        logits=logits,
        block=block,
        external_data=external_data,
        validate=validate,
        tolerance=tolerance,
        force=force,
    )
    with err_console.status(f"exporting {model}…"):
        result = run_export(model, out, random_init=random_init, seed=seed, revision=revision, options=options)
    manifest = result.manifest
    table = Table(title=f"{manifest['name']} → {result.folder}", show_header=False)
    table.add_row("kind", manifest["kind"] + (f" {options.block}" if options.block is not None else ""))
    table.add_row("opset", str(manifest["opset"]))
    for name, info in manifest["files"].items():
        table.add_row(name, _size(info["bytes"]))
    parity = manifest["parity"]
    table.add_row(
        "parity",
        "skipped (--no-validate)"
        if parity is None
        else f"max |Δlogits| {parity['max_abs_logits']:.2e}, max |Δpresent| {parity['max_abs_present']:.2e}"
        f" (tolerance {parity['tolerance']:.0e})",
    )
    table.add_row("time", ", ".join(f"{k.removesuffix('_seconds')} {v:.1f} s" for k, v in result.timings.items()))
    console.print(table)


@app.command("inspect")
def inspect_command(
    path: Annotated[Path, typer.Argument(help="An .onnx file or an exported folder.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print everything as JSON.")] = False,
) -> None:
    """Show inputs, outputs, opsets, op histogram, file sizes and parameter accounting of an ONNX model."""
    from gpt2onnx.inspection import inspect_model

    info = inspect_model(path)
    if as_json:
        console.print_json(json.dumps(info))
        return
    console.print(f"[bold]{info['path']}[/]  IR {info['ir_version']}, {info['producer'] or 'unknown producer'}")
    console.print("opsets: " + ", ".join(f"{d} {v}" for d, v in info["opset_imports"].items()))
    io = Table(title="inputs and outputs")
    for col in ("", "name", "dtype", "dims"):
        io.add_column(col)
    for kind in ("inputs", "outputs"):
        for t in info[kind]:
            io.add_row(kind[:-1], t["name"], t["dtype"], escape("[" + ", ".join(map(str, t["dims"])) + "]"))
    console.print(io)
    ops = Table(title=f"ops ({info['node_count']} nodes)")
    for col in ("domain", "op", "count"):
        ops.add_column(col, justify="right" if col == "count" else "left")
    for row in info["op_histogram"]:
        ops.add_row(row["domain"], row["op_type"], str(row["count"]))
    console.print(ops)
    params = info["parameters"]
    acc = Table(title="parameters")
    for col in ("component", "per instance", "instances", "total"):
        acc.add_column(col, justify="left" if col == "component" else "right")
    for c in params["components"]:
        acc.add_row(c["component"], f"{c['params_per_instance']:,}", str(c["instances"]), f"{c['total']:,}")
    for u in params["unnamed"]:
        acc.add_row(f"{u['name']} (unnamed)", f"{u['params']:,}", "1", f"{u['params']:,}")
    acc.add_row("[bold]total[/]", "", "", f"[bold]{params['total']:,}[/]")
    console.print(acc)
    console.print("files: " + ", ".join(f"{name} {_size(size)}" for name, size in info["files"].items()))
    if info["manifest"] and info["manifest"].get("parity"):
        parity = info["manifest"]["parity"]
        console.print(f"parity at export: max |Δlogits| {parity['max_abs_logits']:.2e} (tolerance {parity['tolerance']:.0e})")
