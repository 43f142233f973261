"""The wire format: request models validated once (unknown fields and wrong types refused), the response types of
the ``openai`` package itself (so that the format cannot drift from what its clients parse), and OpenAI's error
body. The completion request's fields are those of ``openai.types.completion_create_params`` (a test compares the
two); the limits that are OpenAI's are applied here, the model's own (its vocabulary, its context) by the engine.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.completion_choice import Logprobs
from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "ApiError",
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


class CompletionRequest(_Strict):
    """``POST /v1/completions``: openai's CompletionCreateParams, field for field."""

    model: str
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    best_of: Optional[int] = None
    echo: Optional[bool] = False
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, Union[int, float]]] = None
    logprobs: Optional[int] = Field(None, ge=0)
    max_tokens: Optional[int] = Field(None, ge=1)
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

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts, one item each: a text or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)

    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Any = None


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``: the model and the messages are read here; the other fields of openai's chat
    CompletionCreateParams are checked once a template can render the messages."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[ChatMessage] = Field(min_length=1)


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
