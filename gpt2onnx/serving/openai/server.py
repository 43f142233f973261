"""The OpenAI endpoint for an exported folder under uvicorn: bound first (its URL known, port 0 included), the model
loaded on a thread while ``/ready`` answers 503, SIGTERM or Ctrl-C draining the requests in flight before it
exits (uvicorn's graceful shutdown, then the engine closed).

Connections (the limits, and why): a request's headers are due within ``header_timeout`` seconds of the
connection opening or of the previous response (:mod:`.connections`: uvicorn itself waits forever for them), its
body within ``body_timeout`` (408 past it); a silent keep-alive connection is closed after ``KEEP_ALIVE_SECONDS``
(uvicorn's and vLLM's 5 s). The listen backlog is 2,048 (the kernel caps it at net.core.somaxconn). The connection
limit (kept by :mod:`.connections`, in place of uvicorn's ``limit_concurrency`` and its plain-text 503) counts idle
connections too, so a low one would let idle connections turn real requests away with 503: it is the descriptors
the process has (its soft limit raised to the hard one) less a reserve, so that past it a client gets a 503 in
OpenAI's error body rather than a refused accept; the requests decoding or waiting are bounded by ``--max-batch``
and ``--max-queue`` (429)."""

from __future__ import annotations

import errno
import logging
import socket
from dataclasses import dataclass
from pathlib import Path

from gpt2onnx.artifact.folder import open_folder
from gpt2onnx.artifact.manifest import MODEL_FILE
from gpt2onnx.errors import BadInput, Gpt2OnnxError, OutputError
from gpt2onnx.runtimes.heap import map_large_blocks
from gpt2onnx.runtimes.providers import ProviderConfig
from gpt2onnx.serving.engine import MAX_ROWS, BatchingEngine

log = logging.getLogger(__name__)
HOST = "127.0.0.1"
DRAIN_SECONDS = 60  # SIGTERM: the longest wait for the requests in flight
KEEP_ALIVE_SECONDS = 5  # a keep-alive connection silent this long after a response is closed
BODY_SECONDS = 30.0  # to send a request's body (at most 1 MiB: about 35 KB/s)
BACKLOG = 2048
MAX_QUEUE = 1 << 16
MAX_TIMEOUT = 3600.0  # the longest header or body timeout, in seconds


@dataclass
class OpenAIServer:
    """A bound server: ``url`` (http://host:port), ``folder``; :meth:`serve_forever` runs it until SIGTERM or
    Ctrl-C."""

    folder: Path
    url: str
    settings: object  # gpt2onnx.serving.openai.routes.ServerSettings
    _server: object
    _socket: socket.socket
    _failure: Gpt2OnnxError | None = None

    def serve_forever(self) -> None:
        """Serve until stopped; raises the error the model could not be loaded with (after the server stopped).
        The process's large blocks are mapped on their own from here (:func:`~gpt2onnx.runtimes.heap.map_large_blocks`:
        a served model's peak under load nearer its rest)."""
        map_large_blocks()
        try:
            self._server.run(sockets=[self._socket])
        finally:
            self._socket.close()
        if self._failure is not None:
            raise self._failure


