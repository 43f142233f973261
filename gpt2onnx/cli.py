"""The gpt2onnx command line: each command parses its options, calls one library function and renders the result."""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import json
import logging
import os
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

from gpt2onnx import __version__
from gpt2onnx.errors import BadInput, Gpt2OnnxError

if TYPE_CHECKING:
    from gpt2onnx.artifact.report import CheckReport
    from gpt2onnx.runtimes.providers import ProviderConfig
    from gpt2onnx.verify.evaluate import EvalReport

INTERNAL_ERROR = 70  # a bug of ours, not the user's: still one line, and the traceback with --verbose

console = Console()
err_console = Console(stderr=True)


# --help at 80 columns: a short metavar per value type (typer shows "<list[str]>", "<int>"), none for flags
_METAVARS = {int: "N", float: "X"}


class OutputPath:
    """The parser of every option that names a path a command writes (--json, --plot, -o, a cache folder): the
    value becomes a Path as it is, and the library checks it with gpt2onnx.artifact.paths.check_output_path
    before any work. Declared on each such option so that tests find them all (tests/bad_input_cases.py feeds
    each the same hostile paths)."""

    def __init__(self, kind: str):
        self.kind = kind  # "file" or "folder"
        self.__name__ = f"output {kind}"

    def __call__(self, value) -> Path:
        return Path(value)


OUTPUT_FILE, OUTPUT_FOLDER = OutputPath("file"), OutputPath("folder")


def _short_metavars(command, ctx) -> None:
    help_option = command.get_help_option(ctx)
    if help_option is not None and help_option.metavar is None:
        help_option.metavar = ""
    for param in command.params:
        if isinstance(param, typer.core.TyperArgument) and param.type_descriptor.is_list:
            param.display_type_rich = lambda ctx: "PATH..."  # typer shows "<list[Path]>" and ignores metavar
        if not isinstance(param, typer.core.TyperOption) or param.metavar is not None:
            continue
        descriptor = param.type_descriptor
        if param.is_flag:
            param.metavar = ""
        elif descriptor.is_path:
            param.metavar = "PATH"
        else:
            element = (typing.get_args(descriptor.annotation) or (descriptor.annotation,))[0]
            param.metavar = _METAVARS.get(element, "TEXT")


