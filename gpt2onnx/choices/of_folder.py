"""What a folder already is, as the declarations of the choices that made it, read from its graph's facts (never
from its manifest): its fusion profile (with its cache layout), its precision, its prompt kernel, its K/V cache
type, and what the graph itself says (its logits, its external data files, every op it holds). A command asks the
resolver about a folder with these beside what it chose; their advice says to export the folder again."""

from __future__ import annotations

from gpt2onnx.artifact.graph import GraphFacts
from gpt2onnx.capabilities import Declared
from gpt2onnx.precisions.all_precisions import precision_of
from gpt2onnx.precisions.kv_cache import FLOAT_DECLARED, cache_format_of
from gpt2onnx.precisions.prompt_path import kernel_of
from gpt2onnx.profiles.all_profiles import UNFUSED, fused_with


def folder_choices(facts: GraphFacts, folder: str) -> list[Declared]:
    """The declarations of what ``folder`` is (its graph's ``facts``), each named after the folder."""
    held = fused_with(facts.ops) or UNFUSED
    profile = held.declared
    if held.layout is not facts.layout:  # a graph whose layout no registered profile of its ops makes
        profile = profile.with_(ensures=facts.layout.ensures, says=facts.layout.says)
    cache = cache_format_of(facts.kv_dtype)
    graph = Declared(
        "graph",
        "facts",
        ensures={
            "ops": facts.ops,
            "logits": "last" if facts.logits_last else "all",
            "data_files": len(facts.data_files),
            "padding_dependent": facts.padding_dependent,
            "batch_dependent": facts.batch_dependent,
        },
        says={
            "logits": "returns the last position's logits only (exported with --logits last)"
            if facts.logits_last
            else "returns every position's logits",
            "data_files": f"keeps its weights in {len(facts.data_files)} external data files",
        },
        label=f"'{folder}' (its graph)",
    )
    # the graph's own facts last: an op is said to come from the choice that writes it (a message names the
    # profile or precision, and advice can name another), the graph only for ops no declared choice writes
    return [
        profile.from_folder(folder),
        precision_of(facts).declared.from_folder(folder),
        kernel_of(facts.quantized_ops).declared.from_folder(folder),
        (FLOAT_DECLARED if cache is None else cache.declared).from_folder(folder),
        graph,
    ]
