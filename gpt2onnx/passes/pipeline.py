"""The graph passes export and optimize share, in order: fusion profile, fp16, weight quantization."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import onnx

from gpt2onnx.artifact.manifest import Fp16Record, FusionReport, KvCacheRecord, QuantizationRecord
from gpt2onnx.errors import BadInput
from gpt2onnx.precisions import fp16
from gpt2onnx.precisions import weights as weight_passes  # by module: tests swap quantize to damage a file
from gpt2onnx.precisions.all_precisions import FP32, by_dtype
from gpt2onnx.precisions.fp16 import FP16_KEEP_GROUPS, parse_keep_fp32
from gpt2onnx.precisions.kv_cache import FLOAT_CACHE, KvCacheFormat, check_kv_cache
from gpt2onnx.precisions.precision import Precision
from gpt2onnx.precisions.quantize_options import QuantizeOptions, check_dtype


@dataclass
class PassResult:
    """What the passes return (as onnx-ir's passes do): the model, and the manifest's record of each pass."""

    model: onnx.ModelProto | None  # None once the caller has saved and freed it
    fusion: FusionReport | None = None
    fp16: Fp16Record | None = None
    quantization: QuantizationRecord | None = None
    # "shared": past and present may be one preallocated buffer (GroupQueryAttention, the ort-shared-kv
    # profile); deployment targets read it (genai: past_present_share_buffer). "static": one fixed-size buffer
    # updated in place by TensorScatter (onnx-static-kv). "concat": present = past + new.
    kv_cache: str = "concat"
    kv_cache_quantization: KvCacheRecord | None = None  # a quantized cache (--kv-cache)

    def records(self) -> dict:
        """The manifest's records of the passes, by their keys."""
        return {
            "fusion": self.fusion,
            "fp16": self.fp16,
            "quantization": self.quantization,
            "kv_cache": self.kv_cache,
            "kv_cache_quantization": self.kv_cache_quantization,
        }


@dataclass(frozen=True)
class GraphPasses:
    """The passes export and optimize run, checked when built: a fusion profile, the dtype (canonical: float32 or
    float16), the weight quantization, what fp16 keeps in fp32 (a tuple of groups, or --keep-fp32's text), and the
    K/V cache's precision (--kv-cache: float, or a quantized format of gpt2onnx.precisions.kv_cache)."""

    fusion: str = "none"
    allow_partial_fusion: bool = False
    dtype: str = FP32.short
    quantization: QuantizeOptions = field(default_factory=QuantizeOptions)
    keep_fp32: tuple[str, ...] | str = FP16_KEEP_GROUPS  # fp16: what stays fp32 (precision.FP16_KEEP_GROUPS)
    kv_cache: str = FLOAT_CACHE

    def __post_init__(self) -> None:  # an invalid one cannot be built: checked here, and only here
        if self.fusion != "none":  # the profiles import onnxscript: only when one is asked for
            from gpt2onnx.passes.fusions.profiles import check_profile

            check_profile(self.fusion)
        if self.allow_partial_fusion and self.fusion == "none":
            raise BadInput("--allow-partial-fusion applies to a fusion profile: add --fusion, or drop it")
        dtype = check_dtype(self.dtype, self.quantization.method)
        keep = parse_keep_fp32(self.keep_fp32)
        if by_dtype(dtype) is not fp16.PRECISION and keep != FP16_KEEP_GROUPS:
            raise BadInput("--keep-fp32 applies to fp16 models only: add --dtype fp16, or leave --keep-fp32 out")
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "keep_fp32", keep)
        self.cache_format  # noqa: B018 (checked when built: --kv-cache against the profile and precision)

    @property
    def cache_format(self) -> KvCacheFormat | None:
        """The quantized cache's format (None: the float cache)."""
        return check_kv_cache(self.kv_cache, fusion=self.fusion, dtype=self.dtype)

    @property
    def precision(self) -> Precision:
        """What the passes write: the quantizing precision, else the dtype's."""
        return self.quantization.precision or by_dtype(self.dtype)

    @property
    def changes_nothing(self) -> bool:
        """No fusion, fp32 weights: the passes would leave a graph as it is."""
        return self.fusion == "none" and self.precision.exact and self.cache_format is None

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
        """Run the passes in order: fusion profile, fp16, weight quantization, K/V cache quantization.
        ``calibration``: the token sequences of a calibrated int4 algorithm or measured 8-bit layers
        (gpt2onnx.precisions.algorithms.algorithm.Calibration); ``kv_calibration``: those a quantized K/V cache's
        scales are calibrated on (the same type);
        ``activation``: the MLP's (the Architecture's canonical name; it fixes which fused op the gelu fusion must
        reach); ``upcast_attention``: the Architecture's reorder_and_upcast_attn (fp16 keeps the scores fp32)."""
        result = PassResult(model)
        if self.fusion != "none":
            from gpt2onnx.passes.fusions import fuse  # lazy: the rules import onnxscript, only a fusion needs it

            with timed(timings, "fusion"):
                result.model, result.fusion = fuse(
                    result.model, self.fusion, allow_partial=self.allow_partial_fusion, activation=activation
                )
        if self.precision is fp16.PRECISION:
            with timed(timings, "fp16"):
                result.model, result.fp16 = fp16.to_fp16(
                    result.model, keep_fp32=self.keep_fp32, upcast_attention=upcast_attention
                )
        if self.quantization.precision is not None:
            with timed(timings, "quantize"):
                result.model, result.quantization = weight_passes.quantize(
                    result.model, self.quantization, calibration=calibration
                )
        if self.cache_format is not None:
            from gpt2onnx.passes.cache_quantization import quantize_kv_cache

            with timed(timings, "kv_cache"):
                result.model, result.kv_cache_quantization = quantize_kv_cache(
                    result.model, self.cache_format, kv_calibration.sequences, kv_calibration.source
                )
        ops = {n.op_type for n in result.model.graph.node}
        result.kv_cache = "shared" if "GroupQueryAttention" in ops else "static" if "TensorScatter" in ops else "concat"
        return result


@contextlib.contextmanager
def timed(timings: dict[str, float], step: str):
    """The seconds the block takes, as timings[step + "_seconds"] (the manifest's timings)."""
    start = time.perf_counter()
    yield
    timings[f"{step}_seconds"] = time.perf_counter() - start
