"""The exported folder and its ONNX contract: IO names, dims and dtypes (contract), ONNX files (graph), the
folder format with its manifest, staging and integrity (folder), check reports (report), and inspect.

Only onnx and json here, never torch: every other layer builds on this one.
"""
