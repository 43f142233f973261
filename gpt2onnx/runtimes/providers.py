"""Execution providers: cpu, cuda, tensorrt; their options, and sessions that are what they claim to be.

ONNX Runtime silently falls back to the CPU when CUDA or TensorRT cannot load (and still lists them in
``get_available_providers()``). Only ``session.get_providers()`` tells the truth, so every session is checked
against what was asked for, and a fallback is an error unless the caller allows it.

A session can also run on the provider asked for and still put single nodes on the CPU (a node with no kernel
there), each with copies from the GPU and back. So a graph is checked against the kernel facts below before any
session is made, and every session's node placement is read back (:class:`Placement`): compute nodes on the CPU
under cuda or tensorrt are an error unless the caller allows the fallback.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import io
import logging
import os
import re
import tempfile
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

from gpt2onnx.artifact.contract import DecoderShape
from gpt2onnx.artifact.graph import all_nodes
from gpt2onnx.artifact.paths import check_output_path
from gpt2onnx.artifact.report import Placement
from gpt2onnx.capabilities import Declared, Lacks, Need
from gpt2onnx.errors import BadInput, ContractError, RuntimeUnavailable
from gpt2onnx.params import param
from gpt2onnx.precisions.all_precisions import PRECISIONS
from gpt2onnx.records import Record
from gpt2onnx.runtimes.heap import release_freed_memory
from gpt2onnx.runtimes.runtime import check_threads, threads_param

log = logging.getLogger(__name__)

PROVIDERS = ("cpu", "cuda", "tensorrt")
ORT_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}
# The K/V cache lives here between decode steps (IO binding): ONNX Runtime's device names.
DEVICE_TYPES = {"cpu": "cpu", "cuda": "cuda", "tensorrt": "cuda"}
TRT_CACHE_DIR = "trt_cache"
# TensorRT rejects zero-sized dimensions, so the prompt step runs with a past of this many masked slots.
TRT_DUMMY_PAST = 1


@dataclass(frozen=True)
class ProviderConfig(Record):
    """The onnxruntime runtime's settings: the execution provider and its options, checked when built."""

    name: str = param("cpu", "cpu, cuda or tensorrt.", flag="--provider", short="-p")
    threads: int | None = threads_param()  # cpu: intra-op threads; None = all cores
    # cpu: idle worker threads spin (lower latency, busier cores)
    spinning: bool = param(True, "cpu: let idle threads spin.", flag="--spin/--no-spin")
    # cpu: onnxruntime's memory arena keeps every buffer a run allocated for the next run (a growing K/V cache
    # leaves it at its peak for good); without it each run's buffers go back to the system when freed
    arena: bool = param(True, "cpu: keep onnxruntime's memory arena.", flag="--arena/--no-arena")
    device_id: int = param(0, "cuda/tensorrt: GPU index.")
    trt_fp16: bool = param(False, "tensorrt: allow fp16 kernels.")
    # tensorrt: engine and timing caches; None = <model folder>/trt_cache
    trt_cache_dir: str | None = param(
        None, "tensorrt: cache \\[default: DIR/trt_cache].", metavar="DIR", writes="folder"
    )
    max_batch: int = param(8, "tensorrt: largest batch.")  # the optimization profile's
    # accept a session that fell back to another provider, or nodes on the CPU
    allow_fallback: bool = param(False, "Run on if nodes leave the provider.")
    # cuda / tensorrt: fp32 matmuls in TF32 (10-bit mantissa): faster, not fp32 parity
    tf32: bool = param(False, "cuda/tensorrt: fp32 matmuls in TF32.")

    def __post_init__(self) -> None:
        self.check()  # an invalid one cannot be built

    def check(self) -> "ProviderConfig":
        """Refuse options out of range, and options the chosen provider would ignore."""
        check_provider(self.name)
        check_threads(self.threads)
        if self.name != "cpu" and self.threads is not None:
            raise BadInput(f"threads apply to the cpu provider, not '{self.name}': drop the thread count")
        if self.device_id < 0:
            raise BadInput(f"device id must be 0 or more, got {self.device_id}")
        if not 1 <= self.max_batch <= 4096:
            raise BadInput(f"max batch must be 1 to 4096, got {self.max_batch}")
        if self.name == "cpu" and self.device_id != 0:
            raise BadInput("device id applies to the cuda and tensorrt providers, not 'cpu': drop it")
        if self.name == "cpu" and self.allow_fallback:
            raise BadInput(
                "--allow-fallback applies to the cuda and tensorrt providers (cpu has nothing to fall back to): drop it"
            )
        if self.name != "cpu" and not self.spinning:
            raise BadInput(f"--no-spin applies to the cpu provider, not '{self.name}': drop it")
        if self.name != "cpu" and not self.arena:
            raise BadInput(f"--no-arena applies to the cpu provider, not '{self.name}': drop it")
        if self.name == "cpu" and self.tf32:
            raise BadInput("--tf32 applies to the cuda and tensorrt providers (the CPU has no TF32): drop it")
        if self.name != "cpu" and self.tf32 and os.environ.get(TF32_OVERRIDE) == "0":
            raise BadInput(f"--tf32 asks for TF32, but {TF32_OVERRIDE}=0 in the environment turns it off: unset it")
        if self.name != "tensorrt":
            ignored = [n for n, on in (("trt_fp16", self.trt_fp16), ("trt_cache_dir", self.trt_cache_dir)) if on]
            if ignored:
                raise BadInput(
                    f"{', '.join(ignored)} apply to the tensorrt provider only, not '{self.name}': drop them"
                )
        if self.trt_cache_dir is not None:  # a folder TensorRT writes into (never replaced)
            check_output_path(Path(self.trt_cache_dir), option="--trt-cache-dir", kind="folder", replaced=False)
        return self


