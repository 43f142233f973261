"""Precisions as plug-ins: one module per precision (fp32, fp16, int8, int4, ...), each declaring a
:class:`~gpt2onnx.precisions.precision.Precision` (its options, its weight pass, its gates and file checks, its
transformers.js dtype, the ops that identify its graphs), listed in :mod:`gpt2onnx.precisions.all_precisions`.
int4's weight algorithms are plug-ins of their own (:mod:`gpt2onnx.precisions.algorithms`). What the
quantizing precisions share is in :mod:`gpt2onnx.precisions.weights`.

A layer above artifact and below passes, runtimes and targets: onnx, numpy and onnxruntime's quantization tools,
never torch (HQQ's quantizer imports it itself, when asked for)."""
