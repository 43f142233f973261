"""The error family: one base class, a subclass per kind of failure, each with the exit code the CLI gives it.

A Python caller catches the kind it cares about (``except CheckFailed``); the CLI turns any of them into one
line on stderr and the kind's exit code. Messages say what is wrong, with which input, and what to do, in
words that make sense both to a CLI user and to a caller of the Python API.
"""

from __future__ import annotations


def shown(value) -> str:
    """A name or value quoted for an error message, on one line: a control character (a newline, a NUL) is
    written as its escape, so a message stays the one line it is meant to be."""
    text = str(value)
    return f"'{text}'" if text.isprintable() else repr(text)


class Gpt2OnnxError(Exception):
    """Base of every error gpt2onnx raises on purpose: one line, what, where, what to do."""

    exit_code = 1


class BadInput(Gpt2OnnxError):
    """An argument, option or input file that cannot be used as given (exit code 2)."""

    exit_code = 2


class CheckpointError(BadInput):
    """A checkpoint or config that is not a GPT-2 this tool can export exactly, or that is unsafe to read."""


class ContractError(BadInput):
    """An ONNX file or folder that is not a model, or does not follow the decoder IO contract."""


class IntegrityError(BadInput):
    """A model folder whose files differ from what its manifest records."""


class CheckFailed(Gpt2OnnxError):
    """A model ran but did not match its reference within the gates (exit code 1). ``report``: the check."""

    exit_code = 1

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


class RuntimeUnavailable(Gpt2OnnxError):
    """A runtime, execution provider or device that cannot be used on this machine (exit code 3)."""

    exit_code = 3


class OutputError(Gpt2OnnxError):
    """An output that cannot be written: permissions, a full disk, a folder another run holds (exit code 4)."""

    exit_code = 4


EXIT_CODES = {
    "ok": 0,
    CheckFailed.__name__: CheckFailed.exit_code,
    BadInput.__name__: BadInput.exit_code,
    RuntimeUnavailable.__name__: RuntimeUnavailable.exit_code,
    OutputError.__name__: OutputError.exit_code,
}
