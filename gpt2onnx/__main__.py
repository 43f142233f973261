"""``python -m gpt2onnx`` and the ``gpt2onnx`` console script: the CLI as a process."""

import os
import signal
import sys
import threading

_INTERRUPTED = (130, 143)  # Ctrl-C, SIGTERM


class _NativeImports:
    """While a native library's package runs its import (torch, onnxruntime, ...), a Ctrl-C waits until it is done,
    then lands in our code. Landing inside the import, it can be raised in Python code that the library's C++ calls
    (pybind11), where it cannot pass: the process then aborts ("terminate called after throwing an instance of
    'pybind11::error_already_set'", exit -6), seen once in a CI run of eval-json-interrupted. SIGINT is blocked
    for the import alone; the pending one is delivered when it is unblocked."""

    NATIVE = frozenset({"torch", "onnxruntime", "transformers", "onnx", "openvino", "tokenizers", "safetensors"})

    def find_spec(self, name, path=None, target=None):
        if name not in self.NATIVE or threading.current_thread() is not threading.main_thread():
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                run(module)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

        spec.loader.exec_module = exec_module
        return spec


def main() -> None:
    """Import the CLI and build its commands (a few seconds: numpy, onnxruntime, typer), then run one. A Ctrl-C
    before the command starts ends as any interrupted command does, one line and exit code 130, never a traceback
    from inside an import."""
    sys.unraisablehook = _unraisable
    sys.meta_path.insert(0, _NativeImports())
    try:
        from gpt2onnx.cli import app

        app(prog_name="gpt2onnx")
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        _end(130)
    except SystemExit as end:
        if end.code in _INTERRUPTED:
            _end(end.code)
        raise


def _unraisable(unraisable) -> None:
    """A Ctrl-C or SIGTERM that landed where Python cannot raise it (a weakref callback of the import system, a
    __del__) would be lost, printed as "Exception ignored" while the command goes on to write its files: it is
    delivered again, to land at the next line that can raise it."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        # sent again from another thread, so that it lands after this hook returns: raised here, its handler would
        # run inside the hook and be lost again ("Exception ignored in sys.unraisablehook", export-sigterm in CI)
        signum = getattr(unraisable.exc_value, "signum", signal.SIGINT)
        again = threading.Timer(0.001, os.kill, (os.getpid(), signum))
        again.daemon = True
        again.start()
        return
    sys.__unraisablehook__(unraisable)


def _end(code: int) -> None:
    """An interrupted command has cleaned up and said its line: the process ends now, with its code. Through the
    interpreter's shutdown CPython would end it by SIGINT instead, in about one Ctrl-C of ten, where the
    KeyboardInterrupt had crossed a C extension's PyRun call (an import under way when the Ctrl-C landed) before it
    was handled: the flag it sets then is never cleared."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or full stdout: nothing more can be said there
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
