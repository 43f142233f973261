"""Real text for evaluation: a text file or a split of a ``datasets`` dataset, tokenized piece by piece (memory
stays flat however long the text is), cut into the sliding windows of transformers' perplexity guide, and the
logits each runtime gives for a window's scored tokens.

The windows (transformers' "Perplexity of fixed-length models"): a window of ``context`` tokens starts every
``stride`` tokens; it scores only the tokens after the previous window's end (labels -100 elsewhere), each
predicted from up to ``context - 1`` tokens before it; the last window ends at the last token. Every token but
the text's first is scored exactly once.
"""

from __future__ import annotations

import codecs
import hashlib
import re
import unicodedata
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from gpt2onnx.artifact.contract import position_ids_for
from gpt2onnx.errors import BadInput, RuntimeUnavailable
from gpt2onnx.files import open_regular

PIECE_CHARS = 1 << 18  # characters read, and tokenized, at a time (about 100 MB of tokenizer state)
DATASETS_INSTALL = "pip install 'gpt2onnx[eval]' (the datasets library)"


@dataclass(frozen=True)
class TextSource:
    """Where the text comes from: a UTF-8 file (``path``), or ``dataset`` as NAME[:CONFIG[:SPLIT]] (split
    default: test), its rows joined with blank lines as transformers' perplexity guide does. Checked when built."""

    path: Path | None = None
    dataset: str | None = None

    def __post_init__(self) -> None:  # an invalid one cannot be built
        if (self.path is None) == (self.dataset is None):
            raise BadInput("give the text to evaluate on as a file (--text FILE) or a dataset (--dataset NAME), one")
        if self.path is not None:
            path = Path(self.path)
            if not path.is_file():
                raise BadInput(f"text file '{path}' does not exist or is not a regular file: give a UTF-8 text file")
        else:
            parts = self.dataset.split(":")
            if len(parts) > 3 or not all(parts):
                raise BadInput(
                    f"dataset '{self.dataset}' is not NAME[:CONFIG[:SPLIT]] (e.g. wikitext:wikitext-2-raw-v1:test)"
                )

    def describe(self) -> dict:
        if self.path is not None:
            return {"file": str(self.path), "bytes": Path(self.path).stat().st_size}
        name, config, split = _dataset_parts(self.dataset)
        return {"dataset": name, "config": config, "split": split, "joined_with": "\\n\\n"}

    def chunks(self) -> Iterator[str]:
        """The text in pieces of about PIECE_CHARS characters (a file is read as it goes, never whole)."""
        if self.path is not None:
            yield from _file_chunks(Path(self.path))
        else:
            yield from _dataset_chunks(self.dataset)


