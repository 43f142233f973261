"""gpt2onnx export: checkpoints and configs refused, remote code never run, kill -9, Ctrl-C and
SIGTERM mid-export, a full disk."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from tests.bad_input.common import (
    EXIT_OUTPUT,
    REMOTE_CODE,
    B,
    Case,
    Ctx,
    F,
    Outcome,
    _deployed_with_user_things,
    config_file,
    finish,
    no_marker,
    source_copy,
)


def weights_edit(edit: Callable[[dict], None]) -> Callable[[Ctx], None]:
    """A copy of the tiny checkpoint as 'm' whose model.safetensors went through ``edit``."""

    def setup(c: Ctx) -> None:
        from safetensors.torch import load_file, save_file

        folder = c.copy("src", "m")
        tensors = load_file(str(folder / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    return setup


def sharded(weight_map) -> Callable[[Ctx], None]:
    """A copy of the tiny checkpoint as 'm' with a weight index instead of model.safetensors."""

    def setup(c: Ctx) -> None:
        folder = c.copy("src", "m")
        shutil.copy(folder / "model.safetensors", c.dir / "outside.safetensors")
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    return setup


def linked(name: str, target: str) -> Callable[[Ctx], None]:
    """A copy of the tiny checkpoint as 'm' whose ``name`` is a symbolic link to ``target`` ({dir}: case folder)."""

    def setup(c: Ctx) -> None:
        folder = c.copy("src", "m")
        secret = c.dir / "secret.txt"
        secret.write_text('{"a": 1}\n')
        secret.chmod(0o600)
        if name == "model.safetensors":
            shutil.move(folder / name, c.dir / "outside.safetensors")
        elif name == "config.json":
            shutil.move(folder / name, c.dir / "outside.json")
        else:
            (folder / name).unlink(missing_ok=True)
        (folder / name).symlink_to(target.format(dir=c.dir))

    return setup


class _Evil:
    def __reduce__(self):
        return (print, ("pickle code ran",))


def pickle_checkpoint(c: Ctx) -> None:
    import torch
    from safetensors.torch import load_file

    folder = c.copy("src", "m")
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    tensors["evil"] = _Evil()
    torch.save(tensors, folder / "pytorch_model.bin")


def remote_code_config(c: Ctx) -> None:
    folder = c.copy("src", "m")
    (folder / "evil.py").write_text(REMOTE_CODE)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilConfig"}
    (folder / "config.json").write_text(json.dumps(config))


def unrelated_folder(c: Ctx) -> None:
    (c.dir / "photos").mkdir()
    (c.dir / "photos" / "holiday.jpg").write_bytes(b"not a model")


# -- faults injected for real -----------------------------------------------------------------------------------
def _spawn(cli, argv: list[str], c: Ctx) -> subprocess.Popen:
    return cli(argv, c, wait=False)


def killed_export(c: Ctx, cli) -> Outcome:
    """kill -9 an export while its staging folder exists; the next export into that parent must remove it."""
    (c.dir / "out").mkdir()
    proc = _spawn(cli, ["export", "--model", "tiny", "--random-init", "-o", "out/a"], c)
    deadline = time.monotonic() + 90
    while not list((c.dir / "out").glob(".a.tmp-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert list((c.dir / "out").glob(".a.tmp-*")), "the export ended before its staging folder was seen"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    return cli(["export", "--model", "tiny", "--random-init", "--no-validate", "-o", "out/b"], c)


def no_stray_staging(c: Ctx, out: Outcome) -> None:
    left = sorted(p.name for p in (c.dir / "out").iterdir())
    assert left == ["b"], f"left in the parent after the next export: {left}"


def concurrent_exports(c: Ctx, cli) -> Outcome:
    """Two exports into one folder at once, without --force: one must win, the other must be refused."""
    argv = ["export", "--model", "tiny", "--random-init", "--no-validate", "-o", "same"]
    procs = [_spawn(cli, argv, c) for _ in range(2)]
    outcomes = sorted((finish(p) for p in procs), key=lambda o: (o.code != 0, o.code))
    winner, loser = outcomes
    assert winner.code == 0, f"neither export succeeded: {winner.stderr[-500:]}"
    return loser


def full_disk(c: Ctx, cli) -> Outcome:
    """An export onto a 256 KB tmpfs: the model (about 750 KB) cannot fit."""
    import pytest

    disk = c.dir / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a full disk needs a small tmpfs, and mounting one needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()[:100]})")
    try:
        out = cli(["export", "--model", "tiny", "--random-init", "--no-validate", "-o", "disk/model"], c)
        left = sorted(p.name for p in disk.iterdir())
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert left == [], f"left on the full disk: {left}"
    return out


def no_space_left(c: Ctx):
    """Every ONNX save fails as a full disk does (ENOSPC): the full-disk case where no tmpfs can be mounted."""
    import errno
    from unittest import mock

    return mock.patch("onnx.save_model", side_effect=OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))


EXPORT_TINY = ("export", "--model", "tiny", "--random-init")


CASES: list[Case] = [
    # -- security: no code from a model folder runs; files read only from inside the folder ----------------------
    Case(
        "auto-map-config-ignored",
        "security",
        ("export", "--model", "m", "-o", "out", "--no-validate"),
        0,
        remote_code_config,
        creates=("out",),
        check=no_marker,
    ),
    Case(
        "pickle-with-code",
        "security",
        ("export", "--model", "m", "-o", "out"),
        B,
        pickle_checkpoint,
        match="refused for safety.*safetensors",
        check=no_marker,
    ),
    Case(
        "vocab-link-outside",
        "security",
        ("export", "--model", "m", "-o", "out"),
        B,
        linked("vocab.json", "{dir}/secret.txt"),
        match="outside the model folder",
    ),
    Case(
        "merges-link-etc-passwd",
        "security",
        ("export", "--model", "m", "-o", "out"),
        B,
        linked("merges.txt", "/etc/passwd"),
        match="outside the model folder",
    ),
    Case(
        "weights-link-outside",
        "security",
        ("export", "--model", "m", "-o", "out"),
        B,
        linked("model.safetensors", "{dir}/outside.safetensors"),
        match="outside the model folder",
    ),
    Case(
        "index-dotdot-shard",
        "security",
        ("export", "--model", "m", "-o", "out"),
        B,
        sharded({"transformer.wte.weight": "../outside.safetensors"}),
        match="not a file name inside the folder",
    ),
    Case(
        "index-absolute-shard",
        "security",
        ("export", "--model", "m", "-o", "out"),
        B,
        lambda c: sharded({"transformer.wte.weight": str(c.dir / "outside.safetensors")})(c),
        match="not a file name inside the folder",
    ),
    Case(
        "index-weight-map-list",
        "traceback",
        ("export", "--model", "m", "-o", "out"),
        B,
        sharded(["model-1.safetensors"]),
        match="weight_map must map",
    ),
    # -- data loss ------------------------------------------------------------------------------------------------
    Case(
        "force-onto-source",
        "data-loss",
        ("export", "--model", "m", "-o", "m", "--force", "--no-validate"),
        B,
        source_copy(),
        match="source",
    ),
    Case(
        "force-onto-unrelated",
        "data-loss",
        (*EXPORT_TINY, "--no-validate", "-o", "photos", "--force"),
        B,
        unrelated_folder,
        match="photos",
    ),
    Case(
        "force-onto-parent-of-source",
        "data-loss",
        ("export", "--model", "m", "-o", ".", "--force", "--no-validate"),
        B,
        source_copy(),
    ),
    Case(
        "force-onto-symlink",
        "data-loss",
        (*EXPORT_TINY, "--no-validate", "-o", "link", "--force"),
        B,
        lambda c: (c.copy("exp", "real"), (c.dir / "link").symlink_to("real")),
    ),
    Case(
        "out-dangling-symlink",
        "traceback",
        (*EXPORT_TINY, "-o", "link"),
        B,
        lambda c: (c.dir / "link").symlink_to(c.dir / "nowhere"),
        match="link",
    ),
    Case(
        "kill-9-leaves-no-staging",
        "data-loss",
        (),
        0,
        run=killed_export,
        check=no_stray_staging,
        creates=("out",),
        timeout=240,
    ),
    Case(
        "two-exports-one-folder",
        "data-loss",
        (),
        (B, EXIT_OUTPUT),
        run=concurrent_exports,
        creates=("same",),
        timeout=240,
        match="same",
    ),
    Case("full-disk", "traceback", (), EXIT_OUTPUT, run=full_disk, creates=("disk",), timeout=240, match="space"),
    Case(
        "full-disk-injected",
        "traceback",
        (*EXPORT_TINY, "--no-validate", "-o", "out"),
        EXIT_OUTPUT,
        inject=no_space_left,
        match="space",
    ),
    # -- sizes checked before allocation, nothing hangs ------------------------------------------------------------
    Case(
        "n-layer-100000-random",
        "hang",
        (*("export", "--model", "config.json", "--random-init"), "-o", "out"),
        B,
        config_file(n_layer=100000),
        match="n_layer",
    ),
    Case(
        "n-layer-4000-memory",
        "hang",
        ("export", "--model", "config.json", "--random-init", "-o", "out"),
        B,
        config_file(n_layer=4000, n_embd=1024, n_head=16),
        match=r"GB",
    ),
    Case(
        "n-layer-huge-weights",
        "hang",
        ("export", "--model", "m", "-o", "out"),
        B,
        source_copy(n_layer=100000),
        match="n_layer",
    ),
    Case(
        "n-embd-1048576",
        "traceback",
        ("export", "--model", "config.json", "--random-init", "-o", "out"),
        B,
        config_file(n_embd=1048576),
        match="n_embd",
    ),
    Case(
        "vocab-2-40",
        "traceback",
        ("export", "--model", "config.json", "--random-init", "-o", "out"),
        B,
        config_file(vocab_size=2**40),
        match="vocab_size",
    ),
    # -- silent wrong results --------------------------------------------------------------------------------------
    Case(
        "n-layer-true",
        "silent",
        ("export", "--model", "config.json", "--random-init", "-o", "out"),
        B,
        config_file(n_layer=True),
        match="n_layer",
    ),
    Case(
        "int64-weights",
        "silent",
        ("export", "--model", "m", "-o", "out"),
        B,
        weights_edit(lambda t: t.update({"transformer.ln_f.bias": t["transformer.ln_f.bias"].long()})),
        match="ln_f.bias.*int64",
    ),
    Case(
        "bool-weights",
        "silent",
        ("export", "--model", "m", "-o", "out"),
        B,
        weights_edit(lambda t: t.update({"transformer.ln_f.weight": t["transformer.ln_f.weight"] > 0})),
        match="ln_f.weight.*bool",
    ),
    Case("revision-with-random-init", "silent", (*EXPORT_TINY, "--revision", "main", "-o", "out"), B, match="revision"),
    Case(
        "gate-kl-negative",
        "silent",
        (*EXPORT_TINY, "--quantize", "int8", "--gate", "kl_mean=-1", "-o", "out"),
        B,
        match="kl_mean",
    ),
    Case(
        "gate-logits-tiny-honoured",
        "silent",
        (*EXPORT_TINY, "--gate", "logits=1e-12", "-o", "out"),
        F,
        match="validation failed",
    ),
    # -- tracebacks ------------------------------------------------------------------------------------------------
    Case(
        "n-layer-str",
        "traceback",
        ("export", "--model", "config.json", "--random-init", "-o", "out"),
        B,
        config_file(n_layer="two"),
        match="n_layer",
    ),
    Case(
        "n-head-str", "traceback", ("export", "--model", "m", "-o", "out"), B, source_copy(n_head="4"), match="n_head"
    ),
    Case(
        "epsilon-str",
        "traceback",
        ("export", "--model", "config.json", "--random-init", "-o", "out"),
        B,
        config_file(layer_norm_epsilon="abc"),
        match="layer_norm_epsilon",
    ),
    Case(
        "n-inner-negative",
        "traceback",
        ("export", "--model", "config.json", "--random-init", "-o", "out"),
        B,
        config_file(n_inner=-5),
        match="n_inner",
    ),
    Case(
        "config-json-list",
        "traceback",
        ("export", "--model", "m", "-o", "out"),
        B,
        lambda c: (c.copy("src", "m"), (c.dir / "m" / "config.json").write_text("[1, 2]")),
        match="list",
    ),
    Case("seed-beyond-64-bits", "traceback", (*EXPORT_TINY, "--seed", str(2**64), "-o", "out"), B, match="seed"),
    # -- misleading messages ---------------------------------------------------------------------------------------
    Case(
        "epsilon-negative",
        "message",
        ("export", "--model", "config.json", "--random-init", "-o", "out"),
        B,
        config_file(layer_norm_epsilon=-1),
        match="layer_norm_epsilon",
        absent="Δlogits",
    ),
    Case(
        "nan-weights",
        "message",
        ("export", "--model", "m", "-o", "out"),
        B,
        weights_edit(lambda t: t["transformer.h.0.mlp.c_fc.weight"].__setitem__((0, 0), float("nan"))),
        match="h.0.mlp.c_fc.weight.*NaN",
    ),
    Case(
        "tolerance-negative",
        "message",
        (*EXPORT_TINY, "--tolerance", "-1", "-o", "out"),
        B,
        match="tolerance",
        absent="validation failed",
    ),
    Case(
        "out-is-a-file",
        "message",
        (*EXPORT_TINY, "-o", "afile"),
        B,
        lambda c: (c.dir / "afile").write_text("x"),
        match="file",
        absent="folder 'afile'",
    ),
    Case(
        "model-no-weights",
        "message",
        ("export", "--model", "m", "-o", "out"),
        B,
        lambda c: ((c.dir / "m").mkdir(), config_file("m/config.json")(c)),
        match="has no weights",
    ),
    # -- option values ---------------------------------------------------------------------------------------------
    Case("opset-99", "options", (*EXPORT_TINY, "--opset", "99", "-o", "out"), B, match="opset"),
    Case("quantize-int3", "options", (*EXPORT_TINY, "--quantize", "int3", "-o", "out"), B, match="int3"),
    Case("seed-not-int", "options", (*EXPORT_TINY, "--seed", "abc"), B, match="seed"),
    Case("export-no-model", "options", ("export",), B, match="model"),
    Case(
        "export-eval-text-missing",
        "message",
        ("export", "--model", "{src}", "-o", "out", "--eval-text", "none.txt"),
        B,
        match="none.txt",
    ),
]


def _foreign_leftovers(c: Ctx) -> None:
    """Things in the output's parent that look like our staging, backup and lock names but are not ours."""
    (c.dir / ".out.tmp-999999-abc").mkdir()
    (c.dir / ".out.tmp-999999-abc" / "keep.txt").write_text("mine")
    (c.dir / ".out.old-999999-abc" / "out").mkdir(parents=True)
    (c.dir / ".out.old-999999-abc" / "out" / "keep.txt").write_text("mine")
    (c.dir / ".photos.lock").write_text("my own lock file")
    (c.dir / ".empty.lock").write_text("")


