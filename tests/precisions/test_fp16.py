"""fp16 on export and optimize: what stays fp32, the outlier-channel test model, and the gate that sees fp16
as a GPU computes it (the CPU provider computes most fp16 nodes in fp32)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from gpt2onnx.errors import Gpt2OnnxError
from gpt2onnx.exporters.export import ExportOptions, export
from gpt2onnx.exporters.optimize import optimize
from gpt2onnx.precisions.fp16 import written_out_layer_norms
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.pytorch.checkpoint import load_checkpoint
from gpt2onnx.pytorch.reference import reference_model
from gpt2onnx.verify.fp16_emulation import emulate_fp16, tensor_types
from gpt2onnx.verify.gates import TOLERANCES
from gpt2onnx.verify.parity import parity
from tests.cli.test_cli import assert_one_line_error, run

OUTLIERS = 3000.0  # about what GPT-2 small's outlier channels reach in its residual stream
WRITTEN_OUT_LN = 14  # below opset 17 the exporter writes LayerNorm out as ReduceMean, Sub, Pow, Sqrt, Div, ...


def test_outlier_channels_reach_the_residual_stream():
    ckpt = load_checkpoint("tiny", random_init=True, outliers=OUTLIERS)
    channels = ckpt.source["outliers"]["channels"]
    assert len(channels) == 2 and load_checkpoint("tiny", random_init=True, outliers=OUTLIERS).source == ckpt.source
    ids = torch.randint(0, ckpt.spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = reference_model(ckpt)(ids, output_hidden_states=True).hidden_states
        plain = reference_model(load_checkpoint("tiny", random_init=True))(ids, output_hidden_states=True).hidden_states
    others = [c for c in range(ckpt.spec.n_embd) if c not in channels]
    for residual in hidden[:-1]:  # the embeddings and every block's output; the last one is after ln_f
        first = residual[:, 0]  # every sequence's first token carries the outliers ...
        assert first[:, channels].abs().min() > 0.9 * OUTLIERS and first[:, others].abs().max() < 1
        assert first[:, channels].square().mean() > 100 * float(np.finfo(np.float16).max)  # its variance overflows fp16
        assert residual[:, 1:].abs().max() < 1  # ... the others do not
    # what leaves the final LayerNorm stays of ordinary size
    assert hidden[-1].abs().max() < 10 * plain[-1].abs().max()


@pytest.mark.parametrize("opset", [WRITTEN_OUT_LN, 17])
def test_fp16_passes_its_gates_with_outliers(gpt2_like_config, tmp_path, opset):
    options = ExportOptions(opset=opset, dtype="fp16")
    result = export(str(gpt2_like_config), tmp_path / "fp16", random_init=True, outliers=OUTLIERS, options=options)
    manifest = result.manifest
    assert manifest.source["outliers"]["magnitude"] == OUTLIERS
    assert manifest.check.passed and manifest.check.fp16_emulated.passed
    assert manifest.fp16.kept_fp32 == ["layernorm", "softmax", "logits"]
    report = parity(result.folder, cases=2, emulate_fp16=True)  # the reference is rebuilt with its outliers
    assert report.passed and report.provider == "cpu (fp16 emulated)", report.failures


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_models_pass_their_gates_with_outliers(gpt2_like_config, tmp_path, method):
    result = export(
        str(gpt2_like_config),
        tmp_path / method,
        random_init=True,
        outliers=OUTLIERS,
        options=ExportOptions(quantization=QuantizeOptions(method)),
    )
    assert result.check.passed and result.manifest.check.precision == method
    assert parity(result.folder, cases=2).passed


def test_fp16_keeping_nothing_fails_on_outliers(tmp_path):
    """The gate can fail: a written-out LayerNorm computed in fp16 squares the outliers past fp16's range."""
    keep_nothing = ExportOptions(opset=WRITTEN_OUT_LN, dtype="fp16", keep_fp32=())
    with pytest.raises(
        Gpt2OnnxError,
        match=r"validation failed: float16 .*FAIL: fp16 arithmetic as on a GPU: top-1 agreement .*mean KL divergence",
    ):
        export("tiny", tmp_path / "naive", random_init=True, outliers=OUTLIERS, options=keep_nothing)
    assert not (tmp_path / "naive").exists()
    # the outliers are what breaks it ...
    assert export("tiny", tmp_path / "plain", random_init=True, options=keep_nothing).check.passed
    # ... and a LayerNormalization op computes its statistics in fp32 (its stash_type) whatever the graph's dtype
    fused_ln = ExportOptions(opset=17, dtype="fp16", keep_fp32=())
    assert export("tiny", tmp_path / "op", random_init=True, outliers=OUTLIERS, options=fused_ln).check.passed