def _file_chunks(path: Path) -> Iterator[str]:
    """The file's text, PIECE_CHARS bytes read at a time (a regular file only: open_regular), decoded as it goes;
    a byte that is not UTF-8 is reported at its position from the start of the file."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    fed = 0  # bytes given to the decoder so far
    with open_regular(path, "text file") as fh:
        while True:
            try:
                data = fh.read(PIECE_CHARS)
            except OSError as err:
                raise BadInput(f"text file '{path}' cannot be read ({err.strerror or err})") from None
            pending = len(decoder.getstate()[0])  # bytes of a character cut by the last read, decoded with these
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as err:
                at = fed - pending + err.start
                raise BadInput(
                    f"text file '{path}' is not UTF-8 ({err.reason} at byte {at:,} from its start): convert it"
                ) from None
            fed += len(data)
            if text:
                yield text
            if not data:
                return


def _dataset_parts(value: str) -> tuple[str, str | None, str]:
    parts = value.split(":")
    return parts[0], (parts[1] if len(parts) > 1 else None), (parts[2] if len(parts) > 2 else "test")


def _dataset_chunks(value: str) -> Iterator[str]:
    """The rows of a datasets split, joined by blank lines, streamed row by row (datasets memory-maps the split)."""
    name, config, split = _dataset_parts(value)
    try:
        with warnings.catch_warnings():  # a library's import-time deprecation notices are not the user's error
            warnings.simplefilter("ignore")
            import datasets
    except ImportError:
        raise RuntimeUnavailable(f"--dataset needs the datasets library, which is not installed: {DATASETS_INSTALL}")
    datasets.logging.set_verbosity_error()
    try:
        data = datasets.load_dataset(name, config, split=split)
    except Exception as err:  # noqa: BLE001 - datasets raises many types (offline, unknown name, bad config or split)
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise BadInput(
            f"dataset '{value}' cannot be loaded ({type(err).__name__}: {reason}): check NAME[:CONFIG[:SPLIT]],"
            " and that this machine is online or has the dataset in its Hugging Face cache; or give a text file"
            " (--text)"
        ) from None
    columns = [c for c, f in data.features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
    column = "text" if "text" in columns else (columns[0] if len(columns) == 1 else None)
    if column is None:
        raise BadInput(f"dataset '{value}' has no single text column (its string columns: {columns or 'none'})")
    pending, size = [], 0
    for index, row in enumerate(data[column] if len(data) < 1 << 16 else (r[column] for r in data)):
        pending.append(("\n\n" if index else "") + (row or ""))
        size += len(pending[-1])
        if size >= PIECE_CHARS:
            yield "".join(pending)
            pending, size = [], 0
    if pending:
        yield "".join(pending)


# Where GPT-2's byte-level pre-tokenizer always splits, whatever comes before or after: its pattern
# ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+) ends a letter, number or other
# run where the class changes or at a space, and starts the next match there, with the same characters either
# way. So a text cut (1) before a single space between two non-space characters, or (2) between two non-space
# characters of different classes (letter, number, other), neither an apostrophe (contractions), gives, piece by
# piece, the whole text's tokens. A run longer than CUT_SEARCH characters with no such place (one "word" of 8 MB)
# is cut at a token boundary, from the tokens of the piece plus CUT_CONTEXT characters after it.
CUT_SEARCH = 1 << 16  # characters searched back for a place to cut
CUT_CONTEXT = 1 << 12  # characters after a forced cut that its tokens are computed with
MAX_PIECE = 2 * PIECE_CHARS  # characters held at most before a forced cut


def _class(char: str) -> str | None:
    """A character's class for the pre-tokenizer (L, N or P), or None: a space, an apostrophe, or a character
    whose class another Unicode version might see otherwise (unassigned, private use, surrogates, controls)."""
    if char.isspace() or char == "'":
        return None
    category = unicodedata.category(char)
    if category[0] == "C":
        return None
    return category[0] if category[0] in "LN" else "P"


def _safe_cut(text: str, position: int) -> bool:
    """Whether the pre-tokenizer splits ``text`` at ``position`` whatever lies beyond the text's ends (see above)."""
    if not 0 < position < len(text) - 1:
        return False
    before, here, after = text[position - 1], text[position], text[position + 1]
    if here == " ":
        return all(c == "'" or _class(c) is not None for c in (before, after))
    a, b = _class(before), _class(here)
    return a is not None and b is not None and a != b


_SPACE_CUT = re.compile(r"(?<=[^\s\x00-\x1f]) (?=[^\s\x00-\x1f])")


def _inside(text: str, position: int, token: str) -> bool:
    """Whether an occurrence of ``token`` in ``text`` spans ``position`` (starts before it, ends after it)."""
    found = text.find(token, max(0, position - len(token) + 1), position + len(token) - 1)
    return 0 <= found < position < found + len(token)


def _last_cut(text: str, start: int, keep: list[str]) -> int | None:
    """The last safe place to cut ``text`` at or after ``start``, not inside an added token of ``keep`` (nor
    so near the end that one could still be cut off by it): before a space between words first (found by a
    regular expression, then checked), else where the class changes in the last CUT_SEARCH characters."""
    end = len(text) - 1 - max((len(k) for k in keep), default=0)

    def ok(position: int) -> bool:
        return _safe_cut(text, position) and not any(_inside(text, position, k) for k in keep)

    for begin in (max(start, end - CUT_SEARCH), start):  # the tail first: the last place is near the end
        found = [m.start() for m in _SPACE_CUT.finditer(text, begin, max(begin, end))]
        for position in reversed(found[-64:]):
            if ok(position):
                return position
        if begin == start:
            break
    for position in range(end - 1, max(start, end - CUT_SEARCH, 1) - 1, -1):
        if ok(position):
            return position
    return None


