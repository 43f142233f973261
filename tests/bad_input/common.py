"""The bad-input corpus: every case is one row of CASES, run by tests/test_bad_input.py: in process through
Typer's CliRunner, or as a real CLI subprocess where the fault needs one (``process`` or ``run``).

A row says what is set up (files in the case's own folder, which is also the working directory), the command
line, the exit code the CLI must give (EXIT_BAD_INPUT for bad arguments or input files, EXIT_CHECK_FAILED for a
failed validation or parity gate, EXIT_RUNTIME for a provider that cannot run here) and, optionally, a pattern
the one-line error must match. The runner also checks that stderr is that one line, with no traceback, and that
no file was written or lost anywhere it can see.

Placeholders in the command line: {src} a tiny Hugging Face checkpoint with tokenizer files, {exp} its export,
{ext} an export with external data, {skv} one with the shared K/V cache (ort-shared-kv), {q4} one in int4 (all
shared, read-only), {dir} the case's folder.

"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

EXIT_BAD_INPUT = 2  # bad arguments or input files: fix the command line or the files
EXIT_CHECK_FAILED = 1  # the input was fine, but a validation or parity gate failed
EXIT_RUNTIME = 3  # a runtime or execution provider that cannot be used on this machine
EXIT_OUTPUT = 4  # an output that cannot be written: a full disk, a folder another run is writing


@dataclass
class Ctx:
    dir: Path
    src: Path
    exp: Path
    ext: Path
    skv: Path | None = None  # an ort-shared-kv export (GroupQueryAttention)
    q4: Path | None = None  # an int4 export

    def copy(self, what: str, name: str) -> Path:
        return Path(shutil.copytree(getattr(self, what), self.dir / name, symlinks=True))


@dataclass
class Outcome:
    code: int | None  # None: killed at the timeout
    stdout: str
    stderr: str


@dataclass(frozen=True)
class Case:
    id: str
    cls: str  # security, data-loss, hang, silent, traceback, message, options
    argv: tuple[str, ...]
    code: int | tuple[int, ...]
    setup: Callable[[Ctx], None] | None = None
    match: str | None = None  # regex the error line must contain
    absent: str | None = None  # regex the error line must not contain
    creates: tuple[str, ...] = ()  # paths under the case folder a correct run may write
    check: Callable[[Ctx, Outcome], None] | None = None  # extra assertions after the run
    run: Callable[[Ctx, Callable], Outcome] | None = None  # a fault injected for real, instead of one CLI run
    timeout: float = 120  # subprocess cases: killed (a hang) after this many seconds
    process: bool = False  # needs a real process: could block or hang, or reads stdin
    inject: Callable[[Ctx], object] | None = None  # in-process cases: a context manager around the run (a fault)


# -- set-up helpers ---------------------------------------------------------------------------------------------
def _config_dict() -> dict:
    from conftest import make_config

    return make_config("h4-v1000").to_dict()


def config_file(name: str = "config.json", raw=None, **changes) -> Callable[[Ctx], None]:
    """A config.json in the case folder: the tiny config with ``changes``, or ``raw`` JSON text."""

    def setup(c: Ctx) -> None:
        text = raw if raw is not None else json.dumps({**_config_dict(), **changes})
        (c.dir / name).write_text(text)

    return setup


def source_copy(**changes) -> Callable[[Ctx], None]:
    """A copy of the tiny checkpoint as 'm', its config.json changed."""

    def setup(c: Ctx) -> None:
        folder = c.copy("src", "m")
        if changes:
            path = folder / "config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return setup


MARKER = "code-from-the-folder-ran"
REMOTE_CODE = (
    f"open({MARKER!r}, 'w').write('x')\n"
    "from transformers import GPT2Config as EvilConfig, GPT2TokenizerFast as EvilTokenizer\n"
)


def no_marker(c: Ctx, out: Outcome) -> None:
    assert not list(c.dir.rglob(MARKER)), "code from the model folder ran"
    assert "pickle code ran" not in out.stdout + out.stderr, "code from a pickle ran"


def export_copy(edit: Callable[[Path], None] | None = None, what: str = "exp") -> Callable[[Ctx], None]:
    def setup(c: Ctx) -> None:
        folder = c.copy(what, "m")
        if edit:
            edit(folder)

    return setup


def swap_model(folder: Path) -> None:
    import onnx

    model = onnx.load(str(folder / "model.onnx"))
    model.producer_name = "someone else"
    onnx.save(model, str(folder / "model.onnx"))


def write(name: str, text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_text(text)


def edit_json(name: str, **changes) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        (folder / name).write_text(json.dumps({**json.loads((folder / name).read_text()), **changes}))

    return edit


def fifo(c: Ctx) -> None:
    os.mkfifo(c.dir / "pipe.onnx")


def readonly_dir(c: Ctx) -> None:
    (c.dir / "ro").mkdir()
    (c.dir / "ro").chmod(0o500)


def finish(proc: subprocess.Popen, timeout: float = 120) -> Outcome:
    """Wait for a CLI subprocess; past ``timeout`` its whole process group is killed (code None)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return Outcome(None, out, err)
    return Outcome(proc.returncode, out, err)


