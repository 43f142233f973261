"""Parity checks, each ending in one :class:`CheckReport`: an exported folder against PyTorch on randomized
cases (``gpt2onnx parity``), an export before it is written, and a rewritten graph against its source.

Each chooses its reference (PyTorch from the checkpoint or the manifest's source, or the source graph), its
cases and, for a quantized file, the reference with the file's own rounded weights, into a :class:`CheckPlan`;
:func:`run_plan` runs every plan the same way. An fp32 export keeps its own tighter check (one left-padded batch
with decode steps against a logits tolerance, or a single block against its PyTorch block)."""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from gpt2onnx.artifact.folder import ModelFolder, open_folder, read_n_positions
from gpt2onnx.artifact.graph import load_model, save_onnx
from gpt2onnx.artifact.lora import adapter_declared, adapter_of
from gpt2onnx.artifact.manifest import QuantizationRecord
from gpt2onnx.artifact.report import CheckReport, WeightRounding
from gpt2onnx.errors import BadInput
from gpt2onnx.files import sha256_file
from gpt2onnx.machine import describe_machine
from gpt2onnx.precisions import all_precisions as precisions
from gpt2onnx.pytorch.checkpoint import Checkpoint, load_checkpoint, with_adapter
from gpt2onnx.pytorch.reference import reference_model
from gpt2onnx.runtimes.all_runtimes import RuntimeOptions, check_combination, open_runtime
from gpt2onnx.runtimes.decoder import cpu_decoder, file_shape
from gpt2onnx.runtimes.providers import ProviderConfig, cpu_session, session_placement
from gpt2onnx.verify.gates import (
    FLAT_NATS,
    QUALITY_GATES,
    TOLERANCES,
    apply_gates,
    cache_tolerances,
    file_gates_for,
    tolerances_for,
    with_cache,
)
from gpt2onnx.verify.kv_path import check_kv_path
from gpt2onnx.verify.lockstep import (
    CaseResult,
    OnnxReference,
    compare_block,
    compare_decoder,
    left_padded_batch,
    random_cases,
    run_case,
    run_loop_case,
)
from gpt2onnx.verify.metrics import summarize
from gpt2onnx.verify.rounding import rounded_checkpoint, rounded_source_graph, weight_rounding

log = logging.getLogger(__name__)

PYTORCH = "PyTorch"
SOURCE_ONNX = "source ONNX model"
MAX_CASES = 10_000


def gate_report(
    results: list[CaseResult],
    precision: str,
    gates: dict,
    *,
    against: str,
    provider: str = "cpu",
    keep_cases: bool = False,
    runtime: str = "onnxruntime",
    placement=None,
    weights=None,
) -> CheckReport:
    """The report of randomized cases: their totals (with the file's ``weights`` figures, where it has them)
    against the gates, the machine they ran on and where the session's nodes ran."""
    measured = summarize(results)
    if weights is not None:
        measured = dataclasses.replace(measured, weights=weights)
    failures = tuple(apply_gates(measured, gates, cases=len(results)))
    cases = tuple(r.as_dict() for r in results) if keep_cases else ()
    machine = describe_machine(provider.split(" ")[0])
    return CheckReport(
        precision,
        against,
        gates,
        measured,
        failures,
        provider=provider,
        runtime=runtime,
        cases=cases,
        machine=machine,
        placement=placement,
    )


