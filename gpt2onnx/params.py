"""Each option declared once: its type and default (the dataclass field's), its help, its command-line flag, its
range (a :class:`Rule`), and where else it is read (transformers' name, a served request, generation_config.json),
on the field of the typed object that holds it, as Olive declares a pass's config (``PassConfigParam``). The CLI's
parameters (gpt2onnx.cli.flags, beside the CLI's own options), the request reader (gpt2onnx.serving.requests) and
generation_config.json's reader (gpt2onnx.artifact.generation) are generated from these declarations; a test reads
every flag from the CLI's command tree and fails where one is declared twice.

A leaf: it imports nothing of the package but the errors.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import struct
import typing
from dataclasses import dataclass
from typing import Any

from gpt2onnx.errors import BadInput

COUNT_MAX = 2**31 - 1  # counts and sizes: what an int32 attribute or config field holds
SEED_MAX = 2**63 - 1


@dataclass(frozen=True)
class Rule:
    """One setting's rule: ``kind`` int, float or bool; the closed range [low, high] (``open_low``: low itself
    excluded); ``token``: a token id (the high end is the vocabulary's last id)."""

    kind: str
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    token: bool = False

    def wanted(self, vocab_size: int | None = None) -> str:
        """The rule in words (the same in every message that applies it)."""
        if self.kind == "bool":
            return "true or false"
        if self.token:
            top = COUNT_MAX if vocab_size is None else vocab_size - 1
            return f"a token id: an integer from 0 to {top}" + (" (the vocabulary)" if vocab_size else "")
        if self.kind == "int":
            return f"an integer from {self.low:,} to {self.high:,}"
        if self.open_low:
            return f"a finite number above {self.low:g} and at most {self.high:g}"
        return f"a finite number from {self.low:g} to {self.high:g}"

    def _within(self, value: float, *, narrow=float) -> bool:
        low, high = narrow(self.low), narrow(self.high)  # the bounds in the same type as the value
        return (value > low if self.open_low else value >= low) and value <= high

    def check(self, value, *, name: str, source: str, vocab_size: int | None = None):
        """``value`` typed (int, float or bool) if it meets the rule, else BadInput: '{name} {value} {source}
        is not {rule}: {what to do}'. ``source``: '(--top-k)' for an option, "in 'FILE'" for a file."""
        if self.kind == "bool":
            ok = isinstance(value, bool)
        elif self.kind == "int":
            low, high = (0, vocab_size - 1 if vocab_size else COUNT_MAX) if self.token else (self.low, self.high)
            ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            ok = ok and self._within(value)
            # and as the runtimes store it (ONNX attributes, float32 scores)
            if ok and not self._within(as_float32(value), narrow=as_float32):
                raise BadInput(
                    f"{name} {_shown(value)} {source} is {as_float32(value):g} as a float32, the type the runtimes"
                    f" store it in, which is not {self.wanted(vocab_size)}: give a value float32 can hold"
                )
        if not ok:
            hint = "fix or delete the field" if source.startswith("in ") else "give another value"
            raise BadInput(f"{name} {_shown(value)} {source} is not {self.wanted(vocab_size)}: {hint}")
        return float(value) if self.kind == "float" else value


def as_float32(value: float) -> float:
    """``value`` rounded to float32, as a runtime that stores it in that type holds it (1e-46 is 0.0)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _shown(value) -> str:
    try:
        text = json.dumps(value)  # as the file has it: NaN, Infinity, "50256", true
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class Param:
    """An option's declaration beside its field: ``help`` (one line); ``flag``: its command-line option (None: the
    field's name with dashes; "": none); ``short``: a one-letter alias; ``metavar``; ``rule``: its range;
    ``name``: transformers' name where it differs (a request's and generation_config.json's key); ``served``:
    a served request may give it; ``config``: generation_config.json gives it; ``cli``: the command line's type
    and default where they differ from the field's (early_stopping's words, --stop's list)."""

    help: str
    flag: str | None = None
    short: str | None = None
    metavar: str | None = None
    rule: Rule | None = None
    name: str | None = None
    served: bool = False
    config: bool = False
    cli: tuple[type, Any] | None = None
    show_default: bool = True
    writes: str | None = None  # a path the command writes: "file" or "folder" (checked as every output is)


def param(default=dataclasses.MISSING, help: str = "", **declared) -> Any:
    """A dataclass field with its option's declaration (:class:`Param`)."""
    return dataclasses.field(default=default, metadata={"param": Param(help, **declared)})


@dataclass(frozen=True)
class Option:
    """A declared option as its class holds it: the field's name, type and default, and its declaration."""

    field: str
    type: Any
    default: Any
    param: Param

    @property
    def flag(self) -> str | None:
        """Its command-line option (None: it has none)."""
        if self.param.flag == "":
            return None
        return (self.param.flag or "--" + self.field.replace("_", "-")).split("/")[0]  # "--spin" of "--spin/--no-spin"

    @property
    def names(self) -> list[str]:
        """The command line's spellings: the flag (with its negation: "--spin/--no-spin"), and its short alias."""
        full = self.param.flag or "--" + self.field.replace("_", "-")
        return [full, *([self.param.short] if self.param.short else [])]

    @property
    def key(self) -> str:
        """Its name outside the command line: transformers' where it differs, else the field's."""
        return self.param.name or self.field


@functools.cache  # a class's declarations do not change; the server checks every request's options by them
def options_of(cls) -> tuple[Option, ...]:
    """The declared options of a dataclass, in field order (fields without a declaration are left out)."""
    hints = typing.get_type_hints(cls)
    return tuple(
        Option(f.name, hints[f.name], f.default, f.metadata["param"])
        for f in dataclasses.fields(cls)
        if "param" in f.metadata
    )


def flags_of(cls) -> dict[str, str]:
    """field → flag of a class's declared options (those with a command-line flag)."""
    return {o.field: o.flag for o in options_of(cls) if o.flag}
