"""The bad-input corpus (tests/bad_input/, a module per command): hostile and careless input to every command. Each case
asserts the exit code (2 bad input, 1 failed check, 3 runtime unavailable, 4 cannot write), one line on stderr
with no traceback, that nothing was written or lost (its own folder and the shared model folders are hashed
before and after), and that no code from a model folder ran (no marker file anywhere in its folder).

Most cases run in this process through Typer's CliRunner (the same OneLineErrors.main a real run goes
through: SystemExit caught, stderr captured), one after another, each with its own folder as the working
directory. The cases that need a real process (``Case.process``: kill -9, concurrent exports, a full disk,
a FIFO or a device that could block, a prompt on stdin, a thread count that could hang) run meanwhile as
CLI subprocesses with a timeout and a memory cap, in a small thread pool. Each test then reads its case's
outcome.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import make_config, write_hf_folder, write_tokenizer

import gpt2onnx
from tests.bad_input import CASES
from tests.bad_input.common import MARKER, Case, Ctx, Outcome, finish, path_options
from tests.bad_input.outputs import OUTPUT_COMMANDS, output_options

REPO = Path(gpt2onnx.__file__).resolve().parent.parent  # the subprocesses import this copy of gpt2onnx
MEMORY_LIMIT = 3 << 30  # address space per CLI run: a case that allocates without bound fails fast, not the machine
WORKERS = 2  # subprocess cases at once, next to the in-process ones in the main thread
SHARED = ("src", "exp", "ext", "skv", "q4")  # the shared folders, in Ctx's order


class ExitCodeMismatch(AssertionError):
    """Raised last: everything but the exit code was right."""


def _params():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    for case in CASES:
        yield pytest.param(case, id=f"{case.cls}:{case.id}")


# -- hashing: what a folder holds, without following links or opening anything but regular files -------------
def snapshot(root: Path) -> dict[str, tuple]:
    found: dict[str, tuple] = {}
    if not root.exists() and not root.is_symlink():
        return found
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            info = path.lstat()
            key = str(path.relative_to(root))
            mode = stat.S_IMODE(info.st_mode)
            if stat.S_ISLNK(info.st_mode):
                found[key] = ("link", os.readlink(path))
            elif stat.S_ISREG(info.st_mode):
                found[key] = ("file", mode, hashlib.sha256(path.read_bytes()).hexdigest())
            elif stat.S_ISDIR(info.st_mode):
                found[key] = ("dir", mode)
            else:
                found[key] = ("special", stat.S_IFMT(info.st_mode))
    return found


def _diff(before: dict, after: dict, allowed: tuple[str, ...] = ()) -> list[str]:
    def kept(key: str) -> bool:
        return not any(key == a or key.startswith(a + os.sep) for a in allowed)

    changes = [f"lost {k}" for k in before if k not in after and kept(k)]
    changes += [f"wrote {k}" for k in after if k not in before and kept(k)]
    changes += [f"changed {k}" for k in before if k in after and before[k] != after[k] and kept(k)]
    return changes


# -- running the CLI ------------------------------------------------------------------------------------------
def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTEST"))}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(home),
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(REPO),
        COLUMNS="200",
        NO_COLOR="1",
        TERM="dumb",
        OMP_NUM_THREADS="1",
    )
    return env


def _limit_memory() -> None:
    """In each case's process, before it starts: the memory cap, and Ctrl-C (SIGINT) as a user's terminal delivers
    it. A test run started in the background by a shell ignores SIGINT, and an ignored signal stays ignored across
    exec: the cases that stop `serve` with Ctrl-C would then wait for it forever."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# Capabilities that let root pass the file permission checks, dropped from the bounding set of a case's process
# run as an unprivileged user: exec then grants uid 0 none of them (linux/capability.h, linux/prctl.h).
_PERMISSION_CAPABILITIES = {"CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3}
_PR_CAPBSET_DROP = 24


def _unprivileged() -> None:
    """In a case's process run as an unprivileged user: as _limit_memory, and where the tests run as root, root
    without the capabilities that pass permission checks. It keeps its uid (the case's files are its own, this
    interpreter under /root stays reachable where a new account could not reach it) and gets every EACCES an
    unprivileged user gets: read-only files and folders, another user's private folder, a home it cannot write."""
    _limit_memory()
    if os.geteuid() == 0:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        for name, number in _PERMISSION_CAPABILITIES.items():
            if libc.prctl(_PR_CAPBSET_DROP, number, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), f"cannot drop {name}")


