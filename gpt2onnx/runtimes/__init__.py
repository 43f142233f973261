"""Running exported models: ONNX Runtime sessions, the decode runner, parity against PyTorch."""
