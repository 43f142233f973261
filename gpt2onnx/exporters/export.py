"""The export pipeline: checkpoint → GPT2ForExport → ONNX → graph passes → staged folder → validated against
PyTorch → moved into place."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpt2onnx.artifact.contract import block_io, buffer_cache_io, check_graph_io, decoder_io
from gpt2onnx.artifact.folder import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    MODEL_FILE,
    TOKENIZER_FILES,
    check_output,
    copy_regular_file,
    staged_folder,
    write_manifest,
)
from gpt2onnx.artifact.generation import special_tokens_outside
from gpt2onnx.artifact.graph import graph_summary, save_onnx
from gpt2onnx.artifact.manifest import Manifest
from gpt2onnx.artifact.report import CheckReport
from gpt2onnx.capabilities import Declared
from gpt2onnx.errors import BadInput, CheckFailed
from gpt2onnx.exporters.torch_export import DEFAULT_OPSET, check_opset, export_module
from gpt2onnx.layouts.all_layouts import layout
from gpt2onnx.passes.pipeline import GraphPasses, timed
from gpt2onnx.precisions.all_precisions import FP32
from gpt2onnx.precisions.fp16 import FP16_KEEP_GROUPS
from gpt2onnx.precisions.gguf_blocks import keep_file_blocks, kept_quantization
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.profiles.all_profiles import UNFUSED
from gpt2onnx.pytorch.checkpoint import Checkpoint, load_checkpoint
from gpt2onnx.pytorch.model import BlockForExport, GPT2ForExport
from gpt2onnx.pytorch.reference import sdpa_disagreement
from gpt2onnx.verify.calibration import calibration_for, kv_cache_calibration
from gpt2onnx.verify.evaluate import EvalReport, eval_source, evaluate_written
from gpt2onnx.verify.gates import EvalGates, tolerances_for
from gpt2onnx.verify.parity import validate_export
from gpt2onnx.verify.text import TextSource

log = logging.getLogger(__name__)

DEFAULT_OUTPUT_ROOT = Path("models")
LOGITS_CHOICES = ("all", "last")


@dataclass(frozen=True)
class ExportOptions:
    """What export does besides loading the checkpoint, checked when built (and only then): each choice becomes
    its typed object here (``passes``: the graph passes; ``eval_source``, ``eval_gates``: the check on real text)
    and flows unchanged to where it is used."""

    opset: int = DEFAULT_OPSET
    logits: str = "all"  # "all" positions, or the "last" position only
    block: int | None = None  # export this transformer block alone
    external_data: bool | None = None  # None: only when the model exceeds protobuf's 2 GB limit
    validate: bool = True
    tolerance: float | None = None  # fp32: max |Δlogits| and |Δpresent|; None: the gate's default (1e-4)
    force: bool = False  # replace an existing output folder (one gpt2onnx wrote, or an empty one)
    fusion: str = UNFUSED.name  # the fusion profile (gpt2onnx.profiles)
    allow_partial_fusion: bool = False  # keep a graph whose fusions fall short of the golden counts
    dtype: str = FP32.short  # fp32, or fp16 (weights, activations and K/V cache; LayerNorm, softmax, logits in fp32)
    quantization: QuantizeOptions = QuantizeOptions()  # weights: a quantizing precision and its options
    gates: dict | None = None  # overrides of the precision's default gates (gpt2onnx.verify.gates.TOLERANCES)
    keep_fp32: tuple[str, ...] | str = FP16_KEEP_GROUPS  # fp16: what stays fp32 (precisions.fp16.FP16_KEEP_GROUPS)
    eval_text: str | None = None  # a text file: perplexity, KL against PyTorch before writing (verify.evaluate)
    eval_gates: EvalGates = EvalGates()  # with eval_text: the most ΔPPL (percent) and mean KL accepted
    kv_cache: str = FLOAT_CACHE  # the K/V cache's type: float, or a quantized one (gpt2onnx.precisions.kv_cache)
    passes: GraphPasses = field(init=False, repr=False, compare=False)
    eval_source: TextSource | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:  # an invalid one cannot be built: checked here, and only here
        check_opset(self.opset)
        if self.logits not in LOGITS_CHOICES:
            raise BadInput(f"logits '{self.logits}' is not valid: choose 'all' or 'last'")
        passes = GraphPasses(
            self.fusion, self.allow_partial_fusion, self.dtype, self.quantization, self.keep_fp32, self.kv_cache
        )
        passes.verdict(self.logits_declared).check()
        object.__setattr__(self, "passes", passes)
        object.__setattr__(self, "keep_fp32", passes.keep_fp32)
        if self.block is not None:
            if self.block < 0:
                raise BadInput(f"block {self.block} is not valid: give a block index from 0")
            for name, whole in (
                ("logits", self.logits != "all"),
                ("dtype", passes.dtype != FP32.dtype),
                ("quantize", self.quantization.method != "none"),
                ("fusion", bool(passes.profile.fusions)),
            ):
                if whole:
                    raise BadInput(f"{name} applies to the whole decoder, not to a single block: drop one of them")
        if self.tolerance is not None:
            if not (math.isfinite(self.tolerance) and self.tolerance > 0):
                raise BadInput(f"tolerance must be a positive number, got {self.tolerance}")
            if not passes.precision.exact:
                raise BadInput(
                    f"tolerance applies to fp32 exports; {passes.precision.name} is checked by its gates: use --gate"
                    " instead"
                )
            if passes.cache_format is not None:
                raise BadInput(
                    f"tolerance applies to a float K/V cache; --kv-cache {self.kv_cache} is checked by its gates: use"
                    " --gate instead"
                )
        if not self.validate and (self.tolerance is not None or self.gates):
            raise BadInput(
                "tolerance and gates apply only when the export is validated: drop them, or drop --no-validate"
            )
        tolerances_for(passes.precision.name, self.gates)  # each gate in its range
        object.__setattr__(self, "eval_source", eval_source(self.eval_text, self.eval_gates))
        if self.eval_text is not None and self.block is not None:
            raise BadInput("eval_text (--eval-text) evaluates a whole decoder, not a single block: drop one of them")

    @property
    def precision(self) -> str:
        return self.passes.precision.name

    @property
    def logits_declared(self) -> Declared:
        return Declared("logits", self.logits, f"--logits {self.logits}", ensures={"logits": self.logits})

    def as_dict(self) -> dict:
        """The manifest's record of the options: the keys every release has written, in their order."""
        quantization = {
            "quantize": self.quantization.method,
            "block_size": self.quantization.recipe.block_size,
            "accuracy_level": self.quantization.accuracy_level,
            "lm_head": self.quantization.lm_head,
            "embeddings": self.quantization.embeddings,
        }
        gates = {"max_ppl_increase": self.eval_gates.max_ppl_increase, "max_kl": self.eval_gates.max_kl}
        data = {}
        for f in dataclasses.fields(self):
            if f.init:
                data.update(
                    {"quantization": quantization, "eval_gates": gates}.get(f.name, {f.name: getattr(self, f.name)})
                )
        data["keep_fp32"] = list(self.keep_fp32)
        if self.passes.cache_format is None:
            del data["kv_cache"]  # written only for a quantized cache
        return data


