"""Declared capabilities, and the one resolver that reads them.

Every plug-in kind (precision, int4 algorithm, prompt kernel, K/V cache dtype, cache layout, fusion profile, runtime,
provider, deploy target, decoding strategy, the batching engine) declares a :class:`Declared`: the facts it ensures
(a value per fact, or ops and features it adds to a set) and what it requires of the facts the other choices
ensure (:class:`Need`, :class:`Lacks`). :func:`resolve` takes the declarations of what a user chose, with a folder's
own read from its graph, and answers whether they work together; where they do not, each conflict is one line:
which choice needs what, which choice makes it otherwise, and what to choose instead (the alternatives on the
maker's axis that ensure what is needed, read from their declarations).

The facts are named here (:data:`FACTS`), each with the value it has where no choice says otherwise; their values
and the plug-ins are their modules' own: this module imports nothing of the package but the errors (a leaf), and
every layer may ask it. onnx-ir's passes (``requires``/``ensures``) and transformers' processors
(``supports_continuous_batching``) are the models: a capability is data on the plug-in, not a refusal written in
one of its callers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from gpt2onnx.errors import BadInput, RuntimeUnavailable


@dataclass(frozen=True)
class Fact:
    """A property of a combination: its key, its value where nothing ensures it, whether choices add to it (a set:
    ops, features) rather than set it, and how it reads in a message (``noun``). ``derive``: a fact no choice
    ensures but the others decide (a function of their values); the choice it is said to come from is the first
    whose own facts make it so."""

    key: str
    default: object
    noun: str
    is_set: bool = False
    verb: str = "writes"  # a set fact: what its maker does with an item ("a precision writes MatMulNBits")
    derive: Callable[[Mapping[str, object]], object] | None = None
    detail: Callable[[Mapping[str, object]], list[str]] | None = None  # a derived fact's cause, in a choice's facts


def _contrib(values: Mapping[str, object]) -> bool:
    return bool(_contrib_ops(values))


def _separable(values: Mapping[str, object]) -> bool:
    return not values.get("batch_dependent")


def _invariant(values: Mapping[str, object]) -> bool:
    return _separable(values) and not values.get("padding_dependent")


def _dependent(values: Mapping[str, object]) -> list[str]:
    padding = [PADDING_SUMS] if values.get("padding_dependent") else []
    return sorted(values.get("batch_dependent", ())) + padding


PADDING_SUMS = (
    "attention sums that follow a row's left padding"
    " (a fused attention kernel's, or a graph exported before 2026-12-07)"
)


def _contrib_ops(values: Mapping[str, object]) -> list[str]:
    return sorted(op for domain, op in values.get("ops", ()) if domain == "com.microsoft")


FACTS: dict[str, Fact] = {
    fact.key: fact
    for fact in (
        # what the graph holds
        Fact("ops", frozenset(), "ops", is_set=True),  # (domain, op type), subgraphs included
        Fact("contrib_ops", False, "com.microsoft ops", derive=_contrib, detail=_contrib_ops),
        Fact("activations", "float32", "activations"),  # the element type of activations and the float cache
        Fact("weight_bits", None, "weight width"),  # None: float weights
        Fact("zero_points", False, "zero points"),  # 4-bit weights with zero points (not symmetric)
        Fact("kv_dtype", "float", "K/V cache type"),  # float, or a quantized format's name
        Fact("logits", "all", "logits"),  # every position's, or the last only
        Fact("upcast_attention", False, "fp32 attention scores"),  # the architecture's reorder_and_upcast_attn
        Fact("body_in_if", False, "the block stack inside an If"),  # int4's prompt path holds it in an If
        Fact("exact_step_rows", None, "rows a step computes on its own weights"),  # None: any
        # what of a step's arithmetic depends on its other rows (a per-tensor activation scale, a kernel chosen by
        # the row count): empty, a row gets the same logits alone and batched (issue 54)
        Fact("batch_dependent", frozenset(), "arithmetic that depends on the other rows", is_set=True, verb="has"),
        # a fused attention kernel sums along the key axis in an order tied to the column index: a left-padded
        # row's sums change unless its padding changes by a multiple of 16 columns (passes/batch_invariance.py
        # aligns unfused attention in the graph; the batching engine runs such rows in groups by their padding)
        Fact("padding_dependent", False, PADDING_SUMS),
        Fact(
            "batch_separable",
            True,
            "arithmetic that depends on the other rows of a step",
            derive=_separable,
            detail=lambda values: sorted(values.get("batch_dependent", ())),
        ),
        Fact(
            "batch_invariant",
            True,
            "a row's arithmetic independent of its batch and its padding",
            derive=_invariant,
            detail=_dependent,
        ),
        # the cache layout
        Fact("cache_grows", True, "growing past"),  # takes past = all tokens so far, present = past + new
        Fact("cache_in_place", False, "in-place cache"),  # one buffer bound as past and present
        Fact("host_buffers", False, "host-memory cache buffers"),  # the stepper binds numpy buffers
        Fact("quantizable_cache", False, "quantized cache"),  # its attention op stores int8/int4 K/V
        # the source folder of optimize (its own facts, under source_*)
        Fact("source_weight_bits", None, "the source's weight width"),
        Fact("source_activations", "float32", "the source's activations"),
        Fact("source_kv_dtype", "float", "the source's K/V cache type"),
        Fact("source_body_in_if", False, "the source's block stack inside an If"),
        Fact("source_profile", None, "the source's fusion profile"),
        Fact("profile", None, "a fusion profile"),  # the profile a graph is fused with (None: unfused)
        # where and how it runs
        Fact("device_memory", False, "device memory"),  # the provider keeps tensors on a GPU
        Fact("owns_loop", False, "generation loop of its own"),
        Fact("step_logits", True, "each step's logits"),  # forced tokens, per-step logits and times
        Fact("checks_proposals", False, "check of proposals in one step"),  # a stepper that crops its cache
        Fact("batches_rows", False, "batch that rows join and leave"),
        Fact("adapter_per_request", False, "switchable LoRA adapter per request"),  # the batching engine's
        Fact("binds_adapters", False, "binding of a switchable LoRA adapter's factors"),  # a runtime's (--adapter)
        Fact("adapter_files", False, "switchable LoRA adapter files"),  # a folder's NAME.onnx_adapter (--adapters)
        Fact("transformers_js_dtype", None, "transformers.js dtype"),
        Fact("data_files", 0, "external data files"),
        Fact("vocab_size", None, "vocabulary"),  # a folder's, where a draft's is compared with it
        Fact("features", frozenset(), "decoding features", is_set=True, verb="uses"),  # what a request uses
        # a request's settings that a search op takes as attributes (None: the request does not use them)
        Fact("no_repeat_ngram_size", 0, "no_repeat_ngram_size (--no-repeat-ngram-size)"),
        Fact("early_stopping", None, "early_stopping (--early-stopping)"),  # beams only
        Fact("length_penalty", None, "length_penalty (--length-penalty)"),  # beams only
        Fact("temperature", None, "temperature (--temperature)"),  # sampling only
        Fact("top_p", None, "top_p (--top-p)"),  # sampling only
        # a deployment a runtime runs (ort-generate's files); None: not read (a planned export)
        Fact("search_files", None, "ort-generate's files (deploy --target ort-generate)"),
    )
}


FACTS_DEFAULTS = MappingProxyType({key: f.default for key, f in FACTS.items()})


def fact(key: str) -> Fact:
    if key not in FACTS:
        raise ValueError(f"unknown fact '{key}': declare it in gpt2onnx.capabilities.FACTS")
    return FACTS[key]


@dataclass(frozen=True)
class Need:
    """A requirement on one fact: its value must be one of ``allowed`` (or none of ``refused``), wherever the facts in
    ``when`` hold (each its value, or one of a set of values). ``why``: what the requiring choice does that needs
    it, as a clause ("runs a loop that feeds a growing past"); ``fix``: advice that replaces the computed one
    ("{value}": the value it refuses)."""

    fact: str
    allowed: frozenset = frozenset()
    refused: frozenset = frozenset()
    why: str = ""
    when: Mapping[str, object] = field(default_factory=dict)
    fix: str = ""

    def __post_init__(self) -> None:
        fact(self.fact)
        for key in self.when:
            fact(key)
        object.__setattr__(self, "allowed", frozenset(self.allowed))
        object.__setattr__(self, "refused", frozenset(self.refused))
        object.__setattr__(self, "when", MappingProxyType(dict(self.when)))
        if bool(self.allowed) == bool(self.refused):
            raise ValueError(f"a need on '{self.fact}' names the values it allows or those it refuses, one of them")

    def met_by(self, value) -> bool:
        return value in self.allowed if self.allowed else value not in self.refused


@dataclass(frozen=True)
class Lacks:
    """A requirement on a set fact: none of ``items`` (ops, features) may be in it. ``why``: the reason, as a clause
    ("has no CUDA kernel for"); ``items`` may map each item to its own reason, which may place the item itself
    ("{item}")."""

    fact: str
    items: Mapping[object, str]
    why: str = ""
    fix: str = ""

    def __post_init__(self) -> None:
        if not fact(self.fact).is_set:
            raise ValueError(f"'{self.fact}' is not a set fact: use Need")
        items = self.items if isinstance(self.items, Mapping) else {item: "" for item in self.items}
        object.__setattr__(self, "items", MappingProxyType(dict(items)))


@dataclass(frozen=True)
class Declared:
    """What one choice declares: its axis and name, how a user makes it (``choose``: "--fusion onnx"), what it
    ensures (fact → value; a set fact's value is added to the others'), what it requires, and how it says the
    values it ensures (fact → clause: "keeps one fixed-size K/V buffer"). ``origin``: "option" for a choice the
    command makes, "folder" for what a folder already is (its advice then says to export it again)."""

    axis: str
    name: str
    choose: str = ""
    ensures: Mapping[str, object] = field(default_factory=dict)
    requires: tuple[Need | Lacks, ...] = ()
    says: Mapping[str, str] = field(default_factory=dict)
    origin: str = "option"
    label: str = ""  # how a message names it; default "AXIS NAME"

    def __post_init__(self) -> None:
        for key in (*self.ensures, *self.says):
            if fact(key).derive is not None and key in self.ensures:
                raise ValueError(f"'{key}' is derived from other facts: a choice cannot ensure it")
        ensures = {k: frozenset(v) if FACTS[k].is_set else v for k, v in self.ensures.items()}
        object.__setattr__(self, "ensures", MappingProxyType(ensures))
        object.__setattr__(self, "says", MappingProxyType(dict(self.says)))
        object.__setattr__(self, "requires", tuple(self.requires))

    @property
    def shown(self) -> str:
        """The choice as a message names it: its label, or "the AXIS NAME" (with how it is chosen)."""
        if self.label:
            return self.label
        how = f" ({self.choose})" if self.choose and self.choose != self.name else ""
        return f"{self.axis} {self.name}{how}"

    def with_(
        self, *, ensures: Mapping | None = None, requires: Iterable = (), says: Mapping | None = None, **changes
    ) -> "Declared":
        """A copy with more facts ensured, more needs and clauses (a profile with the facts of its layout)."""
        merged = dict(self.ensures)
        for key, value in (ensures or {}).items():
            merged[key] = merged.get(key, frozenset()) | frozenset(value) if FACTS[key].is_set else value
        return Declared(
            **{
                "axis": self.axis,
                "name": self.name,
                "choose": self.choose,
                "origin": self.origin,
                "label": self.label,
                **changes,
                "ensures": merged,
                "requires": (*self.requires, *requires),
                "says": {**self.says, **(says or {})},
            }
        )

    def from_folder(self, folder: str) -> "Declared":
        """The same declaration as what ``folder`` already is (its advice says to export it again)."""
        return Declared(
            self.axis,
            self.name,
            self.choose,
            self.ensures,
            self.requires,
            self.says,
            "folder",
            f"'{folder}' ({self.axis} {self.name})",
        )


def as_source(declared: Declared) -> Declared:
    """A folder's declaration as optimize's source: its facts under source_* (where the source has such a fact)."""
    ensures = {f"source_{k}": v for k, v in declared.ensures.items() if f"source_{k}" in FACTS}
    says = {f"source_{k}": v for k, v in declared.says.items() if f"source_{k}" in FACTS}
    return Declared(declared.axis, declared.name, declared.choose, ensures, (), says, "folder", declared.label)


@dataclass(frozen=True)
class Conflict:
    """One reason a combination does not work: who needs it, which fact, who makes it otherwise, the line, and the
    axes of the two choices."""

    needer: str
    fact: str
    maker: str | None
    line: str
    axes: tuple[str, ...] = ()

    @property
    def on_runtime(self) -> bool:
        """A provider is in it, or a runtime cannot run what the graph's choices made (not a request's option)."""
        needer, *maker = self.axes
        return "provider" in self.axes or (needer == "runtime" and bool(maker) and maker[0] in GRAPH_AXES)


@dataclass(frozen=True)
class Verdict:
    """What :func:`resolve` found: the choices (as shown), the facts they make, and the conflicts (none: it works)."""

    choices: tuple[str, ...]
    facts: Mapping[str, object]
    conflicts: tuple[Conflict, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.conflicts

    @property
    def line(self) -> str:
        """One line: "supported", or the first conflict."""
        return "supported" if self.ok else self.conflicts[0].line

    def check(self) -> "Verdict":
        """Raise where a conflict was found, in one line: :class:`UnsupportedRuntime` (exit code 3, as every
        RuntimeUnavailable) where a provider, or a runtime that cannot run the model, is in it; else
        :class:`Unsupported` (exit code 2: the options ask what the combination cannot do). Else return itself."""
        if not self.ok:
            raise (UnsupportedRuntime if self.conflicts[0].on_runtime else Unsupported)(self)
        return self


GRAPH_AXES = frozenset(
    {"graph", "profile", "layout", "precision", "algorithm", "prompt kernel", "K/V cache", "architecture", "logits"}
)


class Unsupported(BadInput):
    """A combination of choices that does not work together, refused before any work (exit code 2);
    ``verdict``: every conflict found."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.line)
        self.verdict = verdict


