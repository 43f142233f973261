"""What a fusion profile declares: one :class:`Profile` per module of this package, listed in
:mod:`gpt2onnx.profiles.all_profiles`. A profile is the fusions applied in order (each named by the rule set it
applies, which :mod:`gpt2onnx.passes.fusions` holds, and the ops it writes), the cache layout it makes
(:mod:`gpt2onnx.layouts`: its rewrite runs after the rules), the opset its ops need, the ops that tell it in a
graph, the profile whose fused graph it may be made from, and its golden counts: what it ensures, checked after
every fusion (gpt2onnx.passes.fusions.fuse). Its capabilities (:attr:`Profile.declared`) are the ops it writes, its
layout's facts and needs, and its own needs.

A profile is data: this room imports no rule (onnxscript's rewriter takes a second to import), so that every layer
that asks what a profile is (help, the resolver, a run on a folder) reads it without the rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpt2onnx.capabilities import Declared, Need
from gpt2onnx.layouts import concat
from gpt2onnx.layouts.layout import CacheLayout

MS = "com.microsoft"
ATTENTION_FUSION = (
    "attention"  # the name of a profile's attention fusion (the rewrite before which shapes are anchored)
)
LAYER_NORM_OP = ("", "LayerNormalization")
SKIP_LAYER_NORM_OP = (MS, "SkipLayerNormalization")


@dataclass(frozen=True)
class Fusion:
    """One fusion: its name (the key of its count in a fusion report), its rule set ("module:NAME": the tuple NAME
    of onnxscript rewrite rules in a module of gpt2onnx.passes.fusions) and the ops it writes."""

    name: str
    rules: str
    produces: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Golden:
    """A golden count: check ``name`` counts the nodes of ``ops`` (any of them), expected ``per_layer`` × n_layer +
    ``extra``. ``ops`` None: the gelu check, whose op the activation decides (Profile.gelu_ops)."""

    name: str
    ops: tuple[tuple[str, str], ...] | None
    per_layer: int = 1
    extra: int = 0


@dataclass(frozen=True)
class Profile:
    """One fusion profile.

    name: what --fusion takes, the manifest's fusion.profile.
    summary: one line for the help and the docs.
    fusions: applied in order; golden: what the whole profile must reach (its layout's count is added).
    gelu_ops: the op its gelu fusion makes of each activation (the export module's canonical names); an activation
        it has none for has no gelu check.
    layout: the K/V cache layout it makes (its rewrite runs after the rules).
    opset: the ai.onnx opset its ops need (the graph is converted up to it first; the layout's may be higher).
    marks: ops that tell a graph fused with it (a profile registered later wins: the one that builds on another).
    base: the profile whose fused graph it can be made from (optimize fuses over it).
    requires, says: its own capabilities beside its layout's (gpt2onnx.capabilities).
    """

    name: str
    summary: str
    fusions: tuple[Fusion, ...] = ()
    golden: tuple[Golden, ...] = ()
    gelu_ops: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    layout: CacheLayout = concat.LAYOUT
    opset: int = 0
    marks: frozenset[tuple[str, str]] = frozenset()
    base: Profile | None = None
    requires: tuple = ()
    says: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gelu_ops", MappingProxyType(dict(self.gelu_ops)))
        object.__setattr__(self, "says", MappingProxyType(dict(self.says)))

    @property
    def min_opset(self) -> int:
        return max(self.opset, self.layout.opset)

    @property
    def attention(self) -> Fusion | None:
        """Its attention fusion (the one its layout's rewrite reads the ops of: where that rewrite stops, this
        one's rules are the reason); None without one."""
        return next((f for f in self.fusions if f.name == ATTENTION_FUSION), None)

    def golden_counts(self, n_layer: int, activation: str = "gelu_new") -> dict[str, tuple[tuple, int]]:
        """What the whole profile must reach: {check name: ((domain, op), ...), expected count}. A layout that
        replaces the attention op it reads drops that op's check; one without a fused op for the activation has
        no gelu check."""
        counts = {}
        for golden in self.golden:
            ops = golden.ops
            if ops is None:
                op = self.gelu_ops.get(activation)
                if op is None:
                    continue
                ops = (op,)
            if self.layout.rewrite is not None and not self.layout.keeps_reads and ops == (self.layout.reads,):
                continue
            counts[golden.name] = (ops, golden.per_layer * n_layer + golden.extra)
        if self.layout.makes is not None:
            op, per_layer = self.layout.makes
            counts[self.layout.check] = ((op,), per_layer * n_layer)
        return counts

    @property
    def produces(self) -> frozenset[tuple[str, str]]:
        """Every op its fusions and its layout may write."""
        ops = {op for f in self.fusions for op in f.produces}
        if self.layout.makes is not None:
            ops.add(self.layout.makes[0])
            if not self.layout.keeps_reads:
                ops.discard(self.layout.reads)
        return frozenset(ops)

    @property
    def declared(self) -> Declared:
        """Its capabilities: the ops it writes (those its golden counts name), its layout's facts and needs, its
        own needs."""
        ops = {op for ops, _ in self.golden_counts(1).values() for op in ops}
        fused = bool(self.fusions) or self.layout.rewrite is not None
        requires = [*self.layout.requires, *self.requires]
        if fused:  # optimize: made from an unfused graph, its own, or its base's (fuse() refuses the others too)
            made_from = {None, self.name, *([self.base.name] if self.base else [])}
            rewrites = frozenset(made_from - {self.name})  # the sources it rewrites (its own: a no-op)
            requires += [
                Need(
                    "source_activations",
                    allowed={"float32"},
                    when={"source_profile": rewrites},
                    why="matches the patterns of fp32 graphs (fp16's casts break them)",
                    fix="optimize the fp32 folder it was made from",
                ),
                Need(
                    "source_body_in_if",
                    allowed={False},
                    when={"source_profile": rewrites},
                    why="rewrites the top-level graph",
                    fix="optimize the fp32 folder it was made from, with its --quantize and --prompt-kernel",
                ),
            ]
            requires.append(
                Need(
                    "source_profile",
                    allowed=made_from,
                    why="fuses an unfused graph, or one fused with itself"
                    + (f" or with {self.base.name}" if self.base else ""),
                    fix="start from the unfused export, or keep the folder's own profile (--fusion {value})",
                )
            )
        return Declared(
            "profile",
            self.name,
            f"--fusion {self.name}",
            ensures={
                **self.layout.declared.ensures,
                "ops": ops | set(self.layout.declared.ensures["ops"]),
                "profile": self.name if fused else None,
                # a fused attention op sums inside its kernel, which the batch-invariance pass cannot align (an
                # unfused graph's own facts say whether the pass aligned it)
                **({"padding_dependent": True} if self.attention is not None else {}),
            },
            requires=tuple(requires),
            says={**self.layout.says, **self.says, "profile": f"is fused with the {self.name} profile"},
        )


# The fusions profiles compose (their rules in gpt2onnx.passes.fusions, one file each)
LAYER_NORM = Fusion("layer_norm", "layer_norm:RULES", (LAYER_NORM_OP,))
ATTENTION = Fusion(ATTENTION_FUSION, "attention:RULES", ((MS, "MultiHeadAttention"),))
ONNX_ATTENTION = Fusion(ATTENTION_FUSION, "onnx_attention:RULES", (("", "Attention"),))
# the activation's fused op: tanh GELU → FastGelu, exact GELU → Gelu, quick GELU → QuickGelu (com.microsoft)
FAST_GELU = Fusion("gelu", "gelu:FAST_GELU_RULES", ((MS, "FastGelu"), (MS, "Gelu"), (MS, "QuickGelu")))
STANDARD_GELU = Fusion("gelu", "gelu:STANDARD_GELU_RULES", (("", "Gelu"),))  # both GELUs → the standard Gelu
SKIP_LAYER_NORM = Fusion("skip_layer_norm", "skip_layer_norm:RULES", (SKIP_LAYER_NORM_OP,))
# what a contrib profile's gelu fusion makes of each activation, and a standard one's (relu, silu, tanh have none)
CONTRIB_GELU_OPS = {"gelu_new": (MS, "FastGelu"), "gelu": (MS, "Gelu"), "quick_gelu": (MS, "QuickGelu")}
STANDARD_GELU_OPS = {"gelu_new": ("", "Gelu"), "gelu": ("", "Gelu")}
