"""The gpt2onnx command line (``gpt2onnx = "gpt2onnx.cli:app"``): app (the Typer app, its error mapping, --help,
--version), options (each option declared once; the groups commands share, built into their typed objects),
commands (one short function per command: build the options, call one library function, render its result) and
render (the results as tables and lines)."""

from gpt2onnx.cli import commands  # noqa: F401  (registers the commands on the app)
from gpt2onnx.cli.app import app
from gpt2onnx.cli.options import OutputPath

__all__ = ["OutputPath", "app"]
