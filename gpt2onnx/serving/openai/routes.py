"""The ASGI app: OpenAI's routes under ``/v1`` over one :class:`~gpt2onnx.serving.engine.BatchingEngine`, health
and readiness, Prometheus metrics; every error in OpenAI's body with its status.

- ``POST /v1/completions`` (:mod:`gpt2onnx.serving.openai.serving`); ``POST /v1/chat/completions``: the messages
  rendered by the folder's chat template (:mod:`gpt2onnx.serving.openai.chat`), then completed; 400 naming what
  the folder lacks where its tokenizer has no chat template (GPT-2 has none); ``GET /v1/models``.
- ``GET /health``: 200 while the process runs; ``GET /ready``: 503 until the engine is loaded (every ``/v1`` route
  answers 503 until then too); ``GET /metrics``: Prometheus' text format.
- ``/v1`` needs ``Authorization: Bearer KEY`` where the server has an API key (401 otherwise); a body above
  ``max_body`` bytes is 413, before it is parsed; a full queue is 429.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from gpt2onnx.artifact.tokenizer import TOKENIZER_CONFIG
from gpt2onnx.errors import Gpt2OnnxError
from gpt2onnx.serving.engine import BatchingEngine
from gpt2onnx.serving.openai.chat import ChatTemplate
from gpt2onnx.serving.openai.prometheus import CONTENT_TYPE, Metrics
from gpt2onnx.serving.openai.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Model,
    error_body,
    parse,
)
from gpt2onnx.serving.openai.serving import CompletionServing

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20  # a request body: 1 MiB (a prompt is at most 64 bytes per position, ids fewer)
MAX_DRAIN_BYTES = 64 << 20  # a larger body is still read (and dropped) up to this, so the client sees the 413


@dataclass(frozen=True)
class ServerSettings:
    """The server's settings: ``model_id`` (the folder's name: what ``model`` must say), ``api_key`` (None: no
    key), ``max_batch`` (requests decoded together), ``max_queue`` (requests waiting beyond those),
    ``body_seconds`` (to send a request's body)."""

    model_id: str
    api_key: str | None = None
    max_batch: int = 16
    max_queue: int = 256
    max_body: int = MAX_BODY_BYTES
    body_seconds: float = 30.0  # a body not all sent within this is answered 408


class _State:
    """The engine once it is loaded (``None`` until then), or why it could not be."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.engine: BatchingEngine | None = None
        self.serving: CompletionServing | None = None
        self.failed: str | None = None
        self.created = int(time.time())
        self.metrics = Metrics(self.load)
        self.chat_template: ChatTemplate | None = None

    def load(self) -> tuple[int, int]:
        return self.engine.load if self.engine is not None else (0, 0)

    def ready(self) -> CompletionServing:
        if self.serving is None:
            why = f"the model could not be loaded: {self.failed}" if self.failed else "the model is loading"
            raise ApiError(503, f"{why}: retry later", type="service_unavailable", code="not_ready")
        return self.serving


def build_app(
    settings: ServerSettings,
    open_engine: Callable[[], BatchingEngine],
    *,
    folder: Path | None = None,
    on_failed: Callable[[str], None] | None = None,
) -> FastAPI:
    """The app; ``open_engine`` loads the engine on a thread when the app starts (``/ready`` is 503 until it
    returns), and the engine is closed when the app stops. ``on_failed``: called with the one-line reason where
    it raises. ``folder``: where the chat template would be read."""
    state = _State(settings)

    def load() -> None:
        try:
            template = ChatTemplate.from_folder(folder) if folder is not None else None
            engine = open_engine()
        except Exception as err:  # logged in one line; the server answers 503 naming it
            state.failed = (str(err).splitlines() or [type(err).__name__])[0]
            if on_failed is not None:
                on_failed(state.failed)
            else:
                log.error("cannot load the model: %s", state.failed)
            return
        state.chat_template = template
        state.engine = engine
        state.serving = CompletionServing(
            engine, settings.model_id, max_queue=settings.max_queue, metrics=state.metrics
        )
        log.info("model %s loaded: ready", settings.model_id)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = threading.Thread(target=load, name="gpt2onnx-load", daemon=True)
        loader.start()
        yield
        loader.join()
        if state.engine is not None:
            state.engine.close()

    app = FastAPI(title="gpt2onnx", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gpt2onnx = state

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return _error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        message = f"{request.method} {request.url.path}: {err.detail}"
        return _error_response(ApiError(err.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        log.exception("request failed")
        message = str(err) if isinstance(err, Gpt2OnnxError) else "internal error"
        return _error_response(ApiError(500, message, type="server_error"))

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        route = request.scope.get("route")
        state.metrics.requests.labels(getattr(route, "path", "other"), str(response.status_code)).inc()
        return response

    def authorize(request: Request) -> None:
        key = settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            what = "no API key was given" if not given else "the API key is wrong"
            raise ApiError(401, f"{what}: send the server's key as 'Authorization: Bearer KEY'", code="invalid_api_key")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        state.ready()
        return {"status": "ready", "model": settings.model_id}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        ids = state.serving.models() if state.serving is not None else [settings.model_id]  # BASE:NAME per adapter
        models = [Model(id=i, created=state.created, object="model", owned_by="gpt2onnx") for i in ids]
        return {"object": "list", "data": [m.model_dump(mode="json", exclude_unset=True) for m in models]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        serving = state.ready()
        body = parse(CompletionRequest, await _read_json(request, settings.max_body, settings.body_seconds))
        result = await serving.create(body, request.is_disconnected)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        serving = state.ready()
        body = parse(ChatCompletionRequest, await _read_json(request, settings.max_body, settings.body_seconds))
        serving.adapter_of(body.model)  # the base, BASE:NAME, or 404 model_not_found
        if state.chat_template is None:
            raise ApiError(
                400,
                f"the model '{settings.model_id}' has no chat template (no chat_template in its"
                f" {TOKENIZER_CONFIG}): it continues text, so use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        result = await serving.chat(body, state.chat_template, request.is_disconnected)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


def _error_response(err: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


async def _read_json(request: Request, limit: int, seconds: float):
    """The body as JSON: 413 past ``limit`` bytes (declared or read), 408 where it has not all come in ``seconds``
    (a client that never finishes it), 400 where it is not JSON."""
    try:
        body = await asyncio.wait_for(_read_body(request, limit), seconds)
    except asyncio.TimeoutError:
        raise ApiError(
            408, f"the request body did not all arrive within {seconds:g} s: send it at once", code="request_timeout"
        ) from None
    try:
        return json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as err:
        detail = str(err).splitlines()[0][:120] if not isinstance(err, RecursionError) else "nested too deeply"
        raise ApiError(400, f"the request body is not valid JSON ({detail})", code="invalid_json") from None


async def _read_body(request: Request, limit: int) -> bytearray:
    declared = request.headers.get("content-length")
    too_large = ApiError(413, f"the request body is larger than {limit:,} bytes: send less", code="body_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        if int(declared) <= MAX_DRAIN_BYTES:
            async for _ in request.stream():  # read and dropped: a client still sending would not see the 413
                pass
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return body


__all__ = ["ServerSettings", "build_app", "error_body"]
