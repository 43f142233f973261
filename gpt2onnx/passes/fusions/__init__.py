"""Graph fusions: one rewrite rule per file (onnxscript's pattern rewriter on onnx-ir), applied in order by a
profile (gpt2onnx.profiles) with a count per fusion and golden counts as a guard (fuse)."""