@dataclass
class ExportResult:
    """What :func:`export` (and optimize) returns: the folder written, its manifest, the check it passed, timings
    in seconds."""

    folder: Path
    manifest: Manifest
    check: CheckReport | None = None  # None with validate=False
    timings: dict[str, float] = field(default_factory=dict)
    quality: EvalReport | None = None  # quality on real text, with eval_text (--eval-text)

    @property
    def model_bytes(self) -> int:
        return self.manifest.model_bytes


def default_output(ckpt_name: str, options: ExportOptions) -> Path:
    """models/<name>, with a suffix per variant: models/gpt2-last-logits-ort, models/gpt2-block3, ..."""
    if options.block is not None:
        return DEFAULT_OUTPUT_ROOT / f"{ckpt_name}-block{options.block}"
    suffix = ("-last-logits" if options.logits == "last" else "") + (
        f"-{options.fusion}" if options.passes.profile is not UNFUSED else ""
    )
    return DEFAULT_OUTPUT_ROOT / f"{ckpt_name}{suffix}"


def export(
    model: str,
    out: str | Path | None = None,
    *,
    random_init: bool = False,
    seed: int = 0,
    revision: str | None = None,
    outliers: float = 0.0,
    adapter: str | Path | None = None,
    options: ExportOptions = ExportOptions(),
) -> ExportResult:
    """Export a GPT-2 checkpoint to an ONNX decoder folder, checked against PyTorch before it is written.

    Args:
        model: a local Hugging Face folder, a Hub id, or (with ``random_init``) an architecture name
            (gpt2, gpt2-medium, gpt2-large, gpt2-xl, distilgpt2, tiny), a config.json or a folder with one.
        out: the output folder (default: models/<name> with a suffix per variant). An existing one is replaced
            only with ``options.force``, and only if gpt2onnx wrote it or it is empty.
        random_init: seeded random weights (``seed``) instead of a checkpoint's.
        revision: a Hub branch, tag or commit.
        outliers: with ``random_init``, residual-stream outlier channels of that magnitude
            (:func:`gpt2onnx.pytorch.checkpoint.inject_outlier_channels`).
        adapter: a PEFT LoRA adapter folder, merged into the weights and checked against PEFT's PeftModel (a PEFT
            folder given as ``model`` names its own base).
        options: opset, logits, block, external data, fusion, precision, gates (:class:`ExportOptions`).

    Returns:
        ExportResult: the folder, its manifest, the CheckReport of the validation, timings.

    Raises:
        BadInput (options, output folder), CheckpointError (the checkpoint or config), CheckFailed (the model
        does not match PyTorch within its gates; nothing is written), OutputError (cannot write).
    """
    if revision is not None and random_init:
        raise BadInput(
            "a revision picks a Hub checkpoint's version; random weights have none: drop --revision or --random-init"
        )
    source = Path(model).expanduser()
    protect = (source.parent if source.is_file() else source,) if source.exists() else ()
    protect += (Path(adapter).expanduser(),) if adapter is not None and Path(adapter).expanduser().exists() else ()
    if out is not None:
        check_output(Path(out), force=options.force, protect=protect)  # fail before loading any weights
    timings: dict[str, float] = {}
    with timed(timings, "load"):
        ckpt = load_checkpoint(
            model, random_init=random_init, seed=seed, revision=revision, outliers=outliers, adapter=adapter
        )
    if ckpt.blocks:  # a quantized GGUF: its blocks kept, in the MatMulNBits of the precision that holds them
        options = dataclasses.replace(options, quantization=kept_quantization(ckpt.blocks, options.quantization))
    options.passes.verdict(options.logits_declared, architecture_declared(ckpt.spec)).check()
    disagreement = sdpa_disagreement(ckpt.config)
    if disagreement is not None:
        log.warning("%s", disagreement)
    if options.block is not None and not 0 <= options.block < ckpt.spec.n_layer:
        raise BadInput(f"block {options.block} is out of range: this model has blocks 0 to {ckpt.spec.n_layer - 1}")
    if options.eval_text is not None and not set(ckpt.companion_files) & set(TOKENIZER_FILES):
        raise BadInput(
            f"eval_text (--eval-text) needs the model's tokenizer, but '{model}' has no tokenizer files"
            " (tokenizer.json, or vocab.json and merges.txt): add them to the checkpoint folder, or drop --eval-text"
        )
    target = Path(out) if out is not None else default_output(ckpt.name, options)
    protect += (ckpt.companion_dir,) if ckpt.companion_dir is not None else ()
    with staged_folder(target, force=options.force, protect=protect) as staging:
        manifest, check, quality = _export_into(staging, ckpt, options, timings, label=str(target))
    log.info("exported %s to %s", ckpt.name, target)
    return ExportResult(target, manifest, check, timings, quality)