@dataclasses.dataclass(frozen=True)
class CheckPlan:
    """One check, planned before it runs (export, optimize and parity each choose their reference and cases,
    then :func:`run_plan` runs any plan the same way).

    precision: the gates' family (a precision's name; tf32 for fp32 with TF32 matmuls).
    reference: what the file is held to: PyTorch (GPT2LMHeadModel) or the source graph (OnnxReference).
    against: the reference's name in the report.
    cases: the lockstep cases (gpt2onnx.verify.lockstep.random_cases).
    gates: the user's overrides of the precision's gates (None: its own).
    rounded: a quantized file's reference with its own rounded weights (the file check, and whether the quality
        gates apply); None for a float file.
    emulate_fp16: also run the cases with fp16 arithmetic emulated as a GPU computes it (the precision's
        ``emulate_fp16``; export and optimize) on ``model_path``.
    kv_path_seed: run the K/V-path checks of the model against itself with this seed (parity); None: not run.
    text_ids: the prompts' token source (parity --text); None: random ids.
    keep_cases: keep every case in the report (parity).
    provider: the provider's label in the report (None: the decoder's).
    """

    precision: str
    reference: object
    against: str
    cases: tuple
    vocab_size: int
    n_positions: int
    gates: dict | None = None
    rounded: "RoundedReference | None" = None
    emulate_fp16: bool = False
    model_path: Path | None = None
    kv_path_seed: int | None = None
    text_ids: np.ndarray | None = None
    keep_cases: bool = False
    provider: str | None = None


def run_plan(decoder, plan: CheckPlan, *, runtime: str = "onnxruntime", on_case=None) -> CheckReport:
    """Run ``plan`` on ``decoder``: its cases against its reference under the precision's gates (the quality
    gates only where a quantized file's weights were trained), the K/V-path checks where planned, the file
    judged by itself against its own rounded weights, fp16 arithmetic emulated where planned. One frozen
    report, its failures computed from its gates and figures."""
    # a quantized K/V cache (read from the stepper's graph) has its own gates in place of an exact precision's
    kv_dtype = getattr(getattr(decoder, "shape", None), "kv_dtype", "float32")
    tolerances = cache_tolerances(plan.precision, kv_dtype, plan.gates) or with_cache(
        plan.precision, kv_dtype, tolerances_for(plan.precision, plan.gates), plan.gates
    )
    quality = tolerances if plan.rounded is None or plan.rounded.trained else {}
    run = run_loop_case if decoder.capabilities.owns_loop else run_case
    results = []
    for case in plan.cases:
        results.append(run(decoder, plan.reference, case, vocab_size=plan.vocab_size, text_ids=plan.text_ids))
        if on_case is not None:
            on_case(results[-1])
    kv_path = None
    if plan.kv_path_seed is not None:
        kv_path = check_kv_path(
            decoder, vocab_size=plan.vocab_size, tolerances=tolerances, seed=plan.kv_path_seed, text_ids=plan.text_ids
        )
    judged = plan.rounded and file_check(decoder, plan.rounded, plan)
    report = gate_report(
        results,
        plan.precision,
        quality,
        against=plan.against,
        provider=plan.provider or decoder.provider,
        keep_cases=plan.keep_cases,
        runtime=runtime,
        placement=decoder.placement,
    )
    if kv_path is not None:
        report = dataclasses.replace(report, kv_path=kv_path)
    if plan.rounded is not None:
        report, rounded = judge_quality(report, plan.rounded)
        return with_file_check(report, judged, rounded)
    if not (plan.emulate_fp16 and precisions.precision(plan.precision).emulate_fp16):
        return report
    from gpt2onnx.verify.fp16_emulation import write_emulated_fp16

    with tempfile.TemporaryDirectory(prefix="gpt2onnx-fp16-") as tmp:
        emulated_path = write_emulated_fp16(Path(plan.model_path), Path(tmp) / "emulated.onnx")
        emulated_plan = dataclasses.replace(plan, emulate_fp16=False, provider=None)
        emulated_decoder = cpu_decoder(emulated_path)
        emulated_decoder.activate_like(decoder)  # an active LoRA adapter stays active
        emulated = run_plan(emulated_decoder, emulated_plan)
    return dataclasses.replace(report, fp16_emulated=emulated)


