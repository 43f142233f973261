"""The ONNX IO contract, declared once as data: names, dtypes and (symbolic) dims; and the decoder shape
read back from any graph that follows it.

This spec drives the torch export (names, dynamic axes, the dummy inputs it traces with), the check of the
written graph, the manifest, the runtimes and the deployment targets. Names and dim names follow the Hugging
Face / optimum convention, so optimum's ORTModelForCausalLM and other tools load the folder as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gpt2onnx.errors import ContractError
from gpt2onnx.layouts.layout import MASK_WIDTH, PAST_BUFFER, PRESENT_BUFFER
from gpt2onnx.records import Record


class DecoderDims(Protocol):
    """The architecture numbers the contract needs (gpt2onnx.pytorch.architecture.Architecture has them)."""

    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    head_dim: int


BATCH = "batch_size"
SEQUENCE = "sequence_length"
PAST = "past_sequence_length"
TOTAL = "past_sequence_length + sequence_length"
# A buffer layout's cache (gpt2onnx.layouts: shared, static): past and present are one preallocated buffer per
# layer, longer than the mask, so its dims get names of their own (the buffer contract: gpt2onnx.layouts.layout).

# ONNX element types by number, and ONNX Runtime's type strings, as numpy dtype names.
ONNX_DTYPES = {
    1: "float32",
    2: "uint8",
    3: "int8",
    6: "int32",
    7: "int64",
    9: "bool",
    10: "float16",
    11: "float64",
    16: "bfloat16",
}
ORT_DTYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int8)": "int8",  # a quantized K/V cache's
    "tensor(uint8)": "uint8",  # a 4-bit K/V cache's, two values a byte
}
_PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)$")
# A K/V cache whose rows pack several values a byte: onnxruntime's GroupQueryAttention stores a 4-bit cache as uint8,
# two values a byte (head_dim / 2 bytes a row); its 8-bit cache is int8, one a byte (gpt2onnx.precisions.kv_cache).
PACKED_VALUES = {"uint8": 2}


@dataclass(frozen=True)
class TensorSpec(Record):
    name: str
    dtype: str  # numpy dtype name
    dims: tuple[str | int, ...]


@dataclass(frozen=True)
class IOSpec(Record):
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {
            t.name: {axis: dim for axis, dim in enumerate(t.dims) if isinstance(dim, str)}
            for t in (*self.inputs, *self.outputs)
        }


def past_names(n_layer: int) -> list[str]:
    return [f"past_key_values.{i}.{kind}" for i in range(n_layer) for kind in ("key", "value")]


def present_names(n_layer: int) -> list[str]:
    return [f"present.{i}.{kind}" for i in range(n_layer) for kind in ("key", "value")]


def decoder_io(
    spec: DecoderDims, *, last_logits_only: bool = False, dtype: str = "float32", logits_dtype: str = "float32"
) -> IOSpec:
    def kv(name, length):
        return TensorSpec(name, dtype, (BATCH, spec.n_head, length, spec.head_dim))

    inputs = (
        TensorSpec("input_ids", "int64", (BATCH, SEQUENCE)),
        TensorSpec("attention_mask", "int64", (BATCH, TOTAL)),
        TensorSpec("position_ids", "int64", (BATCH, SEQUENCE)),
        *(kv(name, PAST) for name in past_names(spec.n_layer)),
    )
    logits_len = 1 if last_logits_only else SEQUENCE
    outputs = (
        # fp32 in every precision, unless an fp16 model is told to keep nothing in fp32
        TensorSpec("logits", logits_dtype, (BATCH, logits_len, spec.vocab_size)),
        *(kv(name, TOTAL) for name in present_names(spec.n_layer)),
    )
    return IOSpec(inputs, outputs)


def buffer_cache_io(io: IOSpec, *, cache_dtype: str | None = None) -> IOSpec:
    """The contract of a graph whose cache is one buffer per layer (a buffer layout): the same names, the cache and
    mask dims renamed (the caller's side: gpt2onnx.layouts.layout); past and present of ``cache_dtype`` where the
    cache is quantized (None: their dtype as it is), their last dim the bytes of a row where it packs values
    (PACKED_VALUES)."""
    per_byte = PACKED_VALUES.get(cache_dtype or "", 1)

    def rename(t: TensorSpec, axis: int, dim: str) -> TensorSpec:
        dims = tuple(dim if i == axis else d for i, d in enumerate(t.dims))
        if cache_dtype and axis == 2:
            return TensorSpec(t.name, cache_dtype, (*dims[:3], dims[3] // per_byte))
        return TensorSpec(t.name, t.dtype, dims)

    inputs = tuple(
        rename(t, 2, PAST_BUFFER)
        if _PAST.match(t.name)
        else rename(t, 1, MASK_WIDTH)
        if t.name == "attention_mask"
        else t
        for t in io.inputs
    )
    outputs = tuple(rename(t, 2, PRESENT_BUFFER) if t.name.startswith("present.") else t for t in io.outputs)
    return IOSpec(inputs, outputs)


def block_io(spec: DecoderDims, *, dtype: str = "float32") -> IOSpec:
    def hidden(name):
        return TensorSpec(name, dtype, (BATCH, SEQUENCE, spec.n_embd))

    def kv(name, length):
        return TensorSpec(name, dtype, (BATCH, spec.n_head, length, spec.head_dim))

    inputs = (
        hidden("hidden_states"),
        TensorSpec("attention_mask", "int64", (BATCH, TOTAL)),
        kv("past_key", PAST),
        kv("past_value", PAST),
    )
    outputs = (hidden("output_hidden_states"), kv("present_key", TOTAL), kv("present_value", TOTAL))
    return IOSpec(inputs, outputs)


def apply_io_dims(model, io: IOSpec) -> None:
    """Write the contract's dims onto the graph's inputs and outputs (the tracer names some dims itself)."""
    declared = {t.name: t for t in (*io.inputs, *io.outputs)}
    for value in (*model.graph.input, *model.graph.output):
        if value.name not in declared:
            continue
        shape = value.type.tensor_type.shape
        del shape.dim[:]
        for dim in declared[value.name].dims:
            entry = shape.dim.add()
            if isinstance(dim, str):
                entry.dim_param = dim
            else:
                entry.dim_value = dim


def check_graph_io(model, io: IOSpec) -> None:
    """Fail if a written graph does not carry exactly the contract's names, dtypes and dims (besides overridable
    initializers, which have their defaults)."""
    declared_inputs, declared_outputs = graph_io(model)
    for kind, declared, actual in (("input", io.inputs, declared_inputs), ("output", io.outputs, declared_outputs)):
        found = {t.name: t for t in actual}
        for t in declared:
            if t.name not in found:
                raise ContractError(f"exported graph lacks {kind} '{t.name}'")
            if found[t.name].dtype != t.dtype or found[t.name].dims != t.dims:
                got = found[t.name]
                raise ContractError(
                    f"exported {kind} '{t.name}' is {got.dtype}{list(got.dims)}, expected {t.dtype}{list(t.dims)}"
                )
        extra = set(found) - {t.name for t in declared}
        if kind == "input":  # an overridable initializer (a LoRA slot) has its default: not part of the contract
            extra -= {init.name for init in model.graph.initializer}
        if extra:
            raise ContractError(f"exported graph has unexpected {kind}s: {sorted(extra)}")


def value_dims(value) -> list[str | int]:
    """A graph input's or output's dims: ints for fixed ones, names for symbolic ones ('' if unnamed)."""
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value.type.tensor_type.shape.dim]


def value_dtype(value) -> str:
    elem_type = value.type.tensor_type.elem_type
    return ONNX_DTYPES.get(elem_type, str(elem_type))


def graph_io(model) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The inputs and outputs a graph declares, as TensorSpecs."""

    def as_spec(v):
        return TensorSpec(v.name, value_dtype(v), tuple(value_dims(v)))

    return [as_spec(v) for v in model.graph.input], [as_spec(v) for v in model.graph.output]


