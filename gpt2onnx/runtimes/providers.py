"""Execution providers: cpu, cuda, tensorrt; their options, and sessions that are what they claim to be.

ONNX Runtime silently falls back to the CPU when CUDA or TensorRT cannot load (and still lists them in
``get_available_providers()``). Only ``session.get_providers()`` tells the truth, so every session is checked
against what was asked for, and a fallback is an error unless the caller allows it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import onnxruntime as ort

from gpt2onnx.artifact.contract import DecoderShape
from gpt2onnx.errors import BadInput, ContractError, RuntimeUnavailable

log = logging.getLogger(__name__)

PROVIDERS = ("cpu", "cuda", "tensorrt")
ORT_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}
# The K/V cache lives here between decode steps (IO binding): ONNX Runtime's device names.
DEVICE_TYPES = {"cpu": "cpu", "cuda": "cuda", "tensorrt": "cuda"}
TRT_CACHE_DIR = "trt_cache"
# TensorRT rejects zero-sized dimensions, so the prompt step runs with a past of this many masked slots.
TRT_DUMMY_PAST = 1


@dataclass(frozen=True)
class ProviderConfig:
    name: str = "cpu"
    threads: int | None = None  # cpu: intra-op threads; None = all cores
    spinning: bool = True  # cpu: idle worker threads spin (lower latency, busier cores)
    device_id: int = 0  # cuda / tensorrt
    trt_fp16: bool = False  # tensorrt: allow fp16 kernels
    trt_cache_dir: str | None = None  # tensorrt: engine and timing caches; None = <model folder>/trt_cache
    max_batch: int = 8  # tensorrt: largest batch the optimization profile covers
    allow_fallback: bool = False  # accept a session that fell back to another provider

    def __post_init__(self) -> None:
        self.check()  # an invalid one cannot be built

    def check(self) -> "ProviderConfig":
        """Refuse options out of range, and options the chosen provider would ignore."""
        check_provider(self.name)
        if self.threads is not None and not 1 <= self.threads <= MAX_THREADS:
            raise BadInput(
                f"threads must be 1 to {MAX_THREADS} (this machine has {os.cpu_count()} cores), got {self.threads}"
            )
        if self.name != "cpu" and self.threads is not None:
            raise BadInput(f"threads apply to the cpu provider, not '{self.name}': drop the thread count")
        if self.device_id < 0:
            raise BadInput(f"device id must be 0 or more, got {self.device_id}")
        if not 1 <= self.max_batch <= 4096:
            raise BadInput(f"max batch must be 1 to 4096, got {self.max_batch}")
        if self.name != "tensorrt":
            ignored = [n for n, on in (("trt_fp16", self.trt_fp16), ("trt_cache_dir", self.trt_cache_dir)) if on]
            if ignored:
                raise BadInput(
                    f"{', '.join(ignored)} apply to the tensorrt provider only, not '{self.name}': drop them"
                )
        return self

    def as_dict(self) -> dict:
        return asdict(self)


MAX_THREADS = 256


def check_provider(name: str) -> None:
    if name not in PROVIDERS:
        raise BadInput(f"unknown provider '{name}': choose one of {', '.join(PROVIDERS)}")


def tensorrt_profile(shape: DecoderShape, *, max_batch: int) -> dict[str, str]:
    """One optimization profile that covers the prompt step and every decode step.

    The runner gives the prompt step a past of TRT_DUMMY_PAST masked slots instead of an empty one, so the past
    length is at least 1 everywhere; the mask grows by that slot. opt is a decode step at half the context, the
    shape that dominates generation time.
    """
    if max_batch < 1:
        raise BadInput(f"max batch must be at least 1, got {max_batch}")
    ctx, dummy = shape.n_positions, TRT_DUMMY_PAST
    # (batch, sequence, past) at the profile's min, opt and max
    points = {"min": (1, 1, dummy), "opt": (1, 1, dummy + ctx // 2), "max": (max_batch, ctx, dummy + ctx)}
    profile = {}
    for key, (batch, seq, past) in points.items():
        dims = {"input_ids": (batch, seq), "attention_mask": (batch, past + seq)}
        if shape.uses_position_ids:
            dims["position_ids"] = (batch, seq)
        for name in shape.past_names:
            dims[name] = (batch, shape.n_head, past, shape.head_dim)
        profile[f"trt_profile_{key}_shapes"] = ",".join(f"{n}:{'x'.join(map(str, d))}" for n, d in dims.items())
    return profile


def provider_options(config: ProviderConfig, *, model_path: Path, shape: DecoderShape | None) -> list:
    """The providers list for InferenceSession: the one asked for first, then its fallbacks."""
    check_provider(config.name)
    if config.name == "cpu":
        return ["CPUExecutionProvider"]
    cuda = ("CUDAExecutionProvider", {"device_id": config.device_id})
    if config.name == "cuda":
        return [cuda, "CPUExecutionProvider"]
    cache_dir = Path(config.trt_cache_dir) if config.trt_cache_dir else Path(model_path).parent / TRT_CACHE_DIR
    trt = {
        "device_id": config.device_id,
        "trt_fp16_enable": config.trt_fp16,
        # fp16 engines compute LayerNorm's Pow and ReduceMean in fp32: GPT-2's outlier channels overflow fp16 there
        "trt_layer_norm_fp32_fallback": config.trt_fp16,
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": str(cache_dir),
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": str(cache_dir),
    }
    if shape is not None:
        trt.update(tensorrt_profile(shape, max_batch=config.max_batch))
    # Nodes TensorRT cannot take run on CUDA (not on the CPU), so the cache never leaves the device.
    return [
        ("TensorrtExecutionProvider", trt),
        ("CUDAExecutionProvider", {"device_id": config.device_id}),
        "CPUExecutionProvider",
    ]


def session_options(config: ProviderConfig) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if config.name == "cpu":
        options.intra_op_num_threads = config.threads or os.cpu_count() or 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if config.spinning else "0")
    return options


@contextlib.contextmanager
def _provider_messages_captured():
    """Collect what ONNX Runtime writes while a session is created: its C++ logger (fd 2) and its Python
    layer's 'EP Error' banner (sys.stdout). They hold the reason a provider failed to load; the user gets
    that reason in one line instead of the banners."""
    captured: list[str] = []
    python_text = io.StringIO()
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        try:
            os.dup2(sink.fileno(), 2)
            with contextlib.redirect_stdout(python_text), contextlib.redirect_stderr(python_text):
                yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.append(python_text.getvalue() + "\n" + sink.read().decode(errors="replace"))
            log.debug("onnxruntime said: %s", captured[-1].strip())


def _failure_reason(native_log: str) -> str | None:
    text = re.sub(r"\x1b\[[0-9;]*m", "", native_log)
    patterns = (r"\) (Please install TensorRT[^\n]*?)(?:, make sure|\n)", r"with error: ([^\n]+)", r"(Require [^\n.]+)")
    for pattern in (*patterns, r"\] ([^\n]*Failed[^\n]+)"):
        match = re.search(pattern, text)
        if match:
            return match.group(1).strip()
    return None


def working_providers() -> list[str]:
    """Providers of ours that really load here (a session on a one-node graph, per provider)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    data = model.SerializeToString()
    usable = []
    for name in PROVIDERS:
        if ORT_NAMES[name] not in ort.get_available_providers():
            continue
        with _provider_messages_captured():
            session = ort.InferenceSession(data, providers=[ORT_NAMES[name]])
        if session.get_providers()[0] == ORT_NAMES[name]:
            usable.append(name)
    return usable


