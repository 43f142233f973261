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


QuantizeOpt = Annotated[str, typer.Option("--quantize", help="Weights: none, int8 (dynamic) or int4 (block-wise).")]
BlockSizeOpt = Annotated[int, typer.Option(help="int4: weights per scale (16, 32, 64, 128 or 256).")]
KeepFp32Opt = Annotated[
    str,
    typer.Option(
        "--keep-fp32",
        help="fp16: what stays fp32, a comma-separated subset of layernorm (its statistics), softmax and logits"
        " (the output), or 'none'.",
    ),
]
GateOpt = Annotated[
    Optional[list[str]],
    typer.Option("--gate", help="Override a default gate, e.g. kl_mean=0.02, top5=0.9, top1=0.99 (repeatable)."),
]


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
    for noisy in ("transformers", "huggingface_hub", "torch", "onnxruntime", "onnxscript"):
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
    outliers: Annotated[
        float,
        typer.Option(
            help="With --random-init: trained GPT-2's massive activations, ±this value in two residual-stream"
            " channels of every sequence's first token (GPT-2 small: about 3000); tests fp16 on realistic"
            " activations. 0 = none."
        ),
    ] = 0.0,
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
    fusion: Annotated[str, typer.Option(help="Fusion profile: none, ort, portable or tensorrt.")] = "none",
    allow_partial_fusion: Annotated[
        bool, typer.Option("--allow-partial-fusion", help="Keep a graph whose fusions fall short of the golden counts.")
    ] = False,
    dtype: Annotated[str, typer.Option(help="fp32, or fp16 (see --keep-fp32).")] = "fp32",
    keep_fp32: KeepFp32Opt = "layernorm,softmax,logits",
    quantize: QuantizeOpt = "none",
    block_size: BlockSizeOpt = 32,
    gate: GateOpt = None,
) -> None:
    """Export a GPT-2 checkpoint to an ONNX decoder with past key/values, validated against PyTorch."""
    from gpt2onnx.exporters.export import ExportOptions
    from gpt2onnx.exporters.export import export as run_export
    from gpt2onnx.runtimes.parity import parse_gates
    from gpt2onnx.exporters.torch_export import DEFAULT_OPSET
    from gpt2onnx.quantization import parse_keep_fp32

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
        dtype=dtype,
        quantize=quantize,
        block_size=block_size,
        gates=parse_gates(gate) or None,
        keep_fp32=parse_keep_fp32(keep_fp32),
    )
    with err_console.status(f"exporting {model}…"):
        result = run_export(
            model, out, random_init=random_init, seed=seed, revision=revision, outliers=outliers, options=options
        )
    manifest = result.manifest
    table = Table(title=f"{manifest['name']} → {result.folder}", show_header=False)
    table.add_row("kind", manifest["kind"] + (f" {options.block}" if options.block is not None else ""))
    table.add_row("opset", str(manifest["opset"]))
    for name, info in manifest["files"].items():
        table.add_row(name, _size(info["bytes"]))
    if manifest.get("fusion"):
        table.add_row("fusion", _fusion_summary(manifest["fusion"]))
    if manifest.get("quantization"):
        q = manifest["quantization"]
        table.add_row("quantization", q["method"] + (f", block {q['block_size']}" if q.get("block_size") else ""))
    if manifest.get("fp16"):
        kept = manifest["fp16"]["kept_fp32"]
        table.add_row("precision", f"float16; fp32 kept for {', '.join(kept) or 'nothing'}")
    table.add_row("parity", _parity_summary(manifest["parity"]))
    table.add_row("time", ", ".join(f"{k.removesuffix('_seconds')} {v:.1f} s" for k, v in result.timings.items()))
    console.print(table)


def _parity_summary(parity: dict | None) -> str:
    if parity is None:
        return "skipped (--no-validate)"
    if "kl" in parity:  # the gates of a quantized model
        return (
            f"{parity['precision']} gates: mean KL {parity['kl']['mean']:.2e}, top-5 {100 * parity['top5_agreement']:.1f}%,"
            f" top-1 {100 * parity['top1_agreement']:.1f}%"
            + (f"; fp16 as on a GPU: mean KL {parity['fp16_emulated']['kl']['mean']:.2e}" if "fp16_emulated" in parity else "")
        )
    return (
        f"max |Δlogits| {parity['max_abs_logits']:.2e}, max |Δpresent| {parity['max_abs_present']:.2e}"
        f" (tolerance {parity['tolerance']:.0e})"
    )


