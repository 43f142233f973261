"""Running an exported folder: the runtime interface (runtime) and registry (all_runtimes), one module per runtime,
each declaring its SPEC and its own settings (onnxruntime with its execution providers, openvino, genai with its
worker, ort_generate: onnxruntime's generation ops), and the decoder stepper (decoder).

Needs onnx, onnxruntime and numpy only, never torch: a deployment machine can run and measure a model.
OpenVINO and onnxruntime-genai are imported only when their runtime is opened.
"""
