"""GPT-2's tokenizer files, built from a vocabulary and its merges, torch-free (the ``tokenizers`` library).

A GPT-2 checkpoint folder holds ``vocab.json`` + ``merges.txt`` (the byte-level BPE), ``tokenizer.json`` (the
same BPE in the ``tokenizers`` format, which transformers.js, onnxruntime-genai and fast tokenizers read) and
``tokenizer_config.json`` (the class and the special tokens for transformers). GPT-2 has one special token,
``<|endoftext|>``, which is its bos, eos and unk token, and no padding token. The files written here are the ones
transformers' ``GPT2TokenizerFast(vocab_file, merges_file).save_pretrained`` writes (the tests check it).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from gpt2onnx.errors import BadInput
from gpt2onnx.files import read_regular_text, write_text_atomic

log = logging.getLogger(__name__)

END_OF_TEXT = "<|endoftext|>"
VOCAB_FILE, MERGES_FILE = "vocab.json", "merges.txt"
TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
MAX_MERGES_BYTES = 64 << 20


@dataclass(frozen=True)
class ByteLevelBPE:
    """A GPT-2 style vocabulary: token → id, and the merges in rank order."""

    vocab: dict[str, int]
    merges: list[tuple[str, str]]

    @property
    def end_of_text_id(self) -> int:
        return self.vocab[END_OF_TEXT]


def _read_text(path: Path, what: str, limit: int) -> str:
    if path.is_symlink() and not path.resolve().is_relative_to(path.parent.resolve()):
        raise BadInput(f"{what} '{path}' points outside its folder: replace the link with the file itself")
    return read_regular_text(path, what, limit=limit)


def read_bpe(vocab_file: str | Path, merges_file: str | Path) -> ByteLevelBPE:
    """A vocab.json (GPT-2's ``encoder.json``) and merges.txt (``vocab.bpe``), checked: BadInput naming the file."""
    vocab_file, merges_file = Path(vocab_file), Path(merges_file)
    try:
        vocab = json.loads(_read_text(vocab_file, "vocabulary", MAX_MERGES_BYTES))
    except ValueError as err:
        raise BadInput(f"vocabulary '{vocab_file}' is not valid JSON ({str(err)[:120]}): replace the file") from None
    if not isinstance(vocab, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in vocab.items()
    ):
        raise BadInput(f"vocabulary '{vocab_file}' is not a JSON object of token → integer id: replace the file")
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise BadInput(f"vocabulary '{vocab_file}' does not number its tokens 0 to {len(vocab) - 1} once each")
    if END_OF_TEXT not in vocab:
        raise BadInput(f"vocabulary '{vocab_file}' has no {END_OF_TEXT} token: it is not a GPT-2 vocabulary")
    merges = []
    for number, line in enumerate(_read_text(merges_file, "merges", MAX_MERGES_BYTES).split("\n"), 1):
        if not line or (number == 1 and line.startswith("#version")):
            continue
        pair = line.split(" ")
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or "".join(pair) not in vocab:
            raise BadInput(
                f"merges '{merges_file}' line {number} ({line[:40]!r}) is not a merge of two tokens of the"
                f" vocabulary into a third: give the merges.txt that belongs to '{vocab_file.name}'"
            )
        merges.append((pair[0], pair[1]))
    return ByteLevelBPE(vocab=vocab, merges=merges)


def build_tokenizer(bpe: ByteLevelBPE):
    """GPT-2's byte-level BPE as a ``tokenizers.Tokenizer``: no prefix space, offsets trimmed, the
    end-of-text token special (never split, kept in ids, skipped when decoding with skip_special_tokens)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokenizer = Tokenizer(
        models.BPE(
            vocab=bpe.vocab,
            merges=bpe.merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(END_OF_TEXT, special=True, normalized=True)])
    return tokenizer


def _special(content: str, *, with_flag: bool) -> dict:
    token = {"content": content, "lstrip": False, "normalized": True, "rstrip": False, "single_word": False}
    return {**token, "special": True} if with_flag else token


def tokenizer_config(bpe: ByteLevelBPE, *, model_max_length: int | None) -> dict:
    """tokenizer_config.json as transformers writes it for GPT-2 (the class GPT2Tokenizer)."""
    eos = END_OF_TEXT
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(bpe.end_of_text_id): _special(eos, with_flag=True)},
        "bos_token": eos,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "errors": "replace",
        "extra_special_tokens": {},
        "model_max_length": model_max_length if model_max_length else int(1e30),
        "pad_token": None,
        "tokenizer_class": "GPT2Tokenizer",
        "unk_token": eos,
    }


def write_tokenizer_files(
    folder: str | Path, *, vocab_file: str | Path, merges_file: str | Path, model_max_length: int | None = None
) -> list[str]:
    """Write the tokenizer files of a GPT-2 checkpoint folder (vocab.json, merges.txt, tokenizer.json,
    tokenizer_config.json, special_tokens_map.json) from a vocabulary and its merges; returns the names written.
    ``model_max_length``: the model's position count (n_positions), as the public gpt2 folder states it."""
    folder = Path(folder)
    bpe = read_bpe(vocab_file, merges_file)
    folder.mkdir(parents=True, exist_ok=True)
    merges = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in bpe.merges)
    special = {key: _special(END_OF_TEXT, with_flag=False) for key in ("bos_token", "eos_token", "unk_token")}
    files = {
        VOCAB_FILE: json.dumps(bpe.vocab, ensure_ascii=False) + "\n",
        MERGES_FILE: merges,
        TOKENIZER_JSON: build_tokenizer(bpe).to_str(pretty=True) + "\n",
        TOKENIZER_CONFIG: json.dumps(tokenizer_config(bpe, model_max_length=model_max_length), indent=2) + "\n",
        SPECIAL_TOKENS_MAP: json.dumps(special, indent=2) + "\n",
    }
    for name, text in files.items():
        if (folder / name).is_symlink():
            (folder / name).unlink()  # a new file: never write through a link
        write_text_atomic(folder / name, text)
    return list(files)


def ensure_tokenizer_json(folder: str | Path, *, read_from: str | Path | None = None) -> bool:
    """Write tokenizer.json into ``folder`` when it has only vocab.json and merges.txt (runtimes such as
    transformers.js and onnxruntime-genai read only tokenizer.json); True when it wrote one. ``read_from``: the
    folder whose vocab.json and merges.txt are read (the source of a staging copy: messages name its files,
    which exist, not the copy's)."""
    folder = Path(folder)
    source = Path(read_from) if read_from is not None else folder
    if (folder / TOKENIZER_JSON).exists() or not ((folder / VOCAB_FILE).is_file() and (folder / MERGES_FILE).is_file()):
        return False
    bpe = read_bpe(source / VOCAB_FILE, source / MERGES_FILE)
    write_text_atomic(folder / TOKENIZER_JSON, build_tokenizer(bpe).to_str(pretty=True) + "\n")
    log.info("wrote %s from %s and %s", folder / TOKENIZER_JSON, VOCAB_FILE, MERGES_FILE)
    return True
