"""A GPT-2 GGUF file (what llama.cpp's convert_hf_to_gguf.py writes) as a :class:`Checkpoint`: the config from its
``gpt2.*`` hyper-parameters, GPT-2's tokenizer files from its ``tokenizer.ggml.*`` metadata, and the weights under
GPT-2's Hugging Face names (llama.cpp's tensor names mapped back with gguf-py's own table, the Conv1D weights
transposed back).

F32, F16 and BF16 tensors are read as they are; Q8_0, Q4_0 and Q6_K tensors are dequantized with
``gguf.quants.dequantize`` for the PyTorch reference and kept as the file stores them for the ONNX file
(gpt2onnx.precisions.gguf_blocks). Other types are refused in one line.

The file is read by memory map and its header is walked here first, every length checked against the file's size
(gguf's reader trusts declared lengths and counts: a string of declared gigabytes, an array of 2⁶⁰ items or a tensor
past the file's end would make it loop, allocate or fail oddly), so a damaged file is refused in one line with
memory bounded by the file's own metadata.
"""

from __future__ import annotations

import json
import logging
import mmap
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpt2onnx.artifact.tokenizer import END_OF_TEXT, MERGES_FILE, VOCAB_FILE, write_tokenizer_files
from gpt2onnx.errors import CheckpointError, shown
from gpt2onnx.files import sha256_file
from gpt2onnx.precisions.gguf_blocks import KEPT, FileBlocks
from gpt2onnx.pytorch.architecture import Architecture, check_fits_in_memory, spec_from_config

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
FLOAT_TYPES = ("F32", "F16", "BF16")
MAX_STRING_BYTES = 16 << 20  # one metadata string (GPT-2's whole merges list is a few MB, as an array of strings)
MAX_DIMS = 4  # GGML_MAX_DIMS
# value types (gguf.GGUFValueType): fixed sizes, 8 string, 9 array
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
# the GPT-2 Conv1D weights, stored [out, in] by llama.cpp's converter (transposed from transformers' [in, out])
CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
REQUIRED = ("context_length", "embedding_length", "block_count", "attention.head_count")
WHY_REFUSED = {
    "Q4_1": "adds a float minimum per block, which MatMulNBits' integer zero point cannot hold bit for bit",
    "Q5_1": "adds a float minimum per block, which MatMulNBits' integer zero point cannot hold bit for bit",
    "Q5_0": "has 5-bit codes, which MatMulNBits (2, 4 or 8 bits) cannot hold",
}


