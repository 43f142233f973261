"""The registered choices of each graph-side axis, as declarations: what a refusal's advice may name instead
(gpt2onnx.capabilities.resolve's ``alternatives``). The run-side axes (runtimes, providers, targets, strategies,
the engine) add theirs where they are asked."""

from __future__ import annotations

from gpt2onnx.capabilities import Declared
from gpt2onnx.precisions.algorithms.all_algorithms import ALGORITHMS
from gpt2onnx.precisions.all_precisions import FLOAT, QUANTIZED
from gpt2onnx.precisions.kv_cache import FLOAT_DECLARED, KV_CACHES
from gpt2onnx.precisions.prompt_path import PROMPT_KERNELS
from gpt2onnx.profiles.all_profiles import PROFILES


def graph_alternatives() -> dict[str, list[Declared]]:
    """By axis: the profiles, precisions, algorithms, prompt kernels and K/V cache types."""
    return {
        "profile": [p.declared for p in PROFILES.values()],
        "precision": [p.declared for p in (*FLOAT.values(), *QUANTIZED.values())],
        "algorithm": [a.declared for a in ALGORITHMS.values()],
        "prompt kernel": [k.declared for k in PROMPT_KERNELS.values()],
        "K/V cache": [FLOAT_DECLARED, *(fmt.declared for fmt in KV_CACHES.values())],
    }
