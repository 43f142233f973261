"""The commands: each builds its options into typed objects, calls one library function and renders its result.

Imported lazily, inside the commands that need them: the library modules that import torch (exporters, parity,
eval), so that the run commands (inspect, generate, bench, deploy, serve) work on a machine without torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from gpt2onnx.artifact.generation import Decoding, Sampling
from gpt2onnx.artifact.inspect import inspect as run_inspect
from gpt2onnx.artifact.paths import check_output_files
from gpt2onnx.benchmarks.bench import bench as run_bench
from gpt2onnx.benchmarks.timing import BenchConfig, parse_batches
from gpt2onnx.cli import render
from gpt2onnx.cli.app import DefaultedGroup, app, console, err_console, ignore_interrupts, write_json_output
from gpt2onnx.cli.options import (
    OUTPUT_FILE,
    OUTPUT_FOLDER,
    AdapterNameOpt,
    BatchesOpt,
    CsvOpt,
    FolderArg,
    ForceOpt,
    FusionOpt,
    GateOpt,
    GgufOpt,
    JsonOpt,
    KvCacheOpt,
    LlamaServerOpt,
    MarkdownOpt,
    MaxKlOpt,
    MaxPplOpt,
    NewTokensOpt,
    OptimizeFusionOpt,
    PartialOpt,
    Precision,
    PromptLenOpt,
    RandomInitOpt,
    RebuildOpt,
    ReferenceOpt,
    RepeatOpt,
    RunOptions,
    RuntimeOpt,
    RuntimesOpt,
    Search,
    ServedServerOpt,
    VerifyFilesOpt,
    WarmupOpt,
    json_output,
    plan,
    planned_defaults,
    precision,
    run_options,
    run_options_defaults,
    speculate,
    uses,
    uses_declared,
)
from gpt2onnx.decoding.constraints import ConstraintOptions, constraint_from
from gpt2onnx.decoding.generate import generate as run_generate
from gpt2onnx.decoding.speculative import Speculation
from gpt2onnx.errors import BadInput, CheckFailed
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE
from gpt2onnx.profiles.all_profiles import UNFUSED
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, parse_runtimes, runtime_options
from gpt2onnx.runtimes.runtime import COMMANDS
from gpt2onnx.targets.all_targets import TARGETS
from gpt2onnx.targets.deploy import deploy as run_deploy
from gpt2onnx.targets.server_image import DEFAULT_MAX_BATCH as SERVER_MAX_BATCH
from gpt2onnx.targets.web_server import is_web_folder, open_server
from gpt2onnx.verify.gates import EvalGates, parse_gates


@app.command()
@uses(precision, into="precision")
def export(
    model: Annotated[str, typer.Option("--model", "-m", help="Folder, Hub id, or a preset name.")],
    out: Annotated[
        Optional[Path],
        typer.Option(
            "--out", "-o", parser=OUTPUT_FOLDER, metavar="DIR", help="Output folder \\[default: models/NAME]."
        ),
    ] = None,
    random_init: RandomInitOpt = False,
    seed: Annotated[int, typer.Option(help="Seed for --random-init.")] = 0,
    outliers: Annotated[float, typer.Option(help="--random-init: outliers of this size (GPT-2: 3000).")] = 0.0,
    revision: Annotated[Optional[str], typer.Option(help="Hub branch, tag or commit.")] = None,
    adapter: Annotated[
        Optional[Path], typer.Option(metavar="DIR", help="PEFT LoRA adapter, merged into the weights.")
    ] = None,
    adapters: Annotated[
        Optional[str], typer.Option(metavar="N=DIR", help="NAME=DIR,…: LoRA adapters, switchable (fp32).")
    ] = None,
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
    force: ForceOpt = False,
    fusion: FusionOpt = UNFUSED.name,
    allow_partial_fusion: PartialOpt = False,
    kv_cache: KvCacheOpt = FLOAT_CACHE,
    precision: Precision = None,
) -> None:
    """Export a checkpoint to an ONNX decoder with past key/values, checked against PyTorch."""
    from gpt2onnx.exporters.export import ExportOptions, export  # lazy: torch
    from gpt2onnx.exporters.torch_export import DEFAULT_OPSET  # lazy: torch

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
        kv_cache=kv_cache,
        **precision.keywords(),
    )
    if adapters is not None:
        from gpt2onnx.exporters.switchable import export_switchable, parse_adapters  # lazy: torch

        if adapter is not None or random_init:
            raise BadInput("--adapters exports switchable adapters over a checkpoint: drop --adapter/--random-init")
        with err_console.status(f"exporting {model} with switchable adapters…"):
            result = export_switchable(
                model, out, adapters=parse_adapters(adapters), revision=revision, options=options
            )
        render.exported(result, block)
        return
    with err_console.status(f"exporting {model}…"):
        result = export(
            model,
            out,
            random_init=random_init,
            seed=seed,
            revision=revision,
            outliers=outliers,
            adapter=adapter,
            options=options,
        )
    render.exported(result, block)


@app.command()
@uses(precision, into="precision")
def optimize(
    source: Annotated[Path, typer.Argument(help="Exported folder or .onnx file (gpt2onnx or optimum).")],
    out: Annotated[Path, typer.Option("--out", "-o", parser=OUTPUT_FOLDER, metavar="DIR", help="Output folder.")],
    fusion: OptimizeFusionOpt = None,
    allow_partial_fusion: PartialOpt = False,
    validate: Annotated[bool, typer.Option(help="Check against the source before writing.")] = True,
    force: ForceOpt = False,
    kv_cache: KvCacheOpt = FLOAT_CACHE,
    precision: Precision = None,
) -> None:
    """Fuse LayerNorm, GELU and attention in an exported decoder, or reduce its precision."""
    from gpt2onnx.exporters.optimize import optimize  # lazy: torch

    with err_console.status(f"optimizing {source}…"):
        result = optimize(
            source,
            out,
            fusion=fusion,
            allow_partial=allow_partial_fusion,
            force=force,
            validate=validate,
            kv_cache=kv_cache,
            **precision.keywords(),
        )
    render.optimized(result, source)


@app.command()
def deploy(
    folder: Annotated[Path, typer.Argument(help="Exported decoder folder.")],
    target: Annotated[str, typer.Option("--target", "-t", metavar="LIST", help=f"{', '.join(TARGETS)}.")],
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
        Optional[Path], typer.Option(metavar="PATH", help="web: node_modules with transformers.js (README).")
    ] = None,
    server_name: Annotated[Optional[str], typer.Option(help="server: its DNS-1123 name \\[the folder's].")] = None,
    server_image: Annotated[Optional[str], typer.Option(help="server: its image \\[gpt2onnx-NAME:latest].")] = None,
    server_batch: Annotated[int, typer.Option(help="server: requests a replica batches.")] = SERVER_MAX_BATCH,
    verify_files: VerifyFilesOpt = True,
) -> None:
    """Make an exported folder ready for genai, transformers.js, Triton, ort-generate, phones, the browser, a server."""
    options = {"triton_name": triton_name, "triton_device": triton_device, "web_lib": web_lib}
    options |= {"server_name": server_name, "server_image": server_image, "server_max_batch": server_batch}
    result = run_deploy(folder, target, out=out, force=force, verify_files=verify_files, **options)
    render.deployed(result, folder)


@app.command("inspect")
def inspect_command(
    path: Annotated[Path, typer.Argument(help="An .onnx file or an exported folder.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print everything as JSON.")] = False,
    verify_files: VerifyFilesOpt = True,
) -> None:
    """Show IO, opsets, ops, file sizes, parameters and the export's checks."""
    info = run_inspect(path, verify_files=verify_files)
    if as_json:
        console.print_json(data=info.as_dict())
    else:
        render.inspected(info)


