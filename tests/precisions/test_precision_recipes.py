"""What int8 and int4 leave alone (--lm-head, --embeddings), int4's arithmetic (--accuracy-level): the ops and
dtypes written for each layer, and each variant still passing its precision's gates against its source graph."""

import json

import onnx
import pytest
from onnx import numpy_helper

from gpt2onnx.exporters.optimize import optimize
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.precisions.weights import embedding_gathers, logits_projection
from tests.cli.test_cli import assert_one_line_error, run


def _attr(node, name, default=None):
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _layers(folder):
    """What the logits projection and the embeddings became: (op, bits or the weight's dtype) each."""
    graph = onnx.load(str(folder / "model.onnx")).graph
    weights = {init.name: init for init in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    node = producer["logits"]
    while node.op_type in ("Reshape", "Cast", "Slice"):  # Slice: the head's rows in pairs (passes/batch_invariance.py)
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
        (QuantizeOptions("int4"), ("MatMulNBits", 8, "UINT8"), ("GatherBlockQuantized", 8, "UINT8")),
        (
            QuantizeOptions("int4", 32, lm_head="int4", embeddings="int4"),
            ("MatMulNBits", 4, "UINT8"),
            ("GatherBlockQuantized", 4, "INT4"),
        ),
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
    ids=["int4-recipe", "int4-all4-bs32", "int4-head8-emb8-bs128-acc0", "int4-head32-emb32", "int8-head32-emb8"],
)
def test_layers_kept_and_gates_pass(gpt2_init_export, tmp_path, options, head, embedding):
    result = optimize(gpt2_init_export, tmp_path / "q", fusion="none", quantization=options)
    assert result.check.passed, result.check.summary()
    recorded = result.manifest.quantization
    resolved = options.recipe
    assert (recorded.lm_head, recorded.embeddings) == (resolved.lm_head, resolved.embeddings)
    got_head, got_embeddings = _layers(tmp_path / "q")
    # token and position embeddings; where the head and the token table have one width, the token Gather reads the
    # head's MatMulNBits weights (its uint8 blocks: the table stored once), and the manifest says so
    shared = recorded.shared_embedding is not None
    width = json.loads((gpt2_init_export / "config.json").read_text())["n_embd"]
    same_width = options.method == "int4" and resolved.lm_head == resolved.embeddings != "fp32"
    assert recorded.block_size == (options.block_size or min(resolved.block_size, width))  # the recipe's, fitted
    assert shared == (same_width and width % recorded.block_size == 0)  # a padded last block is not shared
    token = (embedding[0], embedding[1], head[2]) if shared else embedding
    assert got_head == head and got_embeddings == sorted([token, embedding])
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

    from gpt2onnx.precisions.weights import gathers_to_8bit as _gathers_to_8bit

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


def _damage(monkeypatch, method: str, damage: str) -> None:
    """Make ``method`` write a damaged file through the real pipeline: ``bits``, fewer bits per weight than it says
    (int4 with 2-bit MatMulNBits, int8 with 4-bit MatMulNBits in place of quantize_dynamic's int8); ``scales``,
    every weight scale doubled after quantization."""
    import onnxruntime.quantization
    from onnx import numpy_helper

    import gpt2onnx.precisions.weights as precision

    if damage == "scales":
        real_quantize = precision.quantize

        def doubled(model, options, **kw):
            quantized, record = real_quantize(model, options, **kw)
            for init in quantized.graph.initializer:
                if init.name.endswith(("_scale", "_scales")) and init.data_type == onnx.TensorProto.FLOAT:
                    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 2, init.name))
            return quantized, record

        monkeypatch.setattr(precision, "quantize", doubled)
        return
    real = precision.matmul_nbits
    if method == "int4":
        monkeypatch.setattr(
            precision, "matmul_nbits", lambda model, options, **kw: real(model, options, **{**kw, "bits": 2})
        )
        return

    def four_bits(model, out, *, nodes_to_exclude=(), **_):
        options = QuantizeOptions("int4", 32, 0)
        onnx.save(real(model, options, bits=4, exclude=set(nodes_to_exclude), gathers=False), str(out))

    monkeypatch.setattr(onnxruntime.quantization, "quantize_dynamic", four_bits)