# -- the corpus -------------------------------------------------------------------------------------------------
B, F = EXIT_BAD_INPUT, EXIT_CHECK_FAILED


# -- round two (issue 22): the newer surfaces ---------------------------------------------------------------------
def rehash(folder: Path) -> None:
    """Make the manifest agree with the files again, as someone handing over a crafted folder would."""
    from gpt2onnx.files import sha256_file

    path = folder / "gpt2onnx.json"
    manifest = json.loads(path.read_text())
    for name in list(manifest["files"]):
        if (folder / name).is_file():
            manifest["files"][name] = {"bytes": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)}
    path.write_text(json.dumps(manifest))


def data_location(location: str, *, move: bool = True, link: bool = False, fifo: bool = False, list_it: bool = False):
    """A copy of the external-data export as 'm' whose graph names ``location`` ({dir}: the case folder) for its
    weights; ``move``: the data file goes to the case folder as outside.bin; ``link``: model.onnx_data becomes a
    link to it; ``fifo``: the location is a FIFO in the folder. The manifest is re-hashed (a crafted folder)."""

    def setup(c: Ctx) -> None:
        import onnx

        folder = c.copy("ext", "m")
        if move:
            shutil.move(folder / "model.onnx_data", c.dir / "outside.bin")
        if link:
            (folder / "model.onnx_data").symlink_to(c.dir / "outside.bin")
        if fifo:
            os.mkfifo(folder / location)
        model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
        for init in model.graph.initializer:
            for entry in init.external_data:
                if entry.key == "location":
                    entry.value = location.format(dir=c.dir)
        onnx.save(model, str(folder / "model.onnx"))
        rehash(folder)
        if list_it:
            manifest = json.loads((folder / "gpt2onnx.json").read_text())
            manifest["files"][location] = manifest["files"].pop("model.onnx_data")
            (folder / "gpt2onnx.json").write_text(json.dumps(manifest))

    return setup


CONSTRUCTOR_C = (
    "#include <stdio.h>\n__attribute__((constructor)) static void ran(void) {\n"
    f'  FILE *f = fopen("{MARKER}", "w"); if (f) {{ fputs("x", f); fclose(f); }}\n}}\n'
)


def genai_config_file(session: dict | None = None, decoder: dict | None = None, raw: str | None = None):
    """A copy of the export as 'm' with its own genai_config.json: ours with ``session`` options or ``decoder``
    fields changed, or ``raw`` text. ``session`` may name {lib}: a library in the folder whose constructor
    writes the marker (built with cc where there is one, else a file that is no library)."""

    def setup(c: Ctx) -> None:
        from gpt2onnx.artifact.genai_config import genai_config

        folder = c.copy("exp", "m")
        if raw is not None:
            (folder / "genai_config.json").write_text(raw)
            return
        lib = folder / "libevil.so"
        if shutil.which("cc"):
            (c.dir / "evil.c").write_text(CONSTRUCTOR_C)
            subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(c.dir / "evil.c")], check=True)
        else:
            lib.write_text("not a library")
        config = genai_config(folder)
        options = config["model"]["decoder"]["session_options"]
        options.update(
            {k: (v.format(lib=lib, dir=c.dir) if isinstance(v, str) else v) for k, v in (session or {}).items()}
        )
        config["model"]["decoder"].update(decoder or {})
        (folder / "genai_config.json").write_text(json.dumps(config))

    return setup


def manifest_edit(**changes) -> Callable[[Path], None]:
    return edit_json("gpt2onnx.json", **changes)


