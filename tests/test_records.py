"""Every record the tool writes as JSON goes through the one serializer (gpt2onnx.records) and comes back equal:
each one is built from its type hints (every field set, then only the required ones), written to JSON text, read
back and compared; and every record is frozen."""

import dataclasses
import enum
import importlib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import pytest

from gpt2onnx import records
from gpt2onnx.records import RECORDS, Record, field, from_json, to_json

PACKAGE = Path(records.__file__).parent


def _record_modules() -> list[str]:
    """The modules that use the serializer (read from their text, so nothing else need be imported)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "gpt2onnx.records import" in path.read_text() and path.name != "records.py":
            found.append(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
    return found


for _module in _record_modules():
    importlib.import_module(_module)
ALL = sorted(RECORDS, key=lambda cls: (cls.__module__, cls.__qualname__))

# Records that must stay mutable, each with its reason. Empty: every record is frozen.
MUTABLE_ALLOWED: set[type] = set()
# Reports written and never read back, whose JSON keeps some fields only inside rows it computes: the round trip
# checks that they are written to JSON text whole, not that they read back.
WRITE_ONLY = {
    "PrecisionReport",  # recipes, sizes and gate figures: in its "summary" rows only
    "RuntimeOptions",  # its settings are its runtime's type (runtime_spec(name).settings): only ever written
    "ModelDescription",  # inspect --json: a summary of the folder's manifest, not the manifest
    "ConstraintCostReport",  # each constraint written with its figures from the rounds
}


class _Values:
    """Values for a type, from its hints: ``full`` sets every optional field and moves every default; otherwise
    only the required fields are set. Numbers differ field by field, so a value written under the wrong key or
    read into the wrong field is seen."""

    def __init__(self, full: bool):
        self.full, self.count = full, 0

    def next(self) -> int:
        self.count += 1
        return self.count

    def of(self, kind: Any, depth: int, default: Any = dataclasses.MISSING) -> Any:
        origin, args = typing.get_origin(kind), typing.get_args(kind)
        if origin is Union or origin is types.UnionType:
            options = [a for a in args if a is not type(None)]
            if type(None) in args and (depth > 2 or not self.full):
                return None
            return self.of(options[0], depth)
        if origin is Literal:
            return args[-1]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            return self.record(kind, depth + 1)
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return list(kind)[-1]
        if kind is bool:
            return not default if isinstance(default, bool) else True
        if kind is int:
            return self.next()
        if kind is float:
            return self.next() + 0.25
        if kind is str:
            return f"text {self.next()}"
        if kind is Path:
            return Path(f"folder/{self.next()}")
        if kind is Any or kind is object or kind is dict or origin is dict and args[1] is Any:
            return {f"key {self.next()}": [self.next(), "x", None, True]}
        if origin is dict:
            return {self.of(args[0], depth): self.of(args[1], depth)}
        if kind in (list, tuple):
            return kind([self.next()])
        if origin in (list, tuple):
            return (
                origin([self.of(args[0], depth)])
                if len(args) < 2 or args[1] is Ellipsis
                else tuple(self.of(a, depth) for a in args)
            )
        raise AssertionError(f"no value for {kind!r}: teach _Values this type")

    def machine(self):
        from gpt2onnx.machine import MachineRecord

        return self.record(MachineRecord, 1)

    def record(self, cls: type, depth: int = 0):
        if cls.__qualname__ in CONSISTENT and depth > 0:  # nested: built whole too
            return CONSISTENT[cls.__qualname__](self, self.full)
        hints, values = typing.get_type_hints(cls), {}
        for f in dataclasses.fields(cls):
            rules = f.metadata.get("json") or {}
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if rules.get("unreadable") or rules.get("order") or not (required or self.full):
                continue  # unreadable and the key order are read, never written
            default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
            values[f.name] = self.of(hints[f.name], depth, default)
        return cls(**values)


def _rounds(values: _Values, full: bool, names=("a", "b"), figures=("ms", "tokens_per_s")):
    """Rounds computes its summary from its series: every variant has every figure, the baseline is a variant."""
    from gpt2onnx.benchmarks.harness import Load, Rounds, Series

    series = tuple(Series(v, f, (1.0 + i, 2.5)) for i, v in enumerate(names) for f in figures)
    load = values.record(Load, 1)
    orders = (tuple(names), tuple(reversed(names)))
    return Rounds(tuple(names), names[0] if full else None, 1, orders, series, load, values.machine())


def _constraint_cost(values: _Values, full: bool):
    """Its constraints' figures are read from its rounds, by the constraint's name and its mask's."""
    from gpt2onnx.benchmarks.constraint_cost import FIGURE, UNCONSTRAINED, ConstraintCostReport, ConstraintRun

    run = dataclasses.replace(values.record(ConstraintRun, 1), name="regex")
    names = (UNCONSTRAINED, run.name, run.mask_variant)
    return ConstraintCostReport("folder", 3, 1, (run,), _rounds(values, True, names, (FIGURE,)))


def _precision_report(values: _Values, full: bool):
    """Its rows join its variants' recipes, sizes, quality rows, timings and gate figures by name."""
    from gpt2onnx.artifact.report import EvalReport
    from gpt2onnx.benchmarks.compare.precision_grid import GateFigures, GridSettings, PrecisionReport

    quality = _Values(full=True).record(EvalReport)  # a variant's row has every figure
    names = [f"variant {i}" for i in range(len(quality.rows))]
    rounds = _rounds(values, full)
    rounds = dataclasses.replace(
        rounds,
        variants=tuple(names),
        baseline=names[0],
        series=tuple(dataclasses.replace(s, variant=names[0]) for s in rounds.series if s.variant == "a"),
    )
    return PrecisionReport(
        model="model",
        settings=values.record(GridSettings),
        recipes=dict.fromkeys(names, "a recipe"),
        sizes=dict.fromkeys(names, 1000),
        quality=quality,
        gates=dict.fromkeys(names, values.record(GateFigures)),
        rounds=rounds,
        refused={},
    )