def is_gguf(path: Path) -> bool:
    """A regular file named .gguf, or starting with GGUF's magic."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (gguf's dims reversed)
    type: str
    offset: int  # from the start of the file
    nbytes: int


class _Header:
    """GGUF's header walked with every length checked against the file's size: the metadata keys with their
    value types (values are read by gguf's reader afterwards) and the tensor infos."""

    def __init__(self, path: Path, what: str):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.what = what
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            if size < 24:
                raise CheckpointError(f"{what} is truncated: {size} bytes, less than a GGUF header")
            self.buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.size, self.pos = size, 0
        if self.buf[:4] != MAGIC:
            raise CheckpointError(f"{what} is not a GGUF file (it does not start with 'GGUF')")
        version = self._int("<I", at=4)
        if version not in (2, 3):
            swapped = struct.unpack(">I", self.buf[4:8])[0]
            if swapped in (2, 3):
                raise CheckpointError(f"{what} is a big-endian GGUF: convert it on a little-endian machine")
            raise CheckpointError(f"{what} is GGUF version {version}: versions 2 and 3 are read")
        self.pos = 8
        tensors, kvs = self._int("<Q"), self._int("<Q")
        self._fits(kvs * 13, "its metadata count")  # a key of 0 bytes (8), a type (4), a value of 1 byte at least
        alignment = 32
        for _ in range(kvs):
            key = self._string("a metadata key")
            kind = self._int("<I")
            if key == "general.alignment" and kind == 4:  # a u32, a power of two
                alignment = self._int("<I", at=self.pos)
                if alignment < 1 or alignment & (alignment - 1):
                    raise CheckpointError(f"{what}: general.alignment {alignment} is not a power of two")
            self._skip_value(kind, key, depth=0)
        self._fits(tensors * 24, "its tensor count")
        infos = []
        for _ in range(tensors):
            name = self._string("a tensor name")
            dims = self._int("<I")
            if not 1 <= dims <= MAX_DIMS:
                raise CheckpointError(f"{what}: tensor {shown(name)} declares {dims} dimensions (1 to 4 are valid)")
            shape = [self._int("<Q") for _ in range(dims)]
            code, offset = self._int("<I"), self._int("<Q")
            try:
                qtype = GGMLQuantizationType(code)
            except ValueError:
                raise CheckpointError(f"{what}: tensor {shown(name)} has an unknown type {code}") from None
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            if not all(0 < d < 2**40 for d in shape) or shape[0] % block:
                raise CheckpointError(f"{what}: tensor {shown(name)} declares an invalid shape {shape}")
            count = int(np.prod(shape, dtype=object))
            infos.append((name, tuple(reversed(shape)), qtype.name, offset, count // block * block_bytes))
        data_start = -(-self.pos // alignment) * alignment
        self.tensors: dict[str, _TensorInfo] = {}
        for name, shape, kind, offset, nbytes in infos:
            if name in self.tensors:
                raise CheckpointError(f"{what} holds tensor {shown(name)} twice: the file is damaged")
            start = data_start + offset
            if offset % alignment or start + nbytes > size:
                raise CheckpointError(
                    f"{what}: tensor {shown(name)} declares {nbytes:,} bytes at offset {start:,}, past the file's end"
                    f" ({size:,} bytes): the file is truncated or damaged"
                )
            self.tensors[name] = _TensorInfo(name, shape, kind, start, nbytes)

    def close(self) -> None:
        self.buf.close()

    def _fits(self, nbytes: int, what: str) -> None:
        if self.pos + nbytes > self.size:
            raise CheckpointError(
                f"{self.what}: {what} declares {nbytes:,} bytes at offset {self.pos:,}, past the file's end"
                f" ({self.size:,} bytes): the file is truncated or damaged"
            )

    def _int(self, fmt: str, at: int | None = None) -> int:
        n = struct.calcsize(fmt)
        pos = self.pos if at is None else at
        if pos + n > self.size:
            raise CheckpointError(f"{self.what} is truncated: it ends inside its header at byte {self.size:,}")
        if at is None:
            self.pos += n
        return struct.unpack_from(fmt, self.buf, pos)[0]

    def _string(self, what: str) -> str:
        length = self._int("<Q")
        self._fits(length, what)
        if length > MAX_STRING_BYTES:
            raise CheckpointError(f"{self.what}: {what} of {length:,} bytes is past the {MAX_STRING_BYTES:,} read")
        raw = self.buf[self.pos : self.pos + length]
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def _skip_value(self, kind: int, key: str, depth: int) -> None:
        if kind in _FIXED:
            self._fits(_FIXED[kind], f"metadata {shown(key)}")
            self.pos += _FIXED[kind]
        elif kind == _STRING:
            length = self._int("<Q")
            self._fits(length, f"metadata string {shown(key)}")
            if length > MAX_STRING_BYTES:
                raise CheckpointError(
                    f"{self.what}: metadata string {shown(key)} of {length:,} bytes is past the {MAX_STRING_BYTES:,}"
                    " read: the file is damaged"
                )
            self.pos += length
        elif kind == _ARRAY and depth == 0:
            item, count = self._int("<I"), self._int("<Q")
            self._fits(count * _FIXED.get(item, 8), f"metadata array {shown(key)}")
            if item in _FIXED:
                self.pos += count * _FIXED[item]
            else:
                for _ in range(count):
                    self._skip_value(item, key, depth + 1)
        else:
            raise CheckpointError(f"{self.what}: metadata {shown(key)} has an unknown value type {kind}")


def _spec(config, what: str) -> Architecture:
    spec = spec_from_config(config)
    check_fits_in_memory(spec, what)
    return spec


def _hf_names(n_layer: int) -> list[str]:
    """GPT-2's parameter names (transformers', ``transformer.``-less)."""
    names = ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]
    for i in range(n_layer):
        for module in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            names += [f"h.{i}.{module}.weight", f"h.{i}.{module}.bias"]
    return names


@dataclass(frozen=True)
class GgufWeights:
    """What a GGUF holds, read and checked: the config and its Architecture, the weights under transformers' names,
    the quantized blocks kept (by export name), the folder its tokenizer files were written to, and the source
    record."""

    config: object  # transformers.GPT2Config
    spec: Architecture
    state_dict: dict[str, torch.Tensor]
    blocks: dict[str, FileBlocks]
    name: str
    source: dict
    folder: Path
    files: list[str]


def _reader(path: Path, what: str):
    """gguf's memory-mapped reader, once the header walk accepted the file."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as err:  # the reader raises ValueError, KeyError, struct errors... on damaged files
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{what}: gguf cannot read it ({reason}): the file is damaged") from None


def _field(reader, key: str, what: str, *, kind: type, required: bool = True):
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        if required:
            raise CheckpointError(f"{what} has no {key} metadata: it is not a complete GPT-2 GGUF")
        return None
    value = field.contents()
    if kind is list:
        if not field.types or field.types[0] != GGUFValueType.ARRAY or not isinstance(value, list):
            raise CheckpointError(f"{what}: metadata {key} is not an array")
        return value
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise CheckpointError(f"{what}: metadata {key} is {shown(str(value))}, not a count")
    if kind is float and not isinstance(value, float):
        raise CheckpointError(f"{what}: metadata {key} is {shown(str(value))}, not a number")
    if kind is str and not isinstance(value, str):
        raise CheckpointError(f"{what}: metadata {key} is not a string")
    return value


def _architecture(reader, what: str) -> None:
    arch = _field(reader, "general.architecture", what, kind=str)
    if arch != "gpt2":
        raise CheckpointError(f"{what} is a GGUF of architecture {shown(arch)}: only GPT-2 ('gpt2') is exported")


def _config(reader, what: str, vocab_size: int):
    from transformers import GPT2Config

    values = {k: _field(reader, f"gpt2.{k}", what, kind=int) for k in REQUIRED}
    eps = _field(reader, "gpt2.attention.layer_norm_epsilon", what, kind=float, required=False)
    inner = _field(reader, "gpt2.feed_forward_length", what, kind=int, required=False)
    bos = _field(reader, "tokenizer.ggml.bos_token_id", what, kind=int, required=False)
    eos = _field(reader, "tokenizer.ggml.eos_token_id", what, kind=int, required=False)
    width = values["embedding_length"]
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=values["context_length"],
        n_embd=width,
        n_layer=values["block_count"],
        n_head=values["attention.head_count"],
        n_inner=inner if inner and inner != 4 * width else None,
        # stored as float32: its shortest decimal (1e-05, not 9.99999974e-06), as the Hugging Face config had it
        layer_norm_epsilon=float(str(np.float32(eps))) if eps is not None else 1e-5,
        activation_function="gelu_new",
        bos_token_id=bos if bos is not None else vocab_size - 1,
        eos_token_id=eos if eos is not None else vocab_size - 1,
        architectures=["GPT2LMHeadModel"],
    )
    return config


def _tokens(reader, what: str) -> list[str]:
    model = _field(reader, "tokenizer.ggml.model", what, kind=str)
    if model != "gpt2":
        raise CheckpointError(f"{what}: its tokenizer is {shown(model)}, not GPT-2's byte-level BPE ('gpt2')")
    tokens = _field(reader, "tokenizer.ggml.tokens", what, kind=list)
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise CheckpointError(f"{what}: tokenizer.ggml.tokens is not a list of token strings")
    return tokens


def _write_tokenizer(reader, tokens: list[str], n_positions: int, folder: Path, what: str) -> list[str]:
    """vocab.json, merges.txt, tokenizer.json, tokenizer_config.json, special_tokens_map.json into ``folder``."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{what}: tokenizer.ggml.tokens names a token twice")
    if END_OF_TEXT not in vocab:
        raise CheckpointError(f"{what}: its tokens have no {END_OF_TEXT}: it is not GPT-2's tokenizer")
    merges = _field(reader, "tokenizer.ggml.merges", what, kind=list, required=False)
    if not merges:
        raise CheckpointError(f"{what} has no tokenizer merges (tokenizer.ggml.merges): GPT-2's BPE needs them")
    for number, merge in enumerate(merges):
        pair = merge.split(" ") if isinstance(merge, str) else []
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or "".join(pair) not in vocab:
            raise CheckpointError(
                f"{what}: tokenizer merge {number} ({shown(str(merge)[:40])}) is not a merge of two tokens into a third"
            )
    (folder / VOCAB_FILE).write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / MERGES_FILE).write_text("#version: 0.2\n" + "".join(f"{m}\n" for m in merges), encoding="utf-8")
    return write_tokenizer_files(
        folder, vocab_file=folder / VOCAB_FILE, merges_file=folder / MERGES_FILE, model_max_length=n_positions
    )


def _name_map(n_layer: int, hf_names) -> dict[str, str]:
    """llama.cpp's tensor name → transformers' (``transformer.``-less), from gguf-py's own table (its
    convert_hf_to_gguf uses the same)."""
    import gguf

    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, n_layer)
    names = {}
    for name in (*hf_names, "lm_head.weight"):
        full = name if name.startswith("lm_head") else f"transformer.{name}"
        mapped = table.get_name(full, try_suffixes=(".weight", ".bias"))
        if mapped is not None:
            names[mapped] = name
    return names


