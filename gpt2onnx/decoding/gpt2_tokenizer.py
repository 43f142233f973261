"""GPT-2's tokenizer through the ``tokenizers`` library alone (no transformers, no torch): what a server process
needs to turn text into ids and back, with the subset of transformers' tokenizer methods that the decode loop,
:class:`~gpt2onnx.decoding.prompts.TextStream` and :class:`~gpt2onnx.decoding.processors.StopStrings` call.

It loads the same files as :func:`gpt2onnx.decoding.prompts.load_tokenizer` and gives the same ids and text as
transformers' ``GPT2TokenizerFast`` on them (tests/serving/test_batching.py compares both): ``tokenizer.json`` when the
folder has one, else the byte-level BPE built from ``vocab.json`` + ``merges.txt``. Each file is a regular file
inside the folder (:func:`~gpt2onnx.artifact.paths.file_in_folder`); ``tokenizer_config.json`` is read as data,
and the settings this class does not implement are refused rather than ignored.
"""

from __future__ import annotations

from pathlib import Path

from gpt2onnx.artifact.folder import read_json_file
from gpt2onnx.artifact.paths import file_in_folder
from gpt2onnx.artifact.tokenizer import (
    MERGES_FILE,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    VOCAB_FILE,
    build_tokenizer,
    read_bpe,
)
from gpt2onnx.errors import BadInput

MAX_TOKENIZER_BYTES = 64 << 20

# transformers' clean_up_tokenization (applied by decode when the config asks for it)
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class Gpt2Tokenizer:
    """A ``tokenizers.Tokenizer`` with transformers' method names: encode, decode, convert_ids_to_tokens,
    convert_tokens_to_string."""

    def __init__(self, tokenizer, *, clean_up_tokenization_spaces: bool = False):
        self.backend = tokenizer
        self.clean_up = clean_up_tokenization_spaces

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self.clean_up:
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        return text

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self.backend.decoder
        return decoder.decode(tokens) if decoder is not None else "".join(tokens)


def load_gpt2_tokenizer(folder: str | Path) -> Gpt2Tokenizer:
    """The folder's tokenizer without transformers: BadInput (one line) when it has none, or one this class
    cannot reproduce exactly."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    config = {}
    if (folder / TOKENIZER_CONFIG).exists() or (folder / TOKENIZER_CONFIG).is_symlink():
        config = read_json_file(
            file_in_folder(folder, TOKENIZER_CONFIG, what="tokenizer file", where=folder), "tokenizer config"
        )
    for key in ("add_prefix_space", "add_bos_token", "add_eos_token"):
        if config.get(key) is True:
            raise BadInput(
                f"'{folder / TOKENIZER_CONFIG}' sets {key}, which the server's tokenizer does not implement:"
                " use gpt2onnx generate, or a folder without it"
            )
    if (folder / TOKENIZER_JSON).exists() or (folder / TOKENIZER_JSON).is_symlink():
        path = file_in_folder(folder, TOKENIZER_JSON, what="tokenizer file", where=folder)
        if path.stat().st_size > MAX_TOKENIZER_BYTES:
            raise BadInput(f"tokenizer file '{path}' is larger than {MAX_TOKENIZER_BYTES >> 20} MB: it is not one")
        try:
            backend = Tokenizer.from_str(path.read_text(encoding="utf-8"))
        except Exception as err:  # tokenizers raises its own exception type for a malformed file
            raise BadInput(f"cannot load the tokenizer '{path}' ({str(err).splitlines()[0][:200]})") from None
    elif (folder / VOCAB_FILE).exists() and (folder / MERGES_FILE).exists():
        vocab = file_in_folder(folder, VOCAB_FILE, what="tokenizer file", where=folder)
        merges = file_in_folder(folder, MERGES_FILE, what="tokenizer file", where=folder)
        backend = build_tokenizer(read_bpe(vocab, merges))
    else:
        raise BadInput(f"'{folder}' has no tokenizer files (tokenizer.json or vocab.json + merges.txt)")
    return Gpt2Tokenizer(backend, clean_up_tokenization_spaces=config.get("clean_up_tokenization_spaces") is True)
