"""The text a calibrated int4 algorithm (GPTQ) or a quantized K/V cache is calibrated on, as token sequences.

A file or a ``datasets`` text (``--calibration``), else the Python standard library's module docstrings
(offline on every machine), tokenized by the model's own tokenizer and cut into CALIBRATION_SEQUENCES sequences
of at most CALIBRATION_LENGTH tokens. A checkpoint without a tokenizer (``--random-init``) is calibrated on
seeded random token ids, and the record says so.
"""

from __future__ import annotations

import ast
import logging
import sysconfig
from pathlib import Path

import numpy as np

from gpt2onnx.decoding.prompts import has_tokenizer, load_tokenizer
from gpt2onnx.errors import BadInput
from gpt2onnx.precisions.algorithms.algorithm import Calibration
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.verify.text import TextSource, text_pieces

log = logging.getLogger(__name__)

CALIBRATION_SEQUENCES = 32
CALIBRATION_LENGTH = 128
KV_CALIBRATION_SEQUENCES = 4  # a quantized K/V cache's: a few whole contexts
KV_CALIBRATION_LENGTH = 1024
STDLIB_CHARS = 400_000  # about 100k GPT-2 tokens: more than the sequences take


def stdlib_docstrings(max_chars: int = STDLIB_CHARS) -> str:
    """The module docstrings of the standard library's top-level modules, in name order, joined by blank lines."""
    parts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        if doc:
            parts.append(doc)
            size += len(doc) + 2
            if size >= max_chars:
                break
    return "\n\n".join(parts)


def _source(text: str | None) -> TextSource | None:
    if text is None:
        return None
    if text.startswith("dataset:"):
        return TextSource(dataset=text.removeprefix("dataset:"))
    path = Path(text)
    if not path.is_file():
        raise BadInput(
            f"--calibration '{text}' is not a regular file: give a UTF-8 text file, or dataset:NAME[:CONFIG[:SPLIT]]"
        )
    return TextSource(path=path)


def calibration_for(
    quantization: QuantizeOptions, tokenizer_folder: Path | None, *, vocab_size: int, n_positions: int
) -> Calibration | None:
    """The calibration of ``quantization``'s int4 algorithm or measured 8-bit layers (None where it takes none)."""
    if not quantization.needs_calibration:
        return None
    length = min(CALIBRATION_LENGTH, n_positions)
    return token_sequences(
        quantization.calibration_text,
        tokenizer_folder,
        vocab_size=vocab_size,
        length=length,
        count=CALIBRATION_SEQUENCES,
    )


def kv_cache_calibration(
    tokenizer_folder: Path | None, *, vocab_size: int, n_positions: int, wanted: bool
) -> Calibration | None:
    """What a quantized K/V cache's scales are calibrated on (None where the cache stays float, ``wanted`` false):
    KV_CALIBRATION_SEQUENCES sequences of the whole context (at most KV_CALIBRATION_LENGTH tokens), so that the K/V
    of every position the model can reach are seen."""
    if not wanted:
        return None
    length = min(KV_CALIBRATION_LENGTH, n_positions)
    return token_sequences(None, tokenizer_folder, vocab_size=vocab_size, length=length, count=KV_CALIBRATION_SEQUENCES)


def token_sequences(
    text: str | None, tokenizer_folder: Path | None, *, vocab_size: int, length: int, count: int
) -> Calibration:
    """``count`` sequences of ``length`` tokens of ``text`` (--calibration's value; None: the standard library's
    module docstrings), tokenized by the folder's tokenizer; seeded random ids for a model without one."""
    source = _source(text)
    if tokenizer_folder is None or not has_tokenizer(tokenizer_folder):
        if source is not None:
            raise BadInput(
                "--calibration needs the model's tokenizer, but the model has no tokenizer files: add them to"
                " the checkpoint folder, or drop --calibration (random token ids are used)"
            )
        rng = np.random.default_rng(0)
        sequences = tuple(rng.integers(0, vocab_size, length, dtype=np.int64) for _ in range(count))
        return Calibration(sequences, f"seeded random token ids (no tokenizer): {count} × {length}")
    tokenizer = load_tokenizer(tokenizer_folder)
    chunks = iter([stdlib_docstrings()]) if source is None else source.chunks()
    described = "the standard library's module docstrings" if source is None else text
    collected, total, needed = [], 0, count * length
    for _, piece in text_pieces(tokenizer, chunks):  # read only as far as the sequences need
        collected.append(np.asarray(piece, np.int64))
        total += len(piece)
        if total >= needed:
            break
    ids = np.concatenate(collected) if collected else np.zeros(0, np.int64)
    found = min(count, len(ids) // length)
    if found == 0:
        raise BadInput(f"--calibration '{described}' has {len(ids)} tokens: give at least {length} (one sequence)")
    if ids.max(initial=0) >= vocab_size:
        raise BadInput(f"the tokenizer gives token id {int(ids.max())}, outside the vocabulary of {vocab_size}")
    sequences = tuple(ids[i * length : (i + 1) * length] for i in range(found))
    log.info("calibrating on %d sequences of %d tokens of %s", found, length, described)
    return Calibration(sequences, f"{described}: {found} × {length} tokens")
