"""The PyTorch reference every parity check compares with: transformers' GPT2LMHeadModel, same weights."""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect

import numpy as np
import torch

from gpt2onnx.pytorch.checkpoint import Checkpoint, to_hf_names


def reference_model(ckpt: Checkpoint, *, device: str | None = None, dtype: torch.dtype | None = None):
    """GPT2LMHeadModel with eager attention, its parameters sharing storage with the checkpoint's tensors; with
    ``device`` ('cuda', 'cuda:1') or ``dtype`` (torch.float16), a copy moved there (the bench baseline on a GPU).
    Parity keeps the default: fp32 on the CPU, the exact reference. A checkpoint with a LoRA adapter gives PEFT's
    own PeftModel: the base's weights with the adapter loaded by PEFT from its folder, unmerged."""
    from transformers import GPT2LMHeadModel

    no_init_weights = _no_init_weights()
    config = copy.deepcopy(ckpt.config)
    config._attn_implementation = "eager"  # the plain softmax(QKᵀ)V path, exact in fp32
    with no_init_weights():
        model = GPT2LMHeadModel(config)
    weights = ckpt.state_dict if ckpt.adapter is None else ckpt.base_state_dict
    missing, unexpected = model.load_state_dict(to_hf_names(weights, ckpt.spec), strict=False, assign=True)
    if unexpected or [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]:
        raise RuntimeError(f"reference model: missing {missing}, unexpected {unexpected}")
    if ckpt.spec.tie_word_embeddings:
        model.tie_weights()
    if ckpt.adapter is not None:
        from peft import PeftModel  # only an adapter's reference needs it

        model = PeftModel.from_pretrained(model, str(ckpt.adapter.folder), is_trainable=False)
    if device is not None or dtype is not None:
        model.to(device=device, dtype=dtype)  # tied weights stay one parameter
    return model.eval()


# the attention settings transformers 4.x's default attention (sdpa) leaves out; 5.x applies them on every path
SDPA_DROPS = {
    "scale_attn_by_inverse_layer_idx": (True, "divides layer i's scores by i + 1"),
    "scale_attn_weights": (False, "leaves the scores undivided by √head_dim"),
}


def sdpa_disagreement(config) -> str | None:
    """Where the installed transformers' default attention (sdpa, what from_pretrained picks) disagrees with its
    eager path on this config, the warning that says which one the export and its checks follow; else None.
    Measured with transformers 4.57.6: max |Δlogits| 0.45 and 2.5 between the two paths on the settings below."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return None
    used = [f"{key} {value}" for key, (value, _) in SDPA_DROPS.items() if getattr(config, key, not value) == value]
    if not used:
        return None
    return (
        f"the config sets {' and '.join(used)}, which transformers {transformers.__version__}'s default attention"
        " (sdpa) ignores and its eager path applies: the export and every check follow eager, GPT-2's own"
        " attention (transformers 5 applies them on both paths); load the model with attn_implementation='eager'"
        " to compare it in transformers"
    )


def model_device(model) -> torch.device:
    """Where a reference's parameters are; the CPU for stand-ins without parameters (OnnxReference)."""
    parameters = getattr(model, "parameters", None)
    first = next(iter(parameters()), None) if callable(parameters) else None
    return first.device if first is not None else torch.device("cpu")


def _no_init_weights():
    """transformers' context that skips weight initialization: in transformers.initialization from 5.x, in
    modeling_utils before; where neither has it, initializing first is only slower."""
    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return importlib.import_module(module).no_init_weights
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext


def cache_argument(model) -> str:
    """The keyword a model's forward takes its cache under: ``cache`` in transformers 5.x (which still accepts
    ``past_key_values`` with a deprecation warning, until 5.40), ``past_key_values`` before and for our
    stand-ins (OnnxReference)."""
    inner = getattr(model, "get_base_model", None)  # PEFT's PeftModel passes the cache on to its base model
    forward = getattr(inner() if callable(inner) else model, "forward", None)
    try:
        if forward is not None and "cache" in inspect.signature(forward).parameters:
            return "cache"
    except (TypeError, ValueError):
        pass
    return "past_key_values"


def forward_with_cache(model, past=None, **inputs):
    """``model(**inputs, use_cache=True)`` with ``past`` passed under the keyword this transformers takes;
    returns (the output, the cache to feed back)."""
    out = model(**inputs, **{cache_argument(model): past}, use_cache=True)
    return out, output_cache(out)


def output_cache(out):
    """The cache an output carries: ``out.cache`` in transformers 5.x, ``out.past_key_values`` before."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def cache_as_arrays(past) -> list[np.ndarray]:
    """Flatten a transformers cache (any version's object, or legacy tuples) to [k0, v0, k1, v1, ...]."""
    if hasattr(past, "layers"):
        pairs = [(layer.keys, layer.values) for layer in past.layers]
    elif hasattr(past, "key_cache"):
        pairs = list(zip(past.key_cache, past.value_cache))
    elif hasattr(past, "to_legacy_cache"):
        pairs = past.to_legacy_cache()
    else:
        pairs = past
    return [t.detach().float().cpu().numpy() for pair in pairs for t in pair]


@torch.no_grad()
def reference_step(model, input_ids, attention_mask, position_ids, past=None):
    """One forward pass; returns (logits as numpy, the cache to feed back)."""
    device = model_device(model)
    out, cache = forward_with_cache(
        model,
        past,
        input_ids=torch.as_tensor(input_ids, device=device),
        attention_mask=torch.as_tensor(attention_mask, device=device),
        position_ids=torch.as_tensor(position_ids, device=device),
    )
    return out.logits.float().cpu().numpy(), cache
