"""GPT-2 GGUF files written from the trained test fixture with the gguf package's own GGUFWriter, laid out as
llama.cpp's convert_hf_to_gguf.py writes them (its tensor names from gguf-py's table, the Conv1D weights stored
[out, in], the position embedding, norms and biases in F32, the tokenizer metadata of a GPT-2 BPE), quantized
with gguf.quants.quantize; and the damage the bad-input corpus does to them."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).parent / "fixtures" / "trained-tiny"
CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def fixture_tensors() -> dict[str, np.ndarray]:
    """The trained fixture's weights under llama.cpp's names, in its layout."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((FIXTURE / "config.json").read_text())
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, config["n_layer"])
    out = {}
    for name, array in load_file(str(FIXTURE / "model.safetensors")).items():
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue
        mapped = table.get_name(
            name if name.startswith("transformer.") else f"transformer.{name}", (".weight", ".bias")
        )
        out[mapped] = np.ascontiguousarray(array.T if name.endswith(CONV1D) else array).astype(np.float32)
    return out


def write_gguf(
    path: Path,
    *,
    matrices: str = "F16",
    embedding: str | None = None,
    architecture: str = "gpt2",
    merges: bool = True,
    drop: tuple[str, ...] = (),
    types: dict[str, str] | None = None,
) -> Path:
    """The fixture as a GGUF: the four block weights as ``matrices`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1), the token
    embedding as ``embedding`` (default: the same), everything else F32; ``types`` overrides one tensor's type
    (raw bytes of that type's size where gguf cannot quantize to it: the reader refuses it before reading);
    ``drop`` leaves tensors out; ``merges`` False writes no merges."""
    import gguf
    from gguf import GGMLQuantizationType as T

    config = json.loads((FIXTURE / "config.json").read_text())
    vocab = json.loads((FIXTURE / "vocab.json").read_text())
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merge_lines = [m for m in (FIXTURE / "merges.txt").read_text().splitlines() if m and not m.startswith("#")]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config["n_layer"])
    writer.add_context_length(config["n_positions"])
    writer.add_embedding_length(config["n_embd"])
    writer.add_feed_forward_length(4 * config["n_embd"])
    writer.add_head_count(config["n_head"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token == "<|endoftext|>" else 1 for token in tokens])  # CONTROL, NORMAL
    if merges:
        writer.add_token_merges(merge_lines)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_unk_token_id(config["eos_token_id"])
    writer.add_add_bos_token(False)
    kinds = {".attn_qkv.weight": matrices, ".attn_output.weight": matrices, ".ffn_up.weight": matrices}
    kinds[".ffn_down.weight"] = matrices
    for name, array in fixture_tensors().items():
        if name in drop:
            continue
        kind = next((k for suffix, k in kinds.items() if name.endswith(suffix)), "F32")
        kind = (embedding or matrices) if name == "token_embd.weight" else kind
        kind = (types or {}).get(name, kind)
        qtype = T[kind]
        if kind == "F32":
            writer.add_tensor(name, array)
        elif kind == "F16":
            writer.add_tensor(name, array.astype(np.float16))
        else:
            try:
                data = gguf.quants.quantize(array, qtype)
            except NotImplementedError:  # a type gguf cannot write: bytes of its size
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                data = np.zeros((array.shape[0], array.shape[1] // block * size), np.uint8)
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tensor_info_offset(path: Path, name: str) -> int:
    """Where tensor ``name``'s info (its name's length) starts in the header."""
    data = path.read_bytes()
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded)
    return at


def set_u64(path: Path, at: int, value: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(struct.pack("<Q", value))
