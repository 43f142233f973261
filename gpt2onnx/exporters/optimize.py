"""`gpt2onnx optimize`: apply a fusion profile to an exported decoder (ours or optimum's) and write a new
folder, checked against the graph it came from before anything is written."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import onnx

from gpt2onnx.artifact.contract import buffer_cache_io
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
from gpt2onnx.artifact.graph import graph_facts, graph_summary, load_graph, load_model, resolve_model_path, save_onnx
from gpt2onnx.artifact.manifest import Manifest
from gpt2onnx.capabilities import Declared, Need, Unsupported, as_source
from gpt2onnx.choices.of_folder import folder_choices
from gpt2onnx.errors import BadInput
from gpt2onnx.exporters.export import ExportResult, passed_or_refused
from gpt2onnx.layouts.all_layouts import layout
from gpt2onnx.passes.batch_invariance import strip as strip_batch_invariance
from gpt2onnx.passes.pipeline import GraphPasses, timed
from gpt2onnx.precisions.all_precisions import FP32
from gpt2onnx.precisions.fp16 import FP16_KEEP_GROUPS
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.profiles.all_profiles import OPTIMIZE_DEFAULT, PROFILES, fused_with
from gpt2onnx.verify.calibration import calibration_for, kv_cache_calibration
from gpt2onnx.verify.evaluate import eval_source, evaluate_written
from gpt2onnx.verify.gates import EvalGates, tolerances_for
from gpt2onnx.verify.parity import SOURCE_ONNX, validate_against_source
from gpt2onnx.verify.text import TextSource

log = logging.getLogger(__name__)


OptimizeResult = ExportResult  # the same record: the folder written, its manifest, its checks, timings


def optimize(
    source: str | Path,
    out: str | Path,
    *,
    fusion: str | None = None,
    allow_partial: bool = False,
    force: bool = False,
    validate: bool = True,
    tolerance: float = 1e-4,
    external_data: bool | None = None,
    quantization: QuantizeOptions = QuantizeOptions(),
    dtype: str = FP32.short,
    gates: dict | None = None,
    keep_fp32: tuple[str, ...] = FP16_KEEP_GROUPS,
    eval_text: str | Path | None = None,
    eval_gates: EvalGates = EvalGates(),
    kv_cache: str = FLOAT_CACHE,
) -> OptimizeResult:
    """Rewrite an exported decoder (gpt2onnx's or optimum's) with a fusion profile and a precision, checked against
    the graph it came from before the new folder is written.

    Args:
        source: an exported folder or an .onnx file.
        out: the new folder (never the source's); replaced only with ``force``, and only if gpt2onnx wrote it.
        fusion: the profile (gpt2onnx.profiles; 'none' with a precision change only). None: the source's own
            profile when it is fused (read from its ops), else ort, or the first registered profile that works
            with the other choices (a quantized ``kv_cache`` needs a layout that quantizes it). Fusing a graph with
            the profile it holds is a no-op; another profile over a fused graph is refused (BadInput).
        allow_partial: keep a graph whose fusions fall short of the golden counts.
        validate: compare with the source (fp32: max |Δlogits| within ``tolerance``; otherwise the gates).
        quantization, dtype, keep_fp32: weight quantization, fp16 and what fp16 keeps in fp32.
        gates: overrides of the precision's default gates.
        eval_text: a text file: the new graph's perplexity, KL and top-1 against the source graph on it
            (:mod:`gpt2onnx.verify.evaluate`), gated by ``eval_gates`` (ΔPPL percent, mean KL) before writing.
        kv_cache: the K/V cache's type: float, or a quantized one (scales calibrated on the standard library's
            docstrings through the source's graph; :mod:`gpt2onnx.precisions.kv_cache`).

    Returns:
        OptimizeResult: the new folder, its manifest, the CheckReport of the check against the source, timings.

    Raises:
        BadInput, ContractError (not an ONNX decoder, missing external data), CheckFailed (fusion short of its
        golden counts, or the rewritten graph differs from its source), OutputError.
    """
    passes = _passes(fusion, allow_partial, dtype, quantization, keep_fp32, kv_cache)
    if passes.changes_nothing:
        raise BadInput(
            f"nothing to do: fusion '{passes.fusion}' with fp32 weights leaves the model as it is; choose a fusion"
            " profile or a precision"
        )
    tolerances_for(passes.precision.name, {"logits": tolerance} if passes.precision.exact else gates)
    text = eval_source(eval_text, eval_gates)
    model_path = resolve_model_path(Path(source))
    if text is not None and not any((model_path.parent / name).is_file() for name in TOKENIZER_FILES):
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
    facts = graph_facts(load_graph(model_path))  # the source's graph, without its weights
    if fusion is None:
        passes = _own_profile(facts, passes)
    passes.verdict(OPTIMIZE, *(as_source(c) for c in folder_choices(facts, str(model_path.parent)))).check()
    _refuse_a_fused_copy(facts, passes, model_path)
    timings = {}
    model = strip_batch_invariance(load_model(model_path))  # the fusion rules match the plain patterns
    previous = read_manifest(model_path.parent)
    architecture = previous.architecture if previous else None  # None: a folder this tool did not write
    passed = passes.apply(
        model,
        timings,
        _calibration(passes, model_path, model),
        activation=architecture.activation if architecture else "gelu_new",
        upcast_attention=bool(architecture and architecture.reorder_and_upcast_attn),
        kv_calibration=_kv_calibration(passes, model_path, model),
    )
    del model
    checks = _Checks(validate, tolerance, gates, text, eval_gates)
    with staged_folder(out, force=force, protect=(model_path.parent,)) as folder:
        manifest, check, quality = _optimize_into(
            folder, model_path, passes, passed, checks, timings, out=out, external_data=external_data
        )
    return OptimizeResult(out, manifest, check, timings, quality)


# What optimize itself needs of its source: the new graph is checked against it, which a quantized cache is not a
# reference for (its float-cache folder is)
OPTIMIZE = Declared(
    "command",
    "optimize",
    requires=(
        Need(
            "source_kv_dtype",
            allowed={FLOAT_CACHE},
            why="checks the new graph against its source",
            fix="optimize the float-cache folder it was made from",
        ),
    ),
    label="optimize",
)


def _passes(fusion, allow_partial, dtype, quantization, keep_fp32, kv_cache) -> GraphPasses:
    """The passes asked for. Without a profile: the default one, else the first registered profile that builds on
    it and works with the other choices (a quantized cache needs a layout that quantizes it)."""
    if fusion is not None:
        return GraphPasses(fusion, allow_partial, dtype, quantization, keep_fp32, kv_cache)
    candidates = [OPTIMIZE_DEFAULT, *(p for p in PROFILES.values() if p.base is OPTIMIZE_DEFAULT)]
    first = None
    for candidate in candidates:
        try:
            return GraphPasses(candidate.name, allow_partial, dtype, quantization, keep_fp32, kv_cache)
        except Unsupported as refused:
            first = first or refused
    raise first


def _own_profile(facts, passes: GraphPasses) -> GraphPasses:
    """The passes with the profile the graph is fused with already, if any (no --fusion given), where the other
    choices work with it."""
    held = fused_with(facts.ops)
    if held is None or held is passes.profile:
        return passes
    try:
        kept = dataclasses.replace(passes, fusion=held.name)
    except Unsupported:
        return passes
    log.info("the source is fused with the %s profile: keeping it", held.name)
    return kept


def _refuse_a_fused_copy(facts, passes: GraphPasses, model_path: Path) -> None:
    """Refuse options that would write the source again: its own fusion profile (a no-op) with fp32 weights."""
    if not passes.profile.fusions or not passes.precision.exact or passes.cache_format is not None:
        return
    if fused_with(facts.ops) is passes.profile:
        raise BadInput(
            f"nothing to do: '{model_path.parent}' is already fused with the {passes.fusion} profile (fusing it again"
            " changes nothing): choose a precision (--dtype fp16, --quantize int8 or int4)"
        )


@dataclass(frozen=True)
class _Checks:
    """What the new graph is held to before it is written: the source (``validate``, within ``tolerance`` or the
    ``gates``), and a text (``text``, its ``eval_gates``)."""

    validate: bool
    tolerance: float
    gates: dict | None
    text: TextSource | None
    eval_gates: EvalGates


def _optimize_into(
    folder: Path, model_path: Path, passes: GraphPasses, passed, checks: _Checks, timings, *, out: Path, external_data
):
    """The rewritten graph and the source's companion files written into the staged ``folder``, checked against
    the source, and its manifest; returns (manifest, check, quality)."""
    fused, passed.model = passed.model, None
    files = save_onnx(fused, folder / MODEL_FILE, external_data=external_data)
    facts = graph_summary(fused)
    del fused
    for name in (CONFIG_FILE, *COMPANION_FILES):
        if (model_path.parent / name).is_file():
            copy_regular_file(model_path.parent / name, folder / name, within=model_path.parent)
    previous = read_manifest(model_path.parent)
    check = None
    if checks.validate:
        with timed(timings, "validate"):
            check = validate_against_source(
                folder / MODEL_FILE,
                model_path,
                precision=passes.precision.name,
                tolerance=checks.tolerance,
                gates=checks.gates,
                quantization=passed.quantization,
                source_record=previous.source if previous else None,
            )
        passed_or_refused(check)
    quality = None
    if checks.text is not None:
        reference = ModelFolder(model_path.parent, model_path, previous, read_n_positions(folder))
        with timed(timings, "eval"):
            quality = evaluate_written(
                folder,
                reference=reference,
                text=checks.text,
                gates=checks.eval_gates,
                against=SOURCE_ONNX,
                label=str(out),
                precision=passes.precision.name,
            )
    manifest = _manifest(model_path, previous, passes, passed, facts, external=len(files) > 1)
    manifest = dataclasses.replace(manifest, check=check, eval=quality, timings=timings)
    return write_manifest(folder, manifest), check, quality


def _manifest(model_path: Path, previous, passes: GraphPasses, passed, facts: dict, *, external: bool) -> Manifest:
    """The new folder's manifest: the source's records (or what an optimum folder lets us know), with the new
    graph's facts and passes."""
    io = previous.io if previous and passes.dtype != "float16" else None
    records = passed.records()
    if previous and previous.fusion and passed.fusion and previous.fusion.profile == passed.fusion.profile:
        if not any(passed.fusion.applied.values()):  # a no-op on a fused graph: the rewrites the source's fusion did
            records["fusion"] = previous.fusion
    return Manifest(
        kind="decoder",
        name=previous.name if previous else model_path.parent.name,
        source=previous.source if previous else {"kind": "onnx", "path": str(model_path.resolve())},
        optimized_from=str(model_path.resolve()),
        architecture=previous.architecture if previous else None,
        dtype=passes.dtype if passes.dtype == "float16" or not previous else previous.dtype,
        # the source's IO record, with the shared cache's dim names when the new graph shares its cache
        io=buffer_cache_io(io, cache_dtype=_cache_dtype(passes))
        if io is not None and layout(passed.cache_layout).in_place
        else io,
        **facts,
        options={
            **(previous.options if previous else {}),
            "fusion": passes.fusion,
            "allow_partial_fusion": passes.allow_partial_fusion,
            "external_data": external,
            **({"kv_cache": passes.kv_dtype} if passes.cache_format is not None else {}),
        },
        **records,
        outside_vocabulary=previous.outside_vocabulary if previous else {},
    )


def _cache_dtype(passes: GraphPasses) -> str | None:
    return passes.cache_format.dtype if passes.cache_format is not None else None


def _vocabulary(model_path: Path, proto: onnx.ModelProto) -> int:
    logits = next((o for o in proto.graph.output if o.name == "logits"), None)
    dims = logits.type.tensor_type.shape.dim if logits is not None else []
    if not dims or not dims[-1].HasField("dim_value"):
        raise BadInput(f"'{model_path}' declares no vocabulary size on its logits output: it cannot be calibrated")
    return dims[-1].dim_value


def _kv_calibration(passes: GraphPasses, model_path: Path, proto: onnx.ModelProto):
    """What a quantized K/V cache's scales are calibrated on (None for a float cache)."""
    if passes.cache_format is None:
        return None
    config = model_path.parent / "config.json"
    positions = read_n_positions(model_path.parent) if config.is_file() else 1024
    return kv_cache_calibration(
        model_path.parent, vocab_size=_vocabulary(model_path, proto), n_positions=positions, wanted=True
    )


def _calibration(passes: GraphPasses, model_path: Path, proto: onnx.ModelProto):
    """A calibrated int4 algorithm's token sequences, in the vocabulary the graph's logits declare and within the
    folder's context length (config.json; 1024, GPT-2's, for a folder without one)."""
    if not passes.quantization.needs_calibration:
        return None
    logits = next((o for o in proto.graph.output if o.name == "logits"), None)
    dims = logits.type.tensor_type.shape.dim if logits is not None else []
    if not dims or not dims[-1].HasField("dim_value"):
        raise BadInput(f"'{model_path}' declares no vocabulary size on its logits output: it cannot be calibrated")
    config = model_path.parent / "config.json"
    positions = read_n_positions(model_path.parent) if config.is_file() else 1024
    return calibration_for(passes.quantization, model_path.parent, vocab_size=dims[-1].dim_value, n_positions=positions)
