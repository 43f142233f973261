"""Providers: real ONNX Runtime sessions, the fallback check (whole sessions and single nodes), the kernel facts, the
mapping of onnxruntime's provider errors, and the TensorRT options and profile."""

import numpy as np
import pytest

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.graph import load_graph
from gpt2onnx.errors import Gpt2OnnxError, RuntimeUnavailable
from gpt2onnx.pytorch.checkpoint import load_checkpoint
from gpt2onnx.pytorch.reference import reference_model
from gpt2onnx.runtimes.decoder import OnnxDecoder, open_decoder
from gpt2onnx.runtimes.providers import (
    TF32_OVERRIDE,
    DecoderShape,
    ProviderConfig,
    create_session,
    host_side_nodes,
    provider_failure,
    provider_options,
    read_placement,
    tensorrt_profile,
    unsupported_nodes,
    working_providers,
)
from gpt2onnx.verify.lockstep import compare_decoder, greedy, left_padded_batch, reference_greedy

WORKING = working_providers()


def test_cpu_is_always_there():
    assert "cpu" in WORKING


def test_cpu_session_options(tiny_export):
    session = create_session(tiny_export / "model.onnx", ProviderConfig(threads=1, spinning=False))
    assert session.get_providers() == ["CPUExecutionProvider"]
    options = session.get_session_options()
    assert options.intra_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


@pytest.mark.parametrize("name", ["cuda", "tensorrt"])
def test_unloadable_provider_is_a_clear_error(tiny_export, name):
    if name in WORKING:
        pytest.skip(f"{name} loads on this machine")
    with pytest.raises(Gpt2OnnxError) as err:
        open_decoder(open_folder(tiny_export), ProviderConfig(name=name))
    message = str(err.value)
    assert f"provider '{name}'" in message and "could not be used" in message
    assert "providers that work here: cpu" in message and "--allow-fallback" in message and "\n" not in message


@pytest.mark.parametrize("name", ["cuda", "tensorrt"])
def test_allow_fallback_runs_on_what_loads(tiny_export, name, caplog):
    if name in WORKING:
        pytest.skip(f"{name} loads on this machine")
    decoder = open_decoder(open_folder(tiny_export), ProviderConfig(name=name, allow_fallback=True))
    assert decoder.provider == "cpu" and decoder.dummy_past == 0
    assert "could not be used" in caplog.text


def test_unknown_provider(tiny_export):
    with pytest.raises(Gpt2OnnxError, match="unknown provider 'rocm': choose one of cpu, cuda, tensorrt"):
        create_session(tiny_export / "model.onnx", ProviderConfig(name="rocm"))


def _shape(n_layer=2, n_positions=256):
    names = tuple(f"past_key_values.{i}.{k}" for i in range(n_layer) for k in ("key", "value"))
    return DecoderShape(names, n_head=12, head_dim=64, n_positions=n_positions)


def _parse_profile(text):
    return {
        name: tuple(int(d) for d in dims.split("x")) for name, dims in (item.split(":") for item in text.split(","))
    }


def test_tensorrt_profile_covers_prompt_and_decode_without_zero_dims():
    profile = tensorrt_profile(_shape(), max_batch=4)
    low, opt, high = (_parse_profile(profile[f"trt_profile_{k}_shapes"]) for k in ("min", "opt", "max"))
    assert set(low) == set(opt) == set(high) == {"input_ids", "attention_mask", "position_ids", *_shape().past_names}
    for name in low:
        assert all(d >= 1 for d in low[name]), f"{name}: TensorRT rejects zero-sized dims"
        assert all(a <= b <= c for a, b, c in zip(low[name], opt[name], high[name])), name
    # prompt step: batch up to max_batch, up to the whole context, past = the one masked dummy slot
    assert high["input_ids"] == (4, 256) and low["past_key_values.0.key"] == (1, 12, 1, 64)
    # decode steps: one token, past up to the whole context (plus the dummy slot)
    assert low["input_ids"] == (1, 1) and high["past_key_values.1.value"] == (4, 12, 257, 64)
    assert high["attention_mask"][1] == high["past_key_values.0.key"][2] + high["input_ids"][1]
    assert opt["input_ids"] == (1, 1) and opt["past_key_values.0.key"][2] == 1 + 128


def test_tensorrt_provider_options(tmp_path):
    model = tmp_path / "m" / "model.onnx"
    providers = provider_options(
        ProviderConfig(name="tensorrt", trt_fp16=True, max_batch=2), model_path=model, shape=_shape()
    )
    (trt_name, trt), (cuda_name, cuda), cpu = providers
    assert (trt_name, cuda_name, cpu) == ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
    assert cuda == {"device_id": 0, "use_tf32": 0}
    assert trt["trt_fp16_enable"] is True and trt["trt_engine_cache_enable"] and trt["trt_timing_cache_enable"]
    assert trt["trt_layer_norm_fp32_fallback"] is True  # fp16 engines: LayerNorm statistics in fp32 (outliers)
    assert trt["trt_engine_cache_path"] == str(tmp_path / "m" / "trt_cache") == trt["trt_timing_cache_path"]
    assert _parse_profile(trt["trt_profile_max_shapes"])["input_ids"][0] == 2
    custom = provider_options(
        ProviderConfig(name="tensorrt", trt_cache_dir=str(tmp_path / "c")), model_path=model, shape=None
    )
    assert custom[0][1]["trt_engine_cache_path"] == str(tmp_path / "c") and "trt_profile_min_shapes" not in custom[0][1]
    assert custom[0][1]["trt_layer_norm_fp32_fallback"] is False
    with pytest.raises(Gpt2OnnxError, match="max batch must be at least 1"):
        tensorrt_profile(_shape(), max_batch=0)


