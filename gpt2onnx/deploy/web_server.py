"""A static server for a deployed web folder, on 127.0.0.1 only, with the headers the wasm thread pool needs.

onnxruntime-web runs its wasm kernels on several threads only when the page is cross-origin isolated
(SharedArrayBuffer): the server sends ``Cross-Origin-Opener-Policy: same-origin`` and
``Cross-Origin-Embedder-Policy: require-corp`` with every response. It serves files from inside the folder only:
a path that leaves it (``..``, a symbolic link pointing out), a hidden file (the lock and staging files) or a
folder without index.html is answered 404 (403 for what lies outside), and nothing is listed.
"""

from __future__ import annotations

import errno
import logging
import threading
from dataclasses import dataclass
from functools import partial
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from gpt2onnx.errors import BadInput, OutputError

HOST = "127.0.0.1"
ISOLATION_HEADERS = {
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Embedder-Policy": "require-corp",
    "Cross-Origin-Resource-Policy": "same-origin",
}
TYPES = {
    ".mjs": "text/javascript",
    ".js": "text/javascript",
    ".wasm": "application/wasm",
    ".json": "application/json",
    ".onnx": "application/octet-stream",
    ".onnx_data": "application/octet-stream",
    ".txt": "text/plain; charset=utf-8",
}

log = logging.getLogger(__name__)


class FolderHandler(SimpleHTTPRequestHandler):
    """Serves one folder (``directory``); GET and HEAD only."""

    extensions_map = {**SimpleHTTPRequestHandler.extensions_map, **TYPES}

    def __init__(self, *args, directory: str, **kwargs):
        self.root = Path(directory).resolve()
        super().__init__(*args, directory=str(self.root), **kwargs)

    def end_headers(self) -> None:
        for name, value in ISOLATION_HEADERS.items():
            self.send_header(name, value)
        self.send_header("Cache-Control", "no-cache")  # a redeployed folder is seen at once
        super().end_headers()

    def send_head(self):
        path = unquote(urlsplit(self.path).path)
        parts = [p for p in path.split("/") if p]
        if any(p == ".." or "\\" in p or "\0" in p for p in parts):
            self.send_error(HTTPStatus.FORBIDDEN, "outside the served folder")
            return None
        if any(p.startswith(".") for p in parts):
            self.send_error(HTTPStatus.NOT_FOUND)
            return None
        target = self.root.joinpath(*parts)
        try:
            real = target.resolve(strict=True)
        except (OSError, RuntimeError):
            self.send_error(HTTPStatus.NOT_FOUND)
            return None
        if not real.is_relative_to(self.root):  # a symbolic link leading out of the folder
            self.send_error(HTTPStatus.FORBIDDEN, "outside the served folder")
            return None
        if real.is_dir() and not (real / "index.html").is_file():
            self.send_error(HTTPStatus.NOT_FOUND)  # no listings
            return None
        if not real.is_dir() and not real.is_file():  # a FIFO, a device
            self.send_error(HTTPStatus.NOT_FOUND)
            return None
        return super().send_head()

    def list_directory(self, path):  # never reached (send_head refuses folders without index.html)
        self.send_error(HTTPStatus.NOT_FOUND)
        return None

    def log_message(self, format: str, *args) -> None:
        log.debug("%s %s", self.address_string(), format % args)


@dataclass
class WebServer:
    """A running server: ``url`` to open, ``close()`` to stop it (also as a context manager)."""

    folder: Path
    url: str
    httpd: ThreadingHTTPServer
    thread: threading.Thread | None = None

    def serve_forever(self) -> None:
        try:
            self.httpd.serve_forever()
        finally:
            self.httpd.server_close()

    def close(self) -> None:
        if self.thread:
            self.httpd.shutdown()  # stops serve_forever in its thread
        self.httpd.server_close()
        if self.thread:
            self.thread.join(timeout=10)

    def __enter__(self) -> WebServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_server(folder: str | Path, *, port: int = 8000, background: bool = False) -> WebServer:
    """Bind a server for ``folder`` on 127.0.0.1:``port`` (0: any free port). With ``background`` it already runs
    in a thread; else call ``serve_forever()``. Raises BadInput (the folder, the port) or OutputError (the port is
    taken)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BadInput(f"'{folder}' is not a folder: give the folder written by gpt2onnx deploy --target web")
    if not (folder / "index.html").is_file():
        raise BadInput(f"'{folder}' has no index.html: run gpt2onnx deploy {folder} --target web first")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise BadInput(f"--port {port} is not a port number: give one from 1 to 65535 (0: any free port)")
    try:
        httpd = ThreadingHTTPServer((HOST, port), partial(FolderHandler, directory=str(folder)))
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise BadInput(
                f"port {port} on {HOST} is already in use: choose another --port (0: any free port)"
            ) from None
        if err.errno == errno.EACCES:
            raise BadInput(f"port {port} needs privileges here: choose a port above 1023") from None
        raise OutputError(f"cannot listen on {HOST}:{port} ({err.strerror or err})") from None
    httpd.daemon_threads = True
    server = WebServer(folder.resolve(), f"http://{HOST}:{httpd.server_address[1]}/", httpd)
    if background:
        server.thread = threading.Thread(target=httpd.serve_forever, name="gpt2onnx-serve", daemon=True)
        server.thread.start()
    log.info("serving %s at %s", server.folder, server.url)
    return server
