"""Graph passes on an ONNX decoder: fusion rules by profile (fusions), and the ordered pipeline export and optimize
share (pipeline: fusion, then the precision's own pass from gpt2onnx.precisions). onnx, onnxscript and
onnxruntime's tools only, never torch."""