def create_session(
    model_path: str | Path, config: ProviderConfig, *, shape: DecoderShape | None = None
) -> ort.InferenceSession:
    """A session on ``config.name``; raises if ONNX Runtime fell back to another provider (unless allowed)."""
    model_path = Path(model_path)
    providers = provider_options(config, model_path=model_path, shape=shape)
    made_cache = None
    if config.name == "tensorrt":
        cache = Path(dict(providers[0][1])["trt_engine_cache_path"])
        if not cache.exists():
            try:
                cache.mkdir(parents=True)
            except OSError as err:
                raise BadInput(
                    f"TensorRT cache folder '{cache}' cannot be created ({err.strerror or err}): choose a writable one"
                ) from None
            made_cache = cache
    wanted = ORT_NAMES[config.name]
    with _provider_messages_captured() as native:
        try:
            session = ort.InferenceSession(str(model_path), sess_options=session_options(config), providers=providers)
        except Exception as err:  # onnxruntime raises its own exception types for invalid models
            _remove_if_empty(made_cache)
            message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ContractError(f"ONNX Runtime cannot load '{model_path}': {message[:300]}") from None
    got = session.get_providers()
    if got[0] != wanted:
        _remove_if_empty(made_cache)
        reason = _failure_reason(native[0] if native else "") or "ONNX Runtime gave no reason"
        message = (
            f"provider '{config.name}' ({wanted}) could not be used: {reason};"
            f" providers that work here: {', '.join(working_providers()) or 'none'}"
        )
        if not config.allow_fallback:
            raise RuntimeUnavailable(message + " (or allow the fallback: --allow-fallback)")
        log.warning("%s; running on %s", message, got[0])
    log.info("session on %s", ", ".join(got))
    return session


def cpu_session(model_path: str | Path, *, threads: int | None = None) -> ort.InferenceSession:
    return create_session(model_path, ProviderConfig(name="cpu", threads=threads))


def _remove_if_empty(folder: Path | None) -> None:
    """A cache folder this run made for a provider that then failed is not left behind."""
    if folder is not None and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def session_provider(session: ort.InferenceSession) -> str:
    """Our name for the provider a session really runs on."""
    first = session.get_providers()[0]
    return next((k for k, v in ORT_NAMES.items() if v == first), first)