class OneLineErrors(typer.core.TyperGroup):
    """Every failure the user can cause ends as one line on stderr and a non-zero exit, never a traceback."""

    def format_help(self, ctx, formatter):
        _short_metavars(self, ctx)
        return super().format_help(ctx, formatter)

    def get_command(self, ctx, cmd_name):
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _short_metavars(command, ctx)
        return command

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        try:
            _refuse_underscored_numbers(args[0] if args else kwargs.get("args"))
            rv = super().main(*args, standalone_mode=False, **kwargs)
            if standalone_mode:
                sys.stdout.flush()  # a full or closed stdout fails here, not at exit
        except typer.TyperException as err:  # usage errors: bad option values, missing options
            if not standalone_mode:
                raise
            err_console.print(
                f"error: {err.format_message()} (see --help)", markup=False, highlight=False, soft_wrap=True
            )
            sys.exit(err.exit_code)
        except typer.Abort:
            err_console.print("aborted", markup=False)
            sys.exit(1)
        except Gpt2OnnxError as err:
            if not standalone_mode:
                raise
            err_console.print(f"error: {err}", markup=False, highlight=False, soft_wrap=True)
            sys.exit(err.exit_code)
        except KeyboardInterrupt:
            err_console.print("interrupted", markup=False)
            sys.exit(130)
        except OSError as err:
            if not standalone_mode or err.errno not in (errno.ENOSPC, errno.EPIPE, errno.EIO, errno.EDQUOT):
                if not standalone_mode:
                    raise
                _internal_error(err)
            with contextlib.suppress(OSError):  # what is still buffered goes nowhere, quietly, at exit
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            err_console.print(
                f"error: cannot write the output to stdout ({os.strerror(err.errno)}):"
                " free space, or send it elsewhere",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            sys.exit(4)
        except MemoryError:
            if not standalone_mode:
                raise
            err_console.print("error: out of memory: use a smaller model, batch or length", markup=False)
            sys.exit(4)
        except Exception as err:  # a bug: one line for the user, the traceback in the log with --verbose
            if not standalone_mode:
                raise
            _internal_error(err)
        if standalone_mode:
            sys.exit(rv if isinstance(rv, int) else 0)
        return rv


def _internal_error(err: BaseException) -> None:
    logging.getLogger("gpt2onnx").debug("internal error", exc_info=err)
    text = str(err).splitlines()[0][:200] if str(err).strip() else ""
    err_console.print(
        f"error: internal error ({type(err).__name__}: {text}); please report it with the command you ran"
        " (--verbose shows the traceback)",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    sys.exit(INTERNAL_ERROR)


_UNDERSCORED_NUMBER = re.compile(r"[+-]?[0-9][0-9_]*_[0-9_]*(?:\.[0-9_]*)?(?:[eE][+-]?[0-9_]+)?")
# free text, paths and names, or values parsed by their own parser: never read by int() or float()
_TEXT_OPTIONS = (
    "--prompt",
    "--ids",
    "--model",
    "--out",
    "--reference",
    "--revision",
    "--json",
    "--plot",
    "--trt-cache-dir",
    "--triton-name",
    "--target",
    "--device",
)


def _refuse_underscored_numbers(args) -> None:
    """Python's int() and float(), which parse option values, read '1_0' as 10: refuse it as a typo."""
    args = list(sys.argv[1:] if args is None else args)
    for before, value in zip(args, args[1:]):
        flag = before.split("=")[0]
        if flag.startswith("--") and flag not in _TEXT_OPTIONS and _UNDERSCORED_NUMBER.fullmatch(value):
            raise BadInput(f"{flag} '{value}' is not a number as written: give it without underscores")
    for arg in args:
        flag, _, value = arg.partition("=")
        if flag.startswith("--") and flag not in _TEXT_OPTIONS and _UNDERSCORED_NUMBER.fullmatch(value):
            raise BadInput(f"{flag} '{value}' is not a number as written: give it without underscores")


app = typer.Typer(
    cls=OneLineErrors,
    help="GPT-2 from a PyTorch checkpoint to a verified, fast ONNX decoder with past key/values.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


QuantizeOpt = Annotated[str, typer.Option("--quantize", help="Weights: none, int8 or int4.")]
BlockSizeOpt = Annotated[
    Optional[int], typer.Option(help="Block-wise tensors: weights per scale, 16 to 256 \\[default: 32].")
]
AccuracyLevelOpt = Annotated[
    Optional[int], typer.Option(help="int4 arithmetic: 0 (fp32) or 4 (int8) [default: recipe].", show_default=False)
]
LmHeadOpt = Annotated[
    Optional[str], typer.Option("--lm-head", help="Logits projection: int4, int8, fp32 [default: recipe].")
]
EmbeddingsOpt = Annotated[Optional[str], typer.Option(help="Embeddings: int4, int8, fp32 [default: recipe].")]
KeepFp32Opt = Annotated[
    str,
    typer.Option(
        "--keep-fp32",
        metavar="LIST",
        show_default=False,
        help="fp16: kept fp32, of layernorm, softmax, logits \\[default: all]; or none.",
    ),
]
GateOpt = Annotated[
    Optional[list[str]],
    typer.Option("--gate", metavar="NAME=X", help="Override a gate, e.g. kl_mean=0.02 (repeatable)."),
]

VerifyFilesOpt = Annotated[
    bool,
    typer.Option("--verify-files/--no-verify-files", help="Check the model files' sha256 first."),
]


def shared_options(spec, make, into: str):
    """A decorator giving a command the options in ``spec`` (name, type, default), declared once, and passing
    them to it as one argument ``into``, built (and checked) by ``make(values)``."""

    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != into]
        shared = [
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d, annotation=t) for n, t, d in spec
        ]

        @functools.wraps(command)
        def with_options(**kwargs):
            values = {name: kwargs.pop(name) for name, _, _ in spec}
            return command(**kwargs, **{into: make(values)})

        with_options.__signature__ = signature.replace(parameters=own + shared)
        with_options.__annotations__ = {p.name: p.annotation for p in own + shared}
        return with_options

    return decorate


@dataclass(frozen=True)
class PrecisionChoice:
    """What export and optimize share: the dtype, what fp16 keeps in fp32, the weight quantization, gate overrides."""

    dtype: str
    keep_fp32: tuple[str, ...]
    quantize: str
    block_size: int
    gates: dict | None
    accuracy_level: int | None = None
    lm_head: str | None = None
    embeddings: str | None = None

    def quantization(self):
        from gpt2onnx.passes.precision import QuantizeOptions

        return QuantizeOptions(self.quantize, self.block_size, self.accuracy_level, self.lm_head, self.embeddings)


_PRECISION_OPTIONS = (
    ("dtype", Annotated[str, typer.Option(help="fp32, or fp16 (see --keep-fp32).")], "fp32"),
    ("keep_fp32", KeepFp32Opt, "layernorm,softmax,logits"),
    ("quantize", QuantizeOpt, "none"),
    ("block_size", BlockSizeOpt, None),
    ("accuracy_level", AccuracyLevelOpt, None),
    ("lm_head", LmHeadOpt, None),
    ("embeddings", EmbeddingsOpt, None),
    ("gate", GateOpt, None),
)


def _make_precision(values: dict) -> PrecisionChoice:
    from gpt2onnx.passes.precision import parse_keep_fp32
    from gpt2onnx.verify.gates import parse_gates

    return PrecisionChoice(
        values["dtype"],
        parse_keep_fp32(values["keep_fp32"]),
        values["quantize"],
        _block_size(values["block_size"], values["quantize"]),
        parse_gates(values["gate"]) or None,
        values["accuracy_level"],
        values["lm_head"],
        values["embeddings"],
    )


def _block_size(value: int | None, quantize: str) -> int:
    """--block-size given without quantized weights would be ignored: refused; the default is 32."""
    if value is not None and quantize == "none":
        raise BadInput("--block-size applies to quantized weights: add --quantize int8 or int4, or drop it")
    return 32 if value is None else value


precision_options = shared_options(_PRECISION_OPTIONS, _make_precision, "precision")


@dataclass(frozen=True)
class EvalChoice:
    """What export and optimize share with eval: a text to check the new folder on, and the gates on it."""

    text: str | None
    max_ppl_increase: float | None
    max_kl: float | None


MaxPplOpt = Annotated[Optional[float], typer.Option(help="Gate: the most ΔPPL %.")]
MaxKlOpt = Annotated[Optional[float], typer.Option(help="Gate: the most mean KL.")]
_EVAL_OPTIONS = (
    (
        "eval_text",
        Annotated[
            Optional[Path],
            typer.Option(help="Evaluate on this text before writing (see eval)."),
        ],
        None,
    ),
    ("max_ppl_increase", MaxPplOpt, None),
    ("max_kl", MaxKlOpt, None),
)


def _make_eval(values: dict) -> EvalChoice:
    text = values["eval_text"]
    return EvalChoice(str(text) if text is not None else None, values["max_ppl_increase"], values["max_kl"])


eval_options = shared_options(_EVAL_OPTIONS, _make_eval, "quality")


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
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err_console, show_path=False)],
        force=True,
    )
    # their notices are not the tool's output; matplotlib's "building the font cache" on a brand-new machine would be
    # a second line before a one-line error
    for noisy in ("transformers", "huggingface_hub", "torch", "onnxruntime", "onnxscript", "matplotlib"):
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
@precision_options
@eval_options
def export(
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            help="Folder, Hub id, or a preset name.",
        ),
    ],
    out: Annotated[
        Optional[Path],
        typer.Option(
            "--out", "-o", parser=OUTPUT_FOLDER, metavar="DIR", help="Output folder \\[default: models/NAME]."
        ),
    ] = None,
    random_init: Annotated[bool, typer.Option("--random-init", help="Seeded random weights, no download.")] = False,
    seed: Annotated[int, typer.Option(help="Seed for --random-init.")] = 0,
    outliers: Annotated[
        float,
        typer.Option(help="--random-init: outliers of this size (GPT-2: 3000)."),
    ] = 0.0,
    revision: Annotated[Optional[str], typer.Option(help="Hub branch, tag or commit.")] = None,
    opset: Annotated[Optional[int], typer.Option(help="ONNX opset, 14 to 20 \\[default: 17].")] = None,
    logits: Annotated[str, typer.Option(help="'all' positions or the 'last'.")] = "all",
    block: Annotated[Optional[int], typer.Option(help="Export transformer block N alone.")] = None,
    external_data: Annotated[
        Optional[bool],
        typer.Option(
            "--external-data/--no-external-data",
            help="Weights in model.onnx_data \\[default: past 2 GB].",
            show_default=False,
        ),
    ] = None,
    validate: Annotated[bool, typer.Option(help="Check against PyTorch before writing.")] = True,
    tolerance: Annotated[Optional[float], typer.Option(help="fp32: max |Δlogits| \\[default: 1e-4].")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output folder.")] = False,
    fusion: Annotated[str, typer.Option(help="none, ort, ort-shared-kv, portable, tensorrt.")] = "none",
    allow_partial_fusion: Annotated[
        bool, typer.Option("--allow-partial-fusion", help="Keep a graph short of its golden counts.")
    ] = False,
    precision: PrecisionChoice = None,
    quality: EvalChoice = None,
) -> None:
    """Export a checkpoint to an ONNX decoder with past key/values, checked against PyTorch."""
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
        fusion=fusion,
        allow_partial_fusion=allow_partial_fusion,
        dtype=precision.dtype,
        quantize=precision.quantize,
        block_size=precision.block_size,
        accuracy_level=precision.accuracy_level,
        lm_head=precision.lm_head,
        embeddings=precision.embeddings,
        gates=precision.gates,
        keep_fp32=precision.keep_fp32,
        eval_text=quality.text,
        max_ppl_increase=quality.max_ppl_increase,
        max_kl=quality.max_kl,
    )
    with err_console.status(f"exporting {model}…"):
        result = run_export(
            model, out, random_init=random_init, seed=seed, revision=revision, outliers=outliers, options=options
        )
    manifest = result.manifest
    table = Table(title=f"{manifest.name} → {result.folder}", show_header=False)
    table.add_row("kind", manifest.kind + (f" {options.block}" if options.block is not None else ""))
    table.add_row("opset", str(manifest.opset))
    for name, info in manifest.files.items():
        table.add_row(name, _size(info.bytes))
    if manifest.fusion:
        table.add_row("fusion", manifest.fusion.summary())
    if manifest.quantization:
        table.add_row("quantization", manifest.quantization.summary())
    if manifest.fp16:
        table.add_row("precision", f"float16; fp32 kept for {', '.join(manifest.fp16.kept_fp32) or 'nothing'}")
    table.add_row("time", ", ".join(f"{k.removesuffix('_seconds')} {v:.1f} s" for k, v in result.timings.items()))
    console.print(table)
    _print_check(result.check, result.quality)