def _fusion_summary(report: dict) -> str:
    counts = ", ".join(f"{n} {op.split('::')[-1]}" for op, n in report["op_counts"].items()) or "nothing fused"
    return f"{report['profile']}: {counts}" + (" (PARTIAL)" if report.get("partial") else "")


@app.command()
def optimize(
    source: Annotated[Path, typer.Argument(help="Exported folder or .onnx file (gpt2onnx or optimum).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder.")],
    fusion: Annotated[str, typer.Option(help="Fusion profile: ort, portable or tensorrt.")] = "ort",
    allow_partial_fusion: Annotated[
        bool, typer.Option("--allow-partial-fusion", help="Keep a graph whose fusions fall short of the golden counts.")
    ] = False,
    validate: Annotated[bool, typer.Option(help="Check the fused graph against its source before writing.")] = True,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output folder.")] = False,
    dtype: Annotated[str, typer.Option(help="fp32, or fp16 (see --keep-fp32).")] = "fp32",
    keep_fp32: KeepFp32Opt = "layernorm,softmax,logits",
    quantize: QuantizeOpt = "none",
    block_size: BlockSizeOpt = 32,
    gate: GateOpt = None,
) -> None:
    """Fuse LayerNorm, SkipLayerNorm, GELU and attention in an exported decoder (and reduce its precision)."""
    from gpt2onnx.exporters.optimize import optimize as run_optimize
    from gpt2onnx.quantization import QuantizeOptions, parse_keep_fp32
    from gpt2onnx.runtimes.parity import parse_gates

    with err_console.status(f"optimizing {source}…"):
        manifest = run_optimize(
            source, out, fusion=fusion, allow_partial=allow_partial_fusion, force=force, validate=validate,
            quantization=QuantizeOptions(quantize, block_size), dtype=dtype, gates=parse_gates(gate) or None,
            keep_fp32=parse_keep_fp32(keep_fp32),
        )  # fmt: skip
    table = Table(title=f"{source} → {out}", show_header=False)
    table.add_row("fusion", _fusion_summary(manifest["fusion"]))
    for check, g in manifest["fusion"]["golden"].items():
        table.add_row(f"  {check}", f"{g['found']} of {g['expected']} ({', '.join(g['ops'])})")
    for name, info in manifest["files"].items():
        table.add_row(name, _size(info["bytes"]))
    if manifest.get("quantization"):
        table.add_row("quantization", ", ".join(f"{n} {op}" for op, n in manifest["quantization"]["ops"].items()))
    table.add_row("parity", _parity_summary(manifest["parity"]) + " against the source graph")
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
    if info["manifest"] and info["manifest"].get("fusion"):
        console.print("fusion: " + _fusion_summary(info["manifest"]["fusion"]))
    if info["manifest"] and info["manifest"].get("parity"):
        parity = info["manifest"]["parity"]
        console.print(f"parity at export: max |Δlogits| {parity['max_abs_logits']:.2e} (tolerance {parity['tolerance']:.0e})")


# -- running: options shared by generate, parity and bench --------------------------------------------------
FolderArg = Annotated[Path, typer.Argument(help="Exported model folder.", show_default=True)]
ProviderOpt = Annotated[str, typer.Option("--provider", "-p", help="cpu, cuda or tensorrt.")]
ThreadsOpt = Annotated[Optional[int], typer.Option(help="cpu: intra-op threads \\[default: all cores].")]
SpinOpt = Annotated[bool, typer.Option("--spin/--no-spin", help="cpu: let idle threads spin.")]
DeviceOpt = Annotated[int, typer.Option(help="cuda/tensorrt: GPU index.")]
TrtFp16Opt = Annotated[bool, typer.Option("--trt-fp16", help="tensorrt: allow fp16 kernels.")]
TrtCacheOpt = Annotated[
    Optional[Path], typer.Option(help="tensorrt: engine and timing cache folder \\[default: DIR/trt_cache].")
]
MaxBatchOpt = Annotated[int, typer.Option(help="tensorrt: largest batch of the optimization profile.")]
FallbackOpt = Annotated[bool, typer.Option("--allow-fallback", help="Run anyway if the provider cannot load.")]
ReferenceOpt = Annotated[
    Optional[str], typer.Option(help="Reference checkpoint (folder or Hub id) \\[default: the manifest's source].")
]