@dataclasses.dataclass(frozen=True)
class RoundedReference:
    """For a quantized file: the reference run with the file's own dequantized weights, what it is called, the
    weights' figures (:func:`gpt2onnx.verify.rounding.weight_rounding`), and whether the weights were trained
    (the quality gates judge trained weights only)."""

    reference: object
    against: str
    weights: WeightRounding
    trained: bool
    why: str
    algorithm: str | None = None  # int4's (the manifest's record): what its weights are judged by (file_gates_for)


def precision_gates(
    model_path,
    reference,
    *,
    precision: str,
    vocab_size: int,
    n_positions: int,
    gates=None,
    decoder=None,
    against: str = PYTORCH,
    rounded: RoundedReference | None = None,
) -> CheckReport:
    """What export and optimize check before writing a reduced-precision model, on the CPU provider: the plan of
    four seeded randomized cases (batches up to 4) against ``reference`` under the precision's gates; for fp16
    also with fp16 arithmetic emulated as a GPU does it (:mod:`gpt2onnx.verify.fp16_emulation`: the CPU
    provider computes most fp16 nodes in fp32, which hides an overflow the graph has on fp16 hardware); for int8
    and int4 the file judged by itself against ``rounded`` (:mod:`gpt2onnx.verify.rounding`), with the quality
    gates only where the weights were trained. ``decoder``: a CPU decoder already open on ``model_path``."""
    plan = CheckPlan(
        precision,
        reference,
        against,
        tuple(random_cases(4, seed=0, n_positions=n_positions, max_batch=4)),
        vocab_size,
        n_positions,
        gates=gates,
        rounded=rounded,
        emulate_fp16=True,
        model_path=Path(model_path),
    )
    return run_plan(decoder or cpu_decoder(model_path), plan)


def with_file_check(report: CheckReport, file_report: CheckReport, rounded: RoundedReference) -> CheckReport:
    """``report`` with the file check attached (its failures among the report's), and which quality gates ran."""
    return dataclasses.replace(report, rounded=file_report, quality_gates=rounded.why)


def rounded_pytorch(
    model_path: Path, ckpt: Checkpoint, quantization: QuantizationRecord, *, switchable: bool = False
) -> RoundedReference:
    """PyTorch with the quantized file's own dequantized weights, and how far those are from ``ckpt``'s.
    ``switchable``: the file holds the base quantized and ``ckpt``'s adapter in fp32 LoRA slots: the base's weights
    rounded, with PEFT's adapter on top (not the merged weights rounded)."""
    source = ckpt.base_state_dict if switchable else ckpt.state_dict
    figures, weights = weight_rounding(load_model(model_path), lambda name: _tensor(source, name), quantization)
    trained, why = quality_gates_apply(ckpt.source)
    rounded_model = reference_model(rounded_checkpoint(ckpt, weights, keep_adapter=switchable))
    against = f"{PYTORCH} with the file's rounded weights"
    return RoundedReference(rounded_model, against, figures, trained, why, quantization.algorithm)


def file_check(decoder, rounded: RoundedReference, plan: CheckPlan) -> CheckReport:
    """The quantized file judged by itself: four seeded cases against the reference with its own rounded
    weights, and its weights' figures, under the file gates (FILE_GATES, with the plan's --gate overrides that
    name them)."""
    run = run_loop_case if decoder.capabilities.owns_loop else run_case
    results = [
        run(decoder, rounded.reference, case, vocab_size=plan.vocab_size)
        for case in random_cases(4, seed=0, n_positions=plan.n_positions, max_batch=4)
    ]
    file_gates = file_gates_for(plan.precision, plan.gates, algorithm=rounded.algorithm)
    return gate_report(results, plan.precision, file_gates, against=rounded.against, weights=rounded.weights)


