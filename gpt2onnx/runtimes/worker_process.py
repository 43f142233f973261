"""A worker process under another Python (another environment's), asked one JSON line at a time.

The wire, as the workers write it (gpt2onnx.runtimes.genai_worker, gpt2onnx.benchmarks.compare.engine_worker): one JSON
request per line; each answer one JSON line, then, when it has ``"npz": N``, N bytes of an .npz archive, whose arrays
come back under ``"arrays"``. An answer ``{"error": "..."}`` raises :class:`RuntimeUnavailable` with that line.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import signal
import subprocess
from pathlib import Path

import numpy as np

from gpt2onnx.errors import RuntimeUnavailable


class WorkerProcess:
    """``python -I script`` in its own process group; ``name`` names it in messages ("the genai worker"),
    ``python_hint`` says what the Python must have when it answers as something else, ``timeout_hint`` how to wait
    longer. ``timeout``: seconds one answer may take, after which the worker is stopped."""

    def __init__(self, python: str, script: Path, *, name: str, timeout: float, python_hint: str, timeout_hint: str,
                 env: dict | None = None):  # fmt: skip
        self.python, self.name, self.timeout = python, name, timeout
        self.python_hint, self.timeout_hint = python_hint, timeout_hint
        # -I: isolated, and without the script's folder on sys.path (where runtimes/onnxruntime.py would shadow the
        # onnxruntime package); OSError (no such Python) is the caller's to word
        self.process: subprocess.Popen | None = subprocess.Popen(
            [python, "-I", str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopped whole where it hangs
            env=env,
        )

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def ask(self, request: dict) -> dict:
        if self.process is None:
            raise RuntimeUnavailable(f"{self.name} is closed")
        try:  # a worker that exited may still have said something first: its output is read below either way
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass
        ready, _, _ = select.select([self.process.stdout], [], [], self.timeout)
        if not ready:  # a worker that never answers: stopped, not waited on forever
            with contextlib.suppress(OSError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise RuntimeUnavailable(
                f"{self.name} ({self.python}) gave no answer within {self.timeout:g} s: it was stopped"
                f" ({self.timeout_hint})"
            )
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeUnavailable(f"{self.name} exited (code {self.process.wait()})")
        try:
            answer = json.loads(line)
            if not isinstance(answer, dict):
                raise ValueError
        except (ValueError, RecursionError):
            raise RuntimeUnavailable(
                f"'{self.python}' answered {line[:60].decode(errors='replace').strip()!r}, not as gpt2onnx's"
                f" {self.name.removeprefix('the ')} does: {self.python_hint}"
            ) from None
        if "npz" in answer:
            arrays = np.load(io.BytesIO(self.process.stdout.read(answer.pop("npz"))))
            answer["arrays"] = {name: arrays[name] for name in arrays.files}
        if "error" in answer:
            raise RuntimeUnavailable(answer["error"])
        return answer

    def close(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                self.process.stdin.write(b'{"op": "close"}\n')
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                with contextlib.suppress(OSError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None


ENGINES_PYTHON_ENV = "GPT2ONNX_ENGINES_PYTHON"


def engines_python() -> str | None:
    """The engines' Python (compare's engines, llama.cpp's server): $GPT2ONNX_ENGINES_PYTHON, else
    <repo>/.venv-engines/bin/python if present."""
    if os.environ.get(ENGINES_PYTHON_ENV):
        return os.environ[ENGINES_PYTHON_ENV]
    candidate = Path(__file__).resolve().parents[2] / ".venv-engines" / "bin" / "python"
    try:
        return str(candidate) if candidate.exists() else None
    except OSError:  # another user's folder on the way: as good as none
        return None