def _provider(provider, threads, spin, device_id, trt_fp16, trt_cache_dir, max_batch, allow_fallback):
    from gpt2onnx.runtimes.providers import ProviderConfig, check_provider

    check_provider(provider)
    if threads is not None and threads < 1:
        raise Gpt2OnnxError(f"--threads must be a positive integer, got {threads}")
    return ProviderConfig(
        name=provider,
        threads=threads,
        spinning=spin,
        device_id=device_id,
        trt_fp16=trt_fp16,
        trt_cache_dir=str(trt_cache_dir) if trt_cache_dir else None,
        max_batch=max_batch,
        allow_fallback=allow_fallback,
    )


def _write_json(path: Path, data: dict) -> None:
    """Write next to the target, then rename: a reader never sees half a file."""
    import os
    import tempfile

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
    except OSError as err:
        raise Gpt2OnnxError(f"cannot write '{path}' ({err.strerror or err}); choose a writable path") from None


def _parse_int_list(value: str, option: str) -> list[int]:
    try:
        numbers = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise Gpt2OnnxError(f"{option} '{value}' is not a comma-separated list of integers (e.g. 1,8)") from None
    if not numbers:
        raise Gpt2OnnxError(f"{option} is empty: give at least one integer")
    return numbers


@app.command()
def generate(
    folder: FolderArg = Path("models/gpt2"),
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", help="Prompt text (repeat for a batch).")] = None,
    ids: Annotated[Optional[list[str]], typer.Option("--ids", help="Prompt token ids, e.g. 1,2,3 (repeat for a batch).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 32,
    sample: Annotated[bool, typer.Option("--sample", help="Sample instead of greedy decoding.")] = False,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sample from the k most likely tokens (0: all).")] = 0,
    top_p: Annotated[float, typer.Option(help="Sample from the smallest set with this probability mass.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed.")] = None,
    provider: ProviderOpt = "cpu",
    threads: ThreadsOpt = None,
    spin: SpinOpt = True,
    device_id: DeviceOpt = 0,
    trt_fp16: TrtFp16Opt = False,
    trt_cache_dir: TrtCacheOpt = None,
    max_batch: MaxBatchOpt = 8,
    allow_fallback: FallbackOpt = False,
) -> None:
    """Generate a continuation, streaming the new tokens."""
    from gpt2onnx.runtimes.generate import Sampling
    from gpt2onnx.runtimes.generate import generate as run_generate
    from gpt2onnx.runtimes.model_folder import open_decoder, open_folder
    from gpt2onnx.runtimes.prompts import encode_prompts, eos_token_id, load_tokenizer, parse_id_prompts

    if bool(prompt) == bool(ids):
        raise Gpt2OnnxError("give the prompt as --prompt TEXT or as --ids 1,2,3 (one of them)")
    config = _provider(provider, threads, spin, device_id, trt_fp16, trt_cache_dir, max_batch, allow_fallback)
    sampling = Sampling(sample=sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    sampling.check()
    model = open_folder(folder)
    tokenizer = load_tokenizer(model.folder) if prompt else None
    input_ids, mask = encode_prompts(tokenizer, prompt) if prompt else parse_id_prompts(ids)
    decoder = open_decoder(model, config)
    eos = eos_token_id(model.folder)
    streamed: list[int] = []

    def stream(step: int, new_ids) -> None:
        if len(new_ids) != 1:
            return
        if step == 0:  # the prompt, shown once it has passed every check
            shown = prompt[0] if tokenizer is not None else " ".join(map(str, input_ids[0]))
            console.print(shown, end="", markup=False, highlight=False, style="dim")
        streamed.append(int(new_ids[0]))
        if tokenizer is None:
            console.print(f" {streamed[-1]}", end="", markup=False, highlight=False)
        else:
            before = tokenizer.decode(streamed[:-1], skip_special_tokens=True)
            console.print(tokenizer.decode(streamed, skip_special_tokens=True)[len(before) :], end="", markup=False, highlight=False)

    result = run_generate(decoder, input_ids, mask, max_new_tokens=max_new_tokens, sampling=sampling, eos_token_id=eos, on_step=stream)
    if len(input_ids) == 1:
        console.print()
        return
    for row, tokens in enumerate(result.tokens):
        if eos is not None and eos in tokens:
            tokens = tokens[: list(tokens).index(eos) + 1]
        text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer else ",".join(map(str, tokens))
        console.print(f"[bold]{row}[/]: ", end="")
        console.print(text, markup=False, highlight=False)


@app.command()
def parity(
    folder: FolderArg = Path("models/gpt2"),
    cases: Annotated[int, typer.Option(help="Randomized cases.")] = 20,
    seed: Annotated[int, typer.Option(help="Seed of the cases.")] = 0,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write every figure to this JSON file.")] = None,
    reference: ReferenceOpt = None,
    gate: GateOpt = None,
    provider: ProviderOpt = "cpu",
    threads: ThreadsOpt = None,
    spin: SpinOpt = True,
    device_id: DeviceOpt = 0,
    trt_fp16: TrtFp16Opt = False,
    trt_cache_dir: TrtCacheOpt = None,
    max_batch: MaxBatchOpt = 8,
    allow_fallback: FallbackOpt = False,
    emulate_fp16: Annotated[
        bool,
        typer.Option(
            "--emulate-fp16",
            help="fp16 models on the cpu provider: round every fp16 tensor as a GPU stores it (the CPU computes"
            " most fp16 nodes in fp32, which hides overflow).",
        ),
    ] = False,
) -> None:
    """Check an exported model against PyTorch on randomized cases; exit 1 if a tolerance is violated."""
    from rich.progress import Progress

    from gpt2onnx.runtimes.parity import check_parity, parse_gates

    gates = parse_gates(gate)

    config = _provider(provider, threads, spin, device_id, trt_fp16, trt_cache_dir, max_batch, allow_fallback)
    with Progress(console=err_console, transient=True) as progress:
        task = progress.add_task("parity cases", total=cases)
        report = check_parity(
            folder,
            provider=config,
            cases=cases,
            seed=seed,
            reference=reference,
            max_batch=min(max_batch, 8),
            on_case=lambda _: progress.advance(task),
            gates=gates,
            emulate_fp16=emulate_fp16,
        )
    worst = sorted(report.cases, key=lambda r: -r.logits["max"])[:10]
    table = Table(title=f"parity on {report.provider}: {len(report.cases)} cases (worst {len(worst)} shown)")
    for col in ("batch", "past", "prompt", "steps", "Δlogits max", "Δlogits p99", "Δpresent max", "top-1", "tokens"):
        table.add_column(col, justify="right")
    for r in worst:
        c = r.case
        table.add_row(
            str(c.batch), str(c.prefix_length), str(c.prompt_length), str(c.decode_steps),
            f"{r.logits['max']:.1e}", f"{r.logits['p99']:.1e}", f"{r.present['max']:.1e}",
            f"{100 * r.top1_agreement:.1f}%", "equal" if r.tokens_equal else "[red]differ[/]",
        )  # fmt: skip
    console.print(table)
    t = report.totals
    summary = Table(title="total", show_header=False)
    summary.add_row("|Δlogits| max / p50 / p99", f"{t['logits']['max']:.2e} / {t['logits']['p50']:.2e} / {t['logits']['p99']:.2e}")
    summary.add_row("|Δpresent| max / p50 / p99", f"{t['present']['max']:.2e} / {t['present']['p50']:.2e} / {t['present']['p99']:.2e}")
    summary.add_row("top-1 agreement", f"{100 * t['top1_agreement']:.3f}% of {t['positions_compared']:,} positions")
    summary.add_row("top-5 agreement", f"{100 * t['top5_agreement']:.3f}%")
    summary.add_row("KL(reference ‖ onnx) mean / max", f"{t['kl']['mean']:.2e} / {t['kl']['max']:.2e}")
    summary.add_row("greedy tokens before divergence", f"min {t['tokens_before_divergence']['min']}, mean {t['tokens_before_divergence']['mean']:.1f}")
    summary.add_row("NaN/Inf", str(t["nonfinite"]))
    summary.add_row("greedy tokens equal", f"{t['tokens_equal_cases']} of {t['cases']} cases")
    summary.add_row("verdict", "[green]pass[/]" if report.passed else "[red]FAIL[/]: " + "; ".join(t["failures"]))
    console.print(summary)
    if json_path:
        _write_json(json_path, report.as_dict())
    if not report.passed:
        raise typer.Exit(1)


@app.command()
def bench(
    folders: Annotated[
        Optional[list[Path]], typer.Argument(help="Exported folders; several are measured side by side \\[default: models/gpt2].")
    ] = None,
    batch: Annotated[str, typer.Option(help="Batch sizes, comma-separated.")] = "1,8",
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens per row.")] = 128,
    new_tokens: Annotated[int, typer.Option(help="Tokens generated per run (the prompt step gives the first).")] = 64,
    warmup: Annotated[int, typer.Option(help="Untimed runs first.")] = 2,
    repeat: Annotated[int, typer.Option(help="Timed runs.")] = 5,
    baseline: Annotated[Optional[str], typer.Option(help="'torch': the same workload on PyTorch eager.")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write every figure to this JSON file.")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Draw decode latency against past length (PNG).")] = None,
    reference: ReferenceOpt = None,
    provider: ProviderOpt = "cpu",
    threads: ThreadsOpt = None,
    spin: SpinOpt = True,
    device_id: DeviceOpt = 0,
    trt_fp16: TrtFp16Opt = False,
    trt_cache_dir: TrtCacheOpt = None,
    max_batch: MaxBatchOpt = 8,
    allow_fallback: FallbackOpt = False,
) -> None:
    """Measure time to first token, decode latency, tokens/s, memory and file size (medians of repeated runs)."""
    from rich.progress import Progress

    from gpt2onnx.runtimes.bench import BenchConfig, benchmark, plot_decode_latency, require_matplotlib

    folders = folders or [Path("models/gpt2")]
    config = _provider(provider, threads, spin, device_id, trt_fp16, trt_cache_dir, max_batch, allow_fallback)
    bench_config = BenchConfig(
        batches=tuple(_parse_int_list(batch, "--batch")), prompt_len=prompt_len, new_tokens=new_tokens,
        warmup=warmup, repeat=repeat,
    )  # fmt: skip
    bench_config.check(None)
    if plot is not None:
        require_matplotlib()  # before minutes of measuring, not after
    engines = len(folders) + (1 if baseline == "torch" else 0)
    results = []
    with Progress(console=err_console, transient=True) as progress:
        task = progress.add_task("benchmark", total=engines * len(bench_config.batches) * (warmup + repeat))
        for i, folder in enumerate(folders):  # PyTorch once, beside the first folder: same model
            results.append(
                benchmark(
                    folder, provider=config, config=bench_config, baseline=baseline if i == 0 else None,
                    reference=reference, progress=lambda: progress.advance(task),
                )
            )  # fmt: skip
    table = Table(title=f"on {results[0]['provider']}: prompt {prompt_len}, {new_tokens} new tokens, ms, median of {repeat}")
    for col in ("model", "batch", "TTFT ms", "decode p50", "p90", "p99", "+/100 past", "tok/s", "RAM MB"):
        table.add_column(col, justify="left" if col == "model" else "right")
    runs = []
    for folder, result in zip(folders, results):
        for run in result["runs"]:
            run["label"] = folder.name if run["engine"] == "onnxruntime" else "torch eager"
            runs.append(run)
            table.add_row(
                run["label"], str(run["batch"]), f"{run['prompt_ms']['p50']:.1f}", f"{run['decode_ms']['p50']:.2f}",
                f"{run['decode_ms']['p90']:.2f}", f"{run['decode_ms']['p99']:.2f}",
                f"{run['decode_growth_ms_per_100_past']:.2f}", f"{run['tokens_per_s']:.0f}",
                f"{run['peak_host_bytes'] / 1e6:.0f}",
            )  # fmt: skip
    console.print(table)
    for folder, result in zip(folders, results):
        console.print(f"{folder.name}: {result['precision']}, {_size(result['model_bytes'])}", highlight=False)
    for run in runs:
        if "speedup_of_onnx" in run["extra"]:
            s = run["extra"]["speedup_of_onnx"]
            console.print(
                f"batch {run['batch']}: {folders[0].name} vs torch eager: first token ×{s['prompt']:.2f}, decode step"
                f" ×{s['decode']:.2f}, tokens/s ×{s['tokens_per_s']:.2f}"
            )
    if json_path:
        _write_json(json_path, {"models": results})
    if plot:
        plot_decode_latency(runs, plot)
        console.print(f"plot written to {plot}")
