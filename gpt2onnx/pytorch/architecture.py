"""GPT-2 architectures: the named presets and the checks that a config is one this model represents exactly."""

from __future__ import annotations

import math

from gpt2onnx.artifact.manifest import Architecture
from gpt2onnx.errors import CheckpointError
from gpt2onnx.files import available_memory

# Cerebras-GPT (cerebras/Cerebras-GPT-*): exact GELU, 2048 positions, n_inner 4 x n_embd, GPT-2's vocabulary.
_CEREBRAS = dict(activation_function="gelu", n_positions=2048)
# stanford-crfm's Mistral GPT-2 runs and BioMedLM: per-layer attention scaling with upcast (fp32) attention.
_MISTRAL = dict(scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True)

# Sizes of the released checkpoints (OpenAI's four and distilgpt2, and the families below, each as its published
# config.json has it), and a tiny one for tests and demos.
PRESETS: dict[str, dict[str, int | str | bool]] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
    "distilgpt2": dict(n_layer=6, n_head=12, n_embd=768),
    "cerebras-gpt-111m": dict(n_layer=10, n_head=12, n_embd=768, n_inner=3072, **_CEREBRAS),
    "cerebras-gpt-256m": dict(n_layer=14, n_head=17, n_embd=1088, n_inner=4352, **_CEREBRAS),
    "cerebras-gpt-590m": dict(n_layer=18, n_head=12, n_embd=1536, n_inner=6144, **_CEREBRAS),
    "cerebras-gpt-1.3b": dict(n_layer=24, n_head=16, n_embd=2048, n_inner=8192, **_CEREBRAS),
    "cerebras-gpt-2.7b": dict(n_layer=32, n_head=32, n_embd=2560, n_inner=10240, **_CEREBRAS),
    "cerebras-gpt-6.7b": dict(n_layer=32, n_head=32, n_embd=4096, n_inner=16384, **_CEREBRAS),
    "cerebras-gpt-13b": dict(n_layer=40, n_head=40, n_embd=5120, n_inner=20480, **_CEREBRAS),
    "biomedlm": dict(
        n_layer=32, n_head=20, n_embd=2560, vocab_size=28896, bos_token_id=28895, eos_token_id=28895, **_MISTRAL
    ),
    "mistral-gpt2-small": dict(n_layer=12, n_head=12, n_embd=768, **_MISTRAL),
    "mistral-gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, **_MISTRAL),
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, vocab_size=1000, n_positions=256),
}

# The activations transformers' GPT-2 takes (transformers.activations.ACT2FN), by the canonical name the export
# module computes: GPT-2's tanh GELU under its three names, the exact (erf) GELU, and the others.
ACTIVATIONS = {
    "gelu_new": "gelu_new",
    "gelu_pytorch_tanh": "gelu_new",
    "gelu_fast": "gelu_new",
    "gelu_accurate": "gelu_new",
    "gelu_python_tanh": "gelu_new",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_10": "gelu_10",
    "quick_gelu": "quick_gelu",
    "relu": "relu",
    "relu2": "relu2",
    "relu6": "relu6",
    "leaky_relu": "leaky_relu",
    "silu": "silu",
    "swish": "silu",
    "mish": "mish",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "linear": "linear",
}
TANH_GELU_NAMES = tuple(name for name, canonical in ACTIVATIONS.items() if canonical == "gelu_new")


def preset_config(name: str):
    """A transformers GPT2Config for a named architecture."""
    from transformers import GPT2Config

    if name not in PRESETS:
        raise CheckpointError(
            f"unknown architecture '{name}': choose one of {', '.join(PRESETS)}, or give a config.json"
        )
    params = dict(PRESETS[name])
    if "vocab_size" in params and "eos_token_id" not in params:  # GPT-2's 50256 lies outside a smaller vocabulary
        params.update(bos_token_id=params["vocab_size"] - 1, eos_token_id=params["vocab_size"] - 1)
    return GPT2Config(**params)


