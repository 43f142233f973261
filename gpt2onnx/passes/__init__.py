"""Graph passes on an ONNX decoder: fusion rules by profile (fusions), fp16 and weight quantization
(precision), and the ordered pipeline export and optimize share (pipeline); graph_tools holds the helpers
they have in common. onnx, onnxscript and onnxruntime's tools only, never torch."""
