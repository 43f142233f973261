"""The layers: imports flow one way (imports inside functions count), and the run path needs no torch."""

import ast
import functools
import itertools
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gpt2onnx"
ARCHITECTURE_PAGE = PACKAGE.parent / "docs" / "architecture.md"
TABLE_HEADER = "| layer | folder | may import | needs torch |"


def read_layer_table(page: Path) -> tuple[list[tuple[str, set[str]]], tuple[str, ...], dict[str, set[str]]]:
    """The layers, in order, each with its folders and modules, the modules that never import torch at top level,
    and the layers each may import, read from the architecture page's layer table: the page states the rule, this
    file only checks it. "needs torch" `no` makes a layer's modules torch-free; "`X.py` does not" names one module
    of a layer that is. "may import": "everything below", "X and everything below", or the layers by name."""
    text = page.read_text()
    rows = text[text.index(TABLE_HEADER) :].splitlines()[2:]  # after the header and its rule
    layers, torch_free, cells = [], [], []
    for row in itertools.takewhile(lambda r: r.startswith("|"), rows):
        name, folders, may, torch = (cell.strip() for cell in row.strip().strip("|").split("|"))
        members = {part.strip("`/ ").removesuffix(".py") for part in folders.split(",")}
        layers.append((name, members))
        cells.append(may)
        torch_free += sorted(members) if torch == "no" else []
        torch_free += [m.removesuffix(".py").replace("/", ".") for m in re.findall(r"`([\w/]+\.py)` does not", torch)]
    names = [name for name, _ in layers]
    allowed = {}
    for index, (name, may) in enumerate(zip(names, cells)):
        below = names[index + 1 :]
        if may == "everything below":
            allowed[name] = set(below)
        elif may.endswith(" and everything below"):
            allowed[name] = set(names[names.index(may.removesuffix(" and everything below")) :])
        else:
            allowed[name] = {n.strip() for n in may.split(",")} - {"nothing of ours"}
        assert allowed[name] <= set(below), f"row {name!r} may import {sorted(allowed[name])}: only layers below it"
    return layers, tuple(torch_free), allowed


# Each layer may import itself and the layers its row names, all of them after it in the page's table.
LAYERS, TORCH_FREE, MAY_IMPORT = read_layer_table(ARCHITECTURE_PAGE)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, tree: ast.Module) -> set[str]:
    """Every gpt2onnx module a file imports, at top level or inside functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("gpt2onnx")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gpt2onnx"):
            for alias in node.names:  # `from gpt2onnx.artifact import graph` imports a module
                candidate = f"{node.module}.{alias.name}"
                found.add(
                    candidate
                    if (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists()
                    else node.module
                )
    return found


@functools.cache
def parsed_package() -> dict[str, tuple[Path, ast.Module]]:
    """Every module of the package, parsed once for all the tests here."""
    return {module_name(p): (p, ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))}


@functools.cache
def import_graph() -> dict[str, frozenset[str]]:
    return {module: frozenset(imports_of(path, tree)) for module, (path, tree) in parsed_package().items()}


def torch_free(module: str) -> bool:
    return any(module == f"gpt2onnx.{name}" or module.startswith(f"gpt2onnx.{name}.") for name in TORCH_FREE)


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for index, (_, members) in enumerate(LAYERS):
        if top in members:
            return index
    return -1  # the package itself (its lazy __getattr__ names every layer)


def test_no_import_cycles():
    modules = set(import_graph())
    graph = {m: {i for i in deps if i != m and i in modules} for m, deps in import_graph().items()}
    state: dict[str, int] = {}

    def visit(module, stack):
        state[module] = 1
        for dep in graph[module]:
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep) :] + [dep]
                pytest.fail("import cycle: " + " → ".join(cycle))
            if dep not in state:
                visit(dep, stack + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_imports_flow_one_way():
    wrong = []
    for module, deps in import_graph().items():
        here = layer_of(module)
        if here < 0:
            continue
        for dep in deps:
            there = layer_of(dep)
            if there >= 0 and there != here and LAYERS[there][0] not in MAY_IMPORT[LAYERS[here][0]]:
                wrong.append(f"{module} ({LAYERS[here][0]}) imports {dep} ({LAYERS[there][0]})")
    assert not wrong, "\n".join(wrong)


def test_run_path_modules_never_import_torch_or_transformers_at_top_level():
    for module, (_, tree) in parsed_package().items():
        if layer_of(module) < 0 or not torch_free(module):
            continue
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names} | {
            n.module for n in top if isinstance(n, ast.ImportFrom)
        }
        assert not {n for n in names if n and n.split(".")[0] in ("torch", "transformers")}, module


NO_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "optimum"):
            raise ImportError(f"{name} is not installed on this deployment machine")
sys.meta_path.insert(0, NoTorch())
from gpt2onnx.cli import app
app(sys.argv[1:], prog_name="gpt2onnx")
"""


