"""Profiles of fusions, applied in order, with a count per fusion and golden counts as a guard.

- none: nothing.
- ort: layer_norm, attention, gelu, skip_layer_norm → MultiHeadAttention, FastGelu, SkipLayerNormalization
  (com.microsoft); golden for n_layer = L: L attention, L GELU, 2L + 1 LayerNorm-type.
- ort-shared-kv: ort's, then shared_kv → GroupQueryAttention, FastGelu, SkipLayerNormalization; golden:
  L GroupQueryAttention, no MultiHeadAttention, L GELU, 2L + 1 LayerNorm-type.
- portable: layer_norm, gelu (standard Gelu, opset 20) → LayerNormalization, Gelu; golden: 2L + 1
  LayerNormalization, L Gelu.
- tensorrt: layer_norm → LayerNormalization (opset 17); golden: 2L + 1 LayerNormalization.
- onnx: layer_norm, attention (the standard Attention, opset 23), gelu (standard Gelu) → LayerNormalization,
  Attention, Gelu, no com.microsoft op; golden: L Attention, 2L + 1 LayerNormalization, L Gelu.
- onnx-static-kv: onnx's at opset 24, then static_kv → each Attention reads one fixed-size K/V buffer per layer
  that two TensorScatter nodes update in place; golden: L Attention, 2L TensorScatter, 2L + 1
  LayerNormalization, L Gelu.

The tensorrt profile stays in the standard domain (TensorRT's parser takes no com.microsoft op) and below
opset 20; TensorRT fuses GELU and attention itself, and 10.16 rejects an opset-23 Attention with present K/V.

ort-shared-kv is ort with its MultiHeadAttention nodes rewritten into GroupQueryAttention (shared_kv.py), whose
past and present can be one preallocated buffer per layer, written in place (the runtime's SharedCacheDecoder).
onnxruntime runs it on the CPU provider only (CUDA's GroupQueryAttention has no fp32 kernel and no attention_bias).

onnx-static-kv is the same idea in standard ONNX (static_kv.py): TensorScatter writes each step's K/V into the
buffer at the mask's write column, Attention reads the whole buffer under the mask padded to its length (the
runtime's StaticCacheDecoder binds the buffer as past and present).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass

import onnx
import onnx_ir as ir
import onnxscript.optimizer
from onnxscript.rewriter import pattern

from gpt2onnx.artifact.graph_tools import infer_value_info
from gpt2onnx.artifact.manifest import FusionReport, GoldenCount
from gpt2onnx.errors import BadInput, CheckFailed, ContractError
from gpt2onnx.passes.fusions.attention import attention_div_rule, attention_split_scale_rule
from gpt2onnx.passes.fusions.gelu import (
    erf_gelu_rule,
    fast_gelu_rule,
    fast_gelu_with_bias_rule,
    quick_gelu_rule,
    standard_erf_gelu_rule,
    standard_gelu_rule,
)
from gpt2onnx.passes.fusions.layer_norm import layer_norm_rule
from gpt2onnx.passes.fusions.onnx_attention import (
    ATTENTION_OPSET,
    onnx_attention_div_rule,
    onnx_attention_split_scale_rule,
)
from gpt2onnx.passes.fusions.shape_anchoring import anchor_shapes
from gpt2onnx.passes.fusions.shared_kv import share_kv_cache
from gpt2onnx.passes.fusions.skip_layer_norm import (
    layer_norm_before_reshape_rule,
    skip_layer_norm_rule,
    skip_layer_norm_with_bias_rule,
)
from gpt2onnx.passes.fusions.static_kv import STATIC_KV_OPSET, static_kv_cache

log = logging.getLogger(__name__)

PROFILES = ("none", "ort", "ort-shared-kv", "portable", "tensorrt", "onnx", "onnx-static-kv")
MS = "com.microsoft"


@dataclass(frozen=True)
class Fusion:
    name: str
    rules: tuple
    produces: tuple[tuple[str, str], ...]  # (domain, op_type) the fusion creates


LAYER_NORM = Fusion("layer_norm", (layer_norm_rule,), (("", "LayerNormalization"),))
ATTENTION = Fusion("attention", (attention_div_rule, attention_split_scale_rule), ((MS, "MultiHeadAttention"),))
ONNX_ATTENTION = Fusion("attention", (onnx_attention_div_rule, onnx_attention_split_scale_rule), (("", "Attention"),))
# The activation's fused op: tanh GELU → FastGelu, exact GELU → Gelu, quick GELU → QuickGelu (com.microsoft); the
# portable profile: both GELUs → the standard Gelu. relu, silu and tanh have none (no golden check).
FAST_GELU = Fusion(
    "gelu",
    (fast_gelu_with_bias_rule, fast_gelu_rule, erf_gelu_rule, quick_gelu_rule),
    ((MS, "FastGelu"), (MS, "Gelu"), (MS, "QuickGelu")),
)
STANDARD_GELU = Fusion("gelu", (standard_gelu_rule, standard_erf_gelu_rule), (("", "Gelu"),))
# The op each profile's gelu fusion makes of each activation (the export module's canonical names).
GELU_OPS = {
    "ort": {"gelu_new": (MS, "FastGelu"), "gelu": (MS, "Gelu"), "quick_gelu": (MS, "QuickGelu")},
    "portable": {"gelu_new": ("", "Gelu"), "gelu": ("", "Gelu")},
}
GELU_OPS["ort-shared-kv"] = GELU_OPS["ort"]
GELU_OPS["onnx"] = GELU_OPS["onnx-static-kv"] = GELU_OPS["portable"]
SKIP_LAYER_NORM = Fusion(
    "skip_layer_norm",
    (layer_norm_before_reshape_rule, skip_layer_norm_with_bias_rule, skip_layer_norm_rule),
    ((MS, "SkipLayerNormalization"),),
)
# Not a pattern rule: a rewrite of every MultiHeadAttention node at once, after the rules (fuse() runs it).
SHARED_KV = Fusion("shared_kv", (), ((MS, "GroupQueryAttention"),))
# Not a pattern rule either: every standard Attention rewritten to read a fixed-size buffer (static_kv.py).
STATIC_KV = Fusion("static_kv", (), (("", "TensorScatter"),))

PROFILE_FUSIONS: dict[str, tuple[Fusion, ...]] = {
    "none": (),
    "ort": (LAYER_NORM, ATTENTION, FAST_GELU, SKIP_LAYER_NORM),
    "ort-shared-kv": (LAYER_NORM, ATTENTION, FAST_GELU, SKIP_LAYER_NORM, SHARED_KV),
    "portable": (LAYER_NORM, STANDARD_GELU),
    "tensorrt": (LAYER_NORM,),
    "onnx": (LAYER_NORM, ONNX_ATTENTION, STANDARD_GELU),
    "onnx-static-kv": (LAYER_NORM, ONNX_ATTENTION, STANDARD_GELU, STATIC_KV),
}
MIN_OPSET = {
    "none": 0,
    "ort": 17,
    "ort-shared-kv": 17,
    "portable": 20,
    "tensorrt": 17,
    "onnx": ATTENTION_OPSET,
    "onnx-static-kv": STATIC_KV_OPSET,
}


def golden_counts(
    profile: str, n_layer: int, activation: str = "gelu_new"
) -> dict[str, tuple[tuple[tuple[str, str], ...], int]]:
    """What a whole fusion must reach: {check name: ((domain, op), ...), expected count}. (ort-shared-kv also
    leaves no MultiHeadAttention: fuse() rewrites every one.) ``activation``: the MLP's (canonical name); one
    without a fused op in this profile has no gelu check."""
    counts = _golden_counts(profile, n_layer)
    if "gelu" in counts:
        op = GELU_OPS[profile].get(activation)
        if op is None:
            del counts["gelu"]
        else:
            counts["gelu"] = ((op,), n_layer)
    return counts


def _golden_counts(profile: str, n_layer: int) -> dict[str, tuple[tuple[tuple[str, str], ...], int]]:
    L = n_layer
    layer_norms = (("", "LayerNormalization"), (MS, "SkipLayerNormalization"))
    return {
        "none": {},
        "ort": {
            "attention": (((MS, "MultiHeadAttention"),), L),
            "gelu": (((MS, "FastGelu"),), L),
            "layer_norm": (layer_norms, 2 * L + 1),
        },
        "ort-shared-kv": {
            "shared_kv": (((MS, "GroupQueryAttention"),), L),
            "gelu": (((MS, "FastGelu"),), L),
            "layer_norm": (layer_norms, 2 * L + 1),
        },
        "portable": {"layer_norm": ((("", "LayerNormalization"),), 2 * L + 1), "gelu": ((("", "Gelu"),), L)},
        "tensorrt": {"layer_norm": ((("", "LayerNormalization"),), 2 * L + 1)},
        "onnx": {
            "attention": ((("", "Attention"),), L),
            "gelu": ((("", "Gelu"),), L),
            "layer_norm": ((("", "LayerNormalization"),), 2 * L + 1),
        },
        "onnx-static-kv": {
            "attention": ((("", "Attention"),), L),
            "static_kv": ((("", "TensorScatter"),), 2 * L),
            "gelu": ((("", "Gelu"),), L),
            "layer_norm": ((("", "LayerNormalization"),), 2 * L + 1),
        },
    }[profile]


def check_profile(profile: str) -> None:
    if profile not in PROFILES:
        raise BadInput(f"unknown fusion profile '{profile}': choose one of {', '.join(PROFILES)}")


def count_layers(model: onnx.ModelProto) -> int:
    pasts = [i.name for i in model.graph.input if re.fullmatch(r"past_key_values\.\d+\.key", i.name)]
    if not pasts:
        raise ContractError("the model has no past_key_values.{i}.key inputs: fusion needs a decoder with past")
    return len(pasts)


def _op_histogram(model: ir.Model) -> Counter:
    return Counter((node.domain or "", node.op_type) for node in model.graph)


def _upgrade_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    from onnx import version_converter

    current = next((i.version for i in model.opset_import if i.domain in ("", "ai.onnx")), 0)
    if current >= opset:
        return model
    log.info("converting the model from opset %d to %d", current, opset)
    try:
        return version_converter.convert_version(model, opset)
    except Exception as err:  # the converter raises several types for ops it cannot move
        raise BadInput(f"cannot convert the model from opset {current} to {opset} for this profile ({err})") from None


def _where_it_stopped(model: ir.Model, fusion: Fusion) -> str:
    """The node at which the fusion's best partial match stopped, and why (from onnxscript's tracer)."""
    tracer = pattern.MatchingTracer()
    pattern.RewriteRuleSet(list(fusion.rules), commute=True).apply_to_model(model, tracer=tracer)
    best = None
    for matches in tracer.best_matches_map.values():
        for info in matches:
            if best is None or info.score() > best.score():
                best = info
    if best is None:
        return "no node starts its pattern"
    reason = best.match_result.reason or "pattern mismatch"
    node = best.root_node
    return f"stopped matching at node '{node.name}' ({node.op_type}): {reason}"


def fused_with(model: onnx.ModelProto) -> str | None:
    """The profile whose fused ops the graph holds, read from its own ops: ort-shared-kv (GroupQueryAttention),
    ort (MultiHeadAttention, FastGelu, SkipLayerNormalization), onnx-static-kv (TensorScatter), onnx (the
    standard Attention), portable (the standard Gelu); None for a graph with none of them (an unfused export,
    and the tensorrt profile's, whose LayerNormalization torch writes too)."""
    ops = {(n.domain or "", n.op_type) for n in model.graph.node}
    if (MS, "GroupQueryAttention") in ops:
        return "ort-shared-kv"
    if any(op in ops for op in ((MS, "MultiHeadAttention"), (MS, "SkipLayerNormalization"), *FAST_GELU.produces)):
        return "ort"
    if ("", "TensorScatter") in ops:
        return "onnx-static-kv"
    if ("", "Attention") in ops:
        return "onnx"
    if ("", "Gelu") in ops:
        return "portable"
    return None


# (profile the graph holds, profile asked for) pairs that fuse() runs: the asked profile's rules on a graph that
# holds the other's ops (ort-shared-kv rewrites ort's MultiHeadAttention). The same profile is a no-op; any other
# pair is refused in one line.
_REFUSABLE = "start from the unfused export (--fusion none), or keep the folder's own profile (--fusion {held})"
_FUSES_OVER = {("ort", "ort-shared-kv"), ("onnx", "onnx-static-kv")}


def _check_fused(held: str | None, profile: str) -> None:
    """Refuse a profile that cannot be applied to a graph already fused with ``held``."""
    if held is None or held == profile or (held, profile) in _FUSES_OVER:
        return
    what = {
        "ort-shared-kv": "a shared K/V cache (GroupQueryAttention)",
        "ort": "com.microsoft ops from the ort profile",
        "portable": "the portable profile's standard Gelu",
        "onnx": "the standard Attention op from the onnx profile",
        "onnx-static-kv": "a fixed-size K/V cache (TensorScatter)",
    }[held]
    raise BadInput(
        f"the model already has {what}, which the {profile} profile cannot be made from: "
        + _REFUSABLE.format(held=held)
    )


def _already_fused(model: onnx.ModelProto, profile: str, n_layer: int, activation: str) -> FusionReport:
    """The report of a profile on a graph it has fused already: nothing applied, its ops counted as they are."""
    graph = ir.from_proto(model)
    histogram = _op_histogram(graph)
    golden = {}
    for check, (ops, expected) in golden_counts(profile, n_layer, activation).items():
        found = sum(histogram[op] for op in ops)
        golden[check] = GoldenCount(expected, found, ["::".join(filter(None, op)) for op in ops])
    produced = {op for f in PROFILE_FUSIONS[profile] for op in f.produces}
    op_counts = {"::".join(filter(None, key)): n for key, n in sorted(histogram.items()) if key in produced}
    partial = [f"fusion '{c}' has {g.found} of {g.expected} ops" for c, g in golden.items() if g.found < g.expected]
    return FusionReport(profile, {f.name: 0 for f in PROFILE_FUSIONS[profile]}, op_counts, golden, partial)


def fuse(
    model: onnx.ModelProto, profile: str, *, allow_partial: bool = False, activation: str = "gelu_new"
) -> tuple[onnx.ModelProto, FusionReport]:
    """Apply a profile's fusions in order; fail below the golden counts unless ``allow_partial``. A graph that
    already holds the profile's fused ops comes back as it is (fusing what is fused is a no-op). ``activation``:
    the MLP's (the Architecture's canonical name), which fixes the gelu check's op."""
    check_profile(profile)
    n_layer = count_layers(model)
    if profile == "none":
        return model, FusionReport(profile, {}, {}, {})
    held = fused_with(model)
    _check_fused(held, profile)
    if held == profile:
        log.info("the model is already fused with the %s profile: nothing to fuse", profile)
        return model, _already_fused(model, profile, n_layer, activation)
    model = _upgrade_opset(model, MIN_OPSET[profile])
    ir_version = model.ir_version
    if any(f is ATTENTION or f is ONNX_ATTENTION for f in PROFILE_FUSIONS[profile]):
        model, anchored = anchor_shapes(model)
        log.info("re-anchored %d intermediate shape reads on the graph inputs", anchored)
    known = list(model.graph.value_info)  # a fused graph's contrib ops are typed by the pass that fused them only
    infer_value_info(model)
    inferred = {v.name for v in model.graph.value_info}
    model.graph.value_info.extend(v for v in known if v.name not in inferred)
    graph = ir.from_proto(model)
    # Small constant subgraphs (the SDPA scale, shape arithmetic) become constants the rules can read.
    onnxscript.optimizer.fold_constants(graph, input_size_limit=1024, output_size_limit=1024)
    applied = {}
    for fusion in PROFILE_FUSIONS[profile]:
        if fusion is SHARED_KV or fusion is STATIC_KV:
            continue  # on the proto, after the rules
        count = pattern.RewriteRuleSet(list(fusion.rules), commute=True).apply_to_model(graph)
        applied[fusion.name] = applied.get(fusion.name, 0) + count
        log.info("fusion %s: %d rewrites", fusion.name, count)
    onnxscript.optimizer.remove_unused_nodes(graph)
    if SHARED_KV in PROFILE_FUSIONS[profile]:
        proto = ir.to_proto(graph)
        proto, applied[SHARED_KV.name] = share_kv_cache(proto)
        log.info("fusion %s: %d rewrites", SHARED_KV.name, applied[SHARED_KV.name])
        graph = ir.from_proto(proto)
    if STATIC_KV in PROFILE_FUSIONS[profile]:
        proto = ir.to_proto(graph)
        proto, applied[STATIC_KV.name] = static_kv_cache(proto)
        log.info("fusion %s: %d rewrites", STATIC_KV.name, applied[STATIC_KV.name])
        graph = ir.from_proto(proto)
    histogram = _op_histogram(graph)
    golden, partial = {}, []
    for check, (ops, expected) in golden_counts(profile, n_layer, activation).items():
        found = sum(histogram[op] for op in ops)
        golden[check] = GoldenCount(expected, found, ["::".join(filter(None, op)) for op in ops])
        if found < expected:
            fusion = next(f for f in PROFILE_FUSIONS[profile] if f.name == check)
            # shared_kv and static_kv rewrite the attention fusion's nodes: where that one stopped is the reason
            where = _where_it_stopped(
                graph, ATTENTION if fusion is SHARED_KV else ONNX_ATTENTION if fusion is STATIC_KV else fusion
            )
            partial.append(
                f"fusion '{check}' reached {found} of {expected} {'/'.join(op for _, op in ops)} ops: {where}"
            )
    if partial and not allow_partial:
        raise CheckFailed(partial[0] + "; allow a partly fused graph (--allow-partial-fusion) to keep it")
    for message in partial:
        log.warning("%s", message)
    op_counts = {
        "::".join(filter(None, key)): n
        for key, n in sorted(histogram.items())
        if key in {op for f in PROFILE_FUSIONS[profile] for op in f.produces}
    }
    fused = ir.to_proto(graph)
    # the source's IR version, or the first that has the profile's opset (11 for 23, 12 for 24): onnx-ir writes a
    # newer one than onnxruntime 1.31 reads, and the opset converter leaves the old one
    needed = onnx.helper.find_min_ir_version_for(list(fused.opset_import), ignore_unknown=True)
    fused.ir_version = max(ir_version, needed)
    return fused, FusionReport(profile, applied, op_counts, golden, partial)