# NVIDIA's libraries read it: 0 turns TF32 off in cuBLAS, cuDNN and TensorRT, whatever the caller asked for.
TF32_OVERRIDE = "NVIDIA_TF32_OVERRIDE"


def check_provider(name: str) -> None:
    if name not in PROVIDERS:
        raise BadInput(f"unknown provider '{name}': choose one of {', '.join(PROVIDERS)}")


# -- kernel facts: what a provider can run, for the ops this project writes --------------------------------------
# Read from onnxruntime's own tables, not measured (no GPU here yet):
# - CUDA: docs/OperatorKernels.md of microsoft/onnxruntime, "Operators implemented by CUDAExecutionProvider" (the
#   table of onnxruntime 1.31, read at commit 001d12d): DynamicQuantizeLinear has no entry; MatMulInteger has
#   T1 = tensor(int8) only, while our int8 graphs feed it DynamicQuantizeLinear's uint8. Every other op we write
#   has a CUDA kernel for our types: MatMulNBits (T1 float, float16, bfloat16), GatherBlockQuantized (int4, uint4,
#   uint8 data), MultiHeadAttention, SkipLayerNormalization, FastGelu, LayerNormalization (float, float16).
#   GroupQueryAttention (float16, bfloat16 only, no attention_bias): its layout declares that it runs on the host
#   (gpt2onnx.layouts.shared). The standard Attention (opsets 23 and 24, past/present) and TensorScatter (24): the
#   CUDA library of onnxruntime 1.31.1 has kernels for both (listed in its wheel, not run); the static layout's
#   stepper binds host buffers (its declared need).
# - TensorRT: onnx-tensorrt's docs/operators.md (the ONNX parser of TensorRT 10) lists MatMulInteger and
#   DynamicQuantizeLinear as unsupported and no com.microsoft op at all; onnxruntime gives such nodes to CUDA,
#   where the facts above apply. TensorRT 10.16 rejects an opset-23 Attention that outputs present K/V (the reason the
#   tensorrt profile stays at opset 17): TENSORRT_KERNEL_FACTS.
MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class KernelFact:
    """A provider's limit on one op: no kernel at all (``types`` empty), or kernels for these element types of
    input ``input_index`` only."""

    reason: str
    input_index: int = 0
    types: tuple[str, ...] = ()


CUDA_KERNEL_FACTS = {
    ("", "DynamicQuantizeLinear"): KernelFact("no CUDA kernel"),
    ("", "MatMulInteger"): KernelFact("CUDA's takes int8 activations only", 0, ("int8",)),
}
TENSORRT_UNSUPPORTED = {("", "DynamicQuantizeLinear"), ("", "MatMulInteger")}
# Ops CUDA runs but TensorRT's parser does not take (the onnx profile's Attention has present K/V outputs).
TENSORRT_KERNEL_FACTS = {
    ("", "Attention"): "TensorRT 10.16 rejects an opset-23 Attention with present K/V outputs",
}
# the same facts, as a provider's declared need says them (gpt2onnx.capabilities.Lacks: "{item}" is the op)
TENSORRT_LACKS = {("", "Attention"): "rejects an opset-23 {item} with present K/V outputs (TensorRT 10.16)"}


