from gpt2onnx.cli import app

app(prog_name="gpt2onnx")
