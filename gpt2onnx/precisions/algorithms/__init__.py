"""int4's weight algorithms as plug-ins: one module per algorithm, each declaring an :class:`Int4Algorithm`
(its name, what it does, whether it needs calibration text, the weight error it is judged by, and the
onnxruntime quantizer configuration it builds), listed in :mod:`gpt2onnx.precisions.algorithms.all_algorithms`."""