LOCK_HEADER = "gpt2onnx output lock 1"


def _killed_between_renames(c: Ctx) -> None:
    """What a run killed between the two renames of a replace leaves: the old folder in a backup its lock
    file records, the output itself missing, the new one in a staging folder."""
    c.copy("exp", ".out.old-999999-abc/out")
    c.copy("exp", ".out.tmp-999999-abc")
    (c.dir / ".out.lock").write_text(f"{LOCK_HEADER}\nstaging .out.tmp-999999-abc\nbackup .out.old-999999-abc\n")


def _recovered(c: Ctx, out: Outcome) -> None:
    assert (c.dir / "out" / "gpt2onnx.json").is_file(), "the old folder was not recovered"
    left = sorted(p.name for p in c.dir.iterdir() if p.name.startswith("."))
    assert left == [], f"left beside it: {left}"


def _no_replace_of_staging(c: Ctx):
    """The final rename of a replace fails (EACCES, as in a folder the user may not write)."""
    import errno
    from unittest import mock

    real = os.replace

    def replace(src, dst):
        if ".tmp-" in str(src):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(src))
        return real(src, dst)

    return mock.patch("gpt2onnx.artifact.folder.os.replace", side_effect=replace)


CASES += [
    Case(
        "lock-file-link",
        "security",
        (*EXPORT_TINY, "--no-validate", "-o", "out"),
        EXIT_OUTPUT,
        lambda c: ((c.dir / "target.txt").write_text("keep"), (c.dir / ".out.lock").symlink_to(c.dir / "target.txt")),
        match="symbolic link",
    ),
    Case(
        "lock-file-foreign",
        "data-loss",
        (*EXPORT_TINY, "--no-validate", "-o", "out"),
        EXIT_OUTPUT,
        lambda c: (c.dir / ".out.lock").write_text("my notes"),
        match="not a gpt2onnx lock file",
    ),
    # -- data loss: cleanup removes only what a lock file of ours records ------------------------------------------
    Case(
        "foreign-leftovers-kept",
        "data-loss",
        (*EXPORT_TINY, "--no-validate", "-o", "out2"),
        0,
        _foreign_leftovers,
        creates=("out2",),
    ),
    Case(
        "foreign-leftovers-same-name",
        "data-loss",
        (*EXPORT_TINY, "--no-validate", "-o", "out"),
        0,
        _foreign_leftovers,
        creates=("out",),
    ),
    Case(
        "killed-between-renames-other-output",
        "data-loss",
        (*EXPORT_TINY, "--no-validate", "-o", "other"),
        0,
        _killed_between_renames,
        creates=("out", "other", ".out.old-999999-abc", ".out.tmp-999999-abc", ".out.lock"),
        check=_recovered,
    ),
    Case(
        "killed-between-renames-same-output",
        "data-loss",
        (*EXPORT_TINY, "--no-validate", "-o", "out"),
        B,
        _killed_between_renames,
        creates=("out", ".out.old-999999-abc", ".out.tmp-999999-abc", ".out.lock"),
        check=_recovered,
        match="already exists",
    ),
    Case(
        "replace-rename-refused",
        "traceback",
        (*EXPORT_TINY, "--no-validate", "-o", "out", "--force"),
        EXIT_OUTPUT,
        lambda c: c.copy("exp", "out"),
        inject=_no_replace_of_staging,
        match="old one is kept",
    ),
    Case(
        "force-empty-manifest",
        "data-loss",
        (*EXPORT_TINY, "--no-validate", "-o", "out", "--force"),
        B,
        lambda c: (
            (c.dir / "out").mkdir(),
            (c.dir / "out/gpt2onnx.json").write_text("{}"),
            (c.dir / "out/a.txt").write_text("x"),
        ),
        match="not a valid gpt2onnx manifest",
    ),
    Case(
        "force-manifest-list",
        "data-loss",
        (*EXPORT_TINY, "--no-validate", "-o", "out", "--force"),
        B,
        lambda c: ((c.dir / "out").mkdir(), (c.dir / "out/gpt2onnx.json").write_text("[]")),
        match="not a valid gpt2onnx manifest",
    ),
    Case(
        "force-manifest-link",
        "data-loss",
        (*EXPORT_TINY, "--no-validate", "-o", "out", "--force"),
        B,
        lambda c: (
            c.copy("exp", "real"),
            (c.dir / "out").mkdir(),
            (c.dir / "out/gpt2onnx.json").symlink_to(c.dir / "real/gpt2onnx.json"),
        ),
        match="never replaced",
    ),
    Case(
        "force-foreign-file-beside",
        "data-loss",
        (*EXPORT_TINY, "--no-validate", "-o", "out", "--force"),
        B,
        lambda c: (c.copy("exp", "out"), (c.dir / "out/thesis.tex").write_text("years of work")),
        match="thesis.tex",
    ),
    Case(
        "force-own-folder-replaced",
        "data-loss",
        (*EXPORT_TINY, "--no-validate", "-o", "out", "--force"),
        0,
        lambda c: c.copy("exp", "out"),
        creates=("out",),
    ),
    Case(
        "force-after-deploy-keeps-user-file",
        "data-loss",
        (*EXPORT_TINY, "--no-validate", "-o", "m", "--force"),
        B,
        _deployed_with_user_things,
        match="does not list",
    ),
    Case("tolerance-underscore", "silent", (*EXPORT_TINY, "--tolerance=1_0", "-o", "out"), B, match="underscores"),
    # -- options that would be ignored --------------------------------------------------------------------------------
    Case(
        "block-size-without-int4", "options", (*EXPORT_TINY, "--block-size", "64", "-o", "out"), B, match="--block-size"
    ),
    Case(  # int8's block-wise tensors (8-bit embeddings) take the block sizes int4 takes
        "block-size-unsupported-int8",
        "options",
        (*EXPORT_TINY, "--quantize", "int8", "--block-size", "48", "-o", "out"),
        B,
        match="--block-size 48 is not supported",
    ),
    Case(
        "partial-fusion-without-fusion",
        "options",
        (*EXPORT_TINY, "--allow-partial-fusion", "-o", "out"),
        B,
        match="--allow-partial-fusion",
    ),
    Case(
        "keep-fp32-without-fp16", "options", (*EXPORT_TINY, "--keep-fp32", "none", "-o", "out"), B, match="--keep-fp32"
    ),
    Case(
        "gate-unknown",
        "options",
        (*EXPORT_TINY, "--quantize", "int8", "--gate", "speed=2", "-o", "out"),
        B,
        match="speed",
    ),
    Case(
        "no-validate-with-tolerance",
        "options",
        (*EXPORT_TINY, "--no-validate", "--tolerance", "1e-3", "-o", "out"),
        B,
        match="validat",
    ),
    # -- internal errors: each a refusal in one line ------------------------------------------------------------------
    *(
        Case(
            f"n-positions-{n}",
            "traceback",
            ("export", "--model", "config.json", "--random-init", "-o", "out"),
            B,
            config_file(n_positions=n),
            match="n_positions",
        )
        for n in (1, 2, 7)
    ),
    Case(
        "initializer-range-negative",
        "traceback",
        ("export", "--model", "config.json", "--random-init", "-o", "out"),
        B,
        config_file(initializer_range=-1),
        match="initializer_range",
    ),
    Case(
        "initializer-range-nan",
        "traceback",
        ("export", "--model", "config.json", "--random-init", "-o", "out"),
        B,
        config_file(initializer_range=float("nan")),
        match="initializer_range",
    ),
    Case(
        "initializer-range-string",
        "traceback",
        ("export", "--model", "config.json", "--random-init", "-o", "out"),
        B,
        config_file(initializer_range="0.02"),
        match="initializer_range",
    ),
    # -- misleading messages ------------------------------------------------------------------------------------------
    Case(
        "error-names-no-staging-folder",
        "message",
        (*EXPORT_TINY, "--gate", "logits=1e-12", "-o", "out"),
        F,
        match="validation failed",
        absent=r"\.tmp-",
    ),
]


