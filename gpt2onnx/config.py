"""GPT-2 architectures: the named presets and the checks that a config is one this model represents exactly."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gpt2onnx.errors import CheckpointError

# Sizes of the released checkpoints (OpenAI's four and distilgpt2), and a tiny one for tests and demos.
PRESETS: dict[str, dict[str, int]] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
    "distilgpt2": dict(n_layer=6, n_head=12, n_embd=768),
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, vocab_size=1000, n_positions=256),
}

# Activations that are GPT-2's tanh GELU under another name.
TANH_GELU_NAMES = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


@dataclass(frozen=True)
class ModelSpec:
    """The numbers that fix a GPT-2 architecture."""

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int
    layer_norm_epsilon: float
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def preset_config(name: str):
    """A transformers GPT2Config for a named architecture."""
    from transformers import GPT2Config

    if name not in PRESETS:
        raise CheckpointError(
            f"unknown architecture '{name}': choose one of {', '.join(PRESETS)}, or give a config.json"
        )
    params = dict(PRESETS[name])
    if "vocab_size" in params:  # GPT-2's special token 50256 lies outside a smaller vocabulary
        params.update(bos_token_id=params["vocab_size"] - 1, eos_token_id=params["vocab_size"] - 1)
    return GPT2Config(**params)


def spec_from_config(config) -> ModelSpec:
    """Check a transformers GPT2Config and return its ModelSpec; refuse what this model cannot represent."""
    get = lambda key, default=None: getattr(config, key, default)  # noqa: E731
    model_type = get("model_type")
    if model_type != "gpt2":
        raise CheckpointError(f"config: model_type is '{model_type}', expected 'gpt2'")
    activation = get("activation_function", "gelu_new")
    if activation not in TANH_GELU_NAMES:
        raise CheckpointError(
            f"config: activation_function '{activation}' is not GPT-2's tanh GELU ({', '.join(TANH_GELU_NAMES)})"
        )
    refusals = {
        "scale_attn_weights": (True, "attention scores must be scaled by 1/sqrt(head_dim)"),
        "scale_attn_by_inverse_layer_idx": (False, "per-layer attention scaling is not supported"),
        "reorder_and_upcast_attn": (False, "reordered/upcast attention is not supported"),
        "add_cross_attention": (False, "cross-attention is not supported"),
    }
    for key, (expected, why) in refusals.items():
        value = get(key, expected)
        if bool(value) != expected:
            raise CheckpointError(f"config: {key}={value} cannot be exported: {why}")
    n_embd, n_head = int(get("n_embd")), int(get("n_head"))
    if n_head <= 0 or n_embd % n_head:
        raise CheckpointError(f"config: n_embd={n_embd} is not divisible by n_head={n_head}")
    for key in ("vocab_size", "n_positions", "n_layer"):
        if int(get(key, 0)) <= 0:
            raise CheckpointError(f"config: {key} must be a positive integer, got {get(key)}")
    return ModelSpec(
        vocab_size=int(get("vocab_size")),
        n_positions=int(get("n_positions")),
        n_embd=n_embd,
        n_layer=int(get("n_layer")),
        n_head=n_head,
        n_inner=int(get("n_inner") or 4 * n_embd),
        layer_norm_epsilon=float(get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(get("tie_word_embeddings", True)),
    )
