"""gpt2onnx optimize: the folder it reads and the precisions, fusions and gates it is asked for."""

from __future__ import annotations

import contextlib
import os
import subprocess

from tests.bad_input.common import EXIT_OUTPUT, B, Case, Ctx, F, Outcome, export_copy

CASES: list[Case] = [
    Case(
        "optimize-onto-cwd",
        "data-loss",
        ("optimize", "m", "-o", ".", "--force"),
        B,
        export_copy(),
        match="working directory|source",
    ),
    Case("optimize-onto-source", "data-loss", ("optimize", "m", "-o", "m", "--force"), B, export_copy()),
    Case(
        "optimize-fusion-none", "traceback", ("optimize", "{exp}", "-o", "out", "--fusion", "none"), B, match="fusion"
    ),
    Case(
        "optimize-data-missing",
        "traceback",
        ("optimize", "m", "-o", "out"),
        B,
        export_copy(lambda f: (f / "model.onnx_data").unlink(), what="ext"),
        match="model.onnx_data",
    ),
    Case("optimize-config-json", "traceback", ("optimize", "{src}/config.json", "-o", "out"), B, match="config.json"),
    Case("optimize-fusion-bogus", "message", ("optimize", "{exp}", "-o", "out", "--fusion", "bogus"), B, match="bogus"),
]


CASES += [
    Case(
        "force-foreign-folder-beside",
        "data-loss",
        ("optimize", "{exp}", "-o", "out", "--force"),
        B,
        lambda c: (c.copy("exp", "out"), (c.dir / "out/photos").mkdir()),
        match="photos",
    ),
    Case(
        "optimize-block-size-without-int4",
        "options",
        ("optimize", "{exp}", "-o", "out", "--block-size", "16"),
        B,
        match="--block-size",
    ),
    Case(
        "optimize-partial-fusion-none",
        "options",
        ("optimize", "{exp}", "-o", "out", "--fusion", "none", "--quantize", "int8", "--allow-partial-fusion"),
        B,
        match="--allow-partial-fusion",
    ),
    Case(
        "optimize-error-names-no-staging-folder",
        "message",
        ("optimize", "{exp}", "-o", "out", "--fusion", "none", "--quantize", "int8", "--gate", "kl_mean=1e-12"),
        F,
        absent=r"\.tmp-",
    ),
]


def full_disk_optimize(c: Ctx, cli) -> Outcome:
    """optimize onto a tmpfs that is already full: not even the lock file's first line fits. One line naming what
    could not be written, and nothing left on the disk but what was there (no .out.lock)."""
    import pytest

    disk = c.dir / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a full disk needs a small tmpfs, and mounting one needs root")
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)]
    mounted = subprocess.run(mount, capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()[:100]})")
    try:
        with contextlib.suppress(OSError), open(disk / "filler", "wb") as filler:
            while True:
                filler.write(b"\0" * 4096)
                filler.flush()
        out = cli(["optimize", str(c.exp), "-o", "disk/out"], c)
        left = sorted(p.name for p in disk.iterdir())
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert left == ["filler"], f"left on the full disk: {left}"
    return out


CASES += [
    Case(
        "optimize-full-disk",
        "data-loss",
        (),
        EXIT_OUTPUT,
        run=full_disk_optimize,
        creates=("disk",),
        timeout=240,
        match="disk/.out.lock.*(space|No space)",
        absent="stdout",
    ),
]


CASES += [
    Case(
        "optimize-int4-into-int8",  # once: "the quantized weight 'wpe.weight' has no source weight"
        "message",
        ("optimize", "{q4}", "-o", "o", "--quantize", "int8"),
        B,
        match="optimize the fp32 folder it was made from",
    ),
    Case(
        "optimize-int4-into-gptq",
        "message",
        ("optimize", "{q4}", "-o", "o", "--quantize", "int4", "--algorithm", "gptq"),
        B,
        match="optimize the fp32 folder it was made from",
        absent="lm-head",
    ),
    Case(
        "calibration-emoji-code-name",  # rich once showed 'x:b:y.txt' as 'x🅱y.txt'
        "message",
        ("optimize", "{exp}", "-o", "o", "--quantize", "int4", "--algorithm", "gptq", "--calibration", "x:b:y.txt"),
        B,
        match=r"'x:b:y\.txt'",
    ),
]
