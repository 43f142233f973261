"""Real text for evaluation: a text file or a split of a ``datasets`` dataset, tokenized piece by piece (memory
stays flat however long the text is), cut into the sliding windows of transformers' perplexity guide, and the
logits each runtime gives for a window's scored tokens.

The windows (transformers' "Perplexity of fixed-length models"): a window of ``context`` tokens starts every
``stride`` tokens; it scores only the tokens after the previous window's end (labels -100 elsewhere), each
predicted from up to ``context - 1`` tokens before it; the last window ends at the last token. Every token but
the text's first is scored exactly once.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from gpt2onnx.errors import BadInput, RuntimeUnavailable
from gpt2onnx.runtimes.decoder import position_ids_for

PIECE_CHARS = 1 << 20  # characters read at a time
DATASETS_INSTALL = "pip install 'gpt2onnx[eval]' (the datasets library)"


@dataclass(frozen=True)
class TextSource:
    """Where the text comes from: a UTF-8 file (``path``), or ``dataset`` as NAME[:CONFIG[:SPLIT]] (split
    default: test), its rows joined with blank lines as transformers' perplexity guide does."""

    path: Path | None = None
    dataset: str | None = None

    def check(self) -> "TextSource":
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
        return self

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
    try:
        with open(path, encoding="utf-8", newline="") as fh:  # newline="": the text as it is, \r\n included
            for chunk in iter(lambda: fh.read(PIECE_CHARS), ""):
                yield chunk
    except UnicodeDecodeError as err:
        raise BadInput(f"text file '{path}' is not UTF-8 ({err.reason} near byte {err.start}): convert it") from None
    except OSError as err:
        raise BadInput(f"text file '{path}' cannot be read ({err.strerror or err})") from None


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


def safe_pieces(chunks: Iterable[str], *, keep: Iterable[str] = ()) -> Iterator[str]:
    """The text re-cut only between an ASCII letter and the punctuation mark after it ("word." "word,"), where
    GPT-2's byte-level pre-tokenizer always splits and neither side's pre-tokens depend on the other (a letter
    run ends at the mark either way, and the mark starts the same match): tokenizing the pieces one by one gives
    the whole text's ids. No cut falls inside a string of ``keep`` (the tokenizer's added tokens, which are
    matched before pre-tokenization). A text without such a place stays one piece."""
    keep = [k for k in keep if k]
    carry = ""
    for chunk in chunks:
        carry += chunk
        cut = None
        for start in (max(0, len(carry) - (1 << 16)), 0):  # the last place, searched in the tail first
            for match in _CUT.finditer(carry, start, len(carry) - 1):
                if not any(_inside(carry, match.end(), k) for k in keep):
                    cut = match.end()
            if cut is not None or start == 0:
                break
        if cut is not None:
            yield carry[:cut]
            carry = carry[cut:]
    if carry:
        yield carry


_CUT = re.compile(r"[A-Za-z](?=[.,;:!?])")


def _inside(text: str, position: int, token: str) -> bool:
    """Whether an occurrence of ``token`` in ``text`` spans ``position`` (starts before it, ends after it)."""
    found = text.find(token, max(0, position - len(token) + 1), position + len(token) - 1)
    return 0 <= found < position < found + len(token)


def added_tokens(tokenizer) -> list[str]:
    """The tokenizer's added tokens (<|endoftext|>, …): matched in the text before pre-tokenization."""
    return [str(t) for t in getattr(tokenizer, "added_tokens_encoder", {})]


def token_pieces(tokenizer, source: TextSource) -> Iterator[np.ndarray]:
    """The text's token ids, piece by piece (int64 arrays); no special tokens are added."""
    for piece in safe_pieces(source.chunks(), keep=added_tokens(tokenizer)):
        ids = tokenizer.encode(piece, add_special_tokens=False)
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
    for piece in safe_pieces(source.chunks(), keep=added_tokens(tokenizer)):
        digest.update(piece.encode("utf-8"))
        ids = tokenizer.encode(piece, add_special_tokens=False)
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
    """Whether a folder's graph returns the last position's logits only (exported with --logits last): from
    its manifest, else from the graph's logits dims ([batch, 1, vocab])."""
    options = model.manifest.options if model.manifest is not None else {}
    if options.get("logits") in ("all", "last"):
        return options["logits"] == "last"
    from gpt2onnx.artifact.contract import graph_io
    from gpt2onnx.artifact.graph import load_graph

    _, outputs = graph_io(load_graph(model.model_path))
    logits = next(t for t in outputs if t.name == "logits")
    return len(logits.dims) == 3 and logits.dims[1] == 1