def provider_declared(config: "ProviderConfig") -> Declared:
    """What a provider ensures (where tensors live) and needs of a graph's ops, from the kernel facts above (the
    graph's element types are checked at session creation: check_kernels); --allow-fallback lets CUDA run the ops
    TensorRT's parser does not take, and the CPU what CUDA has no kernel for."""
    name = config.name
    requires = []
    if name != "cpu" and not config.allow_fallback:
        lacks = {op: f"has no {name} kernel for" for op, fact in CUDA_KERNEL_FACTS.items() if not fact.types}
        if name == "tensorrt":
            lacks.update({op: "takes no" for op in TENSORRT_UNSUPPORTED})
            lacks.update(TENSORRT_LACKS)
            requires.append(Need("contrib_ops", allowed={False}, why="takes no com.microsoft op (TensorRT's parser)"))
        requires.append(
            Lacks("ops", lacks, fix="use --provider cpu, or let another provider run them (--allow-fallback)")
        )
    return Declared(
        "provider",
        name,
        f"--provider {name}",
        ensures={"device_memory": DEVICE_TYPES[name] != "cpu"},
        requires=tuple(requires),
        says={"device_memory": "keeps tensors in GPU memory" if name != "cpu" else "keeps tensors in host memory"},
    )


def provider_alternatives() -> list[Declared]:
    """Every provider's declaration, with its defaults (what a refusal's advice may name)."""
    return [provider_declared(ProviderConfig(name)) for name in PROVIDERS]


def cuda_precisions() -> list[str]:
    """The precisions whose identifying ops CUDA has kernels for (none of theirs in CUDA_KERNEL_FACTS)."""
    missing = {op for _, op in CUDA_KERNEL_FACTS}
    return [p.short for p in PRECISIONS.values() if p.selectable and not p.marks & missing]


def _elem_types(graph) -> dict[str, str]:
    """Element type names ('float', 'uint8', ...) of the tensors whose type the graph states, or that the ONNX
    spec fixes (DynamicQuantizeLinear's y is uint8, a Cast's output its ``to``)."""
    from onnx import TensorProto

    name_of = {v: k.lower() for k, v in TensorProto.DataType.items()}
    g = graph.graph
    types = {t.name: name_of.get(t.data_type, "?") for t in g.initializer}
    for info in (*g.input, *g.value_info, *g.output):
        if info.type.tensor_type.elem_type:
            types[info.name] = name_of.get(info.type.tensor_type.elem_type, "?")
    for node in all_nodes(g, prompt_body=True):
        if node.op_type == "DynamicQuantizeLinear" and node.domain in ("", "ai.onnx") and node.output:
            types[node.output[0]] = "uint8"
        elif node.op_type == "Cast" and node.domain in ("", "ai.onnx") and node.output:  # int8's per-token uint8
            to = next((a.i for a in node.attribute if a.name == "to"), 0)
            types.setdefault(node.output[0], name_of.get(to, "?"))
    return types


def unsupported_nodes(graph, provider: str) -> dict[str, tuple[int, str]]:
    """The ops of ``graph`` (a ModelProto, weights not needed) that ``provider`` cannot run on its own device,
    from the kernel facts above: op → (nodes, reason). Empty for the cpu provider."""
    if provider == "cpu":
        return {}
    types = _elem_types(graph)
    found: dict[str, list] = {}
    for node in all_nodes(graph.graph, prompt_body=True):  # subgraphs too: int4's int8 prompt body
        key = ("" if node.domain == "ai.onnx" else node.domain, node.op_type)
        reason = None
        if provider == "tensorrt" and key[0] == MS_DOMAIN:
            reason = "TensorRT takes no com.microsoft op"
        elif provider == "tensorrt" and key in TENSORRT_KERNEL_FACTS:
            reason = TENSORRT_KERNEL_FACTS[key]
        elif key in CUDA_KERNEL_FACTS and (provider == "cuda" or key in TENSORRT_UNSUPPORTED):
            fact = CUDA_KERNEL_FACTS[key]
            given = types.get(node.input[fact.input_index]) if len(node.input) > fact.input_index else None
            if not fact.types:
                reason = fact.reason
            elif given is not None and given not in fact.types:
                reason = f"{fact.reason}; this graph gives it {given}"
            if reason and provider == "tensorrt":
                reason = f"TensorRT takes no {node.op_type}, and {reason}"
        if reason:
            found.setdefault(node.op_type, [0, reason])[0] += 1
    return {op: (n, reason) for op, (n, reason) in found.items()}


