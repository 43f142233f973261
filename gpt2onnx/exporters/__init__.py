"""torch → ONNX: the IO contract, the export itself, validation, and the exported folder on disk."""