def _compare_report(values: _Values, full: bool):
    """Its rows join each variant's record with its speed rounds by name."""
    from gpt2onnx.benchmarks.compare.compare import CompareReport, VariantRecord

    report = values.record(CompareReport)
    variants = tuple(dataclasses.replace(values.record(VariantRecord), name=name) for name in "ab")
    return dataclasses.replace(report, variants=variants, speed=_rounds(values, full))


def _provider(values: _Values, full: bool):
    """Settings refuse a provider or precision they do not know: a known one, every other field moved."""
    from gpt2onnx.runtimes.providers import ProviderConfig

    return ProviderConfig("cpu", threads=2, spinning=False, arena=False, max_batch=7) if full else ProviderConfig()


def _openvino(values: _Values, full: bool):
    from gpt2onnx.runtimes.openvino import OpenVinoSettings

    return OpenVinoSettings("GPU", "bf16", threads=3) if full else OpenVinoSettings()


def _runtime_options(values: _Values, full: bool):
    from gpt2onnx.runtimes.all_runtimes import RuntimeOptions

    return RuntimeOptions("openvino", _openvino(values, full)) if full else RuntimeOptions()


# Records whose fields are bound by an invariant that a value per type cannot keep: built by hand, still whole.
CONSISTENT = {
    "Rounds": _rounds,
    "ConstraintCostReport": _constraint_cost,
    "PrecisionReport": _precision_report,
    "CompareReport": _compare_report,
    "ProviderConfig": _provider,
    "OpenVinoSettings": _openvino,
    "RuntimeOptions": _runtime_options,
}


def round_trip(cls: type, *, full: bool):
    values = _Values(full)
    build = CONSISTENT.get(cls.__qualname__)
    record = build(values, full) if build else values.record(cls)
    written = to_json(record)
    missing = {c.key for c in cls.json_computed} - written.keys()
    assert not missing, f"{cls.__qualname__}: computed keys not written: {sorted(missing)}"
    text = json.dumps(written, allow_nan=False)
    if cls.__qualname__ in WRITE_ONLY:
        return
    again = from_json(cls, json.loads(text))
    assert again == record, f"{cls.__qualname__} read back differs:\n{record!r}\n{again!r}\nfrom {text}"
    assert json.dumps(to_json(again)) == text, f"{cls.__qualname__} writes back other JSON"


def test_every_record_module_found():
    # the package's records: the manifest's, the reports', the machine's (the list grows as modules move over)
    names = {cls.__qualname__ for cls in ALL}
    assert {"Manifest", "CheckReport", "EvalReport", "Figures", "MachineRecord", "IOSpec"} <= names


@pytest.mark.parametrize("full", [True, False], ids=["every field", "required fields"])
@pytest.mark.parametrize("cls", ALL, ids=lambda cls: f"{cls.__module__.removeprefix('gpt2onnx.')}.{cls.__qualname__}")
def test_round_trip(cls, full):
    round_trip(cls, full=full)


@pytest.mark.parametrize("cls", ALL, ids=lambda cls: cls.__qualname__)
def test_records_are_frozen(cls):
    assert dataclasses.is_dataclass(cls), f"{cls.__qualname__} is marked Record but is not a dataclass"
    assert cls.__dataclass_params__.frozen or cls in MUTABLE_ALLOWED, f"{cls.__qualname__} is not frozen"


def test_nested_dataclasses_are_records():
    """A dataclass inside a record is written by the same serializer, so it is a record too (and tested here)."""

    def dataclasses_in(kind):
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            yield kind
        for arg in typing.get_args(kind):
            yield from dataclasses_in(arg)

    unmarked = {
        f"{cls.__qualname__}.{name}: {inner.__qualname__}"
        for cls in ALL
        for name, kind in ((f.name, typing.get_type_hints(cls)[f.name]) for f in dataclasses.fields(cls))
        for inner in dataclasses_in(kind)
        if not issubclass(inner, Record)
    }
    assert not unmarked


def test_round_trip_fails_on_a_lossy_record():
    """The round trip sees a field that does not come back: here one written only where set whose rule is wrong."""

    @dataclasses.dataclass(frozen=True)
    class Lossy(Record):
        kept: int
        dropped: int = field(default=0, omit=lambda record: True)

    try:
        with pytest.raises(AssertionError, match="Lossy read back differs"):
            round_trip(Lossy, full=True)
    finally:
        RECORDS.remove(Lossy)


def test_reading_is_strict():
    """A damaged record is refused, naming where: never coerced, never half read."""
    from gpt2onnx.artifact.report import DiffStats, Figures

    assert from_json(Figures, {"logits": {"max": 1}, "later": [1]}).extra == {"later": [1]}
    for damaged, where in (
        ({"logits": {"max": "1"}}, "Figures.logits.max: not a number"),
        ({"logits": {"max": True}}, "Figures.logits.max: not a number"),
        ({"logits": {"max": 1, "p95": 2}}, "Figures.logits: unknown keys \\['p95'\\]"),
        ({"positions_compared": 2.5}, "Figures.positions_compared: not a integer"),
    ):
        with pytest.raises(records.RecordError, match=where):
            from_json(Figures, damaged)
    with pytest.raises(records.RecordError, match="DiffStats: no 'max'"):
        from_json(DiffStats, {})
