"""Prompts for generate: text through the folder's tokenizer, or token ids; batches are left-padded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from gpt2onnx.checkpoint import TOKENIZER_FILES
from gpt2onnx.errors import Gpt2OnnxError


def load_tokenizer(folder: Path):
    if not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        raise Gpt2OnnxError(
            f"'{folder}' has no tokenizer files (tokenizer.json or vocab.json + merges.txt): give token ids with --ids 1,2,3"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as err:  # transformers raises many types for broken tokenizer files
        raise Gpt2OnnxError(f"cannot load the tokenizer in '{folder}' ({str(err).splitlines()[0][:200]}); use --ids") from None


def left_pad(rows: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = row
            mask[i, width - len(row) :] = 1
    return ids, mask


def encode_prompts(tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    rows = [tokenizer.encode(text) for text in texts]
    for text, row in zip(texts, rows):
        if not row:
            raise Gpt2OnnxError(f"--prompt {text!r} is empty (no tokens): give some text")
    return left_pad(rows, pad_id=tokenizer.eos_token_id or 0)


def parse_id_prompts(values: list[str]) -> tuple[np.ndarray, np.ndarray]:
    rows = []
    for value in values:
        try:
            row = [int(v) for v in value.replace(" ", ",").split(",") if v.strip()]
        except ValueError:
            raise Gpt2OnnxError(f"--ids '{value}' is not a comma-separated list of token ids (e.g. 464,3290,318)") from None
        if not row:
            raise Gpt2OnnxError("--ids is empty: give at least one token id")
        rows.append(row)
    return left_pad(rows)


def eos_token_id(folder: Path) -> int | None:
    """End-of-sequence id from generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((Path(folder) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return None
