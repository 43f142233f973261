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

from gpt2onnx.artifact.paths import check_output_path
from gpt2onnx.precisions.all_precisions import FLOAT, FP32, QUANTIZED, quantized_names
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE, KV_CACHES
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.profiles.all_profiles import OPTIMIZE_DEFAULT
from gpt2onnx.profiles.all_profiles import help_line as fusion_help
from gpt2onnx.runtimes.base import RUNTIMES, RuntimeOptions, runtime_options
from gpt2onnx.runtimes.decoding import Decoding, Sampling
from gpt2onnx.runtimes.speculative import Speculation, speculation_from
from gpt2onnx.verify.gates import EvalGates, parse_gates


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


def json_output(path: Path | None, *, reads: tuple = (), files: tuple = ()) -> None:
    """A --json file the command writes at its end, checked before any work (the one output rule): never one of
    the folders it reads (``reads``: folders or model files), nor a file it reads."""
    if path is not None:
        folders = tuple(Path(p).parent if Path(p).is_file() else Path(p) for p in reads if p and Path(p).exists())
        check_output_path(path, option="--json", folders=folders, files=tuple(f for f in files if f))


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


_ALGORITHMS_HELP = "; ".join(
    f"{p.short}: {', '.join(p.algorithms)} \\[default: {p.default_algorithm}]"
    for p in QUANTIZED.values()
    if p.algorithms
)


def precision(
    dtype: Annotated[str, typer.Option(help=f"{', or '.join(FLOAT)} (see --keep-fp32).")] = FP32.short,
    keep_fp32: Annotated[
        str,
        typer.Option(
            "--keep-fp32",
            metavar="LIST",
            show_default=False,
            help="fp16: kept fp32, of layernorm, softmax, logits \\[default: all]; or none.",
        ),
    ] = "layernorm,softmax,logits",
    quantize: Annotated[str, typer.Option("--quantize", help=f"Weights: {quantized_names()}.")] = "none",
    block_size: Annotated[
        Optional[int], typer.Option(help="Block-wise tensors: weights per scale, 16 to 256 \\[default: recipe].")
    ] = None,
    accuracy_level: Annotated[
        Optional[int],
        typer.Option(help="int4 arithmetic: 0 (fp32) or 4 (int8) [default: recipe].", show_default=False),
    ] = None,
    lm_head: Annotated[
        Optional[str], typer.Option("--lm-head", help="Logits projection: int4, int8, fp32 [default: recipe].")
    ] = None,
    embeddings: Annotated[Optional[str], typer.Option(help="Embeddings: int4, int8, fp32 [default: recipe].")] = None,
    weight_algorithm: Annotated[
        Optional[str],
        typer.Option(
            "--algorithm",
            metavar="NAME",
            help=_ALGORITHMS_HELP,
            show_default=False,
        ),
    ] = None,
    calibration_text: Annotated[
        Optional[str],
        typer.Option(
            "--calibration",
            metavar="FILE",
            help="Calibrate gptq, --mixed-int8 on it (or dataset:NAME).",
            show_default=False,
        ),
    ] = None,
    mixed_int8: Annotated[
        Optional[float],
        typer.Option(
            "--mixed-int8",
            metavar="PCT",
            help="int4: % of weights at 8 bits, by sensitivity.",
            show_default=False,
        ),
    ] = None,
    prompt_kernel: Annotated[
        Optional[str],
        typer.Option(
            "--prompt-kernel",
            metavar="KERNEL",
            help="int4: a prompt step's matmuls: nbits or int8 (folded at load) [default: nbits].",
            show_default=False,
        ),
    ] = None,
    gate: GateOpt = None,
    eval_text: Annotated[Optional[Path], typer.Option(help="Evaluate on this text before writing (see eval).")] = None,
    max_ppl_increase: MaxPplOpt = None,
    max_kl: MaxKlOpt = None,
) -> Precision:
    return Precision(
        dtype,
        keep_fp32,
        QuantizeOptions(
            quantize,
            block_size,
            accuracy_level,
            lm_head,
            embeddings,
            weight_algorithm,
            calibration_text,
            mixed_int8,
            prompt_kernel,
        ),
        parse_gates(gate) or None,
        str(eval_text) if eval_text is not None else None,
        EvalGates(max_ppl_increase, max_kl),
    )


