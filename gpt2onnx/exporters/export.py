"""The export pipeline: checkpoint → GPT2ForExport → ONNX → staged folder → validated against PyTorch → in place."""

from __future__ import annotations

import json
import logging
import platform
import shutil
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from gpt2onnx.checkpoint import Checkpoint, load_checkpoint
from gpt2onnx.errors import Gpt2OnnxError
from gpt2onnx.exporters.io_spec import block_io, check_graph_io, decoder_io
from gpt2onnx.exporters.output import save_onnx, staged_folder
from gpt2onnx.exporters.torch_export import DEFAULT_OPSET, check_opset, export_module
from gpt2onnx.files import sha256_file
from gpt2onnx.exporters.passes import GraphPasses
from gpt2onnx.quantization import FP16_KEEP_GROUPS, QuantizeOptions, check_dtype, parse_keep_fp32

log = logging.getLogger(__name__)

MANIFEST_NAME = "gpt2onnx.json"
MANIFEST_FORMAT_VERSION = 1
MODEL_FILE = "model.onnx"
DEFAULT_OUTPUT_ROOT = Path("models")
LOGITS_CHOICES = ("all", "last")


@dataclass(frozen=True)
class ExportOptions:
    opset: int = DEFAULT_OPSET
    logits: str = "all"  # "all" positions, or the "last" position only
    block: int | None = None  # export this transformer block alone
    external_data: bool | None = None  # None: only when the model exceeds protobuf's 2 GB limit
    validate: bool = True
    tolerance: float | None = None  # None: the dtype's default (runtimes.parity.TOLERANCES)
    force: bool = False  # replace an existing output folder
    fusion: str = "none"  # fusion profile: none, ort, portable, tensorrt (see gpt2onnx.fusions)
    allow_partial_fusion: bool = False  # keep a graph whose fusions fall short of the golden counts
    dtype: str = "fp32"  # fp32, or fp16 (weights, activations and K/V cache; LayerNorm, softmax, logits in fp32)
    quantize: str = "none"  # weight quantization: none, int8 (dynamic) or int4 (block-wise)
    block_size: int = 32  # int4: weights per scale
    gates: dict | None = None  # overrides of the precision's default gates (runtimes.parity.TOLERANCES)
    keep_fp32: tuple[str, ...] = FP16_KEEP_GROUPS  # fp16: what stays fp32 (quantization.FP16_KEEP_GROUPS)


@dataclass
class ExportResult:
    folder: Path
    manifest: dict
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def model_bytes(self) -> int:
        return sum(f["bytes"] for name, f in self.manifest["files"].items() if name.startswith(MODEL_FILE))


def _passes(options: ExportOptions) -> GraphPasses:
    return GraphPasses(
        options.fusion,
        options.allow_partial_fusion,
        options.dtype,
        QuantizeOptions(options.quantize, options.block_size),
        options.keep_fp32,
    )


def default_output(ckpt_name: str, options: ExportOptions) -> Path:
    """models/<name>, with a suffix per variant: models/gpt2-last-logits-ort, models/gpt2-block3, ..."""
    if options.block is not None:
        return DEFAULT_OUTPUT_ROOT / f"{ckpt_name}-block{options.block}"
    suffix = ("-last-logits" if options.logits == "last" else "") + (f"-{options.fusion}" if options.fusion != "none" else "")
    return DEFAULT_OUTPUT_ROOT / f"{ckpt_name}{suffix}"