def spec_from_config(config) -> Architecture:
    """Check a transformers GPT2Config and return its Architecture; refuse what this model cannot represent."""

    def get(key, default=None):
        return getattr(config, key, default)

    model_type = get("model_type")
    if model_type != "gpt2":
        raise CheckpointError(f"config: model_type is '{model_type}', expected 'gpt2'")
    activation = get("activation_function", "gelu_new")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise CheckpointError(
            f"config: activation_function {activation!r} cannot be exported: choose one of {', '.join(ACTIVATIONS)}"
        )
    flags = {}
    for key, default in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
    ):
        value = get(key, default)
        if not isinstance(value, bool):
            raise CheckpointError(f"config: {key} must be true or false, got {value!r}; fix config.json")
        flags[key] = value
    if bool(get("add_cross_attention", False)):
        raise CheckpointError(
            f"config: add_cross_attention={get('add_cross_attention')} cannot be exported: cross-attention (an"
            " encoder-decoder GPT-2) is not a decoder-only GPT2LMHeadModel"
        )
    for key, (low, high) in INT_FIELDS.items():
        _check_int(key, get(key), low, high)
    n_inner = get("n_inner")
    if n_inner is not None:
        _check_int("n_inner", n_inner, 1, MAX_N_INNER)
    n_embd, n_head = get("n_embd"), get("n_head")
    if n_embd % n_head:
        raise CheckpointError(f"config: n_embd={n_embd} is not divisible by n_head={n_head}; fix config.json")
    epsilon = get("layer_norm_epsilon", 1e-5)
    if (
        isinstance(epsilon, bool)
        or not isinstance(epsilon, (int, float))
        or not (math.isfinite(epsilon) and epsilon > 0)
    ):
        raise CheckpointError(
            f"config: layer_norm_epsilon must be a positive finite number (GPT-2: 1e-5), got {epsilon!r}; fix"
            " config.json"
        )
    tie = get("tie_word_embeddings", True)
    if not isinstance(tie, bool):
        raise CheckpointError(f"config: tie_word_embeddings must be true or false, got {tie!r}; fix config.json")
    return Architecture(
        vocab_size=get("vocab_size"),
        n_positions=get("n_positions"),
        n_embd=n_embd,
        n_layer=get("n_layer"),
        n_head=n_head,
        n_inner=n_inner or 4 * n_embd,
        layer_norm_epsilon=float(epsilon),
        tie_word_embeddings=tie,
        activation=ACTIVATIONS[activation],
        **flags,
    )


# Ranges of the integer fields: far beyond any released GPT-2 (gpt2-xl: 48 layers, 25 heads, 1600 wide,
# 50257 tokens, 1024 positions), tight enough that a typo is caught before anything is allocated.
INT_FIELDS: dict[str, tuple[int, int]] = {
    "n_layer": (1, 4096),
    "n_head": (1, 4096),
    "n_embd": (1, 1 << 18),
    "vocab_size": (1, 1 << 24),
    "n_positions": (8, 1 << 20),  # below 8 the export's own check (a prompt and two decode steps) cannot run
}
MAX_N_INNER = 1 << 20


def _check_int(key: str, value, low: int, high: int) -> None:
    # bool is an int in Python, and JSON's true would silently become a 1-layer model.
    if isinstance(value, bool) or not isinstance(value, int):
        shown = f"{value!r} ({type(value).__name__})" if value is not None else "missing"
        raise CheckpointError(f"config: {key} must be an integer from {low} to {high}, got {shown}; fix config.json")
    if not low <= value <= high:
        raise CheckpointError(
            f"config: {key}={value} is out of range: it must be from {low} to {high}; fix config.json"
        )


def parameter_count(spec: Architecture) -> int:
    """The parameters of a GPT-2 of this shape (exact for GPT2ForExport: blocks, embeddings, final LayerNorm, head)."""
    d, inner = spec.n_embd, spec.n_inner
    per_block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * inner + inner) + (inner * d + d)
    head = 0 if spec.tie_word_embeddings else spec.vocab_size * d
    return spec.n_layer * per_block + (spec.vocab_size + spec.n_positions) * d + 2 * d + head


# The peak of an export, in bytes per fp32 parameter: the checkpoint's tensors, the ONNX graph built from
# them and its serialized bytes, plus transformers' reference model at validation, which shares the tensors.
EXPORT_BYTES_PER_PARAMETER = 12


def export_peak_bytes(spec: Architecture) -> int:
    return EXPORT_BYTES_PER_PARAMETER * parameter_count(spec)


def check_fits_in_memory(spec: Architecture, what: str) -> None:
    """Refuse, before anything is allocated, a model whose export would need more memory than this machine has."""
    needed, available = export_peak_bytes(spec), available_memory()
    if available is not None and needed > available:
        raise CheckpointError(
            f"{what}: {parameter_count(spec):,} parameters (n_layer {spec.n_layer}, n_embd {spec.n_embd},"
            f" vocab_size {spec.vocab_size}) need about {needed / 1e9:.1f} GB to export, but this machine has"
            f" {available / 1e9:.1f} GB available; check the config, or use a machine with more memory"
        )
