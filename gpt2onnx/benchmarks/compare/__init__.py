"""gpt2onnx compare: our exports beside the engines users weigh us against, on one checkpoint, in one window."""
