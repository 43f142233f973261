"""One completion request turned into :class:`~gpt2onnx.serving.engine.BatchingEngine` submissions, one per choice
(prompts × ``n``), and their events turned into OpenAI's response: one body, or server-sent events in OpenAI's
chunk format ending with ``data: [DONE]``.

OpenAI's parameters map onto the options declared once (gpt2onnx.params): ``temperature`` 0 is greedy, above it
sampling (``Sampling``: temperature, ``top_p``, ``seed``, the choice's index added to it so that ``n`` seeded
choices differ); ``stop`` is ``Decoding.stop``, its string cut from the text as OpenAI returns it; ``logit_bias``,
``presence_penalty`` and ``frequency_penalty`` are a :class:`~gpt2onnx.decoding.processors.Bias`; ``max_tokens``
is ``max_new_tokens`` (16 when omitted, as OpenAI); ``logprobs`` come from the engine (the model's log-softmax,
before any processor). With ``echo`` they start with the prompt's tokens, as OpenAI's legacy completions give them
(what lm-evaluation-harness scores with): the first None, each later one given the tokens before it, from the
engine's prompt step (``submit(prompt_logprobs=)``); ``max_tokens`` 0 with ``echo`` returns the prompt only. A
request whose client goes away is cancelled in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from openai.types.chat import ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from openai.types.chat.chat_completion_token_logprob import TopLogprob

from gpt2onnx.decoding.processors import Bias
from gpt2onnx.errors import BadInput, Gpt2OnnxError
from gpt2onnx.generation_options import Decoding, Sampling
from gpt2onnx.serving.engine import BatchingEngine, GenerationStream, TokenEvent
from gpt2onnx.serving.openai.chat import chat_messages
from gpt2onnx.serving.openai.guided import GUIDED_FIELDS, constraint_of
from gpt2onnx.serving.openai.prometheus import Metrics
from gpt2onnx.serving.openai.protocol import (
    DEFAULT_MAX_TOKENS,
    MAX_CHOICES,
    MAX_STOP,
    ApiError,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    CompletionUsage,
    Logprobs,
    error_body,
)

log = logging.getLogger(__name__)
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # the engine's reasons as OpenAI's
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


@dataclass
class _Choice:
    """One choice's state: what the engine sent, and what was shown to the client."""

    index: int
    prompt_ids: list[int]
    echo: str
    stops: tuple[str, ...]
    tokens: list[int] = field(default_factory=list)
    raw: str = ""  # the engine's text so far
    sent: str = ""  # the part of it given to the client (a stop string and what may begin one held back)
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    prompt_logprobs: tuple | None = None  # with echo and logprobs: the prompt's, from the first event
    first: float | None = None
    last_token: float | None = None

    def push(self, event: TokenEvent) -> str:
        """The text this event lets the client see."""
        self.tokens.extend(event.token_ids)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.logprobs:
            self.logprobs.extend(event.logprobs)
        self.raw += event.text
        if event.last:
            shown = self.raw
            if event.finish_reason == "stop" and self.stops:
                cut = min((i for i in (self.raw.find(s) for s in self.stops) if i >= 0), default=-1)
                shown = self.raw[: max(cut, len(self.sent))] if cut >= 0 else self.raw
        else:
            hold = max((len(s) for s in self.stops), default=1) - 1
            shown = self.raw[: len(self.raw) - hold] if hold else self.raw
            found = [i for i in (self.raw.find(s) for s in self.stops) if i >= 0]
            if found:
                shown = self.raw[: max(min(found), len(self.sent))]
        new = shown[len(self.sent) :] if len(shown) > len(self.sent) else ""
        self.sent += new
        return new