def judge_quality(report: CheckReport, rounded: RoundedReference) -> tuple[CheckReport, RoundedReference]:
    """Whether the quality gates apply, from what ``report`` measured: where the source is a checkpoint but the
    reference's own predictions are nearly flat (random weights saved as a checkpoint: their distance from uniform
    under FLAT_NATS), a new report without the quality gates (its failures computed again) and ``rounded`` told
    why; else both as they are, ``rounded`` with the reason."""
    flatness = report.measured.reference_information
    if not rounded.trained or flatness is None:
        return report, rounded
    if flatness >= FLAT_NATS:
        why = f"quality gates applied (weights from a checkpoint, predicting {flatness:.2f} nats from uniform)"
        return report, dataclasses.replace(rounded, why=why)
    gates = {name: value for name, value in report.gates.items() if name not in QUALITY_GATES}
    failures = tuple(apply_gates(report.measured, gates, cases=report.measured.cases or 1))
    why = (
        f"quality gates not applied: the reference predicts nearly flat distributions ({flatness:.2f} nats from"
        f" uniform, under {FLAT_NATS}), as random weights do, where KL and top-k agreement measure nothing; the"
        " file is judged by its weights and its activation path"
    )
    report = dataclasses.replace(report, gates=gates, gate_failures=failures)
    return report, dataclasses.replace(rounded, trained=False, why=why)


def quality_gates_apply(source: dict | None) -> tuple[bool, str]:
    """Whether a quantized model's quality gates (KL, top-1 and top-5 against fp32) mean something for weights from
    ``source`` (a manifest's source record): not for random weights, whose nearly flat predictions make top-k
    agreement chance; the file checks judge those."""
    if isinstance(source, dict) and source.get("kind") == "random":
        return False, (
            "quality gates not applied: random weights predict nearly flat distributions, where KL and top-k"
            " agreement measure nothing; the file is judged by its weights and its activation path"
        )
    return True, "quality gates applied (weights from a checkpoint)"


def validate_export(
    path: Path,
    ckpt: Checkpoint,
    *,
    precision: str,
    block: int | None,
    tolerance: float | None,
    gates,
    quantization: QuantizationRecord | None = None,
    adapter: Path | None = None,
) -> CheckReport:
    """An export before it is written: fp32 on a left-padded batch of 3 (empty past, then two decode steps)
    within ``tolerance``; reduced precisions through their gates (a quantized one also judged by itself against
    PyTorch with its own rounded weights); a single block against its PyTorch block. ``adapter``: a switchable
    graph with that LoRA adapter file active, ``ckpt`` carrying the same adapter (a quantized base's rounded
    reference: its rounded weights with PEFT's fp32 adapter on top)."""
    decode_steps = 2
    length = max(2, min(8, ckpt.spec.n_positions - decode_steps))
    input_ids, mask = left_padded_batch(ckpt.spec.vocab_size, batch=3, length=length, seed=0)
    reference = reference_model(ckpt)
    cache = file_shape(path, ckpt.spec.n_positions).kv_dtype if block is None else "float32"  # a block has none
    if not precisions.precision(precision).exact or cache_tolerances(precision, cache, gates) is not None:
        log.info("checking the %s gates against transformers' GPT2LMHeadModel", precision)
        switchable = adapter is not None
        rounded = rounded_pytorch(path, ckpt, quantization, switchable=switchable) if quantization else None
        return precision_gates(
            path,
            reference,
            precision=precision,
            vocab_size=ckpt.spec.vocab_size,
            n_positions=ckpt.spec.n_positions,
            gates=gates,
            rounded=rounded,
            decoder=cpu_decoder(path, adapter=adapter) if switchable else None,
        )
    tolerance = tolerances_for(precision, {"logits": tolerance} if tolerance is not None else gates)["logits"]
    log.info("validating against transformers' GPT2LMHeadModel (batch 3, left-padded, %d decode steps)", decode_steps)
    if block is not None:
        session = cpu_session(path)
        report = compare_block(
            session, reference, block, input_ids, mask, decode_steps=decode_steps, tolerance=tolerance
        )
        report = dataclasses.replace(report, placement=session_placement(session))
    else:
        decoder = cpu_decoder(path, adapter=adapter)
        report = compare_decoder(decoder, reference, input_ids, mask, decode_steps=decode_steps, tolerance=tolerance)
        report = dataclasses.replace(report, placement=decoder.placement)
    log.info("%s", report.summary())
    return report


