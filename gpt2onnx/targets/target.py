"""What a deployment target is to gpt2onnx (gpt2onnx.targets.all_targets registers them: adding one is one new
module plus one line there).

A target is one module under ``gpt2onnx.targets`` that defines ``SPEC``, a :class:`TargetSpec`: its name, the
top-level paths it adds to a folder, the targets it builds on, its typed options (a frozen dataclass validated when
it is built, whose field names are :func:`~gpt2onnx.targets.deploy.deploy`'s keywords) and
``write(deployment, options) -> Written``: the files it wrote into the staged folder and, where it keeps one, its
record for the manifest. ``deploy`` stages the folder once and calls each target asked for, in this registry's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from gpt2onnx.artifact.folder import ModelFolder
from gpt2onnx.capabilities import Declared, Need


@dataclass(frozen=True)
class Deployment:
    """What every target writes from: the folder deployed (opened: its files checked, its manifest read), the
    staged new folder (the source's own files already in it) and the new folder's name."""

    source: ModelFolder
    staging: Path
    name: str  # the deployed folder's own name: the page's title, Triton's default model name
    owned: frozenset[str] = frozenset()  # the top-level paths every registered target adds (TargetSpec.paths)


@dataclass(frozen=True)
class Written:
    """What a target wrote: its files (relative to the folder) and its record for the manifest, if it keeps one."""

    files: list[str]
    record: dict | None = None


@dataclass(frozen=True)
class TargetSpec:
    """One deployment target, declared by its module."""

    name: str
    summary: str  # one line: what it makes the folder ready for
    write: Callable[[Deployment, Any], Written]
    paths: tuple[str, ...]  # the top-level entries it adds: dropped when the folder is deployed again
    options: type | None = None  # its options; their field names are deploy()'s keywords
    needs: tuple[str, ...] = ()  # targets it builds on: added when it is asked for, written before it
    tokenizer_json: bool = False  # it reads only tokenizer.json: built from vocab.json + merges.txt when missing
    record: str | None = None  # the key of its record in the manifest's deploy record
    aliases: tuple[str, ...] = ()  # other spellings accepted by --target
    undo: Callable[[Path], None] | None = None  # removes what an earlier deploy of it wrote into shared files
    requires: tuple = ()  # what it needs of a folder (gpt2onnx.capabilities: Need, Lacks), before anything is written
    carries_adapters: bool = False  # it writes a folder's switchable LoRA adapter files where its runtime reads them

    @property
    def declared(self) -> Declared:
        adapters = () if self.carries_adapters else (DROPS_ADAPTERS,)
        return Declared("target", self.name, f"--target {self.name}", requires=(*self.requires, *adapters))


# a target that does not carry switchable adapters would serve the base alone: refused, not silently dropped
DROPS_ADAPTERS = Need(
    "adapter_files",
    allowed={False},
    why="deploys the base graph without its switchable LoRA adapters",
    fix="export the adapter merged for this target (gpt2onnx export --adapter DIR)",
)


@dataclass(frozen=True)
class NoOptions:
    """A target without options of its own."""