@app.command()
@uses(run_options, into="options")
@uses_declared(Sampling, Decoding, into="search", make=Search)
@uses(speculate, into="speculation")
@uses_declared(ConstraintOptions, into="wanted")
def generate(
    folder: FolderArg = Path("models/gpt2"),
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", help="Prompt text (repeat: a batch).")] = None,
    ids: Annotated[
        Optional[list[str]], typer.Option("--ids", metavar="IDS", help="Token ids, e.g. 1,2,3 (repeatable).")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 32,
    json_path: Annotated[
        Optional[Path],
        typer.Option("--json", parser=OUTPUT_FILE, metavar="FILE", help="Write ids, text and score per sequence."),
    ] = None,
    runtime: RuntimeOpt = "onnxruntime",
    search: Search = None,
    options: RunOptions = None,
    speculation: Optional[Speculation] = None,
    wanted: Optional[ConstraintOptions] = None,
    adapter: AdapterNameOpt = None,
) -> None:
    """Generate a continuation, streaming the new tokens (greedy, sampling or beam search, as transformers).

    --prompt-lookup or --draft check several proposed tokens a step: greedy's tokens, sampling's distribution.
    --json-schema, --regex, --grammar or --choice hold what it writes to a constraint (exit 1 where a row runs out
    of tokens before the constraint is complete)."""
    # the draft is read too, and a schema or grammar file: checked before they are read
    json_output(
        json_path, reads=(folder, speculation and speculation.folder), files=(wanted.json_schema, wanted.grammar)
    )
    constraint = constraint_from(**vars(wanted))
    result = run_generate(
        folder,
        prompts=prompt,
        ids=ids,
        max_new_tokens=max_new_tokens,
        sampling=search.sampling,
        decoding=search.decoding,
        runtime=options.runtime(runtime),
        verify_files=options.verify_files,
        on_text=render.streamed,
        speculation=speculation,
        constraint=constraint,
        adapter=adapter,
    )
    if json_path is not None:
        write_json_output(json_path, result.as_dict())
    render.generated(result)
    incomplete = [row for row, done in enumerate(result.complete or []) if not done]
    if incomplete:  # the text is shown, but not as a success
        raise CheckFailed(
            f"{len(incomplete)} of {len(result.texts)} sequence(s) (row {incomplete[0]} first) ran out of"
            f" --max-new-tokens {max_new_tokens} before {constraint.label} was complete: raise --max-new-tokens"
        )


@app.command()
@uses(run_options, into="options")
def parity(
    folder: FolderArg = Path("models/gpt2"),
    cases: Annotated[int, typer.Option(help="Randomized cases.")] = 20,
    seed: Annotated[int, typer.Option(help="Seed of the cases.")] = 0,
    json_path: JsonOpt = None,
    reference: ReferenceOpt = None,
    gate: GateOpt = None,
    runtime: RuntimeOpt = "onnxruntime",
    emulate_fp16: Annotated[
        bool, typer.Option("--emulate-fp16", help="fp16 on cpu: round tensors as a GPU stores them.")
    ] = False,
    text: Annotated[
        Optional[Path],
        typer.Option(
            "--text", help="Take the prompts from this UTF-8 text file (the folder's tokenizer) instead of random ids."
        ),
    ] = None,
    options: RunOptions = None,
    adapter: AdapterNameOpt = None,
) -> None:
    """Check an exported model against PyTorch; exit 1 if a gate fails."""
    from gpt2onnx.verify.parity import parity  # lazy: torch

    gates = parse_gates(gate)
    json_output(json_path, reads=(folder, reference), files=(text,))
    with render.progress("parity cases", cases) as step:
        report = parity(
            folder,
            runtime=options.runtime(runtime),
            cases=cases,
            seed=seed,
            reference=reference,
            on_case=lambda _: step(),
            gates=gates,
            emulate_fp16=emulate_fp16,
            verify_files=options.verify_files,
            text=text,
            adapter=adapter,
        )
    render.parity_report(report)
    if json_path:
        write_json_output(json_path, report.as_dict())
    if not report.passed:
        raise typer.Exit(1)


bench_app = typer.Typer(
    cls=DefaultedGroup,
    help="Measure speed and memory. bench FOLDERS is bench run FOLDERS; the other measurements are below.",
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(bench_app, name="bench")


@bench_app.command("run")
@uses(run_options, into="options")
@uses(speculate, into="speculation")
def bench(
    folders: Annotated[
        Optional[list[Path]], typer.Argument(help="Folders, side by side \\[default: models/gpt2].")
    ] = None,
    batch: BatchesOpt = "1,8",
    prompt_len: PromptLenOpt = 128,
    new_tokens: NewTokensOpt = 64,
    past: Annotated[
        Optional[str], typer.Option(metavar="LIST", help="Also time one step at these past lengths.")
    ] = None,
    capacity: Annotated[
        Optional[int],
        typer.Option(
            metavar="N",
            help="A preallocated cache's buffer at the --past steps \\[default: past + 1].",
        ),
    ] = None,
    warmup: WarmupOpt = 2,
    repeat: RepeatOpt = 5,
    baseline: Annotated[Optional[str], typer.Option(help="'torch': PyTorch eager too.")] = None,
    json_path: JsonOpt = None,
    plot: Annotated[
        Optional[Path], typer.Option(parser=OUTPUT_FILE, metavar="FILE", help="PNG: decode latency by past.")
    ] = None,
    csv_path: CsvOpt = None,
    markdown_path: MarkdownOpt = None,
    reference: ReferenceOpt = None,
    runtime: RuntimesOpt = "onnxruntime",
    options: RunOptions = None,
    speculation: Optional[Speculation] = None,
    adapter: AdapterNameOpt = None,
) -> None:
    """Measure first-token and decode latency, tokens/s and memory (medians over interleaved rounds).

    --prompt-lookup or --draft: each batch also with proposals, its acceptance and tok/s beside plain decoding."""
    folders = folders or [Path("models/gpt2")]
    runtimes = runtime_options(parse_runtimes(runtime), options.flags)
    pasts = parse_batches(past, what="past lengths (--past)") if past else ()
    config = BenchConfig(parse_batches(batch), prompt_len, new_tokens, warmup, repeat, pasts=pasts, capacity=capacity)
    measured = len(folders) * (1 + (adapter is not None)) * len(runtimes) * (1 + (speculation is not None))
    measured += baseline == "torch"
    runs = measured * len(config.batches) * (warmup + repeat)
    with render.progress("benchmark", runs) as step:
        report = run_bench(
            folders,
            runtimes=runtimes,
            config=config,
            baseline=baseline,
            reference=reference,
            json_path=json_path,
            plot=plot,
            verify_files=options.verify_files,
            progress=step,
            speculation=speculation,
            before_writing=ignore_interrupts,
            csv_path=csv_path,
            markdown_path=markdown_path,
            adapter=adapter,
        )
    render.benched(report, plot)


@bench_app.command("generate")
@uses(run_options, into="options")
@uses_declared(Decoding, into="decoding")
def bench_generate(
    folder: FolderArg,
    batch: Annotated[int, typer.Option(help="Prompts, left-padded.")] = 2,
    prompt_len: PromptLenOpt = 32,
    new_tokens: Annotated[int, typer.Option(help="Tokens each side decodes (genai: at most).")] = 32,
    warmup: WarmupOpt = 1,
    repeat: RepeatOpt = 5,
    reference: ReferenceOpt = None,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
    runtime: RuntimeOpt = "onnxruntime",
    options: RunOptions = None,
    decoding: Decoding = None,
) -> None:
    """Generation (greedy, beams) against transformers' generate() with the same options, in interleaved rounds."""
    from gpt2onnx.benchmarks.generation_speed import bench_generation

    with render.progress("generation", 2 * (warmup + repeat)) as step:
        report = bench_generation(
            folder,
            runtime=options.runtime(runtime),
            decoding=decoding,
            batch=batch,
            prompt_len=prompt_len,
            new_tokens=new_tokens,
            warmup=warmup,
            repeat=repeat,
            reference=reference,
            json_path=json_path,
            markdown_path=markdown_path,
            progress=step,
            before_writing=ignore_interrupts,
        )
    render.generation(report)


@bench_app.command("speculative")
@uses(run_options, into="options")
@uses(speculate, into="speculation")
def bench_speculative(
    folder: FolderArg,
    prompt_tokens: Annotated[int, typer.Option(help="Each real prompt cut to this many tokens.")] = 64,
    new_tokens: Annotated[int, typer.Option(help="New tokens at most (a row stops at end-of-sequence).")] = 48,
    warmup: WarmupOpt = 1,
    repeat: RepeatOpt = 3,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
    options: RunOptions = None,
    speculation: Optional[Speculation] = None,
) -> None:
    """Speculative decoding on real prompts against greedy, beside transformers' generate() with the same proposer."""
    from gpt2onnx.benchmarks.speculation import bench_speculation, real_prompts

    if speculation is None:
        raise BadInput("bench speculative times a proposer: give --prompt-lookup N or --draft DIR")
    with render.progress("speculative decoding", 4 * len(real_prompts()) * (warmup + repeat)) as step:
        report = bench_speculation(
            folder,
            speculation,
            runtime=options.runtime("onnxruntime"),
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            warmup=warmup,
            repeat=repeat,
            json_path=json_path,
            markdown_path=markdown_path,
            progress=step,
            before_writing=ignore_interrupts,
        )
    render.speculative(report)


@bench_app.command("constraint")
@uses(run_options, into="options")
@uses_declared(ConstraintOptions, into="given")
def bench_constraint(
    folder: FolderArg,
    new_tokens: Annotated[int, typer.Option(help="New tokens at most (a constraint ends its row sooner).")] = 64,
    warmup: WarmupOpt = 1,
    repeat: RepeatOpt = 3,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
    options: RunOptions = None,
    given: Optional[ConstraintOptions] = None,
) -> None:
    """A constraint's mask per token beside the decode step without it, batch 1 (default: a JSON schema, any JSON
    object, a regex, a choice)."""
    from gpt2onnx.benchmarks.constraint_cost import bench_constraint_cost, default_constraints

    files = (given.json_schema, given.grammar)  # never overwritten by an output: checked before they are read
    check_output_files({"--json": json_path, "--md": markdown_path}, inputs=(folder,), files=files)
    constraint = constraint_from(**vars(given))
    chosen = {constraint.label.removeprefix("the "): constraint} if constraint is not None else default_constraints()
    with render.progress("constraint cost", (1 + 2 * len(chosen)) * (warmup + repeat)) as step:
        report = bench_constraint_cost(
            folder,
            constraints=chosen,
            files=files,
            runtime=options.runtime("onnxruntime"),
            new_tokens=new_tokens,
            warmup=warmup,
            repeat=repeat,
            verify_files=options.verify_files,
            json_path=json_path,
            markdown_path=markdown_path,
            progress=step,
            before_writing=ignore_interrupts,
        )
    render.constraint_cost(report)


@bench_app.command("precision")
def bench_precision_command(
    model: Annotated[
        Path, typer.Argument(metavar="CHECKPOINT", help="A checkpoint, or an architecture with --random-init.")
    ],
    text: Annotated[Path, typer.Option("--text", help="A UTF-8 text to score on.")],
    work: Annotated[
        Path, typer.Option(parser=OUTPUT_FOLDER, metavar="DIR", help="Where the variants are built and kept.")
    ] = Path("models/precision"),
    only: Annotated[
        Optional[list[str]], typer.Option(metavar="NAMES", help="Grid rows, comma-separated; 'all' \\[default: 12].")
    ] = None,
    random_init: RandomInitOpt = False,
    seed: Annotated[int, typer.Option(help="The random weights' seed.")] = 0,
    outliers: Annotated[float, typer.Option(help="Random weights: outlier channels of this size.")] = 0.0,
    max_chars: Annotated[int, typer.Option(help="Score the text's first N characters.")] = 60_000,
    calibration: Annotated[Optional[str], typer.Option(help="gptq's and --mixed-int8's text (a file).")] = None,
    threads: Annotated[int, typer.Option(help="onnxruntime's threads.")] = 2,
    past: Annotated[int, typer.Option(help="Cached tokens of the timed decode step.")] = 128,
    prompt_len: PromptLenOpt = 128,
    warmup: WarmupOpt = 3,
    repeat: RepeatOpt = 20,
    gate_cases: Annotated[int, typer.Option(help="Randomized cases of the gate figures.")] = 10,
    greedy_tokens: Annotated[int, typer.Option(help="Greedy tokens compared.")] = 64,
    cpus: Annotated[
        Optional[str], typer.Option(metavar="LIST", help="Also on these CPUs, emulated (QEMU models).")
    ] = None,
    cpu_tokens: Annotated[int, typer.Option(help="--cpus: tokens of the text run on each CPU.")] = 512,
    rebuild: RebuildOpt = False,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
    csv_path: CsvOpt = None,
) -> None:
    """What each precision costs: every variant built, scored on real text, held to the gates and timed.

    --cpus EPYC-Rome,Nehalem: also each variant's answers on those CPUs (qemu-x86_64) against this one's."""
    from gpt2onnx.benchmarks.compare.precision_grid import bench_precision

    with render.progress("precision grid") as step:
        report = bench_precision(
            str(model),
            text=text,
            work=work,
            only=only,
            random_init=random_init,
            seed=seed,
            outliers=outliers,
            max_chars=max_chars,
            calibration=calibration,
            threads=threads,
            past=past,
            prompt_len=prompt_len,
            warmup=warmup,
            repeat=repeat,
            gate_cases=gate_cases,
            greedy_tokens=greedy_tokens,
            cpus=tuple(c.strip() for c in cpus.split(",")) if cpus else (),
            cpu_tokens=cpu_tokens,
            json_path=json_path,
            markdown_path=markdown_path,
            csv_path=csv_path,
            rebuild=rebuild,
            progress=lambda what, done, total: step(done, total, what=what),
            before_writing=ignore_interrupts,
        )
    render.precision_grid(report)


@bench_app.command("served")
def bench_served_command(
    folder: FolderArg,
    concurrency: Annotated[str, typer.Option(metavar="LIST", help="Streaming clients, comma-separated.")] = "1,4,16",
    requests: Annotated[int, typer.Option(help="Requests per client, one after another.")] = 2,
    new_tokens: Annotated[int, typer.Option(help="New tokens per request, exactly.")] = 64,
    threads: Annotated[Optional[int], typer.Option(help="onnxruntime's threads \\[default: all cores].")] = None,
    warmup: WarmupOpt = 1,
    repeat: RepeatOpt = 2,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
    server: ServedServerOpt = "triton",
    gguf: GgufOpt = None,
    llama_server: LlamaServerOpt = None,
    max_batch: Annotated[int, typer.Option(help="openai: gpt2onnx serve's --max-batch.")] = 16,
) -> None:
    """The folder served by Triton (.venv-triton) under concurrent streaming clients, beside the in-process loop;
    or behind gpt2onnx's OpenAI endpoint, beside llama.cpp's server on --gguf (.venv-engines)."""
    from gpt2onnx.benchmarks.served import bench_served

    levels = parse_batches(concurrency, what="concurrency (--concurrency)")
    with render.progress("served") as step:
        report = bench_served(
            folder,
            concurrency=levels,
            requests=requests,
            new_tokens=new_tokens,
            threads=threads,
            warmup=warmup,
            repeat=repeat,
            json_path=json_path,
            markdown_path=markdown_path,
            progress=step,
            before_writing=ignore_interrupts,
            server=server,
            gguf=gguf,
            llama_server=llama_server,
            max_batch=max_batch,
        )
    if server == "openai":
        render.served_openai(report)
    else:
        render.served(report)


@bench_app.command("web")
def bench_web_command(
    folder: FolderArg,
    threads: Annotated[str, typer.Option(metavar="LIST", help="Thread counts, comma-separated.")] = "1,2",
    new_tokens: Annotated[int, typer.Option(help="New tokens, greedy.")] = 64,
    browser: Annotated[bool, typer.Option("--browser/--no-browser", help="Chromium's rows too.")] = True,
    warmup: WarmupOpt = 1,
    repeat: RepeatOpt = 3,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
) -> None:
    """Tokens/s in Chromium (transformers.js, wasm) beside Node and Python on the folder deployed for the web."""
    from gpt2onnx.benchmarks.web_speed import bench_web

    counts = parse_batches(threads, what="threads (--threads)")
    with render.progress("web") as step:
        report = bench_web(
            folder,
            threads=counts,
            new_tokens=new_tokens,
            warmup=warmup,
            repeat=repeat,
            browser=browser,
            json_path=json_path,
            markdown_path=markdown_path,
            progress=step,
            before_writing=ignore_interrupts,
        )
    render.web(report)


@bench_app.command("memory")
def bench_memory(
    folders: Annotated[list[Path], typer.Argument(help="Exported folders.")],
    batch: BatchesOpt = "1,8",
    prompt_len: PromptLenOpt = 128,
    new_tokens: NewTokensOpt = 64,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
) -> None:
    """Host memory a greedy decode grows by, beside the estimate that guards runs.

    Each folder at each batch size in its own process (Linux): the peak resident size less the size before."""
    from gpt2onnx.benchmarks.memory import measure_memory

    batches = parse_batches(batch)
    with render.progress("memory", len(folders) * len(batches)) as step:
        report = measure_memory(
            folders,
            batches,
            prompt_len,
            new_tokens,
            json_path=json_path,
            markdown_path=markdown_path,
            progress=step,
            before_writing=ignore_interrupts,
        )
    render.memory(report)


@app.command("compare")
def compare_command(
    model: Annotated[
        Path,
        typer.Argument(
            metavar="CHECKPOINT", help="A Hugging Face folder, a GPT-2 GGUF, or an architecture with --random-init."
        ),
    ],
    work: Annotated[
        Path, typer.Option(parser=OUTPUT_FOLDER, metavar="DIR", help="Where the files are built and kept.")
    ] = Path("models/compare"),
    only: Annotated[
        Optional[list[str]], typer.Option(metavar="ENGINE[:FORMAT]", help="Only these (repeatable) \\[default: all].")
    ] = None,
    baseline: Annotated[Optional[str], typer.Option(help="Ratios to this variant \\[default: the first].")] = None,
    random_init: RandomInitOpt = False,
    seed: Annotated[int, typer.Option(help="The random weights' seed.")] = 0,
    prompt_len: PromptLenOpt = 128,
    new_tokens: Annotated[int, typer.Option(help="New tokens per generation, exactly.")] = 64,
    batch: Annotated[int, typer.Option(help="Rows of the batch decode figure (1: none).")] = 8,
    threads: Annotated[int, typer.Option(help="Threads of every engine.")] = 2,
    warmup: WarmupOpt = 1,
    repeat: RepeatOpt = 5,
    text: Annotated[
        Optional[Path], typer.Option("--text", help="Quality text \\[default: the stdlib's docstrings].")
    ] = None,
    context: Annotated[int, typer.Option(help="Tokens per quality window.")] = 512,
    stride: Annotated[Optional[int], typer.Option(help="Window step \\[default: the context].")] = None,
    quality: Annotated[bool, typer.Option("--quality/--no-quality", help="Score every variant on the text.")] = True,
    rebuild: RebuildOpt = False,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
    csv_path: CsvOpt = None,
    plot: Annotated[
        Optional[Path], typer.Option(parser=OUTPUT_FILE, metavar="FILE", help="PNG: decode ms, and KL against it.")
    ] = None,
) -> None:
    """Our exports beside the peers (optimum, PyTorch) and the engines (llama.cpp, OpenVINO, CTranslate2) on one
    checkpoint: speed and quality in one window.

    The engines run from .venv-engines (bash scripts/setup-engines.sh; llama.cpp: ENGINES_LLAMA=1)."""
    from gpt2onnx.benchmarks.compare.compare import Settings, compare

    settings = Settings(prompt_len, new_tokens, batch, threads, repeat, warmup)
    with render.progress("compare") as step:
        report = compare(
            str(model),
            work=work,
            only=only,
            baseline=baseline,
            settings=settings,
            random_init=random_init,
            seed=seed,
            text=text,
            context=context,
            stride=stride,
            quality=quality,
            json_path=json_path,
            markdown_path=markdown_path,
            csv_path=csv_path,
            plot=plot,
            rebuild=rebuild,
            progress=lambda what, done, total: step(done, total, what=what),
            before_writing=ignore_interrupts,
        )
    render.compared(report)


@app.command("eval")
@uses(run_options, into="options")
def eval_command(
    folders: Annotated[list[Path], typer.Argument(help="Exported folders, side by side.")],
    text: Annotated[Optional[Path], typer.Option("--text", help="A UTF-8 text file to evaluate on.")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="Or NAME[:CONFIG[:SPLIT]] via datasets (README).")] = None,
    context: Annotated[Optional[int], typer.Option(help="Tokens per window \\[default: the context].")] = None,
    stride: Annotated[Optional[int], typer.Option(help="Window step \\[default: context / 2].")] = None,
    reference: Annotated[Optional[str], typer.Option(help="Checkpoint or folder \\[default: the source].")] = None,
    max_ppl_increase: MaxPplOpt = None,
    max_kl: MaxKlOpt = None,
    greedy_tokens: Annotated[int, typer.Option(help="Greedy tokens compared (0: none).")] = 64,
    json_path: Annotated[
        Optional[Path],
        typer.Option("--json", parser=OUTPUT_FILE, metavar="FILE", help="Write every figure to this JSON file."),
    ] = None,
    runtime: RuntimeOpt = "onnxruntime",
    options: RunOptions = None,
    adapter: AdapterNameOpt = None,
) -> None:
    """Perplexity on real text (sliding windows), and KL, top-1 and greedy agreement against a reference."""
    from gpt2onnx.verify.evaluate import evaluate  # lazy: torch

    json_output(json_path, reads=(*folders, reference), files=(text,))
    with render.progress("windows") as step:
        report = evaluate(
            folders,
            text=text,
            dataset=dataset,
            context=context,
            stride=stride,
            reference=reference,
            runtime=options.runtime(runtime),
            gates=EvalGates(max_ppl_increase=max_ppl_increase, max_kl=max_kl),
            greedy_tokens=greedy_tokens,
            verify_files=options.verify_files,
            on_window=step,
            adapter=adapter,
        )
    render.evaluated(report)
    if json_path:
        write_json_output(json_path, report.as_dict())
    if not report.passed:
        failing = next(r.check for r in report.rows if r.check and r.check.failures)
        raise CheckFailed("eval gate failed: " + "; ".join(report.failures), failing)


@app.command()
def serve(
    folder: Annotated[
        Path, typer.Argument(help="An exported model folder (OpenAI's API), or a folder of deploy --target web.")
    ],
    port: Annotated[int, typer.Option(help="Port (0: any free port).")] = 8000,
    host: Annotated[Optional[str], typer.Option(help="Address to listen on \\[127.0.0.1].")] = None,
    api_key: Annotated[
        Optional[str], typer.Option(envvar="GPT2ONNX_API_KEY", help="Key clients send as 'Bearer KEY'.")
    ] = None,
    max_batch: Annotated[Optional[int], typer.Option(help="Requests decoded together \\[16].")] = None,
    max_queue: Annotated[Optional[int], typer.Option(help="Requests waiting beyond those \\[256].")] = None,
    header_timeout: Annotated[
        Optional[float], typer.Option(help="Seconds a client has to send a request's headers \\[10].")
    ] = None,
    body_timeout: Annotated[
        Optional[float], typer.Option(help="Seconds a client has to send a request's body \\[30].")
    ] = None,
    endpoint: Annotated[
        str, typer.Option(help="openai, web, or auto: web where the folder has index.html, else openai.")
    ] = "auto",
    verify_files: VerifyFilesOpt = True,
) -> None:
    """Serve a model folder over OpenAI's API (/v1/completions, /v1/chat/completions), or a web folder on
    127.0.0.1 with cross-origin isolation (the wasm thread pool needs it); Ctrl-C (or SIGTERM) stops."""
    if endpoint not in ("auto", "openai", "web"):
        raise BadInput(f"--endpoint {endpoint!r} is not one of auto, openai, web: give one of them")
    if endpoint == "openai" or (endpoint == "auto" and not is_web_folder(folder)):
        from gpt2onnx.serving.openai.server import HOST, open_openai_server

        model = open_openai_server(
            folder, host=host or HOST, port=port, api_key=api_key,
            max_batch=16 if max_batch is None else max_batch,
            max_queue=256 if max_queue is None else max_queue, verify_files=verify_files,
            header_timeout=header_timeout, **({} if body_timeout is None else {"body_timeout": body_timeout}),
        )  # fmt: skip
        print(f"serving {model.folder} at {model.url}/v1 (OpenAI API; Ctrl-C stops)", flush=True)
        model.serve_forever()
        return
    given = [name for name, value in (("--host", host), ("--api-key", api_key), ("--max-batch", max_batch),
                                      ("--max-queue", max_queue), ("--header-timeout", header_timeout),
                                      ("--body-timeout", body_timeout)) if value is not None]  # fmt: skip
    if given:
        raise BadInput(
            f"{', '.join(given)}: for the OpenAI endpoint, and '{folder}' is served as a web folder (it has"
            " index.html): drop them, or give --endpoint openai"
        )
    server = open_server(folder, port=port)
    # one line, flushed: scripts and tests read the address from it
    print(f"serving {server.folder} at {server.url} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # the way to stop it: not an error
        pass


@app.command()
@uses(plan, into="planned")
@uses(run_options, into="options")
@uses_declared(Sampling, Decoding, into="search", make=Search)
@uses(speculate, into="speculation")
@uses_declared(ConstraintOptions, into="wanted")
def check(
    folder: Annotated[Optional[Path], typer.Argument(help="An exported folder \\[or a planned export].")] = None,
    model: Annotated[
        Optional[str], typer.Option("--model", "-m", help="A planned export's checkpoint (its config only).")
    ] = None,
    fusion: FusionOpt = UNFUSED.name,
    kv_cache: KvCacheOpt = FLOAT_CACHE,
    logits: Annotated[str, typer.Option(help="A planned export's: 'all' or 'last'.")] = "all",
    runtime: Annotated[
        Optional[str], typer.Option("--runtime", "-r", help="Where it runs \\[default: not asked].")
    ] = None,
    target: Annotated[Optional[str], typer.Option("--target", "-t", metavar="LIST", help="Deploy targets.")] = None,
    engine: Annotated[bool, typer.Option("--engine", help="Served by the batching engine.")] = False,
    command: Annotated[
        Optional[str], typer.Option("--command", metavar="NAME", help=f"Run by: {', '.join(COMMANDS)}.")
    ] = None,
    matrix: Annotated[bool, typer.Option("--matrix", help="Print every combination (Markdown).")] = False,
    json_path: JsonOpt = None,
    planned: tuple = None,
    options: RunOptions = None,
    search: Search = None,
    speculation: Speculation = None,
    wanted: Optional[ConstraintOptions] = None,
    adapter: AdapterNameOpt = None,
) -> None:
    """Say whether a folder (or a planned export) works with a runtime, provider, targets, decoding and the engine."""
    if matrix:  # every combination, as Markdown: an option beside it would be ignored, so it is refused
        defaults = planned_defaults()
        given = {
            "FOLDER": folder is not None,
            "--model": model is not None,
            "--fusion": fusion != defaults["fusion"],
            "--kv-cache": kv_cache != defaults["kv_dtype"],
            "--logits": logits != "all",
            "--dtype/--quantize and its options": planned != (defaults["dtype"], defaults["quantization"]),
            "--runtime": runtime is not None,
            "the runtime's options": options.flags != run_options_defaults() or not options.verify_files,
            "--target": target is not None,
            "--engine": engine,
            "--command": command is not None,
            "the decoding options": search.sampling != Sampling() or search.decoding != Decoding(),
            "--prompt-lookup/--draft": speculation is not None,
            "--json-schema/--regex/--grammar/--choice": any(vars(wanted).values()),
            "--json": json_path is not None,
            "--adapter": adapter is not None,
        }
        if any(given.values()):
            dropped = ", ".join(name for name, on in given.items() if on)
            raise BadInput(f"--matrix prints every combination (Markdown) and takes no other option: drop {dropped}")
        from gpt2onnx.preflight.matrix import markdown

        console.print(markdown(), end="", markup=False, highlight=False, soft_wrap=True)
        return
    from gpt2onnx.preflight.check import preflight

    dtype, quantization = planned
    draft = speculation and speculation.folder
    # what it reads, and what the planned export would: the checkpoint, the draft, the calibration text
    files = (quantization.calibration_text, wanted.json_schema, wanted.grammar)
    json_output(json_path, reads=(folder, model, draft), files=files)
    constraint = constraint_from(**vars(wanted))
    passes = {"fusion": fusion, "dtype": dtype, "quantization": quantization, "kv_dtype": kv_cache}
    if folder is not None:
        if passes != planned_defaults() or model is not None or logits != "all":
            raise BadInput(f"'{folder}' is an exported folder with its own choices: drop the planned export's options")
        passes = None
    asked = runtime is not None or options.flags != run_options_defaults()  # a runtime, or one of its options
    chosen = options.runtime(runtime or RuntimeOptions().name) if asked else None
    decoding_asked = search.sampling != Sampling() or search.decoding != Decoding()
    result = preflight(
        folder,
        plan=passes,
        logits=logits,
        model=model,
        runtime=chosen,
        targets=target,
        sampling=search.sampling if decoding_asked else None,
        decoding=search.decoding if decoding_asked else None,
        speculation=speculation,
        engine=engine,
        command=command,
        verify_files=options.verify_files,
        constraint=constraint,
        adapter=adapter,
    )
    render.preflighted(result)
    if json_path is not None:
        write_json_output(json_path, result.as_dict())
    if not result.ok:  # a verdict, not an error: the report is written, the first conflict is the one line
        raise CheckFailed(f"not supported: {result.line}")