@pytest.mark.parametrize("damage", ["bits", "scales"])
@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("weights", ["trained", "random"])
def test_the_recipes_pass_and_a_damaged_file_fails_on_any_weights(
    weights, method, damage, trained_export, gpt2_init_export, tmp_path, monkeypatch
):
    """The method's recipe passes; the same method with fewer bits per weight than it declares (int4 → 2 bits,
    int8 → 4 bits) or with wrong scales fails, and nothing is written: on trained weights (quality gates and the
    file checks) and on random ones (the file checks alone: their weights are not the declared rounding)."""
    from gpt2onnx.errors import CheckFailed

    source = trained_export if weights == "trained" else gpt2_init_export
    good = optimize(source, tmp_path / "good", fusion="none", quantization=QuantizeOptions(method))
    assert good.check.passed, good.check.summary()
    assert good.check.rounded.measured.weights.max_steps <= 1.0 + 1e-3
    assert ("not applied" in good.check.quality_gates) == (weights == "random")
    if weights == "trained":  # a checkpoint whose predictions carry information: measured, and said
        assert good.check.quality_gates.startswith("quality gates applied (weights from a checkpoint, predicting")
        assert good.check.measured.reference_information > 0.6
    _damage(monkeypatch, method, damage)
    with pytest.raises(CheckFailed, match=f"validation failed: {method}") as failed:
        optimize(source, tmp_path / "damaged", fusion="none", quantization=QuantizeOptions(method))
    assert not (tmp_path / "damaged").exists()
    assert any("weights are not the declared rounding" in f for f in failed.value.report.failures)


FLAT = dict(model_type="gpt2", n_layer=1, n_head=2, n_embd=64, n_positions=64, vocab_size=50257, eos_token_id=50256)


@pytest.mark.parametrize("precision", [(), ("--dtype", "fp16"), ("--quantize", "int8"), ("--quantize", "int4")])
def test_random_weights_export_in_every_precision(tmp_path, precision):
    """The README's --random-init exports succeed in every precision, on a model with GPT-2's vocabulary and init,
    whose random predictions are nearly flat as the random 124M model's (where top-1 agreement of a sound int4 file
    is close to chance: 55.6 % on an AVX2 CPU, docs/benchmarks.md), judged by the file checks."""
    import json

    from gpt2onnx.machine import describe_cpu

    (tmp_path / "config.json").write_text(json.dumps(FLAT))
    result = run("export", "-m", tmp_path / "config.json", "--random-init", "-o", tmp_path / "out", *precision)
    assert result.exit_code == 0, result.output
    check = json.loads((tmp_path / "out" / "gpt2onnx.json").read_text())["parity"]
    assert check["passed"] and check["machine"]["cpu"]["model"] == describe_cpu().model
    shown = run("inspect", tmp_path / "out")
    assert shown.exit_code == 0 and describe_cpu().short() in shown.output  # where the check ran, on its line
    if precision and precision[1] in ("int8", "int4"):
        assert check["quality_gates"].startswith("quality gates not applied: random weights")
        assert check["rounded"]["measured"]["weights"]["max_steps"] <= 1.001


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_random_checkpoint_folder_is_judged_by_its_predictions_not_its_origin(tmp_path, monkeypatch, method):
    """Random weights saved as a checkpoint (save_pretrained: nothing says they are random, as with the peers'
    benchmark checkpoint) predict nearly flat distributions, where top-k agreement is chance: their int8 and int4
    exports pass without the quality gates, saying why with the figure (gates.FLAT_NATS), and the file checks still
    refuse a damaged file from the same folder. The trained fixture keeps its quality gates (the test above)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2onnx.errors import CheckFailed
    from gpt2onnx.exporters.export import ExportOptions, export

    torch.manual_seed(0)
    config = GPT2Config(**{k: v for k, v in FLAT.items() if k != "model_type"})
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "random-checkpoint")
    options = ExportOptions(quantization=QuantizeOptions(method))
    good = export(str(tmp_path / "random-checkpoint"), tmp_path / "good", options=options)
    assert good.check.passed, good.check.summary()
    assert good.check.quality_gates.startswith("quality gates not applied: the reference predicts nearly flat")
    assert good.check.measured.reference_information < 0.05  # n_embd 64 · 0.02² / 2 = 0.013 nats
    assert "kl_mean" not in good.check.gates and good.check.rounded.passed
    _damage(monkeypatch, method, "bits")
    with pytest.raises(CheckFailed, match=f"validation failed: {method}") as failed:
        export(str(tmp_path / "random-checkpoint"), tmp_path / "damaged", options=options)
    assert not (tmp_path / "damaged").exists()
    assert any("weights are not the declared rounding" in f for f in failed.value.report.failures)