def _small_vocab_source(c: Ctx) -> None:
    """A checkpoint of 300 tokens whose tokenizer files give ids up to 999 (they belong to another model)."""
    from conftest import make_config, write_hf_folder, write_tokenizer

    config = make_config("h4-v1000")
    config.vocab_size, config.eos_token_id, config.bos_token_id = 300, 299, 299  # its merges have ids above 300
    folder = write_hf_folder(c.dir / "m", config)
    write_tokenizer(folder)
    (c.dir / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)


CASES += [
    Case(
        "export-eval-text-tokenizer-of-the-source",
        "message",
        ("export", "--model", "m", "-o", "out", "--no-validate", "--eval-text", "t.txt"),
        B,
        _small_vocab_source,
        match="the tokenizer of '[^']*m'",
        absent="'out'",
    ),
]


def _float8_weights(tensors: dict) -> None:
    import torch

    tensors["transformer.ln_f.weight"] = tensors["transformer.ln_f.weight"].to(torch.float8_e4m3fn)


CASES += [
    Case(  # F8_E4M3 in the safetensors file: torch has no isfinite for it (was exit 70)
        "float8-weights",
        "traceback",
        ("export", "--model", "m", "-o", "out"),
        B,
        weights_edit(_float8_weights),
        match="ln_f.weight.*float8_e4m3fn",
    ),
    Case(
        "index-names-itself",
        "message",
        ("export", "--model", "m", "-o", "out"),
        B,
        sharded({"transformer.wte.weight": "model.safetensors.index.json"}),
        match="names itself as a shard",
    ),
    Case(
        "index-empty-weight-map",
        "message",
        ("export", "--model", "m", "-o", "out"),
        B,
        sharded({}),
        match="empty weight_map",
    ),
    Case(
        "index-shard-nul",
        "message",
        ("export", "--model", "m", "-o", "out"),
        B,
        sharded({"transformer.wte.weight": "a\x00b.safetensors"}),
        match=r"the shard 'a\\x00b.safetensors'",
    ),
    Case(
        "index-shard-fifo",
        "message",
        ("export", "--model", "m", "-o", "out"),
        B,
        lambda c: (
            sharded({"transformer.wte.weight": "model-1.safetensors"})(c),
            os.mkfifo(c.dir / "m" / "model-1.safetensors"),
        ),
        match="model-1.safetensors' named in .* is a FIFO",
        process=True,
        timeout=120,
    ),
]


