"""The graph passes export and optimize share, in order: fusion profile, fp16, weight quantization."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import onnx

from gpt2onnx.artifact.manifest import Fp16Record, FusionReport, QuantizationRecord
from gpt2onnx.errors import BadInput
from gpt2onnx.passes.precision import FP16_KEEP_GROUPS, QuantizeOptions, check_dtype, parse_keep_fp32


@dataclass
class PassResult:
    """What the passes return (as onnx-ir's passes do): the model, and the manifest's record of each pass."""

    model: onnx.ModelProto | None  # None once the caller has saved and freed it
    fusion: FusionReport | None = None
    fp16: Fp16Record | None = None
    quantization: QuantizationRecord | None = None
    # "shared": past and present may be one preallocated buffer (GroupQueryAttention, the ort-shared-kv
    # profile); deployment targets read it (genai: past_present_share_buffer). "concat": present = past + new.
    kv_cache: str = "concat"


@dataclass(frozen=True)
class GraphPasses:
    fusion: str = "none"
    allow_partial_fusion: bool = False
    dtype: str = "fp32"
    quantization: QuantizeOptions = field(default_factory=QuantizeOptions)
    keep_fp32: tuple[str, ...] = FP16_KEEP_GROUPS  # fp16: what stays fp32 (precision.FP16_KEEP_GROUPS)

    def __post_init__(self) -> None:
        self.check()  # an invalid one cannot be built

    def check(self) -> str:
        """Refuse an unknown profile, dtype or method, or fp16 with quantized weights; returns the dtype."""
        if self.fusion != "none":  # the profiles import onnxscript: only when one is asked for
            from gpt2onnx.passes.fusions.profiles import check_profile

            check_profile(self.fusion)
        self.quantization.check()
        dtype = check_dtype(self.dtype, self.quantization.method)
        keep = parse_keep_fp32(self.keep_fp32)
        if dtype != "float16" and keep != FP16_KEEP_GROUPS:
            raise BadInput("--keep-fp32 applies to fp16 models only: add --dtype fp16, or leave --keep-fp32 out")
        return dtype

    @property
    def precision(self) -> str:
        """The key of the parity gates: the quantization method, else the dtype."""
        method = self.quantization.method
        return method if method != "none" else check_dtype(self.dtype)

    def apply(self, model: onnx.ModelProto, timings: dict[str, float]) -> PassResult:
        """Run the passes in order: fusion profile, fp16, weight quantization."""
        result = PassResult(model)
        if self.fusion != "none":
            from gpt2onnx.passes.fusions import fuse

            start = time.perf_counter()
            result.model, result.fusion = fuse(result.model, self.fusion, allow_partial=self.allow_partial_fusion)
            timings["fusion_seconds"] = time.perf_counter() - start
        if self.check() == "float16":
            from gpt2onnx.passes.precision import to_fp16

            start = time.perf_counter()
            result.model, result.fp16 = to_fp16(result.model, keep_fp32=parse_keep_fp32(self.keep_fp32))
            timings["fp16_seconds"] = time.perf_counter() - start
        if self.quantization.method != "none":
            from gpt2onnx.passes.precision import quantize

            start = time.perf_counter()
            result.model, result.quantization = quantize(result.model, self.quantization)
            timings["quantize_seconds"] = time.perf_counter() - start
        shared = any(n.op_type == "GroupQueryAttention" for n in result.model.graph.node)
        result.kv_cache = "shared" if shared else "concat"
        return result
