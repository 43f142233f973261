"""The options: each declared once (a type alias with its flag and help), and the groups commands share declared
as the parameters of a builder function that turns them into their typed object (``uses``). The objects check
themselves when built (QuantizeOptions, EvalGates, Sampling, Decoding, the runtimes' settings): the CLI checks
nothing itself."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from gpt2onnx.artifact.generation import Decoding, Sampling
from gpt2onnx.artifact.paths import check_output_file
from gpt2onnx.capabilities import RefusedOptions, Unsupported
from gpt2onnx.decoding.proposers.all_proposers import PROPOSERS
from gpt2onnx.decoding.speculative import Speculation, speculation_from
from gpt2onnx.params import Option, options_of
from gpt2onnx.precisions.all_precisions import FLOAT, FP32
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE, KV_CACHES
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.profiles.all_profiles import OPTIMIZE_DEFAULT, UNFUSED
from gpt2onnx.profiles.all_profiles import help_line as fusion_help
from gpt2onnx.runtimes.all_runtimes import RUNTIMES, RuntimeOptions, runtime_options, runtime_spec
from gpt2onnx.verify.gates import EvalGates, parse_gates


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


def uses(builder: Callable, *, into: str):
    """A decorator giving a command the options that ``builder`` declares as its parameters (Annotated, with their
    flags and defaults), and passing it what ``builder`` returns, the typed object, as the argument ``into``: a
    group of options shared by several commands is declared once, and built once."""
    declared = list(inspect.signature(builder, eval_str=True).parameters.values())

    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != into]

        @functools.wraps(command)
        def with_options(**kwargs):
            built = builder(**{p.name: kwargs.pop(p.name) for p in declared})
            return command(**kwargs, **{into: built})

        with_options.__signature__ = signature.replace(parameters=own + declared)
        with_options.__annotations__ = {p.name: p.annotation for p in own + declared}
        return with_options

    return decorate


def _cli_name(option: Option) -> str:
    """A declared option's parameter name in a command: its flag's (--ov-precision → ov_precision)."""
    return option.flag.lstrip("-").replace("-", "_")


def _cli_parameter(option: Option) -> inspect.Parameter:
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
    return inspect.Parameter(
        _cli_name(option),
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        default=default,
        annotation=Annotated[kind, typer_option],
    )


def uses_declared(*classes, into: str, make: Callable | None = None):
    """A decorator giving a command the declared options of ``classes`` (gpt2onnx.params: one declaration each, with
    its flag and help) and passing it, as the argument ``into``, ``make`` of each class built from its options (a
    value the command line leaves at None takes the field's default); ``make`` defaults to the one class's object."""
    options = [(cls, option) for cls in classes for option in options_of(cls) if option.flag]

    def build(**values):
        built = []
        for cls in classes:
            fields = {}
            for option in options_of(cls):
                if option.flag and _cli_name(option) in values:
                    value = values[_cli_name(option)]
                    fields[option.field] = option.default if value is None and option.param.cli else value
                    if isinstance(option.default, tuple):
                        fields[option.field] = tuple(fields[option.field] or ())
            built.append(cls(**fields))
        return make(*built) if make is not None else built[0]

    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != into]
        declared = [_cli_parameter(option) for _, option in options]

        @functools.wraps(command)
        def with_options(**kwargs):
            values = {p.name: kwargs.pop(p.name) for p in declared}
            return command(**kwargs, **{into: build(**values)})

        with_options.__signature__ = signature.replace(parameters=own + declared)
        with_options.__annotations__ = {p.name: p.annotation for p in own + declared}
        return with_options

    return decorate


def json_output(path: Path | None, *, reads: tuple = (), files: tuple = ()) -> None:
    """A --json file the command writes at its end, checked before any work (the one output rule): never in one of
    the folders it reads (``reads``: folders, model files, a draft, a checkpoint; a Hub id is skipped), nor a file
    it reads (``files``), nor a hard link to either."""
    if path is not None:
        check_output_file(path, option="--json", inputs=reads, files=files)


# -- the options of one command, declared once ---------------------------------------------------------------------
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing output folder.")]
# the registered profiles besides the default (shown): four lines at most in an 80-column --help
FusionOpt = Annotated[str, typer.Option(help=f"{fusion_help()}.")]
OptimizeFusionOpt = Annotated[
    Optional[str],
    typer.Option("--fusion", help=f"As export's; default: the source's profile, else {OPTIMIZE_DEFAULT.name}."),
]
PartialOpt = Annotated[bool, typer.Option("--allow-partial-fusion", help="Keep a graph short of its golden counts.")]
KvCacheOpt = Annotated[
    str,
    typer.Option("--kv-cache", metavar="TYPE", help=f"The K/V cache: {', '.join([FLOAT_CACHE, *KV_CACHES])}."),
]
VerifyFilesOpt = Annotated[
    bool, typer.Option("--verify-files/--no-verify-files", help="Check the model files' sha256 first.")
]
FolderArg = Annotated[Path, typer.Argument(help="Exported model folder.", show_default=True)]
_FIRST, *_OTHERS = RUNTIMES
RuntimeOpt = Annotated[
    str, typer.Option("--runtime", "-r", help=f"Default {_FIRST}; or {', '.join(_OTHERS)}.", show_default=False)
]
RuntimesOpt = Annotated[
    str, typer.Option("--runtime", "-r", metavar="LIST", help=f"{', '.join(RUNTIMES)} (comma-separated).")
]
ReferenceOpt = Annotated[Optional[str], typer.Option(help="Reference \\[default: the manifest's source].")]
# generate, parity, eval, bench, check: a switchable LoRA adapter of the folder (export --adapters), by name
AdapterNameOpt = Annotated[
    Optional[str], typer.Option("--adapter", metavar="NAME", help="A switchable LoRA adapter of the folder, active.")
]
# the workload of bench's subcommands (each names its parameter batch, prompt_len, new_tokens)
BatchesOpt = Annotated[str, typer.Option(metavar="LIST", help="Batch sizes, comma-separated.")]
PromptLenOpt = Annotated[int, typer.Option(help="Prompt tokens per row.")]
NewTokensOpt = Annotated[int, typer.Option(help="Tokens per run, the first included.")]
WarmupOpt = Annotated[int, typer.Option(help="Untimed runs first, each variant's.")]
RepeatOpt = Annotated[int, typer.Option(help="Timed rounds: every variant once a round, rotating.")]
MarkdownOpt = Annotated[
    Optional[Path],
    typer.Option("--md", parser=OUTPUT_FILE, metavar="FILE", help="The table as Markdown, with machine and load."),
]
# bench served: which server, and llama.cpp's file beside ours
ServedServerOpt = Annotated[
    str, typer.Option("--server", help="triton (its generation model) or openai (gpt2onnx serve, beside --gguf).")
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
RandomInitOpt = Annotated[bool, typer.Option("--random-init", help="Seeded random weights, no download.")]
RebuildOpt = Annotated[
    bool, typer.Option("--rebuild", help="A --work folder of another build: remove what it built, build again.")
]
CsvOpt = Annotated[Optional[Path], typer.Option("--csv", parser=OUTPUT_FILE, metavar="FILE", help="The table as CSV.")]
JsonOpt = Annotated[
    Optional[Path], typer.Option("--json", parser=OUTPUT_FILE, metavar="FILE", help="Write every figure here.")
]
GateOpt = Annotated[
    Optional[list[str]],
    typer.Option("--gate", metavar="NAME=X", help="Override a gate, e.g. kl_mean=0.02 (repeatable)."),
]
MaxPplOpt = Annotated[Optional[float], typer.Option(help="Gate: the most ΔPPL %.")]
MaxKlOpt = Annotated[Optional[float], typer.Option(help="Gate: the most mean KL.")]


# -- what export and optimize share: the precision of the new folder, and the checks it must pass ---------------
@dataclass(frozen=True)
class Precision:
    """The dtype, what fp16 keeps in fp32, the weight quantization, gate overrides, and a text to check the new
    folder on with its gates: the same keywords for ExportOptions and optimize()."""

    dtype: str
    keep_fp32: str
    quantization: QuantizeOptions
    gates: dict | None
    eval_text: str | None
    eval_gates: EvalGates

    def keywords(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def precision(**values) -> Precision:
    """export's and optimize's precision options: --dtype and --keep-fp32, the weight quantization's declared
    options (gpt2onnx.precisions.quantize_options), the gates and the text to check on (the signature below)."""
    quantization = QuantizeOptions(**{o.field: values.pop(_cli_name(o)) for o in options_of(QuantizeOptions)})
    eval_text = values["eval_text"]
    return Precision(
        values["dtype"],
        values["keep_fp32"],
        quantization,
        parse_gates(values["gate"]) or None,
        str(eval_text) if eval_text is not None else None,
        EvalGates(values["max_ppl_increase"], values["max_kl"]),
    )


def _keyword(name: str, annotation, default) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)


precision.__signature__ = inspect.Signature(
    [
        _keyword("dtype", Annotated[str, typer.Option(help=f"{', or '.join(FLOAT)} (see --keep-fp32).")], FP32.short),
        _keyword(
            "keep_fp32",
            Annotated[
                str,
                typer.Option(
                    "--keep-fp32",
                    metavar="LIST",
                    show_default=False,
                    help="fp16: kept fp32, of layernorm, softmax, logits \\[default: all]; or none.",
                ),
            ],
            "layernorm,softmax,logits",
        ),
        *(_cli_parameter(option) for option in options_of(QuantizeOptions)),
        _keyword("gate", GateOpt, None),
        _keyword(
            "eval_text",
            Annotated[Optional[Path], typer.Option(help="Evaluate on this text before writing (see eval).")],
            None,
        ),
        _keyword("max_ppl_increase", MaxPplOpt, None),
        _keyword("max_kl", MaxKlOpt, None),
    ]
)


def plan(**values) -> tuple[str, QuantizeOptions | RefusedOptions]:
    """check's planned precision: --dtype and the weight quantization's declared options (the signature below);
    where those choices conflict (an algorithm with zero points and the int8 prompt kernel), the refusal: check's
    verdict, not an error."""
    fields = {o.field: values.pop(_cli_name(o)) for o in options_of(QuantizeOptions)}
    try:
        return values["dtype"], QuantizeOptions(**fields)
    except Unsupported as refused:
        return values["dtype"], RefusedOptions(refused, fields["calibration_text"])


plan.__signature__ = inspect.Signature(
    [
        _keyword("dtype", Annotated[str, typer.Option(help=f"{', or '.join(FLOAT)}.")], FP32.short),
        *(_cli_parameter(option) for option in options_of(QuantizeOptions)),
    ]
)


def planned_defaults() -> dict:
    """check's planned export when no option is given (every option at its default)."""
    values = {name: p.default for name, p in plan.__signature__.parameters.items()}
    dtype, quantization = plan(**values)
    return {"fusion": UNFUSED.name, "dtype": dtype, "quantization": quantization, "kv_dtype": FLOAT_CACHE}


# -- what generate, parity, bench and eval share: the runtime's settings -------------------------------------------
@dataclass(frozen=True)
class RunOptions:
    """The runtimes' command-line options as given (option → value; runtime_options gives each runtime its
    own), and whether the model files are checked against the manifest first."""

    flags: dict[str, Any]
    verify_files: bool

    def runtime(self, name: str) -> RuntimeOptions:
        return runtime_options([name], self.flags)[0]


def _runtime_options() -> list[Option]:
    """Every registered runtime's declared options, each flag once (--threads is one declaration all take)."""
    found: dict[str, Option] = {}
    for name in RUNTIMES:
        for option in options_of(runtime_spec(name).settings):
            if option.flag and option.flag not in found:
                found[option.flag] = option
    return list(found.values())


RUNTIME_OPTIONS = _runtime_options()


def run_options_defaults() -> dict:
    """The runtimes' options at their defaults, by flag (what RunOptions.flags holds when none is given)."""
    return {option.flag: option.default for option in RUNTIME_OPTIONS}


def run_options(**values) -> RunOptions:
    """The runtimes' options as given (by flag), and --verify-files: its parameters are the runtimes' declared
    options (the signature below), each once."""
    verify_files = values.pop("verify_files")
    flags = {}
    for option in RUNTIME_OPTIONS:
        value = values[_cli_name(option)]
        flags[option.flag] = str(value) if option.param.writes and value is not None else value
    return RunOptions(flags, verify_files)


run_options.__signature__ = inspect.Signature(
    [
        *(_cli_parameter(option) for option in RUNTIME_OPTIONS),
        inspect.Parameter(
            "verify_files", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=True, annotation=VerifyFilesOpt
        ),
    ]
)


# -- generate's speculative decoding: prompt lookup or a draft folder --------------------------------------------
def speculate(**values) -> Speculation | None:
    """Speculative decoding's options: every registered proposer's declared options (the signature below)."""
    given = {o.field: values[_cli_name(o)] for spec in PROPOSERS.values() for o in options_of(spec.options)}
    return speculation_from(**given)


speculate.__signature__ = inspect.Signature(
    [_cli_parameter(o) for spec in PROPOSERS.values() for o in options_of(spec.options)]
)


# -- generate's search: transformers' generate() options ----------------------------------------------------------
@dataclass(frozen=True)
class Search:
    sampling: Sampling
    decoding: Decoding