def terminated_export(c: Ctx, cli) -> Outcome:
    """SIGTERM an export while its staging folder exists: it unwinds as Ctrl-C does (exit code 143, one line, no
    staging folder, no lock); then the next export into that parent runs."""
    (c.dir / "out").mkdir()
    proc = _spawn(cli, ["export", "--model", "tiny", "--random-init", "-o", "out/a"], c)
    deadline = time.monotonic() + 90
    while not list((c.dir / "out").glob(".a.tmp-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert list((c.dir / "out").glob(".a.tmp-*")), "the export ended before its staging folder was seen"
    proc.send_signal(signal.SIGTERM)
    first = finish(proc, 60)
    assert first.code == 143 and first.stderr.strip() == "terminated", (first.code, first.stderr[-500:])
    assert not list((c.dir / "out").iterdir()), f"left after SIGTERM: {list((c.dir / 'out').iterdir())}"
    return cli(["export", "--model", "tiny", "--random-init", "--no-validate", "-o", "out/b"], c)


_LATE_CTRL_C = {
    # a Ctrl-C handled after it crossed a C extension's PyRun call (an import under way when it landed): CPython
    # marks the process and, through -m, ends it by SIGINT instead of its exit code (once about one Ctrl-C in ten,
    # 3 s into eval)
    "crossed-pyrun": """
def _ctrl_c():
    sys.excepthook = lambda *exc: None  # PyRun_SimpleString prints the exception it ends with, through the hook
    ctypes.pythonapi.PyRun_SimpleString(b"raise KeyboardInterrupt")  # marks the process; later PyRun calls unmark it
    sys.excepthook = sys.__excepthook__
    os.kill(os.getpid(), signal.SIGINT)

threading.Timer(1.5, _ctrl_c).start()
""",
    # a Ctrl-C that lands where Python cannot raise it (a weakref callback of the import system): printed as
    # "Exception ignored" and lost, and the command went on to write its output
    "unraisable": """
class _Late:
    def __del__(self):
        raise KeyboardInterrupt

threading.Timer(1.5, _Late).start()
""",
}


def _late_ctrl_c(kind: str) -> Callable[[Ctx, Callable], Outcome]:
    """An export with the Ctrl-C of ``kind`` injected at start-up (a sitecustomize of the case's folder): it ends
    as every interrupted command does, exit code 130, "interrupted", no output; then the next export runs."""

    def run(c: Ctx, cli) -> Outcome:
        site = c.dir / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text("import ctypes, os, signal, sys, threading\n" + _LATE_CTRL_C[kind])
        paths = os.pathsep.join((str(site), str(Path(__file__).resolve().parents[2])))
        out = cli(["export", "--model", "tiny", "--random-init", "-o", "out"], c, env_changes={"PYTHONPATH": paths})
        assert (out.code, out.stderr.strip()) == (130, "interrupted"), (out.code, out.stderr[-500:])
        assert not (c.dir / "out").exists(), "an interrupted export wrote its folder"
        shutil.rmtree(site)
        return cli(["export", "--model", "tiny", "--random-init", "--no-validate", "-o", "out"], c)

    return run


CASES += [
    Case("ctrl-c-crossed-pyrun", "data-loss", (), 0, run=_late_ctrl_c("crossed-pyrun"), creates=("out",), timeout=200),
    Case("ctrl-c-unraisable", "data-loss", (), 0, run=_late_ctrl_c("unraisable"), creates=("out",), timeout=200),
]


CASES += [
    Case("export-sigterm", "data-loss", (), 0, run=terminated_export, creates=("out",), timeout=200),
]

# int4's quality gates need its weights
TRAINED = str(Path(__file__).resolve().parents[1] / "fixtures" / "trained-tiny")
MIXED_STATIC = ("--quantize", "int4", "--mixed-int8", "25", "--fusion", "onnx-static-kv")


CASES += [
    Case(
        "export-mixed-int8-static-kv",  # once exit 70: TensorScatter's max_sequence_length (0)
        "traceback",
        ("export", "--model", TRAINED, "-o", "m", *MIXED_STATIC),
        0,
        creates=("m",),
        timeout=300,
    ),
]


# -- PEFT LoRA adapters (issue 56): what a merged GPT-2 cannot hold, refused before anything is written ----------
def lora_folder(
    name: str = "a", *, width: int = 64, modules=("h.0.attn.c_attn",), pickle: bool = False, saved_head=None, **config
):
    """A PEFT LoRA adapter folder for {src} (2 layers × 64, tied head) as PEFT writes it: adapter_config.json and
    rank-2 factors under PEFT's keys; ``width`` another base's n_embd, ``config`` changed settings, ``saved_head``
    a value for the head's own weight as PEFT saves it beside an adapted tied head."""

    def setup(c: Ctx) -> None:
        import torch
        from safetensors.torch import save_file

        folder = c.dir / name
        folder.mkdir()
        settings = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["c_attn"], "use_dora": False}
        settings.update({"base_model_name_or_path": str(c.src), **config})
        (folder / "adapter_config.json").write_text(json.dumps(settings))
        outs = {"c_attn": 3 * width, "c_proj": width, "c_fc": 4 * width, "lm_head": 1000}
        tensors = {}
        for module in modules:
            prefix = f"base_model.model.{'' if module == 'lm_head' else 'transformer.'}{module}"
            if module in ("wte", "wpe"):  # PEFT's embedding adapters: lora_embedding_A [r, rows], B [width, r]
                tensors[f"{prefix}.lora_embedding_A"] = torch.full((2, 128), 0.01)
                tensors[f"{prefix}.lora_embedding_B"] = torch.full((width, 2), 0.01)
                continue
            fan_out = outs[module.rsplit(".", 1)[-1]]
            tensors[f"{prefix}.lora_A.weight"] = torch.full((2, width), 0.01)
            tensors[f"{prefix}.lora_B.weight"] = torch.full((fan_out, 2), 0.01)
        if saved_head is not None:
            tensors["base_model.model.lm_head.base_layer.weight"] = torch.full((1000, width), saved_head)
        if pickle:
            torch.save(tensors, folder / "adapter_model.bin")
        else:
            save_file(tensors, str(folder / "adapter_model.safetensors"))

    return setup


ADAPTER_EXPORT = ("export", "--model", "{src}", "--adapter", "a", "-o", "out")


CASES += [
    Case("adapter-dora", "message", ADAPTER_EXPORT, B, lora_folder(use_dora=True), match="DoRA .* not supported"),
    Case(
        "adapter-embedding",
        "message",
        ADAPTER_EXPORT,
        B,
        lora_folder(target_modules=["wte"]),
        match="embedding adapters are not supported",
    ),
    Case(
        "adapter-embedding-factors",
        "message",
        ADAPTER_EXPORT,
        B,
        lora_folder(modules=("wpe",)),
        match="is an embedding adapter",
    ),
    Case(
        "adapter-modules-to-save",
        "message",
        ADAPTER_EXPORT,
        B,
        lora_folder(modules_to_save=["lm_head"]),
        match="modules_to_save .* not supported",
    ),
    Case(
        "adapter-other-base",
        "message",
        ADAPTER_EXPORT,
        B,
        lora_folder(width=128),
        match="trained on another base",
    ),
    Case(
        "adapter-pickle-only",
        "security",
        ADAPTER_EXPORT,
        B,
        lora_folder(pickle=True),
        match="no adapter_model.safetensors .*pickle, never loaded",
    ),
    Case("adapter-not-lora", "message", ADAPTER_EXPORT, B, lora_folder(peft_type="IA3"), match="not LORA"),
    Case(
        "adapter-saved-head-other-base",
        "message",
        ADAPTER_EXPORT,
        B,
        lora_folder(modules=("lm_head",), target_modules=["lm_head"], saved_head=0.5),
        match="saved a head weight other than this base's: it was trained on another base",
    ),
    Case(
        "adapter-base-escapes",
        "security",
        ("export", "--model", "a", "-o", "out"),
        B,
        lambda c: (source_copy()(c), lora_folder(base_model_name_or_path="../m")(c)),
        match="leads out of the adapter folder",
    ),
    Case(
        "adapter-missing-folder",
        "message",
        ("export", "--model", "{src}", "--adapter", "nope", "-o", "out"),
        B,
        match="no such folder",
    ),
]


# -- GGUF files in (gpt2onnx.pytorch.gguf_checkpoint): the fixture written by gguf's GGUFWriter, then damaged -------
def gguf_file(damage: Callable[[Path], None] | None = None, **write) -> Callable[[Ctx], None]:
    def setup(c: Ctx) -> None:
        from gguf_files import write_gguf

        path = write_gguf(c.dir / "m.gguf", **write)
        if damage is not None:
            damage(path)

    return setup


def _cut(path: Path) -> None:
    os.truncate(path, path.stat().st_size * 6 // 10)


def _tensor_past_end(path: Path) -> None:
    from gguf_files import set_u64, tensor_info_offset

    name = "token_embd.weight"
    at = tensor_info_offset(path, name) + 8 + len(name) + 4 + 2 * 8 + 4  # length, name, n_dims, 2 dims, type
    set_u64(path, at, 1 << 40)


def _string_of_gigabytes(path: Path) -> None:
    from gguf_files import set_u64

    key = b"tokenizer.ggml.pre"
    at = path.read_bytes().index(key) + len(key) + 4  # the value's type, then its declared length
    set_u64(path, at, 4 << 30)


def _tensor_twice(path: Path) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(b"blk.0.ffn_up.bias")
    data[at : at + 17] = b"blk.1.ffn_up.bias"
    path.write_bytes(bytes(data))


GGUF_EXPORT = ("export", "--model", "m.gguf", "-o", "out")


CASES += [
    Case(
        "gguf-other-architecture",
        "message",
        GGUF_EXPORT,
        B,
        gguf_file(architecture="llama"),
        match="architecture 'llama': only GPT-2",
    ),
    Case("gguf-truncated", "message", GGUF_EXPORT, B, gguf_file(_cut), match="past the file's end.*truncated"),
    Case(
        "gguf-tensor-past-end",
        "message",
        GGUF_EXPORT,
        B,
        gguf_file(_tensor_past_end),
        match="tensor 'token_embd.weight' declares .* past the file's end",
    ),
    Case(
        "gguf-metadata-string-gigabytes",
        "message",
        GGUF_EXPORT,
        B,
        gguf_file(_string_of_gigabytes),
        match="metadata string 'tokenizer.ggml.pre' declares 4,294,967,296 bytes.*past the file's end",
        process=True,  # under the corpus's memory cap: nothing of the declared size is allocated
    ),
    Case(
        "gguf-duplicate-tensor",
        "message",
        GGUF_EXPORT,
        B,
        gguf_file(_tensor_twice),
        match="holds tensor 'blk.1.ffn_up.bias' twice",
    ),
    Case("gguf-no-merges", "message", GGUF_EXPORT, B, gguf_file(merges=False), match="has no tokenizer merges"),
    Case(
        "gguf-missing-tensor",
        "message",
        GGUF_EXPORT,
        B,
        gguf_file(drop=("blk.1.ffn_down.weight",)),
        match="has no tensor 'blk.1.ffn_down.weight'",
    ),
    Case(
        "gguf-k-quant",
        "message",
        GGUF_EXPORT,
        B,
        gguf_file(types={"blk.0.ffn_down.weight": "Q4_K"}),
        match="Q4_K.*cannot hold exactly",
    ),
]


CASES += [
    Case(
        "adapters-switchable-block",
        "options",
        ("export", "--model", "{src}", "--adapters", "x=a", "--block", "0", "-o", "out"),
        B,
        lora_folder(),
        match="switchable adapters .* as a whole decoder and checked per adapter: drop --block",
    ),
    Case(
        "adapters-no-dir",
        "options",
        ("export", "--model", "{src}", "--adapters", "x", "-o", "out"),
        B,
        match="NAME=DIR,NAME=DIR; 'x' has no '=DIR'",
    ),
    Case(
        "adapters-bad-name",
        "options",
        ("export", "--model", "{src}", "--adapters", "../x=a", "-o", "out"),
        B,
        lora_folder(),
        match="name '../x' is not valid",
    ),
]
