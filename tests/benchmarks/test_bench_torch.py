"""The PyTorch baseline of bench on the device the ONNX side uses: device choice, synchronization, dtype.
Only the CPU paths run here; the GPU ones run in scripts/gpu_check.sh."""

import numpy as np
import torch

from gpt2onnx.benchmarks.bench import bench_torch, synchronizer, torch_device
from gpt2onnx.benchmarks.timing import BenchConfig
from gpt2onnx.pytorch.checkpoint import load_checkpoint
from gpt2onnx.pytorch.reference import model_device, reference_model, reference_step
from gpt2onnx.runtimes.providers import ProviderConfig
from gpt2onnx.verify.lockstep import OnnxReference


def test_the_baseline_goes_to_the_gpu_the_provider_uses_when_torch_sees_it(monkeypatch):
    assert torch_device(ProviderConfig()) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert torch_device(ProviderConfig(name="cuda")) == "cpu"  # a CPU-only torch beside onnxruntime-gpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert torch_device(ProviderConfig(name="cuda", device_id=1)) == "cuda:1"
    assert torch_device(ProviderConfig(name="tensorrt")) == "cuda:0"
    assert torch_device(ProviderConfig(name="cpu")) == "cpu"


def test_timings_synchronize_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    synchronizer("cpu")()
    assert calls == []
    synchronizer("cuda:1")()
    assert calls == [torch.device("cuda:1")]


def test_reference_model_moves_and_casts_and_steps_where_it_is(tiny_folder):
    ckpt = load_checkpoint(str(tiny_folder))
    exact = reference_model(ckpt)
    wide = reference_model(ckpt, device="cpu", dtype=torch.float64)
    assert next(wide.parameters()).dtype == torch.float64 and model_device(wide) == torch.device("cpu")
    assert wide.lm_head.weight is wide.transformer.wte.weight  # still tied after the cast
    assert next(exact.parameters()).dtype == torch.float32  # the checkpoint's tensors were not cast in place
    ids = np.array([[5, 6, 7]]), np.ones((1, 3), np.int64), np.array([[0, 1, 2]])
    a, _ = reference_step(exact, *ids)
    b, _ = reference_step(wide, *ids)
    assert a.dtype == b.dtype == np.float32 and np.abs(a - b).max() < 1e-4
    assert model_device(OnnxReference(decoder=None)) == torch.device("cpu")  # a stand-in without parameters


def test_bench_torch_records_where_and_in_what_it_ran(tiny_folder):
    ref = reference_model(load_checkpoint(str(tiny_folder)))
    stats = bench_torch(
        ref, BenchConfig(batches=(2,), prompt_len=4, new_tokens=3, warmup=0, repeat=1), 2, vocab_size=1000
    )
    assert stats.as_dict()["extra"] == {"device": "cpu", "dtype": "float32"} and stats.peak_device_bytes is None
    assert [p for p, _ in stats.decode_ms_by_past] == [4, 5]


def test_the_baseline_takes_the_sessions_tf32_setting_and_gives_it_back():
    from gpt2onnx.benchmarks.bench import matmul_tf32

    before = torch.get_float32_matmul_precision()
    with matmul_tf32(True):
        assert torch.backends.cuda.matmul.allow_tf32  # what bench records for PyTorch's runs
    with matmul_tf32(False):
        assert not torch.backends.cuda.matmul.allow_tf32
    assert torch.get_float32_matmul_precision() == before
