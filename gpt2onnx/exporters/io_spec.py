"""The ONNX IO contract, declared once as data: names, dtypes and (symbolic) dims.

This spec drives the torch export (names, dynamic axes), the dummy inputs it traces with, the check
of the written graph, and the manifest. Names and dim names follow the Hugging Face / optimum convention,
so optimum's ORTModelForCausalLM and other tools load the folder as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpt2onnx.config import ModelSpec
from gpt2onnx.errors import Gpt2OnnxError

BATCH = "batch_size"
SEQUENCE = "sequence_length"
PAST = "past_sequence_length"
TOTAL = "past_sequence_length + sequence_length"

ONNX_DTYPES = {1: "float32", 7: "int64", 10: "float16", 16: "bfloat16"}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name
    dims: tuple[str | int, ...]

    def as_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "dims": list(self.dims)}


@dataclass(frozen=True)
class IOSpec:
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

    def as_dict(self) -> dict:
        return {"inputs": [t.as_dict() for t in self.inputs], "outputs": [t.as_dict() for t in self.outputs]}


def past_names(n_layer: int) -> list[str]:
    return [f"past_key_values.{i}.{kind}" for i in range(n_layer) for kind in ("key", "value")]


def present_names(n_layer: int) -> list[str]:
    return [f"present.{i}.{kind}" for i in range(n_layer) for kind in ("key", "value")]


def decoder_io(
    spec: ModelSpec, *, last_logits_only: bool = False, dtype: str = "float32", logits_dtype: str = "float32"
) -> IOSpec:
    kv = lambda name, length: TensorSpec(name, dtype, (BATCH, spec.n_head, length, spec.head_dim))  # noqa: E731
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


def block_io(spec: ModelSpec, *, dtype: str = "float32") -> IOSpec:
    hidden = lambda name: TensorSpec(name, dtype, (BATCH, SEQUENCE, spec.n_embd))  # noqa: E731
    kv = lambda name, length: TensorSpec(name, dtype, (BATCH, spec.n_head, length, spec.head_dim))  # noqa: E731
    inputs = (
        hidden("hidden_states"),
        TensorSpec("attention_mask", "int64", (BATCH, TOTAL)),
        kv("past_key", PAST),
        kv("past_value", PAST),
    )
    outputs = (hidden("output_hidden_states"), kv("present_key", TOTAL), kv("present_value", TOTAL))
    return IOSpec(inputs, outputs)


def dummy_inputs(io: IOSpec, spec: ModelSpec, *, batch=2, sequence=3, past=4) -> tuple[torch.Tensor, ...]:
    """Trace inputs: distinct sizes for each symbolic dim, so no two get tied together by accident."""
    sizes = {BATCH: batch, SEQUENCE: sequence, PAST: past, TOTAL: past + sequence}
    generator = torch.Generator().manual_seed(0)
    tensors = []
    for t in io.inputs:
        shape = [sizes[d] if isinstance(d, str) else d for d in t.dims]
        if t.name == "input_ids":
            tensors.append(torch.randint(0, spec.vocab_size, shape, generator=generator))
        elif t.name == "attention_mask":
            tensors.append(torch.ones(shape, dtype=torch.int64))
        elif t.name == "position_ids":
            tensors.append(torch.arange(past, past + sequence).expand(batch, sequence).contiguous())
        else:
            tensors.append(torch.randn(shape, generator=generator))
    return tuple(tensors)


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
    """Fail if a written graph does not carry exactly the contract's names, dtypes and dims."""
    for kind, declared, actual in (("input", io.inputs, model.graph.input), ("output", io.outputs, model.graph.output)):
        found = {v.name: v for v in actual}
        for t in declared:
            if t.name not in found:
                raise Gpt2OnnxError(f"exported graph lacks {kind} '{t.name}'")
            tensor_type = found[t.name].type.tensor_type
            dtype = ONNX_DTYPES.get(tensor_type.elem_type, str(tensor_type.elem_type))
            dims = tuple(d.dim_param if d.dim_param else d.dim_value for d in tensor_type.shape.dim)
            if dtype != t.dtype or dims != t.dims:
                raise Gpt2OnnxError(f"exported {kind} '{t.name}' is {dtype}{list(dims)}, expected {t.dtype}{list(t.dims)}")
        extra = set(found) - {t.name for t in declared}
        if extra:
            raise Gpt2OnnxError(f"exported graph has unexpected {kind}s: {sorted(extra)}")
