"""The measurements: bench (run, the default, and generate, speculative, constraint, precision, served, web,
memory; compare is in check_commands). Each builds its options, calls one library function and renders its
report; every option is declared once in gpt2onnx.cli.flags, and a workload size left out takes the library
function's default (listed under each command's --help)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from gpt2onnx.artifact.paths import check_output_files
from gpt2onnx.benchmarks.bench import bench as run_bench
from gpt2onnx.benchmarks.timing import BenchConfig, parse_batches
from gpt2onnx.cli import render, render_bench
from gpt2onnx.cli.app import DefaultedGroup, app, ignore_interrupts
from gpt2onnx.cli.flags import (
    AdapterNameOpt,
    BaselineOpt,
    BatchesOpt,
    BatchOpt,
    BenchFoldersArg,
    BrowserOpt,
    CapacityOpt,
    CheckpointArg,
    ConcurrencyOpt,
    CsvOpt,
    FolderArg,
    FoldersArg,
    GgufOpt,
    JsonOpt,
    LlamaServerOpt,
    MarkdownOpt,
    NewTokensOpt,
    PastsOpt,
    PlotOpt,
    PromptLenOpt,
    PromptTokensOpt,
    ReferenceOpt,
    RepeatOpt,
    RequestsOpt,
    RuntimeOpt,
    RuntimesOpt,
    ServedBatchOpt,
    ServedServerOpt,
    ThreadCountsOpt,
    ThreadsOpt,
    WarmupOpt,
    defaults_from,
    given,
    with_defaults_of,
)
from gpt2onnx.cli.options import PrecisionGrid, RunOptions, run_options, speculate, uses, uses_declared
from gpt2onnx.decoding.constraints import ConstraintOptions, constraint_from
from gpt2onnx.decoding.speculative import Speculation
from gpt2onnx.errors import BadInput
from gpt2onnx.generation_options import Decoding
from gpt2onnx.runtimes.all_runtimes import parse_runtimes, runtime_options

bench_app = typer.Typer(
    cls=DefaultedGroup,
    help="Measure speed and memory. bench FOLDERS is bench run FOLDERS; the other measurements are below.",
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(bench_app, name="bench")

_OUTPUTS = {"before_writing": ignore_interrupts}  # every report's files are written last (see ignore_interrupts)


@bench_app.command("run")
@defaults_from("gpt2onnx.benchmarks.timing:BenchConfig")
@uses(run_options, into="options")
@uses(speculate, into="speculation")
def bench(
    folders: BenchFoldersArg = None,
    batch: BatchesOpt = "1,8",
    prompt_len: PromptLenOpt = None,
    new_tokens: NewTokensOpt = None,
    past: PastsOpt = None,
    capacity: CapacityOpt = None,
    warmup: WarmupOpt = None,
    repeat: RepeatOpt = None,
    baseline: BaselineOpt = None,
    json_path: JsonOpt = None,
    plot: PlotOpt = None,
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
    workload = given(prompt_len=prompt_len, new_tokens=new_tokens, warmup=warmup, repeat=repeat)
    config = BenchConfig(parse_batches(batch), pasts=pasts, capacity=capacity, **workload)
    measured = len(folders) * (1 + (adapter is not None)) * len(runtimes) * (1 + (speculation is not None))
    measured += baseline == "torch"
    with render.progress("benchmark", measured * len(config.batches) * (config.warmup + config.repeat)) as step:
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
            csv_path=csv_path,
            markdown_path=markdown_path,
            adapter=adapter,
            **_OUTPUTS,
        )
    render_bench.benched(report, plot)


@bench_app.command("generate")
@defaults_from("gpt2onnx.benchmarks.generation_speed:bench_generation")
@uses(run_options, into="options")
@uses_declared(Decoding, into="decoding")
def bench_generate(
    folder: FolderArg,
    batch: BatchOpt = None,
    prompt_len: PromptLenOpt = None,
    new_tokens: NewTokensOpt = None,
    warmup: WarmupOpt = None,
    repeat: RepeatOpt = None,
    reference: ReferenceOpt = None,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
    runtime: RuntimeOpt = None,
    options: RunOptions = None,
    decoding: Decoding = None,
) -> None:
    """Generation (greedy, beams) against transformers' generate() with the same options, in interleaved rounds."""
    from gpt2onnx.benchmarks.generation_speed import bench_generation

    workload = with_defaults_of(
        bench_generation, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, warmup=warmup, repeat=repeat
    )
    with render.progress("generation", 2 * (workload["warmup"] + workload["repeat"])) as step:
        report = bench_generation(
            folder,
            runtime=options.runtime(runtime),
            decoding=decoding,
            reference=reference,
            json_path=json_path,
            markdown_path=markdown_path,
            progress=step,
            **workload,
            **_OUTPUTS,
        )
    render_bench.generation(report)


