"""int4 --prompt-kernel int8: one If on the step's row count, the prompt body on int8 kernels whose weights
onnxruntime folds from the 4-bit initializers at session creation, the decode body on MatMulNBits."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.graph import PROMPT_IF, all_nodes, load_graph
from gpt2onnx.errors import BadInput
from gpt2onnx.exporters.optimize import optimize
from gpt2onnx.precisions.all_precisions import precision_of
from gpt2onnx.precisions.prompt_path import int8_matmul_nodes, int8_weight_nodes
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.verify.parity import parity


@pytest.fixture(scope="module")
def trained_ort(trained_checkpoint, tmp_path_factory):
    from gpt2onnx.exporters.export import ExportOptions, export

    out = tmp_path_factory.mktemp("prompt-path") / "fp32-ort"
    return export(str(trained_checkpoint), out, options=ExportOptions(fusion="ort")).folder


@pytest.fixture(scope="module")
def written(trained_ort, tmp_path_factory):
    """The trained test model at int4's recipe, with and without the int8 prompt path."""
    base = tmp_path_factory.mktemp("prompt-path-int4")
    plain = optimize(trained_ort, base / "int4", fusion="none", quantization=QuantizeOptions("int4"))
    fast = optimize(
        trained_ort, base / "int4-pp", fusion="none", quantization=QuantizeOptions("int4", prompt_kernel="int8")
    )
    return plain, fast