def test_cuda_provider_options_turn_tf32_off_unless_asked(tmp_path):
    """onnxruntime's CUDA provider computes fp32 GEMMs in TF32 by default (use_tf32 1): fp32 parity needs it off."""
    providers = provider_options(
        ProviderConfig(name="cuda", device_id=1), model_path=tmp_path / "model.onnx", shape=None
    )
    assert providers == [("CUDAExecutionProvider", {"device_id": 1, "use_tf32": 0}), "CPUExecutionProvider"]
    fast = provider_options(ProviderConfig(name="cuda", tf32=True), model_path=tmp_path / "model.onnx", shape=None)
    assert fast[0] == ("CUDAExecutionProvider", {"device_id": 0, "use_tf32": 1})
    trt = provider_options(ProviderConfig(name="tensorrt", tf32=True), model_path=tmp_path / "m.onnx", shape=None)
    assert trt[1] == fast[0]  # the nodes TensorRT leaves to CUDA get the same setting
    assert trt[0][1]["trt_engine_cache_path"] == str(tmp_path / "trt_cache" / "tf32")  # TF32 engines kept apart
    with pytest.raises(Gpt2OnnxError, match="--tf32 applies to the cuda and tensorrt providers"):
        ProviderConfig(name="cpu", tf32=True)


def test_dummy_past_slot_used_for_tensorrt_gives_the_same_results(tiny_folder, tiny_export):
    """The TensorRT path (a masked dummy past slot instead of an empty past), run for real on the CPU provider."""
    decoder = OnnxDecoder(create_session(tiny_export / "model.onnx", ProviderConfig()), n_positions=128)
    decoder.dummy_past = 1
    assert decoder.empty_past(2)[0].shape == (2, 4, 1, 16)
    reference = reference_model(load_checkpoint(str(tiny_folder)))
    ids, mask = left_padded_batch(1000, batch=3, length=7, seed=5)
    assert compare_decoder(decoder, reference, ids, mask, decode_steps=3, tolerance=1e-4).passed
    np.testing.assert_array_equal(greedy(decoder, ids, mask, 8), reference_greedy(reference, ids, mask, 8))


# -- kernel facts, node placement, provider errors ----------------------------------------------------------------
@pytest.fixture(scope="module")
def variants(tiny_folder, tmp_path_factory):
    """The tiny checkpoint as an int8 folder and as an ort-fused one (com.microsoft ops), not validated: cheap."""
    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.precisions.quantize_options import QuantizeOptions

    root = tmp_path_factory.mktemp("provider-variants")
    options = {
        "int8": ExportOptions(quantization=QuantizeOptions("int8"), validate=False),
        "ort": ExportOptions(fusion="ort", validate=False),
    }
    return {name: export(str(tiny_folder), root / name, options=o).folder for name, o in options.items()}


def test_cpu_provider_reports_every_node_on_the_cpu(tiny_export):
    """The placement comes from onnxruntime's own record, into the decoder and the export's check (manifest)."""
    import json

    decoder = open_decoder(open_folder(tiny_export), ProviderConfig())
    placement = decoder.placement
    assert placement.reported and placement.asked == "cpu" and list(placement.nodes) == ["CPUExecutionProvider"]
    assert placement.nodes["CPUExecutionProvider"] > 20 and not placement.fallback and not placement.cpu_ops
    recorded = json.loads((tiny_export / "gpt2onnx.json").read_text())["parity"]["placement"]
    assert recorded["nodes"] == placement.nodes  # the check at export ran on the same graph, on the CPU


def test_int8_on_cuda_is_refused_before_any_session(variants, monkeypatch):
    """onnxruntime's CUDA kernel table: MatMulInteger with int8 activations only (ours are uint8, quantized per
    token). Refused from the graph alone, naming the ops; no session is made (none would fail here: it would fall
    back to the CPU)."""
    import gpt2onnx.runtimes.providers as providers

    made = []
    monkeypatch.setattr(providers.ort, "InferenceSession", lambda *a, **k: made.append(a))
    with pytest.raises(RuntimeUnavailable) as err:
        open_decoder(open_folder(variants["int8"]), ProviderConfig(name="cuda"))
    message = str(err.value)
    assert "MatMulInteger ×" in message and "uint8" in message  # its activations: per-token uint8 (a Cast's)
    assert "--allow-fallback" in message and "\n" not in message and made == []
    assert unsupported_nodes(load_graph(variants["ort"] / "model.onnx"), "cuda") == {}  # fp32 fused: all on CUDA


