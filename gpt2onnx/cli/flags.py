"""Every command-line option and argument of the CLI, declared once: the one module that calls typer.Option and
typer.Argument (tests/test_architecture.py fails on such a call anywhere else under gpt2onnx/cli). A flag has one
declaration here, with one type, one help and one default, whichever commands take it; the options the library
declares (gpt2onnx.params: the runtimes', decoding's, the quantizer's) become parameters through :func:`declared`.

A workload size whose default differs per command (--warmup, --repeat, --new-tokens, ...) is declared with the
default None, "the command's own": the command passes only what was given (:func:`given`), the library function's
default applies, and --help shows it (``defaults_from``, read by gpt2onnx.cli.app). A few flags name two things
that differ in kind (a file or a switch, one value or a list); each meaning is declared once, under its own name,
and tests/test_architecture.py lists them.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated, Optional

import typer

from gpt2onnx import __version__
from gpt2onnx.params import Option, options_of
from gpt2onnx.precisions.all_precisions import FLOAT
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE, KV_CACHES
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.profiles.all_profiles import OPTIMIZE_DEFAULT
from gpt2onnx.profiles.all_profiles import help_line as fusion_help
from gpt2onnx.runtimes.all_runtimes import RUNTIMES
from gpt2onnx.runtimes.runtime import COMMANDS, ThreadSettings
from gpt2onnx.targets.all_targets import TARGETS


class OutputPath:
    """The parser of every option that names a path a command writes (--json, --plot, -o, a cache folder): the
    value becomes a Path as it is, and the library checks it with gpt2onnx.artifact.paths.check_output_path
    before any work. Declared on each such option so that tests find them all (tests/bad_input/ feeds
    each the same hostile paths)."""

    def __init__(self, kind: str):
        self.kind = kind  # "file" or "folder"
        self.__name__ = f"output {kind}"

    def __call__(self, value) -> Path:
        return Path(value)


OUTPUT_FILE, OUTPUT_FOLDER = OutputPath("file"), OutputPath("folder")


def cli_name(option: Option) -> str:
    """A declared option's parameter name in a command: its flag's (--ov-precision → ov_precision)."""
    return option.flag.lstrip("-").replace("-", "_")


def declared(option: Option) -> inspect.Parameter:
    """A declared option (gpt2onnx.params) as a command's parameter: its flag, help, metavar and default."""
    kind, default = option.param.cli or (option.type, option.default)
    extra = {}
    if option.param.writes:  # a path the command writes: every such option has the one parser
        kind, extra = Optional[Path], {"parser": OUTPUT_FOLDER if option.param.writes == "folder" else OUTPUT_FILE}
    typer_option = typer.Option(
        *option.names,
        help=option.param.help,
        metavar=option.param.metavar,
        show_default=option.param.show_default,
        **extra,
    )
    return parameter(cli_name(option), Annotated[kind, typer_option], default)


def parameter(name: str, annotation, default) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)


def declared_as(cls, field: str):
    """The parameter type (Annotated, with its flag) of one option a class declares: a command that takes that
    flag alone uses this, not a second declaration (bench precision's --calibration is the quantizer's)."""
    (option,) = [o for o in options_of(cls) if o.field == field]
    return declared(option).annotation


def given(**values) -> dict:
    """The values a command line gave (None: not given, the library function's default applies)."""
    return {name: value for name, value in values.items() if value is not None}


def with_defaults_of(function, **values) -> dict:
    """``values`` with each None (not given) replaced by ``function``'s default for it: the library states a
    workload's defaults once, and the command reads them (to count its progress steps, say)."""
    defaults = inspect.signature(function).parameters
    return {name: defaults[name].default if value is None else value for name, value in values.items()}


def defaults_from(*functions: str, renamed: dict[str, str] | None = None):
    """A command whose options left at None take the defaults of ``functions`` ("module:name", the library's, read
    when the command is looked up): gpt2onnx.cli.app lists them under its --help. ``renamed``: a parameter whose
    name in the function differs (--repeat: compare's rounds)."""

    def mark(command):
        command.defaults_from = (functions, renamed or {})
        return command

    return mark


