"""The commands that judge a checkpoint or a folder, and serve one: compare (our exports beside the peers and the
engines), eval, serve, and check (does a folder, or a planned export, work with a runtime, targets, decoding and
the engine). Each builds its options into typed objects, calls one library function and renders its result; every
option is declared once in gpt2onnx.cli.flags, and a workload size left out takes the library's default."""

from __future__ import annotations

from typing import Optional

from gpt2onnx.cli import render, render_bench
from gpt2onnx.cli.app import app, console, ignore_interrupts, write_json_output
from gpt2onnx.cli.flags import (
    AdapterNameOpt,
    ApiKeyOpt,
    BaselineOpt,
    BatchOpt,
    BodyTimeoutOpt,
    CheckFolderArg,
    CheckpointArg,
    CommandOpt,
    ContextOpt,
    CsvOpt,
    DatasetOpt,
    EndpointOpt,
    EngineOpt,
    FoldersArg,
    FusionOpt,
    GreedyTokensOpt,
    HeaderTimeoutOpt,
    HostOpt,
    JsonOpt,
    KvCacheOpt,
    LogitsOpt,
    MarkdownOpt,
    MatrixOpt,
    MaxKlOpt,
    MaxPplOpt,
    MaxQueueOpt,
    ModelOpt,
    NewTokensOpt,
    OnlyOpt,
    PlotOpt,
    PortOpt,
    PromptLenOpt,
    QualityOpt,
    RandomInitOpt,
    RebuildOpt,
    ReferenceOpt,
    RepeatOpt,
    RuntimeOpt,
    SeedOpt,
    ServedBatchOpt,
    ServeFolderArg,
    StrideOpt,
    TargetOpt,
    TextOpt,
    ThreadsOpt,
    VerifyFilesOpt,
    WarmupOpt,
    WorkOpt,
    defaults_from,
    given,
)
from gpt2onnx.cli.options import (
    RunOptions,
    Search,
    json_output,
    plan,
    planned_defaults,
    run_options,
    run_options_defaults,
    speculate,
    uses,
    uses_declared,
)
from gpt2onnx.decoding.constraints import ConstraintOptions, constraint_from
from gpt2onnx.decoding.speculative import Speculation
from gpt2onnx.errors import BadInput, CheckFailed
from gpt2onnx.generation_options import Decoding, Sampling
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE
from gpt2onnx.profiles.all_profiles import UNFUSED
from gpt2onnx.targets.web_server import is_web_folder, open_server
from gpt2onnx.verify.gates import EvalGates


@app.command("compare")
@defaults_from(
    "gpt2onnx.benchmarks.compare.compare:compare",
    "gpt2onnx.benchmarks.compare.compare:Settings",
    renamed={"repeat": "rounds"},
)
def compare_command(
    model: CheckpointArg,
    work: WorkOpt = None,
    only: OnlyOpt = None,
    baseline: BaselineOpt = None,
    random_init: RandomInitOpt = False,
    seed: SeedOpt = 0,
    prompt_len: PromptLenOpt = None,
    new_tokens: NewTokensOpt = None,
    batch: BatchOpt = None,
    threads: ThreadsOpt = None,
    warmup: WarmupOpt = None,
    repeat: RepeatOpt = None,
    text: TextOpt = None,
    context: ContextOpt = None,
    stride: StrideOpt = None,
    quality: QualityOpt = True,
    rebuild: RebuildOpt = False,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
    csv_path: CsvOpt = None,
    plot: PlotOpt = None,
) -> None:
    """Our exports beside the peers (optimum, PyTorch) and the engines (llama.cpp, OpenVINO, CTranslate2) on one
    checkpoint: speed and quality in one window.

    The engines run from .venv-engines (bash scripts/setup-engines.sh; llama.cpp: ENGINES_LLAMA=1)."""
    from gpt2onnx.benchmarks.compare.compare import Settings, compare

    settings = Settings(
        **given(
            prompt_len=prompt_len, new_tokens=new_tokens, batch=batch, threads=threads, rounds=repeat, warmup=warmup
        )
    )
    with render.progress("compare") as step:
        report = compare(
            str(model),
            only=only,
            baseline=baseline,
            settings=settings,
            random_init=random_init,
            seed=seed,
            text=text,
            stride=stride,
            quality=quality,
            json_path=json_path,
            markdown_path=markdown_path,
            csv_path=csv_path,
            plot=plot,
            rebuild=rebuild,
            progress=lambda what, done, total: step(done, total, what=what),
            **given(work=work, context=context),
            before_writing=ignore_interrupts,
        )
    render_bench.compared(report)