def _export_into(folder: Path, ckpt: Checkpoint, options: ExportOptions, timings: dict[str, float], *, label: str):
    """The checkpoint exported into the staged ``folder``, checked (against PyTorch, and on a text where asked),
    with its companion files and manifest; returns (manifest, check, quality)."""
    passed, io, kind = _graph(ckpt, options, timings)
    with timed(timings, "save"):
        model_files = save_onnx(passed.model, folder / MODEL_FILE, external_data=options.external_data)
    graph_facts = graph_summary(passed.model)
    passed.model = None  # free the graph before validation; the pass records stay
    check = None
    if options.validate:
        with timed(timings, "validate"):
            check = validate_export(
                folder / MODEL_FILE,
                ckpt,
                precision=options.precision,
                block=options.block,
                tolerance=options.tolerance,
                gates=options.gates,
                quantization=passed.quantization,
            )
        passed_or_refused(check)
    _write_companions(folder, ckpt)
    outside = _special_tokens_outside(folder, ckpt.spec.vocab_size)
    quality = None
    if options.eval_source is not None:
        with timed(timings, "eval"):
            quality = evaluate_written(
                folder,
                reference=ckpt,
                text=options.eval_source,
                gates=options.eval_gates,
                against=f"PyTorch fp32 ({ckpt.name})",
                label=label,
                precision=options.precision,
            )
    adapter = ckpt.adapter.record if ckpt.adapter is not None else None
    manifest = write_export_manifest(
        folder,
        ckpt,
        options,
        passed,
        io=io,
        kind=kind,
        graph_facts=graph_facts,
        model_files=model_files,
        outside=outside,
        timings=timings,
        check=check,
        eval=quality,
        adapter=adapter,
    )
    return manifest, check, quality


