"""The common tools of the field run on our files, and what they write still matches ours.

- onnxruntime's transformer optimizer (``optimize_model(model_type="gpt2")``, which Olive's
  OrtTransformersOptimization pass calls): it once crashed with an IndexError at our logits Gemm, which has no
  bias; the projection now reads ln_f's output directly (the reshape comes first), which its rewrite leaves alone.
- onnxslim: its simplified graph.
- polygraphy's lint (slow: it runs every node).

Each rewritten graph is checked against our own export (itself checked against PyTorch at export) on a
left-padded batch with an empty past and two decode steps (max |Δlogits| and |Δpresent| ≤ 1e-4).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from gpt2onnx.verify.parity import validate_against_source


def _beside(tiny_export: Path, tmp_path: Path, model: onnx.ModelProto) -> Path:
    """A copy of the export with ``model`` as its model.onnx (config.json beside it, for the context)."""
    folder = tmp_path / "rewritten"
    folder.mkdir()
    shutil.copy(tiny_export / "config.json", folder / "config.json")
    onnx.save(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


def _matches(rewritten: Path, tiny_export: Path) -> None:
    report = validate_against_source(
        rewritten, tiny_export / "model.onnx", precision="float32", tolerance=1e-4, gates=None
    )
    assert report.passed, report.failures


def test_onnxruntime_transformer_optimizer_fuses_our_export(tiny_export, tmp_path):
    from onnxruntime.transformers import optimizer

    config = json.loads((tiny_export / "config.json").read_text())
    optimized = optimizer.optimize_model(
        str(tiny_export / "model.onnx"), model_type="gpt2", num_heads=config["n_head"], hidden_size=config["n_embd"]
    )
    stats = optimized.get_fused_operator_statistics()
    layers = config["n_layer"]
    # what it does on optimum's export too: SkipLayerNorm and FastGelu, no attention (NOTES.md)
    assert stats["SkipLayerNormalization"] + stats["LayerNormalization"] == 2 * layers + 1, stats
    assert stats["FastGelu"] == layers, stats
    _matches(_beside(tiny_export, tmp_path, optimized.model), tiny_export)


def test_onnxslim_simplifies_our_export(tiny_export, tmp_path):
    onnxslim = pytest.importorskip("onnxslim")

    slimmed = onnxslim.slim(str(tiny_export / "model.onnx"))
    assert len(slimmed.graph.node) <= len(onnx.load(str(tiny_export / "model.onnx")).graph.node)
    _matches(_beside(tiny_export, tmp_path, slimmed), tiny_export)


@pytest.mark.slow
def test_polygraphy_lint_passes_our_export(tiny_export, tmp_path):
    pytest.importorskip("polygraphy")
    pytest.importorskip("onnx_graphsurgeon")
    script = Path(sys.executable).with_name("polygraphy")  # its console script (the package has no __main__)
    if not script.exists():
        pytest.skip(f"no polygraphy script beside {sys.executable}")
    report = tmp_path / "lint.json"
    done = subprocess.run(
        [str(script), "check", "lint", str(tiny_export / "model.onnx"), "-o", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lint = json.loads(report.read_text())
    assert lint["summary"]["failing"] == [] and lint["summary"]["passing"], lint["summary"]["failing"]
