"""Switchable LoRA export: one base graph with a LoRA slot on every adapted weight, and one adapter file per name
in onnxruntime's adapter format (gpt2onnx.passes.lora_slots). The base alone (no adapter active: rank-0 slots) is
checked against the base, and each adapter, active, against PEFT's PeftModel with that adapter. The slots are added
before the passes: a quantized base keeps them fp32 (QLoRA's shape: the quantizers leave them alone), an fp16 graph
has them fp16 (its adapter files too), and the fusions fuse around them."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from gpt2onnx.artifact.folder import MODEL_FILE, check_output, staged_folder
from gpt2onnx.artifact.graph import graph_summary, save_onnx
from gpt2onnx.artifact.lora import adapter_file, check_adapter_name
from gpt2onnx.errors import BadInput
from gpt2onnx.exporters.export import (
    DEFAULT_OUTPUT_ROOT,
    ExportOptions,
    ExportResult,
    _graph,
    _special_tokens_outside,
    _write_companions,
    passed_or_refused,
    write_export_manifest,
)
from gpt2onnx.passes.lora_slots import LoraSlot, add_lora_slots, slot_dtypes, write_adapter_file
from gpt2onnx.passes.pipeline import timed
from gpt2onnx.pytorch.adapters import HEAD
from gpt2onnx.pytorch.checkpoint import Checkpoint, load_checkpoint, with_adapter
from gpt2onnx.verify.parity import validate_export

log = logging.getLogger(__name__)


def parse_adapters(text: str) -> dict[str, Path]:
    """``NAME=DIR,NAME=DIR`` (--adapters) as names to folders, each name valid and given once."""
    adapters: dict[str, Path] = {}
    for item in (part.strip() for part in text.split(",")):
        name, sep, folder = item.partition("=")
        if not sep or not folder:
            raise BadInput(f"--adapters takes NAME=DIR,NAME=DIR; {item!r} has no '=DIR'")
        check_adapter_name(name.strip(), "--adapters name")
        if name.strip() in adapters:
            raise BadInput(f"--adapters names {name.strip()!r} twice: give each adapter one name")
        adapters[name.strip()] = Path(folder.strip()).expanduser()
    return adapters


def _check_options(options: ExportOptions) -> None:
    """Switchable slots go on the whole decoder, checked per adapter: what else is asked, refused."""
    asked = [
        (options.block is not None, "--block"),
        (options.eval_text is not None, "--eval-text"),
        (not options.validate, "--no-validate"),
    ]
    for bad, flag in asked:
        if bad:
            raise BadInput(
                "switchable adapters (--adapters) are exported as a whole decoder and checked per adapter:"
                f" drop {flag}, or export each adapter merged (--adapter DIR)"
            )


def export_switchable(
    model: str,
    out: str | Path | None = None,
    *,
    adapters: dict[str, str | Path],
    revision: str | None = None,
    options: ExportOptions = ExportOptions(),
) -> ExportResult:
    """Export ``model`` (a base checkpoint) with LoRA slots for ``adapters`` (name → PEFT folder): model.onnx and
    NAME.onnx_adapter per name, checked (the base alone against the base, each adapter active against PEFT)
    before anything is written."""
    if not adapters:
        raise BadInput("--adapters names no adapter: give NAME=DIR,...")
    for name in adapters:
        check_adapter_name(name, "--adapters name")
    _check_options(options)
    folders = {name: Path(folder).expanduser() for name, folder in adapters.items()}
    if out is not None:
        check_output(Path(out), force=options.force, protect=tuple(f for f in folders.values() if f.exists()))
    timings: dict[str, float] = {}
    with timed(timings, "load"):
        base = load_checkpoint(model, revision=revision)
        adapted = {name: with_adapter(base, folder, option=f"--adapters {name}") for name, folder in folders.items()}
    slots = _slots(base, adapted)
    target = Path(out) if out is not None else DEFAULT_OUTPUT_ROOT / f"{base.name}-adapters"
    protect = tuple(f for f in folders.values() if f.exists()) + (
        (base.companion_dir,) if base.companion_dir is not None else ()
    )
    with staged_folder(target, force=options.force, protect=protect) as staging:
        manifest, check = _export_into(staging, base, adapted, slots, options, timings)
    log.info("exported %s with %d switchable adapters to %s", base.name, len(adapted), target)
    return ExportResult(target, manifest, check, timings)


def _slots(base: Checkpoint, adapted: dict[str, Checkpoint]) -> list[LoraSlot]:
    """One slot per weight any adapter adapts, in the base's weight order, the head's last (its Gemm reads the
    token embedding on a tied base: the embedding itself is never adapted)."""
    weights = {module.weight for ckpt in adapted.values() for module in ckpt.adapter.modules}
    slots = [LoraSlot(w, *base.state_dict[w].shape) for w in base.state_dict if w in weights and w != HEAD]
    if HEAD in weights:
        tied = base.spec.tie_word_embeddings
        slots.append(LoraSlot(HEAD, base.spec.n_embd, base.spec.vocab_size, reads="wte.weight" if tied else HEAD))
    return slots


def _factors(ckpt: Checkpoint) -> dict:
    """The adapter's factors under the slots' names: Aᵀ [in, r] and scale · Bᵀ [r, out], fp32."""
    factors = {}
    for module in ckpt.adapter.modules:
        slot = LoraSlot(module.weight, module.a.shape[1], module.b.shape[0])
        factors[slot.a] = module.a.T.contiguous().numpy()
        factors[slot.b] = (module.b.double().T * module.scale).float().contiguous().numpy()
    return factors


def _export_into(folder: Path, base: Checkpoint, adapted: dict, slots, options: ExportOptions, timings: dict):
    # the slots go in before the passes: a quantizer then leaves their MatMuls fp32 (gpt2onnx.precisions.weights)
    passed, io, kind = _graph(base, options, timings, before_passes=lambda proto: add_lora_slots(proto, slots))
    with timed(timings, "save"):
        model_files = save_onnx(passed.model, folder / MODEL_FILE, external_data=options.external_data)
        dtypes = slot_dtypes(passed.model)  # fp16 in an fp16 graph
        for name, ckpt in adapted.items():
            write_adapter_file(adapter_file(folder, name), _factors(ckpt), dtypes)
    graph_facts = graph_summary(passed.model)
    passed.model = None
    check_args = dict(
        precision=options.precision,
        block=None,
        tolerance=options.tolerance,
        gates=options.gates,
        quantization=passed.quantization,
    )
    records = {}
    with timed(timings, "validate"):
        check = passed_or_refused(validate_export(folder / MODEL_FILE, base, **check_args))
        for name, ckpt in adapted.items():
            report = validate_export(folder / MODEL_FILE, ckpt, adapter=adapter_file(folder, name), **check_args)
            report = passed_or_refused(dataclasses.replace(report, against=f"PEFT with adapter {name!r}"))
            records[name] = dataclasses.replace(ckpt.adapter.record, form="switchable", check=report.summary())
    _write_companions(folder, base)
    outside = _special_tokens_outside(folder, base.spec.vocab_size)
    manifest = write_export_manifest(
        folder,
        base,
        options,
        passed,
        io=io,
        kind=kind,
        graph_facts=graph_facts,
        model_files=model_files,
        outside=outside,
        timings=timings,
        check=check,
        adapters=records,
    )
    return manifest, check