def write_export_manifest(
    folder: Path,
    ckpt: Checkpoint,
    options: ExportOptions,
    passed,
    *,
    io,
    kind: str,
    graph_facts: dict,
    model_files: list,
    outside,
    timings: dict,
    **records,
) -> Manifest:
    """The manifest of an export written into ``folder`` (what every export writes last): the checkpoint, the
    options, the graph's facts, the passes' records and ``records`` (check, eval, adapter or adapters)."""
    manifest = Manifest(
        kind=kind,
        name=ckpt.name,
        source=ckpt.source,
        architecture=ckpt.spec,
        dtype=options.passes.dtype,
        io=io,
        **graph_facts,
        options={**options.as_dict(), "external_data": len(model_files) > 1},
        **passed.records(),
        outside_vocabulary=outside,
        timings=timings,
        **records,
    )
    return write_manifest(folder, manifest)


def _graph(ckpt: Checkpoint, options: ExportOptions, timings: dict[str, float], *, before_passes=None):
    """The checkpoint as an ONNX graph (the whole decoder, or one block) with the passes applied, and its IO
    contract; returns (PassResult, io, kind). ``before_passes(proto)``: a rewrite of the exported graph (in
    place) before any pass (switchable LoRA slots, which the quantizers then leave fp32)."""
    spec, passes, last = ckpt.spec, options.passes, options.logits == "last"
    with timed(timings, "export"):
        with torch.device("meta"):
            full = GPT2ForExport(spec, last_logits_only=last)
        full.load_state_dict(ckpt.state_dict, assign=True)  # shares the checkpoint's tensors, no copy
        if options.block is None:
            module, io, kind = full, decoder_io(spec, last_logits_only=last), "decoder"
            tied = spec.tie_word_embeddings
            head = ("wte.weight", ckpt.state_dict["wte.weight"]) if tied else ("lm_head", full.lm_head)
        else:
            module, io, kind, head = BlockForExport(full.h[options.block]), block_io(spec), "block", None
        log.info("exporting %s (%s, opset %d)", ckpt.name, kind, options.opset)
        proto = export_module(module, io, spec, opset=options.opset, head_weight=head)
    if before_passes is not None:
        before_passes(proto)
    calibration = calibration_for(
        passes.quantization, ckpt.companion_dir, vocab_size=spec.vocab_size, n_positions=spec.n_positions
    )
    kv_calibration = kv_cache_calibration(
        ckpt.companion_dir,
        vocab_size=spec.vocab_size,
        n_positions=spec.n_positions,
        wanted=passes.cache_format is not None,
    )
    passed = passes.apply(
        proto,
        timings,
        calibration,
        activation=spec.activation,
        upcast_attention=spec.reorder_and_upcast_attn,
        kv_calibration=kv_calibration,
    )
    if ckpt.blocks:
        passed.quantization = keep_file_blocks(passed.model, ckpt.blocks, passed.quantization)
    if passes.dtype == "float16":
        logits_dtype = "float32" if "logits" in passes.keep_fp32 else "float16"
        io = decoder_io(spec, last_logits_only=last, dtype=passes.dtype, logits_dtype=logits_dtype)
    buffers = layout(passed.cache_layout).in_place if kind == "decoder" else False
    if buffers:
        io = buffer_cache_io(io, cache_dtype=passes.cache_format.dtype if passes.cache_format else None)
    if passes.dtype == "float16" or buffers:
        check_graph_io(passed.model, io)
    return passed, io, kind


