"""Where weights come from: a local Hugging Face folder, a Hub id, or a named architecture with seeded random weights.

Every path ends in a :class:`Checkpoint`: a checked config, its :class:`ModelSpec`, and a state dict in
:class:`gpt2onnx.model.GPT2ForExport`'s naming whose every tensor was checked against that config.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpt2onnx.artifact.folder import COMPANION_FILES, TOKENIZER_FILES  # noqa: F401 (TOKENIZER_FILES: re-exported)
from gpt2onnx.config import PRESETS, ModelSpec, preset_config, spec_from_config
from gpt2onnx.errors import BadInput, CheckpointError
from gpt2onnx.files import sha256_file

log = logging.getLogger(__name__)

SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
TORCH_BIN_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# Buffers that old GPT-2 checkpoints carry; they hold no parameters (the causal mask), so they are skipped.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


@dataclass
class Checkpoint:
    config: Any  # transformers.GPT2Config
    spec: ModelSpec
    state_dict: dict[str, torch.Tensor]
    name: str  # a short name for the default output folder
    source: dict[str, Any]  # what the manifest records: kind, id/path, revision, hash, seed
    companion_dir: Path | None = None  # folder holding generation_config.json / tokenizer files, if any
    companion_files: list[str] = field(default_factory=list)


def load_checkpoint(
    model: str, *, random_init: bool = False, seed: int = 0, revision: str | None = None, outliers: float = 0.0
) -> Checkpoint:
    """Resolve ``model`` (folder, Hub id, architecture name or config.json) into a checked Checkpoint.

    ``outliers`` (random weights only): the magnitude of the residual-stream outlier channels to inject
    (see :func:`inject_outlier_channels`); 0 injects none.
    """
    path = Path(model).expanduser()
    if outliers and not random_init:
        raise CheckpointError("--outliers only shapes random weights: add --random-init, or leave --outliers out")
    if not (math.isfinite(outliers) and outliers >= 0):
        raise CheckpointError(f"--outliers must be a magnitude ≥ 0 (GPT-2's reach about 3000), got {outliers}")
    if random_init:
        return _random_checkpoint(model, path, seed, outliers)
    if path.exists():
        if path.is_file():
            raise CheckpointError(
                f"--model '{model}' is a file, not a model folder: point it at a folder with config.json and weights,"
                " or add --random-init to export the architecture of a config.json with random weights"
            )
        return _local_checkpoint(path, source={"kind": "local", "path": str(path.resolve())})
    if _looks_like_path(model):
        raise CheckpointError(f"--model '{model}': no such file or folder")
    if model in PRESETS:
        log.info("'%s' is not a local folder; trying the Hugging Face Hub", model)
    folder, commit = _fetch_from_hub(model, revision)
    return _local_checkpoint(folder, source={"kind": "hub", "id": model, "revision": revision, "commit": commit})


def _looks_like_path(model: str) -> bool:
    # Hub ids are 'name' or 'org/name'; anything else that is not on disk is a mistyped path.
    return model.startswith((".", "/", "~")) or model.endswith((".json", "/")) or model.count("/") > 1 or "\\" in model


def _read_config(config_file: Path):
    from transformers import AutoConfig

    if not config_file.is_file():
        raise CheckpointError(
            f"'{config_file.parent}' has no config.json: point --model at a Hugging Face model folder,"
            " or use --random-init with a named architecture"
        )
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"'{config_file}' is not valid JSON ({err}); fix or replace the file") from None
    if raw.get("model_type") != "gpt2":
        raise CheckpointError(f"'{config_file}': model_type is '{raw.get('model_type')}', expected 'gpt2'")
    try:
        return AutoConfig.from_pretrained(config_file.parent if config_file.name == "config.json" else config_file)
    except Exception as err:  # transformers raises many types for a bad config
        raise CheckpointError(f"'{config_file}' is not a valid GPT-2 config ({err})") from None


def _random_checkpoint(model: str, path: Path, seed: int, outliers: float = 0.0) -> Checkpoint:
    from transformers import GPT2LMHeadModel

    companion_dir = None
    if path.is_file():
        config = _read_config(path)
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
    elif path.is_dir():
        config = _read_config(path / "config.json")
        name, companion_dir = path.resolve().name, path
    elif model in PRESETS:
        config, name = preset_config(model), model
    elif _looks_like_path(model):
        raise CheckpointError(f"--model '{model}': no such file or folder")
    else:
        raise CheckpointError(
            f"unknown architecture '{model}' for --random-init: choose one of {', '.join(PRESETS)}, or give a config.json"
        )
    spec = spec_from_config(config)
    config.tie_word_embeddings = spec.tie_word_embeddings
    config.architectures = ["GPT2LMHeadModel"]
    log.info("initializing %s with random weights (seed %d)", name, seed)
    torch.manual_seed(seed)
    hf_model = GPT2LMHeadModel(config).eval()
    state_dict = hf_model.state_dict()
    # transformers initializes biases to 0 and LayerNorm gains to 1. Perturb every 1-D tensor so that
    # biases and gains are really exercised by parity checks and no two tensors are identical (the
    # exporter would merge identical initializers and blur the parameter accounting).
    with torch.no_grad():
        for tensor in state_dict.values():
            if tensor.ndim == 1 and tensor.is_floating_point():
                tensor.add_(torch.randn(tensor.shape) * config.initializer_range)
    channels = inject_outlier_channels(hf_model, outliers, seed) if outliers else []
    # Identity of random weights: the architecture's numbers and the seed (not transformers' config dump,
    # which changes with its version).
    spec_hash = hashlib.sha256(json.dumps(spec.as_dict(), sort_keys=True).encode()).hexdigest()
    source = {"kind": "random", "architecture": model, "seed": seed, "spec_sha256": spec_hash}
    if outliers:
        source["outliers"] = {"magnitude": outliers, "channels": channels}
    ckpt = Checkpoint(config, spec, to_export_names(state_dict, spec), name, source)
    if companion_dir is not None:
        ckpt.companion_dir, ckpt.companion_files = companion_dir, _present(companion_dir, COMPANION_FILES)
    return ckpt


OUTLIER_CHANNELS = 2  # GPT-2 small's massive activations sit in a few channels (447 and 138 above all)


def inject_outlier_channels(model, magnitude: float, seed: int) -> list[int]:
    """Give a randomly initialized GPT2LMHeadModel the massive activations of a trained GPT-2 (in place).

    In trained GPT-2 the first token of every sequence carries a few residual-stream channels in the
    thousands (about 3000 in GPT-2 small) from the early blocks to the last; that token becomes an attention
    sink. Every LayerNorm that reads it normalizes a vector whose variance is of the order of 3000², far past
    fp16's 65504 when it is computed in fp16. Random weights have nothing of the kind, so an fp16 graph that
    would overflow on a real checkpoint passes on them.

    Done here: the position embedding of position 0 gets ±``magnitude`` (alternating signs) in
    ``OUTLIER_CHANNELS`` seeded channels, so the residual stream of every sequence's first token carries them
    through every block into the final LayerNorm; the other positions are left as they were. Returns the
    channels.
    """
    generator = torch.Generator().manual_seed(seed)
    channels = sorted(torch.randperm(model.config.n_embd, generator=generator)[:OUTLIER_CHANNELS].tolist())
    signs = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(channels))])
    with torch.no_grad():
        model.transformer.wpe.weight[0, channels] += signs * magnitude
    log.info("outlier channels %s injected at magnitude %g on position 0", channels, magnitude)
    return channels


def _local_checkpoint(folder: Path, *, source: dict[str, Any]) -> Checkpoint:
    config = _read_config(folder / "config.json")
    spec = spec_from_config(config)
    weight_files = _weight_files(folder)
    state_dict: dict[str, torch.Tensor] = {}
    digest = hashlib.sha256()
    for file in weight_files:
        state_dict.update(_read_weights(file))
        digest.update(sha256_file(file).encode())
    source.update(weights=[f.name for f in weight_files], sha256=digest.hexdigest())
    name = source.get("id", folder.resolve().name).split("/")[-1]
    return Checkpoint(
        config,
        spec,
        to_export_names(state_dict, spec),
        name,
        source,
        companion_dir=folder,
        companion_files=_present(folder, COMPANION_FILES),
    )


def _present(folder: Path, names) -> list[str]:
    return [n for n in names if (folder / n).is_file()]


def _weight_files(folder: Path) -> list[Path]:
    for single, index in (SAFETENSORS_FILES, TORCH_BIN_FILES):
        if (folder / single).is_file():
            return [folder / single]
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise CheckpointError(f"'{folder / index}' is not a valid weight index ({err})") from None
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise CheckpointError(f"'{folder}': shard '{missing[0]}' named in {index} is missing")
            return [folder / s for s in shards]
    raise CheckpointError(
        f"'{folder}' has no weights (model.safetensors or pytorch_model.bin);"
        " use --random-init to export its architecture with random weights"
    )


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    log.info("reading weights from %s", file)
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # safetensors and torch.load raise a variety of types for damaged files
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"'{file}': cannot read weights ({reason}); the file is corrupt or truncated, download it again"
        ) from None


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter of GPT2ForExport with its shape, in module order."""
    from gpt2onnx.model import GPT2ForExport

    with torch.device("meta"):
        module = GPT2ForExport(spec)
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def to_export_names(state_dict: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Map a Hugging Face GPT-2 state dict (GPT2LMHeadModel or GPT2Model keys) onto GPT2ForExport's names,
    checking that every tensor is there, expected, and of the shape the config implies."""
    expected = expected_shapes(spec)
    mapped: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        name = key.removeprefix("transformer.")
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight":
            if spec.tie_word_embeddings:
                continue  # tied: the head is the token embedding, stored once
            name = "lm_head"
        if name not in expected:
            raise CheckpointError(f"checkpoint tensor '{key}' is not part of a GPT-2 with this config")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"checkpoint tensor '{key}' has shape {list(tensor.shape)}, but the config implies {list(expected[name])}"
            )
        mapped[name] = tensor.float() if tensor.dtype != torch.float32 else tensor
    missing = [name for name in expected if name not in mapped]
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor '{missing[0]}' ({len(missing)} missing in all)")
    return {name: mapped[name] for name in expected}


def to_hf_names(state_dict: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The inverse of to_export_names: keys for transformers' GPT2LMHeadModel."""
    out = {f"transformer.{k}": v for k, v in state_dict.items() if k != "lm_head"}
    out["lm_head.weight"] = state_dict["wte.weight"] if spec.tie_word_embeddings else state_dict["lm_head"]
    return out


def _fetch_from_hub(repo_id: str, revision: str | None) -> tuple[Path, str | None]:
    """Download (or find in the cache) what export needs; honours HF_HUB_OFFLINE, HF_HOME and HF_TOKEN."""
    from huggingface_hub import snapshot_download

    def fetch(patterns):
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns)))

    try:
        folder = fetch(("config.json", *COMPANION_FILES, *SAFETENSORS_FILES, "model-*.safetensors"))
        if not any((folder / f).is_file() for f in SAFETENSORS_FILES):
            folder = fetch(("config.json", *TORCH_BIN_FILES, "pytorch_model-*.bin"))
    except Exception as err:  # network, auth, validation and offline-cache errors all end here
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "") else ""
        raise CheckpointError(
            f"--model '{repo_id}' is not a local folder and could not be fetched from the Hugging Face Hub{offline}:"
            f" {reason[:200]}; use --model PATH for a local folder, or --random-init for seeded random weights"
        ) from None
    return folder, folder.name if len(folder.name) == 40 else None
