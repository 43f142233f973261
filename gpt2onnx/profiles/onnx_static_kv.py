"""The onnx profile's fusions at opset 24, then the static cache layout: each Attention reads one fixed-size K/V
buffer per layer that two TensorScatter nodes update in place (gpt2onnx.layouts.static). Golden: L Attention, 2L
TensorScatter, 2L + 1 LayerNormalization, L Gelu."""

import dataclasses

from gpt2onnx.layouts import static
from gpt2onnx.profiles import onnx_ops

PROFILE = dataclasses.replace(
    onnx_ops.PROFILE,
    name="onnx-static-kv",
    summary="the onnx profile over one fixed-size K/V buffer per layer, written in place by TensorScatter (opset 24)",
    layout=static.LAYOUT,
    marks=frozenset({("", "TensorScatter")}),
    base=onnx_ops.PROFILE,
)
