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
from typing import Any, Callable

from gpt2onnx.artifact.paths import check_output_file
from gpt2onnx.capabilities import RefusedOptions, Unsupported
from gpt2onnx.cli.flags import (
    CalibrationOpt,
    CpusOpt,
    CpuTokensOpt,
    CsvOpt,
    DtypeOpt,
    EvalTextOpt,
    GateCasesOpt,
    GateOpt,
    GreedyTokensOpt,
    JsonOpt,
    KeepFp32Opt,
    MarkdownOpt,
    MaxCharsOpt,
    MaxKlOpt,
    MaxPplOpt,
    OnlyOpt,
    OutliersOpt,
    PastOpt,
    PromptLenOpt,
    RandomInitOpt,
    RebuildOpt,
    RepeatOpt,
    SeedOpt,
    TextOpt,
    ThreadsOpt,
    VerifyFilesOpt,
    WarmupOpt,
    WorkOpt,
    cli_name,
    declared,
    given,
    parameter,
)
from gpt2onnx.decoding.proposers.all_proposers import PROPOSERS
from gpt2onnx.decoding.speculative import Speculation, speculation_from
from gpt2onnx.generation_options import Decoding, Sampling
from gpt2onnx.params import Option, options_of
from gpt2onnx.precisions.all_precisions import FP32
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.profiles.all_profiles import UNFUSED
from gpt2onnx.runtimes.all_runtimes import RUNTIMES, RuntimeOptions, runtime_options, runtime_spec
from gpt2onnx.verify.gates import EvalGates, parse_gates


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
                if option.flag and cli_name(option) in values:
                    value = values[cli_name(option)]
                    fields[option.field] = option.default if value is None and option.param.cli else value
                    if isinstance(option.default, tuple):
                        fields[option.field] = tuple(fields[option.field] or ())
            built.append(cls(**fields))
        return make(*built) if make is not None else built[0]

    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != into]
        generated = [declared(option) for _, option in options]

        @functools.wraps(command)
        def with_options(**kwargs):
            values = {p.name: kwargs.pop(p.name) for p in generated}
            return command(**kwargs, **{into: build(**values)})

        with_options.__signature__ = signature.replace(parameters=own + generated)
        with_options.__annotations__ = {p.name: p.annotation for p in own + generated}
        return with_options

    return decorate


def json_output(path: Path | None, *, reads: tuple = (), files: tuple = ()) -> None:
    """A --json file the command writes at its end, checked before any work (the one output rule): never in one of
    the folders it reads (``reads``: folders, model files, a draft, a checkpoint; a Hub id is skipped), nor a file
    it reads (``files``), nor a hard link to either."""
    if path is not None:
        check_output_file(path, option="--json", inputs=reads, files=files)


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
    quantization = QuantizeOptions(**{o.field: values.pop(cli_name(o)) for o in options_of(QuantizeOptions)})
    eval_text = values["eval_text"]
    return Precision(
        values["dtype"],
        values["keep_fp32"],
        quantization,
        parse_gates(values["gate"]) or None,
        str(eval_text) if eval_text is not None else None,
        EvalGates(values["max_ppl_increase"], values["max_kl"]),
    )


precision.__signature__ = inspect.Signature(
    [
        parameter("dtype", DtypeOpt, FP32.short),
        parameter("keep_fp32", KeepFp32Opt, "layernorm,softmax,logits"),
        *(declared(option) for option in options_of(QuantizeOptions)),
        parameter("gate", GateOpt, None),
        parameter("eval_text", EvalTextOpt, None),
        parameter("max_ppl_increase", MaxPplOpt, None),
        parameter("max_kl", MaxKlOpt, None),
    ]
)


def plan(**values) -> tuple[str, QuantizeOptions | RefusedOptions]:
    """check's planned precision: --dtype and the weight quantization's declared options (the signature below);
    where those choices conflict (an algorithm with zero points and the int8 prompt kernel), the refusal: check's
    verdict, not an error."""
    fields = {o.field: values.pop(cli_name(o)) for o in options_of(QuantizeOptions)}
    try:
        return values["dtype"], QuantizeOptions(**fields)
    except Unsupported as refused:
        return values["dtype"], RefusedOptions(refused, fields["calibration_text"])


plan.__signature__ = inspect.Signature(
    [
        parameter("dtype", DtypeOpt, FP32.short),
        *(declared(option) for option in options_of(QuantizeOptions)),
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

    def runtime(self, name: str | None = None) -> RuntimeOptions:
        """The runtime ``name`` (None: the default, onnxruntime) with its settings from the options given."""
        return runtime_options([name or RuntimeOptions().name], self.flags)[0]


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
        value = values[cli_name(option)]
        flags[option.flag] = str(value) if option.param.writes and value is not None else value
    return RunOptions(flags, verify_files)


run_options.__signature__ = inspect.Signature(
    [
        *(declared(option) for option in RUNTIME_OPTIONS),
        parameter("verify_files", VerifyFilesOpt, True),
    ]
)


# -- generate's speculative decoding: prompt lookup or a draft folder --------------------------------------------
def speculate(**values) -> Speculation | None:
    """Speculative decoding's options: every registered proposer's declared options (the signature below)."""
    given = {o.field: values[cli_name(o)] for spec in PROPOSERS.values() for o in options_of(spec.options)}
    return speculation_from(**given)


speculate.__signature__ = inspect.Signature(
    [declared(o) for spec in PROPOSERS.values() for o in options_of(spec.options)]
)


# -- generate's search: transformers' generate() options ----------------------------------------------------------
@dataclass(frozen=True)
class Search:
    sampling: Sampling
    decoding: Decoding


# -- bench precision's grid: its options, the keywords of its library function -----------------------------------
@dataclass(frozen=True)
class PrecisionGrid:
    """bench precision's options, each a keyword of gpt2onnx.benchmarks.compare.precision_grid.bench_precision
    (None: the function's default): declared here once, built once, passed as they are."""

    text: TextOpt
    work: WorkOpt = None
    only: OnlyOpt = None
    random_init: RandomInitOpt = False
    seed: SeedOpt = 0
    outliers: OutliersOpt = 0.0
    max_chars: MaxCharsOpt = None
    calibration: CalibrationOpt = None
    threads: ThreadsOpt = None
    past: PastOpt = None
    prompt_len: PromptLenOpt = None
    warmup: WarmupOpt = None
    repeat: RepeatOpt = None
    gate_cases: GateCasesOpt = None
    greedy_tokens: GreedyTokensOpt = 64
    cpus: CpusOpt = None
    cpu_tokens: CpuTokensOpt = None
    rebuild: RebuildOpt = False
    json_path: JsonOpt = None
    markdown_path: MarkdownOpt = None
    csv_path: CsvOpt = None

    def keywords(self) -> dict[str, Any]:
        """The options given, as bench_precision's keywords (--cpus A,B: a tuple of names)."""
        values = given(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if self.cpus:
            values["cpus"] = tuple(cpu.strip() for cpu in self.cpus.split(","))
        return values