def validate_against_source(
    rewritten: Path,
    source: Path,
    *,
    precision: str,
    tolerance: float,
    gates,
    quantization: QuantizationRecord | None = None,
    source_record: dict | None = None,
) -> CheckReport:
    """A rewritten graph (fused, fp16, quantized) against the graph it came from: fp32 on a left-padded batch
    with an empty past and decode steps; reduced precisions through their gates on a few randomized cases (a
    quantized one also judged by itself against the source graph with its own rounded weights).
    ``source_record``: the source's manifest source record (random weights are not judged by quality gates)."""
    n_positions = read_n_positions(rewritten.parent)
    fused = cpu_decoder(rewritten, n_positions=n_positions)
    reference = OnnxReference(cpu_decoder(source, n_positions=n_positions))
    vocab = fused.vocab_size or 1000
    # a quantized cache is held to its own gates (run_plan chooses them from the stepper's cache dtype)
    quantized_cache = cache_tolerances(precision, fused.shape.kv_dtype, gates) is not None
    if quantized_cache or not precisions.precision(precision).exact:
        with tempfile.TemporaryDirectory(prefix="gpt2onnx-rounded-") as tmp:
            rounded = None
            if quantization is not None and not quantized_cache:
                source_model = load_model(source)
                initializers = {i.name: i for i in source_model.graph.initializer}

                def source_weight(name: str):
                    return numpy_helper.to_array(initializers[name]) if name in initializers else None

                figures, weights = weight_rounding(onnx.load(str(rewritten)), source_weight, quantization)
                rounded_path = Path(tmp) / "rounded.onnx"
                save_onnx(rounded_source_graph(source_model, weights), rounded_path, external_data=None)
                del source_model, initializers
                trained, why = quality_gates_apply(source_record)
                rounded_reference = OnnxReference(cpu_decoder(rounded_path, n_positions=n_positions))
                against = f"{SOURCE_ONNX} with the file's rounded weights"
                rounded = RoundedReference(rounded_reference, against, figures, trained, why, quantization.algorithm)
            return precision_gates(
                rewritten,
                reference,
                precision=precision,
                vocab_size=vocab,
                n_positions=n_positions,
                gates=gates,
                decoder=fused,
                against=SOURCE_ONNX,
                rounded=rounded,
            )
    input_ids, mask = left_padded_batch(vocab, batch=3, length=8, seed=0)
    report = compare_decoder(
        fused, reference, input_ids, mask, decode_steps=2, tolerance=tolerance, against=SOURCE_ONNX
    )
    report = dataclasses.replace(report, placement=fused.placement)
    return report


def _tensor(state_dict: dict, name: str):
    """A checkpoint weight by its gpt2onnx.pytorch name, as numpy; None if it has none."""
    tensor = state_dict.get(name)
    return None if tensor is None else tensor.detach().float().numpy()


