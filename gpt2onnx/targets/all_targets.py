"""Every deployment target, by name, in the order they are written (a target after those it needs): a new one is a
module beside this one and a line here. The rest of the package asks this table: --target's choices and spellings,
each target's options as deploy()'s keywords."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from gpt2onnx.errors import BadInput
from gpt2onnx.registry import Registry
from gpt2onnx.targets import genai, mobile, ort_generate, server_image, transformers_js, triton, web
from gpt2onnx.targets.target import NoOptions, TargetSpec

TARGETS: Registry[TargetSpec] = Registry(
    "deploy target",
    (
        genai.SPEC,
        transformers_js.SPEC,
        triton.SPEC,
        ort_generate.SPEC,
        mobile.SPEC,
        web.SPEC,
        server_image.SPEC,
    ),
    option="--target",
)


def target_spec(name: str) -> TargetSpec:
    return TARGETS.lookup(name)


def target_specs() -> list[TargetSpec]:
    """Every registered target, in the registry's order."""
    return list(TARGETS.values())


def owned_paths() -> frozenset[str]:
    """The top-level paths the registered targets add to a folder (what a deployment of one is not the source's)."""
    return frozenset(path for spec in TARGETS.values() for path in spec.paths)


def parse_targets(value: str | list[str]) -> list[TargetSpec]:
    """'genai,triton' (or a list) → the targets, with those they need, in the registry's order."""
    items = value.split(",") if isinstance(value, str) else [p for v in value for p in v.split(",")]
    spelled = {item.strip().lower().replace("_", "-") for item in items if item.strip()}
    specs = target_specs()
    names = {next((s.name for s in specs if n in s.aliases), n) for n in spelled}
    unknown = names - set(TARGETS)
    if unknown or not names:
        raise TARGETS.refusal(", ".join(sorted(unknown)) or "(none)")
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
