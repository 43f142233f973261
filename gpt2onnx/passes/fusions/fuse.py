"""Applying a fusion profile (gpt2onnx.profiles): its rules in order, then its cache layout's rewrite, with
a count per fusion and the profile's golden counts as a guard; a graph already fused with the profile comes back as
it is, and one fused with a profile it cannot be made from is refused in one line."""

from __future__ import annotations

import importlib
import logging
import re
from collections import Counter

import onnx
import onnx_ir as ir
import onnxscript.optimizer
from onnxscript.rewriter import pattern

from gpt2onnx.artifact.graph import all_nodes
from gpt2onnx.artifact.graph_tools import infer_value_info
from gpt2onnx.artifact.manifest import FusionReport, GoldenCount
from gpt2onnx.errors import BadInput, CheckFailed, ContractError
from gpt2onnx.passes.batch_invariance import strip as strip_batch_invariance
from gpt2onnx.passes.fusions.shape_anchoring import anchor_shapes
from gpt2onnx.profiles.all_profiles import UNFUSED, fused_with
from gpt2onnx.profiles.profile import Fusion, Profile

log = logging.getLogger(__name__)


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


def rule_set(fusion: Fusion) -> tuple:
    """The rewrite rules a profile's fusion names ("module:NAME" in this package)."""
    module, name = fusion.rules.split(":")
    return tuple(getattr(importlib.import_module(f"gpt2onnx.passes.fusions.{module}"), name))


def _where_it_stopped(model: ir.Model, fusion: Fusion) -> str:
    """The node at which the fusion's best partial match stopped, and why (from onnxscript's tracer)."""
    tracer = pattern.MatchingTracer()
    pattern.RewriteRuleSet(list(rule_set(fusion)), commute=True).apply_to_model(model, tracer=tracer)
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


def graph_profile(model: onnx.ModelProto) -> Profile | None:
    """The profile whose fused ops the graph holds (subgraphs included), read from its own ops."""
    return fused_with(("" if n.domain == "ai.onnx" else n.domain, n.op_type) for n in all_nodes(model.graph))


def _check_fused(held: Profile | None, profile: Profile) -> None:
    """Refuse a profile that cannot be applied to a graph already fused with ``held``: only the same profile (a
    no-op) and one that builds on it (its base) can."""
    if held is None or held is profile or profile.base is held:
        return
    raise BadInput(
        f"the model is already fused with the {held.name} profile ({held.summary}), which the {profile.name} profile"
        f" cannot be made from: start from the unfused export (--fusion {UNFUSED.name}), or keep the folder's own"
        f" profile (--fusion {held.name})"
    )


def _golden(histogram: Counter, profile: Profile, n_layer: int, activation: str) -> dict[str, GoldenCount]:
    golden = {}
    for check, (ops, expected) in profile.golden_counts(n_layer, activation).items():
        found = sum(histogram[op] for op in ops)
        golden[check] = GoldenCount(expected, found, ["::".join(filter(None, op)) for op in ops])
    return golden


def _op_counts(histogram: Counter, profile: Profile) -> dict[str, int]:
    produced = {op for f in profile.fusions for op in f.produces} | set(profile.produces)
    return {"::".join(filter(None, key)): n for key, n in sorted(histogram.items()) if key in produced}


def _already_fused(model: onnx.ModelProto, profile: Profile, n_layer: int, activation: str) -> FusionReport:
    """The report of a profile on a graph it has fused already: nothing applied, its ops counted as they are."""
    histogram = _op_histogram(ir.from_proto(model))
    golden = _golden(histogram, profile, n_layer, activation)
    partial = [f"fusion '{c}' has {g.found} of {g.expected} ops" for c, g in golden.items() if g.found < g.expected]
    applied = {f.name: 0 for f in profile.fusions} | ({profile.layout.check: 0} if profile.layout.check else {})
    return FusionReport(profile.name, applied, _op_counts(histogram, profile), golden, partial)


def fuse(
    model: onnx.ModelProto, profile: Profile, *, allow_partial: bool = False, activation: str = "gelu_new"
) -> tuple[onnx.ModelProto, FusionReport]:
    """Apply a profile's fusions in order, then its layout's rewrite; fail below the golden counts unless
    ``allow_partial``. A graph that already holds the profile's fused ops comes back as it is (fusing what is fused
    is a no-op). ``activation``: the MLP's (the Architecture's canonical name), which fixes the gelu check's op.
    A folder's graph holds the batch-invariance rewrites: they are undone first (the rules match the plain
    patterns; the export's last pass writes them again)."""
    model = strip_batch_invariance(model)
    n_layer = count_layers(model)
    if not profile.fusions and profile.layout.rewrite is None:
        return model, FusionReport(profile.name, {}, {}, {})
    held = graph_profile(model)
    _check_fused(held, profile)
    if held is profile:
        log.info("the model is already fused with the %s profile: nothing to fuse", profile.name)
        return model, _already_fused(model, profile, n_layer, activation)
    model = _upgrade_opset(model, profile.min_opset)
    ir_version = model.ir_version
    if profile.attention is not None:
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
    for fusion in profile.fusions:
        count = pattern.RewriteRuleSet(list(rule_set(fusion)), commute=True).apply_to_model(graph)
        applied[fusion.name] = applied.get(fusion.name, 0) + count
        log.info("fusion %s: %d rewrites", fusion.name, count)
    onnxscript.optimizer.remove_unused_nodes(graph)
    layout = profile.layout
    if layout.rewrite is not None:  # on the proto, after the rules
        proto = ir.to_proto(graph)
        proto, applied[layout.check] = layout.rewrite(proto)
        log.info("fusion %s: %d rewrites", layout.check, applied[layout.check])
        graph = ir.from_proto(proto)
    histogram = _op_histogram(graph)
    golden, partial = _golden(histogram, profile, n_layer, activation), []
    for check, count in golden.items():
        if count.found >= count.expected:
            continue
        # the layout rewrites the attention fusion's nodes: where that one stopped is the reason
        fusion = profile.attention if check == layout.check else next(f for f in profile.fusions if f.name == check)
        where = _where_it_stopped(graph, fusion)
        names = "/".join(op.split("::")[-1] for op in count.ops)
        partial.append(f"fusion '{check}' reached {count.found} of {count.expected} {names} ops: {where}")
    if partial and not allow_partial:
        raise CheckFailed(partial[0] + "; allow a partly fused graph (--allow-partial-fusion) to keep it")
    for message in partial:
        log.warning("%s", message)
    fused = ir.to_proto(graph)
    # the source's IR version, or the first that has the profile's opset (11 for 23, 12 for 24): onnx-ir writes a
    # newer one than onnxruntime 1.31 reads, and the opset converter leaves the old one
    needed = onnx.helper.find_min_ir_version_for(list(fused.opset_import), ignore_unknown=True)
    fused.ir_version = max(ir_version, needed)
    return fused, FusionReport(profile.name, applied, _op_counts(histogram, profile), golden, partial)
