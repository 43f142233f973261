"""What a K/V cache layout declares: one :class:`CacheLayout` per module of this package, listed in
:mod:`gpt2onnx.layouts.all_layouts`. A layout is how past and present are laid out and bound: a new tensor each
step (concat), or one preallocated buffer per layer bound as both and written in place (shared, static). Each
declares the ops that tell it in a graph, the rewrite that makes it from a fusion profile's attention op, the
stepper binding that runs it (:mod:`gpt2onnx.runtimes.decoder` maps each binding to its stepper), and its
capabilities (:mod:`gpt2onnx.capabilities`): what it ensures and what it needs of the provider and the rest.

The IO contract of a buffer layout (the names its dims take; the caller's side in the steppers):

- buffer: [batch, n_head, M, head_dim] per layer K and V, M = past_buffer_length ≥ the mask's width T for every
  step of the sequence (prompt + new tokens, or the whole context); the same array bound as past_key_values.{i}.*
  and present.{i}.* (IO binding), so the graph writes it in place;
- attention_mask: [batch, T] (total_sequence_length), left-padded as everywhere: buffer column j holds the K/V of
  mask column j in every row; columns T..M - 1 are never read (the graph masks them), whatever they hold;
- write positions: no input. A step of S tokens writes columns [T - S, T) of every row, computed in the graph from
  the mask's and input_ids' widths, so the caller passes what it passes for any layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import onnx
from onnx import helper

from gpt2onnx.capabilities import FACTS, Declared, Need

CACHE_FACTS = ("cache_grows", "cache_in_place", "host_buffers", "quantizable_cache")  # what every layout says
PAST_BUFFER = "past_buffer_length"
PRESENT_BUFFER = "present_buffer_length"
MASK_WIDTH = "total_sequence_length"
MASK = "attention_mask"

# How a stepper binds the cache (gpt2onnx.runtimes.decoder.STEPPERS): the past a step is given is the presents of
# the last, a new tensor each step; one buffer per layer for the whole sequence, allocated for its length (the
# kernel reads how far it is filled from the mask); one fixed-size buffer per layer, the presents views of it
GROWING, SHARED_BUFFER, STATIC_BUFFER = "growing", "shared-buffer", "static-buffer"
BINDINGS = (GROWING, SHARED_BUFFER, STATIC_BUFFER)


@dataclass(frozen=True)
class CacheLayout:
    """One K/V cache layout.

    name: the manifest's ``kv_cache`` value.
    summary: one line for the docs and the help.
    binding: how a stepper binds it (one of BINDINGS).
    marks: the op types that tell it in a graph (subgraphs included); none for the plain layout.
    rewrite: the graph pass that makes it from ``reads``, the attention op a fusion profile writes: ModelProto →
        (the same ModelProto, the number of attention nodes rewritten); None for the plain layout.
    keeps_reads: its graph still holds the op it reads (False: the rewrite replaces every one).
    check: the name of its rewrite's golden count in a fusion report; ``makes``: the op it writes and how many
        per layer (its golden count).
    opset: the ai.onnx opset its ops need (0: any).
    ensures, requires, says: its capabilities (gpt2onnx.capabilities.Declared).
    """

    name: str
    summary: str
    binding: str
    marks: frozenset[str] = frozenset()
    rewrite: Callable[[onnx.ModelProto], tuple[onnx.ModelProto, int]] | None = None
    reads: tuple[str, str] | None = None
    keeps_reads: bool = True
    check: str | None = None
    makes: tuple[tuple[str, str], int] | None = None
    opset: int = 0
    ensures: Mapping[str, object] = field(default_factory=dict)
    requires: tuple = ()
    says: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.binding not in BINDINGS:
            raise ValueError(f"layout {self.name}: binding '{self.binding}' is not one of {BINDINGS}")
        object.__setattr__(self, "ensures", MappingProxyType(dict(self.ensures)))
        object.__setattr__(self, "says", MappingProxyType(dict(self.says)))

    @property
    def in_place(self) -> bool:
        """Past and present are one buffer, written in place (genai: past_present_share_buffer)."""
        return self.binding != GROWING

    @property
    def declared(self) -> Declared:
        """Its capabilities: every cache fact (its own, else the fact's default, so that a message names the layout
        as what makes it), the op it writes, its needs."""
        ops = {self.makes[0]} if self.makes else set()
        facts = {key: self.ensures.get(key, FACTS[key].default) for key in CACHE_FACTS}
        return Declared("layout", self.name, ensures={"ops": ops, **facts}, requires=self.requires, says=self.says)


# What every buffer layout needs: its stepper binds numpy buffers, so it runs where tensors live in host memory
HOST_MEMORY = Need(
    "device_memory", allowed={False}, why="runs on the host only (its stepper binds host-memory buffers)"
)


def attribute(node: onnx.NodeProto, name: str, default=None):
    """A node's attribute value by name, else ``default``."""
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _rename_dim(value: onnx.ValueInfoProto, axis: int, name: str) -> None:
    dim = value.type.tensor_type.shape.dim[axis]
    dim.Clear()
    dim.dim_param = name


def name_buffer_io(graph: onnx.GraphProto, rewritten: set[str]) -> None:
    """The IO of a graph whose pasts and presents are preallocated buffers: their length dims and the mask's width
    take the buffer contract's names (the module's docstring), and the value infos of the rewritten attention
    outputs (``rewritten``), typed for the op they replaced, are dropped."""
    for value in graph.input:
        if value.name.startswith("past_key_values."):
            _rename_dim(value, 2, PAST_BUFFER)
        elif value.name == MASK:
            _rename_dim(value, 1, MASK_WIDTH)
    for value in graph.output:
        if value.name.startswith("present."):
            _rename_dim(value, 2, PRESENT_BUFFER)
    kept = [v for v in graph.value_info if v.name not in rewritten]
    del graph.value_info[:]
    graph.value_info.extend(kept)