def _tensorrt_profiles() -> str:
    """The fusion profiles whose ops TensorRT's parser takes, from what each declares it writes."""
    from gpt2onnx.profiles.all_profiles import PROFILES

    blocked = set(TENSORRT_KERNEL_FACTS) | TENSORRT_UNSUPPORTED
    names = [
        name
        for name, profile in reversed(PROFILES.items())  # the most fused first
        if not any(domain == MS_DOMAIN or (domain, op) in blocked for domain, op in profile.declared.ensures["ops"])
    ]
    return " or ".join(f"--fusion {name}" for name in names)


def check_kernels(graph, config: ProviderConfig) -> None:
    """Refuse, before any session is made, a graph with ops the provider cannot run on its device (they would run
    on the CPU, with copies from the GPU and back at every layer); with --allow-fallback, a warning."""
    missing = unsupported_nodes(graph, config.name)
    if not missing:
        return
    ops = "; ".join(f"{op} ×{n} ({reason})" for op, (n, reason) in missing.items())
    standard_only = {op for _, op in TENSORRT_KERNEL_FACTS}  # CUDA runs them: the same advice as contrib ops
    contrib = config.name == "tensorrt" and (
        any("com.microsoft" in reason for _, reason in missing.values()) or bool(standard_only & set(missing))
    )
    if contrib:
        advice = (
            f"export it with {_tensorrt_profiles()} (standard ops only, no int8/int4 weights), or use --provider cuda"
            " (or let CUDA run them: --allow-fallback)"
        )
    else:
        advice = (
            f"use --provider cpu, or a model in {' or '.join(cuda_precisions())} (or run them on the CPU anyway:"
            " --allow-fallback)"
        )
    message = f"provider '{config.name}' cannot run this model's {ops}"
    if not config.allow_fallback:
        raise RuntimeUnavailable(f"{message}: {advice}")
    log.warning("%s: running them elsewhere (--allow-fallback)", message)


# -- placement: which provider got each node -------------------------------------------------------------------
RECORD_PLACEMENT = "session.record_ep_graph_assignment_info"
# elements: onnxruntime's own bound for an initializer it keeps on the CPU (kSmallInitializerThreshold, in
# onnxruntime/core/framework/fallback_cpu_capability.cc)
SMALL_CONSTANT = 100
_PLACEMENTS: "weakref.WeakKeyDictionary[ort.InferenceSession, Placement]" = weakref.WeakKeyDictionary()
_TF32: "weakref.WeakKeyDictionary[ort.InferenceSession, bool | None]" = weakref.WeakKeyDictionary()


def host_side_nodes(graph) -> frozenset[str]:
    """Names of the nodes whose every input is an integer graph input, a small constant, a shape (Shape, Size)
    or another such node's output: the shape and mask arithmetic onnxruntime may keep on the CPU on purpose
    (GetCpuPreferredNodes). A node that reads a weight, the K/V cache or any activation is compute."""
    from onnx import TensorProto

    g = graph.graph
    integer = {TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL}
    host = {t.name for t in g.initializer if _elements(t.dims) <= SMALL_CONSTANT}
    host |= {i.name for i in g.input if i.type.tensor_type.elem_type in integer}
    names: set[str] = set()
    changed = True
    while changed:  # until nothing changes: a file from elsewhere need not list its nodes in topological order
        changed = False
        for node in g.node:
            if node.name in names or not node.name:  # a nameless node cannot be told apart in the record
                continue
            if node.op_type in ("Shape", "Size"):
                ok = True
            elif node.op_type == "Constant":
                ok = all(_elements(a.t.dims) <= SMALL_CONSTANT for a in node.attribute if a.name == "value")
            else:
                ok = all(not name or name in host for name in node.input)
            if ok:
                host.update(node.output)
                names.add(node.name)
                changed = True
    return frozenset(names)