@bench_app.command("speculative")
@defaults_from("gpt2onnx.benchmarks.speculation:bench_speculation")
@uses(run_options, into="options")
@uses(speculate, into="speculation")
def bench_speculative(
    folder: FolderArg,
    prompt_tokens: PromptTokensOpt = None,
    new_tokens: NewTokensOpt = None,
    warmup: WarmupOpt = None,
    repeat: RepeatOpt = None,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
    options: RunOptions = None,
    speculation: Optional[Speculation] = None,
) -> None:
    """Speculative decoding on real prompts against greedy, beside transformers' generate() with the same proposer."""
    from gpt2onnx.benchmarks.speculation import bench_speculation, real_prompts

    if speculation is None:
        raise BadInput("bench speculative times a proposer: give --prompt-lookup N or --draft DIR")
    workload = with_defaults_of(
        bench_speculation, prompt_tokens=prompt_tokens, new_tokens=new_tokens, warmup=warmup, repeat=repeat
    )
    with render.progress(
        "speculative decoding", 4 * len(real_prompts()) * (workload["warmup"] + workload["repeat"])
    ) as step:
        report = bench_speculation(
            folder,
            speculation,
            runtime=options.runtime(),
            json_path=json_path,
            markdown_path=markdown_path,
            progress=step,
            **workload,
            **_OUTPUTS,
        )
    render_bench.speculative(report)


@bench_app.command("constraint")
@defaults_from("gpt2onnx.benchmarks.constraint_cost:bench_constraint_cost")
@uses(run_options, into="options")
@uses_declared(ConstraintOptions, into="given")
def bench_constraint(
    folder: FolderArg,
    new_tokens: NewTokensOpt = None,
    warmup: WarmupOpt = None,
    repeat: RepeatOpt = None,
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
    workload = with_defaults_of(bench_constraint_cost, new_tokens=new_tokens, warmup=warmup, repeat=repeat)
    with render.progress("constraint cost", (1 + 2 * len(chosen)) * (workload["warmup"] + workload["repeat"])) as step:
        report = bench_constraint_cost(
            folder,
            constraints=chosen,
            files=files,
            runtime=options.runtime(),
            verify_files=options.verify_files,
            json_path=json_path,
            markdown_path=markdown_path,
            progress=step,
            **workload,
            **_OUTPUTS,
        )
    render_bench.constraint_cost(report)


@bench_app.command("precision")
@defaults_from("gpt2onnx.benchmarks.compare.precision_grid:bench_precision")
@uses(PrecisionGrid, into="grid")
def bench_precision_command(model: CheckpointArg, grid: PrecisionGrid = None) -> None:
    """What each precision costs: every variant built, scored on real text, held to the gates and timed.

    --cpus EPYC-Rome,Nehalem: also each variant's answers on those CPUs (qemu-x86_64) against this one's."""
    from gpt2onnx.benchmarks.compare.precision_grid import bench_precision

    with render.progress("precision grid") as step:
        report = bench_precision(
            str(model), **grid.keywords(), progress=lambda what, done, total: step(done, total, what=what), **_OUTPUTS
        )
    render_bench.precision_grid(report)


@bench_app.command("served")
@defaults_from("gpt2onnx.benchmarks.served:bench_served")
def bench_served_command(
    folder: FolderArg,
    concurrency: ConcurrencyOpt = None,
    requests: RequestsOpt = None,
    new_tokens: NewTokensOpt = None,
    threads: ThreadsOpt = None,
    warmup: WarmupOpt = None,
    repeat: RepeatOpt = None,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
    server: ServedServerOpt = None,
    gguf: GgufOpt = None,
    llama_server: LlamaServerOpt = None,
    max_batch: ServedBatchOpt = None,
) -> None:
    """The folder served by Triton (.venv-triton) under concurrent streaming clients, beside the in-process loop;
    or behind gpt2onnx's OpenAI endpoint, beside llama.cpp's server on --gguf (.venv-engines)."""
    from gpt2onnx.benchmarks.served import bench_served

    levels = parse_batches(concurrency, what="concurrency (--concurrency)") if concurrency else None
    workload = given(
        concurrency=levels,
        requests=requests,
        new_tokens=new_tokens,
        threads=threads,
        warmup=warmup,
        repeat=repeat,
        server=server,
        max_batch=max_batch,
    )
    with render.progress("served") as step:
        report = bench_served(
            folder,
            json_path=json_path,
            markdown_path=markdown_path,
            progress=step,
            gguf=gguf,
            llama_server=llama_server,
            **workload,
            **_OUTPUTS,
        )
    if server == "openai":
        render_bench.served_openai(report)
    else:
        render_bench.served(report)


@bench_app.command("web")
@defaults_from("gpt2onnx.benchmarks.web_speed:bench_web")
def bench_web_command(
    folder: FolderArg,
    threads: ThreadCountsOpt = None,
    new_tokens: NewTokensOpt = None,
    browser: BrowserOpt = True,
    warmup: WarmupOpt = None,
    repeat: RepeatOpt = None,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
) -> None:
    """Tokens/s in Chromium (transformers.js, wasm) beside Node and Python on the folder deployed for the web."""
    from gpt2onnx.benchmarks.web_speed import bench_web

    counts = parse_batches(threads, what="threads (--threads)") if threads else None
    with render.progress("web") as step:
        report = bench_web(
            folder,
            browser=browser,
            json_path=json_path,
            markdown_path=markdown_path,
            progress=step,
            **given(threads=counts, new_tokens=new_tokens, warmup=warmup, repeat=repeat),
            **_OUTPUTS,
        )
    render_bench.web(report)


@bench_app.command("memory")
@defaults_from("gpt2onnx.benchmarks.memory:measure_memory")
def bench_memory(
    folders: FoldersArg,
    batch: BatchesOpt = "1,8",
    prompt_len: PromptLenOpt = None,
    new_tokens: NewTokensOpt = None,
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
            json_path=json_path,
            markdown_path=markdown_path,
            progress=step,
            **given(prompt_len=prompt_len, new_tokens=new_tokens),
            **_OUTPUTS,
        )
    render_bench.memory(report)
