"""A local Triton Inference Server on a repository that ``deploy --target triton`` wrote: the ``tritonserver``
binary that PyPI's ``nvidia-pytriton`` bundles (Triton 2.51 with its Python backend), started on 127.0.0.1.

The tests and gpt2onnx bench served use it; so can anyone trying the repository on one machine::

    with TritonServer("models/gpt2/triton", models=["gpt2-generate", "gpt2-infer"]) as server:
        print(server.http_url)  # POST {url}/v2/models/gpt2-generate/generate_stream

The server's Python is a virtual environment with nvidia-pytriton, onnxruntime, onnx, numpy, tokenizers and
gpt2onnx (``--no-deps``): ``$GPT2ONNX_TRITON_PYTHON``, else ``.venv-triton`` beside this package
(scripts/setup.sh creates it). nvidia-pytriton ships one Python-backend stub per Python version and leaves
choosing it to its own launcher; here a backend folder in a temporary directory links the backend library and
copies the stub for the environment's Python. Two settings make the stub run that environment:
``PATH`` starts with its ``bin/`` (the embedded interpreter finds its ``pyvenv.cfg`` there), and
``LD_LIBRARY_PATH`` names the ``lib/`` of the Python it was made from (with a Python built outside Debian,
the stub otherwise loads Debian's ``libpython3.x.so`` and crashes). On a machine without a GPU the server logs
CUDA and NVML errors at start-up, then serves. The ONNX Runtime backend is not in the bundle (it is in
NVIDIA's containers only), so only the models named in ``models`` are loaded (``--model-control-mode
explicit``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from gpt2onnx.errors import BadInput, RuntimeUnavailable

log = logging.getLogger(__name__)

PYTHON_ENV = "GPT2ONNX_TRITON_PYTHON"
INSTALL = (
    "bash scripts/setup.sh (it creates .venv-triton with nvidia-pytriton), or set"
    f" {PYTHON_ENV} to a Python that has nvidia-pytriton, onnxruntime, onnx, tokenizers and gpt2onnx"
)
_PROBE = """
import json, sys, sysconfig, pathlib
import pytriton, gpt2onnx, onnxruntime, tokenizers
root = pathlib.Path(pytriton.__file__).parent
print(json.dumps({
    "tritonserver": str(root / "tritonserver"),
    "libs": str(root.parent / "nvidia_pytriton.libs"),
    "version": f"{sys.version_info[0]}.{sys.version_info[1]}",
    "libdir": sysconfig.get_config_var("LIBDIR") or "",
    "bin": str(pathlib.Path(sys.executable).parent),
}))
"""


def triton_python() -> str | None:
    """The server's Python: $GPT2ONNX_TRITON_PYTHON, else <repo>/.venv-triton/bin/python where it exists."""
    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV]
    candidate = Path(__file__).resolve().parents[2] / ".venv-triton" / "bin" / "python"
    return str(candidate) if candidate.exists() else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TritonServer:
    """``tritonserver`` on ``repository`` with the ``models`` loaded, listening on 127.0.0.1 only (free ports
    unless given). Starts in the constructor and waits until every model is ready (RuntimeUnavailable with the
    end of its log otherwise); :meth:`stop` (or leaving the ``with`` block) stops it with SIGTERM and waits for
    it to exit."""

    # 63 lines: the server's start-up in order (its Python, the ports, the process, waiting for readiness), each
    # step undone by the ones before it when it fails.
    def __init__(
        self,
        repository: str | Path,
        *,
        models: list[str],
        python: str | None = None,
        http_port: int | None = None,
        grpc_port: int | None = None,
        timeout: float = 120.0,
        log_file: str | Path | None = None,
    ):
        self.process, self._log, self._workdir, self.final_log = None, None, None, ""
        self.repository = Path(repository).resolve()
        if not self.repository.is_dir():
            raise BadInput(f"Triton model repository '{repository}' is not a folder: deploy --target triton first")
        missing = [m for m in models if not (self.repository / m / "config.pbtxt").is_file()]
        if missing or not models:
            raise BadInput(f"model {', '.join(missing) or '(none)'} is not in '{self.repository}': name its folders")
        python = python or triton_python()
        if python is None:
            raise RuntimeUnavailable(f"no Python for Triton (nvidia-pytriton): {INSTALL}")
        probe = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
        if probe.returncode != 0:
            lines = (probe.stderr or probe.stdout).strip().splitlines() or ["no output"]
            raise RuntimeUnavailable(f"the Python '{python}' cannot run Triton's models ({lines[-1]}): {INSTALL}")
        found = json.loads(probe.stdout.strip().splitlines()[-1])
        self.models = list(models)
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = free_port()
        self._workdir = tempfile.TemporaryDirectory(prefix="gpt2onnx-triton-")
        backends = self._backends(Path(found["tritonserver"]), found["version"])
        env = dict(os.environ)
        env["PATH"] = f"{found['bin']}{os.pathsep}{env.get('PATH', '')}"
        libs = [p for p in (found["libdir"], found["libs"], env.get("LD_LIBRARY_PATH")) if p]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
        command = [
            str(Path(found["tritonserver"]) / "bin" / "tritonserver"),
            f"--model-repository={self.repository}",
            f"--backend-directory={backends}",
            "--model-control-mode=explicit",
            *(f"--load-model={m}" for m in self.models),
            "--http-address=127.0.0.1",
            f"--http-port={self.http_port}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={self.grpc_port}",
            "--allow-metrics=false",
            f"--metrics-port={self.metrics_port}",
            "--exit-timeout-secs=20",
        ]
        self.log_path = (
            Path(log_file) if log_file else Path(self._workdir.name) / "tritonserver.log"
        )  # beside the backends
        self._log = open(self.log_path, "wb")
        log.info("starting %s", " ".join(command))
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=self._workdir.name
        )
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _backends(self, root: Path, version: str) -> Path:
        stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.is_file():
            raise RuntimeUnavailable(f"nvidia-pytriton has no Python-backend stub for Python {version}: {INSTALL}")
        python = Path(self._workdir.name) / "backends" / "python"
        python.mkdir(parents=True)
        for item in (root / "backends" / "python").iterdir():
            if item.is_file():
                (python / item.name).symlink_to(item)
        shutil.copy(stub, python / "triton_python_backend_stub")
        return python.parent

    def log_tail(self, lines: int = 20) -> str:
        self._log.flush()
        text = self.log_path.read_bytes().decode("utf-8", "replace").splitlines()
        return "\n".join(text[-lines:])

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        urls = [f"{self.http_url}/v2/models/{m}/ready" for m in self.models]
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeUnavailable(
                    f"tritonserver exited with code {self.process.returncode} before it was ready:\n{self.log_tail()}"
                )
            if all(_ok(url) for url in urls):
                return
            time.sleep(0.25)
        raise RuntimeUnavailable(f"tritonserver was not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then wait (SIGKILL after ``timeout`` seconds); returns the exit code. The server's log stays
        readable in ``final_log``."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver did not stop within %.0f s: killed", timeout)
                self.process.kill()
                self.process.wait()
        if self._log is not None and not self._log.closed:
            self._log.close()
        if self._workdir is not None:
            self.final_log = self.log_path.read_bytes().decode("utf-8", "replace") if self.log_path.exists() else ""
            self._workdir.cleanup()
            self._workdir = None
        return self.process.returncode if self.process is not None else None


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False
