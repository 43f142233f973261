"""The sandbox a chat template renders in (imported only where a folder has a template): transformers'
environment (trim_blocks, lstrip_blocks, loop controls, ``raise_exception``, ``strftime_now``, its ``tojson``) as
jinja2's ``ImmutableSandboxedEnvironment``, with the limits of :mod:`gpt2onnx.serving.openai.chat`: the filters
kept, integer arguments bounded, and what a single operation could allocate checked before it runs."""

from __future__ import annotations

import datetime
import json
import re

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RENDER_CHARS = 256 << 10  # the rendered prompt, and any string or list built on the way (a prompt fits a context)
KEPT_FILTERS = (
    "abs attr batch capitalize center count d default dictsort e escape filesizeformat first float forceescape"
    " groupby indent int items join last length list lower map max min reject rejectattr replace reverse round safe"
    " select selectattr slice sort string striptags sum title trim truncate unique upper urlencode wordcount"
    " wordwrap"
).split()
REFUSED_METHODS = ("format", "format_map", "expandtabs")
_PERCENT_WIDTH = re.compile(r"%[-#0 +]*(\*|\d{5,}|\.\*|\.\d{5,})")


class Refused(Exception):
    """The template went past a limit while rendering."""


def _raise_exception(message):
    raise jinja2.TemplateError(str(message))


def _strftime_now(format):
    return datetime.datetime.now().strftime(format)


def _bounded(value, budget: int = MAX_RENDER_CHARS) -> int:
    """``value``'s size (characters of its strings, items of its containers, recursively, shared ones each time
    they appear) up to ``budget``; Refused past it. Walked before a value is turned into text in one C call."""
    if isinstance(value, str):
        size = len(value)
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        size = len(value)
        if size > budget:
            raise Refused(f"a value it built holds more than {MAX_RENDER_CHARS:,} items")
        items = value.items() if isinstance(value, dict) else value
        for item in items:
            size += _bounded(item, budget - size)
    else:
        size = 1
    if size > budget:
        raise Refused(f"a value it built is larger than {MAX_RENDER_CHARS:,} characters")
    return size


def _check_args(args, kwargs) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_RENDER_CHARS:
            raise Refused(f"it passed {value} to a call (at most {MAX_RENDER_CHARS:,})")


def _check_result(value):
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_RENDER_CHARS:
        raise Refused(f"a value it built is larger than {MAX_RENDER_CHARS:,}")
    return value


def _joined(parts) -> str:
    """``str_join``, ``concat`` and ``~`` bounded: the pieces' total size checked before they are joined."""
    parts = list(parts)
    total = 0
    for part in parts:
        total += _bounded(part) if not isinstance(part, str) else len(part)
        if total > MAX_RENDER_CHARS:
            raise Refused(f"a string it built is longer than {MAX_RENDER_CHARS:,} characters")
    return "".join(p if isinstance(p, str) else str(p) for p in parts)


def _pre_check(name: str, args: tuple, kwargs: dict) -> tuple:
    """What an operation would allocate, checked before it runs (filters and string methods by name): ``args``
    (the value first), with an iterator about to be joined made a list."""
    if name == "join" and args:  # a filter's value or a method's argument
        items = args[0] if isinstance(args[0], (str, list, tuple, dict)) else list(args[0])
        _bounded(items)
        args = (items, *args[1:])
    elif name == "replace" and len(args) >= 3 and isinstance(args[0], str):
        text, old, new = args[0], str(args[1]), str(args[2])
        grows = (text.count(old) if old else len(text) + 1) * len(new)
        if len(text) + grows > MAX_RENDER_CHARS:
            raise Refused(f"a replace would make more than {MAX_RENDER_CHARS:,} characters")
    elif name == "indent" and args and isinstance(args[0], str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        if len(args[0]) + (args[0].count("\n") + 1) * width > MAX_RENDER_CHARS:
            raise Refused(f"an indent would make more than {MAX_RENDER_CHARS:,} characters")
    elif name in ("string", "tojson", "sum", "unique", "sort", "dictsort") and args:
        _bounded(args[0])
    return args


def _filter(name: str, function):
    """A filter with its arguments and result bounded (its value is its first argument after the context or
    environment a pass_context filter is given)."""
    skip = 1 if getattr(function, "jinja_pass_arg", None) else 0

    def bounded(*args, **kwargs):
        _check_args(args[skip + 1 :], kwargs)
        args = (*args[:skip], *_pre_check(name, args[skip:], kwargs))
        return _check_result(function(*args, **kwargs))

    if skip:
        bounded.jinja_pass_arg = function.jinja_pass_arg
    return bounded


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson (not jinja's: no HTML escaping), its indent bounded."""
    if isinstance(indent, int) and indent > 16:
        raise Refused(f"tojson's indent {indent} is more than 16")
    text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    return _check_result(text)


class _Template(jinja2.Template):
    @classmethod
    def _from_namespace(cls, environment, namespace, globals):
        namespace["str_join"] = namespace["markup_join"] = _joined  # ``~``, bounded
        return super()._from_namespace(environment, namespace, globals)


class Environment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment, with the limits of the module docstring."""

    template_class = _Template
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    concat = staticmethod(_joined)

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        kept = {name: _filter(name, self.filters[name]) for name in KEPT_FILTERS if name in self.filters}
        self.filters = {**kept, "tojson": _filter("tojson", _tojson)}
        self.globals = {
            "range": self.globals["range"],
            "dict": self.globals["dict"],
            "namespace": self.globals["namespace"],
            "cycler": self.globals["cycler"],
            "joiner": self.globals["joiner"],
            "raise_exception": _raise_exception,
            "strftime_now": _strftime_now,
        }
        self.finalize = _finalize

    def call_binop(self, context, operator, left, right):
        if isinstance(left, int) and isinstance(right, int) and not isinstance(left, bool):
            bits = max(abs(left).bit_length(), 1)
            if operator == "**" and (right > 4096 or bits * max(right, 1) > 65536):
                raise Refused(f"{left} ** {right} is too large a number")
            if operator == "*" and bits + abs(right).bit_length() > 65536:
                raise Refused("a number it built is too large")
        elif operator == "*":
            sized, count = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(sized, (str, list, tuple)) and isinstance(count, int):
                if len(sized) * max(count, 0) > MAX_RENDER_CHARS:
                    raise Refused(f"a value it built is larger than {MAX_RENDER_CHARS:,}")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            if len(left) + len(right) > MAX_RENDER_CHARS:
                raise Refused(f"a value it built is larger than {MAX_RENDER_CHARS:,}")
        elif operator == "%" and isinstance(left, str):
            if _PERCENT_WIDTH.search(left):
                raise Refused("a % format with a width from an argument or of 5 digits or more")
            _bounded(right)
        elif operator == "**":
            raise Refused("** on what is not a pair of integers")
        return _check_result(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        _check_args(args, kwargs)
        name = getattr(__obj, "__name__", "")
        if isinstance(getattr(__obj, "__self__", None), str) or name in REFUSED_METHODS:
            if name in REFUSED_METHODS:
                raise Refused(f"a chat template may not call {name}")
            if name == "join":
                args = _pre_check(name, args, kwargs)
            else:
                _pre_check(name, (__obj.__self__, *args), kwargs)
        return _check_result(super().call(__context, __obj, *args, **kwargs))


def _finalize(value):
    """Every ``{{ value }}``, its size checked before it becomes text."""
    if not isinstance(value, str):
        _bounded(value)
    return value