def _forced_cut(tokenizer, text: str, limit: int) -> tuple[int, list[int]]:
    """A cut at a token boundary at or before ``limit``, for a run with no safe place: the ids of ``text``
    (a piece that starts at a token boundary, with CUT_CONTEXT characters after ``limit``), kept up to the last
    boundary at or before ``limit``. Token lengths are byte counts (GPT-2's byte-level tokens hold one
    character per byte; added tokens their own text); another kind of tokenizer is refused."""
    ids = tokenizer.encode(text, add_special_tokens=False, verbose=False)
    added = set(added_tokens(tokenizer))
    pieces = tokenizer.convert_ids_to_tokens(ids)
    sizes = [len(p.encode("utf-8")) if p in added else len(p) for p in pieces]
    encoded = text.encode("utf-8")
    if sum(sizes) != len(encoded):
        raise BadInput(
            f"the text has a run of more than {CUT_SEARCH:,} characters without a space or punctuation, which this"
            " tokenizer (not a byte-level BPE) cannot be read in pieces: cut the text, or use GPT-2's tokenizer"
        )
    limit_byte = len(text[:limit].encode("utf-8"))
    end, count, best = 0, 0, None
    for index, size in enumerate(sizes):
        if end > limit_byte:
            break
        if end and (encoded[end] & 0xC0) != 0x80:  # a character starts here: a boundary in the text too
            best = (end, index)
        end += size
    if best is None:
        raise BadInput(
            f"the text has a token longer than {limit:,} characters: it cannot be read in pieces; cut the text"
        )
    end, count = best
    return len(encoded[:end].decode("utf-8")), ids[:count]


def text_pieces(tokenizer, chunks: Iterable[str]) -> Iterator[tuple[str, list[int]]]:
    """The text, cut into pieces of about PIECE_CHARS characters, and each piece's token ids, equal to the whole
    text's (memory stays flat whatever the text holds): cut where the pre-tokenizer always splits, else (a run of
    CUT_SEARCH characters without such a place) at a token boundary computed with CUT_CONTEXT characters of
    context. No cut falls inside one of the tokenizer's added tokens. (``verbose=False``: a piece is longer than the
    model's context on purpose, it is scored in windows; transformers' "longer than the specified maximum" warning
    would tell the user something is wrong.)"""
    keep = [k for k in added_tokens(tokenizer) if k]
    margin = 2 + max((len(k) for k in keep), default=0)  # the last characters are searched once more text came
    carry, searched = "", 0  # searched: carry[:searched] holds no safe place (checked before)
    for chunk in chunks:
        carry += chunk
        while len(carry) > PIECE_CHARS:
            cut = _last_cut(carry, searched, keep)
            if cut is not None:
                yield carry[:cut], tokenizer.encode(carry[:cut], add_special_tokens=False, verbose=False)
                carry, searched = carry[cut:], 0
                break
            searched = max(0, len(carry) - margin)
            if len(carry) < MAX_PIECE:
                break
            cut, ids = _forced_cut(tokenizer, carry[: PIECE_CHARS + CUT_CONTEXT], PIECE_CHARS)
            yield carry[:cut], ids
            carry, searched = carry[cut:], 0
    if carry:
        yield carry, tokenizer.encode(carry, add_special_tokens=False, verbose=False)


def added_tokens(tokenizer) -> list[str]:
    """The tokenizer's added tokens (<|endoftext|>, …): matched in the text before pre-tokenization."""
    return [str(t) for t in getattr(tokenizer, "added_tokens_encoder", {})]


def token_pieces(tokenizer, source: TextSource) -> Iterator[np.ndarray]:
    """The text's token ids, piece by piece (int64 arrays); no special tokens are added."""
    for _, ids in text_pieces(tokenizer, source.chunks()):
        if ids:
            yield np.asarray(ids, dtype=np.int64)


@dataclass(frozen=True)
class TextSummary:
    """A first pass over the text: its length in tokens, its largest id, its sha256 (of the UTF-8 text)."""

    tokens: int
    max_id: int
    sha256: str
    head: np.ndarray  # its first tokens (the greedy prompt)


def summarize_text(tokenizer, source: TextSource, *, head: int = 64) -> TextSummary:
    digest, count, max_id, first = hashlib.sha256(), 0, -1, []
    for piece, ids in text_pieces(tokenizer, source.chunks()):
        digest.update(piece.encode("utf-8"))
        count += len(ids)
        max_id = max(max_id, max(ids, default=-1))
        if len(first) < head:
            first += ids[: head - len(first)]
    return TextSummary(count, max_id, digest.hexdigest(), np.asarray(first, dtype=np.int64))


