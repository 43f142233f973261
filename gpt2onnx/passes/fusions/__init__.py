"""Graph fusions: one rewrite rule per file (onnxscript's pattern rewriter on onnx-ir), applied in order by
profile (ort, ort-shared-kv, portable, tensorrt, onnx, onnx-static-kv), with a count per fusion and golden counts
as a guard."""

from gpt2onnx.passes.fusions.profiles import PROFILES, FusionReport, fuse, golden_counts

__all__ = ["PROFILES", "FusionReport", "fuse", "golden_counts"]