def test_written_out_layer_norms_stay_fp32_inside(tmp_path):
    def pow_types(keep):
        options = ExportOptions(opset=WRITTEN_OUT_LN, dtype="fp16", keep_fp32=keep, validate=False)
        model = onnx.load(
            str(export("tiny", tmp_path / str(keep), random_init=True, options=options).folder / "model.onnx")
        )
        types = tensor_types(model)
        return {types[n.output[0]] for n in model.graph.node if n.op_type == "Pow" and "ln_" in n.name}

    fp32 = export(
        "tiny", tmp_path / "fp32", random_init=True, options=ExportOptions(opset=WRITTEN_OUT_LN, validate=False)
    )
    n_layer = 2
    assert len(written_out_layer_norms(onnx.load(str(fp32.folder / "model.onnx")).graph)) == 2 * n_layer + 1
    assert pow_types(("layernorm", "softmax", "logits")) == {TensorProto.FLOAT}
    assert pow_types(()) == {TensorProto.FLOAT16}


def _pow_then_sqrt() -> onnx.ModelProto:
    two = helper.make_tensor("two", TensorProto.FLOAT16, [], np.array(2.0, np.float16).tobytes(), raw=True)
    graph = helper.make_graph(
        [helper.make_node("Pow", ["x", "two"], ["squared"]), helper.make_node("Sqrt", ["squared"], ["y"])],
        "pow_sqrt",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [3])],
        [two],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_emulation_overflows_where_fp16_does():
    x = np.array([OUTLIERS, 0.1, 300.0], np.float16)
    on_cpu = ort.InferenceSession(_pow_then_sqrt().SerializeToString(), providers=["CPUExecutionProvider"])
    assert on_cpu.run(None, {"x": x})[0][0] == OUTLIERS  # the CPU provider squares in fp32: no overflow
    emulated = ort.InferenceSession(
        emulate_fp16(_pow_then_sqrt()).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    y = emulated.run(None, {"x": x.astype(np.float32)})[0]
    with np.errstate(over="ignore"):  # 3000² in fp16 is inf: the point
        squared = np.square(x.astype(np.float32)).astype(np.float16)
    expected = np.sqrt(squared.astype(np.float32)).astype(np.float16)
    assert np.isinf(y[0]) and np.array_equal(y.astype(np.float16), expected)


def test_optimize_to_fp16_keeps_layer_norms_too(tmp_path):
    source = export(
        "tiny", tmp_path / "src", random_init=True, outliers=OUTLIERS, options=ExportOptions(opset=WRITTEN_OUT_LN)
    ).folder
    result = optimize(source, tmp_path / "o", fusion="none", dtype="fp16")
    assert result.check.passed and result.manifest.fp16.kept_fp32_nodes["Pow"] == 5
    with pytest.raises(Gpt2OnnxError, match="fp16 arithmetic as on a GPU"):
        optimize(source, tmp_path / "naive", fusion="none", dtype="fp16", keep_fp32=())


def test_fp16_export_passes_its_gates(gpt2_like_config, tmp_path):
    result = export(str(gpt2_like_config), tmp_path / "fp16", random_init=True, options=ExportOptions(dtype="fp16"))
    manifest = result.manifest.as_dict()  # the record as written
    assert (
        manifest["dtype"] == "float16" and manifest["parity"]["passed"] and manifest["parity"]["precision"] == "float16"
    )
    n_layer = json_config(gpt2_like_config)["n_layer"]
    assert manifest["fp16"]["kept_fp32_nodes"] == {"LayerNormalization": 2 * n_layer + 1, "Softmax": n_layer}
    inputs = {t["name"]: t["dtype"] for t in manifest["io"]["inputs"]}
    outputs = {t["name"]: t["dtype"] for t in manifest["io"]["outputs"]}
    assert inputs["past_key_values.0.key"] == "float16" and outputs["present.0.value"] == "float16"
    assert outputs["logits"] == "float32" and inputs["input_ids"] == "int64"
    assert parity(result.folder, cases=2).passed
    # the runner keeps an fp16 cache
    from gpt2onnx.artifact.folder import open_folder
    from gpt2onnx.runtimes.decoder import open_decoder
    from gpt2onnx.runtimes.providers import ProviderConfig

    decoder = open_decoder(open_folder(result.folder), ProviderConfig())
    assert decoder.empty_past(1)[0].dtype == "float16"


def json_config(path):
    import json

    return json.loads(path.read_text())


def test_optimize_to_fp16_with_fusion(tmp_path):
    source = export("tiny", tmp_path / "src", random_init=True).folder
    manifest = optimize(source, tmp_path / "o", fusion="ort", dtype="fp16").manifest.as_dict()
    assert (
        manifest["dtype"] == "float16" and manifest["parity"]["passed"] and manifest["parity"]["precision"] == "float16"
    )
    assert manifest["fusion"]["golden"]["attention"]["found"] == 2
    assert manifest["fp16"]["kept_fp32_nodes"] == {"SkipLayerNormalization": 5}  # softmax is inside MultiHeadAttention
    assert parity(tmp_path / "o", cases=2).passed


def test_fp16_invalid_combinations(tmp_path, tiny_export):
    out = tmp_path / "h"
    assert_one_line_error(
        run("export", "-m", "tiny", "--random-init", "-o", out, "--dtype", "fp16", "--quantize", "int8"),
        "--dtype fp16 and --quantize int8 do not combine",
    )
    assert_one_line_error(
        run("export", "-m", "tiny", "--random-init", "-o", out, "--dtype", "bf16"), "unknown --dtype 'bf16'"
    )
    assert_one_line_error(
        run("export", "-m", "tiny", "--random-init", "-o", out, "--dtype", "fp16", "--block", 0),
        "dtype applies to the whole decoder",
    )
    assert_one_line_error(
        run("export", "-m", "tiny", "--random-init", "-o", out, "--dtype", "fp16", "--keep-fp32", "layernorm,gelu"),
        "--keep-fp32 'layernorm,gelu' is not valid",
    )
    assert_one_line_error(
        run("export", "-m", "tiny", "--random-init", "-o", out, "--keep-fp32", "none"),
        "--keep-fp32 applies to fp16 models only",
    )
    assert_one_line_error(
        run("optimize", tiny_export, "-o", out, "--dtype", "fp16", "--keep-fp32", ""), "--keep-fp32 '' is not valid"
    )
    assert_one_line_error(run("parity", tiny_export, "--emulate-fp16"), "fp16 emulation needs an fp16 model")
    assert not out.exists()


def test_outliers_bad_inputs(tmp_path, tiny_folder):
    out = tmp_path / "o"
    assert_one_line_error(
        run("export", "-m", tiny_folder, "-o", out, "--outliers", 3000), "--outliers only shapes random weights"
    )
    assert_one_line_error(
        run("export", "-m", "tiny", "--random-init", "-o", out, "--outliers", -1), "--outliers must be a magnitude"
    )
    assert_one_line_error(
        run("export", "-m", "tiny", "--random-init", "-o", out, "--outliers", "nan"), "--outliers must be a magnitude"
    )
    assert not out.exists()


def test_cli_keep_nothing_on_outliers_is_refused(tmp_path):
    out = tmp_path / "naive"
    args = ("export", "-m", "tiny", "--random-init", "--outliers", 3000, "--opset", 14, "--dtype", "fp16", "-o", out)
    assert_one_line_error(run(*args, "--keep-fp32", "none"), "validation failed: float16 against PyTorch")
    assert not out.exists()
    result = run(*args)
    assert result.exit_code == 0, result.output
    assert "fp16 as on a GPU: mean KL" in result.output
    assert TOLERANCES["float16"]["kl_mean"] > 0
    checked = run("parity", out, "--cases", 2, "--emulate-fp16")
    assert checked.exit_code == 0 and "(fp16 emulated)" in checked.output, checked.output
