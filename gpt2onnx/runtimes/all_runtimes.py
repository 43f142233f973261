"""Every runtime, by name (a new one is a module beside this one and a line here), and what the rest of the package
asks of them before one opens: :class:`RuntimeOptions` (a runtime's name and its settings, checked when built), the
settings built from the command line, the combination resolved (gpt2onnx.capabilities) and the runtime opened."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpt2onnx.artifact.folder import ModelFolder
from gpt2onnx.capabilities import Declared, Verdict, resolve
from gpt2onnx.choices.axes import graph_alternatives
from gpt2onnx.choices.of_folder import folder_choices
from gpt2onnx.errors import BadInput
from gpt2onnx.params import flags_of, options_of
from gpt2onnx.records import Record
from gpt2onnx.registry import Registry
from gpt2onnx.runtimes import genai, onnxruntime, openvino, ort_generate
from gpt2onnx.runtimes.runtime import Runtime, RuntimeSpec, command_declared

RUNTIMES: Registry[RuntimeSpec] = Registry(
    "runtime", (onnxruntime.SPEC, openvino.SPEC, genai.SPEC, ort_generate.SPEC), option="--runtime"
)


def runtime_spec(name: str) -> RuntimeSpec:
    return RUNTIMES.lookup(name)


@dataclass(frozen=True)
class RuntimeOptions(Record):
    """A runtime and its settings (default: the runtime's defaults), checked when built."""

    name: str = "onnxruntime"
    settings: Any = None

    def __post_init__(self) -> None:
        spec = runtime_spec(self.name)
        if self.settings is None:
            object.__setattr__(self, "settings", spec.settings())
        elif not isinstance(self.settings, spec.settings):
            raise BadInput(
                f"{type(self.settings).__name__} are not the {self.name} runtime's settings: give a"
                f" {spec.settings.__name__}"
            )

    def check(self) -> RuntimeOptions:  # built checked: kept for callers of the earlier API
        return self

    @property
    def spec(self) -> RuntimeSpec:
        return runtime_spec(self.name)

    @property
    def threads(self) -> int | None:
        return getattr(self.settings, "threads", None)

    @property
    def declared(self) -> list[Declared]:
        """What the runtime and its settings declare (the onnxruntime runtime: its provider's too)."""
        spec = self.spec
        return [spec.declared, *(spec.declare_settings(self.settings) if spec.declare_settings else [])]

    def declared_on(self, folder: Path) -> list[Declared]:
        """What the runtime and its settings declare, and what ``folder``'s deployment for it declares."""
        spec = self.spec
        return [*self.declared, *(spec.declare_folder(Path(folder)) if spec.declare_folder else [])]

    def requires(self, command: str) -> None:
        """Refuse, before anything is opened, a command the runtime cannot serve (its needs: COMMANDS), in the
        line check --command gives."""
        verdict = resolve([*self.declared, command_declared(command)], alternatives=runtime_alternatives())
        if not verdict.ok:
            raise BadInput(verdict.conflicts[0].line)


def runtime_options(names: list[str], flags: dict[str, Any]) -> list[RuntimeOptions]:
    """The runtimes ``names``, each with its settings built from the command-line options it takes.

    ``flags``: option → value, as given (``--threads``: 2); an option at its default is taken as not given. One
    given that none of the runtimes takes is refused, naming the runtime that does."""
    specs = [runtime_spec(name) for name in names]
    every = list(RUNTIMES.values())
    defaults = {o.flag: o.default for s in every for o in options_of(s.settings) if o.flag}
    given = {flag: value for flag, value in flags.items() if flag not in defaults or value != defaults[flag]}
    for flag in given:
        owners = [s.name for s in every if flag in flags_of(s.settings).values()]
        if not owners:
            raise BadInput(f"{flag} is not an option of any runtime")
        if not any(s.name in owners for s in specs):
            raise BadInput(
                f"{flag} applies to the {' and '.join(owners)} runtime, not {', '.join(names)}: choose"
                f" --runtime {owners[0]}, or drop {flag}"
            )
    options = []
    for spec in specs:
        fields = {name: given[flag] for name, flag in flags_of(spec.settings).items() if flag in given}
        options.append(RuntimeOptions(spec.name, spec.settings(**fields)))
    return options


def runtime_alternatives() -> dict[str, list[Declared]]:
    """By axis, what a refusal's advice may name: the graph's axes, the runtimes, their settings' (providers)."""
    specs = list(RUNTIMES.values())
    found = {**graph_alternatives(), "runtime": [spec.declared for spec in specs]}
    for spec in specs:
        found.update(spec.setting_alternatives() if spec.setting_alternatives else {})
    return found


def check_combination(model: ModelFolder, options: RuntimeOptions, *others: Declared) -> Verdict:
    """Whether the folder runs on the runtime and its settings, with ``others`` (a request, a strategy, the engine):
    Unsupported (one line) where it does not, before anything is opened."""
    chosen = [*folder_choices(model.facts, str(model.folder)), *options.declared_on(model.folder), *others]
    return resolve(chosen, alternatives=runtime_alternatives()).check()


def open_runtime(model: ModelFolder, options: RuntimeOptions, *others: Declared) -> Runtime:
    """Open ``model`` (an opened :class:`~gpt2onnx.artifact.folder.ModelFolder`) on the runtime ``options`` names,
    once the combination is resolved (with ``others``: what the caller's use of it declares)."""
    check_combination(model, options, *others)
    return options.spec.open(model, options.settings)


def parse_runtimes(value: str) -> list[str]:
    """'onnxruntime,openvino' → ['onnxruntime', 'openvino']; each known, none twice."""
    names = [v.strip() for v in value.split(",")]
    for name in names:
        RUNTIMES.lookup(name, "comma-separated for bench")
    if len(set(names)) != len(names):
        raise BadInput(f"runtimes '{value}' name one twice: give each once")
    return names
