"""The server's guard against clients that hold connections without finishing a request (imported with uvicorn).

uvicorn's h11 protocol times out only a keep-alive connection that stays silent after a response: a fresh
connection that sends nothing, or sends its headers a byte at a time (slowloris), is held forever. Here a
connection gets ``header_seconds`` to complete each request's headers (from when it opens, and from the end of each
response); one that has not is closed. A request whose headers came is the app's: its body has ``body_seconds``
(``routes._read_json``, 408 past it), and its response runs as long as it decodes.

The connection limit is kept here too, not by uvicorn's ``limit_concurrency`` (whose 503 is plain text, "Service
Unavailable"): each connection's app is wrapped in a small ASGI middleware (:func:`limited`) that, past
``max_connections`` connections or requests in flight, answers 503 in OpenAI's error body and closes the
connection, as uvicorn's would.
"""

from __future__ import annotations

import asyncio
import json
import logging

try:
    import resource
except ImportError:  # not on Windows: no limit is set there
    resource = None

from uvicorn.protocols.http.h11_impl import H11Protocol

from gpt2onnx.serving.openai.protocol import error_body

log = logging.getLogger(__name__)
HEADER_SECONDS = 10.0  # to send a request's headers (nginx's client_header_timeout is 60 s; slowloris needs less)
FD_RESERVE = 256  # descriptors kept for the model's files, the engine's threads and the logs


class _GuardedH11(H11Protocol):
    header_seconds = HEADER_SECONDS
    max_connections: int | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.max_connections is not None:
            self.app = limited(self.app, self.max_connections, lambda: max(len(self.connections), len(self.tasks)))

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_seconds, self._expired)

    def _disarm(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        serving = self.cycle is not None and not self.cycle.response_complete
        if not serving and not self.transport.is_closing():
            log.info("%s: no complete request in %g s: connection closed", self.client, self.header_seconds)
            self.transport.close()


def guarded_protocol(header_seconds: float, max_connections: int | None = None) -> type[H11Protocol]:
    """uvicorn's h11 protocol, each request's headers due within ``header_seconds``, and past ``max_connections``
    connections (or requests in flight) a 503 in OpenAI's error body (None: no limit)."""
    attributes = {"header_seconds": float(header_seconds), "max_connections": max_connections}
    return type("GuardedH11", (_GuardedH11,), attributes)


def limited(app, limit: int, count):
    """``app`` behind a limit: a request that arrives while ``count()`` (the server's connections or requests in
    flight, this one's included) is above ``limit`` gets OpenAI's 503 error body, and its connection is closed."""
    body = json.dumps(
        error_body(
            f"the server holds its most connections ({limit}): retry later", type="service_unavailable",
            code="too_many_connections",
        )
    ).encode()  # fmt: skip
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        (b"retry-after", b"1"),
    ]

    async def guarded(scope, receive, send) -> None:
        if scope["type"] != "http" or count() <= limit:
            await app(scope, receive, send)
            return
        log.warning("%d connections or requests, past the limit of %d: answered 503", count(), limit)
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return guarded


def connection_limit() -> int | None:
    """The most connections to hold: the process's descriptors (its soft limit raised to the hard one, at most
    65,536) less :data:`FD_RESERVE`. uvicorn answers 503 past it instead of failing to accept."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard if hard != resource.RLIM_INFINITY else 65536, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):  # kept as it is
            pass
    soft = 65536 if soft == resource.RLIM_INFINITY else soft
    return max(64, soft - FD_RESERVE)