def _elements(dims) -> int:
    count = 1
    for d in dims:
        count *= d
    return count


def read_placement(
    session: ort.InferenceSession, config: ProviderConfig, *, host_side: frozenset[str] | None = None
) -> Placement:
    """The session's node placement from onnxruntime's graph-assignment record; where a GPU provider was asked for,
    the nodes on the CPU by op, and the compute ones among them (not in ``host_side``)."""
    try:
        assigned = [
            (sg.ep_name, node) for sg in session.get_provider_graph_assignment_info() for node in sg.get_nodes()
        ]
    except Exception as err:  # onnxruntime < 1.24 has no such record (or it was not asked for)
        log.debug("no node placement from onnxruntime %s: %s", ort.__version__, err)
        return Placement(config.name, {}, reported=False)
    nodes = Counter(ep for ep, _ in assigned)
    if config.name == "cpu":
        return Placement(config.name, dict(nodes))
    on_cpu = [node for ep, node in assigned if ep == "CPUExecutionProvider"]
    host_side = host_side or frozenset()
    fallback = Counter(n.op_type for n in on_cpu if n.name not in host_side and not n.op_type.startswith("Memcpy"))
    return Placement(config.name, dict(nodes), dict(Counter(n.op_type for n in on_cpu)), dict(fallback))


def session_placement(session: ort.InferenceSession) -> Placement | None:
    """The placement read when :func:`create_session` made ``session`` (None for a session made elsewhere)."""
    return _PLACEMENTS.get(session)


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
    # onnxruntime's CUDA provider computes fp32 GEMMs in TF32 unless use_tf32 is 0 (its default is 1); PyTorch's
    # CUDA matmuls do not (torch.backends.cuda.matmul.allow_tf32 is False by default).
    cuda = ("CUDAExecutionProvider", {"device_id": config.device_id, "use_tf32": int(config.tf32)})
    if config.name == "cuda":
        return [cuda, "CPUExecutionProvider"]
    cache_dir = Path(config.trt_cache_dir) if config.trt_cache_dir else Path(model_path).parent / TRT_CACHE_DIR
    if config.tf32:  # engines built with TF32 are kept apart: a cached one would otherwise serve fp32 runs
        cache_dir = cache_dir / "tf32"
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
    return [("TensorrtExecutionProvider", trt), cuda, "CPUExecutionProvider"]


def session_options(config: ProviderConfig) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    # onnxruntime ≥ 1.24 records which provider got each node (session.get_provider_graph_assignment_info())
    options.add_session_config_entry(RECORD_PLACEMENT, "1")
    if config.name == "cpu":
        options.intra_op_num_threads = config.threads or os.cpu_count() or 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if config.spinning else "0")
        options.enable_cpu_mem_arena = config.arena
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


# -- GPU libraries: loaded the way onnxruntime expects, and their versions ---------------------------------------
_PRELOADED = False
_GPU_LIBRARIES = re.compile(r"/(lib(?:cudart|cublasLt|cublas|cudnn|nvinfer|nvonnxparser|cuda)\.so[.0-9]*)$")


def preload_gpu_libraries() -> None:
    """Before the first CUDA or TensorRT session of the process: onnxruntime.preload_dlls() (onnxruntime ≥ 1.21;
    the CUDA and cuDNN libraries of the nvidia-* pip packages, else the loader's search path), then TensorRT's from
    pip's tensorrt_libs package, which pip installs outside the loader's path. What cannot load is left to the
    session, which then fails with onnxruntime's reason. Once per process."""
    global _PRELOADED
    if _PRELOADED:
        return
    _PRELOADED = True
    with _provider_messages_captured():  # preload_dlls prints each library it cannot find
        if hasattr(ort, "preload_dlls"):
            try:
                ort.preload_dlls()
            except Exception as err:  # a missing folder or library: the session says what it needs
                log.debug("onnxruntime.preload_dlls(): %s", err)
        spec = importlib.util.find_spec("tensorrt_libs")
        for folder in spec.submodule_search_locations or () if spec else ():
            # libnvinfer first: the parser and the plugins depend on it
            for path in sorted(
                Path(folder).glob("libnv*.so*"), key=lambda p: (not p.name.startswith("libnvinfer."), p.name)
            ):
                try:
                    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
                except OSError as err:
                    log.debug("TensorRT library %s: %s", path, err)