@pytest.mark.parametrize(
    "command",
    [
        ["inspect", "{folder}"],
        ["inspect", "{folder}", "--json"],
        ["generate", "{folder}", "--ids", "5,6,7", "--max-new-tokens", "4"],
        [
            "bench",
            "{folder}",
            "--batch",
            "1",
            "--prompt-len",
            "4",
            "--new-tokens",
            "3",
            "--warmup",
            "0",
            "--repeat",
            "1",
            "--json",
            "{tmp}/b.json",
        ],
    ],
)
def test_run_commands_work_without_torch(tiny_export, tmp_path, command):
    args = [a.format(folder=tiny_export, tmp=tmp_path) for a in command]
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    if command[0] == "bench":
        assert json.loads((tmp_path / "b.json").read_text())["runs"][0]["batch"] == 1
    # the guard works: a command that needs torch says so
    check = subprocess.run(
        [sys.executable, "-c", NO_TORCH, "parity", str(tiny_export), "--cases", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode != 0 and "not installed on this deployment machine" in check.stderr + check.stdout


NO_OPTIMUM = """
import importlib, pkgutil, sys
sys.modules["optimum"] = None  # as if not installed: importing it fails, importlib.util.find_spec finds nothing
import gpt2onnx
for info in pkgutil.walk_packages(gpt2onnx.__path__, "gpt2onnx."):
    if info.name != "gpt2onnx.__main__":
        importlib.import_module(info.name)
from gpt2onnx.cli import app
app(sys.argv[1:], prog_name="gpt2onnx")
"""


def test_every_module_imports_and_parity_runs_without_optimum(tiny_export):
    """optimum is an optional extra (only interop tests use it): nothing in the package may need it."""
    proc = subprocess.run(
        [sys.executable, "-c", NO_OPTIMUM, "parity", str(tiny_export), "--cases", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_the_layer_table_read_from_the_architecture_page_covers_the_package():
    """The page's table (read above) is complete and names what exists: every top-level module and folder of the
    package is in exactly one layer, and every name in the table is a module or folder of the package, so that a
    typo or a new folder cannot leave code unchecked."""
    assert [name for name, _ in LAYERS][:3] == ["cli", "measuring", "exporters"] and len(LAYERS) >= 8, LAYERS
    named = [member for _, members in LAYERS for member in members]
    assert len(named) == len(set(named)), f"a folder in two layers: {sorted(named)}"
    top = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"} | {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()
    }
    assert set(named) == top, f"not in the page's table: {sorted(top - set(named))}; not in the package: " + str(
        sorted(set(named) - top)
    )
    for module in TORCH_FREE:
        assert (PACKAGE / module.replace(".", "/")).with_suffix(".py").exists() or (PACKAGE / module).is_dir(), module


def test_no_two_modules_share_a_name():
    """Module names say what they are: only a runtime and the deployment target for it share one."""
    names = Counter(p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    assert {name for name, count in names.items() if count > 1} <= {"genai.py", "ort_generate.py"}


def test_the_registries_of_runtimes_and_targets():
    """Adding a runtime or a deploy target is one new module that declares its SPEC, plus one line in its
    registry: every module there that declares a SPEC is registered under its name, and the CLI's --runtime and
    --target take exactly the registered names."""
    import dataclasses
    import importlib

    from typer.testing import CliRunner

    from gpt2onnx.cli import app
    from gpt2onnx.params import flags_of
    from gpt2onnx.runtimes.all_runtimes import RUNTIMES, runtime_spec
    from gpt2onnx.runtimes.runtime import LoopRuntime, RuntimeSpec, StepRuntime
    from gpt2onnx.targets.all_targets import TARGETS, target_spec
    from gpt2onnx.targets.target import TargetSpec

    assert list(RUNTIMES) == ["onnxruntime", "openvino", "genai", "ort-generate"]
    assert list(TARGETS) == ["genai", "transformers-js", "triton", "ort-generate", "mobile", "web", "server"]
    for folder, registry, kind in (("runtimes", RUNTIMES, RuntimeSpec), ("targets", TARGETS, TargetSpec)):
        declaring = {
            module
            for module, (_, tree) in parsed_package().items()
            if module.startswith(f"gpt2onnx.{folder}.")
            and any(
                isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SPEC" for t in node.targets)
                for node in tree.body
            )
        }
        specs = {module: importlib.import_module(module).SPEC for module in declaring}
        assert len(specs) == len(registry) and all(registry.get(s.name) is s for s in specs.values()), folder
        for name, spec in registry.items():
            assert isinstance(spec, kind) and spec.name == name
    modules = {  # each runtime's module, by the name its SPEC registers
        name: module
        for module, (_, tree) in parsed_package().items()
        if module.startswith("gpt2onnx.runtimes.")
        for name in [getattr(getattr(importlib.import_module(module), "SPEC", None), "name", None)]
        if name in RUNTIMES
    }
    for name in RUNTIMES:
        spec = runtime_spec(name)
        settings = spec.settings()  # each runtime's settings: a frozen dataclass, valid at its defaults
        assert dataclasses.is_dataclass(settings) and set(flags_of(spec.settings)) <= {
            f.name for f in dataclasses.fields(settings)
        }
    # the interface each runtime's class implements is the one its declared capabilities promise
    classes = {"onnxruntime": "OnnxDecoder", "openvino": "OpenVinoDecoder", "genai": "GenaiRunner"}
    for name, spec in ((n, runtime_spec(n)) for n in RUNTIMES):
        opened = getattr(importlib.import_module(modules[name]), classes.get(name, "OrtGenerator"), None)
        interface = LoopRuntime if spec.capabilities.owns_loop else StepRuntime
        assert issubclass(opened, interface) and opened.capabilities == spec.capabilities, name
    assert all(target_spec(name).needs == () or set(target_spec(name).needs) < set(TARGETS) for name in TARGETS)
    helps = [
        CliRunner().invoke(app, [command, "--help"], terminal_width=200).output for command in ("generate", "deploy")
    ]
    assert all(name in helps[0] for name in RUNTIMES) and all(name in helps[1] for name in TARGETS)


def test_every_api_name_resolves_to_what_it_names_not_to_a_room():
    """The Python API's names (gpt2onnx.__init__'s lazy table) are functions and types: a room (a subpackage) of the
    same name would shadow one once imported (gpt2onnx.bench, the function, beside a bench/ package)."""
    import importlib
    import types

    import gpt2onnx

    for name, (module, attribute) in gpt2onnx._HOMES.items():
        importlib.import_module(module)  # the room that defines it, imported: its parent's attributes set
        value = getattr(gpt2onnx, name)
        assert not isinstance(value, types.ModuleType), f"gpt2onnx.{name} is a module, not {module}.{attribute}"
        assert value is getattr(importlib.import_module(module), attribute), name


# -- each option declared once (gpt2onnx/cli/flags.py, and gpt2onnx.params for the library's) -----------------------
CLI = PACKAGE / "cli"
DECLARATIONS = CLI / "flags.py"  # the one module that calls typer.Option and typer.Argument
# Flags that name two things differing in kind, kept because users' command lines give them; each meaning is one
# declaration of flags.py (or gpt2onnx.params), and a third is refused.
TWO_MEANINGS = {
    "--json": "a file to write (every command), inspect's switch to print JSON",
    "--adapter": "export's PEFT folder merged into the weights, a switchable adapter's name",
    "--batch": "bench run's and memory's list of sizes, one size (bench generate, compare)",
    "--past": "bench run's list of past lengths, bench precision's one",
    "--threads": "the runtimes' thread count, bench web's list of counts",
    "--runtime": "one runtime, bench run's list",
    "--seed": "a fixed seed (random weights, parity's cases; 0), sampling's (none: unseeded)",
    "--max-batch": "tensorrt's largest batch (a runtime option), the server's batch (serve, bench served)",
    "--fusion": "export's and check's profile (none), optimize's (default: the source's own)",
}


def _declared_params(command, path=()):
    """(command path, click parameter) for every option of every command of the CLI, read from the command tree."""
    if hasattr(command, "commands"):
        for name, sub in sorted(command.commands.items()):
            yield from _declared_params(sub, (*path, name))
    else:
        for param in command.params:
            yield " ".join(path), param


def _signature(param) -> tuple:
    """What a flag's declaration fixes: its spellings, value type, help, metavar, and its default ("required"
    where a command needs the flag: that is the command's, not the flag's)."""
    import typer

    if not isinstance(param, typer.core.TyperOption):
        return ()
    kind = getattr(param.type_descriptor, "annotation", None)
    names = tuple(sorted(param.opts + param.secondary_opts))
    metavar = param.metavar if param.metavar not in ("", None) else None
    return (names, repr(kind), param.help, metavar, "required" if param.required else repr(param.default))


def flag_declarations() -> dict[str, set[tuple]]:
    """Every flag of the CLI (derived from the commands' parameters, not from literal strings), with the distinct
    declarations the commands give it (a required use counts as the optional one it otherwise matches)."""
    from typer.main import get_command

    from gpt2onnx.cli import app

    found: dict[str, set[tuple]] = {}
    for _, param in _declared_params(get_command(app)):
        for flag in param.opts + param.secondary_opts:
            if flag.startswith("--") and _signature(param):
                found.setdefault(flag, set()).add(_signature(param))
    for flag, signatures in found.items():
        optional = {s[:4] for s in signatures if s[4] != "required"}
        found[flag] = {s for s in signatures if s[4] != "required" or s[:4] not in optional}
    return found


def inline_declarations() -> list[str]:
    """Every typer.Option( or typer.Argument( call (or a bare Option(/Argument( imported from typer) in a CLI module
    other than the declarations module."""
    found = []
    for path in sorted(CLI.glob("*.py")):
        if path == DECLARATIONS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                owner = getattr(func.value, "id", None) if isinstance(func, ast.Attribute) else None
                if name in ("Option", "Argument") and owner in ("typer", None):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {name}(")
    return found


def test_each_flag_is_declared_once():
    """One flag, one declaration: every command that takes it has the same type, help, metavar and default (a
    workload size that differs by command is None there, the library's default); only TWO_MEANINGS' flags have
    two. And no CLI module declares an option inline: they are all in gpt2onnx/cli/flags.py."""
    declarations = flag_declarations()
    assert {"--threads", "--seed", "--new-tokens", "--json", "--runtime", "--warmup", "--repeat"} <= set(declarations)
    twice = {flag: sorted(found, key=repr) for flag, found in declarations.items() if len(found) > 1}
    wrong = {flag: found for flag, found in twice.items() if flag not in TWO_MEANINGS or len(found) > 2}
    assert not wrong, "a flag declared more than once (declare it once in gpt2onnx/cli/flags.py):\n" + "\n".join(
        f"{flag}: {found}" for flag, found in wrong.items()
    )
    assert set(TWO_MEANINGS) <= set(twice), f"no longer two meanings: {sorted(set(TWO_MEANINGS) - set(twice))}"
    assert inline_declarations() == [], "declare these in gpt2onnx/cli/flags.py"
    # the runtimes' options become one parameter per flag (gpt2onnx.cli.options): two runtimes that take a flag
    # take the one declaration (--threads: runtimes.runtime.threads_param), or the first would hide the other
    from gpt2onnx.params import options_of
    from gpt2onnx.runtimes.all_runtimes import RUNTIMES, runtime_spec

    by_flag: dict[str, set] = {}
    for name in RUNTIMES:
        for option in options_of(runtime_spec(name).settings):
            by_flag.setdefault(option.flag, set()).add((repr(option.type), repr(option.default), option.param))
    assert {flag: found for flag, found in by_flag.items() if len(found) > 1} == {}


def test_the_cli_stays_thin():
    """Commands build options, call one library function and render: no CLI module over 400 lines (the
    renderers too: render.py and render_bench.py), no command function over 60 lines."""
    too_long = []
    for path in sorted(CLI.glob("*.py")):
        tree = ast.parse(path.read_text())
        lines = len(path.read_text().splitlines())
        if lines > 400:
            too_long.append(f"{path.name}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any("command" in ast.unparse(d) for d in node.decorator_list):
                if node.end_lineno - node.lineno + 1 > 60:
                    too_long.append(f"{path.name}: {node.name} {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []
