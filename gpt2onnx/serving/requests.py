"""One reader for generation requests: what the served models (``NAME-generate``, ``NAME-infer``:
:mod:`gpt2onnx.serving.triton_models`) and :meth:`BatchingEngine.submit
<gpt2onnx.serving.engine.BatchingEngine.submit>` take from a client, checked before anything is converted or
tokenized. Every refusal is a :class:`~gpt2onnx.errors.BadInput` naming the input.

- token ids are whole numbers: Python ints or numpy integers, never floats (78.9 is not an id), bools or bytes;
- text is ``str`` (or UTF-8 bytes where a wire format carries bytes), at most :func:`max_prompt_bytes` bytes,
  measured before the tokenizer sees it (a 10 MB prompt is refused at once, not tokenized whole);
- a number is an int or a float (numpy's too), finite; a whole number is an int or a numpy integer.
"""

from __future__ import annotations

import math
import numbers
import typing
from dataclasses import dataclass

import numpy as np

from gpt2onnx.decoding.prompts import MAX_TOKEN_ID
from gpt2onnx.decoding.proposers.all_proposers import PROPOSERS
from gpt2onnx.decoding.results import check_new_tokens
from gpt2onnx.errors import BadInput
from gpt2onnx.generation_options import EARLY_STOPPING, MAX_NEW_TOKENS, Decoding, Sampling, check_pair
from gpt2onnx.params import options_of

BYTES_PER_POSITION = 64  # a byte-level BPE token is a few bytes; no prompt that fits the context needs more
MIN_PROMPT_BYTES = 1 << 16


def _kind(option) -> type | tuple:
    """The type a client sends for a declared option (an int or None is an int; early_stopping: a bool or a word)."""
    kinds = {k for k in typing.get_args(option.type) if k is not type(None)} or {option.type}
    return tuple(sorted(kinds, key=lambda k: k.__name__)) if len(kinds) > 1 else kinds.pop()


# request parameter → the type a client sends: the options declared served (gpt2onnx.params), by generate's names
PARAMETERS = {
    o.field: _kind(o) for o in (MAX_NEW_TOKENS, *options_of(Sampling), *options_of(Decoding)) if o.param.served
}
SAMPLING_FIELDS = tuple(o.field for o in options_of(Sampling))
DEFAULT_MAX_NEW_TOKENS = MAX_NEW_TOKENS.default  # as gpt2onnx generate
# transformers' generate() names of speculative decoding: known, and refused (continuous batching checks one token
# per row per step); `gpt2onnx generate` runs them (gpt2onnx.decoding.speculative)
SPECULATIVE_PARAMETERS = tuple(name for spec in PROPOSERS.values() for name in spec.transformers_names)
NOT_SPECULATIVE = (
    "speculative decoding runs in `gpt2onnx generate`, not in the batching engine (it checks one token per row per"
    " step)"
)


def max_prompt_bytes(n_positions: int) -> int:
    """The most bytes of prompt text read for a model of ``n_positions`` positions."""
    return max(MIN_PROMPT_BYTES, BYTES_PER_POSITION * int(n_positions))


