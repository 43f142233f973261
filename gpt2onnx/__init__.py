"""gpt2onnx: GPT-2 from a PyTorch checkpoint to a verified, fast ONNX decoder with past key/values."""

__version__ = "0.1.0"