class CompletionServing:
    """``/v1/completions`` over one engine. ``max_queue``: the most requests waiting for a row of the batch beyond
    the ``engine.max_batch`` decoding (a request that would go past it is answered 429)."""

    def __init__(self, engine: BatchingEngine, model_id: str, *, max_queue: int, metrics: Metrics):
        self.engine, self.model_id, self.metrics = engine, model_id, metrics
        self.capacity = engine.max_batch + max_queue
        self._outstanding = 0
        self._count_lock = threading.Lock()

    # -- the request, checked ------------------------------------------------------------------------------------
    def models(self) -> list[str]:
        """The model ids served: the base, and ``BASE:NAME`` for each switchable LoRA adapter of the folder."""
        return [self.model_id, *(f"{self.model_id}:{name}" for name in self.engine.adapters)]

    def adapter_of(self, model: str) -> str | None:
        """The adapter a request's ``model`` names (as vLLM serves LoRA modules by name): the served id is the
        base (None), ``ID:NAME`` the folder's adapter NAME; any other is OpenAI's 404 model_not_found."""
        if model == self.model_id:
            return None
        name = model.removeprefix(f"{self.model_id}:") if isinstance(model, str) else None
        if name != model and name in self.engine.adapters:
            return name
        served = ", ".join(f"'{m}'" for m in self.models())
        raise ApiError(
            404, f"the model '{model}' does not exist: this server serves {served}", param="model",
            code="model_not_found",
        )  # fmt: skip

    def _options(self, request: CompletionRequest) -> tuple[int, list[tuple[Sampling, Decoding]], Bias]:
        if request.suffix:
            raise ApiError(400, "suffix is not offered: a GPT-2 model continues a prompt only", param="suffix")
        n = request.n or 1
        if request.best_of is not None and request.best_of != n:
            raise ApiError(
                400, f"best_of {request.best_of} is not offered (only best_of = n, {n}): drop it", param="best_of"
            )
        if request.max_tokens == 0 and not request.echo:
            raise ApiError(
                400, "max_tokens 0 returns nothing without echo: give 1 or more, or set echo", param="max_tokens"
            )
        stops = request.stops()
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ApiError(400, f"stop takes 1 to {MAX_STOP} non-empty strings", param="stop")
        temperature = 1.0 if request.temperature is None else request.temperature
        top_p = 1.0 if request.top_p is None else request.top_p
        try:
            if request.logit_bias is not None:
                bias_items = [(_token_key(k), v) for k, v in request.logit_bias.items()]
            else:
                bias_items = []
            bias = Bias(
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                logit_bias=tuple(bias_items),
            )
            decoding = Decoding(stop=stops)
            choices = []
            for j in range(n):
                if temperature == 0.0:
                    sampling = Sampling()
                else:
                    seed = None if request.seed is None else request.seed + j
                    sampling = Sampling(sample=True, temperature=temperature, top_p=top_p, seed=seed)
                choices.append((sampling, decoding))
        except BadInput as err:
            raise ApiError(400, str(err), param=_param_of(str(err))) from None
        max_tokens = DEFAULT_MAX_TOKENS if request.max_tokens is None else request.max_tokens
        return max_tokens, choices, bias

    def _prompt_ids(self, request: CompletionRequest) -> list[list[int]]:
        prompts = request.prompts()
        if not prompts or any(not p for p in prompts):
            raise ApiError(400, "prompt is empty: give some text or token ids", param="prompt")
        if len(prompts) * (request.n or 1) > MAX_CHOICES:
            raise ApiError(400, f"prompts × n is more than {MAX_CHOICES} choices: send fewer", param="n")
        try:
            return [self.engine.encode(p) if isinstance(p, str) else self.engine.reader.ids(p) for p in prompts]
        except BadInput as err:
            raise ApiError(400, str(err), param="prompt") from None

    async def chat(self, request: ChatCompletionRequest, template, is_disconnected: Callable[[], Awaitable[bool]]):
        """A chat request: its messages rendered by the folder's template (:class:`~.chat.ChatTemplate`, on a worker
        thread), then served as a completion of the rendered prompt's token ids, in the chat's shapes. Its
        ``max_completion_tokens`` (or ``max_tokens``) defaults to the rest of the context, as OpenAI's does."""
        self.adapter_of(request.model)
        refused = request.refused()
        if refused is not None:
            raise ApiError(
                400, f"{refused} is not offered: this server runs a text model without tools, audio or structured"
                " output: drop it", param=refused,
            )  # fmt: skip
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        wanted = {request.max_completion_tokens, request.max_tokens} - {None}
        if len(wanted) > 1:
            raise ApiError(
                400, "max_completion_tokens and max_tokens differ: give one of them", param="max_completion_tokens"
            )
        messages = chat_messages(request.messages)
        text = await asyncio.to_thread(template.render, messages)
        try:
            ids = self.engine.encode(text)
        except BadInput as err:
            raise ApiError(400, f"the rendered chat prompt cannot be read: {err}", param="messages") from None
        if not ids:
            raise ApiError(400, "the chat template rendered an empty prompt for these messages", param="messages")
        room = self.engine.stepper.n_positions - len(ids)
        if room < 1:
            raise ApiError(
                400, f"the rendered chat prompt is {len(ids)} tokens, and the model's context is"
                f" {self.engine.stepper.n_positions}: send shorter or fewer messages", param="messages",
                code="context_length_exceeded",
            )  # fmt: skip
        completion = CompletionRequest.model_construct(
            model=request.model, prompt=ids, max_tokens=wanted.pop() if wanted else max(room, 1),
            temperature=request.temperature, top_p=request.top_p, stop=request.stop, seed=request.seed, n=request.n,
            logit_bias=request.logit_bias, presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty, stream=request.stream, stream_options=request.stream_options,
            user=request.user, logprobs=(request.top_logprobs or 0) if request.logprobs else None, echo=False,
            suffix=None, best_of=None, response_format=request.response_format,
            **{name: getattr(request, name) for name in GUIDED_FIELDS},
        )  # fmt: skip
        return await self.create(completion, is_disconnected, shape=_ChatRun)

    # -- into the engine ------------------------------------------------------------------------------------------
    def _reserve(self, count: int) -> None:
        if count > self.capacity:  # it would never fit: not a reason to retry
            raise ApiError(
                400, f"prompts × n is {count} requests, more than the {self.capacity} this server takes at once:"
                " send fewer", param="n",
            )  # fmt: skip
        with self._count_lock:
            if self._outstanding + count > self.capacity:
                raise ApiError(
                    429, f"the server's queue is full ({self.capacity} requests): retry later",
                    type="rate_limit_error", code="queue_full",
                )  # fmt: skip
            self._outstanding += count

    def _release(self, count: int) -> None:
        with self._count_lock:
            self._outstanding -= count

    def _ended(self, event: TokenEvent) -> None:
        """A choice's last event, on the engine's thread: its place in the queue given back, its reason counted."""
        self._release(1)
        self.metrics.finished.labels(event.finish_reason).inc()

    async def create(
        self, request: CompletionRequest, is_disconnected: Callable[[], Awaitable[bool]], *, shape: type = None
    ):
        """The response: a dict for one body, or an async iterator of server-sent events (``shape``: the run that
        writes them, completions' by default)."""
        adapter = self.adapter_of(request.model)
        max_tokens, options, bias = self._options(request)
        constraint = constraint_of(request)  # response_format or vLLM's guided_* (one of them)
        prompt_ids = self._prompt_ids(request)
        tokenizer = self.engine.tokenizer
        choices = []
        for p, ids in enumerate(prompt_ids):
            prompt = request.prompts()[p]
            echo = ""
            if request.echo:
                echo = prompt if isinstance(prompt, str) else tokenizer.decode(ids) if tokenizer else ""
            for j in range(len(options)):
                choices.append(_Choice(len(choices), ids, echo, request.stops()))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        self._reserve(len(choices))
        streams: list[GenerationStream] = []
        started = time.perf_counter()
        try:
            for choice in choices:
                sampling, decoding = options[choice.index % len(options)]
                streams.append(
                    self.engine.submit(
                        choice.prompt_ids,
                        max_new_tokens=max_tokens,
                        sampling=sampling,
                        decoding=decoding,
                        bias=bias,
                        logprobs=request.logprobs,
                        prompt_logprobs=_prompt_logprobs(request, max_tokens),
                        on_event=_deliver(loop, events, choice.index, self._ended),
                        constraint=constraint,
                        adapter=adapter,
                    )
                )
        except BaseException as err:
            for stream in streams:
                stream.cancel()
            self._release(len(choices) - len(streams))  # the submitted ones are released as they end
            if isinstance(err, BadInput):
                raise ApiError(400, str(err), param=_param_of(str(err))) from None
            raise
        self.metrics.prompt_tokens.inc(sum(len(ids) for ids in prompt_ids))
        run = (shape or _Run)(self, request, choices, streams, events, started)
        if request.stream:
            return run.stream()
        return await run.body(is_disconnected)