def make_cli(env: dict[str, str], timeout: float):
    def cli(argv, ctx: Ctx, *, wait: bool = True, unprivileged: bool = False, env_changes: dict | None = None):
        """``unprivileged``: run as a user without root's permission bypass (skipped where that cannot be
        arranged). ``env_changes``: variables set, or removed where the value is None."""
        run_env = {**env, **{k: v for k, v in (env_changes or {}).items() if v is not None}}
        for name in [k for k, v in (env_changes or {}).items() if v is None]:
            run_env.pop(name, None)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gpt2onnx", *argv],
                cwd=ctx.dir,
                env=run_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
                preexec_fn=_unprivileged if unprivileged else _limit_memory,
            )
        except subprocess.SubprocessError as err:
            pytest.skip(f"cannot run a process without root's permission capabilities here ({err})")
        return finish(proc, timeout) if wait else proc

    return cli


def run_in_process(argv: list[str], ctx: Ctx, home: Path) -> Outcome:
    """The CLI in this process: Typer's CliRunner around the same entry point (OneLineErrors.main), with the
    case's folder as the working directory. An exception that escapes is reported as a traceback."""
    from typer.testing import CliRunner

    from gpt2onnx.cli import app

    cwd = os.getcwd()
    os.chdir(ctx.dir)
    try:
        result = CliRunner().invoke(app, argv, env={"HF_HOME": str(home), "COLUMNS": "200", "NO_COLOR": "1"})
    finally:
        os.chdir(cwd)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return Outcome(result.exit_code, result.stdout, stderr)


class Result:
    def __init__(self, outcome=None, before=None, after=None, error=None, skipped=None):
        self.outcome, self.before, self.after, self.error, self.skipped = outcome, before, after, error, skipped


def _run_case(case: Case, ctx: Ctx, env: dict[str, str], home: Path) -> Result:
    start = time.monotonic()
    result = _run_case_timed(case, ctx, env, home)
    result.seconds = time.monotonic() - start
    return result


def _run_case_timed(case: Case, ctx: Ctx, env: dict[str, str], home: Path) -> Result:
    try:
        if case.setup:
            case.setup(ctx)
        before = snapshot(ctx.dir)
        cli = make_cli(env, case.timeout)
        argv = [a.format(**{k: getattr(ctx, k) for k in SHARED}, dir=ctx.dir) for a in case.argv]
        if case.run:
            outcome = case.run(ctx, cli)
        elif case.process:
            outcome = cli(argv, ctx)
        elif case.inject:
            with case.inject(ctx):
                outcome = run_in_process(argv, ctx, home)
        else:
            outcome = run_in_process(argv, ctx, home)
        return Result(outcome, before, snapshot(ctx.dir))
    except pytest.skip.Exception as skip:
        return Result(skipped=str(skip))
    except BaseException as err:  # reported by the case's own test
        return Result(error=err)


# -- shared models and the parallel run -----------------------------------------------------------------------
@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.precisions.quantize_options import QuantizeOptions

    root = tmp_path_factory.mktemp("bad-input-shared")
    src = write_hf_folder(root / "src", make_config("h4-v1000"))
    write_tokenizer(src)
    exp = export(str(src), root / "exp").folder
    ext = export(str(src), root / "ext", options=ExportOptions(external_data=True, validate=False)).folder
    skv = export(str(src), root / "skv", options=ExportOptions(fusion="ort-shared-kv", validate=False)).folder
    q4 = export(
        str(src), root / "q4", options=ExportOptions(quantization=QuantizeOptions("int4"), validate=False)
    ).folder
    return {"src": src, "exp": exp, "ext": ext, "skv": skv, "q4": q4, "home": root / "hf-home"}


