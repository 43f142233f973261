"""Commands run as another user (nobody): private files, read-only folders, telemetry."""

from __future__ import annotations

import os
from typing import Callable

from tests.bad_input.common import EXIT_OUTPUT, B, Case, Ctx, Outcome

# -- round four's leftovers: an unprivileged user, Ctrl-C at the end of eval, serve decides per request -----------
# ``cli(..., unprivileged=True)``: the case's process cannot pass permission checks (test_bad_input._unprivileged):
# the case folder's files are its own, a folder given to NOBODY is another user's.
NOBODY = 65534


def _as_user(argv: tuple[str, ...], *, home: bool = False, check=None) -> Callable[[Ctx, Callable], Outcome]:
    """``argv`` run by an unprivileged user; ``home``: with a home it may not write (the case's 'home', 0555) and
    onnxruntime's telemetry as onnxruntime has it, on (no ORT_DISABLE_TELEMETRY from this process)."""

    def run(c: Ctx, cli) -> Outcome:
        changes = {}
        if home:
            (c.dir / "home").mkdir()
            (c.dir / "home").chmod(0o555)
            changes = {"HOME": str(c.dir / "home"), "XDG_CACHE_HOME": None, "ORT_DISABLE_TELEMETRY": None}
        args = [a.format(exp=c.exp, dir=c.dir) for a in argv]
        out = cli(args, c, unprivileged=True, env_changes=changes)
        if check:
            check(c, out)
        return out

    return run


def _no_stderr(c: Ctx, out: Outcome) -> None:
    assert out.stderr.strip() == "", f"a run that succeeded printed on stderr: {out.stderr[-500:]!r}"


def _private_folder(c: Ctx) -> None:
    """'priv', another user's private folder (0700), holding a model folder and a text."""
    c.copy("exp", "priv/m")
    (c.dir / "priv" / "t.txt").write_text("some text to evaluate on")
    for path in [c.dir / "priv", *(c.dir / "priv").rglob("*")]:
        os.chown(path, NOBODY, NOBODY)
    (c.dir / "priv").chmod(0o700)


def _read_only_copy(c: Ctx) -> None:
    """'m', the user's export made read-only (chmod -R a-w m): its files and the folder itself."""
    folder = c.copy("exp", "m")
    for path in [*folder.rglob("*"), folder]:
        path.chmod(path.stat().st_mode & ~0o222)


def _read_only_subfolder(c: Ctx) -> None:
    """'m' with the user's own read-only sub-folder trt_cache/ (deploy carries it) and read-only files."""
    folder = c.copy("exp", "m")
    (folder / "trt_cache").mkdir()
    (folder / "trt_cache" / "engine.bin").write_bytes(b"engine")
    for path in [*folder.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)


def _foreign_subfolder(c: Ctx) -> None:
    """'m' holding another user's sub-folder (trt_cache/, owned by NOBODY, 0755) that the user cannot empty."""
    folder = c.copy("exp", "m")
    (folder / "trt_cache").mkdir()
    (folder / "trt_cache" / "engine.bin").write_bytes(b"engine")
    for path in (folder / "trt_cache", folder / "trt_cache" / "engine.bin"):
        os.chown(path, NOBODY, NOBODY)


def _deployed_in_place(c: Ctx, out: Outcome) -> None:
    assert (c.dir / "m" / "genai_config.json").is_file(), sorted(p.name for p in (c.dir / "m").iterdir())
    left = sorted(p.name for p in c.dir.iterdir() if p.name.startswith("."))
    assert left == [], f"left beside the folder: {left}"


def _carried_read_only(c: Ctx, out: Outcome) -> None:
    _deployed_in_place(c, out)
    assert (c.dir / "m" / "trt_cache" / "engine.bin").read_bytes() == b"engine"


def _nothing_beside(c: Ctx, out: Outcome) -> None:
    left = sorted(p.name for p in c.dir.iterdir() if p.name.startswith("."))
    assert left == [], f"left beside the folder: {left}"


def _no_work_done(c: Ctx, out: Outcome) -> None:
    assert out.stdout.strip() == "", f"the command worked before refusing its --json: {out.stdout[:200]!r}"


CASES: list[Case] = [
    Case(
        "unprivileged-telemetry-success",
        "message",
        (),
        0,
        run=_as_user(("generate", "{exp}", "--ids", "1,2", "--max-new-tokens", "1"), home=True, check=_no_stderr),
        creates=("home",),
    ),
    Case(
        "unprivileged-telemetry-error",
        "message",
        (),
        B,
        run=_as_user(("generate", "nope", "--ids", "1,2"), home=True),
        creates=("home",),
        match="does not exist",
    ),
    *(
        Case(
            f"unprivileged-private-{name}",
            "traceback",
            (),
            B,
            _private_folder,
            run=_as_user(argv),
            match=f"cannot use '{where}' \\(Permission denied\\)",
        )
        for name, argv, where in (
            ("model-json", ("generate", "priv/m", "--ids", "1,2", "--json", "e.json"), "priv/m"),
            ("inspect", ("inspect", "priv/m"), "priv/m"),
            ("deploy", ("deploy", "priv/m", "--target", "genai"), "priv/m"),
            ("serve", ("serve", "priv/m", "--port", "0"), "priv/m"),
            ("eval-text", ("eval", "{exp}", "--text", "priv/t.txt"), "priv/t.txt"),
        )
    ),
    Case(
        "unprivileged-json-read-only-folder",
        "data-loss",
        (),
        EXIT_OUTPUT,
        lambda c: ((c.dir / "ro").mkdir(), (c.dir / "ro").chmod(0o555)),
        run=_as_user(("generate", "{exp}", "--ids", "1,2", "--json", "ro/e.json"), check=_no_work_done),
        match="ro/e.json.*its folder 'ro' is not writable",
    ),
    Case(
        "unprivileged-deploy-read-only-folder",
        "data-loss",
        (),
        0,
        _read_only_copy,
        run=_as_user(("deploy", "m", "--target", "genai")),
        creates=("m",),
        check=_deployed_in_place,
    ),
    Case(
        "unprivileged-deploy-read-only-subfolder",
        "data-loss",
        (),
        0,
        _read_only_subfolder,
        run=_as_user(("deploy", "m", "--target", "genai")),
        creates=("m",),
        check=_carried_read_only,
    ),
    Case(
        "unprivileged-deploy-foreign-subfolder",
        "data-loss",
        (),
        EXIT_OUTPUT,
        _foreign_subfolder,
        run=_as_user(("deploy", "m", "--target", "genai")),
        match="'.*m/trt_cache' cannot be removed by this user",
        check=_nothing_beside,
    ),
]