@dataclass(frozen=True)
class DecoderShape:
    """A decoder graph as the runtimes see it: its past names in layer order, heads, head size, context."""

    past_names: tuple[str, ...]
    n_head: int
    head_dim: int
    n_positions: int
    uses_position_ids: bool = True
    kv_dtype: str = "float32"
    vocab_size: int | None = None

    @property
    def n_layer(self) -> int:
        return len(self.past_names) // 2

    @property
    def present_names(self) -> tuple[str, ...]:
        return tuple(n.replace("past_key_values", "present") for n in self.past_names)


def decoder_shape(inputs: list[TensorSpec], outputs: list[TensorSpec], n_positions: int) -> DecoderShape:
    """Read (and check) the decoder IO contract from a graph's inputs and outputs."""
    found_inputs = {t.name: t for t in inputs}
    found_outputs = {t.name: t for t in outputs}
    for required in ("input_ids", "attention_mask"):
        if required not in found_inputs:
            raise ContractError(f"model has no input '{required}': it does not follow the decoder IO contract")
    if "logits" not in found_outputs:
        raise ContractError("model has no output 'logits': it does not follow the decoder IO contract")
    past = [n for n in found_inputs if _PAST.match(n)]
    if not past:
        raise ContractError("model has no past_key_values.{i}.key/value inputs: export it with past key/values")
    n_layer = len(past) // 2
    for i in range(n_layer):
        for kind in ("key", "value"):
            if f"past_key_values.{i}.{kind}" not in found_inputs:
                raise ContractError(
                    f"model has no input 'past_key_values.{i}.{kind}': it does not follow the IO contract"
                )
            if f"present.{i}.{kind}" not in found_outputs:
                raise ContractError(f"model has no output 'present.{i}.{kind}': it does not follow the IO contract")
    ordered = tuple(past_names(n_layer))
    first = found_inputs[ordered[0]]
    if len(first.dims) != 4 or not isinstance(first.dims[1], int) or not isinstance(first.dims[3], int):
        raise ContractError(
            f"input '{ordered[0]}' has shape {list(first.dims)}, expected [batch, n_head, past, head_dim]"
        )
    vocab = found_outputs["logits"].dims[-1] if found_outputs["logits"].dims else None
    return DecoderShape(
        ordered,
        first.dims[1],
        first.dims[3] * PACKED_VALUES.get(first.dtype, 1),  # head_dim, from the bytes of a packed cache's row
        n_positions,
        "position_ids" in found_inputs,
        first.dtype,
        vocab if isinstance(vocab, int) and vocab > 0 else None,
    )


def position_ids_for(attention_mask: np.ndarray) -> np.ndarray:
    """Positions of a left-padded batch: 0 at each row's first real token; padding gets 1 (as transformers does)."""
    positions = np.cumsum(attention_mask, axis=-1) - 1
    return np.where(attention_mask == 0, 1, positions).astype(np.int64)
