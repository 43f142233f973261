"""Where weights come from: a local Hugging Face folder, a Hub id, or a named architecture with seeded random weights.

Every path ends in a :class:`Checkpoint`: a checked config, its :class:`Architecture`, and a state dict in
:class:`gpt2onnx.pytorch.model.GPT2ForExport`'s naming whose every tensor was checked against that config.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpt2onnx.artifact.folder import COMPANION_FILES, MAX_JSON_BYTES
from gpt2onnx.errors import CheckpointError, shown
from gpt2onnx.files import kind_of, read_regular_text, sha256_file
from gpt2onnx.pytorch.adapters import (
    HEAD,
    LoraAdapter,
    adapts_head,
    base_model_of,
    is_adapter_folder,
    merged_weights,
    read_adapter,
)
from gpt2onnx.pytorch.architecture import PRESETS, Architecture, check_fits_in_memory, preset_config, spec_from_config

log = logging.getLogger(__name__)

SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
TORCH_BIN_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# torch.manual_seed takes 64 bits, but numpy's and most other generators take 32: one range for every seed.
SEED_RANGE = (0, 2**32 - 1)
# Buffers that old GPT-2 checkpoints carry; they hold no parameters (the causal mask), so they are skipped.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


@dataclass
class Checkpoint:
    config: Any  # transformers.GPT2Config
    spec: Architecture
    state_dict: dict[str, torch.Tensor]
    name: str  # a short name for the default output folder
    source: dict[str, Any]  # what the manifest records: kind, id/path, revision, hash, seed
    companion_dir: Path | None = None  # folder holding generation_config.json / tokenizer files, if any
    companion_files: list[str] = field(default_factory=list)
    # a quantized GGUF's blocks kept as stored, by export name (gpt2onnx.precisions.gguf_blocks.FileBlocks)
    blocks: dict[str, Any] = field(default_factory=dict)
    adapter: LoraAdapter | None = None  # a PEFT LoRA adapter merged into state_dict
    base_state_dict: dict[str, torch.Tensor] | None = None  # with an adapter: the base's weights, before the merge


def load_checkpoint(
    model: str,
    *,
    random_init: bool = False,
    seed: int = 0,
    revision: str | None = None,
    outliers: float = 0.0,
    option: str = "--model",
    adapter: str | Path | None = None,
) -> Checkpoint:
    """Resolve ``model`` (folder, Hub id, architecture name or config.json) into a checked Checkpoint.

    ``outliers`` (random weights only): the magnitude of the residual-stream outlier channels to inject
    (see :func:`inject_outlier_channels`); 0 injects none. ``option``: the command-line option that gave
    ``model``, named in errors (``--reference`` for a parity reference). ``adapter``: a PEFT LoRA adapter folder
    merged into the weights; a PEFT folder given as ``model`` is read as its base (``base_model_name_or_path``)
    with that adapter.

    Nothing from the folder is ever executed: config.json is read as data (an ``auto_map`` is ignored),
    pickled weights are read with ``weights_only``, and every file read must lie inside the folder.
    """
    if adapter is not None:
        base = load_checkpoint(
            model, random_init=random_init, seed=seed, revision=revision, outliers=outliers, option=option
        )
        return with_adapter(base, Path(adapter).expanduser(), option="--adapter")
    what = f"model '{model}' ({option})"
    path = Path(model).expanduser()
    if not random_init and is_adapter_folder(path):
        base = base_model_of(path, what)
        log.info("'%s' is a PEFT adapter: its base is '%s'", model, base)
        return with_adapter(load_checkpoint(base, revision=revision, option=option), path, option=option)
    if outliers and not random_init:
        raise CheckpointError(
            "--outliers only shapes random weights: add --random-init (random_init=True), or leave it out"
        )
    if not (math.isfinite(outliers) and outliers >= 0):
        raise CheckpointError(f"--outliers must be a magnitude ≥ 0 (GPT-2's reach about 3000), got {outliers}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise CheckpointError(f"seed (--seed) must be an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]}, got {seed!r}")
    if random_init and revision is not None:
        raise CheckpointError(
            f"revision (--revision) '{revision}' selects a Hub version of the weights, but random_init (--random-init)"
            " uses none: drop one of them"
        )
    if random_init:
        return _random_checkpoint(model, path, seed, outliers, what)
    if path.exists():
        if path.is_file() and _is_gguf(path):
            return _gguf_checkpoint(path, what)
        if path.is_file():
            raise CheckpointError(
                f"{what} is a file, not a model folder: point it at a folder with config.json and weights (or a .gguf),"
                " or add --random-init to export the architecture of a config.json with random weights"
            )
        return _local_checkpoint(path, source={"kind": "local", "path": str(path.resolve())}, what=what)
    if path.is_symlink():
        raise CheckpointError(f"{what} is a symbolic link to '{os.readlink(path)}', which does not exist")
    if _looks_like_path(model):
        raise CheckpointError(f"{what}: no such file or folder")
    if model in PRESETS:
        log.info("'%s' is not a local folder; trying the Hugging Face Hub", model)
    folder, commit = _fetch_from_hub(model, revision, what, option)
    # A Hub snapshot's files are links into the repository's blob store, two levels up: that is its folder.
    return _local_checkpoint(
        folder,
        source={"kind": "hub", "id": model, "revision": revision, "commit": commit},
        what=what,
        root=folder.parent.parent,
    )


def with_adapter(ckpt: Checkpoint, folder: Path, *, option: str) -> Checkpoint:
    """``ckpt`` with the LoRA adapter in ``folder`` merged into its weights (the base's kept for the reference)."""
    adapter = read_adapter(
        folder, expected=expected_shapes(ckpt.spec), tied=ckpt.spec.tie_word_embeddings, option=option
    )
    head = ckpt.state_dict["wte.weight" if ckpt.spec.tie_word_embeddings else HEAD]
    saved = adapter.saved_head
    if saved is not None and (saved.shape != head.shape or not torch.equal(saved.to(head.dtype), head)):
        raise CheckpointError(
            f"adapter '{folder}' ({option}) saved a head weight other than this base's: it was trained on another"
            " base; give its own base with --model"
        )
    if adapts_head(adapter) and ckpt.spec.tie_word_embeddings:
        ckpt = untied(ckpt)  # the merged head differs from the embedding, which PEFT leaves as it is
    return dataclasses.replace(
        ckpt,
        state_dict=merged_weights(ckpt.state_dict, adapter),
        name=folder.resolve().name,
        adapter=adapter,
        base_state_dict=ckpt.state_dict,
    )


def untied(ckpt: Checkpoint) -> Checkpoint:
    """``ckpt`` with its head untied from the token embedding: a head of its own holding the same values (one more
    vocab × n_embd matrix), so that a LoRA adapter can change the head alone."""
    config = copy.deepcopy(ckpt.config)
    config.tie_word_embeddings = False
    state_dict = {**ckpt.state_dict, HEAD: ckpt.state_dict["wte.weight"].clone()}
    log.info("untied the head of %s from its token embedding (its adapter adapts lm_head)", ckpt.name)
    return dataclasses.replace(
        ckpt, config=config, spec=dataclasses.replace(ckpt.spec, tie_word_embeddings=False), state_dict=state_dict
    )


def local_config(model: str, option: str = "--model"):
    """A planned export's checkpoint read for its config alone (no weights, nothing run): a local folder's or
    file's checked GPT2Config, the named architecture's, or None for a Hub id (not fetched); a mistyped path is
    refused as :func:`load_checkpoint` refuses it."""
    what = f"model '{model}' ({option})"
    path = Path(model).expanduser()
    if is_adapter_folder(path):
        return local_config(base_model_of(path, what), option)
    if path.is_dir():
        return _read_config(path / "config.json", what, root=path)
    if path.exists() and _is_gguf(path):
        from gpt2onnx.pytorch.gguf_checkpoint import gguf_config

        return gguf_config(path, what)
    if path.exists():  # a file: read only if it is a regular one (never a FIFO)
        return _read_config(path, what)
    if path.is_symlink():
        raise CheckpointError(f"{what} is a symbolic link to '{os.readlink(path)}', which does not exist")
    if _looks_like_path(model):
        raise CheckpointError(f"{what}: no such file or folder")
    return preset_config(model) if model in PRESETS else None


def _gguf_checkpoint(path: Path, what: str) -> Checkpoint:
    """A GPT-2 GGUF file (gpt2onnx.pytorch.gguf_checkpoint); its tokenizer files live as long as the Checkpoint."""
    from gpt2onnx.pytorch.gguf_checkpoint import read_gguf

    read = read_gguf(path, what)
    try:
        weights = to_export_names(read.state_dict, read.spec)
    except BaseException:
        shutil.rmtree(read.folder, ignore_errors=True)
        raise
    ckpt = Checkpoint(
        read.config,
        read.spec,
        weights,
        read.name,
        read.source,
        companion_dir=read.folder,
        companion_files=read.files,
        blocks=read.blocks,
    )
    weakref.finalize(ckpt, shutil.rmtree, read.folder, True)
    return ckpt


def _is_gguf(path: Path) -> bool:
    from gpt2onnx.pytorch.gguf_checkpoint import is_gguf

    return is_gguf(path)


def _looks_like_path(model: str) -> bool:
    # Hub ids are 'name' or 'org/name'; anything else that is not on disk is a mistyped path.
    return model.startswith((".", "/", "~")) or model.endswith((".json", "/")) or model.count("/") > 1 or "\\" in model


def _inside(root: Path, path: Path, what: str) -> Path:
    """``path`` resolved, refused if it (or the link it is) leads outside ``root``."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise CheckpointError(
            f"{what}: '{path}' is a link to '{resolved}', outside the model folder; only files inside the folder"
            " are read: replace the link with a copy of the file"
        )
    return resolved


def _read_config(config_file: Path, what: str, root: Path | None = None):
    """config.json as data, never as code: checked, then given to GPT2Config.from_dict (an auto_map is ignored)."""
    from transformers import GPT2Config

    if not config_file.exists() and not config_file.is_symlink():  # a FIFO or a folder: read_regular_text says
        raise CheckpointError(
            f"{what}: '{config_file.parent}' has no config.json: point it at a Hugging Face model folder,"
            " or use --random-init with a named architecture"
        )
    if root is not None:
        _inside(root, config_file, what)
    text = read_regular_text(config_file, "config", limit=MAX_JSON_BYTES)  # a regular file only: never a FIFO
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise CheckpointError(f"'{config_file}' is not valid JSON ({err}); fix or replace the file") from None
    if not isinstance(raw, dict):
        raise CheckpointError(
            f"'{config_file}' holds a JSON {type(raw).__name__}, not an object of settings; give a GPT-2 config.json"
        )
    if raw.get("model_type") != "gpt2":
        raise CheckpointError(f"'{config_file}': model_type is {raw.get('model_type')!r}, expected 'gpt2'")
    if raw.pop("auto_map", None) is not None:
        log.warning("'%s': auto_map ignored (code from a model folder is never run)", config_file)
    try:
        config = GPT2Config.from_dict(raw)
    except Exception as err:  # transformers raises many types for a bad config
        reason = " ".join(str(err).split())  # transformers 5 validates fields itself, over several lines: one line
        raise CheckpointError(f"'{config_file}' is not a valid GPT-2 config ({reason}); fix the file") from None
    return config


def _checked_spec(config, what: str) -> Architecture:
    spec = spec_from_config(config)
    check_fits_in_memory(spec, what)
    return spec


def _random_checkpoint(model: str, path: Path, seed: int, outliers: float, what: str) -> Checkpoint:
    from transformers import GPT2LMHeadModel

    companion_dir = None
    if path.is_file():
        config = _read_config(path, what)
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
    elif path.is_dir():
        config = _read_config(path / "config.json", what, root=path)
        name, companion_dir = path.resolve().name, path
    elif model in PRESETS:
        config, name = preset_config(model), model
    elif _looks_like_path(model):
        raise CheckpointError(f"{what}: no such file or folder")
    else:
        raise CheckpointError(
            f"unknown architecture '{model}' for --random-init: choose one of {', '.join(PRESETS)}, or give a"
            " config.json"
        )
    spec = _checked_spec(config, what)
    scale = getattr(config, "initializer_range", 0.02)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale >= 0):
        raise CheckpointError(
            f"{what}: initializer_range must be a finite number of 0 or more (GPT-2: 0.02), got {scale!r};"
            " fix the config"
        )
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
        ckpt.companion_dir, ckpt.companion_files = companion_dir, _companions(companion_dir, companion_dir, what)
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


def _local_checkpoint(folder: Path, *, source: dict[str, Any], what: str, root: Path | None = None) -> Checkpoint:
    root = folder if root is None else root
    config = _read_config(folder / "config.json", what, root=root)
    spec = _checked_spec(config, what)
    weight_files = _weight_files(folder, root, what)
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
        companion_files=_companions(folder, root, what),
    )


def _companions(folder: Path, root: Path, what: str) -> list[str]:
    """The companion files present in ``folder``; one that is a link leading out of ``root`` is refused."""
    present = []
    for name in COMPANION_FILES:
        path = folder / name
        if path.is_symlink() or path.exists():
            _inside(root, path, what)
        if path.is_file():
            present.append(name)
    return present


def _weight_files(folder: Path, root: Path, what: str) -> list[Path]:
    for single, index in (SAFETENSORS_FILES, TORCH_BIN_FILES):
        if (folder / single).is_file() or (folder / single).is_symlink():
            _inside(root, folder / single, what)
            return [folder / single]
        if (folder / index).is_file():
            return _shards(folder, index, root, what)
    raise CheckpointError(
        f"{what}: '{folder}' has no weights (model.safetensors or pytorch_model.bin);"
        " use --random-init to export its architecture with random weights"
    )


def _shards(folder: Path, index: str, root: Path, what: str) -> list[Path]:
    """The shard files a weight index names: plain file names inside the folder, nothing else."""
    index_file = _inside(root, folder / index, what)
    text = read_regular_text(index_file, "weight index", limit=MAX_JSON_BYTES)
    try:
        weight_map = json.loads(text)["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        reason = f"no {err}" if isinstance(err, KeyError) else str(err)
        raise CheckpointError(
            f"'{folder / index}' is not a valid weight index ({reason}); fix or replace the file"
        ) from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"'{folder / index}': weight_map must map tensor names to shard file names (strings), got"
            f" {json.dumps(weight_map)[:80]}; fix or replace the file"
        )
    shards = sorted(set(weight_map.values()))
    if not shards:
        raise CheckpointError(f"'{folder / index}' has an empty weight_map: it names no shard; fix the index")
    for shard in shards:
        bad = not shard or "\x00" in shard or Path(shard).is_absolute() or Path(shard).name != shard
        if bad or shard in (".", ".."):
            raise CheckpointError(
                f"'{folder / index}' names the shard {shown(shard)}, which is not a file name inside the folder;"
                " only shards beside the index are read: fix the index"
            )
        if shard == index:
            raise CheckpointError(f"'{folder / index}' names itself as a shard: name the .safetensors files")
    for shard in shards:
        path = folder / shard
        if not (path.exists() or path.is_symlink()):
            raise CheckpointError(f"'{folder}': shard {shown(shard)} named in {index} is missing")
        if not path.is_file():
            mode = (path.stat() if path.exists() else path.lstat()).st_mode
            raise CheckpointError(
                f"'{path}' named in {index} is {kind_of(mode)}, not a shard file: replace it with the file"
            )
    for shard in shards:
        _inside(root, folder / shard, what)
    return [folder / s for s in shards]


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    log.info("reading weights from %s", file)
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            weights = load_file(str(file))
        else:
            # A pickle can run code while it loads: weights_only reads plain tensors and refuses anything else.
            weights = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # safetensors and torch.load raise a variety of types for damaged files
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "weights only load failed" in str(err).lower() or "weights_only" in str(err):
            raise CheckpointError(
                f"'{file}' is refused for safety: it is a pickle that holds more than plain tensors, and loading it"
                " could run code; convert it to model.safetensors where you trust it, or use a safetensors checkpoint"
            ) from None
        raise CheckpointError(
            f"'{file}': cannot read weights ({reason[:200]}); the file is corrupt or truncated, download it again"
        ) from None
    if not isinstance(weights, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()
    ):
        raise CheckpointError(
            f"'{file}' does not hold a state dict (tensor names to tensors); save the model's state_dict() as"
            " model.safetensors"
        )
    return weights


def expected_shapes(spec: Architecture) -> dict[str, tuple[int, ...]]:
    """Every parameter of GPT2ForExport with its shape, in module order."""
    from gpt2onnx.pytorch.model import GPT2ForExport

    with torch.device("meta"):
        module = GPT2ForExport(spec)
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def to_export_names(state_dict: dict[str, torch.Tensor], spec: Architecture) -> dict[str, torch.Tensor]:
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
                f"checkpoint tensor '{key}' has shape {list(tensor.shape)}, but the config implies"
                f" {list(expected[name])}"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(
                f"checkpoint tensor '{key}' is {str(tensor.dtype).removeprefix('torch.')}, not floating point:"
                " GPT-2 weights are float; fix the checkpoint (a cast would change the model silently)"
            )
        if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):  # float8: scaled
            raise CheckpointError(
                f"checkpoint tensor '{key}' is {str(tensor.dtype).removeprefix('torch.')}, which is read with scales"
                " this tool does not apply: give float32, float16 or bfloat16 weights"
            )
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(
                f"checkpoint tensor '{key}' holds {bad:,} NaN or infinite values; the checkpoint is damaged: use"
                " another"
            )
        mapped[name] = tensor.float() if tensor.dtype != torch.float32 else tensor
    missing = [name for name in expected if name not in mapped]
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor '{missing[0]}' ({len(missing)} missing in all)")
    return {name: mapped[name] for name in expected}


def to_hf_names(state_dict: dict[str, torch.Tensor], spec: Architecture) -> dict[str, torch.Tensor]:
    """The inverse of to_export_names: keys for transformers' GPT2LMHeadModel."""
    out = {f"transformer.{k}": v for k, v in state_dict.items() if k != "lm_head"}
    out["lm_head.weight"] = state_dict["wte.weight"] if spec.tie_word_embeddings else state_dict["lm_head"]
    return out


def _fetch_from_hub(repo_id: str, revision: str | None, what: str, option: str) -> tuple[Path, str | None]:
    """Download (or find in the cache) what export needs; honours HF_HUB_OFFLINE, HF_HOME and HF_TOKEN."""
    from huggingface_hub import snapshot_download

    def fetch(patterns):
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns)))

    try:
        folder = fetch(("config.json", *COMPANION_FILES, *SAFETENSORS_FILES, "model-*.safetensors"))
        if not any((folder / f).is_file() for f in SAFETENSORS_FILES):
            folder = fetch(("config.json", *TORCH_BIN_FILES, "pytorch_model-*.bin"))
    except Exception as err:  # network, auth, validation and offline-cache errors all end here
        reason = _one_sentence_or_more(" ".join(str(err).split()) or type(err).__name__)
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "") else ""
        raise CheckpointError(
            f"{what} is not a local folder and could not be fetched from the Hugging Face Hub{offline}:"
            f" {reason}; use {option} PATH for a local folder, or --random-init for seeded random weights"
        ) from None
    return folder, folder.name if len(folder.name) == 40 else None


def _one_sentence_or_more(text: str, limit: int = 300) -> str:
    """``text`` (one line) up to ``limit`` characters, cut at a sentence's end (never mid-sentence), without its
    last full stop."""
    if len(text) > limit:
        end = text.rfind(". ", 0, limit)
        text = text[: end + 1] if end > 0 else text[:limit].rsplit(" ", 1)[0] + " …"
    return text.rstrip(".")
