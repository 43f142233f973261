"""The commands that make a folder (export, optimize, deploy), read it (inspect) and run it (generate, parity): each
builds its options into typed objects, calls one library function and renders its result. compare, eval, serve
and check are in check_commands, bench's in bench_commands (imported in the order --help lists them); every option
is declared once in gpt2onnx.cli.flags.

Imported lazily, inside the commands that need them: the library modules that import torch (exporters, parity,
eval), so that the run commands (inspect, generate, bench, deploy, serve) work on a machine without torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from gpt2onnx.artifact.inspect import inspect as run_inspect
from gpt2onnx.cli import render
from gpt2onnx.cli.app import app, console, err_console, write_json_output
from gpt2onnx.cli.flags import (
    AdapterNameOpt,
    AdaptersOpt,
    BlockOpt,
    CasesOpt,
    DeployFolderArg,
    EmulateFp16Opt,
    ExternalDataOpt,
    FolderArg,
    ForceOpt,
    FusionOpt,
    GateOpt,
    IdsOpt,
    InspectPathArg,
    JsonOpt,
    KvCacheOpt,
    LogitsOpt,
    MaxNewTokensOpt,
    MergedAdapterOpt,
    ModelOpt,
    OpsetOpt,
    OptimizeFusionOpt,
    OptimizeSourceArg,
    OutliersOpt,
    OutOpt,
    PartialOpt,
    PrintJsonOpt,
    PromptOpt,
    RandomInitOpt,
    ReferenceOpt,
    RevisionOpt,
    RuntimeOpt,
    SeedOpt,
    ServerBatchOpt,
    ServerImageOpt,
    ServerNameOpt,
    TargetOpt,
    TextOpt,
    ToleranceOpt,
    TritonDeviceOpt,
    TritonNameOpt,
    ValidateOpt,
    VerifyFilesOpt,
    WebLibOpt,
    given,
)
from gpt2onnx.cli.options import (
    Precision,
    RunOptions,
    Search,
    json_output,
    precision,
    run_options,
    speculate,
    uses,
    uses_declared,
)
from gpt2onnx.decoding.constraints import ConstraintOptions, constraint_from
from gpt2onnx.decoding.generate import generate as run_generate
from gpt2onnx.decoding.speculative import Speculation
from gpt2onnx.errors import CheckFailed
from gpt2onnx.generation_options import Decoding, Sampling
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE
from gpt2onnx.profiles.all_profiles import UNFUSED
from gpt2onnx.targets.deploy import deploy as run_deploy
from gpt2onnx.targets.server_image import DEFAULT_MAX_BATCH as SERVER_MAX_BATCH
from gpt2onnx.verify.gates import parse_gates


@app.command()
@uses(precision, into="precision")
def export(
    model: ModelOpt,
    out: OutOpt = None,
    random_init: RandomInitOpt = False,
    seed: SeedOpt = 0,
    outliers: OutliersOpt = 0.0,
    revision: RevisionOpt = None,
    adapter: MergedAdapterOpt = None,
    adapters: AdaptersOpt = None,
    opset: OpsetOpt = None,
    logits: LogitsOpt = "all",
    block: BlockOpt = None,
    external_data: ExternalDataOpt = None,
    validate: ValidateOpt = True,
    tolerance: ToleranceOpt = None,
    force: ForceOpt = False,
    fusion: FusionOpt = UNFUSED.name,
    allow_partial_fusion: PartialOpt = False,
    kv_cache: KvCacheOpt = FLOAT_CACHE,
    precision: Precision = None,
) -> None:
    """Export a checkpoint to an ONNX decoder with past key/values, checked against PyTorch."""
    from gpt2onnx.exporters.adapter_forms import chosen_form, export_adapted  # lazy: torch
    from gpt2onnx.exporters.export import ExportOptions

    options = ExportOptions(
        logits=logits,
        block=block,
        external_data=external_data,
        validate=validate,
        tolerance=tolerance,
        force=force,
        allow_partial_fusion=allow_partial_fusion,
        kv_cache=kv_cache,
        fusion=fusion,
        **given(opset=opset),
        **precision.keywords(),
    )
    forms = {"--adapter": adapter, "--adapters": adapters}  # each selects an adapter form (exporters.adapter_forms)
    chosen = chosen_form(forms, random_init=random_init)
    with err_console.status(f"exporting {model}{f' with {chosen[0].words}' if chosen else ''}…"):
        result = export_adapted(
            model,
            out,
            given=forms,
            random_init=random_init,
            seed=seed,
            revision=revision,
            outliers=outliers,
            options=options,
        )
    render.exported(result, block)


@app.command()
@uses(precision, into="precision")
def optimize(
    source: OptimizeSourceArg,
    out: OutOpt,
    fusion: OptimizeFusionOpt = None,
    allow_partial_fusion: PartialOpt = False,
    validate: ValidateOpt = True,
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
    folder: DeployFolderArg,
    target: TargetOpt,
    out: OutOpt = None,
    force: ForceOpt = False,
    triton_name: TritonNameOpt = None,
    triton_device: TritonDeviceOpt = "cpu",
    web_lib: WebLibOpt = None,
    server_name: ServerNameOpt = None,
    server_image: ServerImageOpt = None,
    server_batch: ServerBatchOpt = SERVER_MAX_BATCH,
    verify_files: VerifyFilesOpt = True,
) -> None:
    """Make an exported folder ready for genai, transformers.js, Triton, ort-generate, phones, the browser, a server."""
    options = {"triton_name": triton_name, "triton_device": triton_device, "web_lib": web_lib}
    options |= {"server_name": server_name, "server_image": server_image, "server_max_batch": server_batch}
    result = run_deploy(folder, target, out=out, force=force, verify_files=verify_files, **options)
    render.deployed(result, folder)


@app.command("inspect")
def inspect_command(path: InspectPathArg, as_json: PrintJsonOpt = False, verify_files: VerifyFilesOpt = True) -> None:
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
    prompt: PromptOpt = None,
    ids: IdsOpt = None,
    max_new_tokens: MaxNewTokensOpt = 32,
    json_path: JsonOpt = None,
    runtime: RuntimeOpt = None,
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
    cases: CasesOpt = 20,
    seed: SeedOpt = 0,
    json_path: JsonOpt = None,
    reference: ReferenceOpt = None,
    gate: GateOpt = None,
    runtime: RuntimeOpt = None,
    emulate_fp16: EmulateFp16Opt = False,
    text: TextOpt = None,
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
