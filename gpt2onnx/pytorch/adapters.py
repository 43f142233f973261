"""PEFT LoRA adapters: read as data from a PEFT folder (adapter_config.json, adapter_model.safetensors), checked
against the base architecture, and merged into the base weights.

A LoRA module adds ``scale · B @ A`` to a weight (A: [r, in], B: [out, r]); ``scale`` is alpha / r, or
alpha / √r with rsLoRA. GPT-2's Conv1D stores its weight as [in, out] (PEFT's ``fan_in_fan_out``, which PEFT
forces on for Conv1D and off for nn.Linear, whatever the config says), so its delta is transposed. Dropout is
a training-time thing and ignored. What a merged GPT-2 cannot hold is refused in one line: DoRA, embedding
adapters, modules_to_save, trained biases, another base's shapes, pickled weights.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2onnx.artifact.manifest import AdapterRecord
from gpt2onnx.errors import CheckpointError, shown
from gpt2onnx.files import read_regular_text, require_regular, sha256_file

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_PICKLE = "adapter_model.bin"
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
CONV1D_KINDS = ("c_attn", "c_proj", "c_fc")  # GPT-2's Conv1D modules: weight [in, out]
HEAD = "lm_head"  # an nn.Linear: weight [out, in]
EMBEDDINGS = ("wte", "wpe")
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<factor>[AB])\.weight$")
_SAVED_HEAD = "base_model.model.lm_head.base_layer.weight"
_MODULE = re.compile(r"^h\.(?P<layer>\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)$")
# settings whose truthy value changes the arithmetic in a way a merged GPT-2 does not hold: (key, what it is)
_UNSUPPORTED = (
    ("use_dora", "DoRA (use_dora: a magnitude vector rescales each merged column)"),
    ("modules_to_save", "modules_to_save (whole modules trained and saved beside the LoRA factors)"),
    ("lora_bias", "lora_bias (a trained bias on B)"),
    ("target_parameters", "target_parameters (LoRA on bare parameters)"),
    ("trainable_token_indices", "trainable_token_indices (trained embedding rows)"),
    ("layer_replication", "layer_replication (layers duplicated)"),
    ("use_qalora", "QALoRA (use_qalora)"),
    ("alora_invocation_tokens", "aLoRA (active only after its invocation tokens)"),
)


@dataclass(frozen=True)
class LoraModule:
    """One adapted module: its weight's name in GPT2ForExport, its factors and its scale."""

    weight: str  # h.0.attn.c_attn.weight, or lm_head
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float
    transposed: bool  # Conv1D: the weight is [in, out], so the delta is (B @ A)ᵀ

    def delta(self) -> torch.Tensor:
        """``scale · B @ A`` in the weight's own layout, computed in float64 and returned in float32."""
        product = self.b.double() @ self.a.double() * self.scale
        return (product.T if self.transposed else product).float().contiguous()


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter read from its folder, checked against a base architecture."""

    folder: Path
    modules: tuple[LoraModule, ...]
    record: AdapterRecord
    # PEFT saves the head's own weight beside its factors where the head is tied to the embedding (its
    # save_embedding_layers): it must be the base's (checked by gpt2onnx.pytorch.checkpoint.with_adapter)
    saved_head: torch.Tensor | None = None


def is_adapter_folder(path: Path) -> bool:
    """A PEFT adapter folder: adapter_config.json and no config.json of its own."""
    return path.is_dir() and (path / ADAPTER_CONFIG).exists() and not (path / "config.json").exists()


def _inside(folder: Path, path: Path, what: str) -> Path:
    resolved = path.resolve()
    if not resolved.is_relative_to(folder.resolve()):
        raise CheckpointError(
            f"{what}: '{path}' is a link to '{resolved}', outside the adapter folder; only files inside it are read:"
            " replace the link with a copy of the file"
        )
    return resolved


def read_adapter_config(folder: Path, what: str) -> dict:
    """adapter_config.json as data (never PEFT's classes), refused where the adapter is not one a merged GPT-2
    can hold."""
    path = folder / ADAPTER_CONFIG
    if not path.exists() and not path.is_symlink():
        raise CheckpointError(f"{what}: '{folder}' has no {ADAPTER_CONFIG}: give a PEFT adapter folder")
    text = read_regular_text(_inside(folder, path, what), "adapter config", limit=MAX_ADAPTER_CONFIG_BYTES)
    try:
        config = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise CheckpointError(f"'{path}' is not valid JSON ({err}); fix or replace the file") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"'{path}' holds a JSON {type(config).__name__}, not a PEFT adapter config")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise CheckpointError(
            f"{what}: peft_type is {shown(peft_type)}, not LORA: only LoRA adapters are exported (merged into the"
            " base weights); merge other kinds with PEFT and export the merged model"
        )
    for key, label in _UNSUPPORTED:
        if config.get(key):
            raise CheckpointError(
                f"{what}: {label} is not supported: a LoRA adapter exports as W + scale·B@A only; merge it with"
                " PEFT's merge_and_unload() and export the merged model"
            )
    if config.get("bias", "none") != "none":
        raise CheckpointError(
            f"{what}: bias {shown(config.get('bias'))} (trained biases saved with the adapter) is not supported:"
            " merge it with PEFT's merge_and_unload() and export the merged model"
        )
    targets = config.get("target_modules")
    named = [targets] if isinstance(targets, str) else targets if isinstance(targets, list) else []
    for target in named:
        if isinstance(target, str) and any(re.search(rf"(^|\.|\b){e}($|\b)", target) for e in EMBEDDINGS):
            raise CheckpointError(
                f"{what}: target module {shown(target)} is an embedding (wte, wpe): embedding adapters are not"
                " supported; target c_attn, c_proj, c_fc or lm_head"
            )
    for key, kind in (("r", int), ("lora_alpha", (int, float))):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
            raise CheckpointError(f"'{path}': {key} must be a positive number, got {shown(value)}; fix the file")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise CheckpointError(f"'{path}': {key} must map module patterns to numbers; fix the file")
    return config


def base_model_of(folder: Path, what: str) -> str:
    """The base model an adapter folder names (``base_model_name_or_path``), for ``--model ADAPTER`` alone: a
    folder inside the adapter folder (a relative path, never leading out of it), an existing folder named by an
    absolute path, or a Hub id; anything else is refused with the way out (``--model BASE --adapter DIR``)."""
    config = read_adapter_config(folder, what)
    raw = config.get("base_model_name_or_path")
    way_out = "give the base with --model BASE --adapter ADAPTER_DIR"
    if not isinstance(raw, str) or not raw.strip() or "\x00" in raw:
        raise CheckpointError(f"{what}: {ADAPTER_CONFIG} names no base model (base_model_name_or_path): {way_out}")
    path = Path(raw).expanduser() if raw.startswith("~") else Path(raw)
    if path.is_absolute():
        if not path.is_dir():
            raise CheckpointError(f"{what}: its base model {shown(raw)} is not an existing folder: {way_out}")
        log.info("base model from %s: the folder %s", ADAPTER_CONFIG, path)
        return str(path)
    if ".." in path.parts or "\\" in raw:
        raise CheckpointError(
            f"{what}: its base model {shown(raw)} leads out of the adapter folder; a relative base is read only"
            f" inside it: {way_out}"
        )
    inside = folder / path
    if inside.exists() or inside.is_symlink():
        _inside(folder, inside, what)
        return str(inside)
    if raw.count("/") > 1 or raw.startswith(".") or raw.endswith("/"):
        raise CheckpointError(
            f"{what}: its base model {shown(raw)} is neither a folder inside the adapter folder nor a Hub id: {way_out}"
        )
    return raw  # a Hub id: fetched as any --model


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup (peft.utils.other.get_pattern_key): the first pattern that
    matches the module name's end."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter(folder: Path, *, expected: dict[str, tuple[int, ...]], tied: bool, option: str) -> LoraAdapter:
    """The adapter in ``folder`` checked against a base whose weights have the ``expected`` shapes (GPT2ForExport's
    names) and whose head is ``tied`` to the token embedding (or not)."""
    what = f"adapter '{folder}' ({option})"
    if not folder.is_dir():
        raise CheckpointError(f"{what}: no such folder")
    config = read_adapter_config(folder, what)
    weights = folder / ADAPTER_WEIGHTS
    if not weights.exists() and not weights.is_symlink():
        pickle = " (adapter_model.bin is a pickle, never loaded: save it as safetensors)"
        raise CheckpointError(
            f"{what}: no {ADAPTER_WEIGHTS}{pickle if (folder / ADAPTER_PICKLE).exists() else ''}; save the adapter"
            " with PEFT's save_pretrained() (safetensors, its default)"
        )
    try:
        from peft.utils import load_peft_weights  # PEFT's own reading: safetensors, never a pickle here
    except ImportError:
        raise CheckpointError(
            f"{what}: reading adapters needs the peft package: pip install 'gpt2onnx[adapters]'"
        ) from None
    _inside(folder, weights, what)
    require_regular(weights, "adapter weights", "save the adapter again with PEFT's save_pretrained()")
    try:
        tensors = load_peft_weights(str(folder), device="cpu")
    except Exception as err:  # safetensors raises several types for a damaged file
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"'{weights}': cannot read the adapter ({reason[:200]}); save it again") from None
    factors: dict[str, dict[str, torch.Tensor]] = {}
    saved_head = tensors.pop(_SAVED_HEAD, None)
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            kind = "DoRA's magnitude vector" if "lora_magnitude_vector" in key else "not a LoRA factor of a module"
            kind = "an embedding adapter" if "lora_embedding" in key else kind
            raise CheckpointError(f"{what}: tensor {shown(key)} is {kind}; only LoRA on linear modules is exported")
        factors.setdefault(match["module"], {})[match["factor"]] = tensor
    if not factors:
        raise CheckpointError(f"{what}: {ADAPTER_WEIGHTS} holds no LoRA factors")
    modules = []
    kinds = set()
    for module, pair in sorted(factors.items()):
        modules.append(_module(module, pair, config, expected, tied, what))
        kinds.add(module.rsplit(".", 1)[-1])
    record = AdapterRecord(
        path=str(folder.resolve()),
        files={name: sha256_file(folder / name) for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)},
        rank=int(config["r"]),
        alpha=float(config["lora_alpha"]),
        target_modules=tuple(sorted(kinds)),
        rslora=bool(config.get("use_rslora", False)),
        modules=len(modules),
        base=str(config.get("base_model_name_or_path") or ""),
    )
    return LoraAdapter(folder, tuple(modules), record, saved_head)


def _module(module: str, pair: dict, config: dict, expected: dict, tied: bool, what: str) -> LoraModule:
    """One module's factors checked against the base: the name, both factors, their shapes, finite floats."""
    name = module.removeprefix("transformer.")
    if name.split(".")[0] in EMBEDDINGS:
        raise CheckpointError(f"{what}: module {shown(module)} is an embedding: embedding adapters are not supported")
    if name == HEAD:  # on a tied base, the head is the token embedding's matrix (PEFT adapts the head alone)
        weight, transposed = HEAD, False
    elif _MODULE.match(name):
        weight, transposed = f"{name}.weight", True
    else:
        raise CheckpointError(f"{what}: module {shown(module)} is not a linear module of GPT-2 (c_attn, c_proj, c_fc)")
    if set(pair) != {"A", "B"}:
        raise CheckpointError(f"{what}: module {shown(module)} has lora_{''.join(pair)} without its other factor")
    a, b = pair["A"], pair["B"]
    shape = expected.get(weight, expected["wte.weight"] if tied and weight == HEAD else None)
    if shape is None:
        raise CheckpointError(f"{what}: module {shown(module)} is not in this base (it has fewer layers)")
    fan_in, fan_out = shape if transposed else shape[::-1]
    rank = a.shape[0] if a.ndim == 2 else -1
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != fan_in or b.shape != (fan_out, rank):
        raise CheckpointError(
            f"{what}: module {shown(module)} has factors A {list(a.shape)} and B {list(b.shape)}, but this base's"
            f" {weight} takes A [r, {fan_in}] and B [{fan_out}, r]: the adapter was trained on another base; give"
            " its own base with --model"
        )
    for factor in (a, b):
        if not factor.is_floating_point() or not bool(torch.isfinite(factor).all()):
            raise CheckpointError(f"{what}: module {shown(module)} holds non-float, NaN or infinite factors")
    hf_name = module.removeprefix("base_model.model.")
    r = _pattern_value(config.get("rank_pattern") or {}, hf_name, config["r"])
    if r != rank:
        raise CheckpointError(f"{what}: module {shown(module)} has rank {rank}, but its config gives {r}")
    alpha = _pattern_value(config.get("alpha_pattern") or {}, hf_name, config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraModule(weight, a.float(), b.float(), float(scale), transposed)


def adapts_head(adapter: LoraAdapter) -> bool:
    return any(module.weight == HEAD for module in adapter.modules)


def merged_weights(state_dict: dict[str, torch.Tensor], adapter: LoraAdapter) -> dict[str, torch.Tensor]:
    """The weights with every adapted module's delta added: new tensors for those, the others shared (an adapted
    head must be untied first: :func:`gpt2onnx.pytorch.checkpoint.with_adapter`)."""
    merged = dict(state_dict)
    for module in adapter.modules:
        merged[module.weight] = state_dict[module.weight] + module.delta()
    log.info("merged %d LoRA modules of %s into the base weights", len(adapter.modules), adapter.folder)
    return merged
