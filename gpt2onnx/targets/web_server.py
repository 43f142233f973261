"""A static server for a deployed web folder, on 127.0.0.1 only, with the headers the wasm thread pool needs.

onnxruntime-web runs its wasm kernels on several threads only when the page is cross-origin isolated
(SharedArrayBuffer): the server sends ``Cross-Origin-Opener-Policy: same-origin`` and
``Cross-Origin-Embedder-Policy: require-corp`` with every response. It serves files from inside the folder only:
a path that leaves it (``..``, a symbolic link pointing out, a folder's index.html that is such a link), a hidden
file (the lock and staging files), the manifest (it records local paths), a FIFO or device, or a folder without
index.html is answered 404 (403 for what lies outside), and nothing is listed. A client that goes away
mid-download is one log line, never a traceback.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import sys
import threading
from dataclasses import dataclass
from functools import partial
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from gpt2onnx.errors import BadInput, OutputError

HOST = "127.0.0.1"
MANIFEST = "gpt2onnx.json"  # not served: it records where the folder came from (local paths)
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
    """Serves one folder (``directory``); GET and HEAD only. What it serves is what it checked: the request target
    is mapped to a path once (origin form ``/a/b`` or absolute form ``http://host/a/b``), the file actually opened
    (a folder's index.html included) is resolved and must lie inside the folder, and it is opened as a regular
    file; the standard handler's own path mapping is never used."""

    extensions_map = {**SimpleHTTPRequestHandler.extensions_map, **TYPES}

    def __init__(self, *args, directory: str, **kwargs):
        self.root = Path(directory).resolve()
        super().__init__(*args, directory=str(self.root), **kwargs)

    def end_headers(self) -> None:
        for name, value in ISOLATION_HEADERS.items():
            self.send_header(name, value)
        self.send_header("Cache-Control", "no-cache")  # a redeployed folder is seen at once
        super().end_headers()

    def translate_path(self, path: str) -> str:  # never used to open anything: see send_head
        raise NotImplementedError

    def request_parts(self) -> tuple[str, list[str]] | None:
        """The request target mapped once: (its path, the path's parts in the folder), or None (answered already)
        when it is refused."""
        target = self.path
        if not target.startswith("/"):  # absolute form (RFC 9112 3.2.2): its path only; nothing else is served
            split = urlsplit(target)
            if split.scheme not in ("http", "https") or not split.netloc:
                self.send_error(HTTPStatus.BAD_REQUEST, "request target is not a path")
                return None
            target = split.path or "/"
        path = unquote(target.split("?", 1)[0].split("#", 1)[0], errors="strict")
        parts = [p for p in path.split("/") if p]
        if any(p == ".." or "\\" in p or "\0" in p for p in parts):
            self.send_error(HTTPStatus.FORBIDDEN, "outside the served folder")
            return None
        if any(p.startswith(".") for p in parts) or parts == [MANIFEST]:
            self.send_error(HTTPStatus.NOT_FOUND)  # hidden files; the manifest (it records local paths)
            return None
        return path, parts

    def inside(self, path: Path) -> Path | None:
        """``path`` resolved, if it exists and lies inside the folder (a link leading out: None, 403 sent)."""
        try:
            real = path.resolve(strict=True)
        except (OSError, RuntimeError):
            self.send_error(HTTPStatus.NOT_FOUND)
            return None
        if not real.is_relative_to(self.root):  # a symbolic link leading out of the folder
            self.send_error(HTTPStatus.FORBIDDEN, "outside the served folder")
            return None
        return real

    def send_head(self):
        try:
            mapped = self.request_parts()
        except UnicodeDecodeError:
            self.send_error(HTTPStatus.BAD_REQUEST, "request target is not UTF-8")
            return None
        if mapped is None:
            return None
        path, parts = mapped
        real = self.inside(self.root.joinpath(*parts))
        if real is None:
            return None
        if path.endswith("/") and parts and not real.is_dir():  # 'file/': no such folder
            self.send_error(HTTPStatus.NOT_FOUND)
            return None
        if real.is_dir():
            index = real / "index.html"
            if not (index.exists() or index.is_symlink()):  # a folder without a page: nothing to redirect to
                self.send_error(HTTPStatus.NOT_FOUND)
                return None
            if not path.endswith("/"):  # as the standard handler: /sub -> /sub/
                self.send_response(HTTPStatus.MOVED_PERMANENTLY)
                self.send_header("Location", "/" + "/".join(parts) + "/")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            real = self.inside(real / "index.html")  # the index is checked as any other file: no listings
            if real is None:
                return None
        try:  # the resolved path, opened without following a link and without blocking on a FIFO
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            self.send_error(HTTPStatus.NOT_FOUND)
            return None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # a FIFO, a device, a folder swapped in
            os.close(fd)
            self.send_error(HTTPStatus.NOT_FOUND)
            return None
        os.set_blocking(fd, True)
        handle = os.fdopen(fd, "rb")
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-type", self.guess_type(str(real)))
        self.send_header("Content-Length", str(info.st_size))
        self.send_header("Last-Modified", self.date_time_string(int(info.st_mtime)))
        self.end_headers()
        return handle

    def list_directory(self, path):  # never reached (send_head serves a folder's index.html only)
        self.send_error(HTTPStatus.NOT_FOUND)
        return None

    def log_message(self, format: str, *args) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """One log line, never a traceback: a client that goes away mid-download is no error of the server."""
        err = sys.exc_info()[1]
        if isinstance(err, (ConnectionError, TimeoutError)):
            log.info("%s:%s went away (%s)", *client_address[:2], type(err).__name__)
        else:
            log.warning("request from %s:%s failed (%s: %s)", *client_address[:2], type(err).__name__, err)


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


def is_web_folder(folder: str | Path) -> bool:
    """Whether ``folder`` is one deploy --target web wrote (it has index.html), not a model folder."""
    folder = Path(folder)
    return folder.is_dir() and (folder / "index.html").is_file()  # the folder first: its own error where it fails


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
        httpd = _Server((HOST, port), partial(FolderHandler, directory=str(folder)))
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise BadInput(
                f"port {port} on {HOST} is already in use: choose another --port (0: any free port)"
            ) from None
        if err.errno == errno.EACCES:
            raise BadInput(f"port {port} needs privileges here: choose a port above 1023") from None
        raise OutputError(f"cannot listen on {HOST}:{port} ({err.strerror or err})") from None
    server = WebServer(folder.resolve(), f"http://{HOST}:{httpd.server_address[1]}/", httpd)
    if background:
        server.thread = threading.Thread(target=httpd.serve_forever, name="gpt2onnx-serve", daemon=True)
        server.thread.start()
    log.info("serving %s at %s", server.folder, server.url)
    return server
