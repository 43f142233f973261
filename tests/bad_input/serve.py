"""gpt2onnx serve: the files it serves (never one outside the folder), hostile requests, clients that go away."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Callable

from tests.bad_input.common import B, Case, Ctx, Outcome, finish

CASES: list[Case] = [
    Case("serve-missing-folder", "message", ("serve", "nope"), B, match="is not a folder"),
    Case("serve-not-a-web-folder", "message", ("serve", "{dir}"), B, match="has no index.html"),
    Case(
        "serve-model-max-batch-zero",
        "options",
        ("serve", "{exp}", "--max-batch", "0", "--port", "0"),
        B,
        match="--max-batch 0 is not an integer from 1 to 256",
    ),
    Case(
        "serve-web-folder-model-options",
        "options",
        ("serve", "{dir}", "--api-key", "k", "--port", "0"),
        B,
        lambda c: (c.dir / "index.html").write_text("<p>hi</p>"),
        match="for the OpenAI endpoint, and .* is served as a web folder",
    ),
    Case(
        "serve-port-bogus",
        "options",
        ("serve", "{dir}", "--port", "70000"),
        B,
        lambda c: (c.dir / "index.html").write_text("<p>hi</p>"),
        match="not a port number",
    ),
    # the OpenAI endpoint's header and body timeouts (issue 54): above 0, at most an hour, a number
    *(
        Case(
            f"serve-{flag}-{name}",
            "options",
            ("serve", "{exp}", f"--{flag}", value, "--port", "0"),
            B,
            match=f"--{flag} .* is not a number of seconds above 0 and at most 3600",
        )
        for flag in ("header-timeout", "body-timeout")
        for name, value in (("zero", "0"), ("negative", "-1"), ("nan", "nan"), ("huge", "1e9"))
    ),
    Case(
        "serve-web-folder-timeout",
        "options",
        ("serve", "{dir}", "--body-timeout", "5", "--port", "0"),
        B,
        lambda c: (c.dir / "index.html").write_text("<p>hi</p>"),
        match="--body-timeout: for the OpenAI endpoint",
    ),
]


# -- serve: what it serves is what it checked ------------------------------------------------------------------
SECRET = "the-secret-outside-the-folder"
SITE = ("site", "secret.html")  # what a serve case sets up as it runs (served, never written by serve)


def _site(c: Ctx, **links: str) -> Path:
    """A served folder 'site' (index.html, a 4 MB file, a manifest naming a local path) beside a secret file;
    ``links``: site-relative path → link target ({secret}: the secret file)."""
    site = c.dir / "site"
    (site / "sub").mkdir(parents=True)
    (site / "index.html").write_text("<p>the page</p>")
    (site / "sub" / "index.html").write_text("<p>sub</p>")
    (site / "config.json").write_text('{"the": "config"}')
    (site / "big.bin").write_bytes(os.urandom(4 << 20))
    (site / "gpt2onnx.json").write_text(json.dumps({"source": {"path": str(c.dir / "private" / "checkpoint")}}))
    (c.dir / "secret.html").write_text(SECRET)
    for rel, target in links.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            path.unlink()
        path.symlink_to(target.format(secret=c.dir / "secret.html"))
    return site


def _serving(c: Ctx, cli, requests: Callable[[str], None], **links: str) -> Outcome:
    """``gpt2onnx serve site --port 0`` for real; ``requests(url)`` runs against it, then Ctrl-C (SIGINT) stops it."""
    _site(c, **links)
    proc = cli(["serve", "site", "--port", "0"], c, wait=False)
    try:
        line = proc.stdout.readline()
        url = line.split(" at ")[1].split()[0] if " at " in line else None
        assert url, f"serve printed no address: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        requests(url)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    return finish(proc, 30)


def _raw(url: str, request: bytes) -> bytes:
    """One raw HTTP/1.0 exchange (a request line the standard clients would never send)."""
    import socket

    host, port = url.split("//")[1].strip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    return data


def _status(url: str, path: str) -> tuple[int, bytes]:
    reply = _raw(url, f"GET {path} HTTP/1.0\r\n\r\n".encode())
    return int(reply.split(b" ", 2)[1]), reply


def _never_secret(path: str, allowed: tuple[int, ...]) -> Callable[[Ctx, Callable], Outcome]:
    def run(c: Ctx, cli) -> Outcome:
        def requests(url: str) -> None:
            code, reply = _status(url, path)
            assert SECRET.encode() not in reply, f"GET {path} served the file outside the folder"
            assert code in allowed, f"GET {path}: {code}"

        return _serving(c, cli, requests, **_SERVE_LINKS)

    return run


_SERVE_LINKS = {
    "index.html": "{secret}",
    "sub/index.html": "{secret}",
    "http:/x/config.json": "{secret}",  # what the absolute form used to be served from
}


def _absolute_form(c: Ctx, cli) -> Outcome:
    def requests(url: str) -> None:
        code, reply = _status(url, "http://x/config.json")
        assert SECRET.encode() not in reply and code == 200 and b'{"the": "config"}' in reply, reply[:300]

    return _serving(c, cli, requests, **_SERVE_LINKS)


def _manifest_not_served(c: Ctx, cli) -> Outcome:
    def requests(url: str) -> None:
        code, reply = _status(url, "/gpt2onnx.json")
        assert code == 404 and str(c.dir).encode() not in reply, reply[:300]

    return _serving(c, cli, requests)


def _clients_go_away(c: Ctx, cli) -> Outcome:
    """200 clients that reset the connection mid-download: no traceback, the server still serves."""
    import socket
    import struct

    def requests(url: str) -> None:
        host, port = url.split("//")[1].strip("/").split(":")
        for _ in range(200):
            with socket.create_connection((host, int(port)), timeout=20) as sock:
                sock.sendall(b"GET /big.bin HTTP/1.0\r\n\r\n")
                sock.recv(1024)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
        code, reply = _status(url, "/config.json")
        assert code == 200, reply[:200]

    out = _serving(c, cli, requests)
    assert len([line for line in out.stderr.splitlines() if line.strip()]) <= 1, out.stderr[-2000:]
    return out


CASES += [
    # -- serve -----------------------------------------------------------------------------------------------------
    *(
        Case(name, cls, (), 0, run=run, timeout=timeout, creates=SITE)
        for name, cls, run, timeout in (
            ("serve-index-link-outside", "security", _never_secret("/", (403, 404)), 60),
            ("serve-sub-index-link-outside", "security", _never_secret("/sub/", (403, 404)), 60),
            ("serve-absolute-form", "security", _absolute_form, 60),
            ("serve-manifest-local-paths", "security", _manifest_not_served, 60),
            ("serve-clients-go-away", "traceback", _clients_go_away, 120),
        )
    ),
]


def _serve_per_request(c: Ctx, cli) -> Outcome:
    """Probes of an index.html that leads out of the folder poison nothing: once it is a page inside the folder,
    '/' serves it; a folder without index.html is 404, never a redirect to a listing; 'file/' on a file is 404."""

    def requests(url: str) -> None:
        for path in ("/", "/index.html", "/index.html/", "//index.html", "/"):
            code, reply = _status(url, path)
            assert SECRET.encode() not in reply and code in (403, 404), (path, code)
        index = c.dir / "site" / "index.html"
        index.unlink()
        (c.dir / "site" / "page.html").write_text("<p>the page</p>")
        index.symlink_to("page.html")  # a link inside the folder
        for path in ("/", "/index.html"):
            code, reply = _status(url, path)
            assert code == 200 and b"<p>the page</p>" in reply, (path, code, reply[:300])
        (c.dir / "site" / "lib").mkdir()
        (c.dir / "site" / "lib" / "a.js").write_text("export {}")
        for path, expected in (("/lib", 404), ("/lib/", 404), ("/config.json/", 404), ("/lib/a.js/", 404)):
            code, reply = _status(url, path)
            assert code == expected and b"Location" not in reply and b"a.js" not in reply, (path, code, reply[:300])

    return _serving(c, cli, requests, **{"index.html": "{secret}"})


CASES += [
    Case("serve-decides-per-request", "security", (), 0, run=_serve_per_request, creates=(*SITE, "site"), timeout=60),
]
