"""Every K/V cache layout, by name: a new one is a module beside this one and a line here. The rest of the package
asks this table (which layout a graph has, what it needs, the stepper binding that runs it)."""

from __future__ import annotations

from collections.abc import Iterable

from gpt2onnx.errors import BadInput
from gpt2onnx.layouts import concat, shared, static
from gpt2onnx.layouts.layout import CacheLayout
from gpt2onnx.registry import Registry

LAYOUTS: Registry[CacheLayout] = Registry("K/V cache layout", (concat.LAYOUT, shared.LAYOUT, static.LAYOUT))
PLAIN = concat.LAYOUT  # what a graph is without a layout's marks


def layout(name: str) -> CacheLayout:
    return LAYOUTS.lookup(name)


def layout_of(op_types: Iterable[str]) -> CacheLayout:
    """The layout of a graph from its op types (subgraphs included), never from a manifest: the one whose marks it
    holds, else the plain layout."""
    ops = set(op_types)
    found = [layout for layout in LAYOUTS.values() if layout.marks & ops]
    if len(found) > 1:
        raise BadInput(f"the graph holds the ops of two K/V cache layouts ({', '.join(f.name for f in found)})")
    return found[0] if found else PLAIN


def bound_by(binding: str) -> CacheLayout | None:
    """The registered layout a stepper binding runs (None: no layout registered with it)."""
    return next((layout for layout in LAYOUTS.values() if layout.binding == binding), None)