def _deliver(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int, ended: Callable[[TokenEvent], None]):
    """An engine callback handing each event to the request's event loop (quick: the batch waits for it); the
    request's place in the queue is given back with its last event, whether or not anyone still reads it."""

    def on_event(event: TokenEvent) -> None:
        if event.last:
            ended(event)
        loop.call_soon_threadsafe(events.put_nowait, (index, event, time.perf_counter()))

    return on_event


class _Run:
    """One request in flight: its choices' events gathered into a body, or streamed (completions' shapes; the
    chat's are :class:`_ChatRun`'s)."""

    prefix = "cmpl"

    def __init__(self, serving: CompletionServing, request, choices, streams, events, started):
        self.serving, self.request, self.choices, self.streams = serving, request, choices, streams
        self.events, self.started = events, started
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.open = len(choices)
        self.tokenizer = serving.engine.tokenizer

    def _take(self, index: int, event: TokenEvent, at: float) -> str:
        choice = self.choices[index]
        metrics = self.serving.metrics
        if event.token_ids:
            if choice.first is None:
                choice.first = at
                metrics.first_token.observe(at - self.started)
            elif choice.last_token is not None:
                metrics.inter_token.observe(at - choice.last_token)
            choice.last_token = at
            metrics.generation_tokens.inc(len(event.token_ids))
        text = choice.push(event)
        if event.last:
            self.open -= 1
            metrics.latency.observe(at - self.started)
            if event.error is not None or event.finish_reason not in FINISH:
                reason = event.error or Gpt2OnnxError(f"the request ended: {event.finish_reason}")
                raise _Failed(reason)
            choice.finish_reason = FINISH[event.finish_reason]
        return text

    def _cancel(self) -> None:
        for stream in self.streams:
            stream.cancel()

    def _usage(self) -> CompletionUsage:
        prompt = sum(len(ids) for ids in {id(c.prompt_ids): c.prompt_ids for c in self.choices}.values())
        completion = sum(len(c.tokens) for c in self.choices)
        return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def _logprobs(self, choice: _Choice, entries: list, offset: int, *, prompt: bool = False) -> Logprobs | None:
        """``entries``' tokens from ``offset`` in the text; ``prompt``: the echoed prompt's first (from 0)."""
        if self.request.logprobs is None:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        if prompt:
            for token, entry in zip(choice.prompt_ids, choice.prompt_logprobs or ()):
                piece = self._piece(token)
                tokens.append(piece)
                offsets.append(sum(len(t) for t in tokens[:-1]))
                token_logprobs.append(None if entry is None else entry[0])
                top.append(None if entry is None else {**{self._piece(t): lp for t, lp in entry[1]}, piece: entry[0]})
        for token, (chosen, best) in zip(choice.tokens[len(choice.tokens) - len(entries) :], entries):
            piece = self._piece(token)
            tokens.append(piece)
            token_logprobs.append(chosen)
            top.append({**{self._piece(t): lp for t, lp in best}, piece: chosen})
            offsets.append(offset)
            offset += len(piece)
        # built unvalidated: the echoed prompt's first token has no log-probability (null, as OpenAI sends it)
        return Logprobs.model_construct(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top,
                                        text_offset=offsets)  # fmt: skip

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    async def body(self, is_disconnected) -> dict:
        try:
            while self.open:
                try:
                    index, event, at = await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await is_disconnected():
                        log.info("a client went away: its request is cancelled")
                        self._cancel()
                        return {}
                    continue
                self._take(index, event, at)
        except _Failed as failed:
            self._cancel()
            raise ApiError(500, str(failed.error), type="server_error") from None
        except BaseException:
            self._cancel()
            raise
        return self._response()

    def _response(self) -> dict:
        choices = [
            CompletionChoice(
                index=c.index,
                text=c.echo + c.sent,
                finish_reason=c.finish_reason,
                logprobs=self._logprobs(c, c.logprobs, len(c.echo), prompt=bool(c.echo)),
            )
            for c in self.choices
        ]
        completion = Completion(
            id=self.id, object="text_completion", created=self.created, model=self.request.model,
            choices=choices, usage=self._usage(),
        )  # fmt: skip
        return completion.model_dump(mode="json", exclude_unset=True)

    def _opening(self) -> list[str]:
        """The chunks before the first token: the echoed prompts (with logprobs: with their first event)."""
        if self.request.logprobs is not None:
            return []
        return [self._chunk(c, c.echo, None, [], 0) for c in self.choices if c.echo]

    def _usage_chunk(self) -> str:
        usage = Completion(
            id=self.id, object="text_completion", created=self.created, model=self.request.model,
            choices=[], usage=self._usage(),
        )  # fmt: skip
        return f"data: {usage.model_dump_json(exclude_unset=True)}\n\n"

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: a chunk per token (the echoed prompts first), the finish reasons, the usage where
        stream_options asks for it, then ``[DONE]``. Cancelled in the engine when the client goes away."""
        try:
            for chunk in self._opening():
                yield chunk
            while self.open:
                index, event, at = await self.events.get()
                choice = self.choices[index]
                before = len(choice.logprobs)
                offset = len(choice.echo) + len(choice.sent)
                try:
                    text = self._take(index, event, at)
                except _Failed as failed:
                    self._cancel()
                    yield f"data: {json.dumps(error_body(str(failed.error), type='server_error'))}\n\n"
                    break
                entries = choice.logprobs[before:]
                if event.prompt_logprobs is not None and choice.echo and self.request.logprobs is not None:
                    # the echoed prompt, its logprobs now known
                    yield self._chunk(choice, choice.echo, None, [], 0, prompt=True)
                if text or entries or event.last:
                    yield self._chunk(choice, text, choice.finish_reason if event.last else None, entries, offset)
            options = self.request.stream_options
            if options is not None and options.include_usage:
                yield self._usage_chunk()
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the task is cancelled), or the stream ended
            if self.open:
                log.info("a client went away mid-stream: its request is cancelled")
                self._cancel()

    def _chunk(self, choice: _Choice, text: str, finish_reason, entries: list, offset: int, prompt=False) -> str:
        chunk = Completion(
            id=self.id, object="text_completion", created=self.created, model=self.request.model,
            choices=[
                # built unvalidated: the type requires a finish_reason, which is null until the last chunk (as
                # OpenAI sends it and its client reads it)
                CompletionChoice.model_construct(
                    index=choice.index, text=text, finish_reason=finish_reason,
                    logprobs=self._logprobs(choice, entries, offset, prompt=prompt),
                )
            ],
        )  # fmt: skip
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


class _ChatRun(_Run):
    """A chat request in flight: the same choices, in the chat's shapes (``ChatCompletion``, and
    ``ChatCompletionChunk`` whose first delta per choice names the assistant's role)."""

    prefix = "chatcmpl"

    def _chat_logprobs(self, choice: _Choice, entries: list) -> ChoiceLogprobs | None:
        if self.request.logprobs is None:
            return None
        content = []
        for token, (chosen, best) in zip(choice.tokens[len(choice.tokens) - len(entries) :], entries):
            piece = self._piece(token)
            top = [TopLogprob(token=p, bytes=list(p.encode()), logprob=lp) for p, lp in ((self._piece(t), lp)
                   for t, lp in best)]  # fmt: skip
            content.append(ChatCompletionTokenLogprob(token=piece, bytes=list(piece.encode()), logprob=chosen,
                                                      top_logprobs=top))  # fmt: skip
        return ChoiceLogprobs(content=content)

    def _response(self) -> dict:
        choices = [
            ChatChoice(
                index=c.index, finish_reason=c.finish_reason, logprobs=self._chat_logprobs(c, c.logprobs),
                message=ChatCompletionMessage(role="assistant", content=c.sent),
            )
            for c in self.choices
        ]  # fmt: skip
        completion = ChatCompletion(
            id=self.id, object="chat.completion", created=self.created, model=self.request.model,
            choices=choices, usage=self._usage(),
        )  # fmt: skip
        return completion.model_dump(mode="json", exclude_unset=True)

    def _opening(self) -> list[str]:
        return [self._delta(c.index, ChoiceDelta(role="assistant", content=""), None, None) for c in self.choices]

    def _chunk(self, choice: _Choice, text: str, finish_reason, entries: list, offset: int) -> str:
        delta = ChoiceDelta(content=text) if text else ChoiceDelta()
        logprobs = self._chat_logprobs(choice, entries) if entries else None
        return self._delta(choice.index, delta, finish_reason, logprobs)

    def _delta(self, index: int, delta: ChoiceDelta, finish_reason, logprobs) -> str:
        choice = ChunkChoice(index=index, delta=delta, finish_reason=finish_reason)
        if logprobs is not None:
            choice.logprobs = logprobs
        chunk = ChatCompletionChunk(
            id=self.id, object="chat.completion.chunk", created=self.created, model=self.request.model,
            choices=[choice],
        )  # fmt: skip
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"

    def _usage_chunk(self) -> str:
        chunk = ChatCompletionChunk(
            id=self.id, object="chat.completion.chunk", created=self.created, model=self.request.model,
            choices=[], usage=self._usage(),
        )  # fmt: skip
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


class _Failed(Exception):
    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def _prompt_logprobs(request: CompletionRequest, max_tokens: int) -> int | None:
    """What the engine is asked of the prompt's log-probabilities: echo's with logprobs, and for max_tokens 0 (the
    engine's prompt step alone) at least the chosen's."""
    if request.echo and request.logprobs is not None:
        return request.logprobs
    return 0 if max_tokens == 0 else None


def _token_key(key: str) -> int:
    """A logit_bias key: a token id written as a JSON string."""
    try:
        token = int(key)
    except ValueError:
        raise BadInput(f"logit_bias key {key[:40]!r} is not a token id: give token ids as strings") from None
    if str(token) != key.strip():
        raise BadInput(f"logit_bias key {key[:40]!r} is not a token id: give token ids as strings")
    return token


def _param_of(message: str) -> str | None:
    """The request field a refusal names (the engine's messages name generate's options)."""
    for word, name in (
        ("logit_bias", "logit_bias"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("seed", "seed"),
        ("stop", "stop"),
        ("logprobs", "logprobs"),
        ("new tokens", "max_tokens"),
        ("token id", "prompt"),
        ("prompt", "prompt"),
    ):
        if word in message:
            return name
    return None
