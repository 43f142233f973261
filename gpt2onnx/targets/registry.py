"""What a deployment target is to gpt2onnx, and the registry of targets: adding one is one new module plus one line
in TARGETS.

A target is one module under ``gpt2onnx.targets`` that defines ``SPEC``, a :class:`TargetSpec`: its name, the
top-level paths it adds to a folder, the targets it builds on, its typed options (a frozen dataclass validated when
it is built, whose field names are :func:`~gpt2onnx.targets.deploy.deploy`'s keywords) and
``write(deployment, options) -> Written``: the files it wrote into the staged folder and, where it keeps one, its
record for the manifest. ``deploy`` stages the folder once and calls each target asked for, in this registry's order.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gpt2onnx.artifact.folder import ModelFolder
from gpt2onnx.capabilities import Declared, Need
from gpt2onnx.errors import BadInput

# name → the module that defines its SPEC, in the order they are written (a target after those it needs)
TARGETS = {
    "genai": "gpt2onnx.targets.genai",
    "transformers-js": "gpt2onnx.targets.transformers_js",
    "triton": "gpt2onnx.targets.triton",
    "ort-generate": "gpt2onnx.targets.ort_generate",
    "mobile": "gpt2onnx.targets.mobile",
    "web": "gpt2onnx.targets.web",
    "server": "gpt2onnx.targets.server_image",
}


@dataclass(frozen=True)
class Deployment:
    """What every target writes from: the folder deployed (opened: its files checked, its manifest read), the
    staged new folder (the source's own files already in it) and the new folder's name."""

    source: ModelFolder
    staging: Path
    name: str  # the deployed folder's own name: the page's title, Triton's default model name


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


def target_spec(name: str) -> TargetSpec:
    if name not in TARGETS:
        raise BadInput(f"unknown deploy target {name}: choose from {', '.join(TARGETS)}")
    return importlib.import_module(TARGETS[name]).SPEC


def target_specs() -> list[TargetSpec]:
    """Every registered target, in the registry's order."""
    return [target_spec(name) for name in TARGETS]


def parse_targets(value: str | list[str]) -> list[TargetSpec]:
    """'genai,triton' (or a list) → the targets, with those they need, in the registry's order."""
    items = value.split(",") if isinstance(value, str) else [p for v in value for p in v.split(",")]
    spelled = {item.strip().lower().replace("_", "-") for item in items if item.strip()}
    specs = target_specs()
    names = {next((s.name for s in specs if n in s.aliases), n) for n in spelled}
    unknown = names - set(TARGETS)
    if unknown or not names:
        raise BadInput(
            f"unknown deploy target {', '.join(sorted(unknown)) or '(none)'}: choose from {', '.join(TARGETS)}"
        )
    for spec in specs[::-1]:  # a target's needs come earlier in the registry
        if spec.name in names:
            names.update(spec.needs)
    return [s for s in specs if s.name in names]


@dataclass(frozen=True)
class TargetOptions:
    """The options of the targets asked for, each built (and so validated) once by its target's options class."""

    by_target: dict[str, Any] = field(default_factory=dict)

    def of(self, spec: TargetSpec) -> Any:
        return self.by_target.get(spec.name, NoOptions())


def target_options(chosen: list[TargetSpec], given: dict[str, Any]) -> TargetOptions:
    """deploy()'s keywords (``given``, by name) as each chosen target's options. A keyword no target knows is
    refused, and so is one of a target not asked for that differs from its default (it would be ignored)."""
    fields = {f.name: (s, f.default) for s in target_specs() if s.options for f in dataclasses.fields(s.options)}
    owners = {key: spec for key, (spec, _) in fields.items()}
    for key, value in given.items():
        if key not in owners:
            raise BadInput(f"unknown deploy option '{key}': the targets take {', '.join(sorted(owners)) or 'none'}")
        if owners[key] not in chosen and value != fields[key][1]:
            flag = "--" + key.replace("_", "-")
            raise BadInput(f"{flag} applies to the {owners[key].name} target: add it to --target, or drop {flag}")
    return TargetOptions(
        {
            s.name: s.options(**{k: v for k, v in given.items() if owners[k] is s})
            for s in chosen
            if s.options is not None
        }
    )