def _ops(graph: onnx.GraphProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def test_one_if_two_bodies_and_the_same_weights(written):
    plain, fast = written
    assert fast.check.passed, fast.check.summary()
    record = fast.manifest.quantization
    assert record.prompt_kernel == "int8" and plain.manifest.quantization.prompt_kernel is None
    # the decode body's ops are counted (int4's), the If once; the prompt body's MatMulInteger are not int8's mark
    assert record.ops == {**plain.manifest.quantization.ops, "If (int8 prompt path)": 1}
    assert precision_of(open_folder(fast.folder).facts).name == "int4"
    graph = load_graph(fast.folder / "model.onnx").graph
    choice = [n for n in graph.node if n.op_type == "If"]
    assert [n.name for n in choice] == [PROMPT_IF]
    bodies = {a.name: a.g for a in choice[0].attribute}
    prompt, decode = _ops(bodies["then_branch"]), _ops(bodies["else_branch"])
    four_bit = sum(
        1
        for n in bodies["else_branch"].node
        if n.op_type == "MatMulNBits" and all(a.name != "bits" or a.i == 4 for a in n.attribute)
    )
    assert four_bit == prompt["MatMulInteger"] > 0 and "DynamicQuantizeLinear" not in prompt  # per token
    assert decode["MatMulNBits"] - prompt.get("MatMulNBits", 0) == four_bit  # the 8-bit head stays in both
    assert "MatMulInteger" not in decode and "Round" in prompt
    # CUDA's kernel table sees the prompt body: int8's ops there have no CUDA kernel (as --quantize int8's)
    from gpt2onnx.runtimes.providers import unsupported_nodes

    refused = unsupported_nodes(load_graph(fast.folder / "model.onnx"), "cuda")
    assert "MatMulInteger" in refused and "uint8" in refused["MatMulInteger"][1]
    assert "MatMulInteger" not in unsupported_nodes(load_graph(plain.folder / "model.onnx"), "cuda")
    # no weight added: the same initializers, byte for byte (the file grows by its node protos only)
    stored = {i.name: i.raw_data for i in load_graph_with_weights(fast.folder).graph.initializer}
    assert stored == {i.name: i.raw_data for i in load_graph_with_weights(plain.folder).graph.initializer}


def load_graph_with_weights(folder):
    return onnx.load(str(folder / "model.onnx"))


def test_onnxruntime_folds_the_int8_weights_at_session_creation(written, tmp_path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(written[1].folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    nodes = list(all_nodes(optimized.graph, prompt_body=True))
    ops = {n.op_type for n in nodes}
    assert not any(o.endswith(("/pairs", "/int8_kn")) for n in nodes for o in n.output)  # the unpacking folded
    assert "MatMulInteger" in ops and "MatMulNBits" in ops  # int8 for prompts, 4-bit for decode


def _one_matmul(k: int, n: int, block: int) -> tuple[onnx.ModelProto, np.ndarray]:
    """A graph of one 4-bit MatMulNBits (onnxruntime's quantizer, round to nearest) and its dequantized weight."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from gpt2onnx.verify.rounding import dequantized_weights

    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "one",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["rows", n])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=block, is_symmetric=True, accuracy_level=4)
    quantizer.process()
    model = quantizer.model.model
    return model, dequantized_weights(model)[0].values


@pytest.mark.parametrize("k, n, block", [(64, 48, 32), (96, 40, 64)])  # 96: a padded last block
def test_the_folded_weight_is_int8s_rounding_of_the_4_bit_one(k, n, block):
    import onnxruntime as ort

    model, dequantized = _one_matmul(k, n, block)
    node = model.graph.node[0]
    weight_nodes, weight, scales = int8_weight_nodes(node, "p", opset=17)
    del model.graph.node[:]
    model.graph.node.extend([*weight_nodes, *int8_matmul_nodes("x", weight, scales, "y", "p", opset=17)])
    model.graph.output.extend([helper.make_tensor_value_info(weight, onnx.TensorProto.INT8, [k, n])])
    model.graph.output.extend([helper.make_tensor_value_info(scales, onnx.TensorProto.FLOAT, [n])])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((20, k)).astype(np.float32)
    y, w8, column = session.run(None, {"x": x})
    # int8's 7-bit per-column rounding of the 4-bit weight: each column's largest |w| is 64 steps
    expected_scale = np.abs(dequantized).max(axis=0) / 64
    np.testing.assert_allclose(column, expected_scale, rtol=1e-6)
    np.testing.assert_array_equal(w8, np.round(dequantized / expected_scale).astype(np.int8))
    assert np.abs(w8).max() == 64
    # and the matmul: within int8's activation rounding of x @ the 4-bit weight
    reference = x @ dequantized
    assert np.abs(y - reference).max() < 0.02 * np.abs(reference).max()


def test_parity_and_the_kv_path_across_both_bodies(written):
    """Parity against PyTorch (batches up to 8, past, decode steps): prompt steps run the int8 body, decode steps
    the MatMulNBits body; the K/V path checks compare one with the other (decode steps against
    the same positions recomputed in one prompt step) within int4's gates."""
    report = parity(written[1].folder, cases=6, seed=0)
    assert report.passed, report.summary()
    assert report.kv_path is not None and all(c.passed for c in report.kv_path.checks)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"method": "int8", "prompt_kernel": "int8"}, "--prompt-kernel applies to int4: drop it"),
        ({"method": "int4", "prompt_kernel": "fast"}, "unknown --prompt-kernel 'fast': choose nbits or int8"),
        (
            {"method": "int4", "prompt_kernel": "int8", "algorithm": "hqq"},
            "prompt kernel int8 (--prompt-kernel int8) folds symmetric round-to-nearest weights (no zero points), but"
            " algorithm hqq (--algorithm hqq) writes zero points (weights that are not symmetric): use --algorithm rtn",
        ),
    ],
)
def test_bad_prompt_kernel_options_are_refused_in_one_line(options, message):
    with pytest.raises(BadInput, match=re.escape(message)):
        QuantizeOptions(**options)


def test_the_cli_refuses_a_prompt_kernel_in_one_line(tiny_export, tmp_path):
    from typer.testing import CliRunner

    from gpt2onnx.cli import app

    args = ["optimize", str(tiny_export), "-o", str(tmp_path / "out"), "--quantize", "int8", "--prompt-kernel", "int8"]
    result = CliRunner().invoke(app, args)
    text = result.output.strip()
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), text
    assert len(text.splitlines()) == 1 and text.startswith("error: "), text
    assert "--prompt-kernel applies to int4: drop it" in text and not (tmp_path / "out").exists()
