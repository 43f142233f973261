"""The wire format: request models validated once (unknown fields and wrong types refused), the response types of
the ``openai`` package itself (so that the format cannot drift from what its clients parse), and OpenAI's error
body. The completion request's fields are those of ``openai.types.completion_create_params`` (a test compares the
two); the limits that are OpenAI's are applied here, the model's own (its vocabulary, its context) by the engine.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import Logprobs
from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "ApiError",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "Completion",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionUsage",
    "Logprobs",
    "Model",
    "error_body",
    "parse",
]

MAX_CHOICES = 128  # prompts × n in one request (OpenAI's own limit of n)
MAX_STOP = 4  # stop strings (OpenAI's limit)
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
PROMPT_TYPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


class ApiError(Exception):
    """A request answered with OpenAI's error body and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param=None, code=None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    # JSON's types as they are: "5" is no int, 5.0 no token id, true no number; NaN and Infinity are no numbers
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None
    include_obfuscation: Optional[bool] = None


TokenIds = list[int]


class Guided(_Strict):
    """vLLM's extra body fields for constrained output (gpt2onnx.serving.openai.guided reads them)."""

    guided_json: Union[dict[str, Any], bool, str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None


class CompletionRequest(Guided):
    """``POST /v1/completions``: openai's CompletionCreateParams, field for field, and vLLM's constraints
    (:class:`Guided`, ``response_format``)."""

    model: str
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    best_of: Optional[int] = None
    echo: Optional[bool] = False
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, Union[int, float]]] = None
    logprobs: Optional[int] = Field(None, ge=0)
    max_tokens: Optional[int] = Field(None, ge=0)  # 0: with echo, the prompt only (serving checks)
    n: Optional[int] = Field(None, ge=1, le=MAX_CHOICES)
    presence_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    suffix: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    user: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None  # vLLM's, as the chat request's

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts, one item each: a text or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)

    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatMessage(BaseModel):
    """A message as a chat template reads it (role, content, name); its other fields (tool calls) are kept and
    refused where they matter."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: Optional[str] = None


class ChatCompletionRequest(Guided):
    """``POST /v1/chat/completions``: openai's chat CompletionCreateParams, field for field, and vLLM's constraints
    (:class:`Guided`). Those about tools, audio and OpenAI's own service are refused where set (:data:`CHAT_REFUSED`);
    ``response_format`` is read as a constraint (text, json_object, json_schema); ``metadata``,
    ``store``, ``user`` and the like are read and have no effect here."""

    messages: list[ChatMessage] = Field(min_length=1)
    model: str
    audio: Optional[Any] = None
    frequency_penalty: Optional[float] = None
    function_call: Optional[Any] = None
    functions: Optional[Any] = None
    logit_bias: Optional[dict[str, Union[int, float]]] = None
    logprobs: Optional[bool] = None
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    metadata: Optional[dict[str, str]] = None
    modalities: Optional[list[str]] = None
    moderation: Optional[Any] = None
    n: Optional[int] = Field(None, ge=1, le=MAX_CHOICES)
    parallel_tool_calls: Optional[bool] = None
    prediction: Optional[Any] = None
    presence_penalty: Optional[float] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_options: Optional[Any] = None
    prompt_cache_retention: Optional[str] = None
    reasoning_effort: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None
    safety_identifier: Optional[str] = None
    seed: Optional[int] = None
    service_tier: Optional[str] = None
    stop: Union[str, list[str], None] = None
    store: Optional[bool] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    tool_choice: Optional[Any] = None
    tools: Optional[Any] = None
    top_logprobs: Optional[int] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    user: Optional[str] = None
    verbosity: Optional[Any] = None
    web_search_options: Optional[Any] = None

    def refused(self) -> str | None:
        """The first field set that this text model cannot honour, None where there is none."""
        for name in CHAT_REFUSED:
            if getattr(self, name) not in (None, [], {}):
                return name
        if self.modalities not in (None, ["text"]):
            return "modalities"
        if self.response_format is not None and self.response_format.get("type") not in STRUCTURED:
            return "response_format"
        return None


STRUCTURED = ("text", "json_object", "json_schema")  # the response formats read (as constraints)
# set, these are refused: tools and functions, audio, predicted outputs, moderation, reasoning, web search
CHAT_REFUSED = (
    "audio", "function_call", "functions", "moderation", "prediction", "reasoning_effort", "tool_choice", "tools",
    "verbosity", "web_search_options",
)  # fmt: skip


def parse(model: type[BaseModel], data) -> Any:
    """``data`` (parsed JSON) as ``model``, or ApiError 400 naming the first field that is wrong."""
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_json_type(data)}")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ApiError(400, _message(err), param=_param(err)) from None


def _param(err: ValidationError) -> str | None:
    loc = err.errors()[0]["loc"]
    return str(loc[0]) if loc else None


def _message(err: ValidationError) -> str:
    first = err.errors()[0]
    name = _param(err) or "the body"
    if first["type"] == "extra_forbidden":
        return f"unknown field {name}: this endpoint takes the fields of OpenAI's API only"
    if first["type"] == "missing":
        return f"{name} is required"
    if name == "prompt" and first["type"] != "too_long":
        return f"prompt must be {PROMPT_TYPES}"
    path = ".".join(str(p) for p in first["loc"])
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"{path} {shown}: {first['msg'][0].lower()}{first['msg'][1:]}"


def _json_type(value) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", type(None): "null", int: "a number"}
    return names.get(type(value), "a number")