def export(
    model: str,
    out: str | Path | None = None,
    *,
    random_init: bool = False,
    seed: int = 0,
    revision: str | None = None,
    outliers: float = 0.0,
    options: ExportOptions = ExportOptions(),
) -> ExportResult:
    """Export ``model`` (local folder, Hub id, or architecture name with ``random_init``) to a verified folder.

    ``outliers``: with ``random_init``, inject residual-stream outlier channels of that magnitude
    (:func:`gpt2onnx.checkpoint.inject_outlier_channels`).
    """
    check_opset(options.opset)
    if options.logits not in LOGITS_CHOICES:
        raise Gpt2OnnxError(f"--logits '{options.logits}' is not valid: choose 'all' or 'last'")
    if options.block is not None and options.logits != "all":
        raise Gpt2OnnxError("--logits applies to the whole decoder, not to a single --block: drop one of them")
    _passes(options).check()
    if options.block is not None and check_dtype(options.dtype) != "float32":
        raise Gpt2OnnxError("--dtype applies to the whole decoder, not to a single --block: drop one of them")
    if options.block is not None and options.quantize != "none":
        raise Gpt2OnnxError("--quantize applies to the whole decoder, not to a single --block: drop one of them")
    if options.block is not None and options.fusion != "none":
        raise Gpt2OnnxError("--fusion applies to the whole decoder, not to a single --block: drop one of them")
    if out is not None and Path(out).exists() and not options.force:  # fail before loading any weights
        raise Gpt2OnnxError(f"output folder '{out}' already exists: choose another --out, or add --force to replace it")
    timings: dict[str, float] = {}
    start = time.perf_counter()
    ckpt = load_checkpoint(model, random_init=random_init, seed=seed, revision=revision, outliers=outliers)
    timings["load_seconds"] = time.perf_counter() - start
    if options.block is not None and not 0 <= options.block < ckpt.spec.n_layer:
        raise Gpt2OnnxError(f"--block {options.block} is out of range: this model has blocks 0 to {ckpt.spec.n_layer - 1}")
    target = Path(out) if out is not None else default_output(ckpt.name, options)
    with staged_folder(target, force=options.force) as staging:
        manifest = _export_into(staging, ckpt, options, timings)
    log.info("exported %s to %s", ckpt.name, target)
    return ExportResult(target, manifest, timings)


def _export_into(folder: Path, ckpt: Checkpoint, options: ExportOptions, timings: dict[str, float]) -> dict:
    from gpt2onnx.model import BlockForExport, GPT2ForExport

    spec, dtype = ckpt.spec, check_dtype(options.dtype)
    start = time.perf_counter()
    with torch.device("meta"):
        full = GPT2ForExport(spec, last_logits_only=options.logits == "last")
    full.load_state_dict(ckpt.state_dict, assign=True)  # shares the checkpoint's tensors, no copy
    if options.block is None:
        module, io, kind = full, decoder_io(spec, last_logits_only=options.logits == "last"), "decoder"
        head = ("wte.weight", ckpt.state_dict["wte.weight"]) if spec.tie_word_embeddings else ("lm_head", full.lm_head)
    else:
        module, io, kind, head = BlockForExport(full.h[options.block]), block_io(spec), "block", None
    log.info("exporting %s (%s, opset %d)", ckpt.name, kind, options.opset)
    proto = export_module(module, io, spec, opset=options.opset, head_weight=head)
    timings["export_seconds"] = time.perf_counter() - start
    proto, reports = _passes(options).apply(proto, timings)
    if dtype == "float16":
        logits_dtype = "float32" if "logits" in parse_keep_fp32(options.keep_fp32) else "float16"
        io = decoder_io(spec, last_logits_only=options.logits == "last", dtype=dtype, logits_dtype=logits_dtype)
        check_graph_io(proto, io)
    start = time.perf_counter()
    model_files = save_onnx(proto, folder / MODEL_FILE, external_data=options.external_data)
    timings["save_seconds"] = time.perf_counter() - start
    graph_facts = graph_summary(proto)
    del proto

    parity = None
    if options.validate:
        start = time.perf_counter()
        parity = _validate(folder / MODEL_FILE, ckpt, options)
        timings["validate_seconds"] = time.perf_counter() - start
        if not parity["passed"] and "failures" in parity:
            raise Gpt2OnnxError(f"validation failed ({parity['precision']}): {'; '.join(parity['failures'])}; nothing was written")
        if not parity["passed"]:
            raise Gpt2OnnxError(
                f"validation failed: max |Δlogits| {parity['max_abs_logits']:.3g} and max |Δpresent|"
                f" {parity['max_abs_present']:.3g} against PyTorch, tolerance {parity['tolerance']:.1g}; nothing was written"
            )
    _write_companions(folder, ckpt)
    manifest = {
        "format_version": MANIFEST_FORMAT_VERSION,
        "kind": kind,
        "name": ckpt.name,
        "source": ckpt.source,
        "architecture": spec.as_dict(),
        "dtype": dtype,
        "io": io.as_dict(),
        **graph_facts,
        "options": {**asdict(options), "external_data": len(model_files) > 1},
        **reports,
        "parity": parity,
        "timings": timings,
    }
    return write_manifest(folder, manifest)


