"""`inspect`: IO, opsets, op histogram, file sizes and exact parameter accounting from the initializers."""

import pytest

from gpt2onnx.artifact.inspect import inspect
from gpt2onnx.errors import Gpt2OnnxError
from gpt2onnx.exporters.export import ExportOptions, export
from gpt2onnx.precisions.quantize_options import QuantizeOptions


def test_inspect_tiny_export(tiny_export):
    info = inspect(tiny_export).as_dict()  # the JSON of inspect --json
    assert info["opset_imports"] == {"ai.onnx": 17}
    inputs = {t["name"]: t for t in info["inputs"]}
    assert inputs["attention_mask"]["dims"] == ["batch_size", "past_sequence_length + sequence_length"]
    assert inputs["past_key_values.1.value"]["dims"] == ["batch_size", 4, "past_sequence_length", 16]
    ops = {row["op_type"]: row["count"] for row in info["op_histogram"]}
    assert ops["LayerNormalization"] == 5 and ops["Gemm"] == 1 and ops["Softmax"] == 2
    components = {c["component"]: c for c in info["parameters"]["components"]}
    assert components["h.ln_1"] == dict(
        component="h.ln_1", params_per_instance=128, instances=2, total=256, uniform=True
    )
    assert components["h.attn.c_attn"]["params_per_instance"] == 64 * 192 + 192
    assert info["parameters"]["unnamed"] == []
    assert info["files"]["model.onnx"] == (tiny_export / "model.onnx").stat().st_size
    assert info["manifest"]["checks"]["passed"] and "pass" in info["manifest"]["check_summary"]


@pytest.mark.slow
def test_gpt2_124m_export_size_and_accounting(tmp_path):
    """The real 124M architecture (random weights): tied embedding stored once, exact parameter accounting."""
    result = export("gpt2", tmp_path / "gpt2", random_init=True, options=ExportOptions(logits="last"))
    assert result.check.passed
    size = result.model_bytes
    assert 497_000_000 < size < 500_000_000, size  # 124,439,808 fp32 parameters + the graph; not 650 MB
    params = inspect(result.folder).parameters
    assert params.total == 124_439_808 and params.unnamed == []
    components = {c.component: c for c in params.components}
    assert (components["h.ln_1"].params_per_instance, components["h.ln_1"].total) == (1_536, 18_432)
    assert components["wte"].total == 50257 * 768 and components["ln_f"].total == 1_536


def test_inspect_external_data_folder(tiny_folder, tmp_path):
    folder = export(str(tiny_folder), tmp_path / "ext", options=ExportOptions(external_data=True)).folder
    info = inspect(folder / "model.onnx")
    assert info.files["model.onnx_data"] == (folder / "model.onnx_data").stat().st_size
    assert info.parameters.total == sum(c.total for c in info.parameters.components)


def test_inspect_errors(tmp_path):
    with pytest.raises(Gpt2OnnxError, match="no such file or folder"):
        inspect(tmp_path / "nope.onnx")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\xff\xfe this is not a protobuf" * 10)
    with pytest.raises(Gpt2OnnxError, match="is not an ONNX model"):
        inspect(junk)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(Gpt2OnnxError, match="holds no model.onnx"):
        inspect(empty)


@pytest.mark.parametrize(
    "variant, options",
    [
        ("fp32", ExportOptions()),
        ("fp16", ExportOptions(dtype="fp16")),
        ("int8", ExportOptions(quantization=QuantizeOptions("int8"))),
        ("int4", ExportOptions(quantization=QuantizeOptions("int4"))),
        ("block", ExportOptions(block=1)),
    ],
)
def test_inspect_shows_the_checks_of_every_variant(tmp_path, variant, options):
    """inspect reads the one check report every export writes, whatever the precision (it used to crash on
    reduced precisions with a KeyError)."""
    from typer.testing import CliRunner

    from gpt2onnx.cli import app

    folder = export("tiny", tmp_path / variant, random_init=True, options=options).folder
    manifest = inspect(folder).manifest
    assert manifest.check.passed and manifest.check.precision == {
        "fp16": "float16",
        "int8": "int8",
        "int4": "int4",
    }.get(variant, "float32")
    assert "— pass" in manifest.check_summary
    result = CliRunner().invoke(app, ["inspect", str(folder)])
    assert result.exit_code == 0 and "checked at export: " in result.output, result.output


def test_inspect_an_optimum_folder(tmp_path, tiny_folder):
    import warnings

    from conftest import import_optimum

    main_export = import_optimum("optimum.exporters.onnx", "main_export")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main_export(
            str(tiny_folder), output=tmp_path / "optimum", task="text-generation-with-past", no_post_process=True
        )
    info = inspect(tmp_path / "optimum")
    assert info.manifest is None and {t.name for t in info.inputs} >= {"input_ids", "past_key_values.0.key"}


def test_inspect_refuses_what_is_not_a_regular_file_and_a_truncated_data_file(tmp_path, tiny_folder):
    import os

    fifo = tmp_path / "pipe.onnx"
    os.mkfifo(fifo)
    with pytest.raises(Gpt2OnnxError, match="is not a regular file"):
        inspect(fifo)
    folder = export(
        str(tiny_folder), tmp_path / "ext", options=ExportOptions(external_data=True, validate=False)
    ).folder
    data = folder / "model.onnx_data"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(Gpt2OnnxError, match="its tensors need"):
        inspect(folder, verify_files=False)
    import onnx

    plain = export(str(tiny_folder), tmp_path / "plain", options=ExportOptions(validate=False)).folder
    swapped = onnx.load(str(plain / "model.onnx"))
    swapped.producer_name = "someone else"
    onnx.save(swapped, str(plain / "model.onnx"))
    with pytest.raises(Gpt2OnnxError, match="differs from what the manifest"):
        inspect(plain)