def gpu_library_versions() -> dict[str, str]:
    """The versions of the CUDA, cuDNN and TensorRT libraries this process has loaded (asked of the libraries
    themselves), and the CUDA version onnxruntime was built for. Empty where none is loaded (a CPU machine)."""
    versions = {}
    try:
        from onnxruntime.capi import build_and_package_info

        if getattr(build_and_package_info, "cuda_version", None):
            versions["onnxruntime_built_for_cuda"] = build_and_package_info.cuda_version
    except ImportError:
        pass
    try:
        with open("/proc/self/maps") as fh:
            loaded = {m.group(1): line.split()[-1] for line in fh if (m := _GPU_LIBRARIES.search(line.strip()))}
    except OSError:
        return versions
    # (library prefix, function, its return type: None = an int written through a pointer, the key, how to print it)
    queries = (
        ("libcuda.so", "cuDriverGetVersion", None, "cuda_driver_api", _cuda_version),
        ("libcudart.so", "cudaRuntimeGetVersion", None, "cuda_runtime", _cuda_version),
        ("libcudnn.so", "cudnnGetVersion", ctypes.c_size_t, "cudnn", _cudnn_version),
        ("libnvinfer.so", "getInferLibVersion", ctypes.c_int32, "tensorrt", _tensorrt_version),
    )
    for prefix, function, returns, key, render in queries:
        path = next((p for name, p in loaded.items() if name.startswith(prefix)), None)
        if path is None:
            continue
        try:
            call = getattr(ctypes.CDLL(path), function)  # already in the process: no new library is loaded
            if returns is None:
                value = ctypes.c_int(0)
                call(ctypes.byref(value))
                number = value.value
            else:
                call.restype = returns
                number = int(call())
            versions[key] = f"{render(number)} ({Path(path).name})"
        except (OSError, AttributeError) as err:
            log.debug("%s in %s: %s", function, path, err)
    return versions


def _cuda_version(n: int) -> str:
    return f"{n // 1000}.{n % 1000 // 10}"


def _cudnn_version(n: int) -> str:  # 9.10.2 is 91002 (cuDNN 9 encodes major * 10000 + minor * 100 + patch)
    return f"{n // 10000}.{n % 10000 // 100}.{n % 100}" if n >= 90000 else f"{n // 1000}.{n % 1000 // 100}.{n % 100}"


def _tensorrt_version(n: int) -> str:  # TensorRT 10 encodes major * 10000 + minor * 100 + patch
    return f"{n // 10000}.{n % 10000 // 100}.{n % 100}" if n >= 10000 else f"{n // 1000}.{n % 1000 // 100}.{n % 100}"


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
        if name != "cpu":
            preload_gpu_libraries()
        with _provider_messages_captured():
            try:
                session = ort.InferenceSession(data, providers=[ORT_NAMES[name]])
            except Exception as err:  # a provider that loads and then fails on the probe does not work here
                log.debug("%s on the probe graph: %s", name, err)
                continue
        if session.get_providers()[0] == ORT_NAMES[name]:
            usable.append(name)
    return usable


# -- errors: onnxruntime's, sorted into the model's fault and the provider's -------------------------------------
# Words of a provider's failure in onnxruntime's messages (EPFail, a CUDA or TensorRT error, a node the provider
# may not give to the CPU); any other failure to load a graph is the model's (ContractError).
_PROVIDER_FAILURE = re.compile(r"EP_FAIL|ExecutionProvider|\bEP\b|CUDA|cuda|cuDNN|cudnn|cuBLAS|cublas|TensorRT|nvinfer")
_ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\] : \d+ : (\w+) : ")


def provider_failure(err: BaseException, provider: str, *, doing: str) -> RuntimeUnavailable | None:
    """onnxruntime's ``err`` as a provider failure (exit code 3, onnxruntime's own words), or None where it is not
    one: an EPFail (which derives from Exception, not RuntimeError), or, on cuda and tensorrt, a message that
    names a provider, CUDA or TensorRT."""
    text = str(err).strip()
    kind = type(err).__name__
    if kind != "EPFail" and not (provider != "cpu" and _PROVIDER_FAILURE.search(text)):
        return None
    first = text.splitlines()[0] if text else kind
    match = _ORT_PREFIX.match(first)
    code = match.group(1) if match else kind
    reason = first[match.end() :] if match else first
    return RuntimeUnavailable(f"provider '{provider}' failed {doing}: {reason[:300]} (onnxruntime {code})")


