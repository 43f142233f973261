"""gpt2onnx inspect: damaged folders, and stdout on a full device."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Callable

from tests.bad_input.common import (
    EXIT_OUTPUT,
    B,
    Case,
    Ctx,
    Outcome,
    export_copy,
    fifo,
    manifest_edit,
    manifest_file_name,
    swap_model,
)


def truncate(name: str) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        path = folder / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    return edit


CASES: list[Case] = [
    Case(
        "inspect-dev-zero",
        "hang",
        ("inspect", "/dev/zero"),
        B,
        match="regular file|not a file",
        timeout=60,
        process=True,
    ),
    Case(
        "inspect-fifo",
        "hang",
        ("inspect", "pipe.onnx"),
        B,
        fifo,
        match="regular file|not a file",
        timeout=20,
        process=True,
    ),
    Case("swapped-model-inspect", "silent", ("inspect", "m"), B, export_copy(swap_model), match="model.onnx"),
    Case("swapped-model-no-verify", "silent", ("inspect", "m", "--no-verify-files"), 0, export_copy(swap_model)),
    Case(
        "inspect-truncated-data",
        "silent",
        ("inspect", "m"),
        B,
        export_copy(truncate("model.onnx_data"), what="ext"),
        match="model.onnx_data",
    ),
    Case("inspect-config-json", "traceback", ("inspect", "{src}/config.json"), B, match="config.json"),
]


def stdout_full(c: Ctx, cli) -> Outcome:
    """stdout on a full device (/dev/full): one line on stderr, exit 4."""
    import sys

    import pytest

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    from test_bad_input import REPO, _env, _limit_memory  # noqa: F401 - the runner's own environment

    with open("/dev/full", "w") as full:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpt2onnx", "inspect", str(c.exp)],
            cwd=c.dir,
            env=_env(c.dir / "hf"),
            stdin=subprocess.DEVNULL,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            err = proc.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return Outcome(None, "", proc.communicate()[1])
        return Outcome(proc.returncode, "", err)


CASES += [
    Case(
        "manifest-name-dotdot",
        "security",
        ("inspect", "m"),
        B,
        export_copy(manifest_file_name("model.onnx/../../secret")),
        match="not a plain file name",
    ),
    Case(
        "manifest-files-garbage",
        "traceback",
        ("inspect", "m"),
        B,
        export_copy(manifest_edit(files={"model.onnx": "x"})),
        match="model.onnx",
    ),
    Case("stdout-full", "traceback", (), EXIT_OUTPUT, run=stdout_full, match="stdout|output", timeout=60),
]


CASES += [
    Case("markup-in-a-folder-name", "message", ("inspect", "[red]nope[/]"), B, match=r"'\[red\]nope\[/\]'"),
]