@dataclass(frozen=True)
class RefusedOptions:
    """Options whose own choices conflict, kept where a command answers with a verdict instead of refusing (check's
    planned --quantize options): the refusal, and the calibration text they name (a file the command reads)."""

    refused: Unsupported
    calibration_text: str | None = None


class UnsupportedRuntime(RuntimeUnavailable):
    """A provider, or a runtime, that cannot run the model the rest of the choices make, refused before any session
    (exit code 3); ``verdict``: every conflict found."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.line)
        self.verdict = verdict


def _facts(chosen: Sequence[Declared]) -> tuple[dict, dict, list[Conflict]]:
    """The facts the choices make, who makes each (a set fact: who adds each item), and the conflicts of two
    choices that ensure different values of one fact."""
    values: dict[str, object] = {key: f.default for key, f in FACTS.items()}
    makers: dict[str, object] = {}
    conflicts = []
    for choice in chosen:
        for key, value in choice.ensures.items():
            if FACTS[key].is_set:
                values[key] = values[key] | value
                for item in value:
                    makers.setdefault((key, item), choice)
                continue
            earlier = makers.get(key)
            if earlier is not None and values[key] != value:
                said = _says(earlier, key, values[key])
                line = f"{choice.shown} {_says(choice, key, value)}, but {earlier.shown} {said}: choose one of them"
                conflicts.append(Conflict(choice.shown, key, earlier.shown, line, (choice.axis, earlier.axis)))
                continue
            values[key], makers[key] = value, choice
    for key, f in FACTS.items():
        if f.derive is None:
            continue
        values[key] = f.derive(values)
        if values[key] != f.default:
            own = ({**FACTS_DEFAULTS, **choice.ensures} for choice in chosen)
            makers[key] = next((c for c, v in zip(chosen, own) if f.derive(v) != f.default), None)
    return values, makers, conflicts


def _says(choice: Declared, key: str, value) -> str:
    if key in choice.says:
        return choice.says[key]
    fact_ = FACTS[key]
    if fact_.detail is not None:  # a derived fact: what of the choice's own makes it so
        return f"writes {fact_.noun} ({', '.join(fact_.detail({**FACTS_DEFAULTS, **choice.ensures}))})"
    if isinstance(value, bool):
        return f"{'has' if value else 'has no'} {fact_.noun}"
    return f"makes {fact_.noun} {_value(value)}"


def _value(value) -> str:
    if value is True:
        return "yes"
    if value is False or value is None:
        return "none" if value is None else "no"
    return str(value)


def _advice(
    need: Need | Lacks,
    needer: Declared,
    maker: Declared | None,
    alternatives: Mapping[str, Sequence[Declared]],
    values: Mapping[str, object],
    chosen: Sequence[Declared],
) -> str:
    """What to do: the need's own fix ("{value}": the value it refuses), else the maker's alternatives (those with
    which the whole combination works first, else those that meet this need; the most like the maker first), else
    drop the needer."""
    if need.fix:
        return need.fix.format(value=_value(values.get(need.fact)))
    if maker is not None:
        others = [alt for alt in alternatives.get(maker.axis, ()) if alt.name != maker.name and alt.choose]
        working = [alt for alt in others if resolve([alt if c is maker else c for c in chosen]).ok]
        meeting = working or [alt for alt in others if _meets(need, alt)]
        if meeting:
            meeting.sort(key=lambda alt: _distance(alt, maker))
            named = " or ".join(dict.fromkeys(alt.choose for alt in meeting[:2]))
            return f"use a folder exported with {named}" if maker.origin == "folder" else f"use {named}"
    instead = [  # another choice in the needer's place with which the combination works
        alt
        for alt in alternatives.get(needer.axis, ())
        if alt.name != needer.name and alt.choose and resolve([alt if c is needer else c for c in chosen]).ok
    ]
    if instead and needer.origin == "option":
        instead.sort(key=lambda alt: _distance(alt, needer))
        return f"use {' or '.join(dict.fromkeys(alt.choose for alt in instead[:2]))}"
    if needer.choose:
        return f"drop {needer.choose}" if needer.origin == "option" else f"use another {needer.axis}"
    return f"choose another {maker.axis if maker else needer.axis}"


def _distance(a: Declared, b: Declared) -> int:
    """How unlike two choices are: the facts they ensure differently, each op in one set and not the other."""
    keys = set(a.ensures) | set(b.ensures)
    distance = 0
    for key in keys:
        x, y = a.ensures.get(key, FACTS[key].default), b.ensures.get(key, FACTS[key].default)
        distance += len(set(x) ^ set(y)) if FACTS[key].is_set else int(x != y)
    return distance


def _meets(need: Need | Lacks, alt: Declared) -> bool:
    if isinstance(need, Lacks):
        return not (alt.ensures.get(need.fact, frozenset()) & set(need.items))
    own = {**FACTS_DEFAULTS, **alt.ensures}
    derive = FACTS[need.fact].derive
    return need.met_by(derive(own) if derive is not None else own[need.fact])


def resolve(chosen: Sequence[Declared], *, alternatives: Mapping[str, Sequence[Declared]] | None = None) -> Verdict:
    """Whether the choices work together: every need of every choice met by the facts the others ensure (a fact
    nobody ensures has its default). ``alternatives``: by axis, the registered choices advice may name."""
    alternatives = alternatives or {}
    values, makers, conflicts = _facts(chosen)
    for needer in chosen:
        for need in needer.requires:
            if isinstance(need, Lacks):
                found = [item for item in need.items if item in values[need.fact]]
                if found:
                    item = found[0]
                    maker = makers.get((need.fact, item))
                    what = _item(item)
                    reason = need.items[item] or need.why or "cannot take"
                    # a reason may place the item itself: "rejects an opset-23 {item} with present K/V outputs"
                    said = reason.format(item=what) if "{item}" in reason else f"{reason} {what}"
                    verb = FACTS[need.fact].verb
                    made = f", which {maker.shown} {verb}" if maker is not None and maker is not needer else ""
                    line = f"{needer.shown} {said}{made}: " + _advice(need, needer, maker, alternatives, values, chosen)
                    conflicts.append(
                        Conflict(needer.shown, need.fact, maker.shown if maker else None, line, _axes(needer, maker))
                    )
                continue
            if not all(_holds(values[key], value) for key, value in need.when.items()):
                continue
            value = values[need.fact]
            if need.met_by(value):
                continue
            maker = makers.get(need.fact)
            advice = _advice(need, needer, maker, alternatives, values, chosen)
            reason = need.why or "needs " + FACTS[need.fact].noun
            if maker is None:  # nothing chosen says otherwise: the fact's default
                line = f"{needer.shown} {reason}, but nothing chosen gives {FACTS[need.fact].noun}: {advice}"
            else:
                line = f"{needer.shown} {reason}, but {maker.shown} {_says(maker, need.fact, value)}: {advice}"
            conflicts.append(
                Conflict(needer.shown, need.fact, maker.shown if maker else None, line, _axes(needer, maker))
            )
    return Verdict(tuple(c.shown for c in chosen), MappingProxyType(values), tuple(conflicts))


def _axes(needer: Declared, maker: Declared | None) -> tuple[str, ...]:
    return (needer.axis, maker.axis) if maker is not None else (needer.axis,)


def _holds(value, condition) -> bool:
    return value in condition if isinstance(condition, (set, frozenset)) else value == condition


def _item(item) -> str:
    if isinstance(item, tuple) and len(item) == 2:  # an op: (domain, op type)
        domain, op = item
        return f"{op} ({domain})" if domain else op
    return str(item)