def manifest_file_name(name: str) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        manifest = json.loads((folder / "gpt2onnx.json").read_text())
        manifest["files"][name] = manifest["files"]["model.onnx"]
        (folder / "gpt2onnx.json").write_text(json.dumps(manifest))

    return edit


def other_checkpoint(**changes) -> Callable[[Ctx], None]:
    """'other': a checkpoint of a different architecture from the shared one."""

    def setup(c: Ctx) -> None:
        from conftest import make_config, write_hf_folder

        config = make_config("h4-v1000")
        for key, value in changes.items():
            setattr(config, key, value)
        write_hf_folder(c.dir / "other", config)

    return setup


def _user_things(c: Ctx) -> None:
    folder = c.copy("exp", "m")
    (folder / "trt_cache").mkdir()
    (folder / "trt_cache" / "engine.bin").write_text("engine")
    (folder / "tokenizer-link").symlink_to("tokenizer.json")
    (folder / "notes.txt").write_text("mine")


def _deployed_with_user_things(c: Ctx) -> None:
    from gpt2onnx.targets.deploy import deploy

    _user_things(c)
    deploy(c.dir / "m", "genai")


BENCH_QUICK = ("--batch", "1", "--prompt-len", "4", "--new-tokens", "2", "--warmup", "0", "--repeat", "1")
MEMORY_QUICK = ("--batch", "1", "--prompt-len", "4", "--new-tokens", "2")
SPEC_QUICK = ("--prompt-lookup", "2", "--new-tokens", "2", "--warmup", "0", "--repeat", "1")
COST_QUICK = ("--choice", "a,b", "--new-tokens", "2", "--warmup", "0", "--repeat", "1")  # bench constraint
GEN = ("--ids", "1,2", "--max-new-tokens", "2")


def int8_export(c: Ctx) -> None:
    """An int8 export of the tiny checkpoint as 'm' (per-token uint8 activations, MatMulInteger), not validated."""
    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.precisions.quantize_options import QuantizeOptions

    export(str(c.src), c.dir / "m", options=ExportOptions(quantization=QuantizeOptions("int8"), validate=False))


# -- round three (issue 30): one output rule, serve, graph facts over manifest claims, numbers, bounded text --------
def _parameters():
    """(command, parameter name, option name, its typer info, its type) for every parameter of every command."""
    import inspect
    import typing

    from gpt2onnx.cli import app
    from gpt2onnx.cli.app import DefaultedGroup

    commands = [(c.name or c.callback.__name__, c) for c in app.registered_commands]
    for group in app.registered_groups:  # bench memory; bench run as bench, its default
        for c in group.typer_instance.registered_commands:
            sub = c.name or c.callback.__name__
            commands.append((group.name if sub == DefaultedGroup.default else f"{group.name} {sub}", c))
    for name, command in commands:
        for param in inspect.signature(command.callback, eval_str=True).parameters.values():
            args = typing.get_args(param.annotation)
            info = next((m for m in args[1:] if hasattr(m, "parser")), None)
            if info is None:
                continue
            decls = [d for d in (info.default, *(info.param_decls or ())) if isinstance(d, str) and d[:2] == "--"]
            yield name, param.name, decls[0] if decls else f"--{param.name.replace('_', '-')}", info, args[0]


def path_options() -> dict[tuple[str, str], bool]:
    """Every (command, parameter) whose value is a path, read or written: True where it is declared an output."""
    import typing

    from gpt2onnx.cli import OutputPath

    def is_path(kind) -> bool:
        return kind is Path or any(is_path(k) for k in typing.get_args(kind))

    return {
        (command, name): isinstance(info.parser, OutputPath)
        for command, name, _, info, kind in _parameters()
        if is_path(kind)
    }


# -- generation numbers: one typed reader -----------------------------------------------------------------------
def _generation_raw(**raw: str) -> Callable[[Ctx], None]:
    """A copy of the export as 'm' whose generation_config.json holds ``raw`` JSON values (NaN, Infinity, 1e30)."""

    def setup(c: Ctx) -> None:
        folder = c.copy("exp", "m")
        path = folder / "generation_config.json"
        text = path.read_text().rstrip().rstrip("}").rstrip()
        path.write_text(text + "".join(f',\n  "{k}": {v}' for k, v in raw.items()) + "\n}\n")

    return setup


