"""Weight quantization (int8 dynamic, int4 block-wise) on export and optimize, with its accuracy gates."""

import json
from collections import Counter

import onnx
import pytest

from gpt2onnx.errors import BadInput, Gpt2OnnxError
from gpt2onnx.exporters.export import ExportOptions, export
from gpt2onnx.exporters.optimize import optimize
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.verify.gates import TOLERANCES
from gpt2onnx.verify.parity import parity
from tests.cli.test_cli import assert_one_line_error, run


def _ops(folder) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(folder / "model.onnx")).graph.node)


@pytest.mark.parametrize("method, op", [("int4", "MatMulNBits"), ("int8", "MatMulInteger")])
def test_export_quantized_passes_its_gates(gpt2_like_config, tmp_path, method, op):
    result = export(
        str(gpt2_like_config),
        tmp_path / method,
        random_init=True,
        options=ExportOptions(quantization=QuantizeOptions(method)),
    )
    manifest = result.manifest.as_dict()  # the record as written
    assert manifest["quantization"]["method"] == method and manifest["quantization"]["ops"][op] > 0
    check = manifest["parity"]
    assert check["passed"] and check["precision"] == method
    assert (
        check["measured"]["kl"]["mean"] <= TOLERANCES[method]["kl_mean"]
        and check["measured"]["top5_agreement"] >= TOLERANCES[method]["top5"]
    )
    model = onnx.load(str(result.folder / "model.onnx"))
    weights = {init.name for init in model.graph.initializer}
    float_projections = [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights]
    assert float_projections == [], "every projection, the logits one included, is quantized"
    report = parity(result.folder, cases=3)
    assert report.precision == method and report.passed, report.failures


def test_int4_is_smaller_than_int8_is_smaller_than_fp32(tiny_folder, tmp_path):
    sizes = {}
    for method in ("none", "int8", "int4"):
        folder = export(
            str(tiny_folder),
            tmp_path / method,
            options=ExportOptions(quantization=QuantizeOptions(method), validate=False),
        ).folder
        sizes[method] = (folder / "model.onnx").stat().st_size
    assert sizes["int4"] < sizes["int8"] < sizes["none"]


def test_optimize_fuses_then_quantizes(tmp_path):
    source = export("tiny", tmp_path / "src", random_init=True).folder
    result = optimize(source, tmp_path / "o", fusion="ort", quantization=QuantizeOptions("int4", 16))
    assert result.manifest.quantization.block_size == 16 and result.check.passed
    assert result.manifest.fusion.golden["attention"].found == 2
    ops = _ops(tmp_path / "o")
    assert ops["MultiHeadAttention"] == 2 and ops["MatMulNBits"] > 0
    model = onnx.load(str(tmp_path / "o" / "model.onnx"))
    opset = next(i.version for i in model.opset_import if i.domain in ("", "ai.onnx"))
    assert model.ir_version >= (10 if opset >= 21 else 8)  # the quantizer's opset 21 needs IR 10


def test_the_recipe_s_int4_blocks_fit_the_model(tmp_path):
    """The recipe's blocks of 128 fitted to a 64-wide model: blocks of 64 (one stored tied table, and k-quant,
    which cannot pad a short block, applies); a block size the user gives is kept, or refused in one line where
    the algorithm cannot split the widths into an even number of blocks."""
    source = export("tiny", tmp_path / "src", random_init=True).folder
    width = json.loads((source / "config.json").read_text())["n_embd"]
    result = optimize(source, tmp_path / "o", fusion="none", quantization=QuantizeOptions("int4"))
    record = result.manifest.quantization
    assert QuantizeOptions("int4").recipe.block_size == 128 and width == 64
    assert record.block_size == 64 and record.shared_embedding == "wte.weight" and result.check.passed
    kept = optimize(source, tmp_path / "k", fusion="none", quantization=QuantizeOptions("int4", 128))
    assert kept.manifest.quantization.block_size == 128 and kept.check.passed
    with pytest.raises(BadInput, match=r"--block-size 64 does not split .* k-quant needs .*: choose --block-size 32"):
        optimize(source, tmp_path / "r", fusion="none", quantization=QuantizeOptions("int4", 64, algorithm="k-quant"))
    assert not (tmp_path / "r").exists()


def test_the_gate_can_fail(tiny_folder, tmp_path, monkeypatch):
    """With a gate no quantized model can meet, export refuses and writes nothing."""
    monkeypatch.setitem(TOLERANCES, "int4", {"kl_mean": 0.0, "top5": 1.0})
    with pytest.raises(Gpt2OnnxError, match=r"validation failed: int4 .*mean KL divergence .* > 0"):
        export(str(tiny_folder), tmp_path / "q", options=ExportOptions(quantization=QuantizeOptions("int4")))
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("block_size", [8, 48, 512])
def test_unsupported_int4_block_size(tmp_path, block_size):
    assert_one_line_error(
        run(
            "export",
            "-m",
            "tiny",
            "--random-init",
            "-o",
            tmp_path / "q",
            "--quantize",
            "int4",
            "--block-size",
            block_size,
        ),
        f"--block-size {block_size} is not supported for int4",
    )


def test_quantize_bad_inputs(tmp_path, tiny_export):
    assert_one_line_error(
        run("export", "-m", "tiny", "--random-init", "-o", tmp_path / "q", "--quantize", "int2"),
        "unknown --quantize 'int2'",
    )
    assert_one_line_error(
        run("export", "-m", "tiny", "--random-init", "-o", tmp_path / "q", "--quantize", "int8", "--block", 0),
        "quantize applies to the whole decoder",
    )
    assert_one_line_error(
        run("optimize", tiny_export, "--out", tmp_path / "o", "--quantize", "fp8"), "unknown --quantize 'fp8'"
    )


def test_cli_quantized_export(tmp_path):
    result = run("export", "-m", "tiny", "--random-init", "-o", tmp_path / "q", "--quantize", "int8")
    assert result.exit_code == 0, result.output
    assert "int8 against PyTorch" in result.output
    manifest = json.loads((tmp_path / "q" / "gpt2onnx.json").read_text())
    assert manifest["quantization"]["method"] == "int8"


def test_gates_can_be_overridden(tmp_path, tiny_folder):
    # the test checkpoints' wide init makes int4 fail the default gates (see gpt2_like_config) ...
    assert_one_line_error(
        run("export", "-m", tiny_folder, "-o", tmp_path / "q", "--quantize", "int4"), "validation failed: int4"
    )
    # ... and a user who accepts that can say so, gate by gate
    result = run(
        "export",
        "-m",
        tiny_folder,
        "-o",
        tmp_path / "q",
        "--quantize",
        "int4",
        "--gate",
        "kl_mean=1",
        "--gate",
        "top5=0.5",
        "--gate",
        "top1=0.2",
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "q" / "gpt2onnx.json").read_text())["parity"]["gates"] == {
        "kl_mean": 1.0,
        "top5": 0.5,
        "top1": 0.2,
    }
    assert run("parity", tmp_path / "q", "--cases", 2).exit_code == 1
    overrides = ("--gate", "kl_mean=1", "--gate", "top5=0.5", "--gate", "top1=0.2")
    assert run("parity", tmp_path / "q", "--cases", 2, *overrides).exit_code == 0
    assert_one_line_error(run("parity", tmp_path / "q", "--gate", "speed=1"), "unknown gate 'speed'")
    assert_one_line_error(run("parity", tmp_path / "q", "--gate", "top5=high"), "'high' is not a number")
