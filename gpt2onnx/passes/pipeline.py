"""The graph passes export and optimize share, in order: fusion profile, fp16, weight quantization."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import onnx

from gpt2onnx.errors import BadInput
from gpt2onnx.passes.precision import FP16_KEEP_GROUPS, QuantizeOptions, check_dtype, parse_keep_fp32


@dataclass(frozen=True)
class GraphPasses:
    fusion: str = "none"
    allow_partial_fusion: bool = False
    dtype: str = "fp32"
    quantization: QuantizeOptions = field(default_factory=QuantizeOptions)
    keep_fp32: tuple[str, ...] = FP16_KEEP_GROUPS  # fp16: what stays fp32 (precision.FP16_KEEP_GROUPS)

    def check(self) -> str:
        """Refuse an unknown profile, dtype or method, or fp16 with quantized weights; returns the dtype."""
        from gpt2onnx.passes.fusions.profiles import check_profile

        check_profile(self.fusion)
        if self.allow_partial_fusion and self.fusion == "none":
            raise BadInput("--allow-partial-fusion applies to a fusion profile: add --fusion, or drop it")
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

    def apply(self, model: onnx.ModelProto, timings: dict[str, float]) -> tuple[onnx.ModelProto, dict]:
        """Run the passes; returns the model and the manifest's reports (fusion, fp16, quantization, kv_cache)."""
        reports: dict = {"fusion": None, "fp16": None, "quantization": None, "kv_cache": None}
        if self.fusion != "none":
            from gpt2onnx.passes.fusions import fuse

            start = time.perf_counter()
            model, report = fuse(model, self.fusion, allow_partial=self.allow_partial_fusion)
            reports["fusion"] = report.as_dict()
            timings["fusion_seconds"] = time.perf_counter() - start
        if self.check() == "float16":
            from gpt2onnx.passes.precision import to_fp16

            start = time.perf_counter()
            model, reports["fp16"] = to_fp16(model, keep_fp32=parse_keep_fp32(self.keep_fp32))
            timings["fp16_seconds"] = time.perf_counter() - start
        if self.quantization.method != "none":
            from gpt2onnx.passes.precision import quantize

            start = time.perf_counter()
            model, reports["quantization"] = quantize(model, self.quantization)
            timings["quantize_seconds"] = time.perf_counter() - start
        # "shared": past and present may be one preallocated buffer (GroupQueryAttention, the ort-shared-kv
        # profile); deployment targets read it (genai: past_present_share_buffer). "concat": present = past + new.
        shared = any(n.op_type == "GroupQueryAttention" for n in model.graph.node)
        reports["kv_cache"] = "shared" if shared else "concat"
        return model, reports
