"""The gpt2onnx command line (``gpt2onnx = "gpt2onnx.cli:app"``): app (the Typer app, its error mapping, --help,
--version), flags (every option and argument declared once: the one module that calls typer.Option), options (the
groups commands share, built into their typed objects), commands, check_commands and bench_commands (one short
function per command: build the options, call one library function, render its result) and render (the results
as tables and lines)."""

# register the commands on the app, in the order --help lists them
from gpt2onnx.cli import commands  # noqa: F401, I001
from gpt2onnx.cli import bench_commands  # noqa: F401, I001
from gpt2onnx.cli import check_commands  # noqa: F401, I001
from gpt2onnx.cli.app import app
from gpt2onnx.cli.flags import OutputPath

__all__ = ["OutputPath", "app"]