def architecture_declared(spec) -> Declared:
    """What an architecture declares of the graphs made from it (gpt2onnx.capabilities)."""
    return Declared(
        "architecture",
        "checkpoint",
        ensures={"upcast_attention": bool(spec.reorder_and_upcast_attn)},
        says={"upcast_attention": "computes its attention scores in fp32 (reorder_and_upcast_attn)"},
        label="the checkpoint's architecture",
    )


def passed_or_refused(check: CheckReport) -> CheckReport:
    """The check of a folder being written; CheckFailed (so nothing is written) where it failed."""
    if not check.passed:
        raise CheckFailed(f"validation failed: {check.summary()}; nothing was written", check)
    return check


def _special_tokens_outside(folder: Path, vocab_size: int) -> dict[str, list[int]]:
    """The special token ids the written configs give outside the vocabulary, said once: transformers accepts such
    a config and its generate() runs on it (the token simply never comes), so the folder keeps them and the
    manifest records them, which every command that reads the folder then accepts."""
    outside = special_tokens_outside(folder, vocab_size)
    if outside:
        ids = ", ".join(f"{key} {'/'.join(map(str, values))}" for key, values in outside.items())
        log.warning(
            "%s outside the vocabulary of %d tokens: as in transformers, never generated (recorded in the manifest)",
            ids,
            vocab_size,
        )
    return outside


def _write_companions(folder: Path, ckpt: Checkpoint) -> None:
    """config.json (so Hugging Face tools load the folder), generation_config.json, tokenizer files."""
    source_config = ckpt.companion_dir / CONFIG_FILE if ckpt.companion_dir else None
    if source_config is not None and source_config.is_file() and ckpt.source["kind"] != "random":
        copy_regular_file(source_config, folder / CONFIG_FILE, within=ckpt.companion_dir)
    else:
        ckpt.config.use_cache = True
        ckpt.config.to_json_file(str(folder / CONFIG_FILE))
    for name in ckpt.companion_files:
        copy_regular_file(ckpt.companion_dir / name, folder / name, within=ckpt.companion_dir)
    if GENERATION_CONFIG_FILE not in ckpt.companion_files:
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(ckpt.config).to_json_file(str(folder / GENERATION_CONFIG_FILE))
