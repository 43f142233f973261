"""The forms a PEFT LoRA adapter is exported in, by name: ``merged`` (``--adapter DIR``: added into the weights before
export, gpt2onnx.pytorch.checkpoint.with_adapter) and ``switchable`` (``--adapters NAME=DIR,...``: LoRA slots in the
base graph, one adapter file per name, gpt2onnx.exporters.switchable). Export looks the form up by the option given
(:func:`export_adapted`); a new form is a module with its export function and a line in ADAPTER_FORMS (and its flag
on ``gpt2onnx export``: the command line stays importable without torch, and this module is not).

requires: at most one form per export; a form that ``needs_checkpoint``, a base checkpoint (no random weights) and no
other form. ensures: the export of the form chosen, its name in the manifest's adapter record (``form``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpt2onnx.capabilities import Declared
from gpt2onnx.errors import BadInput, ContractError
from gpt2onnx.exporters import switchable
from gpt2onnx.exporters.export import ExportOptions, ExportResult, export
from gpt2onnx.registry import Registry


@dataclass(frozen=True)
class AdapterForm:
    """One form: its name (the manifest's adapter record ``form``), its words in messages, the export option that
    selects it, its export function and the keyword that takes the option's value (``parse``d), whether it needs a
    base checkpoint of its own (no random weights, no other form), and what it declares (gpt2onnx.capabilities):
    the facts its folder ensures, what it requires of the passes."""

    name: str
    words: str
    option: str
    # (model, out, *, revision, options, KEYWORD=value; random_init, seed, outliers unless it needs a checkpoint)
    export: Callable[..., ExportResult]
    keyword: str
    parse: Callable[[object], object] = lambda value: value
    needs_checkpoint: bool = False
    ensures: Mapping[str, object] = field(default_factory=dict)
    says: Mapping[str, str] = field(default_factory=dict)
    requires: tuple = ()  # of the passes (Need, Lacks): asked before any weight is loaded

    @property
    def declared(self) -> Declared:
        label = f"{self.words} ({self.option})"
        return Declared("adapter form", self.name, self.option, self.ensures, self.requires, self.says, label=label)


ADAPTER_FORMS: Registry[AdapterForm] = Registry(
    "adapter form",
    (
        AdapterForm(
            "merged", "an adapter merged into the weights", "--adapter", export, keyword="adapter"
        ),
        AdapterForm(
            "switchable", "switchable adapters", "--adapters", switchable.export_switchable, keyword="adapters",
            parse=switchable.parse_adapters, needs_checkpoint=True,
            ensures={"adapter_files": True}, says={"adapter_files": "keeps switchable LoRA adapters beside its graph"},
        ),
    ),
)  # fmt: skip


def chosen_form(given: Mapping[str, object], *, random_init: bool = False) -> tuple[AdapterForm, object] | None:
    """The form export's options choose and its value (``given``: a form's option → its value, None where not
    given); None: no adapter. Refused in one line where two are given, or random weights for a form that needs a
    checkpoint."""
    options = {form.option: form for form in ADAPTER_FORMS.values()}
    unknown = set(given) - set(options)
    if unknown:
        raise ContractError(f"{sorted(unknown)} select no adapter form: the forms' options are {sorted(options)}")
    chosen = [(form, given[form.option]) for form in ADAPTER_FORMS.values() if given.get(form.option) is not None]
    for form, _ in chosen:
        if form.needs_checkpoint and (random_init or len(chosen) > 1):
            drop = [other for other in options if other != form.option] + ["--random-init"]
            raise BadInput(f"{form.option} exports {form.words} over a checkpoint: drop {'/'.join(drop)}")
    if len(chosen) > 1:
        raise BadInput(f"give one adapter form: {' and '.join(form.option for form, _ in chosen)} cannot be combined")
    return chosen[0] if chosen else None


def export_adapted(
    model: str,
    out: str | Path | None = None,
    *,
    given: Mapping[str, object],
    random_init: bool = False,
    seed: int = 0,
    revision: str | None = None,
    outliers: float = 0.0,
    options: ExportOptions = ExportOptions(),
) -> ExportResult:
    """Export ``model`` with the adapter form the options in ``given`` choose (:func:`chosen_form`), or without an
    adapter where none is given: the form's own export (gpt2onnx.exporters.export.export's arguments)."""
    chosen = chosen_form(given, random_init=random_init)
    if chosen is None:
        return export(
            model, out, random_init=random_init, seed=seed, revision=revision, outliers=outliers, options=options
        )
    form, value = chosen
    options.passes.verdict(form.declared).check()
    source = {} if form.needs_checkpoint else dict(random_init=random_init, seed=seed, outliers=outliers)
    return form.export(model, out, revision=revision, options=options, **source, **{form.keyword: form.parse(value)})