@app.command("eval")
@uses(run_options, into="options")
def eval_command(
    folders: FoldersArg,
    text: TextOpt = None,
    dataset: DatasetOpt = None,
    context: ContextOpt = None,
    stride: StrideOpt = None,
    reference: ReferenceOpt = None,
    max_ppl_increase: MaxPplOpt = None,
    max_kl: MaxKlOpt = None,
    greedy_tokens: GreedyTokensOpt = 64,
    json_path: JsonOpt = None,
    runtime: RuntimeOpt = None,
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
    folder: ServeFolderArg,
    port: PortOpt = 8000,
    host: HostOpt = None,
    api_key: ApiKeyOpt = None,
    max_batch: ServedBatchOpt = None,
    max_queue: MaxQueueOpt = None,
    header_timeout: HeaderTimeoutOpt = None,
    body_timeout: BodyTimeoutOpt = None,
    endpoint: EndpointOpt = "auto",
    verify_files: VerifyFilesOpt = True,
) -> None:
    """Serve a model folder over OpenAI's API (/v1/completions, /v1/chat/completions), or a web folder on
    127.0.0.1 with cross-origin isolation (the wasm thread pool needs it); Ctrl-C (or SIGTERM) stops."""
    if endpoint not in ("auto", "openai", "web"):
        raise BadInput(f"--endpoint {endpoint!r} is not one of auto, openai, web: give one of them")
    # the OpenAI endpoint's settings, as given (the server's defaults: 127.0.0.1, 16, 256, 10 s, 30 s)
    openai = given(host=host, api_key=api_key, max_batch=max_batch, max_queue=max_queue,
                   header_timeout=header_timeout, body_timeout=body_timeout)  # fmt: skip
    if endpoint == "openai" or (endpoint == "auto" and not is_web_folder(folder)):
        from gpt2onnx.serving.openai.server import open_openai_server

        model = open_openai_server(folder, port=port, verify_files=verify_files, **openai)
        print(f"serving {model.folder} at {model.url}/v1 (OpenAI API; Ctrl-C stops)", flush=True)
        model.serve_forever()
        return
    if openai:
        raise BadInput(
            f"{', '.join('--' + name.replace('_', '-') for name in openai)}: for the OpenAI endpoint, and"
            f" '{folder}' is served as a web folder (it has index.html): drop them, or give --endpoint openai"
        )
    server = open_server(folder, port=port)
    # one line, flushed: scripts and tests read the address from it
    print(f"serving {server.folder} at {server.url} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # the way to stop it: not an error
        pass


def _print_matrix(*, folder, model, fusion, kv_cache, logits, planned, runtime, options, target, engine, command,
                  search, speculation, wanted, json_path, adapter) -> None:  # fmt: skip
    """check --matrix prints every combination (Markdown): an option beside it would be ignored, so it is refused."""
    defaults = planned_defaults()
    options_given = {
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
    if any(options_given.values()):
        dropped = ", ".join(name for name, on in options_given.items() if on)
        raise BadInput(f"--matrix prints every combination (Markdown) and takes no other option: drop {dropped}")
    from gpt2onnx.preflight.matrix import markdown

    console.print(markdown(), end="", markup=False, highlight=False, soft_wrap=True)


def _planned_passes(folder, model, fusion, kv_cache, logits, planned) -> dict | None:
    """check's planned export (None for an exported folder, which has its own choices: then none may be given)."""
    dtype, quantization = planned
    passes = {"fusion": fusion, "dtype": dtype, "quantization": quantization, "kv_dtype": kv_cache}
    if folder is not None:
        if passes != planned_defaults() or model is not None or logits != "all":
            raise BadInput(f"'{folder}' is an exported folder with its own choices: drop the planned export's options")
        return None
    return passes


@app.command()
@uses(plan, into="planned")
@uses(run_options, into="options")
@uses_declared(Sampling, Decoding, into="search", make=Search)
@uses(speculate, into="speculation")
@uses_declared(ConstraintOptions, into="wanted")
def check(
    folder: CheckFolderArg = None,
    model: ModelOpt = None,
    fusion: FusionOpt = UNFUSED.name,
    kv_cache: KvCacheOpt = FLOAT_CACHE,
    logits: LogitsOpt = "all",
    runtime: RuntimeOpt = None,
    target: TargetOpt = None,
    engine: EngineOpt = False,
    command: CommandOpt = None,
    matrix: MatrixOpt = False,
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
        return _print_matrix(**{name: value for name, value in locals().items() if name != "matrix"})
    from gpt2onnx.preflight.check import preflight

    # what it reads, and what the planned export would: the checkpoint, the draft, the calibration text
    files = (planned[1].calibration_text, wanted.json_schema, wanted.grammar)
    json_output(json_path, reads=(folder, model, speculation and speculation.folder), files=files)
    passes = _planned_passes(folder, model, fusion, kv_cache, logits, planned)
    asked = runtime is not None or options.flags != run_options_defaults()  # a runtime, or one of its options
    decoding_asked = search.sampling != Sampling() or search.decoding != Decoding()
    result = preflight(
        folder,
        plan=passes,
        logits=logits,
        model=model,
        runtime=options.runtime(runtime) if asked else None,
        targets=target,
        sampling=search.sampling if decoding_asked else None,
        decoding=search.decoding if decoding_asked else None,
        speculation=speculation,
        engine=engine,
        command=command,
        verify_files=options.verify_files,
        constraint=constraint_from(**vars(wanted)),
        adapter=adapter,
    )
    render.preflighted(result)
    if json_path is not None:
        write_json_output(json_path, result.as_dict())
    if not result.ok:  # a verdict, not an error: the report is written, the first conflict is the one line
        raise CheckFailed(f"not supported: {result.line}")
