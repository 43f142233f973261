"""Prompts for generate: text through the folder's tokenizer, or token ids; batches are left-padded."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from gpt2onnx.artifact.folder import TOKENIZER_FILES, read_json_file
from gpt2onnx.artifact.paths import file_in_folder
from gpt2onnx.errors import BadInput

MAX_TOKEN_ID = 2**31 - 1


# tokenizer_config.json keys passed on to the tokenizer class: data only. A path (tokenizer_file, vocab_file,
# merges_file) would load files from outside the folder, auto_map names code.
TOKENIZER_CONFIG_KEYS = (
    "add_prefix_space",
    "add_bos_token",
    "add_eos_token",
    "added_tokens_decoder",
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "model_max_length",
    "clean_up_tokenization_spaces",
    "errors",
    "padding_side",
    "truncation_side",
)


def has_tokenizer(folder: Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


# what AutoTokenizer would load as GPT2TokenizerFast in a folder whose config.json says model_type gpt2
GPT2_CLASSES = (None, "GPT2Tokenizer", "GPT2TokenizerFast")


def _tokenizer_class(folder: Path) -> str | None:
    """The class tokenizer_config.json names (None when it names none or the folder has no such file)."""
    if not (folder / "tokenizer_config.json").exists():
        return None
    path = file_in_folder(folder, "tokenizer_config.json", what="tokenizer file", where=folder)
    named = read_json_file(path, "tokenizer config").get("tokenizer_class")
    return named if isinstance(named, str) else None


def load_tokenizer(folder: Path):
    """The folder's tokenizer in a fixed class, loaded from a private copy of exactly its tokenizer files
    (each a regular file inside the folder) with tokenizer_config.json reduced to its data keys."""
    folder = Path(folder)
    present = [name for name in TOKENIZER_FILES if (folder / name).exists() or (folder / name).is_symlink()]
    if not any(name in present for name in ("tokenizer.json", "vocab.json")):
        raise BadInput(
            f"'{folder}' has no tokenizer files (tokenizer.json or vocab.json + merges.txt): give token ids with --ids"
            " 1,2,3"
        )
    from transformers import GPT2TokenizerFast, PreTrainedTokenizerFast

    named = _tokenizer_class(folder)
    with tempfile.TemporaryDirectory(prefix="gpt2onnx-tokenizer-") as tmp:
        for name in present:
            path = file_in_folder(folder, name, what="tokenizer file", where=folder)
            if name == "tokenizer_config.json":
                config = read_json_file(path, "tokenizer config")
                kept = {k: v for k, v in config.items() if k in TOKENIZER_CONFIG_KEYS}
                (Path(tmp) / name).write_text(json.dumps(kept))
            else:
                shutil.copyfile(path, Path(tmp) / name)
        try:
            # A fixed class, never AutoTokenizer: a tokenizer_config.json's auto_map could name code in the folder,
            # and no code from a model folder ever runs. A GPT-2 folder (its config names GPT2Tokenizer, or names
            # nothing) loads as GPT2TokenizerFast, from tokenizer.json or converted from vocab.json and merges.txt;
            # another class named there loads from tokenizer.json through the generic fast class.
            kind = (
                GPT2TokenizerFast
                if named in GPT2_CLASSES or "tokenizer.json" not in present
                else PreTrainedTokenizerFast
            )
            return kind.from_pretrained(tmp, trust_remote_code=False, local_files_only=True)
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


def check_prompt_text(text: str) -> str:
    """A prompt must be text: a command line holding bytes that are not UTF-8 arrives with them escaped as lone
    surrogates, which no tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadInput(
            f"--prompt is not valid UTF-8 text (an undecodable byte at character {err.start + 1}): give UTF-8 text,"
            " or token ids with --ids"
        ) from None
    return text


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
            # int('') fails: '1,,2' is refused, not read as 1,2; int('1_0') is 10, so digits are matched first
            row = [int(v) if re.fullmatch(r"[+-]?[0-9]+", v) else int("not a number") for v in parts]
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


# the prompts of the load benchmarks (bench served: Triton and the OpenAI endpoint), one per request in turn
LOAD_PROMPTS = (
    "The quick brown fox jumps over the lazy dog, and then it runs into the forest where",
    "Return the number of items in the container, counting only those that are",
    "In the beginning of the twentieth century, the small town by the river was",
    "Open the file for reading and return a stream object that yields lines of",
    "She looked at the map again and realised that the road they had taken was",
    "Raise a ValueError if the argument is negative or larger than the size of the",
    "The committee met on Tuesday to discuss the budget for the coming year and",
    "Convert the string to lower case, strip the white space at both ends, and",
    "After the storm had passed, the fishermen went back to the harbour to see",
    "This module provides a simple interface to the operating system's services for",
    "When the train finally arrived at the station, the passengers who had waited",
    "Iterate over the keys of the mapping in sorted order and yield each pair of",
    "The museum's new exhibition brings together paintings from three centuries that",
    "Compute the checksum of the data block and compare it with the value stored in",
    "He had never seen so many people in one place, all of them waiting for the",
    "Create a new thread that runs the given function with the arguments and keyword",
)