def _read(reader_tensor, info: _TensorInfo) -> np.ndarray:
    """A tensor as float32, numpy order: read as it is (F32), widened (F16, BF16), or dequantized by gguf."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = reader_tensor.data
    if info.type == "F32":
        return np.asarray(data, np.float32).reshape(info.shape)
    return dequantize(np.asarray(data), GGMLQuantizationType[info.type]).reshape(info.shape).astype(np.float32)


def gguf_config(path: Path, what: str):
    """The checked GPT2Config of a GGUF file, its metadata only (no tensor read)."""
    header = _Header(path, what)
    header.close()
    reader = _reader(path, what)
    _architecture(reader, what)
    config = _config(reader, what, len(_tokens(reader, what)))
    _spec(config, what)
    return config


def read_gguf(path: Path, what: str) -> GgufWeights:
    """A GPT-2 GGUF file read and checked; its tokenizer files written to a new temporary folder (the caller's to
    remove)."""
    header = _Header(path, what)
    infos = header.tensors
    header.close()
    reader = _reader(path, what)
    _architecture(reader, what)
    tokens = _tokens(reader, what)
    config = _config(reader, what, len(tokens))
    spec = _spec(config, what)
    hf_names = _hf_names(spec.n_layer)
    names = _name_map(spec.n_layer, hf_names)
    by_name = {t.name: t for t in reader.tensors}
    if set(by_name) != set(infos):
        raise CheckpointError(f"{what}: gguf's reader and the header disagree on the tensors: the file is damaged")
    unknown = [name for name in infos if name not in names]
    if unknown:
        raise CheckpointError(f"{what}: tensor {shown(unknown[0])} is not part of a GPT-2 (llama.cpp's names)")
    for info in infos.values():
        if info.type not in FLOAT_TYPES and info.type not in KEPT:
            why = WHY_REFUSED.get(info.type, "is a K-quant or i-quant that ONNX's MatMulNBits cannot hold exactly")
            raise CheckpointError(
                f"{what}: tensor {shown(info.name)} is {info.type}, which {why.removeprefix('is ')}: convert the"
                " checkpoint with llama.cpp's convert_hf_to_gguf.py --outtype f16 or q8_0, or quantize to Q4_0"
            )
    missing = [name for name, hf in names.items() if hf in hf_names and name not in infos]
    if missing:
        raise CheckpointError(f"{what} has no tensor {shown(missing[0])} ({len(missing)} missing in all)")
    tied = "output.weight" not in infos or _same(by_name, "output.weight", "token_embd.weight")
    if not tied:
        config.tie_word_embeddings = False
        spec = _spec(config, what)
    state_dict, blocks = {}, {}
    for name, info in infos.items():
        hf = names[name]
        if hf == "lm_head.weight" and tied:
            continue
        array = _read(by_name[name], info)
        if hf.endswith(CONV1D):
            array = array.T
        state_dict[hf] = torch.from_numpy(np.require(array, requirements=["C", "W"]))  # the file's map is read-only
        if info.type in KEPT and len(info.shape) == 2 and hf != "wpe.weight":
            export_name = "lm_head" if hf == "lm_head.weight" else hf
            raw = np.asarray(by_name[name].data).reshape(info.shape[0], -1)
            blocks[export_name] = FileBlocks(info.type, info.shape[0], info.shape[1], raw)
    folder = Path(tempfile.mkdtemp(prefix="gpt2onnx-gguf-"))
    try:
        files = _write_tokenizer(reader, tokens, spec.n_positions, folder, what)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    types = {name: info.type for name, info in infos.items()}
    source = {
        "kind": "gguf",
        "path": str(path.resolve()),
        "sha256": sha256_file(path),
        "tensor_types": types,
        "kept_blocks": sorted({t for t in types.values() if t in KEPT}),
    }
    log.info("read %s: %d tensors (%s)", path, len(infos), ", ".join(sorted(set(types.values()))))
    return GgufWeights(config, spec, state_dict, blocks, path.stem, source, folder, files)


def _same(by_name: dict, a: str, b: str) -> bool:
    x, y = by_name[a], by_name[b]
    return x.tensor_type == y.tensor_type and np.array_equal(np.asarray(x.data), np.asarray(y.data))
