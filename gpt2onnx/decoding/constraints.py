"""Constrained output: what a row may write is held to a JSON schema (or any JSON object), a regular expression, a
Lark grammar or a choice among strings, by llguidance (guidance-ai; the engine onnxruntime-genai constrains with).

A :class:`Constraint` is the spec, checked when built (one line, before any model is opened): its size, its syntax,
what llguidance can compile (an invalid or unsupported schema, a regex or grammar it rejects, nesting too deep).
:meth:`Constraint.bind` ties it to a model's tokens (the folder's tokenizer, its vocabulary size and end-of-sequence
ids, :func:`vocabulary_of`) and refuses one that can match nothing. A bound constraint hands each sequence its own
matcher (:class:`Matchers`: one llguidance ``LLMatcher`` per row), used as a logits processor: every token whose bytes
cannot continue the constraint is -inf, end-of-sequence only where the constraint is complete; the chosen token
advances the row's matcher. Matching is on bytes, so a byte-level BPE token may cross from one part of the
constraint into the next (``{"`` in JSON), and a token that would run past the end is refused.

A row that reaches ``max_new_tokens`` before the constraint is complete ends as every row does there (not finished);
:meth:`TokenConstraint.accepts` says, from its tokens alone, whether its output is complete (``Generation.complete``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from gpt2onnx.capabilities import Declared
from gpt2onnx.errors import BadInput, shown
from gpt2onnx.generation_options import CONSTRAINED  # the decoding feature a constrained request uses
from gpt2onnx.params import param
from gpt2onnx.registry import Registry

log = logging.getLogger(__name__)

MAX_SPEC_BYTES = 1 << 20  # a schema, regex, grammar or choice list: more is refused before it is read
MAX_CHOICES = 10_000
# JSON as json.dumps writes it: ", " and ": ", no other whitespace (llguidance's default lets whitespace run on,
# where a small model may loop; a schema's own "x-guidance" options override this)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
    except ImportError:  # an optional extra: say how to get it
        raise BadInput(
            "constrained decoding needs llguidance: pip install 'gpt2onnx[constrain]' (or pip install llguidance)"
        ) from None
    return llguidance


def _first_line(message: str) -> str:
    """An engine's message on one line: its first line, and its "error:" line where it has one (regex errors)."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    line = lines[0] if lines else "rejected"
    detail = next((x for x in lines[1:] if x.startswith("error:")), None)
    line = f"{line} {detail}" if detail else line
    return line if len(line) <= 200 else line[:197] + "..."


