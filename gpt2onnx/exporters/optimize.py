"""`gpt2onnx optimize`: apply a fusion profile to an exported decoder (ours or optimum's) and write a new
folder, checked against the graph it came from before anything is written."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import onnx

from gpt2onnx.checkpoint import COMPANION_FILES
from gpt2onnx.errors import Gpt2OnnxError
from gpt2onnx.exporters.export import MANIFEST_FORMAT_VERSION, MODEL_FILE, graph_summary, read_manifest, write_manifest
from gpt2onnx.exporters.output import save_onnx, staged_folder
from gpt2onnx.exporters.passes import GraphPasses
from gpt2onnx.quantization import FP16_KEEP_GROUPS, QuantizeOptions

log = logging.getLogger(__name__)


def _input_model(path: Path) -> Path:
    from gpt2onnx.inspection import resolve_model_path

    return resolve_model_path(path)


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
) -> dict:
    """Fuse ``source`` (a folder or .onnx file) with profile ``fusion`` (and quantize its weights) into the
    folder ``out``; returns its manifest."""
    from gpt2onnx.inspection import load_graph

    passes = GraphPasses(fusion, allow_partial, dtype, quantization, keep_fp32)
    dtype = passes.check()
    model_path = _input_model(Path(source))
    load_graph(model_path)  # a clear error for a file that is not ONNX, before the weights are read
    out = Path(out)
    if out.exists() and not force:
        raise Gpt2OnnxError(f"output folder '{out}' already exists: choose another --out, or add --force to replace it")
    if out.resolve() == model_path.parent.resolve():
        raise Gpt2OnnxError("--out is the input folder: write the optimized model to another folder")
    timings = {}
    fused, reports = passes.apply(onnx.load(str(model_path)), timings)
    with staged_folder(out, force=force) as folder:
        files = save_onnx(fused, folder / MODEL_FILE, external_data=external_data)
        facts = graph_summary(fused)
        del fused
        for name in ("config.json", *COMPANION_FILES):
            if (model_path.parent / name).is_file():
                shutil.copyfile(model_path.parent / name, folder / name)
        parity = None
        if validate:
            start = time.perf_counter()
            precision = passes.precision
            parity = _against_source(folder / MODEL_FILE, model_path, tolerance, precision, gates)
            timings["validate_seconds"] = time.perf_counter() - start
            if not parity["passed"] and "failures" in parity:
                raise Gpt2OnnxError(
                    f"validation failed ({precision}): {'; '.join(parity['failures'])}; nothing was written"
                )
            if not parity["passed"]:
                raise Gpt2OnnxError(
                    f"validation failed: the fused model differs from its source by max |Δlogits|"
                    f" {parity['max_abs_logits']:.3g} (tolerance {tolerance:g}); nothing was written"
                )
        previous = read_manifest(model_path.parent) or {}
        manifest = {
            "format_version": MANIFEST_FORMAT_VERSION,
            "kind": "decoder",
            "name": previous.get("name", model_path.parent.name),
            "source": previous.get("source", {"kind": "onnx", "path": str(model_path.resolve())}),
            "optimized_from": str(model_path.resolve()),
            "architecture": previous.get("architecture"),
            "dtype": dtype if dtype == "float16" else previous.get("dtype", "float32"),
            "io": None if dtype == "float16" else previous.get("io"),
            **facts,
            "options": {**previous.get("options", {}), "fusion": fusion, "allow_partial_fusion": allow_partial, "external_data": len(files) > 1},
            **reports,
            "parity": parity,
            "timings": timings,
        }
        return write_manifest(folder, manifest)


def _against_source(fused_path: Path, source_path: Path, tolerance: float, method: str = "float32", gates=None) -> dict:
    """The fused graph against the graph it came from: a left-padded batch, empty past, decode steps; for
    quantized weights, the precision's gates on a few randomized cases."""
    from gpt2onnx.runtimes.decoder import OnnxDecoder, read_n_positions
    from gpt2onnx.runtimes.parity import OnnxReference, compare_decoder, left_padded_batch, precision_gates
    from gpt2onnx.runtimes.providers import cpu_session

    fused = OnnxDecoder(cpu_session(fused_path))
    source = OnnxReference(OnnxDecoder(cpu_session(source_path)))
    vocab = fused.vocab_size or 1000
    if method != "float32":
        n_positions = read_n_positions(fused_path.parent)
        checked = precision_gates(
            fused_path, source, precision=method, vocab_size=vocab, n_positions=n_positions, gates=gates, decoder=fused
        )
        return {**checked, "against": "source ONNX model"}
    input_ids, mask = left_padded_batch(vocab, batch=3, length=8, seed=0)
    result = compare_decoder(fused, source, input_ids, mask, decode_steps=2, tolerance=tolerance)
    return {**result.as_dict(), "against": "source ONNX model"}
