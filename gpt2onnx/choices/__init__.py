"""The choices a combination is made of, as declarations (gpt2onnx.capabilities): what a folder already is, read
from its graph (of_folder), and the registered alternatives of each graph-side axis (axes)."""
