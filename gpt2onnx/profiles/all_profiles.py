"""Every fusion profile, by name: a new one is a module beside this one and a line here, after any profile it builds
on. The rest of the package asks this table (what --fusion takes, which profile a graph holds, what a profile
needs and ensures) instead of naming a profile."""

from __future__ import annotations

from collections.abc import Iterable

from gpt2onnx.profiles import none, onnx_ops, onnx_static_kv, ort, ort_shared_kv, portable, tensorrt
from gpt2onnx.profiles.profile import Profile
from gpt2onnx.registry import Registry

PROFILES: Registry[Profile] = Registry(
    "fusion profile",
    (
        none.PROFILE,
        ort.PROFILE,
        ort_shared_kv.PROFILE,
        portable.PROFILE,
        tensorrt.PROFILE,
        onnx_ops.PROFILE,
        onnx_static_kv.PROFILE,
    ),
    option="--fusion",
)
UNFUSED = none.PROFILE  # export's default
OPTIMIZE_DEFAULT = ort.PROFILE  # optimize's, where the source holds no profile


def profile(name: str) -> Profile:
    """A profile by what --fusion takes; BadInput naming the choices for another name."""
    return PROFILES.lookup(name)


def fused_with(ops: Iterable[tuple[str, str]]) -> Profile | None:
    """The profile a graph holds, told by its ops ((domain, op type), subgraphs included): the last registered
    whose marks it has (a profile that builds on another is registered after it); None for a graph with none
    (an unfused export, or the tensorrt profile's, whose LayerNormalization torch writes too)."""
    found = set(ops)
    return next((p for p in reversed(PROFILES.values()) if p.marks & found), None)


def help_line() -> str:
    """--fusion's choices besides the default, for the help, a profile that builds on another written with it:
    "ort[-shared-kv], portable, ..."."""
    shown = []
    for p in PROFILES.values():
        if p is UNFUSED or (p.base is not None and p.name.startswith(p.base.name)):
            continue
        extensions = [q.name[len(p.name) :] for q in PROFILES.values() if q.base is p and q.name.startswith(p.name)]
        shown.append(p.name + "".join(f"[{e}]" for e in extensions))
    return ", ".join(shown)