def rehash_all(folder: Path) -> None:
    """List every top-level file in the manifest again, hashed (a folder handed over as it is)."""
    from gpt2onnx.files import sha256_file

    path = folder / "gpt2onnx.json"
    manifest = json.loads(path.read_text())
    manifest["files"] = {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != "gpt2onnx.json"
    }
    path.write_text(json.dumps(manifest))


PREVIOUS = b'{"the": "previous report"}\n'


def _interrupted(argv: tuple[str, ...], outputs: tuple[str, ...]) -> Callable[[Ctx, Callable], Outcome]:
    """``argv`` writing ``outputs`` (--json, --plot), each already there. Ctrl-C 3 s in, while it works: exit code
    130, every output as it was, no staging file. Ctrl-C again and again from the moment it starts writing them
    to its end: all of them whole and new, no traceback of an interrupted interpreter shutdown. Returns the second
    run."""

    def run(c: Ctx, cli) -> Outcome:
        words = ("the", "cat", "sat", "on", "a", "mat", "and", "ran", "far", "away")
        (c.dir / "t.txt").write_text(" ".join(words[(i * 7) % 10] for i in range(6000)))
        args = [a.format(exp=c.exp) for a in argv]

        def as_before() -> bool:
            return all((c.dir / name).read_bytes() == PREVIOUS for name in outputs)

        for name in outputs:
            (c.dir / name).write_bytes(PREVIOUS)
        proc = cli(args, c, wait=False)
        time.sleep(3)
        assert proc.poll() is None, "the command ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        first = finish(proc, 60)
        assert first.code == 130, (first.code, first.stderr[-500:])
        assert "Traceback" not in first.stderr, first.stderr[-2000:]
        assert as_before(), "an interrupted command replaced its output"
        assert sorted(p.name for p in c.dir.iterdir()) == sorted([*outputs, "t.txt"])

        proc = cli(args, c, wait=False)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if any(c.dir.glob(".*.*")) or not as_before():  # a staging file, or a file replaced
                break
            time.sleep(0.001)
        while proc.poll() is None:  # Ctrl-C from the start of the writing to the process's end
            proc.send_signal(signal.SIGINT)
            time.sleep(0.02)
        out = finish(proc, 60)
        if out.code == 0:
            assert all((c.dir / name).read_bytes() != PREVIOUS for name in outputs), "a finished run kept an old output"
            json.loads((c.dir / outputs[0]).read_text())
        else:
            assert as_before(), "an interrupted command replaced its output"
        assert sorted(p.name for p in c.dir.iterdir()) == sorted([*outputs, "t.txt"])
        return out

    return run


# -- round five (issue 47) -----------------------------------------------------------------------------------------
def _int4_external(c: Ctx) -> None:
    """An int4 export whose weights are in an external data file (deploy hard-links that file into its targets)."""
    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.precisions.quantize_options import QuantizeOptions

    options = ExportOptions(quantization=QuantizeOptions("int4"), external_data=True, validate=False)
    export(str(c.src), c.dir / "q", options=options)


# -- round six: check answers what the command does ----------------------------------------------------------------
def _og_deployed(c: Ctx) -> None:
    """'og': the shared export deployed for ort-generate (its ops' attributes: greedy's, sampling's defaults)."""
    from typer.testing import CliRunner

    from gpt2onnx.cli import app

    result = CliRunner().invoke(app, ["deploy", str(c.exp), "--target", "ort-generate", "-o", str(c.dir / "og")])
    assert result.exit_code == 0, result.output


def _work_record(name: str, kind: str) -> Callable[[Ctx], None]:
    """'w' holding its record ``name`` as ``kind``: a FIFO, a link to /dev/zero, a folder, or none beside a
    build found there ('gpt2onnx-fp32' for compare, 'fp32' for the grid: an export of the case's checkpoint)."""

    def setup(c: Ctx) -> None:
        (c.dir / "w").mkdir()
        (c.dir / "t.txt").write_text("Hello, world. " * 40)
        record = c.dir / "w" / name
        if kind == "fifo":
            os.mkfifo(record)
        elif kind == "dev-zero":
            record.symlink_to("/dev/zero")
        elif kind == "folder":
            record.mkdir()
        else:
            shutil.copytree(c.exp, c.dir / "w" / kind, symlinks=True)

    return setup
