"""`gpt2onnx optimize`: apply a fusion profile to an exported decoder (ours or optimum's) and write a new
folder, checked against the graph it came from before anything is written."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from gpt2onnx.artifact.contract import shared_cache_io
from gpt2onnx.artifact.folder import (
    COMPANION_FILES,
    CONFIG_FILE,
    MODEL_FILE,
    TOKENIZER_FILES,
    ModelFolder,
    check_output,
    copy_regular_file,
    graph_data_files,
    read_manifest,
    read_n_positions,
    staged_folder,
    write_manifest,
)
from gpt2onnx.artifact.graph import graph_summary, resolve_model_path, save_onnx
from gpt2onnx.artifact.manifest import Manifest
from gpt2onnx.artifact.report import CheckReport
from gpt2onnx.errors import BadInput, CheckFailed
from gpt2onnx.passes.pipeline import GraphPasses
from gpt2onnx.passes.precision import FP16_KEEP_GROUPS, QuantizeOptions
from gpt2onnx.verify.evaluate import EvalGates, EvalReport, check_eval_options, evaluate_written
from gpt2onnx.verify.gates import tolerances_for
from gpt2onnx.verify.parity import SOURCE_ONNX, validate_against_source

log = logging.getLogger(__name__)


@dataclass
class OptimizeResult:
    """What :func:`optimize` returns: the folder written, its manifest, the check it passed, timings in seconds."""

    folder: Path
    manifest: Manifest
    check: CheckReport | None = None  # None with validate=False
    timings: dict[str, float] = field(default_factory=dict)
    quality: EvalReport | None = None  # quality on real text, with eval_text (--eval-text)


def optimize(
    source: str | Path,
    out: str | Path,
    *,
    fusion: str,
    allow_partial: bool = False,
    force: bool = False,
    validate: bool = True,
    tolerance: float = 1e-4,
    external_data: bool | None = None,
    quantization: QuantizeOptions = QuantizeOptions(),
    dtype: str = "fp32",
    gates: dict | None = None,
    keep_fp32: tuple[str, ...] = FP16_KEEP_GROUPS,
    eval_text: str | Path | None = None,
    eval_gates: EvalGates = EvalGates(),
) -> OptimizeResult:
    """Rewrite an exported decoder (gpt2onnx's or optimum's) with a fusion profile and a precision, checked against
    the graph it came from before the new folder is written.

    Args:
        source: an exported folder or an .onnx file.
        out: the new folder (never the source's); replaced only with ``force``, and only if gpt2onnx wrote it.
        fusion: the profile: ort, portable or tensorrt ('none' with a precision change only).
        allow_partial: keep a graph whose fusions fall short of the golden counts.
        validate: compare with the source (fp32: max |Δlogits| within ``tolerance``; otherwise the gates).
        quantization, dtype, keep_fp32: weight quantization, fp16 and what fp16 keeps in fp32.
        gates: overrides of the precision's default gates.
        eval_text: a text file: the new graph's perplexity, KL and top-1 against the source graph on it
            (:mod:`gpt2onnx.verify.evaluate`), gated by ``eval_gates`` (ΔPPL percent, mean KL) before writing.

    Returns:
        OptimizeResult: the new folder, its manifest, the CheckReport of the check against the source, timings.

    Raises:
        BadInput, ContractError (not an ONNX decoder, missing external data), CheckFailed (fusion short of its
        golden counts, or the rewritten graph differs from its source), OutputError.
    """
    passes = GraphPasses(fusion, allow_partial, dtype, quantization, keep_fp32)
    dtype = passes.check()
    if fusion == "none" and passes.precision == "float32":
        raise BadInput(
            "nothing to do: fusion 'none' with fp32 weights leaves the model as it is; choose a fusion profile or a"
            " precision"
        )
    tolerances_for(passes.precision, {"logits": tolerance} if passes.precision == "float32" else gates)
    check_eval_options(eval_text, eval_gates)
    model_path = resolve_model_path(Path(source))
    if eval_text is not None and not any((model_path.parent / name).is_file() for name in TOKENIZER_FILES):
        raise BadInput(
            f"eval_text (--eval-text) needs the model's tokenizer, but '{model_path.parent}' has no tokenizer files"
            " (tokenizer.json, or vocab.json and merges.txt): copy them into the source folder, or drop --eval-text"
        )
    # a clear error for a file that is not ONNX, or external data that is missing or outside its folder (a
    # location with '..', a link leading out, a FIFO), before the weights are read
    graph_data_files(model_path)
    out = Path(out)
    if out.resolve() == model_path.parent.resolve():
        raise BadInput("the output folder is the input folder: write the optimized model to another folder")
    check_output(out, force=force, protect=(model_path.parent,))
    timings = {}
    passed = passes.apply(onnx.load(str(model_path)), timings)
    fused, passed.model = passed.model, None
    with staged_folder(out, force=force, protect=(model_path.parent,)) as folder:
        files = save_onnx(fused, folder / MODEL_FILE, external_data=external_data)
        facts = graph_summary(fused)
        del fused
        for name in (CONFIG_FILE, *COMPANION_FILES):
            if (model_path.parent / name).is_file():
                copy_regular_file(model_path.parent / name, folder / name, within=model_path.parent)
        check = None
        previous = read_manifest(model_path.parent)
        if validate:
            start = time.perf_counter()
            check = validate_against_source(
                folder / MODEL_FILE,
                model_path,
                precision=passes.precision,
                tolerance=tolerance,
                gates=gates,
                quantization=passed.quantization,
                source_record=previous.source if previous else None,
            )
            timings["validate_seconds"] = time.perf_counter() - start
            if not check.passed:
                raise CheckFailed(f"validation failed: {check.summary()}; nothing was written", check)
        io = previous.io if previous and dtype != "float16" else None
        quality = None
        if eval_text is not None:
            start = time.perf_counter()
            reference = ModelFolder(model_path.parent, model_path, previous, read_n_positions(folder))
            quality = evaluate_written(
                folder,
                reference=reference,
                text=eval_text,
                gates=eval_gates,
                against=SOURCE_ONNX,
                label=str(out),
                precision=passes.precision,
            )
            timings["eval_seconds"] = time.perf_counter() - start
            if not quality.passed:
                failing = next(r.check for r in quality.rows if r.check and r.check.failures)
                raise CheckFailed(
                    f"quality on real text failed: {'; '.join(quality.failures)}; nothing was written", failing
                )
        manifest = Manifest(
            kind="decoder",
            name=previous.name if previous else model_path.parent.name,
            source=previous.source if previous else {"kind": "onnx", "path": str(model_path.resolve())},
            optimized_from=str(model_path.resolve()),
            architecture=previous.architecture if previous else None,
            dtype=dtype if dtype == "float16" or not previous else previous.dtype,
            # the source's IO record, with the shared cache's dim names when the new graph shares its cache
            io=shared_cache_io(io) if io is not None and passed.kv_cache == "shared" else io,
            **facts,
            options={
                **(previous.options if previous else {}),
                "fusion": fusion,
                "allow_partial_fusion": allow_partial,
                "external_data": len(files) > 1,
            },
            fusion=passed.fusion,
            fp16=passed.fp16,
            quantization=passed.quantization,
            kv_cache=passed.kv_cache,
            check=check,
            eval=quality.as_dict() if quality else None,
            timings=timings,
        )
        manifest = write_manifest(folder, manifest)
    return OptimizeResult(out, manifest, check, timings, quality)