def graph_summary(proto) -> dict:
    """What the manifest records of a graph: opset, domains, node count."""
    opset_imports = {imp.domain or "ai.onnx": imp.version for imp in proto.opset_import}
    return {"opset": opset_imports.get("ai.onnx"), "opset_imports": opset_imports, "node_count": len(proto.graph.node)}


def write_manifest(folder: Path, manifest: dict) -> dict:
    """Add the file hashes, versions and date, and write gpt2onnx.json (the last file of a folder)."""
    manifest = {
        **manifest,
        "files": {
            p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(folder.iterdir())
            if p.is_file() and p.name != MANIFEST_NAME
        },
        "versions": _versions(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _validate(path: Path, ckpt: Checkpoint, options: ExportOptions):
    from gpt2onnx.reference import reference_model
    from gpt2onnx.runtimes.decoder import OnnxDecoder
    from gpt2onnx.runtimes.parity import TOLERANCES, compare_block, compare_decoder, left_padded_batch
    from gpt2onnx.runtimes.providers import cpu_session

    tolerance = options.tolerance if options.tolerance is not None else TOLERANCES["float32"]["logits"]
    decode_steps = 2
    length = max(2, min(8, ckpt.spec.n_positions - decode_steps))
    input_ids, mask = left_padded_batch(ckpt.spec.vocab_size, batch=3, length=length, seed=0)
    reference = reference_model(ckpt)
    precision = _passes(options).precision
    if precision != "float32":
        from gpt2onnx.runtimes.parity import precision_gates

        log.info("checking the %s gates against transformers' GPT2LMHeadModel", precision)
        return precision_gates(
            path, reference, precision=precision, vocab_size=ckpt.spec.vocab_size,
            n_positions=ckpt.spec.n_positions, gates=options.gates,
        )  # fmt: skip
    log.info("validating against transformers' GPT2LMHeadModel (batch 3, left-padded, %d decode steps)", decode_steps)
    session = cpu_session(path)
    if options.block is not None:
        result = compare_block(
            session, reference, options.block, input_ids, mask, decode_steps=decode_steps, tolerance=tolerance
        )
    else:
        result = compare_decoder(
            OnnxDecoder(session),
            reference,
            input_ids,
            mask,
            decode_steps=decode_steps,
            tolerance=tolerance,
        )
    log.info("max |Δlogits| %.3g, max |Δpresent| %.3g", result.max_abs_logits, result.max_abs_present)
    return result.as_dict()


def _write_companions(folder: Path, ckpt: Checkpoint) -> None:
    """config.json (so Hugging Face tools load the folder), generation_config.json, tokenizer files."""
    source_config = ckpt.companion_dir / "config.json" if ckpt.companion_dir else None
    if source_config is not None and source_config.is_file() and ckpt.source["kind"] != "random":
        shutil.copyfile(source_config, folder / "config.json")
    else:
        ckpt.config.use_cache = True
        ckpt.config.to_json_file(str(folder / "config.json"))
    for name in ckpt.companion_files:
        shutil.copyfile(ckpt.companion_dir / name, folder / name)
    if "generation_config.json" not in ckpt.companion_files:
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(ckpt.config).to_json_file(str(folder / "generation_config.json"))


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import transformers

    from gpt2onnx import __version__

    return {
        "gpt2onnx": __version__,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def read_manifest(folder: Path) -> dict | None:
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