# -- what generate, parity, bench and eval share: the runtime's settings -------------------------------------------
@dataclass(frozen=True)
class RunOptions:
    """The runtimes' command-line options as given (option → value; runtime_options gives each runtime its
    own), and whether the model files are checked against the manifest first."""

    flags: dict[str, Any]
    verify_files: bool

    def runtime(self, name: str) -> RuntimeOptions:
        return runtime_options([name], self.flags)[0]


def run_options(
    device: Annotated[str, typer.Option("--device", help="openvino: CPU, GPU, …")] = "CPU",
    ov_precision: Annotated[str, typer.Option("--ov-precision", help="openvino: f32, bf16 or fp16.")] = "f32",
    provider: Annotated[str, typer.Option("--provider", "-p", help="cpu, cuda or tensorrt.")] = "cpu",
    threads: Annotated[Optional[int], typer.Option(help="cpu: threads \\[default: all cores].")] = None,
    spin: Annotated[bool, typer.Option("--spin/--no-spin", help="cpu: let idle threads spin.")] = True,
    device_id: Annotated[int, typer.Option(help="cuda/tensorrt: GPU index.")] = 0,
    trt_fp16: Annotated[bool, typer.Option("--trt-fp16", help="tensorrt: allow fp16 kernels.")] = False,
    trt_cache_dir: Annotated[
        Optional[Path],
        typer.Option(parser=OUTPUT_FOLDER, metavar="DIR", help="tensorrt: cache \\[default: DIR/trt_cache]."),
    ] = None,
    max_batch: Annotated[int, typer.Option(help="tensorrt: largest batch.")] = 8,
    allow_fallback: Annotated[
        bool, typer.Option("--allow-fallback", help="Run on if nodes leave the provider.")
    ] = False,
    tf32: Annotated[bool, typer.Option("--tf32", help="cuda/tensorrt: fp32 matmuls in TF32.")] = False,
    verify_files: VerifyFilesOpt = True,
) -> RunOptions:
    flags = {
        "--device": device,
        "--ov-precision": ov_precision,
        "--provider": provider,
        "--threads": threads,
        "--spin": spin,
        "--device-id": device_id,
        "--trt-fp16": trt_fp16,
        "--trt-cache-dir": str(trt_cache_dir) if trt_cache_dir is not None else None,
        "--max-batch": max_batch,
        "--allow-fallback": allow_fallback,
        "--tf32": tf32,
    }
    return RunOptions(flags, verify_files)


# -- generate's speculative decoding: prompt lookup or a draft folder --------------------------------------------
def speculate(
    prompt_lookup: Annotated[
        Optional[int], typer.Option("--prompt-lookup", metavar="N", help="Propose N tokens from n-grams.")
    ] = None,
    max_ngram: Annotated[
        Optional[int], typer.Option("--max-ngram", metavar="M", help="Prompt lookup: longest n-gram \\[2].")
    ] = None,
    draft: Annotated[
        Optional[Path], typer.Option("--draft", metavar="DIR", help="A draft folder proposes tokens.")
    ] = None,
    draft_tokens: Annotated[
        Optional[str], typer.Option("--draft-tokens", metavar="N", help="Draft: N or adaptive \\[adaptive].")
    ] = None,
) -> Speculation | None:
    return speculation_from(prompt_lookup, max_ngram, draft, draft_tokens)


# -- generate's search: transformers' generate() options ----------------------------------------------------------
@dataclass(frozen=True)
class Search:
    sampling: Sampling
    decoding: Decoding


def search(
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
) -> Search:
    sampling = Sampling(sample=sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    decoding = Decoding(
        num_beams=num_beams,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        num_return_sequences=num_return_sequences,
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
        min_new_tokens=min_new_tokens,
        stop=tuple(stop or ()),
    )
    return Search(sampling, decoding)