def _print_check(report: CheckReport | None, quality: EvalReport | None = None) -> None:
    """The check a folder passed before it was written, on one line of its own (never cut by a table)."""
    console.print(
        "check: " + (report.summary() if report else "skipped (--no-validate)"),
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    if quality is not None:
        console.print("real text: " + quality.summary(), markup=False, highlight=False, soft_wrap=True)


@app.command()
@precision_options
@eval_options
def optimize(
    source: Annotated[Path, typer.Argument(help="Exported folder or .onnx file (gpt2onnx or optimum).")],
    out: Annotated[Path, typer.Option("--out", "-o", parser=OUTPUT_FOLDER, metavar="DIR", help="Output folder.")],
    fusion: Annotated[
        str,
        typer.Option(help="ort, ort-shared-kv, portable, tensorrt, or none."),
    ] = "ort",
    allow_partial_fusion: Annotated[
        bool, typer.Option("--allow-partial-fusion", help="Keep a graph short of its golden counts.")
    ] = False,
    validate: Annotated[bool, typer.Option(help="Check against the source before writing.")] = True,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output folder.")] = False,
    precision: PrecisionChoice = None,
    quality: EvalChoice = None,
) -> None:
    """Fuse LayerNorm, GELU and attention in an exported decoder, or reduce its precision."""
    from gpt2onnx.exporters.optimize import optimize as run_optimize
    from gpt2onnx.verify.evaluate import EvalGates

    with err_console.status(f"optimizing {source}…"):
        result = run_optimize(
            source,
            out,
            fusion=fusion,
            allow_partial=allow_partial_fusion,
            force=force,
            validate=validate,
            quantization=precision.quantization(),
            dtype=precision.dtype,
            gates=precision.gates,
            keep_fp32=precision.keep_fp32,
            eval_text=quality.text,
            eval_gates=EvalGates(max_ppl_increase=quality.max_ppl_increase, max_kl=quality.max_kl),
        )
    manifest = result.manifest
    table = Table(title=f"{source} → {out}", show_header=False)
    if manifest.fusion:
        table.add_row("fusion", manifest.fusion.summary())
        for check, g in manifest.fusion.golden.items():
            table.add_row(f"  {check}", f"{g.found} of {g.expected} ({', '.join(g.ops)})")
    for name, info in manifest.files.items():
        table.add_row(name, _size(info.bytes))
    if manifest.quantization:
        ops = ", ".join(f"{n} {op}" for op, n in manifest.quantization.ops.items())
        table.add_row("quantization", f"{manifest.quantization.summary()}; {ops}")
    console.print(table)
    _print_check(result.check, result.quality)


@app.command()
def deploy(
    folder: Annotated[Path, typer.Argument(help="Exported decoder folder.")],
    target: Annotated[
        str,
        typer.Option(
            "--target",
            "-t",
            metavar="LIST",
            help="genai, transformers-js, triton, ort-generate, web.",
        ),
    ],
    out: Annotated[
        Optional[Path],
        typer.Option(
            "--out", "-o", parser=OUTPUT_FOLDER, metavar="DIR", help="A new folder \\[default: FOLDER itself]."
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --out folder.")] = False,
    triton_name: Annotated[Optional[str], typer.Option(help="Triton model name \\[default: the folder's].")] = None,
    triton_device: Annotated[str, typer.Option(help="Triton instances: cpu or gpu.")] = "cpu",
    web_lib: Annotated[
        Optional[Path],
        typer.Option(
            metavar="PATH",
            help="web: node_modules with transformers.js (README).",
        ),
    ] = None,
    verify_files: VerifyFilesOpt = True,
) -> None:
    """Make an exported folder ready for genai, transformers.js, Triton, ort-generate, the browser."""
    from gpt2onnx.targets.deploy import deploy as run_deploy

    result = run_deploy(
        folder,
        target,
        out=out,
        force=force,
        triton_name=triton_name,
        triton_device=triton_device.lower(),
        web_lib=web_lib,
        verify_files=verify_files,
    )
    table = Table(title=f"{folder} → {result.folder} ({result.record.precision})", show_header=False)
    for name, files in result.targets.items():
        table.add_row(name, ", ".join(files))
    console.print(table)
    if "web" in result.targets:
        console.print(f"open the page with: gpt2onnx serve {result.folder}", highlight=False, soft_wrap=True)


@app.command("inspect")
def inspect_command(
    path: Annotated[Path, typer.Argument(help="An .onnx file or an exported folder.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print everything as JSON.")] = False,
    verify_files: VerifyFilesOpt = True,
) -> None:
    """Show IO, opsets, ops, file sizes, parameters and the export's checks."""
    from gpt2onnx.artifact.inspect import inspect as run_inspect

    info = run_inspect(path, verify_files=verify_files)
    if as_json:
        console.print_json(json.dumps(info.as_dict()))
        return
    console.print(f"[bold]{escape(info.path)}[/]  IR {info.ir_version}, {info.producer or 'unknown producer'}")
    console.print("opsets: " + ", ".join(f"{d} {v}" for d, v in info.opset_imports.items()))
    io = Table(title="inputs and outputs")
    for col in ("", "name", "dtype", "dims"):
        io.add_column(col)
    for kind, tensors in (("input", info.inputs), ("output", info.outputs)):
        for t in tensors:
            io.add_row(kind, t.name, t.dtype, escape("[" + ", ".join(map(str, t.dims)) + "]"))
    console.print(io)
    ops = Table(title=f"ops ({info.node_count} nodes)")
    for col in ("domain", "op", "count"):
        ops.add_column(col, justify="right" if col == "count" else "left")
    for row in info.op_histogram:
        ops.add_row(row.domain, row.op_type, str(row.count))
    console.print(ops)
    params = info.parameters
    acc = Table(title="parameters")
    for col in ("component", "per instance", "instances", "total"):
        acc.add_column(col, justify="left" if col == "component" else "right")
    for c in params.components:
        acc.add_row(c.component, f"{c.params_per_instance:,}", str(c.instances), f"{c.total:,}")
    for u in params.unnamed:
        acc.add_row(f"{u.name} (unnamed)", f"{u.params:,}", "1", f"{u.params:,}")
    acc.add_row("[bold]total[/]", "", "", f"[bold]{params.total:,}[/]")
    console.print(acc)
    console.print("files: " + ", ".join(f"{name} {_size(size)}" for name, size in info.files.items()))
    if info.manifest and info.manifest.fusion:
        console.print("fusion: " + info.manifest.fusion.summary())
    if info.manifest:
        console.print(
            "checked at export: " + info.manifest.check_summary, markup=False, highlight=False, soft_wrap=True
        )


# -- running: options shared by generate, parity and bench --------------------------------------------------
FolderArg = Annotated[Path, typer.Argument(help="Exported model folder.", show_default=True)]
RuntimeOpt = Annotated[str, typer.Option("--runtime", "-r", help="onnxruntime, genai or openvino.")]
OvDeviceOpt = Annotated[str, typer.Option("--device", help="openvino: CPU, GPU, …")]
OvPrecisionOpt = Annotated[
    str,
    typer.Option("--ov-precision", help="openvino: f32, bf16 or fp16."),
]
ProviderOpt = Annotated[str, typer.Option("--provider", "-p", help="cpu, cuda or tensorrt.")]
ThreadsOpt = Annotated[Optional[int], typer.Option(help="cpu: threads \\[default: all cores].")]
SpinOpt = Annotated[bool, typer.Option("--spin/--no-spin", help="cpu: let idle threads spin.")]
DeviceOpt = Annotated[int, typer.Option(help="cuda/tensorrt: GPU index.")]
TrtFp16Opt = Annotated[bool, typer.Option("--trt-fp16", help="tensorrt: allow fp16 kernels.")]
TrtCacheOpt = Annotated[
    Optional[Path],
    typer.Option(parser=OUTPUT_FOLDER, metavar="DIR", help="tensorrt: cache \\[default: DIR/trt_cache]."),
]
MaxBatchOpt = Annotated[int, typer.Option(help="tensorrt: largest batch.")]
FallbackOpt = Annotated[bool, typer.Option("--allow-fallback", help="Run on if nodes leave the provider.")]
Tf32Opt = Annotated[bool, typer.Option("--tf32", help="cuda/tensorrt: fp32 matmuls in TF32.")]
ReferenceOpt = Annotated[Optional[str], typer.Option(help="Reference \\[default: the manifest's source].")]


@dataclass(frozen=True)
class RunOptions:
    """What generate, parity and bench share: the provider and its settings, OpenVINO's device and precision, and
    whether the model files are checked against the manifest first."""

    provider: ProviderConfig
    device: str
    ov_precision: str
    verify_files: bool


# name, type, default: added to every command decorated with run_options
_RUN_OPTIONS = (
    ("device", OvDeviceOpt, "CPU"),
    ("ov_precision", OvPrecisionOpt, "f32"),
    ("provider", ProviderOpt, "cpu"),
    ("threads", ThreadsOpt, None),
    ("spin", SpinOpt, True),
    ("device_id", DeviceOpt, 0),
    ("trt_fp16", TrtFp16Opt, False),
    ("trt_cache_dir", TrtCacheOpt, None),
    ("max_batch", MaxBatchOpt, 8),
    ("allow_fallback", FallbackOpt, False),
    ("tf32", Tf32Opt, False),
    ("verify_files", VerifyFilesOpt, True),
)


def _make_run_options(values: dict) -> RunOptions:
    from gpt2onnx.artifact.paths import check_output_path
    from gpt2onnx.runtimes.providers import ProviderConfig

    if values["trt_cache_dir"] is not None:  # a folder TensorRT writes into (never replaced)
        check_output_path(values["trt_cache_dir"], option="--trt-cache-dir", kind="folder", replaced=False)

    provider = ProviderConfig(
        name=values["provider"],
        threads=values["threads"],
        spinning=values["spin"],
        device_id=values["device_id"],
        trt_fp16=values["trt_fp16"],
        trt_cache_dir=str(values["trt_cache_dir"]) if values["trt_cache_dir"] else None,
        max_batch=values["max_batch"],
        allow_fallback=values["allow_fallback"],
        tf32=values["tf32"],
    )
    return RunOptions(provider, values["device"], values["ov_precision"], values["verify_files"])


run_options = shared_options(_RUN_OPTIONS, _make_run_options, "options")


def _read_folders(*paths) -> tuple[Path, ...]:
    """The model folders a command reads (its folders, a --reference folder; a model file: its folder)."""
    found = []
    for path in paths:
        if path is not None and Path(path).exists():
            found.append(Path(path).parent if Path(path).is_file() else Path(path))
    return tuple(found)


def _runtime(name: str, options: RunOptions):
    from gpt2onnx.runtimes.base import RuntimeOptions

    return RuntimeOptions(
        name=name, provider=options.provider, device=options.device, ov_precision=options.ov_precision
    )


@app.command()
@run_options
def generate(
    folder: FolderArg = Path("models/gpt2"),
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", help="Prompt text (repeat: a batch).")] = None,
    ids: Annotated[
        Optional[list[str]], typer.Option("--ids", metavar="IDS", help="Token ids, e.g. 1,2,3 (repeatable).")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 32,
    sample: Annotated[bool, typer.Option("--sample", help="Sample instead of greedy.")] = False,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sample from the top k (0: all).")] = 0,
    top_p: Annotated[float, typer.Option(help="Sample from the top-p mass.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed.")] = None,
    num_beams: Annotated[int, typer.Option(help="Beams (1: greedy or sampling).")] = 1,
    length_penalty: Annotated[float, typer.Option(help="Beams: score / new_length ** this.")] = 1.0,
    early_stopping: Annotated[str, typer.Option(help="Beams: true, false or never.")] = "false",
    num_return_sequences: Annotated[int, typer.Option(help="Sequences per prompt (≤ beams).")] = 1,
    repetition_penalty: Annotated[float, typer.Option(help="Penalise tokens already in the row.")] = 1.0,
    no_repeat_ngram_size: Annotated[int, typer.Option(help="No n-gram of this size twice (0: off).")] = 0,
    min_new_tokens: Annotated[int, typer.Option(help="No end-of-sequence before this many.")] = 0,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop a row at this text (repeatable).")] = None,
    json_path: Annotated[
        Optional[Path],
        typer.Option("--json", parser=OUTPUT_FILE, metavar="FILE", help="Write ids, text and score per sequence."),
    ] = None,
    runtime: RuntimeOpt = "onnxruntime",
    options: RunOptions = None,
) -> None:
    """Generate a continuation, streaming the new tokens (greedy, sampling or beam search, as transformers)."""
    from gpt2onnx.artifact.paths import check_output_path
    from gpt2onnx.errors import BadInput
    from gpt2onnx.files import write_json_atomic
    from gpt2onnx.runtimes.generate import EARLY_STOPPING, Decoding, Sampling
    from gpt2onnx.runtimes.generate import generate as run_generate

    if json_path is not None:
        check_output_path(json_path, option="--json", folders=_read_folders(folder))
    if early_stopping.lower() not in EARLY_STOPPING:
        raise BadInput(f"--early-stopping must be true, false or never, got '{early_stopping}'")
    sampling = Sampling(sample=sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    decoding = Decoding(
        num_beams=num_beams,
        length_penalty=length_penalty,
        early_stopping=EARLY_STOPPING[early_stopping.lower()],
        num_return_sequences=num_return_sequences,
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
        min_new_tokens=min_new_tokens,
        stop=tuple(stop or ()),
    )

    def show(kind: str, text: str) -> None:
        console.print(text, end="", markup=False, highlight=False, style="dim" if kind == "prompt" else None)

    result = run_generate(
        folder,
        prompts=prompt,
        ids=ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        decoding=decoding,
        runtime=_runtime(runtime, options),
        verify_files=options.verify_files,
        on_text=show,
    )
    if json_path is not None:
        write_json_atomic(json_path, result.as_dict())
    if len(result.texts) == 1 and num_beams == 1:
        console.print()
        return
    for row, text in enumerate(result.texts):  # "prompt.sequence" when several are returned per prompt
        label = f"{result.prompt_index[row]}.{row % num_return_sequences}" if num_return_sequences > 1 else f"{row}"
        score = f" [dim](score {result.scores[row]:.4f})[/]" if result.scores[row] is not None and num_beams > 1 else ""
        console.print(f"[bold]{label}[/]{score}: ", end="")
        console.print(text, markup=False, highlight=False)


@app.command()
@run_options
def parity(
    folder: FolderArg = Path("models/gpt2"),
    cases: Annotated[int, typer.Option(help="Randomized cases.")] = 20,
    seed: Annotated[int, typer.Option(help="Seed of the cases.")] = 0,
    json_path: Annotated[
        Optional[Path], typer.Option("--json", parser=OUTPUT_FILE, metavar="FILE", help="Write every figure here.")
    ] = None,
    reference: ReferenceOpt = None,
    gate: GateOpt = None,
    runtime: RuntimeOpt = "onnxruntime",
    emulate_fp16: Annotated[
        bool,
        typer.Option(
            "--emulate-fp16",
            help="fp16 on cpu: round tensors as a GPU stores them.",
        ),
    ] = False,
    text: Annotated[
        Optional[Path],
        typer.Option(
            "--text", help="Take the prompts from this UTF-8 text file (the folder's tokenizer) instead of random ids."
        ),
    ] = None,
    options: RunOptions = None,
) -> None:
    """Check an exported model against PyTorch; exit 1 if a gate fails."""
    from rich.progress import Progress

    from gpt2onnx.artifact.paths import check_output_path
    from gpt2onnx.files import write_json_atomic
    from gpt2onnx.verify.gates import parse_gates
    from gpt2onnx.verify.parity import parity as run_parity

    gates = parse_gates(gate)
    if json_path:
        check_output_path(
            json_path, option="--json", folders=_read_folders(folder, reference), files=(text,) if text else ()
        )
    with Progress(console=err_console, transient=True, disable=not err_console.is_terminal) as progress:
        task = progress.add_task("parity cases", total=cases)
        report = run_parity(
            folder,
            runtime=_runtime(runtime, options),
            cases=cases,
            seed=seed,
            reference=reference,
            max_batch=min(options.provider.max_batch, 8),
            on_case=lambda _: progress.advance(task),
            gates=gates,
            emulate_fp16=emulate_fp16,
            verify_files=options.verify_files,
            text=text,
        )
    worst = sorted(report.parity_cases(), key=lambda case: -case.logits.max)[:10]
    table = Table(
        title=f"parity on {report.runtime}/{report.provider}: {len(report.cases)} cases (worst {len(worst)} shown)"
    )
    for col in ("batch", "past", "prompt", "steps", "Δlogits max", "Δlogits p99", "Δpresent max", "top-1", "tokens"):
        table.add_column(col, justify="right")
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
            "equal" if case.tokens_equal else "[red]differ[/]",
        )
    console.print(table)
    t = report.parity_totals()
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
    summary.add_row("KL(reference ‖ onnx) mean / max", f"{t.kl_mean:.2e} / {t.kl_max:.2e}")
    summary.add_row(
        "greedy tokens before divergence",
        f"min {t.tokens_before_divergence_min}, mean {t.tokens_before_divergence_mean:.1f}",
    )
    summary.add_row("NaN/Inf", str(t.nonfinite))
    summary.add_row("prompts", t.prompts)
    if report.placement is not None:
        summary.add_row("node placement", escape(report.placement.summary()))
    summary.add_row("greedy tokens equal", f"{t.tokens_equal_cases} of {t.cases} cases")
    if report.kv_path is not None and report.kv_path.skipped:
        summary.add_row("K/V path", f"not checked: {report.kv_path.skipped}")
    for check in report.kv_path.checks if report.kv_path is not None else []:
        summary.add_row(f"K/V path: {check.description}", check.figures() + ("" if check.passed else " [red]FAIL[/]"))
    summary.add_row(
        "verdict", "[green]pass[/]" if report.passed else "[red]FAIL[/]: " + escape("; ".join(report.failures))
    )
    console.print(summary)
    if json_path:
        write_json_atomic(json_path, report.as_dict())
    if not report.passed:
        raise typer.Exit(1)


@app.command()
@run_options
def bench(
    folders: Annotated[
        Optional[list[Path]],
        typer.Argument(help="Folders, side by side \\[default: models/gpt2]."),
    ] = None,
    batch: Annotated[str, typer.Option(metavar="LIST", help="Batch sizes, comma-separated.")] = "1,8",
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens per row.")] = 128,
    new_tokens: Annotated[int, typer.Option(help="Tokens per run, the first included.")] = 64,
    past: Annotated[
        Optional[str],
        typer.Option(
            metavar="LIST",
            help="Also time one step at these past lengths.",
        ),
    ] = None,
    warmup: Annotated[int, typer.Option(help="Untimed runs first.")] = 2,
    repeat: Annotated[int, typer.Option(help="Timed runs.")] = 5,
    baseline: Annotated[Optional[str], typer.Option(help="'torch': PyTorch eager too.")] = None,
    json_path: Annotated[
        Optional[Path], typer.Option("--json", parser=OUTPUT_FILE, metavar="FILE", help="Write every figure here.")
    ] = None,
    plot: Annotated[
        Optional[Path], typer.Option(parser=OUTPUT_FILE, metavar="FILE", help="PNG: decode latency by past.")
    ] = None,
    reference: ReferenceOpt = None,
    runtime: Annotated[
        str,
        typer.Option("--runtime", "-r", metavar="LIST", help="onnxruntime, genai, openvino (comma-separated)."),
    ] = "onnxruntime",
    options: RunOptions = None,
) -> None:
    """Measure first-token and decode latency, tokens/s and memory (medians)."""
    from rich.progress import Progress

    from gpt2onnx.errors import BadInput
    from gpt2onnx.runtimes.base import RuntimeOptions, parse_runtimes
    from gpt2onnx.runtimes.providers import ProviderConfig
    from gpt2onnx.runtimes.timing import BenchConfig, parse_batches
    from gpt2onnx.verify.bench import bench as run_bench

    folders = folders or [Path("models/gpt2")]
    config = options.provider
    names = parse_runtimes(runtime)
    for flag, value, default in (("--device", options.device, "CPU"), ("--ov-precision", options.ov_precision, "f32")):
        if value != default and "openvino" not in names:
            raise BadInput(f"{flag} applies to the openvino runtime: add it to --runtime, or drop {flag}")
    if config.name != "cpu" and "onnxruntime" not in names:
        raise BadInput("--provider applies to the onnxruntime runtime: add it to --runtime, or drop --provider")
    runtimes = [
        RuntimeOptions(
            name=name,
            provider=config if name == "onnxruntime" else ProviderConfig(threads=config.threads),
            **({"device": options.device, "ov_precision": options.ov_precision} if name == "openvino" else {}),
        )
        for name in names
    ]
    bench_config = BenchConfig(
        batches=parse_batches(batch),
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        warmup=warmup,
        repeat=repeat,
        pasts=parse_batches(past, what="past lengths (--past)") if past else (),
    )
    engines = len(folders) * len(runtimes) + (1 if baseline == "torch" else 0)
    with Progress(console=err_console, transient=True, disable=not err_console.is_terminal) as progress:
        task = progress.add_task("benchmark", total=engines * len(bench_config.batches) * (warmup + repeat))
        result = run_bench(
            folders,
            runtimes=runtimes,
            config=bench_config,
            baseline=baseline,
            reference=reference,
            json_path=json_path,
            plot=plot,
            verify_files=options.verify_files,
            progress=lambda: progress.advance(task),
        )
    models = result.models
    where = ", ".join(f"{m.runtime}/{m.provider}" for m in models[: len(runtimes)])
    table = Table(title=f"on {where}: prompt {prompt_len}, {new_tokens} new tokens, ms, median of {repeat}")
    for col in ("model", "batch", "TTFT ms", "decode p50", "p90", "p99", "+/100 past", "tok/s", "RAM MB"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for run in result.runs:
        decode = run.decode_ms
        table.add_row(
            run.label,
            str(run.batch),
            f"{run.prompt_ms.p50:.1f}",
            *((f"{decode.p50:.2f}", f"{decode.p90:.2f}", f"{decode.p99:.2f}") if decode else ("-", "-", "-")),
            f"{run.decode_growth_ms_per_100_past:.2f}",
            f"{run.tokens_per_s:.0f}",
            f"{run.peak_host_bytes / 1e6:.0f}",
        )
    console.print(table)
    if bench_config.pasts:
        by_past = Table(title=f"decode step (ms, median of {repeat}) at past length")
        for col in ("model", "batch", *map(str, bench_config.pasts)):
            by_past.add_column(col, justify="left" if col == "model" else "right")
        for run in result.runs:
            if run.decode_ms_at_past:
                by_past.add_row(run.label, str(run.batch), *(f"{ms:.2f}" for _, ms in run.decode_ms_at_past))
        console.print(by_past)
    for folder, model in zip(folders, models[:: len(runtimes)]):
        line = f"{folder.name}: {model.precision}, {_size(model.model_bytes)}"
        if model.placement is not None:
            line += f"; {model.placement.summary()}"
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    tf32 = {run.runtime or run.engine: run.extra["tf32"] for run in result.runs if "tf32" in run.extra}
    if tf32:
        console.print("TF32 in fp32 matmuls: " + ", ".join(f"{k} {'on' if v else 'off'}" for k, v in tf32.items()))
    for run in result.runs:
        for label, s in run.speedup_by_label.items():
            console.print(
                f"batch {run.batch}: {label} vs torch eager: first token ×{s.prompt:.2f}, decode step"
                f" ×{s.decode:.2f}, tokens/s ×{s.tokens_per_s:.2f}",
                highlight=False,
            )
        if run.note:
            console.print(f"batch {run.batch}: {run.note}", highlight=False)
    if plot:
        console.print(f"plot written to {plot}")


# -- eval: quality on real text ---------------------------------------------------------------------------------
@app.command("eval")
@run_options
def eval_command(
    folders: Annotated[list[Path], typer.Argument(help="Exported folders, side by side.")],
    text: Annotated[Optional[Path], typer.Option("--text", help="A UTF-8 text file to evaluate on.")] = None,
    dataset: Annotated[
        Optional[str],
        typer.Option(
            help="Or NAME[:CONFIG[:SPLIT]] via datasets (README).",
        ),
    ] = None,
    context: Annotated[Optional[int], typer.Option(help="Tokens per window \\[default: the context].")] = None,
    stride: Annotated[Optional[int], typer.Option(help="Window step \\[default: context / 2].")] = None,
    reference: Annotated[
        Optional[str],
        typer.Option(
            help="Checkpoint or folder \\[default: the source].",
        ),
    ] = None,
    max_ppl_increase: MaxPplOpt = None,
    max_kl: MaxKlOpt = None,
    greedy_tokens: Annotated[int, typer.Option(help="Greedy tokens compared (0: none).")] = 64,
    json_path: Annotated[
        Optional[Path],
        typer.Option("--json", parser=OUTPUT_FILE, metavar="FILE", help="Write every figure to this JSON file."),
    ] = None,
    runtime: RuntimeOpt = "onnxruntime",
    options: RunOptions = None,
) -> None:
    """Perplexity on real text (sliding windows), and KL, top-1 and greedy agreement against a reference."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from gpt2onnx.artifact.paths import check_output_path
    from gpt2onnx.errors import CheckFailed
    from gpt2onnx.files import write_json_atomic
    from gpt2onnx.verify.evaluate import EvalGates, evaluate

    if json_path is not None:
        check_output_path(
            json_path, option="--json", folders=_read_folders(*folders, reference), files=(text,) if text else ()
        )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err_console, transient=True, disable=not err_console.is_terminal) as progress:
        task = progress.add_task("windows", total=None)
        report = evaluate(
            folders,
            text=text,
            dataset=dataset,
            context=context,
            stride=stride,
            reference=reference,
            runtime=_runtime(runtime, options),
            gates=EvalGates(max_ppl_increase=max_ppl_increase, max_kl=max_kl),
            greedy_tokens=greedy_tokens,
            verify_files=options.verify_files,
            on_window=lambda done, total: progress.update(task, completed=done, total=total),
        )
    p = report.protocol
    console.print(
        f"{p.method}: {p.scored_tokens:,} scored tokens of {p.source} ({p.tokens:,} tokens), context"
        f" {p.context}, stride {p.stride}, {p.windows} windows; against {p.reference}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    short = {"float32": "fp32", "float16": "fp16"}
    ref, rows = report.reference, report.rows
    # one column per model, so that several folders fit a terminal
    table = Table(title=f"greedy: {p.greedy_prompt_tokens} prompt tokens from the text's start")
    table.add_column("")
    table.add_column("reference", justify="right")
    for r in rows:
        table.add_column(escape(Path(r.label).name), justify="right")

    def greedy(r) -> str:
        if r.greedy is None:
            return "-"
        if r.greedy.first_divergence is None:
            return f"same {r.greedy.new_tokens} tokens"
        return f"differs at token {r.greedy.first_divergence}"

    figures = [
        ("precision", short.get(ref.precision, ref.precision), lambda r: short.get(r.precision, r.precision)),
        (
            "runtime",
            ref.runtime,
            lambda r: f"{r.runtime}/{r.provider}" + (", token by token" if r.token_by_token else ""),
        ),
        ("PPL ± se", f"{ref.ppl:.6g} ± {ref.ppl_stderr:.2g}", lambda r: f"{r.ppl:.6g} ± {r.ppl_stderr:.2g}"),
        ("ΔPPL % ± se", "", lambda r: f"{r.delta_ppl_percent:+.3f} ± {r.delta_ppl_stderr:.2g}"),
        ("mean KL ± se", "", lambda r: f"{r.kl.mean:.3g} ± {r.kl.stderr:.2g}"),
        ("KL p99 / max", "", lambda r: f"{r.kl.p99:.2g} / {r.kl.max:.2g}"),
        ("same top-1", "", lambda r: f"{100 * r.same_top1:.2f} %"),
        ("RMS Δp", "", lambda r: f"{r.rms_dp:.3g}"),
        ("greedy", "", greedy),
        ("verdict", "", lambda r: "-" if r.check is None else "[green]pass[/]" if r.check.passed else "[red]FAIL[/]"),
    ]
    for name, ref_value, value in figures:
        table.add_row(name, ref_value, *(value(r) for r in rows))
    console.print(table)
    if json_path:
        write_json_atomic(json_path, report.as_dict())
    if not report.passed:
        failing = next(r.check for r in report.rows if r.check and r.check.failures)
        raise CheckFailed("eval gate failed: " + "; ".join(report.failures), failing)


# --- the browser (issue 21): gpt2onnx serve ------------------------------------------------------------------


@app.command()
def serve(
    folder: Annotated[Path, typer.Argument(help="A folder written by gpt2onnx deploy --target web.")],
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1 (0: any free port).")] = 8000,
) -> None:
    """Serve a web folder on 127.0.0.1 with cross-origin isolation (the wasm thread pool needs it); Ctrl-C stops."""
    from gpt2onnx.targets.web_server import open_server

    server = open_server(folder, port=port)
    # one line, flushed: scripts and tests read the address from it
    print(f"serving {server.folder} at {server.url} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # the way to stop it: not an error
        pass
