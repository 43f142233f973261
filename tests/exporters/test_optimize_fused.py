"""optimize on a folder that export fused already: every precision from every profile's export (fusing what is
fused is a no-op, the profile read from the graph's own ops), and one-line refusals for the combinations that
cannot be made (never an internal error)."""

from collections import Counter

import onnx
import pytest
from typer.testing import CliRunner

from gpt2onnx.cli.app import app
from gpt2onnx.errors import Gpt2OnnxError
from gpt2onnx.exporters.export import ExportOptions, export
from gpt2onnx.exporters.optimize import optimize
from gpt2onnx.passes.fusions.fuse import graph_profile
from gpt2onnx.precisions.quantize_options import QuantizeOptions

PROFILES = ("none", "ort", "ort-shared-kv", "portable", "tensorrt", "onnx", "onnx-static-kv")
PRECISIONS = {
    "int8": dict(quantization=QuantizeOptions(method="int8")),
    "int4": dict(quantization=QuantizeOptions(method="int4")),
    "fp16": dict(dtype="fp16"),
}
runner = CliRunner()


@pytest.fixture(scope="module")
def exports(trained_checkpoint, tmp_path_factory):
    """The trained fixture (head size 16: every profile applies; trained weights, so int8 and int4 are held to the
    quality gates, not the file checks alone) exported with each profile."""
    root = tmp_path_factory.mktemp("fused")
    return {p: export(str(trained_checkpoint), root / p, options=ExportOptions(fusion=p)).folder for p in PROFILES}


def _fused_ops(folder) -> Counter:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return Counter(f"{n.domain}::{n.op_type}" for n in model.graph.node if n.domain or n.op_type in ("Gelu",))


@pytest.mark.parametrize(("profile", "precision"), [(p, q) for p in PROFILES for q in PRECISIONS])
def test_every_precision_from_every_profiles_export(exports, tmp_path, profile, precision):
    source = exports[profile]
    result = optimize(source, tmp_path / "o", **PRECISIONS[precision])  # no fusion given: the source's own, else ort
    kept = profile if profile not in ("none", "tensorrt") else "ort"  # an unfused graph (tensorrt's looks so) gets ort
    assert result.manifest.fusion.profile == kept and not result.manifest.fusion.partial
    assert result.check.passed, result.check.failures
    assert result.check.precision == {"fp16": "float16"}.get(precision, precision)
    if kept == profile:  # fused already: the fused ops are the source's, and the source's fusion record is kept
        held = graph_profile(onnx.load(str(tmp_path / "o" / "model.onnx"), load_external_data=False))
        assert (held.name if held else "none") == profile
        assert result.manifest.fusion.applied == onnx_fusion_record(source)
        written = _fused_ops(tmp_path / "o")  # the source's fused ops, as many (quantization adds its own)
        assert all(written[op] == n for op, n in _fused_ops(source).items()), (written, _fused_ops(source))


def onnx_fusion_record(folder) -> dict:
    from gpt2onnx.artifact.folder import read_manifest

    return read_manifest(folder).fusion.applied


def test_the_issues_commands_on_an_ort_folder(exports, tmp_path):
    """`export --fusion ort`, then `optimize` with each precision and the default or explicit profile."""
    flags_of = {"int8": ["--quantize", "int8"], "int4": ["--quantize", "int4"], "fp16": ["--dtype", "fp16"]}
    for name, flags in flags_of.items():
        for fusion in ([], ["--fusion", "ort"]):
            out = tmp_path / f"{name}{len(fusion)}"
            result = runner.invoke(app, ["optimize", str(exports["ort"]), "-o", str(out), *flags, *fusion])
            assert result.exit_code == 0, result.output
            assert graph_profile(onnx.load(str(out / "model.onnx"), load_external_data=False)).name == "ort"


@pytest.mark.parametrize(
    ("profile", "fusion", "message"),
    [
        ("ort", None, "nothing to do: .* already fused with the ort profile"),
        ("ort", "ort", "nothing to do"),
        ("ort-shared-kv", "ort", "is fused with the ort-shared-kv profile: start from the unfused export"),
        ("ort", "portable", "profile portable .* fuses an unfused graph.*is fused with the ort profile"),
        ("portable", "ort", "profile ort .*is fused with the portable profile.* \\(--fusion portable\\)"),
        ("portable", "tensorrt", "profile tensorrt .*is fused with the portable profile"),
    ],
)
def test_a_fused_folder_refuses_in_one_line(exports, tmp_path, profile, fusion, message):
    with pytest.raises(Gpt2OnnxError, match=message):
        optimize(exports[profile], tmp_path / "o", fusion=fusion)
    assert not (tmp_path / "o").exists()
    args = ["optimize", str(exports[profile]), "-o", str(tmp_path / "o"), *(["--fusion", fusion] if fusion else [])]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "Traceback" not in result.output, result.output


def test_ort_shared_kv_from_an_ort_folder(exports, tmp_path):
    """A profile that builds on another (ort-shared-kv rewrites ort's MultiHeadAttention) is done, not refused."""
    result = optimize(exports["ort"], tmp_path / "o", fusion="ort-shared-kv", dtype="fp16")
    assert result.check.passed and result.manifest.fusion.applied["shared_kv"] == 2
    assert result.manifest.cache_layout == "shared"


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_every_precision_of_the_unfused_graph(exports, tmp_path, precision):
    """--fusion none keeps the standard-domain graph: fp16 of its attention stays finite (the mask's blocked value
    is fp16-safe; it overflowed to NaN in the check's GPU emulation before)."""
    result = optimize(exports["none"], tmp_path / "o", fusion="none", **PRECISIONS[precision])
    assert result.check.passed, result.check.summary()
    assert graph_profile(onnx.load(str(tmp_path / "o" / "model.onnx"), load_external_data=False)) is None
