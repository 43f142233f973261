"""The graph passes export and optimize share: small classes composed in sequence, as onnx-ir's ``PassBase`` and
``Sequential`` compose theirs (each declares what it requires of the model and what it ensures, and returns the
manifest's record of what it did): the fusion profile (its rules, then its cache layout's rewrite), fp16, the
weight quantization (with int4's prompt path), the K/V cache's quantization.

onnx-ir's own classes are not used as they are: their ``Sequential`` wraps every error of a pass in a ``PassError``,
which would turn a one-line refusal (BadInput, CheckFailed) into a traceback, and these passes work on a
ModelProto (onnxruntime's quantizers take one), not on an ``ir.Model``.

:class:`GraphPasses` is what a user chose, checked when built: each option on its own, then every option against
the others through their declared capabilities (:mod:`gpt2onnx.capabilities`), so a combination that cannot work
is refused in one line before any work.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import onnx

from gpt2onnx.artifact.graph import all_nodes
from gpt2onnx.artifact.manifest import Fp16Record, FusionReport, KvCacheRecord, QuantizationRecord
from gpt2onnx.capabilities import Declared, Verdict, resolve
from gpt2onnx.choices.axes import graph_alternatives
from gpt2onnx.errors import BadInput
from gpt2onnx.layouts.all_layouts import layout_of
from gpt2onnx.precisions import fp16
from gpt2onnx.precisions import weights as weight_passes  # by module: tests swap quantize to damage a file
from gpt2onnx.precisions.all_precisions import FP32, by_dtype
from gpt2onnx.precisions.fp16 import FP16_KEEP_GROUPS, parse_keep_fp32
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE, KV_CACHES, KvCacheFormat, cache_declared
from gpt2onnx.precisions.precision import Precision
from gpt2onnx.precisions.quantize_options import QuantizeOptions, check_dtype
from gpt2onnx.profiles.all_profiles import UNFUSED, profile
from gpt2onnx.profiles.profile import Profile


@dataclass
class PassResult:
    """What the passes return (as onnx-ir's passes do): the model, and the manifest's record of each pass."""

    model: onnx.ModelProto | None  # None once the caller has saved and freed it
    fusion: FusionReport | None = None
    fp16: Fp16Record | None = None
    quantization: QuantizationRecord | None = None
    # the K/V cache layout's name (gpt2onnx.layouts), read from the result's ops: deployment targets read it
    cache_layout: str = ""
    kv_cache_quantization: KvCacheRecord | None = None  # a quantized cache (--kv-cache)
    batch_invariance: tuple[int, int] = (0, 0)  # attentions aligned, MatMulNBits paired (the graph shows them)

    def records(self) -> dict:
        """The manifest's records of the passes, by their keys."""
        return {
            "fusion": self.fusion,
            "fp16": self.fp16,
            "quantization": self.quantization,
            "cache_layout": self.cache_layout,
            "kv_cache_quantization": self.kv_cache_quantization,
        }


class GraphPass(ABC):
    """One pass: its configuration is its fields (declared once, checked by GraphPasses), ``requires`` and
    ``ensures`` check the model before and after, ``call`` returns the new model and the pass's record."""

    record: ClassVar[str]  # the PassResult field its record goes to
    timing: ClassVar[str]  # the manifest's timing key (``{timing}_seconds``)

    def requires(self, model: onnx.ModelProto) -> None:
        """What the model must hold before the pass (a BadInput where it does not)."""

    def ensures(self, model: onnx.ModelProto) -> None:
        """What the pass guarantees of its result (checked after it runs)."""

    @abstractmethod
    def call(self, model: onnx.ModelProto) -> tuple[onnx.ModelProto, Any]:
        """The pass: (the new model, its record)."""


@dataclass(frozen=True)
class FusionPass(GraphPass):
    """A fusion profile: its rules, then its layout's rewrite; ensures its golden counts (the fusion itself checks
    them, CheckFailed below them unless ``allow_partial``)."""

    profile: Profile
    allow_partial: bool = False
    activation: str = "gelu_new"
    record: ClassVar[str] = "fusion"
    timing: ClassVar[str] = "fusion"

    def call(self, model):
        from gpt2onnx.passes.fusions.fuse import fuse  # lazy: the rules import onnxscript, only a fusion needs it

        return fuse(model, self.profile, allow_partial=self.allow_partial, activation=self.activation)


@dataclass(frozen=True)
class Fp16Pass(GraphPass):
    """fp16 weights and activations, the groups of ``keep_fp32`` kept fp32."""

    keep_fp32: tuple[str, ...] = FP16_KEEP_GROUPS
    upcast_attention: bool = False
    record: ClassVar[str] = "fp16"
    timing: ClassVar[str] = "fp16"

    def call(self, model):
        return fp16.to_fp16(model, keep_fp32=self.keep_fp32, upcast_attention=self.upcast_attention)


@dataclass(frozen=True)
class QuantizePass(GraphPass):
    """The quantizing precision's weight pass (and int4's prompt path), on calibration where it needs one."""

    options: QuantizeOptions
    calibration: Any = None
    record: ClassVar[str] = "quantization"
    timing: ClassVar[str] = "quantize"

    def call(self, model):
        return weight_passes.quantize(model, self.options, calibration=self.calibration)


@dataclass(frozen=True)
class KvCachePass(GraphPass):
    """The K/V cache stored as ``format`` by the attention op of a layout that quantizes it, with scales calibrated
    through the graph on ``calibration``."""

    format: KvCacheFormat
    calibration: Any = None
    record: ClassVar[str] = "kv_cache_quantization"
    timing: ClassVar[str] = "kv_cache"

    def call(self, model):
        from gpt2onnx.passes.cache_quantization import quantize_kv_cache

        return quantize_kv_cache(model, self.format, self.calibration.sequences, self.calibration.source)


@dataclass(frozen=True)
class BatchInvariancePass(GraphPass):
    """A row's sums independent of its batch: unfused attention aligned against left padding, MatMulNBits fed
    rows in pairs (gpt2onnx.passes.batch_invariance); the last pass, on what the others left."""

    record: ClassVar[str] = "batch_invariance"
    timing: ClassVar[str] = "batch_invariance"

    def call(self, model):
        from gpt2onnx.passes.batch_invariance import make_batch_invariant

        return make_batch_invariant(model)


@dataclass(frozen=True)
class Sequential:
    """Passes run in order, each ``requires`` checked before it and ``ensures`` after it."""

    passes: tuple[GraphPass, ...]

    def __call__(self, model: onnx.ModelProto, timings: dict[str, float]) -> PassResult:
        result = PassResult(model)
        for graph_pass in self.passes:
            graph_pass.requires(result.model)
            with timed(timings, graph_pass.timing):
                result.model, record = graph_pass.call(result.model)
            graph_pass.ensures(result.model)
            setattr(result, graph_pass.record, record)
        op_types = (n.op_type for n in all_nodes(result.model.graph, prompt_body=True))
        result.cache_layout = layout_of(op_types).name
        return result


@dataclass(frozen=True)
class GraphPasses:
    """The passes export and optimize run, checked when built: a fusion profile, the dtype (canonical: float32 or
    float16), the weight quantization, what fp16 keeps in fp32 (a tuple of groups, or --keep-fp32's text), and the
    K/V cache's precision (--kv-cache: float, or a quantized format of gpt2onnx.precisions.kv_cache). Each is
    checked on its own, then against the others through what they declare (gpt2onnx.capabilities)."""

    fusion: str = UNFUSED.name
    allow_partial_fusion: bool = False
    dtype: str = FP32.short
    quantization: QuantizeOptions = field(default_factory=QuantizeOptions)
    keep_fp32: tuple[str, ...] | str = FP16_KEEP_GROUPS  # fp16: what stays fp32 (precision.FP16_KEEP_GROUPS)
    kv_dtype: str = FLOAT_CACHE  # the K/V cache's element type (--kv-cache): float, or a quantized format

    def __post_init__(self) -> None:  # an invalid one cannot be built: checked here, and only here
        chosen = profile(self.fusion)
        if self.allow_partial_fusion and not chosen.fusions:
            raise BadInput("--allow-partial-fusion applies to a fusion profile: add --fusion, or drop it")
        dtype = check_dtype(self.dtype, self.quantization.method)
        keep = parse_keep_fp32(self.keep_fp32)
        if by_dtype(dtype) is not fp16.PRECISION and keep != FP16_KEEP_GROUPS:
            raise BadInput("--keep-fp32 applies to fp16 models only: add --dtype fp16, or leave --keep-fp32 out")
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "keep_fp32", keep)
        self.verdict().check()

    @property
    def profile(self) -> Profile:
        return profile(self.fusion)

    @property
    def cache_format(self) -> KvCacheFormat | None:
        """The quantized cache's format (None: the float cache)."""
        return KV_CACHES.get(self.kv_dtype)

    @property
    def precision(self) -> Precision:
        """What the passes write: the quantizing precision, else the dtype's."""
        return self.quantization.precision or by_dtype(self.dtype)

    @property
    def changes_nothing(self) -> bool:
        """No fusion, fp32 weights: the passes would leave a graph as it is."""
        return not self.profile.fusions and self.precision.exact and self.cache_format is None

    def choices(self) -> list[Declared]:
        """What the chosen passes declare: the profile (with its layout), the precision and its options, the cache."""
        precision = self.quantization.choices() or [by_dtype(self.dtype).declared]
        return [self.profile.declared, *precision, cache_declared(self.kv_dtype)]

    def verdict(self, *others: Declared) -> Verdict:
        """Whether the passes, with ``others`` (an architecture's facts, optimize's source), work together."""
        return resolve([*self.choices(), *others], alternatives=graph_alternatives())

    def sequence(
        self, *, activation: str = "gelu_new", upcast_attention: bool = False, calibration=None, kv_calibration=None
    ) -> Sequential:
        """The passes in order: fusion profile, fp16, weight quantization, K/V cache quantization (those that do
        something), then the batch-invariance rewrites (always)."""
        passes: list[GraphPass] = []
        if self.profile.fusions or self.profile.layout.rewrite is not None:
            passes.append(FusionPass(self.profile, self.allow_partial_fusion, activation))
        if self.precision is fp16.PRECISION:
            passes.append(Fp16Pass(self.keep_fp32, upcast_attention))
        if self.quantization.precision is not None:
            passes.append(QuantizePass(self.quantization, calibration))
        if self.cache_format is not None:
            passes.append(KvCachePass(self.cache_format, kv_calibration))
        passes.append(BatchInvariancePass())
        return Sequential(tuple(passes))

    def apply(
        self,
        model: onnx.ModelProto,
        timings: dict[str, float],
        calibration=None,
        *,
        activation: str = "gelu_new",
        upcast_attention: bool = False,
        kv_calibration=None,
    ) -> PassResult:
        """Run the passes in order on ``model``. ``calibration``: the token sequences of a calibrated int4 algorithm
        or measured 8-bit layers (gpt2onnx.precisions.algorithms.algorithm.Calibration); ``kv_calibration``: those
        a quantized K/V cache's scales are calibrated on (the same type); ``activation``: the MLP's (the
        Architecture's canonical name; it fixes which fused op the gelu fusion must reach); ``upcast_attention``:
        the Architecture's reorder_and_upcast_attn (fp16 keeps the scores fp32)."""
        sequence = self.sequence(
            activation=activation,
            upcast_attention=upcast_attention,
            calibration=calibration,
            kv_calibration=kv_calibration,
        )
        return sequence(model, timings)


@contextlib.contextmanager
def timed(timings: dict[str, float], step: str):
    """The seconds the block takes, as timings[step + "_seconds"] (the manifest's timings)."""
    start = time.perf_counter()
    yield
    timings[f"{step}_seconds"] = time.perf_counter() - start