def open_openai_server(
    folder: str | Path,
    *,
    host: str = HOST,
    port: int = 8000,
    api_key: str | None = None,
    max_batch: int = 16,
    max_queue: int = 256,
    # no onnxruntime arena: a batch's growing cache left it at its peak for good (124M int8 under 16 clients: 747
    # MB after the requests with it, 315 without; the same tokens/s within the rounds' spread)
    provider: ProviderConfig = ProviderConfig(arena=False),
    verify_files: bool = True,
    header_timeout: float | None = None,
    body_timeout: float = BODY_SECONDS,
    max_connections: int | None = None,
) -> OpenAIServer:
    """Check ``folder`` (an exported model folder) and the settings, and bind ``host``:``port`` (0: any free
    port); the model loads when :meth:`OpenAIServer.serve_forever` starts. BadInput (one line) for a bad folder,
    setting or taken port, or a chat template it refuses (:mod:`.chat`); BadInput naming the extra where fastapi,
    uvicorn, openai or jinja2 is not installed. ``header_timeout`` (None: 10 s) and ``body_timeout``: the seconds a
    client has to send a request's headers and its body (module docstring), each above 0 and at most an hour;
    ``max_connections``: the connections past which a request is answered 503 (None: the process's descriptors
    less a reserve)."""

    folder = Path(folder)
    what = "give an exported model folder, or one written by gpt2onnx deploy --target web"
    if not folder.is_dir():
        raise BadInput(f"'{folder}' is not a folder: {what}")
    if not (folder / MODEL_FILE).exists() and not (folder / "index.html").exists():
        raise BadInput(f"'{folder}' has no {MODEL_FILE} and has no index.html: {what}")
    open_folder(folder, verify_files=False)  # what is wrong with the folder is said now, not after binding
    for name, value, low, high in (
        ("--port", port, 0, 65535),
        ("--max-batch", max_batch, 1, MAX_ROWS),
        ("--max-queue", max_queue, 0, MAX_QUEUE),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise BadInput(f"{name} {value} is not an integer from {low} to {high}: give one")
    if api_key is not None and (not api_key.strip() or any(c.isspace() for c in api_key)):
        raise BadInput("--api-key is empty or holds spaces: give a key without spaces")
    for name, value in (("--header-timeout", header_timeout), ("--body-timeout", body_timeout)):
        wrong = isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT
        if value is not None and wrong:  # NaN and infinity too
            raise BadInput(f"{name} {value!r} is not a number of seconds above 0 and at most {MAX_TIMEOUT:g}: give one")
    if max_connections is not None and (
        isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1
    ):
        raise BadInput(f"max_connections {max_connections!r} is not a positive integer: give one")
    try:
        import uvicorn

        from gpt2onnx.serving.openai.chat import ChatTemplate
        from gpt2onnx.serving.openai.connections import HEADER_SECONDS, connection_limit, guarded_protocol
        from gpt2onnx.serving.openai.routes import ServerSettings, build_app
    except ImportError as err:
        raise BadInput(
            f"the OpenAI endpoint needs {err.name or 'its packages'}, which is not installed: pip install"
            " 'gpt2onnx[serve]'"
        ) from None
    ChatTemplate.from_folder(folder)  # a template it refuses is said now, in one line
    sock = _bind(host, port)
    settings = ServerSettings(
        model_id=folder.resolve().name, api_key=api_key, max_batch=max_batch, max_queue=max_queue,
        body_seconds=float(body_timeout),
    )  # fmt: skip
    holder: dict = {}

    def failed(reason: str) -> None:  # the model could not be loaded: the server stops, serve_forever raises
        holder["server"]._failure = BadInput(f"cannot serve '{folder}': {reason}")
        holder["server"]._server.should_exit = True

    app = build_app(
        settings,
        lambda: BatchingEngine.open(folder, max_batch=max_batch, provider=provider, verify_files=verify_files),
        folder=folder,
        on_failed=failed,
    )
    config = uvicorn.Config(
        app,
        log_level="warning",
        timeout_graceful_shutdown=DRAIN_SECONDS,
        lifespan="on",
        access_log=False,
        http=guarded_protocol(
            HEADER_SECONDS if header_timeout is None else header_timeout,
            connection_limit() if max_connections is None else max_connections,
        ),
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        limit_concurrency=None,  # kept by the protocol, with OpenAI's error body (.connections)
        backlog=BACKLOG,
    )
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    server = OpenAIServer(folder.resolve(), f"http://{shown}:{bound_port}", settings, uvicorn.Server(config), sock)
    holder["server"] = server
    return server


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise BadInput(f"--host {host!r} is not an address of this machine ({err.strerror}): give one") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise BadInput(
                f"port {port} on {host} is already in use: choose another --port (0: any free port)"
            ) from None
        if err.errno == errno.EACCES:
            raise BadInput(f"port {port} needs privileges here: choose a port above 1023") from None
        if err.errno == errno.EADDRNOTAVAIL:
            raise BadInput(f"--host {host} is not an address of this machine: give one") from None
        raise OutputError(f"cannot listen on {host}:{port} ({err.strerror or err})") from None
    sock.set_inheritable(True)
    return sock
