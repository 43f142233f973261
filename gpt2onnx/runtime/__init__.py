"""Running an exported folder: execution providers and sessions (providers), the decoder stepper (decoder),
the decode loop (generate), prompts and detokenization (prompts), and measurement (bench).

Needs onnx, onnxruntime and numpy only, never torch: a deployment machine can run and measure a model.
"""
