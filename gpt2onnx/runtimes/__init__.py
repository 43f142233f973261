"""Running an exported folder: the runtime interface and registry (base), one module per runtime (onnxruntime
with its execution providers, openvino, genai with its worker), the decoder stepper (decoder), the decode loop
(generate), prompts and detokenization (prompts), and measurement (timing).

Needs onnx, onnxruntime and numpy only, never torch: a deployment machine can run and measure a model.
OpenVINO and onnxruntime-genai are imported only when their runtime is asked for.
"""
