"""Every kind of plug-in is a gpt2onnx.registry.Registry (issue 55, item 2): found by importing the package, each
kind's registry in ``all_<kinds>.py`` (or in the kind's own module, for a kind of a few entries), names mapped to
the plug-in objects themselves, and a name not registered refused in the one line every kind shares."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import gpt2onnx
from gpt2onnx.errors import BadInput, ContractError
from gpt2onnx.registry import Registry

PACKAGE = Path(gpt2onnx.__file__).parent
# a kind of a few entries keeps its registry in its own module
IN_THE_KIND_MODULE = {
    "gpt2onnx.precisions.kv_cache.KV_CACHES",
    "gpt2onnx.precisions.prompt_path.PROMPT_KERNELS",
    "gpt2onnx.decoding.constraints.CONSTRAINT_KINDS",
    "gpt2onnx.exporters.adapter_forms.ADAPTER_FORMS",
}
_DEFINED = re.compile(r"^([A-Z_]+): Registry\[", re.M)


def _registries() -> dict[str, Registry]:
    """Every module-level ``NAME: Registry[...]`` of the package, by where it is defined."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        names = _DEFINED.findall(path.read_text())
        if names:
            module = importlib.import_module(".".join(("gpt2onnx", *path.relative_to(PACKAGE).with_suffix("").parts)))
            found.update({f"{module.__name__}.{name}": getattr(module, name) for name in names})
    return found


REGISTRIES = _registries()


def test_every_kind_of_plug_in_has_one_registry_where_the_scheme_says():
    assert len(REGISTRIES) >= 10, REGISTRIES
    for where in REGISTRIES:
        module = where.rsplit(".", 1)[0]
        assert module.rsplit(".", 1)[-1].startswith("all_") or where in IN_THE_KIND_MODULE, where
    kinds = [r.kind for r in REGISTRIES.values()]
    assert len(set(kinds)) == len(kinds), kinds


@pytest.mark.parametrize("where", sorted(REGISTRIES))
def test_a_name_not_registered_is_refused_in_one_line_naming_the_choices(where):
    registry = REGISTRIES[where]
    assert len(registry) > 0 and all(isinstance(name, str) and name for name in registry)
    first = next(iter(registry))
    assert registry.lookup(first) is registry[first]  # names map to the plug-ins themselves
    with pytest.raises(BadInput) as refused:
        registry.lookup("no-such-" + first)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"unknown {registry.option or registry.kind} 'no-such-{first}': choose one of ")
    assert line.endswith(registry.choices()) and all(name in line for name in registry)


def test_two_plug_ins_of_one_name_are_refused_when_registered():
    class Item:
        def __init__(self, name):
            self.name = name

    with pytest.raises(ContractError, match="two widgets are registered as 'a'"):
        Registry("widget", (Item("a"), Item("b"), Item("a")))
    with pytest.raises(ContractError, match="two widgets are registered as 'none'"):
        Registry("widget", (Item("none"),), extra=("none",))
