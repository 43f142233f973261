"""A quantized K/V cache (--kv-cache int8, fusion ort-shared-kv): onnxruntime's GroupQueryAttention kernel against
numpy on one node, the pass and its calibrated scales, SharedCacheDecoder's int8 buffers, the checks, and the
options it refuses in one line."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.cli import app
from gpt2onnx.decoding.generate import decode
from gpt2onnx.errors import BadInput
from gpt2onnx.exporters.export import ExportOptions, export
from gpt2onnx.exporters.optimize import optimize
from gpt2onnx.precisions.kv_cache import INT4, INT8, steps_of
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.runtimes.decoder import SharedCacheDecoder, open_decoder
from gpt2onnx.runtimes.providers import ProviderConfig
from gpt2onnx.verify.lockstep import left_padded_batch
from gpt2onnx.verify.parity import parity
from tests.cli.test_cli import assert_one_line_error

runner = CliRunner()
B, H, D = 2, 2, 64  # the kernel needs head_dim a multiple of 8


def _one_node(k_scale, v_scale, *, bits: int = 8) -> ort.InferenceSession:
    """GroupQueryAttention with an int8 (or 4-bit, uint8) per-channel cache, as the pass writes it (scales as
    initializers)."""
    E = H * D
    cache, row = (TensorProto.INT8, D) if bits == 8 else (TensorProto.UINT8, D // 2)
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [B, "S", E]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, [B, "S", E]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, [B, "S", E]),
        helper.make_tensor_value_info("past_k", cache, [B, H, "C", row]),
        helper.make_tensor_value_info("past_v", cache, [B, H, "C", row]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [B]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []),
        helper.make_tensor_value_info("bias", TensorProto.FLOAT, [B, 1, "S", "T"]),
    ]
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total", "", "", "", "bias", "", "k_scale", "v_scale"],
        ["y", "present_k", "present_v"],
        domain="com.microsoft",
        num_heads=H,
        kv_num_heads=H,
        kv_cache_bit_width=bits,
        k_quant_type="PER_CHANNEL",
        v_quant_type="PER_CHANNEL",
    )
    outputs = [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("present_k", cache, None),
        helper.make_tensor_value_info("present_v", cache, None),
    ]
    scales = [onnx.numpy_helper.from_array(k_scale, "k_scale"), onnx.numpy_helper.from_array(v_scale, "v_scale")]
    graph = helper.make_graph([node], "gqa", inputs, outputs, initializer=scales)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _attention(q, k, v, bias):
    """Reference attention on [B, T, H*D] inputs (scale 1/√D), in float64."""
    split = [x.reshape(B, x.shape[1], H, D).transpose(0, 2, 1, 3).astype(np.float64) for x in (q, k, v)]
    scores = split[0] @ split[1].transpose(0, 1, 3, 2) / np.sqrt(D) + bias
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return (weights @ split[2]).transpose(0, 2, 1, 3).reshape(B, -1, H * D)


@pytest.mark.parametrize("fmt", [INT8, INT4], ids=["int8", "int4"])
def test_the_kernel_stores_rounded_steps_in_place_and_reads_them_back(fmt):
    """onnxruntime's CPU kernel, one buffer bound as past and present: each new K/V value stored as
    clip(round(x / scale), -128, 127) per channel (4 bits: clip to [-8, 7], stored + 8, two a byte, low nibble
    first), attention on scale × the stored steps (prompt and decode)."""
    rng = np.random.default_rng(0)
    low, high = (-128, 127) if fmt.bit_width == 8 else (-8, 7)
    spread = 0.02 if fmt.bit_width == 8 else 0.3  # steps that clip some values and keep most
    k_scale = rng.uniform(spread / 2, spread * 1.5, (1, H, 1, D)).astype(np.float32)
    v_scale = rng.uniform(spread / 2, spread * 1.5, (1, H, 1, D)).astype(np.float32)
    session = _one_node(k_scale, v_scale, bits=fmt.bit_width)
    capacity = 12
    buffers = [np.zeros((B, H, capacity, D // fmt.values_per_byte), np.dtype(fmt.dtype)) for _ in range(2)]
    values = [ort.OrtValue.ortvalue_from_numpy(b) for b in buffers]
    keys, vals, total = [], [], 0
    for length in (5, 1, 1):
        q, k, v = (rng.standard_normal((B, length, H * D)).astype(np.float32) for _ in range(3))
        total += length
        keys.append(k)
        vals.append(v)
        bias = np.triu(np.full((length, total), -1e4, np.float32), k=total - length + 1)[None, None]
        binding = session.io_binding()
        for name, array in (("q", q), ("k", k), ("v", v), ("bias", np.repeat(bias, B, 0))):
            binding.bind_cpu_input(name, array)
        binding.bind_cpu_input("seqlens_k", np.full(B, total - 1, np.int32))
        binding.bind_cpu_input("total", np.array(total, np.int32))
        binding.bind_ortvalue_input("past_k", values[0])
        binding.bind_ortvalue_input("past_v", values[1])
        binding.bind_output("y", "cpu")
        binding.bind_ortvalue_output("present_k", values[0])
        binding.bind_ortvalue_output("present_v", values[1])
        session.run_with_iobinding(binding)
        steps = []
        for x, scale in ((np.concatenate(keys, 1), k_scale), (np.concatenate(vals, 1), v_scale)):
            heads = x.reshape(B, total, H, D).transpose(0, 2, 1, 3)
            steps.append(np.clip(np.round(heads / scale), low, high))
        for buffer, expected_steps in zip(buffers, steps):  # in place: the bound buffer holds them
            np.testing.assert_array_equal(steps_of(buffer[:, :, :total], fmt), expected_steps)
        dequantized = [
            (s * scale).transpose(0, 2, 1, 3).reshape(B, total, -1) for s, scale in zip(steps, (k_scale, v_scale))
        ]
        expected = _attention(q, *dequantized, np.repeat(bias, B, 0))
        assert np.abs(binding.get_outputs()[0].numpy() - expected).max() < 1e-5


@pytest.fixture(scope="module")
def int8_cache(trained_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("kv") / "int8"
    return export(str(trained_checkpoint), out, options=ExportOptions(fusion="ort-shared-kv", kv_cache="int8"))


@pytest.fixture(scope="module")
def float_cache(trained_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("kv") / "float"
    return export(str(trained_checkpoint), out, options=ExportOptions(fusion="ort-shared-kv")).folder


def test_the_export_writes_an_int8_cache_with_calibrated_scales(int8_cache):
    assert int8_cache.check.passed, int8_cache.check.summary()
    assert int8_cache.check.gates == dict(INT8.gates)
    manifest = json.loads((int8_cache.folder / "gpt2onnx.json").read_text())
    record = manifest["kv_cache_quantization"]
    assert (manifest["kv_cache"], record["dtype"], record["quant_type"]) == ("shared", "int8", "PER_CHANNEL")
    assert "module docstrings" in record["calibration"] and record["largest_key"] > 0
    assert manifest["options"]["kv_cache"] == "int8"
    dtypes = {t["name"]: t["dtype"] for t in manifest["io"]["inputs"] + manifest["io"]["outputs"]}
    assert dtypes["past_key_values.1.value"] == dtypes["present.0.key"] == "int8" and dtypes["logits"] == "float32"
    graph = onnx.load(str(int8_cache.folder / "model.onnx"))
    scales = {i.name: onnx.numpy_helper.to_array(i) for i in graph.graph.initializer if i.name.startswith("kv_cache.")}
    assert len(scales) == 4 and all(s.shape == (1, 4, 1, 16) and (s > 0).all() for s in scales.values())
    for node in (n for n in graph.graph.node if n.op_type == "GroupQueryAttention"):
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert (attributes["kv_cache_bit_width"], attributes["k_quant_type"]) == (8, b"PER_CHANNEL")
        assert node.input[12] in scales and node.input[13] in scales
    facts = open_folder(int8_cache.folder).facts
    assert (facts.dtype, facts.kv_dtype) == ("float32", "int8")


def test_the_decoder_holds_int8_buffers_and_generates(int8_cache, float_cache):
    decoder = open_decoder(open_folder(int8_cache.folder), ProviderConfig())
    float_decoder = open_decoder(open_folder(float_cache), ProviderConfig())
    assert isinstance(decoder, SharedCacheDecoder) and decoder.kv_dtype == np.int8
    assert decoder.cache_bytes(8, 100) * 4 == float_decoder.cache_bytes(8, 100)
    ids, mask = left_padded_batch(500, batch=3, length=9, seed=2)
    tokens = decode(decoder, ids, mask, max_new_tokens=10).tokens
    assert decoder._buffers[0].dtype == np.int8 and decoder._buffers[0].shape == (3, 4, 19, 16)
    reference = decode(float_decoder, ids, mask, max_new_tokens=10).tokens
    assert (tokens == reference).mean() > 0.9


def test_parity_holds_the_int8_cache_to_its_gates(int8_cache):
    report = parity(int8_cache.folder, cases=4, seed=1, max_batch=4)
    assert report.passed, report.failures
    assert report.gates == dict(INT8.gates) and report.measured.kl.mean < INT8.gates["kl_mean"] / 4
    assert len(report.kv_path.checks) == 3 and not report.kv_path.failures


def test_optimize_quantizes_the_cache_of_a_float_folder(float_cache, tmp_path):
    result = optimize(float_cache, tmp_path / "int8", kv_cache="int8")
    assert result.check.passed and result.manifest.kv_cache_quantization.dtype == "int8"
    assert result.manifest.io.inputs[3].dtype == "int8"
    refused = runner.invoke(
        app, ["optimize", str(tmp_path / "int8"), "--out", str(tmp_path / "again"), "--dtype", "fp16"]
    )
    assert_one_line_error(refused, "stores the K/V cache as int8: optimize the float-cache folder it was made from")


def test_bench_at_a_past_on_the_int8_cache(int8_cache, tmp_path):
    args = ["bench", str(int8_cache.folder), "--batch", "1,2", "--prompt-len", "4", "--new-tokens", "3"]
    result = runner.invoke(
        app, [*args, "--warmup", "0", "--repeat", "1", "--past", "64", "--json", str(tmp_path / "b")]
    )
    assert result.exit_code == 0, result.output
    assert len(json.loads((tmp_path / "b").read_text())["runs"]) == 2


@pytest.mark.parametrize(
    "options, message",
    [
        (["--fusion", "ort"], "but profile ort (--fusion ort) writes a new float cache each step (concatenated, which"),
        (["--fusion", "none"], "quantizes it, but profile none (--fusion none) writes a new float cache each step"),
        (["--fusion", "ort-shared-kv", "--dtype", "fp16"], "takes fp32 activations"),
        (["--fusion", "ort-shared-kv", "--tolerance", "1e-3"], "is checked by its gates"),
    ],
)
def test_refused_in_one_line(options, message, tmp_path):
    args = ["export", "--model", "tiny", "--random-init", "--out", str(tmp_path / "x"), "--kv-cache", "int8"]
    result = runner.invoke(app, [*args, *options])
    assert result.exit_code == 2
    assert_one_line_error(result, message)


def test_an_unknown_cache_type_is_refused():
    with pytest.raises(BadInput, match="unknown --kv-cache 'int3': choose one of float, int8"):
        ExportOptions(fusion="ort-shared-kv", kv_cache="int3")
    with pytest.raises(BadInput, match="which no attention op quantizes"):
        optimize("nowhere", "elsewhere", fusion="ort", quantization=QuantizeOptions(), kv_cache="int8")


@pytest.mark.parametrize("factor", [1 / 16, 64.0])
def test_damaged_scales_fail_the_gates(trained_checkpoint, tmp_path, monkeypatch, factor):
    """Scales 16× too small (most values clipped) or 64× too large (2 steps per channel) fail the check, and
    nothing is written. (16× too large, about 4 bits: mean KL 1.4e-4 on the trained test model, at the gate.)"""
    from gpt2onnx.errors import CheckFailed
    from gpt2onnx.passes import cache_quantization

    honest = cache_quantization._scale
    monkeypatch.setattr(cache_quantization, "_scale", lambda ranges, fmt: honest(ranges, fmt) * np.float32(factor))
    with pytest.raises(CheckFailed, match="mean KL divergence|top-1 agreement"):
        export(str(trained_checkpoint), tmp_path / "x", options=ExportOptions(fusion="ort-shared-kv", kv_cache="int8"))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "target, message",
    [
        ("transformers-js", "allocates a float K/V cache itself"),
        ("genai", "has not been checked on a quantized K/V cache"),
    ],
)
def test_targets_that_feed_a_float_cache_refuse_it(int8_cache, tmp_path, target, message):
    result = runner.invoke(app, ["deploy", str(int8_cache.folder), "--target", target, "--out", str(tmp_path / "d")])
    assert_one_line_error(result, message)


def test_int4_weights_with_an_int8_cache(float_cache, tmp_path):
    """int4 weights and an int8 cache: the scales calibrated on the int4 graph, the file judged by int4's gates and
    file check, the cache included (its relative logits error stays far below the file gate's 5 %)."""
    result = optimize(float_cache, tmp_path / "w4kv8", quantization=QuantizeOptions("int4"), kv_cache="int8")
    assert result.check.passed, result.check.summary()
    assert result.manifest.precision == "int4" and result.manifest.kv_cache_quantization.dtype == "int8"
    assert result.check.rounded.measured.relative_error.mean < 0.01
    report = parity(tmp_path / "w4kv8", cases=3, seed=2, max_batch=3)
    assert report.passed, report.failures


def test_openvino_refuses_an_int8_cache(int8_cache):
    result = runner.invoke(app, ["generate", str(int8_cache.folder), "--ids", "1,2", "--runtime", "openvino"])
    assert result.exit_code == 3
    assert_one_line_error(result, "does not read a quantized K/V cache as onnxruntime does")


def test_a_4_bit_cache_packs_two_values_a_byte(float_cache, tmp_path):
    """--kv-cache int4: uint8 past and present of head_dim / 2 bytes a row (the contract and the manifest say so),
    buffers of that shape, step() unpacking them, parity within the 4-bit cache's gates."""
    result = optimize(float_cache, tmp_path / "int4", kv_cache="int4")
    assert result.check.passed, result.check.summary()
    past = result.manifest.io.inputs[3]
    assert (past.dtype, past.dims[3], result.manifest.kv_cache_quantization.dtype) == ("uint8", 8, "uint8")
    decoder = open_decoder(open_folder(tmp_path / "int4"), ProviderConfig())
    assert (decoder.head_dim, decoder.kv_dtype) == (16, np.uint8)
    assert decoder.cache_bytes(8, 100) * 8 == open_decoder(open_folder(float_cache), ProviderConfig()).cache_bytes(
        8, 100
    )
    ids, mask = left_padded_batch(500, batch=2, length=6, seed=3)
    decoder.empty_past(2, capacity=6)
    _, presents = decoder.step(ids, mask, np.where(mask == 0, 1, np.cumsum(mask, -1) - 1))
    assert decoder._buffers[0].shape == (2, 4, 6, 8) and presents[0].shape == (2, 4, 6, 16)
    report = parity(tmp_path / "int4", cases=3, seed=1, max_batch=3)
    assert report.passed and report.gates == dict(INT4.gates), report.failures


def test_quantized_weights_over_a_quantized_cache_add_the_two_budgets():
    """int8-weights' gates over a 4-bit cache: each quality gate the weights' budget plus the cache's (the
    near-lossless gates alone refused a sound int8-weights file over an int4 cache: KL 2.0e-4, top-1 97.5 %);
    a --gate keeps its value; a float cache and an exact precision are left as they are."""
    from gpt2onnx.verify.gates import tolerances_for, with_cache

    weights = tolerances_for("int8-weights")
    combined = with_cache("int8-weights", "uint8", weights)
    assert combined["kl_mean"] == pytest.approx(1e-4 + 5e-3) and combined["top1"] == pytest.approx(0.98 + 0.9 - 1)
    assert with_cache("int8-weights", "uint8", weights, {"kl_mean": 1e-4})["kl_mean"] == weights["kl_mean"]
    assert with_cache("int8-weights", "float32", weights) == weights
    assert with_cache("float32", "int8", tolerances_for("float32")) == tolerances_for("float32")
