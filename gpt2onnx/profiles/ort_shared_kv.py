"""ort's fusions, then the shared cache layout: every MultiHeadAttention rewritten into GroupQueryAttention, whose
past and present are one preallocated buffer per layer written in place (gpt2onnx.layouts.shared). Golden: L
GroupQueryAttention, no MultiHeadAttention, L GELU, 2L + 1 LayerNorm-type. onnxruntime runs it on the CPU
provider only (its layout's need)."""

import dataclasses

from gpt2onnx.layouts import shared
from gpt2onnx.profiles import ort
from gpt2onnx.profiles.profile import MS

PROFILE = dataclasses.replace(
    ort.PROFILE,
    name="ort-shared-kv",
    summary="ort's ops with GroupQueryAttention: one K/V buffer per layer, written in place (cpu provider)",
    layout=shared.LAYOUT,
    marks=frozenset({(MS, "GroupQueryAttention")}),
    base=ort.PROFILE,
)
