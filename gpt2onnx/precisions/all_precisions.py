"""Every precision, by name: a new one is a module beside this one and a line here. The rest of the package asks
this table (gates, file checks, graph identification, deployment targets) instead of naming a precision."""

from __future__ import annotations

from gpt2onnx.errors import BadInput
from gpt2onnx.precisions import fp16, fp32, int4, int8, int8_weights
from gpt2onnx.precisions.precision import Precision
from gpt2onnx.registry import Registry

PRECISIONS: Registry[Precision] = Registry(
    "precision",
    (
        fp32.PRECISION,
        fp32.TF32,
        fp16.PRECISION,
        int8.PRECISION,
        int4.PRECISION,
        int8_weights.PRECISION,
    ),
)
FP32 = PRECISIONS["float32"]  # the reference's precision, and what an export is before any pass
TF32 = PRECISIONS["tf32"]  # the gates of fp32 weights run with TF32 matmuls
FP16 = fp16.PRECISION
INT8, INT4, INT8_WEIGHTS = int8.PRECISION, int4.PRECISION, int8_weights.PRECISION  # (the grid, compare: by name)
NO_QUANTIZATION = "none"  # --quantize's value for float weights
QUANTIZED: Registry[Precision] = Registry(  # by --quantize
    "quantizing precision",
    (p for p in PRECISIONS.values() if p.method is not None),
    option="--quantize",
    key=lambda p: p.method,
    extra=(NO_QUANTIZATION,),
)
FLOAT = {p.short: p for p in PRECISIONS.values() if p.selectable and p.method is None}  # by --dtype


def precision(name: str) -> Precision:
    """A precision by its name (a manifest's, a report's, a gate family's)."""
    return PRECISIONS.lookup(name)


def by_dtype(dtype: str) -> Precision:
    """A float precision by --dtype's value (fp32, fp16; or its canonical name float32, float16)."""
    found = FLOAT.get(dtype) or next((p for p in FLOAT.values() if p.name == dtype), None)
    if found is None:
        raise BadInput(
            f"unknown --dtype '{dtype}': choose {' or '.join(FLOAT)} (bf16 has no CPU kernels in ONNX Runtime)"
        )
    return found


def precision_of(facts) -> Precision:
    """The precision of a graph from its facts (gpt2onnx.artifact.graph.GraphFacts: its quantized ops and its
    dtype), never from a manifest: the first quantized precision whose marks the graph has (in the table's
    order), else the float precision of its dtype."""
    found = set(facts.quantized_ops)
    for candidate in QUANTIZED.values():
        if found & candidate.marks:
            return candidate
    return next((p for p in FLOAT.values() if p.dtype == facts.dtype), FP32)


def layer_bits(name: str) -> int:
    """The declared weight width of a layer stored at precision ``name`` (a method, or --lm-head's and
    --embeddings' values); 4 for a name no precision has (manifests from before the layer options)."""
    found = QUANTIZED.get(name)
    return found.weight_bits if found is not None else 4


def quantized_names() -> str:
    """--quantize's choices, for the help and the errors."""
    return QUANTIZED.choices()
