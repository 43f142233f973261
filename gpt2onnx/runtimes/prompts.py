"""Prompts for generate: text through the folder's tokenizer, or token ids; batches are left-padded."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from gpt2onnx.artifact.folder import TOKENIZER_FILES, read_json_file
from gpt2onnx.errors import BadInput

MAX_TOKEN_ID = 2**31 - 1


def has_tokenizer(folder: Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


# what AutoTokenizer would load as GPT2TokenizerFast in a folder whose config.json says model_type gpt2
GPT2_CLASSES = (None, "GPT2Tokenizer", "GPT2TokenizerFast")


def _tokenizer_class(folder: Path) -> str | None:
    """The class tokenizer_config.json names (None when it names none or the folder has no such file)."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None
    named = read_json_file(path, "tokenizer config").get("tokenizer_class")
    return named if isinstance(named, str) else None


def load_tokenizer(folder: Path):
    if not has_tokenizer(folder):
        raise BadInput(
            f"'{folder}' has no tokenizer files (tokenizer.json or vocab.json + merges.txt): give token ids with --ids"
            " 1,2,3"
        )
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_symlink() and not path.resolve().is_relative_to(folder.resolve()):
            raise BadInput(f"tokenizer file '{path}' points outside the folder: replace the link with the file itself")
    named = _tokenizer_class(folder)
    try:
        # A fixed class, never AutoTokenizer: a tokenizer_config.json's auto_map could name code in the folder,
        # and no code from a model folder ever runs. A GPT-2 folder (its config names GPT2Tokenizer, or names
        # nothing) loads as GPT2TokenizerFast, from tokenizer.json or converted from vocab.json and merges.txt;
        # another class named there loads from tokenizer.json through the generic fast class.
        if named in GPT2_CLASSES or not (folder / "tokenizer.json").is_file():
            from transformers import GPT2TokenizerFast

            return GPT2TokenizerFast.from_pretrained(str(folder), trust_remote_code=False)
        return PreTrainedTokenizerFast.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as err:  # transformers raises many types for broken tokenizer files
        raise BadInput(
            f"cannot load the tokenizer in '{folder}' ({str(err).splitlines()[0][:200]}); use --ids"
        ) from None


def left_pad(rows: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = row
            mask[i, width - len(row) :] = 1
    return ids, mask


def encode_prompts(tokenizer, texts: list[str], *, pad_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    rows = [tokenizer.encode(text) for text in texts]
    for text, row in zip(texts, rows):
        if not row:
            raise BadInput(f"--prompt {text!r} is empty (no tokens): give some text")
    return left_pad(rows, pad_id=pad_id if pad_id is not None else tokenizer.eos_token_id or 0)


def parse_id_prompts(values: list[str], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rows = []
    for value in values:
        parts = re.split(r"\s*,\s*|\s+", value.strip()) if value.strip() else []
        if not parts:
            raise BadInput("token ids (--ids) are empty: give at least one token id")
        try:
            row = [int(v) for v in parts]  # int('') fails: '1,,2' is refused, not read as 1,2
        except ValueError:
            raise BadInput(
                f"token ids (--ids) '{value}' are not a comma-separated list of integers (e.g. 464,3290,318)"
            ) from None
        if any(not 0 <= v <= MAX_TOKEN_ID for v in row):
            raise BadInput(
                f"token ids (--ids) '{value}' hold a value outside 0 to {MAX_TOKEN_ID}: give ids of the vocabulary"
            )
        rows.append(row)
    return left_pad(rows, pad_id)


class TextStream:
    """Incremental detokenization: the text each new token adds, as the tokenizer would decode the whole row
    (a byte-level BPE token can be half a character, which shows once the next token completes it)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ",".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.tokenizer is None:
            return f" {token_id}"
        text = self.text(self.ids)
        if text.endswith("\ufffd"):  # an incomplete character: wait for the next token
            return ""
        new, self.shown = text[len(self.shown) :], text
        return new
