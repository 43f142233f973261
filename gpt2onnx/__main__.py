"""``python -m gpt2onnx`` and the ``gpt2onnx`` console script: the CLI as a process."""

import sys


def main() -> None:
    """Import the CLI and build its commands (a few seconds: numpy, onnxruntime, typer), then run one. A Ctrl-C
    before the command starts ends as any interrupted command does, one line and exit code 130, never a traceback
    from inside an import."""
    try:
        from gpt2onnx.cli import app

        app(prog_name="gpt2onnx")
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)


if __name__ == "__main__":
    main()
