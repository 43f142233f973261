"""The declarations and the one resolver (gpt2onnx.capabilities): how a conflict is found and said, that every plug-in
is registered and named only where it is declared, that each option is declared once, and that runtimes/ holds the
engines only."""

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

from gpt2onnx import layouts, profiles
from gpt2onnx.capabilities import FACTS, Declared, Lacks, Need, Unsupported, UnsupportedRuntime, as_source, resolve
from gpt2onnx.decoding import proposers
from gpt2onnx.decoding.all_strategies import STRATEGIES
from gpt2onnx.decoding.proposers.all_proposers import PROPOSERS
from gpt2onnx.decoding.proposers.proposer import ProposerSpec
from gpt2onnx.decoding.strategy import Strategy
from gpt2onnx.layouts.all_layouts import LAYOUTS, layout_of
from gpt2onnx.layouts.layout import CacheLayout
from gpt2onnx.profiles.all_profiles import PROFILES, fused_with
from gpt2onnx.profiles.profile import Profile

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gpt2onnx"


# -- the resolver ------------------------------------------------------------------------------------------------
def test_a_need_met_and_unmet_with_the_maker_named_and_advice_from_the_alternatives():
    grows = Declared("layout", "a", "--fusion a", ensures={"cache_grows": True})
    fixed = Declared("layout", "b", "--fusion b", ensures={"cache_grows": False}, says={"cache_grows": "keeps one"})
    target = Declared("target", "t", "--target t", requires=(Need("cache_grows", allowed={True}, why="feeds a past"),))
    assert resolve([grows, target]).ok
    verdict = resolve([fixed, target], alternatives={"layout": [grows, fixed]})
    assert not verdict.ok
    assert verdict.line == "target t (--target t) feeds a past, but layout b (--fusion b) keeps one: use --fusion a"
    with pytest.raises(Unsupported, match="feeds a past"):
        verdict.check()


def test_a_fact_nobody_ensures_has_its_default_and_a_conditional_need_applies_only_where_it_holds():
    needer = Declared("x", "n", requires=(Need("logits", allowed={"last"}, why="wants the last"),))
    assert "nothing chosen gives logits" in resolve([needer]).line
    conditional = Declared(
        "x", "c", requires=(Need("upcast_attention", allowed={False}, when={"activations": "float16"}, why="w"),)
    )
    upcast = Declared("architecture", "a", ensures={"upcast_attention": True})
    assert resolve([conditional, upcast]).ok  # fp32: the condition does not hold
    half = Declared("precision", "fp16", ensures={"activations": "float16"})
    assert not resolve([conditional, upcast, half]).ok
    within = Declared("x", "w", requires=(Need("logits", allowed={"all"}, when={"profile": frozenset({"p"})}),))
    assert resolve([within, Declared("profile", "p", ensures={"profile": "q"})]).ok  # q is not in {p}


def test_a_set_fact_adds_up_and_a_lacks_names_the_item_and_who_wrote_it():
    writes = Declared("precision", "int8", "--quantize int8", ensures={"ops": {("", "DynamicQuantizeLinear")}})
    other = Declared("profile", "p", ensures={"ops": {("com.microsoft", "FastGelu")}})
    provider = Declared(
        "provider", "cuda", "--provider cuda", requires=(Lacks("ops", {("", "DynamicQuantizeLinear"): "has no"}),)
    )
    verdict = resolve([writes, other, provider])
    assert verdict.facts["ops"] == {("", "DynamicQuantizeLinear"), ("com.microsoft", "FastGelu")}
    assert verdict.line.startswith(
        "provider cuda (--provider cuda) has no DynamicQuantizeLinear, which precision int8 (--quantize int8) writes"
    )
    assert verdict.facts["contrib_ops"] is True  # derived: a com.microsoft op is among them
    with pytest.raises(UnsupportedRuntime):  # a provider in the conflict: exit code 3, as RuntimeUnavailable
        verdict.check()


def test_two_choices_that_ensure_one_fact_differently_conflict():
    a = Declared("x", "a", ensures={"kv_dtype": "int8"})
    b = Declared("y", "b", ensures={"kv_dtype": "int4"})
    assert "choose one of them" in resolve([a, b]).line