def library_defaults(command, names: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(flag, default) of a command's parameters ``names`` ((name, flag): those left at None) whose default the
    library function it is marked with (:func:`defaults_from`) states."""
    import importlib

    functions, renamed = command.defaults_from
    found = {}
    for path in functions:
        module, name = path.split(":")
        for parameter_ in inspect.signature(getattr(importlib.import_module(module), name)).parameters.values():
            found[parameter_.name] = parameter_.default
    shown = []
    for name, flag in names:
        default = found.get(renamed.get(name, name), inspect.Parameter.empty)
        if default not in (None, (), inspect.Parameter.empty):
            shown.append((flag, ",".join(map(str, default)) if isinstance(default, tuple) else str(default)))
    return shown


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gpt2onnx {__version__}")
        raise typer.Exit()


# -- the app's own ---------------------------------------------------------------------------------------------------
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Log each step.")]
VersionOpt = Annotated[
    Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
]

# -- arguments ---------------------------------------------------------------------------------------------------------
FolderArg = Annotated[Path, typer.Argument(help="Exported model folder.", show_default=True)]
FoldersArg = Annotated[list[Path], typer.Argument(help="Exported folders, side by side.")]
BenchFoldersArg = Annotated[
    Optional[list[Path]], typer.Argument(help="Folders, side by side \\[default: models/gpt2].")
]
CheckFolderArg = Annotated[Optional[Path], typer.Argument(help="An exported folder \\[or a planned export].")]
DeployFolderArg = Annotated[Path, typer.Argument(help="Exported decoder folder.")]
InspectPathArg = Annotated[Path, typer.Argument(help="An .onnx file or an exported folder.")]
OptimizeSourceArg = Annotated[Path, typer.Argument(help="Exported folder or .onnx file (gpt2onnx or optimum).")]
ServeFolderArg = Annotated[
    Path, typer.Argument(help="An exported model folder (OpenAI's API), or a folder of deploy --target web.")
]
CheckpointArg = Annotated[
    Path,
    typer.Argument(
        metavar="CHECKPOINT",
        help="A Hugging Face folder, a GPT-2 GGUF, or an architecture with --random-init.",
    ),
]

# -- the model: its checkpoint, and the export's choices ---------------------------------------------------------------
ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Folder, Hub id, or a preset name.")]
RandomInitOpt = Annotated[bool, typer.Option("--random-init", help="Seeded random weights, no download.")]
OutliersOpt = Annotated[float, typer.Option(help="--random-init: outliers of this size (GPT-2: 3000).")]
RevisionOpt = Annotated[Optional[str], typer.Option(help="Hub branch, tag or commit.")]
MergedAdapterOpt = Annotated[
    Optional[Path], typer.Option("--adapter", metavar="DIR", help="PEFT LoRA adapter, merged into the weights.")
]
AdaptersOpt = Annotated[
    Optional[str], typer.Option(metavar="N=DIR", help="NAME=DIR,…: LoRA adapters, switchable (fp32).")
]
OpsetOpt = Annotated[Optional[int], typer.Option(help="ONNX opset, 14 to 20 \\[default: 17].")]
LogitsOpt = Annotated[str, typer.Option(help="'all' positions or the 'last'.")]
BlockOpt = Annotated[Optional[int], typer.Option(help="Export transformer block N alone.")]
ExternalDataOpt = Annotated[
    Optional[bool],
    typer.Option(
        "--external-data/--no-external-data",
        help="Weights in model.onnx_data \\[default: past 2 GB].",
        show_default=False,
    ),
]
ValidateOpt = Annotated[bool, typer.Option(help="Check against its source before writing.")]
ToleranceOpt = Annotated[Optional[float], typer.Option(help="fp32: max |Δlogits| \\[default: 1e-4].")]
OutOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--out",
        "-o",
        parser=OUTPUT_FOLDER,
        metavar="DIR",
        help="Output folder \\[export: models/NAME; deploy: FOLDER].",
    ),
]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing output folder.")]
# the registered profiles besides the default (shown): four lines at most in an 80-column --help
FusionOpt = Annotated[str, typer.Option(help=f"{fusion_help()}.")]
OptimizeFusionOpt = Annotated[  # optimize's default is the source's own profile
    Optional[str],
    typer.Option("--fusion", help=f"As export's; default: the source's profile, else {OPTIMIZE_DEFAULT.name}."),
]
PartialOpt = Annotated[bool, typer.Option("--allow-partial-fusion", help="Keep a graph short of its golden counts.")]
KvCacheOpt = Annotated[
    str,
    typer.Option("--kv-cache", metavar="TYPE", help=f"The K/V cache: {', '.join([FLOAT_CACHE, *KV_CACHES])}."),
]
DtypeOpt = Annotated[str, typer.Option(help=f"{', or '.join(FLOAT)}.")]
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
EvalTextOpt = Annotated[Optional[Path], typer.Option(help="Evaluate on this text before writing (see eval).")]
MaxPplOpt = Annotated[Optional[float], typer.Option(help="Gate: the most ΔPPL %.")]
MaxKlOpt = Annotated[Optional[float], typer.Option(help="Gate: the most mean KL.")]

# -- deploy ------------------------------------------------------------------------------------------------------------
TargetOpt = Annotated[Optional[str], typer.Option("--target", "-t", metavar="LIST", help=f"{', '.join(TARGETS)}.")]
TritonNameOpt = Annotated[Optional[str], typer.Option(help="Triton model name \\[default: the folder's].")]
TritonDeviceOpt = Annotated[str, typer.Option(help="Triton instances: cpu or gpu.")]
WebLibOpt = Annotated[
    Optional[Path], typer.Option(metavar="PATH", help="web: node_modules with transformers.js (README).")
]
ServerNameOpt = Annotated[Optional[str], typer.Option(help="server: its DNS-1123 name \\[the folder's].")]
ServerImageOpt = Annotated[Optional[str], typer.Option(help="server: its image \\[gpt2onnx-NAME:latest].")]
ServerBatchOpt = Annotated[int, typer.Option(help="server: requests a replica batches.")]

# -- running a folder ----------------------------------------------------------------------------------------------
VerifyFilesOpt = Annotated[
    bool, typer.Option("--verify-files/--no-verify-files", help="Check the model files' sha256 first.")
]
_FIRST, *_OTHERS = RUNTIMES
RuntimeOpt = Annotated[
    Optional[str],
    typer.Option(
        "--runtime", "-r", help=f"Default {_FIRST} (check: not asked); or {', '.join(_OTHERS)}.", show_default=False
    ),
]
RuntimesOpt = Annotated[
    str, typer.Option("--runtime", "-r", metavar="LIST", help=f"{', '.join(RUNTIMES)} (comma-separated).")
]
ReferenceOpt = Annotated[Optional[str], typer.Option(help="Checkpoint or folder \\[default: the manifest's source].")]
AdapterNameOpt = Annotated[
    Optional[str], typer.Option("--adapter", metavar="NAME", help="A switchable LoRA adapter of the folder, active.")
]
PromptOpt = Annotated[Optional[list[str]], typer.Option("--prompt", help="Prompt text (repeat: a batch).")]
IdsOpt = Annotated[
    Optional[list[str]], typer.Option("--ids", metavar="IDS", help="Token ids, e.g. 1,2,3 (repeatable).")
]
MaxNewTokensOpt = Annotated[int, typer.Option(help="Most tokens to generate.")]
CasesOpt = Annotated[int, typer.Option(help="Randomized cases.")]
SeedOpt = Annotated[int, typer.Option(help="Seed (random weights, parity's cases).")]
EmulateFp16Opt = Annotated[
    bool, typer.Option("--emulate-fp16", help="fp16 on cpu: round tensors as a GPU stores them.")
]
TextOpt = Annotated[
    Optional[Path],
    typer.Option("--text", help="A UTF-8 text file: to score on, parity's prompts, compare's \\[the stdlib's docs]."),
]
DatasetOpt = Annotated[Optional[str], typer.Option(help="Or NAME[:CONFIG[:SPLIT]] via datasets (README).")]
ContextOpt = Annotated[Optional[int], typer.Option(help="Tokens per window \\[default: eval: the model's context].")]
StrideOpt = Annotated[Optional[int], typer.Option(help="Window step \\[default: eval: context / 2; compare: context].")]
GreedyTokensOpt = Annotated[int, typer.Option(help="Greedy tokens compared (0: none).")]
JsonOpt = Annotated[
    Optional[Path], typer.Option("--json", parser=OUTPUT_FILE, metavar="FILE", help="Write every figure here.")
]
PrintJsonOpt = Annotated[bool, typer.Option("--json", help="Print everything as JSON.")]

# -- serve -------------------------------------------------------------------------------------------------------------
PortOpt = Annotated[int, typer.Option(help="Port (0: any free port).")]
HostOpt = Annotated[Optional[str], typer.Option(help="Address to listen on \\[127.0.0.1].")]
ApiKeyOpt = Annotated[Optional[str], typer.Option(envvar="GPT2ONNX_API_KEY", help="Key clients send as 'Bearer KEY'.")]
ServedBatchOpt = Annotated[
    Optional[int],
    typer.Option(
        "--max-batch",
        help="Requests the server decodes together \\[16]; each holds its K/V cache: fewer use less memory.",
    ),
]
MaxQueueOpt = Annotated[Optional[int], typer.Option(help="Requests waiting beyond those \\[256].")]
HeaderTimeoutOpt = Annotated[
    Optional[float], typer.Option(help="Seconds a client has to send a request's headers \\[10].")
]
BodyTimeoutOpt = Annotated[Optional[float], typer.Option(help="Seconds a client has to send a request's body \\[30].")]
EndpointOpt = Annotated[
    str, typer.Option(help="openai, web, or auto: web where the folder has index.html, else openai.")
]

# -- check -------------------------------------------------------------------------------------------------------------
EngineOpt = Annotated[bool, typer.Option("--engine", help="Served by the batching engine.")]
CommandOpt = Annotated[Optional[str], typer.Option("--command", metavar="NAME", help=f"Run by: {', '.join(COMMANDS)}.")]
MatrixOpt = Annotated[bool, typer.Option("--matrix", help="Print every combination (Markdown).")]

# -- the benchmarks' workload (None: the benchmark's own, listed under its --help) ---------------------------------
BatchesOpt = Annotated[str, typer.Option(metavar="LIST", help="Batch sizes, comma-separated.")]
BatchOpt = Annotated[Optional[int], typer.Option(help="Rows: bench generate's prompts, compare's batch figure.")]
PromptLenOpt = Annotated[Optional[int], typer.Option(help="Prompt tokens per row.")]
PromptTokensOpt = Annotated[Optional[int], typer.Option(help="Each real prompt cut to this many tokens.")]
NewTokensOpt = Annotated[Optional[int], typer.Option(help="New tokens per run, the first included.")]
WarmupOpt = Annotated[Optional[int], typer.Option(help="Untimed runs first, each variant's.")]
RepeatOpt = Annotated[Optional[int], typer.Option(help="Timed rounds: every variant once a round, rotating.")]
PastsOpt = Annotated[
    Optional[str], typer.Option("--past", metavar="LIST", help="Also time one step at these past lengths.")
]
PastOpt = Annotated[Optional[int], typer.Option("--past", help="Cached tokens of the timed decode step.")]
CapacityOpt = Annotated[
    Optional[int],
    typer.Option(metavar="N", help="A preallocated cache's buffer at the --past steps \\[default: past + 1]."),
]
BaselineOpt = Annotated[
    Optional[str], typer.Option(help="bench: 'torch', PyTorch eager too; compare: ratios to this variant.")
]
PlotOpt = Annotated[
    Optional[Path], typer.Option(parser=OUTPUT_FILE, metavar="FILE", help="PNG: decode ms by past, or KL by speed.")
]
CsvOpt = Annotated[Optional[Path], typer.Option("--csv", parser=OUTPUT_FILE, metavar="FILE", help="The table as CSV.")]
MarkdownOpt = Annotated[
    Optional[Path],
    typer.Option("--md", parser=OUTPUT_FILE, metavar="FILE", help="The table as Markdown, with machine and load."),
]
ThreadCountsOpt = Annotated[
    Optional[str], typer.Option("--threads", metavar="LIST", help="Thread counts, comma-separated.")
]
BrowserOpt = Annotated[bool, typer.Option("--browser/--no-browser", help="Chromium's rows too.")]
ConcurrencyOpt = Annotated[Optional[str], typer.Option(metavar="LIST", help="Streaming clients, comma-separated.")]
RequestsOpt = Annotated[Optional[int], typer.Option(help="Requests per client, one after another.")]
ServedServerOpt = Annotated[
    Optional[str],
    typer.Option("--server", help="triton (its generation model) or openai (gpt2onnx serve, beside --gguf)."),
]
GgufOpt = Annotated[
    Optional[Path], typer.Option("--gguf", metavar="FILE", help="openai: llama.cpp's server on this GGUF beside ours.")
]
LlamaServerOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--llama-server", metavar="FILE", help="openai: llama.cpp's C++ llama-server too (--parallel = --max-batch)."
    ),
]
WorkOpt = Annotated[
    Optional[Path], typer.Option(parser=OUTPUT_FOLDER, metavar="DIR", help="Where the variants are built and kept.")
]
OnlyOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        metavar="NAMES", help="Only these variants (repeatable) \\[default: all; bench precision: 12, or 'all']."
    ),
]
RebuildOpt = Annotated[
    bool, typer.Option("--rebuild", help="A --work folder of another build: remove what it built, build again.")
]
QualityOpt = Annotated[bool, typer.Option("--quality/--no-quality", help="Score every variant on the text.")]
MaxCharsOpt = Annotated[Optional[int], typer.Option(help="Score the text's first N characters.")]
GateCasesOpt = Annotated[Optional[int], typer.Option(help="Randomized cases of the gate figures.")]
CpusOpt = Annotated[Optional[str], typer.Option(metavar="LIST", help="Also on these CPUs, emulated (QEMU models).")]
ThreadsOpt = declared_as(ThreadSettings, "threads")  # the runtimes' one --threads
CalibrationOpt = declared_as(QuantizeOptions, "calibration_text")  # the quantizer's --calibration
CpuTokensOpt = Annotated[Optional[int], typer.Option(help="--cpus: tokens of the text run on each CPU.")]