def reference_checkpoint(model: ModelFolder, reference: str | None = None) -> Checkpoint:
    """The checkpoint the folder was exported from (from its manifest), or ``reference`` when given."""
    if reference is not None:
        return load_checkpoint(reference, option="--reference")
    source = model.manifest.source if model.manifest else None
    if not isinstance(source, dict) or not source:
        raise BadInput(
            f"'{model.folder}' has no gpt2onnx.json manifest naming its source: give the reference checkpoint"
            " (--reference)"
        )
    kind = source.get("kind")
    try:
        if kind == "random":
            outliers = float((source.get("outliers") or {}).get("magnitude", 0.0))
            ckpt = load_checkpoint(
                source["architecture"], random_init=True, seed=int(source["seed"]), outliers=outliers
            )
            if ckpt.source.get("spec_sha256") != source.get("spec_sha256"):
                raise BadInput(
                    f"the architecture '{source['architecture']}' recorded in the manifest no longer matches the"
                    " export: give the reference checkpoint (--reference)"
                )
            return _with_recorded_adapter(model, ckpt)
        if kind in ("local", "gguf"):
            ckpt = load_checkpoint(source["path"])
        elif kind == "hub":
            ckpt = load_checkpoint(source["id"], revision=source.get("commit") or source.get("revision"))
        else:
            raise BadInput(f"manifest source kind '{kind}' is unknown: give the reference checkpoint (--reference)")
    except (KeyError, TypeError, ValueError):
        raise BadInput(
            f"the manifest of '{model.folder}' has an incomplete source record: give the reference checkpoint"
            " (--reference)"
        ) from None
    if source.get("sha256") and ckpt.source.get("sha256") != source["sha256"]:
        raise BadInput(
            "the source checkpoint's weights changed since the export (sha256 differs): give the reference"
            " (--reference), or export again"
        )
    return _with_recorded_adapter(model, ckpt)


def _with_recorded_adapter(model: ModelFolder, ckpt: Checkpoint, record=None) -> Checkpoint:
    """The source checkpoint with the LoRA adapter the manifest records merged in (PEFT's model the reference),
    refused where the adapter's files changed since the export. ``record``: a switchable adapter's record
    (default: the merged one, if any)."""
    record = record or model.manifest.adapter
    if record is None:
        return ckpt
    folder = Path(record.path)
    for name, digest in record.files.items():
        if not (folder / name).is_file() or sha256_file(folder / name) != digest:
            raise BadInput(
                f"the adapter '{folder}' the export merged has changed or is gone ({name}): give the reference"
                " (--reference), or export again"
            )
    return with_adapter(ckpt, folder, option="the manifest's adapter")


def with_switchable_adapter(model: ModelFolder, ckpt: Checkpoint, name: str) -> Checkpoint:
    """``ckpt`` (the base) with switchable adapter ``name`` merged as PEFT merges it, from the source folder the
    manifest records for it (checked against its sha256): the reference of a run with that adapter active."""
    adapter_of(model, name)  # a name the folder has
    return _with_recorded_adapter(model, ckpt, model.manifest.adapters[name])