def _is_whole(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def whole_number(name: str, value) -> int:
    """``value`` as an int: a Python int or a numpy integer (not a bool, not a float)."""
    if not _is_whole(value):
        raise BadInput(f"{name} must be a whole number, got {_kind(value)}")
    return int(value)


def number(name: str, value) -> float:
    """``value`` as a float: an int or a float (numpy's too; not a bool), finite."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise BadInput(f"{name} must be a number, got {_kind(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise BadInput(f"{name} must be a finite number, got {value}")
    return value


def flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise BadInput(f"{name} must be true or false, got {_kind(value)}")
    return bool(value)


def text(name: str, value, *, max_bytes: int) -> str:
    """``value`` as text: a str (or UTF-8 bytes) of at most ``max_bytes`` bytes, checked before anything reads it."""
    if isinstance(value, (bytes, bytearray, np.bytes_)):
        if len(value) > max_bytes:
            raise BadInput(f"{name} is {len(value):,} bytes, more than the {max_bytes:,} bytes read: send less text")
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise BadInput(f"{name} is not UTF-8 text: send it as UTF-8") from None
    if not isinstance(value, str):
        raise BadInput(f"{name} must be text, got {_kind(value)}")
    if len(value) > max_bytes or len(value.encode("utf-8", "surrogatepass")) > max_bytes:
        raise BadInput(f"{name} is more than the {max_bytes:,} bytes read: send a shorter text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadInput(f"{name} holds a lone surrogate, which is not text: send valid Unicode") from None
    return str(value)


def token_ids(name: str, value) -> list[int]:
    """``value`` as token ids: a list, tuple or 1-d integer array of whole numbers (never text, bytes, floats or
    bools: none of them is an id)."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise BadInput(f"{name} must be a 1-d array of integers, got a {value.ndim}-d {value.dtype} array")
        return [int(i) for i in value]
    if not isinstance(value, (list, tuple)):
        raise BadInput(f"{name} must be text or a list of token ids, got {_kind(value)}")
    for index, item in enumerate(value):
        if not _is_whole(item):
            raise BadInput(f"{name}[{index}] must be a whole-number token id, got {_kind(item)}")
    return [int(i) for i in value]


@dataclass(frozen=True)
class PromptReader:
    """A model's prompts read one way: text (``tokenizer`` needed) or token ids, checked in that order: the type,
    the bytes (before tokenizing), not empty, every id in the vocabulary, and the prompt plus its new tokens within
    the context. Used by the engine's submit and by the served models before anything is queued."""

    tokenizer: object | None
    n_positions: int | None
    vocab_size: int | None

    @property
    def max_bytes(self) -> int:
        return max_prompt_bytes(self.n_positions or 0)

    def ids(self, prompt, *, name: str = "the prompt") -> list[int]:
        if isinstance(prompt, (bytes, bytearray, np.bytes_)):  # neither ids nor text: the caller decodes
            raise BadInput(f"{name} is bytes, which is neither text nor token ids: decode it to text (str) first")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise BadInput("this model has no tokenizer files: give the prompt as token ids")
            prompt = text(name, prompt, max_bytes=self.max_bytes)
            ids = list(self.tokenizer.encode(prompt))
            if not ids:
                raise BadInput(f"{name} {prompt[:40]!r} is empty (no tokens): give some text")
        else:
            ids = token_ids(name, prompt)
            if not ids:
                raise BadInput(f"{name} is empty: give at least one token")
        top = self.vocab_size - 1 if self.vocab_size is not None else MAX_TOKEN_ID
        bad = [i for i in ids if not 0 <= i <= top]
        if bad:
            raise BadInput(f"token id {bad[0]} is outside the vocabulary (0 to {top}): give ids of the vocabulary")
        return ids

    def check_length(self, prompt_length: int, max_new_tokens: int) -> None:
        total = prompt_length + max_new_tokens
        if self.n_positions and total > self.n_positions:
            raise BadInput(
                f"prompt plus new tokens is {total} tokens, beyond the model's context of {self.n_positions}:"
                " shorten the prompt or ask for fewer new tokens"
            )


def _kind(value) -> str:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"{type(value).__name__} {shown}"


def _typed(name: str, value, kind):
    """``value`` as the parameter's type, or BadInput naming it (JSON gives 1 for 1.0; a bool is not a number)."""
    if kind is float:
        return number(f"parameter {name}", value)
    if kind is int:
        return whole_number(f"parameter {name}", value)
    if kind is bool:
        return flag(f"parameter {name}", value)
    # early_stopping: true, false or "never"
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str) and value.lower() in EARLY_STOPPING:
        return EARLY_STOPPING[value.lower()]
    raise BadInput(f'parameter {name} must be true, false or "never", got {_kind(value)}')


@dataclass(frozen=True)
class GenerationRequest:
    """One request's options, checked: what :meth:`BatchingEngine.submit` takes."""

    max_new_tokens: int
    sampling: Sampling
    decoding: Decoding


def stop_strings(values, *, max_bytes: int = MIN_PROMPT_BYTES) -> tuple[str, ...]:
    """Stop strings as text (each str or UTF-8 bytes)."""
    return tuple(text("stop string", v, max_bytes=max_bytes) for v in values)


def parse_request(parameters, stop=()) -> GenerationRequest:
    """A request's parameters (names of :data:`PARAMETERS`; Triton's own ``triton_*`` keys are left to it) and
    stop strings, checked once: BadInput naming the parameter. transformers' speculative options
    (:data:`SPECULATIVE_PARAMETERS`) are refused by name, whatever their value."""
    if not isinstance(parameters, dict):
        raise BadInput("the request parameters must be an object of name → value")
    speculative = [str(k) for k in parameters if k in SPECULATIVE_PARAMETERS]
    if speculative:
        raise BadInput(
            f"parameter {', '.join(speculative)}: {NOT_SPECULATIVE}: drop {'it' if len(speculative) == 1 else 'them'}"
        )
    unknown = sorted(str(k) for k in parameters if k not in PARAMETERS and not str(k).startswith("triton_"))
    if unknown:
        raise BadInput(f"unknown parameter {', '.join(unknown)}: the parameters are {', '.join(PARAMETERS)}")
    values = {k: _typed(k, v, PARAMETERS[k]) for k, v in parameters.items() if k in PARAMETERS}
    max_new_tokens = values.pop("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    check_new_tokens(max_new_tokens)
    sampling = Sampling(**{k: values.pop(k) for k in SAMPLING_FIELDS if k in values})
    decoding = Decoding(**values, stop=stop_strings(stop))
    check_pair(sampling, decoding)
    return GenerationRequest(max_new_tokens, sampling, decoding)