def test_a_source_is_read_under_its_own_facts():
    folder = Declared("precision", "int4", ensures={"weight_bits": 4, "activations": "float32"}).from_folder("f")
    source = as_source(folder)
    assert source.ensures == {"source_weight_bits": 4, "source_activations": "float32"} and source.origin == "folder"


def test_every_declaration_names_known_facts():
    for fact in FACTS.values():
        assert fact.key and fact.noun
    with pytest.raises(ValueError, match="unknown fact"):
        Need("no_such_fact", allowed={1})
    with pytest.raises(ValueError, match="derived"):
        Declared("x", "y", ensures={"contrib_ops": True})


# -- plug-ins: registered where declared, named only there --------------------------------------------------------
@pytest.mark.parametrize(
    ("package", "kind", "registry", "attribute"),
    [
        (profiles, Profile, PROFILES, "PROFILE"),
        (layouts, CacheLayout, LAYOUTS, "LAYOUT"),
        (proposers, ProposerSpec, PROPOSERS, "PROPOSER"),
    ],
)
def test_each_registry_lists_every_module_that_declares_one(package, kind, registry, attribute):
    declared = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        value = getattr(module, attribute, None)
        if isinstance(value, kind):
            declared[value.name] = value
    assert declared == registry


def test_the_strategies_are_one_module_each_and_the_last_serves_every_request():
    from gpt2onnx import decoding

    declared = [
        getattr(importlib.import_module(f"{decoding.__name__}.{i.name}"), "STRATEGY", None)
        for i in pkgutil.iter_modules(decoding.__path__)
    ]
    assert sorted(s.name for s in declared if isinstance(s, Strategy)) == sorted(STRATEGIES)
    assert list(STRATEGIES.values())[-1].applies(None, None)


def test_a_graph_tells_its_profile_and_layout():
    for profile in PROFILES.values():
        ops = {op for ops, _ in profile.golden_counts(2).values() for op in ops}
        assert fused_with(ops) is (profile if profile.marks else None), profile.name
        assert layout_of(op for _, op in ops) is profile.layout, profile.name


# The profile and layout names: outside their own modules and the registries each may appear only where it is not
# a profile or a layout (each allowed line says what it is).
_NAMES = sorted({*PROFILES, *LAYOUTS} - {"none"}, key=len, reverse=True)  # "none" is every option's word for none
_KEYS = re.compile(r"""["'](%s)["']""" % "|".join(map(re.escape, _NAMES)))
_NOT_A_PROFILE = {
    ("targets/transformers_js.py", 'SUBFOLDER = "onnx"'): "transformers.js's folder of ONNX files",
    ("exporters/optimize.py", '"kind": "onnx"'): "a source's kind: an ONNX file",
    ("artifact/folder.py", '("torch", "onnx", "transformers")'): "the onnx package",
    ("__main__.py", '"onnxruntime", "transformers", "onnx", "openvino"'): "the onnx package",
    ("benchmarks/compare/engine_worker.py", '"export", "onnx", "--model"'): "optimum-cli's export to ONNX",
    ("runtimes/providers.py", "tensorrt"): "the TensorRT execution provider",
    ("runtimes/decoder.py", '"tensorrt"'): "the TensorRT execution provider",
    ("runtimes/runtime.py", '"tensorrt"'): "the TensorRT execution provider, in a comment",
    ("benchmarks/bench.py", '"tensorrt"'): "the TensorRT execution provider",
    ("artifact/manifest.py", '"shared"'): "a comment on the manifest's record of the layout's name",
}


def test_no_profile_or_layout_name_outside_its_module_and_registry():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(("profiles/", "layouts/")):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _KEYS.search(line) and not any(
                relative == file and fragment in line for file, fragment in _NOT_A_PROFILE
            ):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert found == []


# -- each option declared once: tests/test_architecture.py (test_each_flag_is_declared_once) reads every flag from
# the CLI's command tree


def test_runtimes_holds_the_engines_only():
    engines = {p.stem for p in (PACKAGE / "runtimes").glob("*.py")} - {"__init__"}
    assert engines == {
        "runtime",  # what a runtime is
        "all_runtimes",  # the registry, RuntimeOptions, the resolver's call before one opens
        "decoder",
        "providers",
        "onnxruntime",
        "openvino",
        "genai",
        "genai_worker",
        "ort_generate",
        "worker_process",  # the client of the workers under another environment's Python (genai's, the engines')
        "heap",  # what a session's loading and a batch's run freed, given back to the system
    }
