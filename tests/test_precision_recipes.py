"""What int8 and int4 leave alone (--lm-head, --embeddings), int4's arithmetic (--accuracy-level): the ops and
dtypes written for each layer, and each variant still passing its precision's gates against its source graph."""

import onnx
import pytest
from onnx import numpy_helper
from test_cli import assert_one_line_error, run

from gpt2onnx.exporters.optimize import optimize
from gpt2onnx.passes.precision import QuantizeOptions, embedding_gathers, logits_projection


def _attr(node, name, default=None):
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _layers(folder):
    """What the logits projection and the embeddings became: (op, bits or the weight's dtype) each."""
    graph = onnx.load(str(folder / "model.onnx")).graph
    weights = {init.name: init for init in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    node = producer["logits"]
    while node.op_type in ("Reshape", "Cast"):
        node = producer[node.input[0]]

    def kind(node):
        weight = weights[node.input[0 if node.op_type.startswith("Gather") else 1]]
        bits = _attr(node, "bits", 4) if node.op_type in ("MatMulNBits", "GatherBlockQuantized") else 32
        return node.op_type, bits, onnx.TensorProto.DataType.Name(weight.data_type)

    embeddings = sorted(
        kind(n) for n in graph.node if n.op_type in ("Gather", "GatherBlockQuantized") and n.input[0] in weights
    )
    return kind(node), embeddings


@pytest.mark.parametrize(
    "options, head, embedding",
    [
        (QuantizeOptions("int4"), ("MatMulNBits", 4, "UINT8"), ("GatherBlockQuantized", 4, "INT4")),
        (
            QuantizeOptions("int4", 128, 0, lm_head="int8", embeddings="int8"),
            ("MatMulNBits", 8, "UINT8"),
            ("GatherBlockQuantized", 8, "UINT8"),
        ),
        (QuantizeOptions("int4", lm_head="fp32", embeddings="fp32"), ("Gemm", 32, "FLOAT"), ("Gather", 32, "FLOAT")),
        (
            QuantizeOptions("int8", lm_head="fp32", embeddings="int8"),
            ("Gemm", 32, "FLOAT"),
            ("GatherBlockQuantized", 8, "UINT8"),
        ),
    ],
    ids=["int4-recipe", "int4-head8-emb8-bs128-acc0", "int4-head32-emb32", "int8-head32-emb8"],
)
def test_layers_kept_and_gates_pass(gpt2_init_export, tmp_path, options, head, embedding):
    result = optimize(gpt2_init_export, tmp_path / "q", fusion="none", quantization=options)
    assert result.check.passed, result.check.summary()
    recorded = result.manifest.quantization
    resolved = options.resolved()
    assert (recorded.lm_head, recorded.embeddings) == (resolved.lm_head, resolved.embeddings)
    got_head, got_embeddings = _layers(tmp_path / "q")
    assert got_head == head and got_embeddings == [embedding, embedding]  # token and position embeddings
    model = onnx.load(str(tmp_path / "q" / "model.onnx"))
    levels = {_attr(n, "accuracy_level", 0) for n in model.graph.node if n.op_type == "MatMulNBits"}
    if options.method == "int4":
        assert levels == {resolved.accuracy_level}
    if head[0] == "Gemm":  # kept fp32: still the tied embedding itself, stored once
        source = onnx.load(str(gpt2_init_export / "model.onnx"))
        assert logits_projection(model.graph).input[1] == logits_projection(source.graph).input[1] == "wte.weight"


def test_8bit_embeddings_round_trip(gpt2_init_export):
    """The 8-bit GatherBlockQuantized dequantizes to within half a step of each block's scale."""
    import numpy as np
    import onnxruntime as ort

    from gpt2onnx.passes.precision import _gathers_to_8bit

    model = onnx.load(str(gpt2_init_export / "model.onnx"))
    gather = embedding_gathers(model.graph)[0]
    weight = next(numpy_helper.to_array(i) for i in model.graph.initializer if i.name == gather.input[0])
    graph = onnx.helper.make_graph(
        [onnx.NodeProto.FromString(gather.SerializeToString())],
        "g",
        [onnx.helper.make_tensor_value_info(gather.input[1], onnx.TensorProto.INT64, [None])],
        [onnx.helper.make_tensor_value_info(gather.output[0], onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, gather.input[0])],
    )
    small = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    small.graph.node[0].name = "emb"
    assert _gathers_to_8bit(small, {"emb"}, 16) == 1
    ids = np.arange(weight.shape[0], dtype=np.int64)
    out = ort.InferenceSession(small.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {gather.input[1]: ids}
    )[0]
    step = np.abs(weight.reshape(weight.shape[0], -1, 16)).max(-1, keepdims=True) / 127
    assert (np.abs(out - weight).reshape(step.shape[0], -1, 16) <= step / 2 + 1e-7).all()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--accuracy-level", "2", "--quantize", "int4"], "--accuracy-level 2 is not supported"),
        (["--accuracy-level", "4", "--quantize", "int8"], "--accuracy-level applies to int4"),
        (["--lm-head", "int4", "--quantize", "int8"], "--lm-head 'int4' is not valid with --quantize int8"),
        (["--embeddings", "bf16", "--quantize", "int4"], "--embeddings 'bf16' is not valid with --quantize int4"),
        (["--lm-head", "fp32"], "--lm-head applies to quantized weights"),
        (["--block-size", "48", "--quantize", "int8", "--embeddings", "int8"], "--block-size 48 is not supported"),
    ],
)
def test_recipe_bad_inputs(tmp_path, args, message):
    assert_one_line_error(run("export", "-m", "tiny", "--random-init", "-o", tmp_path / "q", *args), message)
    assert not (tmp_path / "q").exists()


def _damage(monkeypatch, method: str) -> None:
    """Make ``method`` quantize with fewer bits per weight than it says, through the real pipeline: int4 with
    2-bit MatMulNBits, int8 with 4-bit MatMulNBits in place of quantize_dynamic's int8."""
    import onnxruntime.quantization

    import gpt2onnx.passes.precision as precision

    real = precision._matmul_nbits
    if method == "int4":
        monkeypatch.setattr(
            precision, "_matmul_nbits", lambda model, options, **kw: real(model, options, **{**kw, "bits": 2})
        )
        return

    def four_bits(model, out, *, nodes_to_exclude=(), **_):
        options = QuantizeOptions("int4", 32, 0)
        onnx.save(real(model, options, bits=4, exclude=set(nodes_to_exclude), gathers=False), str(out))

    monkeypatch.setattr(onnxruntime.quantization, "quantize_dynamic", four_bits)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_default_gates_pass_the_recipes_and_fail_a_damaged_one(trained_export, tmp_path, monkeypatch, method):
    """On a model that has learned something, the method's recipe passes its default gates; the same method with
    fewer bits per weight (int4 → 2 bits, int8 → 4 bits) fails them, and nothing is written."""
    from gpt2onnx.errors import CheckFailed

    good = optimize(trained_export, tmp_path / "good", fusion="none", quantization=QuantizeOptions(method))
    assert good.check.passed, good.check.summary()
    _damage(monkeypatch, method)
    with pytest.raises(CheckFailed, match=f"validation failed: {method}") as failed:
        optimize(trained_export, tmp_path / "damaged", fusion="none", quantization=QuantizeOptions(method))
    assert not (tmp_path / "damaged").exists()
    assert failed.value.report.failures