@dataclass(frozen=True)
class Constraint:
    """What a row may write: ``kind`` (json_schema, regex, grammar, choice) and ``spec`` (the schema as JSON text,
    the regex, the Lark grammar, or the choices as a JSON list). Build it with :meth:`json_schema`,
    :meth:`json_object`, :meth:`regex`, :meth:`lark` or :meth:`choice`; it is checked when built (BadInput, one
    line) and holds llguidance's compiled grammar."""

    kind: str
    spec: str
    source: str = ""  # where it came from, for messages ("--regex", "'schema.json'")
    grammar: str = field(default="", repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in CONSTRAINT_KINDS:
            raise BadInput(f"a constraint's kind is one of {CONSTRAINT_KINDS.choices()}, got {shown(self.kind)}")
        if not isinstance(self.spec, str):
            raise BadInput(f"{self.label} must be text, got {type(self.spec).__name__}")
        size = len(self.spec.encode("utf-8", "surrogatepass"))
        if size > MAX_SPEC_BYTES:
            raise BadInput(
                f"{self.label} is {size:,} bytes, more than the {MAX_SPEC_BYTES:,} bytes a constraint may take:"
                " give a smaller one"
            )
        object.__setattr__(self, "grammar", _compile(self.kind, self.spec, self.label))

    @property
    def label(self) -> str:
        kind = CONSTRAINT_KINDS[self.kind]
        return f"the {kind.words} ({self.source or kind.flag})"

    # -- the kinds ------------------------------------------------------------------------------------------------
    @classmethod
    def json_schema(cls, schema: dict | bool | str, *, source: str = "") -> "Constraint":
        """JSON that validates against ``schema`` (a dict, a bool, or its JSON text)."""
        text = schema if isinstance(schema, str) else _dumps(schema, source or "--json-schema")
        return cls("json_schema", text, source)

    @classmethod
    def json_object(cls) -> "Constraint":
        """Any JSON object (OpenAI's ``response_format`` json_object)."""
        return cls("json_schema", '{"type": "object"}', "any JSON object")

    @classmethod
    def regex(cls, pattern: str, *, source: str = "") -> "Constraint":
        """Text that the regular expression matches whole (Rust regex syntax, as ``re.fullmatch`` for the common
        subset; no lookarounds or backreferences)."""
        return cls("regex", pattern, source)

    @classmethod
    def lark(cls, grammar: str, *, source: str = "") -> "Constraint":
        """Text the Lark grammar derives from ``start`` (llguidance's Lark dialect; GBNF is read too)."""
        return cls("grammar", grammar, source)

    @classmethod
    def choice(cls, options, *, source: str = "") -> "Constraint":
        """Exactly one of the strings ``options``."""
        if isinstance(options, str) or not all(isinstance(o, str) for o in options):
            raise BadInput(f"the choices ({source or '--choice'}) must be a list of strings")
        options = list(dict.fromkeys(options))
        if not options or any(not o for o in options):
            raise BadInput(f"the choices ({source or '--choice'}) must be one or more non-empty strings")
        if len(options) > MAX_CHOICES:
            raise BadInput(f"{len(options):,} choices ({source or '--choice'}) are more than {MAX_CHOICES:,}")
        return cls("choice", json.dumps(options), source)

    @property
    def declared(self) -> Declared:
        """The decoding feature it uses (runtimes whose own loop takes no logits processor lack it)."""
        return Declared("request", "constraint", ensures={"features": {CONSTRAINED}}, label=self.label)

    def bind(self, vocabulary: "Vocabulary") -> "TokenConstraint":
        """The constraint on a model's tokens, refused (one line) where it can match nothing."""
        return TokenConstraint(self, vocabulary)


def _dumps(value, source: str) -> str:
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as err:
        raise BadInput(f"the JSON schema ({source}) is not JSON: {_first_line(err)}") from None


def _loads_schema(text: str, label: str):
    try:
        schema = json.loads(text)
    except RecursionError:
        raise BadInput(f"{label} is nested too deeply to read: give a flatter schema") from None
    except ValueError as err:
        raise BadInput(f"{label} is not JSON: {_first_line(err)}") from None
    if not isinstance(schema, (dict, bool)):
        raise BadInput(f"{label} must be a JSON object (or true/false), got {type(schema).__name__}")
    return schema


def _check_schema(schema, label: str) -> None:
    """The schema against its metaschema (jsonschema, the validator the tests check outputs with)."""
    try:
        import jsonschema
    except ImportError:  # llguidance still refuses what it cannot compile
        return
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "/".join(str(p) for p in err.absolute_path) or "the top level"
        raise BadInput(f"{label} is not a valid JSON schema at {where}: {_first_line(err.message)}") from None
    except RecursionError:
        raise BadInput(f"{label} is nested too deeply to check: give a flatter schema") from None


def _compile(kind: str, spec: str, label: str) -> str:
    """llguidance's grammar for the spec, checked without a tokenizer (syntax, support, limits)."""
    llg, how = _llguidance(), CONSTRAINT_KINDS[kind]
    if how.check is not None:
        how.check(spec, label)
    try:
        grammar = how.grammar(llg, spec)
    except (ValueError, TypeError, RecursionError) as err:
        raise BadInput(f"{label} cannot be read: {_first_line(err)}") from None
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise BadInput(f"{label} is refused by llguidance: {_first_line(messages[0] if messages else '')}")
    return grammar


# -- the kinds: one entry each in CONSTRAINT_KINDS -------------------------------------------------------------
@dataclass(frozen=True)
class ConstraintKind:
    """One kind of constraint: its name (``Constraint.kind``), its words in messages, its command-line option (the
    value's type, help and metavar; the flag is ``--`` + the name), how that value becomes a :class:`Constraint`
    (``from_option``), an optional check of a spec before llguidance reads it, and llguidance's grammar for a spec.
    A new kind is one entry in CONSTRAINT_KINDS (its option, ``generate``'s and ``bench constraint``'s, follows)."""

    name: str
    words: str
    option_type: type
    help: str
    metavar: str
    from_option: Callable[[Any], "Constraint"]
    grammar: Callable[[Any, str], str]  # (llguidance, spec) -> grammar
    check: Callable[[str, str], None] | None = None  # (spec, label): BadInput where it is not one

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _from_file(kind: str, build: Callable[..., "Constraint"]) -> Callable[[Path], "Constraint"]:
    """A kind given as a file on the command line (its flag: the kind's): read (refused before it is read where it is
    not one), then built."""

    def read(path: Path) -> "Constraint":
        flag = CONSTRAINT_KINDS[kind].flag  # registered by the time an option is read
        return build(read_spec_file(path, flag), source=f"{flag} {shown(path)}")

    return read


CONSTRAINT_KINDS: Registry[ConstraintKind] = Registry(
    "constraint kind",
    [
        ConstraintKind(
            "json_schema", "JSON schema", Path, "Write JSON valid against this schema file.", "FILE",
            from_option=_from_file("json_schema", lambda spec, source: Constraint.json_schema(spec, source=source)),
            # one way to write it (json.dumps' separators), not whitespace anywhere
            grammar=lambda llg, spec: llg.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_STYLE),
            check=lambda spec, label: _check_schema(_loads_schema(spec, label), label),
        ),
        ConstraintKind(
            "regex", "regex", str, "Write text this regex matches whole.", "REGEX",
            from_option=lambda pattern: Constraint.regex(pattern),
            grammar=lambda llg, spec: llg.grammar_from("regex", spec),
        ),
        ConstraintKind(
            "grammar", "grammar", Path, "Write text of this Lark grammar file.", "FILE",
            from_option=_from_file("grammar", lambda spec, source: Constraint.lark(spec, source=source)),
            grammar=lambda llg, spec: llg.grammar_from("lark", spec),
        ),
        ConstraintKind(
            "choice", "choice", str, "Write one of these strings (A,B,...).", "A,B",
            from_option=lambda text: Constraint.choice([c.strip() for c in text.split(",")]),
            grammar=lambda llg, spec: llg.grammar_from("choice", spec),
        ),
    ],
)  # fmt: skip


# -- a model's tokens ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Vocabulary:
    """A model's tokens as llguidance reads them: its tokenizer (``tokenizer.json`` text), the vocabulary size of
    its logits and its end-of-sequence ids."""

    tokenizer_json: str = field(repr=False)
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    @property
    def tokens(self):
        return _ll_tokenizer(self.tokenizer_json, self.vocab_size, self.eos_token_ids)


@lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
    llg = _llguidance()
    try:
        return llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
    except Exception as err:  # llguidance raises its own types for a tokenizer it cannot read
        raise BadInput(f"llguidance cannot read the tokenizer: {_first_line(err)}") from None


def vocabulary_of(folder: str | Path, *, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Vocabulary:
    """The folder's tokens (its tokenizer.json, or vocab.json + merges.txt, loaded without transformers)."""
    from gpt2onnx.decoding.gpt2_tokenizer import load_gpt2_tokenizer
    from gpt2onnx.decoding.prompts import has_tokenizer

    if not has_tokenizer(Path(folder)):
        raise BadInput(f"a constraint needs the model's tokenizer files, and '{folder}' has none: drop the constraint")
    if not eos_token_ids:
        raise BadInput(
            f"a constraint ends a row with end-of-sequence, and '{folder}' names no eos_token_id: set one in its"
            " generation_config.json, or drop the constraint"
        )
    backend = load_gpt2_tokenizer(folder).backend
    text, size = backend.to_str(), backend.get_vocab_size(with_added_tokens=True)
    if max(eos_token_ids) >= size:  # llguidance reads its eos among the tokenizer's ids: name the ids up to it
        data = json.loads(text)
        data["added_tokens"] += [_unused(i) for i in range(size, max(eos_token_ids) + 1)]
        text = json.dumps(data)
    return Vocabulary(text, int(vocab_size), tuple(int(i) for i in eos_token_ids))


def _unused(token: int) -> dict:
    """A special token for an id the model has and its tokenizer does not (never written as text)."""
    content = f"<|gpt2onnx-unused-{token}|>"
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    return {"id": token, "content": content, **flags}


class TokenConstraint:
    """A constraint on one model's tokens: it starts matchers, one per sequence, and says whether a row's tokens
    complete it."""

    def __init__(self, constraint: Constraint, vocabulary: Vocabulary):
        self.constraint, self.vocabulary = constraint, vocabulary
        self.vocab_size = vocabulary.vocab_size
        self.eos_token_ids = vocabulary.eos_token_ids
        first = self._matcher()
        allowed = Matchers([first], self.vocab_size).allowed()
        if first.is_error() or not allowed.any():
            raise BadInput(f"{constraint.label} can match nothing: give one that some text satisfies")

    def _matcher(self):
        llg = _llguidance()
        matcher = llg.LLMatcher(self.vocabulary.tokens, self.constraint.grammar, log_level=0)
        if matcher.is_error():
            raise BadInput(f"{self.constraint.label} is refused by llguidance: {_first_line(matcher.get_error())}")
        return matcher

    @property
    def label(self) -> str:
        return self.constraint.label

    def start(self, rows: int) -> "Matchers":
        """A fresh matcher for each of ``rows`` sequences."""
        return Matchers([self._matcher() for _ in range(rows)], self.vocab_size)

    def accepts(self, tokens) -> bool:
        """Whether these new tokens (a row's, up to and including its end-of-sequence) are a complete match."""
        tokens = [int(t) for t in tokens]
        if tokens and tokens[-1] in self.eos_token_ids:
            tokens = tokens[:-1]
        matcher = self._matcher()
        return matcher.consume_tokens(tokens) and matcher.is_accepting() if tokens else matcher.is_accepting()

    def text_of(self, tokens) -> str:
        """The bytes of these tokens as llguidance reads them, decoded (for messages and tests)."""
        return self.vocabulary.tokens.decode_str([int(t) for t in tokens])


class Matchers:
    """One llguidance matcher per row of a batch: the logits processor (:meth:`mask`) and its state (:meth:`advance`,
    :meth:`reorder` for beams)."""

    def __init__(self, matchers: list, vocab_size: int):
        self.matchers = list(matchers)
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32

    def __len__(self) -> int:
        return len(self.matchers)

    def allowed(self, rows=None) -> np.ndarray:
        """[len(rows), vocab] bool: the tokens each row's matcher takes next (end-of-sequence where complete)."""
        rows = range(len(self.matchers)) if rows is None else rows
        rows = list(rows)
        bits = np.zeros((len(rows), self._words), dtype=np.int32)
        for index, row in enumerate(rows):
            matcher = self.matchers[row]
            if matcher.is_error():
                continue  # nothing: the row's scores are all -inf
            matcher.unsafe_compute_mask_ptr(bits[index].ctypes.data, bits[index].nbytes)
        flags = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        return flags.view(bool)

    def mask(self, scores: np.ndarray, active=None) -> np.ndarray:
        """``scores`` [rows, vocab] with every token the row's matcher refuses at -inf (rows not ``active``, e.g.
        finished, as they are)."""
        rows = np.arange(len(self.matchers)) if active is None else np.flatnonzero(active)
        if len(rows) == 0:
            return scores
        allowed = self.allowed(rows)
        if scores.shape[1] != self.vocab_size:  # logits wider than the vocabulary: the rest is refused too
            allowed = np.pad(allowed, ((0, 0), (0, max(0, scores.shape[1] - self.vocab_size))))[:, : scores.shape[1]]
        refused = scores.dtype.type(-np.inf)
        if len(rows) == len(scores):
            return np.where(allowed, scores, refused)
        out = scores.copy()
        out[rows] = np.where(allowed, out[rows], refused)
        return out

    def advance(self, ids, active=None) -> None:
        """Each active row's matcher takes its chosen token (a refused one leaves it in its error state: its
        scores are then all -inf, which only a beam that never wins reaches)."""
        for row, token in enumerate(np.asarray(ids).reshape(-1).tolist()):
            if active is None or active[row]:
                matcher = self.matchers[row]
                if not matcher.is_error() and not matcher.consume_token(int(token)):
                    log.debug("row %d: token %d refused by its constraint", row, token)

    def reorder(self, parents) -> None:
        """Beam search: row i continues row ``parents[i]``'s matcher (copied where a row has several children)."""
        parents = [int(p) for p in parents]
        taken: set[int] = set()
        out = []
        for parent in parents:
            matcher = self.matchers[parent]
            out.append(matcher if parent not in taken else matcher.deep_copy())
            taken.add(parent)
        self.matchers = out

    def feed(self, tokens, row: int = 0) -> bool:
        """The row's matcher takes these tokens in turn; False where it refuses one."""
        return bool(self.matchers[row].consume_tokens([int(t) for t in tokens]))

    def valid_prefix(self, tokens, row: int = 0) -> int:
        """How many of ``tokens`` the row's matcher would take in turn (proposals checked before a step)."""
        return int(self.matchers[row].validate_tokens([int(t) for t in tokens]))


# -- the command line: one option per kind, mutually exclusive -----------------------------------------------------
# generate's and bench constraint's options, one per kind, declared once (gpt2onnx.params) from CONSTRAINT_KINDS;
# at most one is given
ConstraintOptions = dataclasses.make_dataclass(
    "ConstraintOptions",
    [
        (k.name, Optional[k.option_type], param(None, k.help, metavar=k.metavar, show_default=False))
        for k in CONSTRAINT_KINDS.values()
    ],
    frozen=True,
)
ConstraintOptions.__module__ = __name__  # make_dataclass's module= is Python 3.12's


def read_spec_file(path: Path, option: str) -> str:
    """A schema or grammar file, refused before it is read where it is missing, not a file, or too large."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"{option} {shown(path)}: no such file")
    size = path.stat().st_size
    if size > MAX_SPEC_BYTES:
        raise BadInput(f"{option} {shown(path)} is {size:,} bytes, more than {MAX_SPEC_BYTES:,}: give a smaller one")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"{option} {shown(path)} is not UTF-8 text") from None


def constraint_from(**values) -> Constraint | None:
    """The constraint the options give (one keyword per kind: ConstraintOptions' fields; None: none), refused in
    one line where two are given, one is empty, or it is invalid."""
    kinds = {name: CONSTRAINT_KINDS.lookup(name) for name in values}
    for name, value in values.items():
        if value == "":
            raise BadInput(f"{kinds[name].flag} is empty: give a {kinds[name].words}")
    given = {name: value for name, value in values.items() if value is not None}
    if len(given) > 1:
        raise BadInput(f"give one constraint: {' and '.join(kinds[k].flag for k in given)} cannot be combined")
    if not given:
        return None
    ((name, value),) = given.items()
    return kinds[name].from_option(value)