def create_session(
    model_path: str | Path,
    config: ProviderConfig,
    *,
    shape: DecoderShape | None = None,
    host_side: frozenset[str] | None = None,
) -> ort.InferenceSession:
    """A session on ``config.name``, checked: no fallback to another provider and no compute node on the CPU
    under cuda or tensorrt (unless ``config.allow_fallback``). Its placement: :func:`session_placement`.
    ``host_side``: the graph's shape and mask arithmetic (:func:`host_side_nodes`), read from the file when needed.
    """
    model_path = Path(model_path)
    providers = provider_options(config, model_path=model_path, shape=shape)
    made_cache = None
    if config.name != "cpu":
        preload_gpu_libraries()
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
    tf32 = config.tf32 and os.environ.get(TF32_OVERRIDE) != "0"
    with _provider_messages_captured() as native, _tensorrt_tf32(config):
        try:
            session = ort.InferenceSession(str(model_path), sess_options=session_options(config), providers=providers)
        except Exception as err:  # onnxruntime raises its own exception types for invalid models
            _remove_if_empty(made_cache)
            failure = provider_failure(err, config.name, doing=f"to create a session for '{model_path}'")
            if failure is not None:
                raise failure from None
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
    placement = _checked_placement(session, config, model_path, host_side, fell_back=got[0] != wanted)
    _PLACEMENTS[session] = placement
    _TF32[session] = tf32 if got[0] != "CPUExecutionProvider" else None
    log.info("session on %s: %s", ", ".join(got), placement.summary())
    release_freed_memory()  # what loading freed (the parsed file, folded and prepacked copies): heap.py
    return session


def _checked_placement(session, config: ProviderConfig, model_path: Path, host_side, *, fell_back: bool) -> Placement:
    """The session's placement; compute nodes on the CPU under cuda or tensorrt are refused unless allowed."""
    if config.name != "cpu" and host_side is None:
        from gpt2onnx.artifact.graph import load_graph

        host_side = host_side_nodes(load_graph(model_path))
    placement = read_placement(session, config, host_side=host_side)
    if config.name == "cpu" or fell_back:  # a whole-session fallback was refused or warned about above
        return placement
    if not placement.reported:
        log.warning(
            "onnxruntime %s does not report node placement: CPU fallback of single nodes goes unchecked",
            ort.__version__,
        )
    elif placement.fallback:
        ops = ", ".join(f"{op} ×{n}" for op, n in placement.fallback.items())
        message = (
            f"provider '{config.name}' put {sum(placement.fallback.values())} compute nodes of '{model_path}' on the"
            f" CPU ({ops}), each with copies from the GPU and back"
        )
        if not config.allow_fallback:
            raise RuntimeUnavailable(f"{message}: use a model whose ops it runs, or run anyway: --allow-fallback")
        log.warning("%s (--allow-fallback)", message)
    return placement


def session_tf32(session: ort.InferenceSession) -> bool | None:
    """Whether the session's fp32 matmuls may use TF32 (as :func:`create_session` made it: CUDA's use_tf32, the
    TensorRT engines' build); None for a session on the CPU or made elsewhere."""
    return _TF32.get(session)


@contextlib.contextmanager
def _tensorrt_tf32(config: ProviderConfig):
    """TensorRT builds fp32 engines with TF32 allowed (its BuilderFlag kTF32 is on by default) and onnxruntime's
    TensorRT provider has no option for it; NVIDIA's libraries read NVIDIA_TF32_OVERRIDE=0 instead. Without
    --tf32 it is set while the session, and with it the engines of the explicit profile, is made; then restored."""
    if config.name != "tensorrt" or config.tf32 or os.environ.get(TF32_OVERRIDE) == "0":
        yield
        return
    os.environ[TF32_OVERRIDE] = "0"
    try:
        yield
    finally:
        os.environ.pop(TF32_OVERRIDE, None)


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