@dataclass(frozen=True)
class Window:
    begin: int  # the text index of the window's first token
    ids: np.ndarray  # the window's tokens
    first: int  # the index in ``ids`` of the first scored token (scored: ids[first:])

    @property
    def scored(self) -> int:
        return len(self.ids) - self.first


def window_count(tokens: int, *, context: int, stride: int) -> int:
    count, begin = 0, 0
    while True:
        count += 1
        if min(begin + context, tokens) == tokens:
            return count
        begin += stride


def sliding_windows(pieces: Iterable[np.ndarray], *, context: int, stride: int) -> Iterator[Window]:
    """The guide's windows over a stream of token pieces: begin = 0, stride, 2·stride, …; end = min(begin +
    context, length); the tokens from the previous window's end to this one's are scored (the first window:
    all but its first token); the window that reaches the last token is the last. Only one window's tokens
    (plus a piece) are held at a time."""
    if not 2 <= context or not 1 <= stride <= context:
        raise BadInput(f"the stride must be 1 to the context ({context}), and the context at least 2")
    stream = iter(pieces)
    buffer, offset, exhausted = np.zeros(0, np.int64), 0, False  # offset: the text index of buffer[0]
    begin = prev_end = 0
    while True:
        while not exhausted and offset + len(buffer) <= begin + context:  # one token past the window, if any
            piece = next(stream, None)
            if piece is None:
                exhausted = True
            else:
                buffer = np.concatenate([buffer, piece])
        known = offset + len(buffer)
        end = min(begin + context, known)
        first = max(1, prev_end - begin)
        if end - begin > first:
            yield Window(begin, buffer[begin - offset : end - offset], first)
        prev_end = end
        if end == known and exhausted:
            return
        begin += stride
        buffer, offset = buffer[begin - offset :], begin


# -- the logits a runtime gives for a window's scored tokens --------------------------------------------------
def window_logits(runner, window: Window, *, last_logits: bool) -> np.ndarray:
    """[scored, vocab] float32: the logits that predict ``window.ids[first:]``, each from the tokens before it in
    the window (positions first-1 … len-2, with an empty past at the window's start).

    A graph with all positions' logits runs the window in one pass. One exported with ``--logits last`` runs
    token by token: the prompt up to the first scored token, then one decode step per scored token, its
    past fed back (the same figures, one step per scored token). A runtime that owns its loop (genai) gets
    the window's tokens forced into it."""
    ids, first = window.ids, window.first
    if runner.capabilities.owns_loop:  # genai: the prompt's logits, then one pass per forced token
        if last_logits:
            out = runner.run_loop(
                ids[:first].tolist(), max_new_tokens=0, forced=ids[first:-1].tolist(), return_logits=True
            )
            return np.concatenate([step[-1:] for step in out.logits]).astype(np.float32, copy=False)
        out = runner.run_loop(ids[:-1].tolist(), max_new_tokens=0, forced=[], return_logits=True)
        return out.logits[0][first - 1 :].astype(np.float32, copy=False)
    inputs = ids[None, :-1]
    if not last_logits:
        mask = np.ones_like(inputs)
        past = runner.empty_past(1, capacity=runner.dummy_past + inputs.shape[1])
        logits, _ = runner.run(inputs, runner.prompt_mask(mask), position_ids_for(mask), past, last_logits_only=False)
        return logits[0, first - 1 :].astype(np.float32, copy=False)
    mask = np.ones((1, first), np.int64)
    full = runner.prompt_mask(mask)
    past = runner.empty_past(1, capacity=runner.dummy_past + inputs.shape[1])
    logits, past = runner.run(inputs[:, :first], full, position_ids_for(mask), past)
    rows = [logits[0, -1]]
    for position in range(first, inputs.shape[1]):
        full = np.concatenate([full, np.ones((1, 1), np.int64)], axis=1)
        logits, past = runner.run(inputs[:, position : position + 1], full, np.array([[position]], np.int64), past)
        rows.append(logits[0, -1])
    return np.stack(rows).astype(np.float32, copy=False)


def graph_logits_last(model) -> bool:
    """Whether a folder's graph returns the last position's logits only (exported with --logits last): read from
    the graph's logits dims ([batch, 1, vocab]), never from the manifest's options."""
    return model.facts.logits_last
