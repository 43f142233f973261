"""The documentation: the site builds strictly (a broken link, a broken anchor or a page left out of the navigation
fails it), the README's links land on real pages and headings, and every command shown in the README and docs/
runs, or says next to it why not (docs/setup.md, "This site", states the rules and the substitutions).

Cost: two MkDocs builds (about 2 s each); the commands of every page with the substitutions below, in one process
(Typer's test runner) on the trained test model and the tiny preset: about 60 s of CPU in all (85 to 125 s of wall
time on a shared 2-core machine with a load average of 6); the reduced-precision exports, whose checks run PyTorch
beside onnxruntime, take most of it."""

import importlib
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ARCHITECTURE = DOCS / "architecture.md"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
TRAINED_FIXTURE = ROOT / "tests" / "fixtures" / "trained-tiny"
NOT_RUN = "not run by the docs test:"
PRESETS = {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2"}
HELDOUT_CHARS = 2000


def missing(what: str) -> None:
    """Skip, saying what is missing; under CI=1 fail instead (as the other tests of installed tools do)."""
    message = f"{what}: run scripts/setup.sh"
    pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)


# -- the site ---------------------------------------------------------------------------------------------------


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        missing("mkdocs and mkdocs-material are not installed (the docs extra)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about its end of life, not a warning
    # never with --verbose: mkdocs 1.6.1 then skips the anchor check (found here; fixed in the mkdocs-ng fork)
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once with `mkdocs build --strict` into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    proc = mkdocs_build(ROOT / "mkdocs.yml", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    return out


def test_the_site_builds_strictly(site):
    assert (site / "index.html").is_file() and (site / "architecture" / "index.html").is_file()


def test_a_broken_link_a_broken_anchor_or_a_page_left_out_fails_the_strict_build(tmp_path):
    """The real mkdocs.yml on a copy of the pages, broken three ways at once: each is reported as a warning, and
    strict mode aborts on any warning (it counts all three)."""
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "index.md", "a") as page:
        page.write("\n[a page](no-such-page.md) and [a heading](export.md#no-such-heading)\n")
    (tmp_path / "docs" / "orphan.md").write_text("# A page the navigation leaves out\n")
    proc = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log
    assert re.search(r"WARNING .*'index\.md' contains a link 'no-such-page\.md', but the target is not found", log), log
    assert re.search(r"WARNING .*'export\.md' does not contain an anchor '#no-such-heading'", log), log
    assert re.search(r"WARNING .*not included in the \"nav\" configuration:\s+- orphan\.md", log), log
    assert "Aborted with 3 warnings in strict mode!" in log, log


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"[`*_]|\]\([^)]*\)|[\[\]]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_the_readme_links_land_on_pages_and_headings_on_the_site_and_on_github(site):
    """Each README link into docs/ names a page of the site and, with an anchor, a heading that has that id on the
    site (MkDocs' anchors) and on GitHub (GitHub's), so the link works where it is read."""
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", (ROOT / "README.md").read_text())
    assert len(links) >= 10, links
    for path, anchor in links:
        page = ROOT / path
        assert page.is_file() and page.suffix == ".md", path
        html = site / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert html.is_file(), f"{path} is not a page of the site"
        if anchor:
            assert f'id="{anchor}"' in html.read_text(), f"{path}#{anchor}: no such heading on the site"
            headings = [line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")]
            assert anchor in {github_anchor(h) for h in headings}, f"{path}#{anchor}: no such heading on GitHub"


# -- the architecture page ---------------------------------------------------------------------------------------


def test_the_architecture_pages_tree_is_the_package_as_it_is():
    """docs/architecture.md's tree of the package is scripts/architecture_tree.py's output for the package as it is
    now, so a module added, moved or renamed, or a docstring's first sentence changed, fails here until the page is
    written again."""
    from scripts import architecture_tree

    page = ARCHITECTURE.read_text()
    assert page.count(architecture_tree.BEGIN) == 1 and page.count(architecture_tree.END) == 1
    fresh = architecture_tree.with_tree(page, architecture_tree.tree())
    assert fresh == page, "docs/architecture.md's tree is stale: run python -m scripts.architecture_tree --write"


def test_the_tree_names_a_module_added_to_the_package(tmp_path):
    """The generator walks the folders, not a list: a module dropped into a copy of the package is in its tree, under
    its room, with its docstring's first sentence (cut at a clause where it is long)."""
    from scripts import architecture_tree

    package = tmp_path / "gpt2onnx"
    shutil.copytree(ROOT / "gpt2onnx", package, ignore=shutil.ignore_patterns("__pycache__"))
    first = "A new kind of thing: " + ", ".join(f"part {i}" for i in range(40)) + ". Not shown."
    (package / "layouts" / "ring.py").write_text(f'"""{first}"""\n')
    tree = architecture_tree.tree(package, ARCHITECTURE)
    assert tree != architecture_tree.tree()
    lines = tree.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("ring.py"))
    assert lines[at].startswith("    ring.py ") and "A new kind of thing: part 0, part 1" in lines[at]
    starts = [i for i, line in enumerate(lines) if line.startswith(("  layouts/", "    layout.py", "    shared.py"))]
    assert starts[0] < starts[1] < at < starts[2], "ring.py is not in layouts/, between layout.py and shared.py"
    shown = " ".join(line.strip() for line in lines[at : at + 3])
    assert shown.endswith("…") and "Not shown" not in tree


def test_where_new_things_go_names_every_registry_where_it_is():
    """The architecture page's "Where new things go" names each kind's Registry (every module-level
    `NAME: Registry[...]` of the package) with the file it is in, so the recipe cannot name a registry that moved."""
    page = ARCHITECTURE.read_text()
    section = page[page.index("## Where new things go") : page.index("## The Python API")]
    found = []
    for path in sorted((ROOT / "gpt2onnx").rglob("*.py")):
        for name in re.findall(r"^([A-Z_]+): Registry\[", path.read_text(), re.M):
            found.append(name)
            where = path.relative_to(ROOT / "gpt2onnx").as_posix()
            assert f"`{name}`" in section, f"{name} ({where}) is not in the page's 'Where new things go'"
            assert f"`{where}`" in section, f"{where} (where {name} is) is not in the page's 'Where new things go'"
    assert len(found) >= 10, found


# -- the commands -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str  # as shown, comment included
    argv: tuple[str, ...]  # the command, without `nice -n N`, environment settings and `.venv/bin/`
    exempt: str | None  # why the docs test does not run it (the comment after NOT_RUN), or None


def shown_commands(page: Path) -> list[Command]:
    """The command lines of a page's shell blocks: `bash`/`sh`/`shell` lines (with `\\` continuations joined) and
    `console` lines after `$ `, that call gpt2onnx, a script of scripts/ or python -m gpt2onnx."""
    found, block, start = [], None, 0
    lines = page.read_text().splitlines()
    pending = ""
    for number, line in enumerate(lines, 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence:
            block = None if block is not None else fence.group(1)
            continue
        if block not in ("bash", "sh", "shell", "console"):
            continue
        text = line.strip()
        if block == "console":
            if not text.startswith("$ "):
                continue
            text = text[2:]
        start = start if pending else number
        text = f"{pending} {text}" if pending else text
        if text.endswith("\\"):
            pending = text[:-1].rstrip()
            continue
        pending = ""
        argv = shlex.split(text, comments=True)
        while argv and re.match(r"^[A-Z_]+=", argv[0]):  # VAR=value before the command
            argv = argv[1:]
        if argv[:2] == ["nice", "-n"]:
            argv = argv[3:]
        if not argv:
            continue
        argv[0] = argv[0].removeprefix(".venv/bin/")
        calls = argv[0] == "gpt2onnx" or (argv[0] == "bash" and argv[1:2] and argv[1].startswith("scripts/"))
        calls |= argv[0] == "python" and (
            argv[1:3] == ["-m", "gpt2onnx"] or any(a.startswith(("scripts.", "scripts/")) for a in argv[1:4])
        )
        if not calls:
            continue
        comment = text.partition(NOT_RUN)[2].strip() if NOT_RUN in text else None
        found.append(Command(page.name, start, text, tuple(argv), comment))
    return found


ALL_COMMANDS = [c for page in PAGES for c in shown_commands(page)]


def test_the_commands_are_found_and_each_one_not_run_says_why():
    assert len(ALL_COMMANDS) >= 40, len(ALL_COMMANDS)
    assert {c.page for c in ALL_COMMANDS} >= {"README.md", "export.md", "precision.md", "deploy.md", "eval.md"}
    for command in ALL_COMMANDS:
        assert command.exempt is None or len(command.exempt) >= 10, f"{command.page}:{command.line}: say why"


def test_the_commands_not_run_still_name_real_options_and_scripts():
    """A command the docs test does not run is still checked as far as it can be here: a gpt2onnx command parses
    (its options exist: run with --help appended, the CLI parses everything before it answers --help), a bash script
    passes `bash -n`, a Python script imports (its work is behind `if __name__ == "__main__"`)."""
    from gpt2onnx.cli import app

    for command in ALL_COMMANDS:
        if command.exempt is None:
            continue
        if command.argv[0] == "gpt2onnx":
            result = CliRunner().invoke(app, [*command.argv[1:], "--help"])
            assert result.exit_code == 0, f"{command.page}:{command.line}: {command.text}\n{result.output}"
            continue
        script = next(a for a in command.argv[1:] if a.startswith("scripts"))
        path = ROOT / (script if "/" in script else script.replace(".", "/") + ".py")
        assert path.is_file(), f"{command.page}:{command.line}: {path} does not exist"
        if path.suffix == ".sh":
            assert subprocess.run(["bash", "-n", str(path)]).returncode == 0, path
        else:
            sys.path.insert(0, str(ROOT))
            try:
                importlib.import_module("scripts." + path.stem)
            finally:
                sys.path.remove(str(ROOT))


def substituted(argv: tuple[str, ...], workspace: Path) -> list[str]:
    """The documented substitutions (docs/setup.md, "This site"): the same options, small sizes."""
    args = list(argv)
    if args[0] == "python" and args[1] == "-m" and args[2] == "gpt2onnx":
        args = ["gpt2onnx", *args[3:]]
    small = {"--cases": 2, "--prompt-len": 8, "--new-tokens": 4, "--max-new-tokens": 8, "--rounds": 1, "--repeat": 1}
    for i, arg in enumerate(args[:-1]):
        value = args[i + 1]
        if arg in ("--model", "-m") and value in PRESETS:
            args[i + 1] = "tiny" if "--random-init" in args else str(workspace / "models" / "my-gpt2")
        elif arg in small and value.isdigit():
            args[i + 1] = str(min(int(value), small[arg]))
        elif arg == "--past":
            args[i + 1] = "8,16"
        elif arg == "--batch":
            args[i + 1] = ",".join(dict.fromkeys(str(min(int(b), 2)) for b in value.split(",")))
        elif arg == "--warmup":
            args[i + 1] = "0"
    command = args[1] if args[0] == "gpt2onnx" else None
    if command == "parity" and "--cases" not in args:
        args += ["--cases", "2"]
    if command == "bench":
        for option, value in (("--warmup", "0"), ("--repeat", "1"), ("--prompt-len", "8"), ("--new-tokens", "4")):
            args += [] if option in args else [option, value]
    if args[0] in ("python", "bash"):  # a script of this checkout, run from the working folder
        args = [str(ROOT / a) if a.startswith("scripts/") else a for a in args]
    return args


def lacks(args: list[str]) -> str | None:
    """What a command needs that this machine lacks (a runtime or tool of the set-up), or None."""
    runtimes = {r for i, a in enumerate(args[:-1]) if a in ("--runtime", "-r") for r in args[i + 1].split(",")}
    targets = {t for i, a in enumerate(args[:-1]) if a in ("--target", "-t") for t in args[i + 1].split(",")}
    genai = (ROOT / ".venv-genai" / "bin" / "python").exists() or importlib.util.find_spec("onnxruntime_genai")
    if "genai" in runtimes and not genai:
        return "onnxruntime-genai (.venv-genai)"
    if "openvino" in runtimes and importlib.util.find_spec("openvino") is None:
        return "OpenVINO"
    if "web" in targets and not (ROOT / "tests" / "js" / "node_modules" / "@huggingface" / "transformers").is_dir():
        return "transformers.js (tests/js/node_modules)"
    return None


def run_script(args: list[str]) -> int:
    """`python [-u] -m scripts.X ARGS` or `python scripts/X.py ARGS`, run as __main__ in this process: its status."""
    args = [a for a in args if a != "-u"]
    module, rest = (args[1], args[2:]) if args[0] == "-m" else (None, args[1:])
    argv, path = sys.argv, list(sys.path)
    sys.argv, sys.path[:0] = [module or args[0], *rest], [str(ROOT)]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True) if module else runpy.run_path(
            args[0], run_name="__main__"
        )
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.argv, sys.path[:] = argv, path
    return 0


@pytest.fixture(scope="module")
def base_folders(trained_checkpoint, trained_export, tmp_path_factory) -> dict[str, Path]:
    """What every page's commands start from: models/gpt2 (the trained test model exported, with its tokenizer),
    models/my-gpt2 (its checkpoint), held-out.txt (the first characters of its held-out text), and the README's
    tests/fixtures/trained-tiny (a copy whose held-out text is cut the same way)."""
    text = (trained_checkpoint / "heldout.txt").read_text()[:HELDOUT_CHARS]
    fixture = tmp_path_factory.mktemp("docs-base") / "trained-tiny"
    shutil.copytree(TRAINED_FIXTURE, fixture)
    (fixture / "heldout.txt").write_text(text)
    return {"models/gpt2": trained_export, "models/my-gpt2": trained_checkpoint, "tests/fixtures/trained-tiny": fixture}


def workspace_for(base: dict[str, Path], folder: Path) -> Path:
    for relative, source in base.items():
        shutil.copytree(source, folder / relative)
    shutil.copy(base["tests/fixtures/trained-tiny"] / "heldout.txt", folder / "held-out.txt")  # already cut
    return folder


@pytest.mark.parametrize("page", sorted({c.page for c in ALL_COMMANDS if c.exempt is None}))
def test_the_commands_of_each_page_run_in_order(page, base_folders, tmp_path, monkeypatch):
    """Every command of the page that does not say why not, in the page's order (a repeated one once), in a fresh
    working folder, through the CLI in this process (the Python scripts too, as __main__; a bash script in a
    subprocess); each must exit 0."""
    from gpt2onnx.cli import app

    commands = [c for c in ALL_COMMANDS if c.page == page and c.exempt is None]
    workspace = workspace_for(base_folders, tmp_path / "work")
    monkeypatch.chdir(workspace)
    runner = CliRunner()
    lacking, done = [], set()
    for command in commands:
        args = substituted(command.argv, workspace)
        if tuple(args) in done:  # the same command shown twice on a page (the README's list, then its output)
            continue
        done.add(tuple(args))
        need = lacks(args)
        if need:
            lacking.append(f"{command.page}:{command.line} needs {need}")
            continue
        where = f"{command.page}:{command.line}: {command.text}\nran as: {shlex.join(args)}"
        if args[0] == "gpt2onnx":
            result = runner.invoke(app, args[1:], env={"COLUMNS": "120"})
            assert result.exit_code == 0, f"{where}\n{result.output}"
        elif args[0] == "python":  # a script of scripts/, in this process too (torch is loaded once)
            assert run_script(args[1:]) == 0, where
        else:
            proc = subprocess.run(args, cwd=workspace, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, f"{where}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    if lacking:
        missing("; ".join(lacking))


MACHINE_FOLDERS = re.compile(r"(?<![\w.$])/(?:tmp|work|root|home)/")


def test_no_page_names_a_folder_of_the_machine_it_was_written_on():
    """A command or path a user can follow: the repository's own, or $WORK (made by a command the page shows);
    never a folder of the machine a record was taken on. A Dockerfile's paths are inside its image."""
    found = []
    for page in PAGES:
        dockerfile = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("```"):
                dockerfile = line.strip() == "```dockerfile"
            if MACHINE_FOLDERS.search(line) and not dockerfile:
                found.append(f"{page.name}:{number}: {line.strip()[:100]}")
        if "$WORK" in page.read_text():
            assert "export WORK=" in page.read_text(), f"{page.name} uses $WORK without the command that makes it"
    assert found == []
