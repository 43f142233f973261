"""The one exception type the CLI turns into a one-line error."""


class Gpt2OnnxError(Exception):
    """A problem with the user's input or environment, stated in one line: what, where, what to do."""