def test_tensorrt_refuses_contrib_ops_in_one_line(variants):
    with pytest.raises(RuntimeUnavailable) as err:
        open_decoder(open_folder(variants["ort"]), ProviderConfig(name="tensorrt"))
    message = str(err.value)
    assert "MultiHeadAttention" in message and "SkipLayerNormalization" in message and "FastGelu" in message
    assert "--fusion tensorrt" in message and "--fusion portable" in message and "\n" not in message


def test_compute_nodes_on_the_cpu_are_told_from_shape_arithmetic(variants):
    """A real onnxruntime placement record, read as if CUDA had been asked for and every node had stayed on the CPU:
    the weights' matmuls and the int8 ops are compute; Shape and the mask built from attention_mask are not."""
    graph = load_graph(variants["int8"] / "model.onnx")
    host = host_side_nodes(graph)
    by_name = {n.name: n for n in graph.graph.node}
    assert all(by_name[n].op_type not in ("MatMul", "MatMulInteger") for n in host)
    assert any(by_name[n].op_type == "Shape" for n in host) and any(by_name[n].op_type == "Where" for n in host)
    session = create_session(variants["int8"] / "model.onnx", ProviderConfig())
    placement = read_placement(session, ProviderConfig(name="cuda"), host_side=host)
    assert placement.cpu_ops["Shape"] >= 1 and "Shape" not in placement.fallback
    assert placement.fallback["MatMulInteger"] >= 2 and placement.fallback["ReduceMax"] >= 2  # per-token scales
    assert placement.fallback["LayerNormalization"] >= 2 and "compute on the CPU: " in placement.summary()
    assert sum(placement.fallback.values()) < sum(placement.cpu_ops.values())


def test_a_provider_error_from_onnxruntime_exits_3(tiny_export, monkeypatch, tmp_path):
    """A real onnxruntime failure that names a provider, provoked here without a GPU: a session asked for CUDA alone
    with CPU fallback disabled (onnxruntime: "fallback to CPU EP has been explicitly disabled"). It must reach the
    user as RuntimeUnavailable (exit code 3) in one line, with onnxruntime's words, not as an invalid model."""
    from typer.testing import CliRunner

    import gpt2onnx.runtimes.providers as providers
    from gpt2onnx.cli import app

    real_options = providers.session_options

    def strict(config):
        options = real_options(config)
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        return options

    monkeypatch.setattr(providers, "session_options", strict)
    monkeypatch.setattr(providers, "provider_options", lambda config, **_: ["CUDAExecutionProvider"])
    with pytest.raises(RuntimeUnavailable, match=r"provider 'cuda' failed to create a session .*CPU EP"):
        create_session(tiny_export / "model.onnx", ProviderConfig(name="cuda"))
    result = CliRunner().invoke(app, ["generate", str(tiny_export), "--ids", "1,2", "--provider", "cuda"])
    assert result.exit_code == 3, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: provider 'cuda' failed") and "onnxruntime FAIL" in lines[0]


def test_epfail_is_a_provider_failure_on_every_provider():
    """onnxruntime's EPFail derives from Exception, not RuntimeError: it is matched by its type."""
    from onnxruntime.capi.onnxruntime_pybind11_state import EPFail

    err = EPFail("[ONNXRuntimeError] : 11 : EP_FAIL : User needs to provide all the dynamic shape inputs")
    assert not isinstance(err, RuntimeError)
    failure = provider_failure(err, "tensorrt", doing="to create a session")
    assert isinstance(failure, RuntimeUnavailable) and failure.exit_code == 3
    assert str(failure).endswith("User needs to provide all the dynamic shape inputs (onnxruntime EP_FAIL)")
    assert provider_failure(ValueError("Invalid model: bad graph"), "cuda", doing="x") is None


def test_tensorrt_tf32_switch_is_restored(tiny_export):
    """Without --tf32, NVIDIA_TF32_OVERRIDE=0 is set only while a TensorRT session is made, then restored."""
    import os

    before = os.environ.get(TF32_OVERRIDE)
    with pytest.raises(Gpt2OnnxError):
        create_session(
            tiny_export / "model.onnx", ProviderConfig(name="tensorrt", trt_cache_dir=str(tiny_export.parent / "c"))
        )
    assert os.environ.get(TF32_OVERRIDE) == before


def test_a_bench_that_fell_back_records_the_cpu_it_ran_on(tiny_export):
    """issue 37: bench --provider cuda --allow-fallback on a machine where cuda cannot load runs on the CPU, and
    its machine record says so: no GPU line (it said 'GPU 0 (nvidia-smi not found…)')."""
    from gpt2onnx.benchmarks.bench import bench
    from gpt2onnx.benchmarks.timing import BenchConfig

    if "cuda" in WORKING:
        pytest.skip("cuda loads on this machine")
    config = BenchConfig(batches=(1,), prompt_len=4, new_tokens=3, warmup=0, repeat=1)
    report = bench([tiny_export], provider=ProviderConfig(name="cuda", allow_fallback=True), config=config)
    assert report.models[0].provider == "cpu"
    assert report.machine.gpu is None and "gpu" not in report.machine.as_dict()
