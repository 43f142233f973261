"""The concat layout: present = past + the step's K/V, a new tensor every step. What every export writes unless a
profile rewrites its attention for another layout; every runtime and target takes it."""

from gpt2onnx.layouts.layout import GROWING, CacheLayout

LAYOUT = CacheLayout(
    name="concat",
    summary="present = past + the step's K/V, a new tensor each step (every runtime, provider and target)",
    binding=GROWING,
    says={
        "quantizable_cache": "writes a new float cache each step (concatenated, which no attention op quantizes)",
        "cache_in_place": "writes a new cache tensor each step (present = past + new)",
    },
)
