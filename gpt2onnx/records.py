"""One serializer for every record the tool writes as JSON: ``to_json(record) -> dict`` and
``from_json(cls, data) -> record``, read from the dataclass's own fields and type hints.

A record is a frozen dataclass that subclasses :class:`Record` (the marker: ``RECORDS`` lists them all, and
tests/test_records.py round-trips each one from its type hints). Its fields are written in their order under
their names, nested records, tuples, enums, paths, optional and union fields alike, and read back strictly:
an int is an int (never a bool), a str a str, a float any JSON number (kept as read, so a file writes back
byte-equal), a key the record does not know is refused (a damaged record is refused whole, never half read).
What a folder's format fixed before this module existed is said beside the field, with :func:`field`:

- ``key``: the JSON key, where it is not the field's name (Manifest.cache_layout is written as "kv_cache");
- ``omit``: ``OMIT_DEFAULT`` (written only where it differs from its default: a key added in a later release is
  absent from earlier files and stays absent), or a test on the record (QuantizationRecord's recipe group);
- ``empty``: None is written as {} and {} read as None (a record's absence, as earlier releases wrote it);
- ``write`` / ``read``: the value written from the record, and the field's value from what was read (a
  report's "failures" are all its failures; it keeps its own gates');
- ``extra``: a dict field that keeps the keys this release does not know, written back at its place (a key
  already written keeps its own);
- ``within``: the key of a JSON object the field is written into (RunStats' notes, under "extra" where bench
  --json has always had them); a dict field written under that key holds the object's other keys;
- ``order``: a tuple field that keeps the order the keys were read in, so a record read back writes back
  byte-equal.

A record with ``json_tolerant = True`` (the manifest) reads a damaged field as its default, keeps what was
written in its ``extra`` field and names the key in its ``unreadable`` field: the model files, not these
records, are what a folder is checked by. A record writes a figure it computes (``EvalReport.passed``) with
:func:`computed`, and reads past it.

Why one generic function over pydantic (installed for FastAPI) or cattrs/msgspec (not installed): the JSON is a
folder format older than the types, and its rules are per field (a key written only where set, a group written
together, keys kept in read order, unknown keys kept, a damaged manifest record kept and named); pydantic's
``TypeAdapter`` would take most of these as hand-written serializer and validator hooks anyway, and its reading is
either lax (it coerces: "3" reads as 3) or, strict, refuses a dict for a dataclass (checked with pydantic 2.14).
The serializer is the two functions below and their rules, with no dependency and nothing built at import.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, Union

RECORDS: list[type] = []  # every Record subclass, in the order their modules were imported
OMIT_DEFAULT = "omit-default"


class RecordError(ValueError):
    """A record that cannot be read from the JSON given: where and why."""


class OtherShape(RecordError):
    """A field written in a shape this release does not read (an older release's): in a tolerant record it is
    kept as it was, like a damaged one, but not named unreadable."""


class Record:
    """The marker of a record: a frozen dataclass written with :func:`to_json` and read with :func:`from_json`."""

    json_computed: ClassVar[tuple[Computed, ...]] = ()
    json_tolerant: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        RECORDS.append(cls)

    def as_dict(self) -> dict:
        return to_json(self)

    @classmethod
    def from_dict(cls, data: Any):
        return from_json(cls, data)


@dataclasses.dataclass(frozen=True)
class Computed:
    """A key written from a property or method of the record (after field ``after``, else at the end), not read."""

    key: str
    attribute: str
    after: str | None = None


def computed(key: str, attribute: str | None = None, *, after: str | None = None) -> Computed:
    return Computed(key, attribute or key, after)


def field(
    *,
    key=None,
    omit=None,
    write=None,
    read=None,
    within=None,
    empty=False,
    extra=False,
    order=False,
    unreadable=False,
    **kwargs,
):
    """A dataclass field with its JSON rules (see the module's docstring)."""
    rules = {"key": key, "omit": omit, "write": write, "read": read, "within": within, "empty": empty}
    rules |= {"extra": extra, "order": order, "unreadable": unreadable}
    return dataclasses.field(metadata={"json": rules}, **kwargs)


def _rules(f: dataclasses.Field) -> dict:
    return f.metadata.get("json") or {}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


# -- writing ---------------------------------------------------------------------------------------------
def to_json(value: Any) -> Any:
    """A record (or any value inside one) as JSON data: dicts, lists, strings, numbers, booleans, None."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _record_to_json(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {(k.value if isinstance(k, enum.Enum) else k): to_json(v) for k, v in value.items()}
    return value


def _record_to_json(record) -> dict:
    out: dict[str, Any] = {}
    order: tuple = ()
    computed = getattr(record, "json_computed", ())

    def computed_after(name: str) -> None:  # the keys computed after a field, or after another computed key
        for c in computed:
            if c.after == name:
                out[c.key] = to_json(_attribute(record, c.attribute))
                computed_after(c.key)

    for f in dataclasses.fields(record):
        rules, value = _rules(f), getattr(record, f.name)
        if rules.get("extra"):
            out.update(value)  # a key already written keeps its place
        elif rules.get("order"):
            order = value
        elif not rules.get("unreadable"):
            omit = rules.get("omit")
            skip = value == _default(f) if omit == OMIT_DEFAULT else bool(omit and omit(record))
            if not skip:
                # a field "within" an object is written into it (the object's own dict field comes first)
                target = out.setdefault(rules["within"], {}) if rules.get("within") else out
                written = to_json(rules["write"](record) if rules.get("write") else value)
                target[rules.get("key") or f.name] = {} if written is None and rules.get("empty") else written
        computed_after(f.name)
    for c in computed:
        if not c.after:
            out[c.key] = to_json(_attribute(record, c.attribute))
    if order:
        return {**{k: out[k] for k in order if k in out}, **{k: v for k, v in out.items() if k not in order}}
    return out


def _attribute(record, name: str):
    value = getattr(record, name)
    return value() if callable(value) else value


# -- reading ---------------------------------------------------------------------------------------------
def from_json(cls: type, data: Any, *, where: str | None = None) -> Any:
    """A ``cls`` read from JSON data; RecordError (a ValueError) naming the place where a part is damaged."""
    return _read(cls, data, where or getattr(cls, "__name__", str(cls)))


def _read(kind: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any or kind is object:
        return value
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _read(arg, value, where)
            except RecordError as error:
                errors.append(str(error))
        raise RecordError(errors[0] if len(errors) == 1 else f"{where}: not any of {kind}: {value!r}")
    if origin is Literal:
        if value not in args:
            raise RecordError(f"{where}: not one of {list(args)}: {value!r}")
        return value
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return _read_record(kind, value, where)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(value)
        except ValueError:
            raise RecordError(f"{where}: not a {kind.__name__}: {value!r}") from None
    if kind is type(None):
        return _check(value is None, value, where, "null")
    if kind is bool:
        return _check(isinstance(value, bool), value, where, "boolean")
    if kind is int:
        return _check(isinstance(value, int) and not isinstance(value, bool), value, where, "integer")
    if kind is float:  # any number, kept as read (1 stays 1: written back the same)
        return _check(isinstance(value, (int, float)) and not isinstance(value, bool), value, where, "number")
    if kind is str:
        return _check(isinstance(value, str), value, where, "string")
    if kind is Path:
        return Path(_check(isinstance(value, str), value, where, "path"))
    if kind in (dict, list, tuple) or origin in (dict, list, tuple):
        base = origin or kind
        if base is dict:
            _check(isinstance(value, dict), value, where, "object")
            if not args:
                return dict(value)
            keys, values = args
            return {_read(keys, k, where): _read(values, v, f"{where}.{k}") for k, v in value.items()}
        _check(isinstance(value, (list, tuple)), value, where, "list")
        if not args:
            return base(value)
        if base is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            _check(len(value) == len(args), value, where, f"list of {len(args)}")
            return tuple(_read(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        return base(_read(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    raise RecordError(f"{where}: cannot read a {kind!r}")


def _optional(kind: Any) -> bool:
    return typing.get_origin(kind) in (Union, types.UnionType) and type(None) in typing.get_args(kind)


def _check(ok: bool, value: Any, where: str, what: str) -> Any:
    if not ok:
        raise RecordError(f"{where}: not a {what}: {value!r}")
    return value


def _read_record(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise RecordError(f"{where}: not a {cls.__name__} record: {data!r}")
    hints, values, extra_field, seen = _hints(cls), {}, None, set()
    tolerant, damaged = getattr(cls, "json_tolerant", False), {}
    nested: dict[str, set[str]] = {}  # object key -> the keys of the fields written within it
    for f in dataclasses.fields(cls):
        if _rules(f).get("within"):
            nested.setdefault(_rules(f)["within"], set()).add(_rules(f).get("key") or f.name)
    for f in dataclasses.fields(cls):
        rules = _rules(f)
        if rules.get("extra"):
            extra_field = f.name
            continue
        if rules.get("order"):
            values[f.name] = tuple(data)
            continue
        if rules.get("unreadable"):
            continue
        key, source = rules.get("key") or f.name, data
        if rules.get("within"):
            source = data.get(rules["within"])
            source = source if isinstance(source, dict) else {}
        else:
            seen.add(key)
        raw = source.get(key)
        if rules.get("empty") and raw == {}:
            raw = None
        if key in nested and isinstance(raw, dict):  # the object's other keys
            raw = {k: v for k, v in raw.items() if k not in nested[key]}
        if (key not in source or (tolerant and raw is None)) and not rules.get("read"):
            if _default(f) is not dataclasses.MISSING:
                continue
            if not _optional(hints[f.name]):
                raise RecordError(f"{where}: no '{key}'")
        try:
            values[f.name] = rules["read"](raw) if rules.get("read") else _read(hints[f.name], raw, f"{where}.{key}")
        except RecordError as error:
            if not tolerant or _default(f) is dataclasses.MISSING:
                raise
            damaged[key] = not isinstance(error, OtherShape)  # read as its default; kept as it was, and named

    seen |= {c.key for c in getattr(cls, "json_computed", ())}
    unknown = {k: v for k, v in data.items() if k not in seen}
    if damaged:
        unknown = {k: v for k, v in data.items() if k in damaged or k in unknown}  # in the order read
        named = [key for key, named in damaged.items() if named]
        values |= {f.name: named for f in dataclasses.fields(cls) if _rules(f).get("unreadable")}
    if extra_field is not None:
        values[extra_field] = unknown
    elif unknown:
        raise RecordError(f"{where}: unknown keys {sorted(unknown)}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as error:
        raise RecordError(f"{where}: {error}") from None
