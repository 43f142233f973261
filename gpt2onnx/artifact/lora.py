"""Switchable LoRA adapters in an exported folder: where the adapter files are (NAME.onnx_adapter beside
model.onnx, hashed in the manifest as every file of the folder), and the names of the slots they fill
(gpt2onnx.passes.lora_slots adds the slots; a runtime binds an adapter's factors to them)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gpt2onnx.artifact.folder import ModelFolder
from gpt2onnx.capabilities import Declared, Need
from gpt2onnx.errors import BadInput, IntegrityError
from gpt2onnx.files import sha256_file

ADAPTER_SUFFIX = ".onnx_adapter"  # onnxruntime's adapter format (onnxruntime.AdapterFormat)
SLOT_PREFIX = "lora."
SLOT_ADD = "/lora_add"  # the name's end of the Add that puts a slot's branch on its MatMul's output
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class LoraSlot:
    """One adapted weight of the base graph: its initializer's name and its [in, out] shape."""

    weight: str  # h.0.attn.c_attn.weight (lm_head: the head)
    fan_in: int
    fan_out: int
    reads: str | None = None  # the initializer its MatMul (the head's Gemm) reads, if not ``weight``: wte.weight

    @property
    def module(self) -> str:
        return self.weight.removesuffix(".weight")

    @property
    def a(self) -> str:
        return f"{SLOT_PREFIX}{self.module}.A"  # [in, r]: Aᵀ

    @property
    def b(self) -> str:
        return f"{SLOT_PREFIX}{self.module}.B"  # [r, out]: scale · Bᵀ

    @property
    def rank_dim(self) -> str:
        return f"{self.module}.rank"


def slot_inputs(model) -> list[str]:
    """The names of a graph's LoRA slots (an onnx.ModelProto's overridable initializers), empty for a graph
    without."""
    initializers = {init.name for init in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name.startswith(SLOT_PREFIX) and i.name in initializers]


def check_adapter_name(name: str, what: str = "adapter name") -> str:
    """A name usable as a file name and in a request: letters, digits, '_', '.', '-', at most 64."""
    if not isinstance(name, str) or not ADAPTER_NAME.match(name) or name in (".", ".."):
        raise BadInput(
            f"{what} {name!r} is not valid: use letters, digits, '_', '.' and '-' (at most 64, starting with a"
            " letter or digit)"
        )
    return name


def adapter_file(folder: Path, name: str) -> Path:
    """Where a switchable folder keeps adapter ``name``: NAME.onnx_adapter beside the model."""
    return Path(folder) / f"{check_adapter_name(name)}{ADAPTER_SUFFIX}"


def adapter_of(model: ModelFolder, name: str) -> Path:
    """The file of adapter ``name`` in an exported folder, checked against the manifest's sha256."""
    names = model.manifest.adapters if model.manifest is not None else {}
    if name not in names:
        has = ", ".join(names) if names else "none (export with --adapters NAME=DIR,… to add switchable ones)"
        raise BadInput(f"'{model.folder}' has no adapter {name!r}; its adapters: {has}")
    path = adapter_file(model.folder, name)
    record = model.manifest.files.get(path.name)
    if record is None or not path.is_file() or sha256_file(path) != record.sha256:
        raise IntegrityError(f"'{path}' is missing or changed since the export (sha256): export the folder again")
    return path


def adapter_declared(name: str) -> Declared:
    """What activating switchable adapter ``name`` needs of a runtime (gpt2onnx.capabilities): one that binds its
    factors to the graph's slots on every run (onnxruntime's steppers; a loop of its own does not)."""
    why = "needs a runtime that binds its factors to the graph's slots on each run"
    need = Need("binds_adapters", allowed={True}, why=why)
    return Declared("adapter", name, f"--adapter {name}", requires=(need,), label=f"the adapter {name!r} (--adapter)")


def adapter_files_declared(model: ModelFolder) -> list[Declared]:
    """A folder with switchable adapters (NAME.onnx_adapter): what a deploy target must carry; none without."""
    names = model.manifest.adapters if model.manifest is not None else {}
    return [adapter_files_choice(str(model.folder), tuple(names))] if names else []


def adapter_files_choice(folder: str, names: tuple[str, ...]) -> Declared:
    """What a folder with switchable adapters ``names`` is, as a choice of the resolver's."""
    says = {"adapter_files": f"keeps switchable LoRA adapters beside its graph ({', '.join(names)})"}
    label = f"'{folder}' (switchable adapters)"
    ensures = {"adapter_files": True}
    return Declared("adapters", "switchable", ensures=ensures, says=says, origin="folder", label=label)