@pytest.fixture(scope="session")
def outcomes(request, shared, tmp_path_factory):
    """Every selected case, run in parallel; then the shared folders are checked to be as they were."""
    selected = [
        item.callspec.params["case"]
        for item in request.session.items
        if getattr(item, "callspec", None) and isinstance(item.callspec.params.get("case"), Case)
    ]
    shared_before = {k: snapshot(shared[k]) for k in SHARED}
    env = _env(shared["home"])
    cases_root = tmp_path_factory.mktemp("bad-input-cases")
    contexts = {}
    for case in selected:
        (cases_root / case.id).mkdir()
        contexts[case.id] = Ctx(cases_root / case.id, *(shared[k] for k in SHARED))
    # Real processes in a pool (slow ones first), and meanwhile the in-process cases one after another here.
    spawned = sorted((c for c in selected if c.run or c.process), key=lambda c: -(c.timeout + (100 if c.run else 0)))
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {case.id: pool.submit(_run_case, case, contexts[case.id], env, shared["home"]) for case in spawned}
        results = {c.id: _run_case(c, contexts[c.id], env, shared["home"]) for c in selected if c.id not in futures}
        results.update({cid: f.result() for cid, f in futures.items()})
    shared_after = {k: snapshot(shared[k]) for k in SHARED}
    for cid in results:
        results[cid].shared_changes = [
            f"{k}: {d}" for k in shared_before for d in _diff(shared_before[k], shared_after[k])
        ]
    report = {  # what each case did, for whoever fixes the gaps: basetemp/bad-input-report.json
        cid: {
            "seconds": round(getattr(r, "seconds", 0), 1),
            "code": r.outcome.code if r.outcome else None,
            "stderr": (r.outcome.stderr if r.outcome else repr(r.error or r.skipped))[-400:],
        }
        for cid, r in results.items()
    }
    (tmp_path_factory.getbasetemp() / "bad-input-report.json").write_text(json.dumps(report, indent=1))
    yield results, contexts
    for ctx in contexts.values():  # the cases that made folders read-only or mounted a tmpfs
        for path in [ctx.dir, *ctx.dir.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
    shutil.rmtree(cases_root, ignore_errors=True)


@pytest.mark.parametrize("case", list(_params()))
def test_bad_input(case: Case, outcomes):
    results, contexts = outcomes
    result, ctx = results[case.id], contexts[case.id]
    if result.skipped:
        pytest.skip(result.skipped)
    if result.error is not None:
        raise result.error
    out = result.outcome
    assert out.code is not None, f"no answer within {case.timeout:.0f} s (hang); stderr: {out.stderr[-300:]!r}"
    assert "Traceback" not in out.stderr + out.stdout, f"traceback:\n{out.stderr[-2000:]}"
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    if out.code != 0:
        assert len(lines) == 1 and lines[0].startswith("error: "), (
            f"not one 'error: ' line on stderr:\n{out.stderr[-2000:]}"
        )
        if case.match:
            assert re.search(case.match, lines[0]), f"error line does not match {case.match!r}: {lines[0]}"
        if case.absent:
            assert not re.search(case.absent, lines[0]), f"error line matches {case.absent!r}: {lines[0]}"
    changes = _diff(result.before, result.after, case.creates)
    assert not changes, f"files written or lost in the case folder: {changes[:10]}"
    assert not result.shared_changes, f"shared model folders changed: {result.shared_changes[:10]}"
    assert not list(ctx.dir.rglob(MARKER)), "code from a model folder ran"  # every case: no code ran
    if case.check:
        case.check(ctx, out)
    expected = case.code if isinstance(case.code, tuple) else (case.code,)
    if out.code not in expected:
        first = lines[0] if lines else out.stderr[-300:]
        raise ExitCodeMismatch(f"exit code {out.code}, expected {' or '.join(map(str, expected))}; stderr: {first}")


def test_the_corpus_covers_every_command_and_class():
    commands = {c.argv[0] for c in CASES if c.argv} | {"export"}  # the fault-injection rows run export
    assert commands == {
        "export",
        "optimize",
        "inspect",
        "generate",
        "parity",
        "bench",
        "deploy",
        "eval",
        "serve",
        "check",
        "compare",
    }
    assert {c.cls for c in CASES} == {"security", "data-loss", "hang", "silent", "traceback", "message", "options"}
    assert len(CASES) >= 160


# the path parameters commands read (every other path parameter is an output, fed the hostile set above)
INPUT_PATHS = {
    ("bench", "draft"),
    ("bench", "folders"),
    ("check", "draft"),
    ("check", "folder"),
    ("check", "json_schema"),
    ("check", "grammar"),
    ("deploy", "folder"),
    ("deploy", "web_lib"),
    ("eval", "folders"),
    ("eval", "text"),
    ("export", "eval_text"),
    ("export", "adapter"),  # a PEFT adapter folder, read
    ("generate", "folder"),
    ("generate", "draft"),
    ("generate", "json_schema"),
    ("generate", "grammar"),
    ("inspect", "path"),
    ("optimize", "eval_text"),
    ("optimize", "source"),
    ("parity", "folder"),
    ("parity", "text"),
    ("serve", "folder"),
    ("bench memory", "folders"),
    ("bench generate", "folder"),
    ("bench speculative", "folder"),
    ("bench speculative", "draft"),
    ("bench constraint", "folder"),
    ("bench constraint", "json_schema"),
    ("bench constraint", "grammar"),
    ("bench precision", "text"),
    ("bench precision", "model"),
    ("compare", "model"),
    ("bench served", "folder"),
    ("bench served", "gguf"),
    ("bench served", "llama_server"),
    ("bench web", "folder"),
    ("compare", "text"),
}


def test_every_output_option_is_fed_the_hostile_paths():
    """Every option naming a path a command writes is declared with the OutputPath parser (so the corpus finds it
    and feeds it the same hostile set), and every other path parameter is one the command reads."""
    outputs = output_options()
    assert {(command, option) for command, option, _ in outputs} == set(OUTPUT_COMMANDS)
    paths = path_options()
    unclassified = [p for p, written in paths.items() if not written and p not in INPUT_PATHS]
    assert not unclassified, f"path options neither read (INPUT_PATHS) nor declared as outputs: {unclassified}"
    fed = {c.id.split("-")[1] for c in CASES if c.id.startswith("output-")}
    assert fed == {command for command, _, _ in outputs}