def check_reference_matches(model: ModelFolder, ckpt: Checkpoint) -> None:
    """The reference must have the graph's architecture (vocabulary, layers, heads, head size): another one
    would give figures that mean nothing, or fail deep inside a comparison."""
    shape = file_shape(model.model_path, model.n_positions)
    spec = ckpt.spec
    graph = (shape.vocab_size, shape.n_layer, shape.n_head, shape.head_dim)
    ours = (spec.vocab_size, spec.n_layer, spec.n_head, spec.n_embd // spec.n_head)
    if any(g is not None and g != o for g, o in zip(graph, ours)):
        raise BadInput(
            f"the reference checkpoint (vocabulary, layers, heads, head size {ours}) does not match the model in"
            f" '{model.folder}' {graph}: give the checkpoint it was exported from (--reference)"
        )


# About 70 lines beside its documented arguments: the options, the fp16 emulation's copy of the model and the
# reference are opened in order, each refusing before the next (slower) one loads.
def parity(
    folder: str | Path,
    *,
    provider: ProviderConfig | None = None,
    runtime: RuntimeOptions | None = None,
    cases: int = 20,
    seed: int = 0,
    reference: str | None = None,
    max_batch: int = 8,
    on_case: Callable[[CaseResult], None] | None = None,
    gates: dict[str, float] | None = None,
    emulate_fp16: bool = False,
    verify_files: bool = True,
    text: str | Path | None = None,
    adapter: str | None = None,
) -> CheckReport:
    """Randomized cases of an exported folder against the PyTorch reference rebuilt from its manifest.

    Args:
        folder: an exported decoder folder.
        provider: onnxruntime's provider (default: the cpu provider, all cores). With ``tf32`` (cuda, tensorrt) an
            fp32 model is held to the ``tf32`` gates instead of fp32's.
        runtime: the runtime and its options (default: onnxruntime on ``provider``). genai owns its loop and
            exposes no presents: its cases are batch 1, the prefix is part of the prompt, the reference's
            greedy tokens are forced into its loop, and logits, KL, top-k and tokens are compared.
        cases: how many randomized cases (batches 1 to ``max_batch``, at most onnxruntime's ``max_batch``, the
            TensorRT profile's; left padding, past 0 or longer, decode steps, a free greedy run); ``seed`` fixes
            them.
        reference: the checkpoint to compare with (default: the source the manifest records).
        on_case: called after each case, for progress.
        gates: overrides of the precision's default gates (see :data:`gpt2onnx.verify.gates.TOLERANCES`).
        emulate_fp16: run an fp16 model with fp16 arithmetic as a GPU does it, on the cpu provider.
        verify_files: check the model files against the manifest's sha256 first.
        text: a UTF-8 text file: the prompts are stretches of it, tokenized by the folder's tokenizer, at seeded
            offsets (instead of random token ids); the cases are otherwise the same.
        adapter: a switchable LoRA adapter of the folder (export --adapters), active; the reference is the
            source (or ``reference``) with that adapter merged by PEFT from the folder the manifest records.

    Returns:
        CheckReport with the totals, the failures (empty when it passed), every case, ``placement`` (onnxruntime:
        which provider ran each node), and ``kv_path``: the model
        against itself on one left-padded batch (a past vs recomputed, the batch vs each row alone, chunks vs
        the whole prompt; :mod:`gpt2onnx.verify.kv_path`), its failures among the report's.

    Raises:
        BadInput (options, folder, reference), ContractError, IntegrityError, RuntimeUnavailable.
        A failed gate is not raised: it is in the report (``report.passed``).
    """
    if not 1 <= cases <= MAX_CASES:
        raise BadInput(f"cases must be 1 to {MAX_CASES}, got {cases}")
    if not 0 <= seed < 2**32:
        raise BadInput(f"seed must be 0 to 2**32 - 1, got {seed}")
    if not 1 <= max_batch <= 64:
        raise BadInput(f"max batch must be 1 to 64, got {max_batch}")
    runtime = runtime or RuntimeOptions(settings=provider)
    runtime.requires("parity")
    onnxruntime = runtime.settings if runtime.name == "onnxruntime" else None  # its ProviderConfig
    if onnxruntime is not None:
        max_batch = min(max_batch, onnxruntime.max_batch)  # TensorRT's profile covers batches up to max_batch
    model = open_folder(folder, verify_files=verify_files)
    adapter_path = None
    if adapter is not None:  # a name the folder has, on a runtime that binds its factors: before any work
        adapter_path = adapter_of(model, adapter)
        check_combination(model, runtime, adapter_declared(adapter))
    text_ids = prompt_text_ids(model, text) if text is not None else None
    # fp32 with TF32 matmuls (--tf32) has its own gates; every other precision keeps its own
    written = precisions.precision_of(model.facts)
    family = precisions.TF32.name if onnxruntime and onnxruntime.tf32 and written.exact else written.name
    tolerances_for(family, gates)  # each gate in its range, checked before the runtime opens
    if emulate_fp16:
        _check_emulation(model, runtime, folder)
    with tempfile.TemporaryDirectory(prefix="gpt2onnx-fp16-") as tmp:
        if emulate_fp16:
            from gpt2onnx.verify.fp16_emulation import write_emulated_fp16  # lazy: only --emulate-fp16 needs it

            model = dataclasses.replace(
                model, model_path=write_emulated_fp16(model.model_path, Path(tmp) / "model.onnx")
            )
        ckpt = reference_checkpoint(model, reference)
        if adapter is not None:
            ckpt = with_switchable_adapter(model, ckpt, adapter)
        decoder = open_runtime(model, runtime)
        if adapter_path is not None:
            decoder.activate_adapter(adapter_path)
        check_reference_matches(model, ckpt)
        if text_ids is not None and text_ids.max() >= ckpt.spec.vocab_size:
            raise BadInput(
                f"the tokenizer of '{model.folder}' gives token id {int(text_ids.max())}, outside the vocabulary of"
                f" {ckpt.spec.vocab_size}: the tokenizer files do not belong to this model"
            )
        torch.set_num_threads(1)  # leave the cores to onnxruntime between reference steps
        quantization = model.manifest.quantization if model.manifest else None
        rounded = None
        if precisions.precision(family).quantized and quantization is not None:
            rounded = rounded_pytorch(model.model_path, ckpt, quantization, switchable=adapter is not None)
        plan = CheckPlan(
            family,
            reference_model(ckpt),
            PYTORCH if adapter is None else f"{PYTORCH} with adapter '{adapter}' (PEFT, merged)",
            tuple(random_cases(cases, seed=seed, n_positions=model.n_positions, max_batch=max_batch)),
            ckpt.spec.vocab_size,
            model.n_positions,
            gates=gates,
            rounded=rounded,
            kv_path_seed=seed,
            text_ids=text_ids,
            keep_cases=True,
            provider=decoder.provider + (" (fp16 emulated)" if emulate_fp16 else ""),
        )
        try:
            report = run_plan(decoder, plan, runtime=runtime.name, on_case=on_case)
        finally:
            decoder.close()
    prompts = "random token ids" if text is None else f"text '{text}' ({len(text_ids):,} tokens)"
    return dataclasses.replace(report, measured=dataclasses.replace(report.measured, prompts=prompts))


def _check_emulation(model: ModelFolder, runtime: RuntimeOptions, folder) -> None:
    """fp16 emulation: an fp16 model, on onnxruntime's cpu provider."""
    if runtime.name != "onnxruntime":
        raise BadInput(f"fp16 emulation runs on onnxruntime's cpu provider, not on {runtime.name}: drop one of them")
    if not precisions.precision_of(model.facts).emulate_fp16:
        raise BadInput(f"fp16 emulation needs an fp16 model: '{folder}' is {model.dtype}; drop --emulate-fp16")
    if runtime.settings.name != "cpu":
        raise BadInput("fp16 emulation runs on the cpu provider (a GPU computes fp16 itself): drop one of them")


MAX_TEXT_TOKENS = 1 << 20  # parity's prompts come from at most this many tokens of the text's start
PARITY_TEXT_TOKENS = 96  # the longest prefix + prompt of a case (random_cases' budget)


def prompt_text_ids(model: ModelFolder, text: str | Path) -> np.ndarray:
    """The first tokens of a text file through the folder's tokenizer, for parity's prompts."""
    from gpt2onnx.decoding.prompts import load_tokenizer
    from gpt2onnx.verify.text import TextSource, token_pieces

    source = TextSource(Path(text))
    tokenizer = load_tokenizer(model.folder)
    pieces, count = [], 0
    for piece in token_pieces(tokenizer, source):
        pieces.append(piece)
        count += len(piece)
        if count >= MAX_TEXT_TOKENS:
            break
    ids = np.concatenate(pieces)[:MAX_TEXT_TOKENS] if pieces else np.zeros(0, np.int64)
    needed = min(PARITY_TEXT_TOKENS, model.n_positions)
    if len(ids) < needed:
        raise BadInput(
            f"text '{text}' has {len(ids)} tokens: parity's prompts need at least {needed}; give a longer text"
        )
    return ids


__all__ = [
    "TOLERANCES",
    "CheckPlan",
    "parity",
    "precision_gates",
    "run_plan",
    "validate_against_source",
    "validate_export",
]
