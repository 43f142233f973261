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

import contextlib
import json
import os
import re
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


MARKER = "code-from-the-folder-ran"
REMOTE_CODE = (
    f"open({MARKER!r}, 'w').write('x')\n"
    "from transformers import GPT2Config as EvilConfig, GPT2TokenizerFast as EvilTokenizer\n"
)


def remote_code_config(c: Ctx) -> None:
    folder = c.copy("src", "m")
    (folder / "evil.py").write_text(REMOTE_CODE)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilConfig"}
    (folder / "config.json").write_text(json.dumps(config))


def remote_code_tokenizer(c: Ctx) -> None:
    folder = c.copy("exp", "m")
    (folder / "evil.py").write_text(REMOTE_CODE)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
    config["tokenizer_class"] = "EvilTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    config = json.loads((folder / "config.json").read_text())
    config.pop("model_type")  # no local class to fall back on: transformers would ask whether to trust the folder
    (folder / "config.json").write_text(json.dumps(config))


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


def truncate(name: str) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        path = folder / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    return edit


def unrelated_folder(c: Ctx) -> None:
    (c.dir / "photos").mkdir()
    (c.dir / "photos" / "holiday.jpg").write_bytes(b"not a model")


def fifo(c: Ctx) -> None:
    os.mkfifo(c.dir / "pipe.onnx")


def readonly_dir(c: Ctx) -> None:
    (c.dir / "ro").mkdir()
    (c.dir / "ro").chmod(0o500)


def _parity_huge(c: Ctx) -> None:
    """An export whose manifest names, as its source, a folder whose config.json is huge."""
    source_copy(n_layer=100000)(c)
    folder = c.copy("exp", "e")
    manifest = json.loads((folder / "gpt2onnx.json").read_text())
    manifest["source"] = {**manifest["source"], "path": str(c.dir / "m")}
    (folder / "gpt2onnx.json").write_text(json.dumps(manifest))


# -- faults injected for real -----------------------------------------------------------------------------------
def _spawn(cli, argv: list[str], c: Ctx) -> subprocess.Popen:
    return cli(argv, c, wait=False)


def finish(proc: subprocess.Popen, timeout: float = 120) -> Outcome:
    """Wait for a CLI subprocess; past ``timeout`` its whole process group is killed (code None)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return Outcome(None, out, err)
    return Outcome(proc.returncode, out, err)


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


def _generation_config(folder: Path, **changes) -> None:
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


# -- the corpus -------------------------------------------------------------------------------------------------
B, F = EXIT_BAD_INPUT, EXIT_CHECK_FAILED
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
    # The tokenizer files load into a fixed class (trust_remote_code=False): generation works, the folder's code
    # never runs.
    Case(
        "auto-map-tokenizer-not-run",
        "security",
        ("generate", "m", "--prompt", "hello", "--max-new-tokens", "2"),
        0,
        remote_code_tokenizer,
        check=no_marker,
        timeout=120,
        process=True,
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
        "optimize-onto-cwd",
        "data-loss",
        ("optimize", "m", "-o", ".", "--force"),
        B,
        export_copy(),
        match="working directory|source",
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
    Case("optimize-onto-source", "data-loss", ("optimize", "m", "-o", "m", "--force"), B, export_copy()),
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
    Case(
        "threads-5000",
        "hang",
        ("generate", "{exp}", "--ids", "1,2", "--max-new-tokens", "1", "--threads", "5000"),
        B,
        match="threads",
        timeout=20,
        process=True,
    ),
    Case(
        "bench-batch-huge",
        "hang",
        (
            "bench",
            "{exp}",
            "--batch",
            "100000",
            "--prompt-len",
            "100",
            "--new-tokens",
            "2",
            "--warmup",
            "0",
            "--repeat",
            "1",
        ),
        B,
        match="batch",
        timeout=60,
    ),
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
    Case("parity-huge-source-config", "hang", ("parity", "e", "--cases", "1"), B, _parity_huge, match="n_layer"),
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
    Case(
        "temperature-without-sample",
        "silent",
        ("generate", "{exp}", "--ids", "1,2", "--temperature", "0.5"),
        B,
        match="--sample",
    ),
    Case("trt-option-on-cpu", "silent", ("generate", "{exp}", "--ids", "1,2", "--trt-fp16"), B, match="tensorrt"),
    Case("ids-empty-item", "silent", ("generate", "{exp}", "--ids", "1,,2"), B, match="--ids"),
    Case(
        "bench-batch-empty-item",
        "silent",
        (
            "bench",
            "{exp}",
            "--batch",
            "1,,2",
            "--prompt-len",
            "4",
            "--new-tokens",
            "2",
            "--warmup",
            "0",
            "--repeat",
            "1",
        ),
        B,
        match="--batch",
    ),
    Case(
        "swapped-model-generate",
        "silent",
        ("generate", "m", "--ids", "1,2", "--max-new-tokens", "1"),
        B,
        export_copy(swap_model),
        match="model.onnx.*sha256|sha256.*model.onnx",
    ),
    Case("swapped-model-inspect", "silent", ("inspect", "m"), B, export_copy(swap_model), match="model.onnx"),
    Case("swapped-model-no-verify", "silent", ("inspect", "m", "--no-verify-files"), 0, export_copy(swap_model)),
    Case(
        "ids-beyond-vocab",
        "silent",
        ("generate", "{exp}", "--ids", "1,5000", "--max-new-tokens", "1"),
        B,
        match="5000.*vocabulary",
    ),
    Case(
        "corrupt-manifest",
        "silent",
        ("generate", "m", "--ids", "1,2", "--max-new-tokens", "1"),
        B,
        export_copy(write("gpt2onnx.json", "{not json")),
        match="gpt2onnx.json",
    ),
    Case(
        "inspect-truncated-data",
        "silent",
        ("inspect", "m"),
        B,
        export_copy(truncate("model.onnx_data"), what="ext"),
        match="model.onnx_data",
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
    Case("ids-beyond-int64", "traceback", ("generate", "{exp}", "--ids", "99999999999999999999999"), B, match="--ids"),
    Case(
        "temperature-nan",
        "traceback",
        ("generate", "{exp}", "--ids", "1,2", "--sample", "--temperature", "nan"),
        B,
        match="temperature",
    ),
    Case(
        "sample-seed-negative",
        "traceback",
        ("generate", "{exp}", "--ids", "1,2", "--sample", "--seed", "-1"),
        B,
        match="seed",
    ),
    Case("parity-seed-negative", "traceback", ("parity", "{exp}", "--seed", "-1", "--cases", "1"), B, match="seed"),
    Case(
        "manifest-json-list",
        "traceback",
        ("generate", "m", "--ids", "1,2", "--max-new-tokens", "1"),
        B,
        export_copy(write("gpt2onnx.json", "[]")),
        match="gpt2onnx.json",
    ),
    Case(
        "manifest-missing-fields",
        "traceback",
        ("parity", "m", "--cases", "1"),
        B,
        export_copy(write("gpt2onnx.json", '{"format_version": 1, "source": {"kind": "random"}}')),
        match="gpt2onnx.json|manifest",
    ),
    Case(
        "n-positions-raised",
        "traceback",
        ("generate", "m", "--ids", ",".join(["5"] * 130), "--max-new-tokens", "2"),
        B,
        export_copy(edit_json("config.json", n_positions=4096)),
        match="n_positions|position",
    ),
    Case(
        "plot-unwritable",
        "traceback",
        (
            "bench",
            "{exp}",
            "--batch",
            "1",
            "--prompt-len",
            "4",
            "--new-tokens",
            "2",
            "--warmup",
            "0",
            "--repeat",
            "1",
            "--json",
            "b.json",
            "--plot",
            "/proc/nope/x.png",
        ),
        B,
        match="plot|x.png",
    ),
    Case(
        "plot-not-png",
        "message",
        (
            "bench",
            "{exp}",
            "--batch",
            "1",
            "--prompt-len",
            "4",
            "--new-tokens",
            "2",
            "--warmup",
            "0",
            "--repeat",
            "1",
            "--json",
            "b.json",
            "--plot",
            "latency.jpg",
        ),
        B,
        match="png",
    ),
    Case(
        "trt-leaves-no-cache",
        "data-loss",
        ("generate", "m", "--ids", "1,2", "--provider", "tensorrt"),
        EXIT_RUNTIME,
        export_copy(),
        match="tensorrt|TensorRT",
    ),
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
    Case("inspect-config-json", "traceback", ("inspect", "{src}/config.json"), B, match="config.json"),
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
        "reference-missing",
        "message",
        ("parity", "{exp}", "--reference", "./nowhere", "--cases", "1"),
        B,
        match="--reference",
        absent="--model",
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
    Case("generate-folder-is-file", "message", ("generate", "{src}/config.json", "--ids", "1"), B, match="is a file"),
    Case(
        "draft-is-file",
        "message",
        ("generate", "{exp}", "--ids", "1", "--draft", "{src}/config.json"),
        B,
        match="draft",
    ),
    Case("draft-missing", "message", ("generate", "{exp}", "--ids", "1", "--draft", "nope"), B, match="draft"),
    Case(
        "draft-no-model", "message", ("generate", "{exp}", "--ids", "1", "--draft", "{src}"), B, match="no model.onnx"
    ),
    Case("lookup-beams", "message", ("generate", "{exp}", "--ids", "1", "--prompt-lookup", "3", "--num-beams", "2"), B),
    Case("optimize-fusion-bogus", "message", ("optimize", "{exp}", "-o", "out", "--fusion", "bogus"), B, match="bogus"),
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
    Case("top-p-2", "options", ("generate", "{exp}", "--ids", "1", "--sample", "--top-p", "2"), B, match="top-p"),
    Case("provider-bogus", "options", ("generate", "{exp}", "--ids", "1", "--provider", "tpu"), B, match="tpu"),
    Case("prompt-lookup-zero", "options", ("generate", "{exp}", "--ids", "1", "--prompt-lookup", "0"), B, match="1 to"),
    Case("draft-tokens-bogus", "options", ("generate", "{exp}", "--ids", "1", "--draft-tokens", "x"), B, match="draft"),
    Case(
        "draft-tokens-superscript",  # '²'.isdigit() is true, int('²') raises: once exit 70
        "traceback",
        ("generate", "{exp}", "--ids", "1", "--draft", "{exp}", "--draft-tokens", "²"),
        B,
        match="--draft-tokens must be a number from 1 to 64",
    ),
    Case("max-ngram-alone", "options", ("generate", "{exp}", "--ids", "1", "--max-ngram", "3"), B, match="--max-ngram"),
    Case("parity-cases-zero", "options", ("parity", "{exp}", "--cases", "0"), B, match="cases"),
    Case("bench-folder-without-model", "options", ("bench", "{src}"), B, match="model.onnx"),
    # -- deploy ------------------------------------------------------------------------------------------------------
    Case("deploy-missing-folder", "message", ("deploy", "nope", "--target", "genai"), B, match="does not exist"),
    Case(
        "deploy-target-bogus",
        "options",
        ("deploy", "{exp}", "--target", "onnxruntime-web", "-o", "out"),
        B,
        match="unknown --target",
    ),
    Case(
        "deploy-out-inside-source",
        "data-loss",
        ("deploy", "{exp}", "--target", "genai", "-o", "{exp}/sub"),
        B,
        match="inside",
    ),
    Case(
        "deploy-out-not-ours",
        "data-loss",
        ("deploy", "{exp}", "--target", "genai", "-o", "out", "--force"),
        B,
        lambda c: ((c.dir / "out").mkdir(), (c.dir / "out" / "keep.txt").write_text("mine")),
        match="never replaced",
    ),
    Case(
        "deploy-triton-name-path",
        "security",
        ("deploy", "{exp}", "--target", "triton", "-o", "out", "--triton-name", "../x"),
        B,
        match="Triton model name",
    ),
    Case(  # issue 37: the name is shown escaped, so the error stays one line
        "deploy-triton-name-newline",
        "message",
        ("deploy", "{exp}", "--target", "triton", "-o", "out", "--triton-name", "a\nb"),
        B,
        match=r"Triton model name 'a\\nb'",
    ),
    Case(
        "deploy-ort-generate-early-stopping-never",
        "options",
        ("deploy", "m", "--target", "ort-generate", "-o", "out"),
        B,
        lambda c: _generation_config(c.copy("exp", "m"), early_stopping="never"),
        match="early_stopping 'never'.*true or false",
    ),
    Case(
        "deploy-triton-device-bogus",
        "options",
        ("deploy", "{exp}", "--target", "triton", "-o", "out", "--triton-device", "tpu"),
        B,
        match="tpu",
    ),
    # -- deploy --target server: the container and its manifests (issue 54) -------------------------------------------
    Case(
        "deploy-server-not-exported",
        "message",
        ("deploy", "{dir}", "--target", "server", "-o", "out"),
        B,
        match="holds no model.onnx",
    ),
    Case(
        "deploy-server-no-manifest",
        "message",
        ("deploy", "m", "--target", "server", "-o", "out"),
        B,
        lambda c: (c.copy("exp", "m") / "gpt2onnx.json").unlink(),
        match="has no gpt2onnx.json",
    ),
    Case(
        "deploy-server-name-not-label",
        "security",
        ("deploy", "{exp}", "--target", "server", "-o", "out", "--server-name", "../Model\nx"),
        B,
        match=r"--server-name '\.\./Model\\nx' is not a DNS-1123 label",
    ),
    Case(
        "deploy-server-image-bogus",
        "options",
        ("deploy", "{exp}", "--target", "server", "-o", "out", "--server-image", "Registry/UPPER case:1"),
        B,
        match="--server-image .* is not an image reference",
    ),
    Case(
        "deploy-server-batch-zero",
        "options",
        ("deploy", "{exp}", "--target", "server", "-o", "out", "--server-batch", "0"),
        B,
        match="--server-batch 0 is not an integer from 1 to 256",
    ),
    Case(
        "deploy-server-option-without-target",
        "options",
        ("deploy", "{exp}", "--target", "genai", "-o", "out", "--server-name", "gpt2"),
        B,
        match="--server-name applies to the server target",
    ),
    # -- deploy --target mobile: the ORT format (issue 58) -----------------------------------------------------------
    Case(
        "deploy-mobile-not-exported",
        "message",
        ("deploy", "{dir}", "--target", "mobile", "-o", "out"),
        B,
        match="holds no model.onnx",
    ),
    Case(
        "deploy-mobile-out-inside-source",
        "data-loss",
        ("deploy", "{exp}", "--target", "mobile", "-o", "{exp}/mobile"),
        B,
        match="inside",
    ),
    Case(  # one flatbuffer, no external data: refused by the target's declaration before anything is written
        "deploy-mobile-external-data",
        "options",
        ("deploy", "{ext}", "--target", "mobile", "-o", "out"),
        B,
        match="target mobile.*external data",
    ),
    Case(  # a file of the user's where the target writes, deployed in place: refused, the file kept
        "deploy-mobile-user-file-in-mobile",
        "data-loss",
        ("deploy", "m", "--target", "mobile"),
        B,
        lambda c: (
            c.copy("exp", "m"),
            (c.dir / "m" / "mobile").mkdir(),
            (c.dir / "m" / "mobile" / "a.txt").write_text("x"),
        ),
        match="mobile target would replace it",
    ),
    # -- eval: the text and the protocol's options, refused before any model is loaded --------------------------
    Case("eval-no-text", "options", ("eval", "{exp}"), B, match="--text FILE"),
    Case("eval-text-missing", "message", ("eval", "{exp}", "--text", "none.txt"), B, match="none.txt"),
    Case(
        "eval-text-fifo",
        "hang",
        ("eval", "{exp}", "--text", "pipe.txt"),
        B,
        lambda c: os.mkfifo(c.dir / "pipe.txt"),
        match="not a regular file",
        timeout=60,
        process=True,
    ),
    Case(
        "eval-context-zero",
        "options",
        ("eval", "{exp}", "--text", "t.txt", "--context", "0"),
        B,
        lambda c: (c.dir / "t.txt").write_text("Hello, world. " * 20),
        match="context",
    ),
    Case(
        "eval-dataset-form",
        "options",
        ("eval", "{exp}", "--dataset", "wikitext::test"),
        B,
        match="NAME\\[:CONFIG",
    ),
    Case(
        "eval-gate-nan",
        "options",
        ("eval", "{exp}", "--text", "t.txt", "--max-kl", "nan"),
        B,
        lambda c: (c.dir / "t.txt").write_text("Hello, world. " * 20),
        match="max-kl",
    ),
    Case(
        "export-eval-text-missing",
        "message",
        ("export", "--model", "{src}", "-o", "out", "--eval-text", "none.txt"),
        B,
        match="none.txt",
    ),
    # -- bench served --server openai: gpt2onnx serve beside llama.cpp's server (issue 54) -----------------------------
    Case(
        "bench-served-server-bogus",
        "options",
        ("bench", "served", "{exp}", "--server", "vllm"),
        B,
        match="--server 'vllm' is not one of triton, openai",
    ),
    Case(
        "bench-served-gguf-with-triton",
        "options",
        ("bench", "served", "{exp}", "--gguf", "{exp}/model.onnx"),
        B,
        match="--gguf applies to --server openai",
    ),
    Case(
        "bench-served-threads-with-openai",
        "options",
        ("bench", "served", "{exp}", "--server", "openai", "--threads", "2"),
        B,
        match="--threads applies to --server triton",
    ),
    Case(
        "bench-served-gguf-missing",
        "message",
        ("bench", "served", "{exp}", "--server", "openai", "--gguf", "nope.gguf"),
        B,
        match="--gguf 'nope.gguf' is not a file",
    ),
    Case(
        "bench-served-gguf-not-gguf",
        "message",
        ("bench", "served", "{exp}", "--server", "openai", "--gguf", "t.txt"),
        B,
        lambda c: (c.dir / "t.txt").write_text("not a model"),
        match="--gguf 't.txt' is not a GGUF file",
    ),
    Case(
        "bench-served-llama-server-with-triton",
        "options",
        ("bench", "served", "{exp}", "--llama-server", "{exp}/model.onnx"),
        B,
        match="--llama-server applies to --server openai",
    ),
    Case(
        "bench-served-llama-server-without-gguf",
        "options",
        ("bench", "served", "{exp}", "--server", "openai", "--llama-server", "t.txt"),
        B,
        lambda c: (c.dir / "t.txt").write_text("not a program"),
        match="--llama-server serves the --gguf file beside ours: give --gguf too",
    ),
    Case(
        "bench-served-llama-server-not-executable",
        "message",
        ("bench", "served", "{exp}", "--server", "openai", "--gguf", "m.gguf", "--llama-server", "t.txt"),
        B,
        lambda c: ((c.dir / "t.txt").write_text("not a program"), (c.dir / "m.gguf").write_bytes(b"GGUF" + bytes(60))),
        match="--llama-server 't.txt' is not an executable file",
    ),
    # -- the browser: deploy --target web, serve ---------------------------------------------------------------------
    Case(
        "deploy-web-lib-missing",
        "message",
        ("deploy", "{exp}", "--target", "web", "-o", "out", "--web-lib", "{dir}"),
        B,
        match="transformers.js is not installed in",
    ),
    Case("serve-missing-folder", "message", ("serve", "nope"), B, match="is not a folder"),
    Case("serve-not-a-web-folder", "message", ("serve", "{dir}"), B, match="has no index.html"),
    Case(
        "serve-model-max-batch-zero",
        "options",
        ("serve", "{exp}", "--max-batch", "0", "--port", "0"),
        B,
        match="--max-batch 0 is not an integer from 1 to 256",
    ),
    Case(
        "serve-web-folder-model-options",
        "options",
        ("serve", "{dir}", "--api-key", "k", "--port", "0"),
        B,
        lambda c: (c.dir / "index.html").write_text("<p>hi</p>"),
        match="for the OpenAI endpoint, and .* is served as a web folder",
    ),
    Case(
        "serve-port-bogus",
        "options",
        ("serve", "{dir}", "--port", "70000"),
        B,
        lambda c: (c.dir / "index.html").write_text("<p>hi</p>"),
        match="not a port number",
    ),
    # the OpenAI endpoint's header and body timeouts (issue 54): above 0, at most an hour, a number
    *(
        Case(
            f"serve-{flag}-{name}",
            "options",
            ("serve", "{exp}", f"--{flag}", value, "--port", "0"),
            B,
            match=f"--{flag} .* is not a number of seconds above 0 and at most 3600",
        )
        for flag in ("header-timeout", "body-timeout")
        for name, value in (("zero", "0"), ("negative", "-1"), ("nan", "nan"), ("huge", "1e9"))
    ),
    Case(
        "serve-web-folder-timeout",
        "options",
        ("serve", "{dir}", "--body-timeout", "5", "--port", "0"),
        B,
        lambda c: (c.dir / "index.html").write_text("<p>hi</p>"),
        match="--body-timeout: for the OpenAI endpoint",
    ),
]


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


def tokenizer_edit(edit: Callable[[Ctx, Path], None]) -> Callable[[Ctx], None]:
    def setup(c: Ctx) -> None:
        edit(c, c.copy("exp", "m"))

    return setup


def tokenizer_config_key(key: str, value: str, *, drop: tuple[str, ...] = (), fifo: bool = False):
    """tokenizer_config.json gains ``key``: ``value`` ({dir}: the case folder); ``drop``: files removed first;
    ``fifo``: the value names a FIFO (a load that would block forever)."""

    def edit(c: Ctx, folder: Path) -> None:
        for name in drop:
            (folder / name).unlink()
        target = value.format(dir=c.dir)
        if fifo:
            os.mkfifo(target)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config[key] = target
        (folder / "tokenizer_config.json").write_text(json.dumps(config))

    return tokenizer_edit(edit)


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


def genai_share_buffer(expected: bool) -> Callable[[Ctx, Outcome], None]:
    def check(c: Ctx, out: Outcome) -> None:
        config = json.loads((c.dir / "out" / "genai_config.json").read_text())
        assert config["search"]["past_present_share_buffer"] is expected, config["search"]

    return check


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


def _deploy_keeps(c: Ctx, out: Outcome) -> None:
    folder = c.dir / "m"
    assert (folder / "trt_cache" / "engine.bin").read_text() == "engine", "trt_cache/ was lost"
    assert os.readlink(folder / "tokenizer-link") == "tokenizer.json", "the link was lost"
    assert (folder / "notes.txt").read_text() == "mine", "notes.txt was lost"
    assert (folder / "genai_config.json").is_file()
    listed = json.loads((folder / "gpt2onnx.json").read_text())["files"]
    assert "notes.txt" not in listed and "genai_config.json" in listed, sorted(listed)


def _user_things(c: Ctx) -> None:
    folder = c.copy("exp", "m")
    (folder / "trt_cache").mkdir()
    (folder / "trt_cache" / "engine.bin").write_text("engine")
    (folder / "tokenizer-link").symlink_to("tokenizer.json")
    (folder / "notes.txt").write_text("mine")


def _redeploy_drops_only_ours(c: Ctx, out: Outcome) -> None:
    folder = c.dir / "m"
    assert not (folder / "genai_config.json").exists(), "the genai target deployed before was kept"
    assert (folder / "triton").is_dir() and (folder / "trt_cache" / "engine.bin").is_file()


def _deployed_with_user_things(c: Ctx) -> None:
    from gpt2onnx.targets.deploy import deploy

    _user_things(c)
    deploy(c.dir / "m", "genai")


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


BENCH_QUICK = ("--batch", "1", "--prompt-len", "4", "--new-tokens", "2", "--warmup", "0", "--repeat", "1")
MEMORY_QUICK = ("--batch", "1", "--prompt-len", "4", "--new-tokens", "2")
GENERATE_QUICK = (*BENCH_QUICK, "--num-beams", "2")
SPEC_QUICK = ("--prompt-lookup", "2", "--new-tokens", "2", "--warmup", "0", "--repeat", "1")
COST_QUICK = ("--choice", "a,b", "--new-tokens", "2", "--warmup", "0", "--repeat", "1")  # bench constraint
GEN = ("--ids", "1,2", "--max-new-tokens", "2")

CASES += [
    # -- security: a folder's genai_config.json never reaches onnxruntime-genai ---------------------------------
    Case(
        "genai-custom-ops-library",
        "security",
        ("generate", "m", *GEN, "--runtime", "genai"),
        0,
        genai_config_file(session={"custom_ops_library": "{lib}"}),
        check=no_marker,
    ),
    Case(
        "genai-enable-profiling",
        "security",
        ("generate", "m", *GEN, "--runtime", "genai"),
        0,
        genai_config_file(session={"enable_profiling": "{dir}/profile"}),
    ),
    Case(
        "genai-decoder-filename",
        "security",
        ("generate", "m", *GEN, "--runtime", "genai"),
        0,
        genai_config_file(decoder={"filename": "libevil.so"}),
    ),
    Case(
        "genai-config-not-json",
        "message",
        ("generate", "m", *GEN, "--runtime", "genai"),
        0,
        genai_config_file(raw="{not json"),
    ),
    Case(
        "genai-parity-custom-ops",
        "security",
        ("parity", "m", "--cases", "1", "--runtime", "genai"),
        0,
        genai_config_file(session={"custom_ops_library": "{lib}"}),
        check=no_marker,
    ),
    # -- security: paths inside files ---------------------------------------------------------------------------
    *(
        Case(
            f"data-dotdot-{cmd}",
            "security",
            (cmd, "m", *args),
            B,
            data_location("../outside.bin"),
            match="not a plain file name",
        )
        for cmd, args in (
            ("generate", GEN),
            ("inspect", ()),
            ("parity", ("--cases", "1")),
            ("bench", BENCH_QUICK),
            ("deploy", ("--target", "triton", "-o", "out")),
            ("optimize", ("-o", "out")),
        )
    ),
    Case(
        "data-absolute",
        "security",
        ("deploy", "m", "--target", "transformers-js", "-o", "out"),
        B,
        data_location("{dir}/outside.bin"),
        match="not a plain file name",
    ),
    Case(
        "data-absolute-no-verify",
        "security",
        ("generate", "m", *GEN, "--no-verify-files"),
        B,
        data_location("{dir}/outside.bin"),
        match="not a plain file name",
    ),
    Case(
        "data-link-outside",
        "security",
        ("deploy", "m", "--target", "triton", "-o", "out"),
        B,
        data_location("model.onnx_data", link=True),
        match="leads outside",
    ),
    Case(
        "data-link-outside-genai",
        "security",
        ("generate", "m", *GEN, "--runtime", "genai", "--no-verify-files"),
        B,
        data_location("model.onnx_data", link=True),
        match="leads outside",
    ),
    Case(
        "data-fifo",
        "hang",
        ("generate", "m", *GEN),
        B,
        data_location("weights.bin", fifo=True),
        match="regular file",
        process=True,
        timeout=120,
    ),
    Case(
        "data-not-in-manifest",
        "security",
        ("generate", "m", *GEN),
        B,
        export_copy(
            lambda f: (shutil.copy(f / "model.onnx_data", f / "weights.bin"), _relocate(f, "weights.bin")), what="ext"
        ),
        match="does not list",
    ),
    Case(
        "manifest-name-dotdot",
        "security",
        ("inspect", "m"),
        B,
        export_copy(manifest_file_name("model.onnx/../../secret")),
        match="not a plain file name",
    ),
    Case(
        "manifest-name-absolute",
        "security",
        ("generate", "m", *GEN),
        B,
        export_copy(manifest_file_name("model.onnx_data/../../../etc/passwd")),
        match="not a plain file name",
    ),
    Case(
        "deploy-manifest-name-dotdot",
        "security",
        ("deploy", "m", "--target", "genai", "-o", "out"),
        B,
        export_copy(manifest_file_name("model.onnx/../../secret")),
        match="not a plain file name",
    ),
    Case(
        "tokenizer-file-outside",
        "security",
        ("generate", "m", "--prompt", "hello", "--max-new-tokens", "2"),
        0,
        tokenizer_config_key("tokenizer_file", "{dir}/nowhere.json", drop=("tokenizer.json",)),
    ),
    Case(
        "tokenizer-file-fifo",
        "hang",
        ("generate", "m", "--prompt", "hello", "--max-new-tokens", "2"),
        0,
        tokenizer_config_key("tokenizer_file", "{dir}/pipe.json", drop=("tokenizer.json",), fifo=True),
        process=True,
        timeout=120,
    ),
    Case(
        "tokenizer-vocab-file-outside",
        "security",
        ("generate", "m", "--prompt", "hello", "--max-new-tokens", "2"),
        0,
        tokenizer_config_key("vocab_file", "/etc/passwd", drop=("tokenizer.json",)),
    ),
    Case(
        "tokenizer-json-link-outside",
        "security",
        ("generate", "m", "--prompt", "hello", "--max-new-tokens", "2"),
        B,
        tokenizer_edit(
            lambda c, f: (
                shutil.move(f / "tokenizer.json", c.dir / "t.json"),
                (f / "tokenizer.json").symlink_to(c.dir / "t.json"),
            )
        ),
        match="leads outside",
    ),
    Case(
        "tokenizer-json-fifo",
        "hang",
        ("generate", "m", "--prompt", "hello", "--max-new-tokens", "2"),
        B,
        tokenizer_edit(lambda c, f: ((f / "tokenizer.json").unlink(), os.mkfifo(f / "tokenizer.json"))),
        match="regular file",
        process=True,
        timeout=120,
    ),
    Case(
        "tokenizer-json-folder",
        "traceback",
        ("generate", "m", "--prompt", "hello", "--max-new-tokens", "2"),
        B,
        tokenizer_edit(lambda c, f: ((f / "tokenizer.json").unlink(), (f / "tokenizer.json").mkdir())),
        match="regular file",
    ),
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
        "force-foreign-folder-beside",
        "data-loss",
        ("optimize", "{exp}", "-o", "out", "--force"),
        B,
        lambda c: (c.copy("exp", "out"), (c.dir / "out/photos").mkdir()),
        match="photos",
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
        "deploy-force-empty-manifest",
        "data-loss",
        ("deploy", "{exp}", "--target", "genai", "-o", "out", "--force"),
        B,
        lambda c: ((c.dir / "out").mkdir(), (c.dir / "out/gpt2onnx.json").write_text("{}")),
        match="not a valid gpt2onnx manifest",
    ),
    # -- data loss: deploy in place keeps what it does not own -----------------------------------------------------
    Case(
        "deploy-in-place-keeps-user-things",
        "data-loss",
        ("deploy", "m", "--target", "genai"),
        0,
        _user_things,
        creates=("m",),
        check=_deploy_keeps,
    ),
    Case(
        "deploy-again-drops-only-its-own",
        "data-loss",
        ("deploy", "m", "--target", "triton"),
        0,
        _deployed_with_user_things,
        creates=("m",),
        check=_redeploy_drops_only_ours,
    ),
    Case(
        "force-after-deploy-keeps-user-file",
        "data-loss",
        (*EXPORT_TINY, "--no-validate", "-o", "m", "--force"),
        B,
        _deployed_with_user_things,
        match="does not list",
    ),
    Case(
        "deploy-in-place-foreign-onnx-folder",
        "data-loss",
        ("deploy", "m", "--target", "transformers-js"),
        B,
        export_copy(lambda f: ((f / "onnx").mkdir(), (f / "onnx" / "mine.onnx").write_text("x"))),
        match="not written by gpt2onnx deploy",
    ),
    Case(
        "deploy-in-place-foreign-genai-config",
        "data-loss",
        ("deploy", "m", "--target", "genai"),
        B,
        export_copy(write("genai_config.json", '{"mine": true}')),
        match="not written by gpt2onnx deploy",
    ),
    Case(
        "deploy-in-place-fifo",
        "data-loss",
        ("deploy", "m", "--target", "genai"),
        B,
        export_copy(lambda f: os.mkfifo(f / "queue")),
        match="FIFO",
    ),
    Case(
        "deploy-in-place-symlink-folder",
        "data-loss",
        ("deploy", "link", "--target", "genai"),
        B,
        lambda c: (c.copy("exp", "real"), (c.dir / "link").symlink_to("real")),
        match="symbolic link",
    ),
    # -- data loss: --json and --plot -------------------------------------------------------------------------------
    Case(
        "json-onto-model",
        "data-loss",
        ("bench", "m", *BENCH_QUICK, "--json", "m/model.onnx"),
        B,
        export_copy(),
        match="inside the model folder",
    ),
    Case(
        "json-onto-manifest",
        "data-loss",
        ("parity", "m", "--cases", "1", "--json", "m/gpt2onnx.json"),
        B,
        export_copy(),
        match="inside the model folder",
    ),
    Case(
        "json-into-model-folder-new-file",
        "data-loss",
        ("bench", "{exp}", *BENCH_QUICK, "--json", "{exp}/bench.json"),
        B,
        match="inside the model folder",
    ),
    Case(
        "json-fifo",
        "hang",
        ("bench", "{exp}", *BENCH_QUICK, "--json", "pipe.json"),
        B,
        lambda c: os.mkfifo(c.dir / "pipe.json"),
        match="not a regular file",
    ),
    Case(
        "json-folder",
        "traceback",
        ("parity", "{exp}", "--cases", "1", "--json", "d"),
        B,
        lambda c: (c.dir / "d").mkdir(),
        match="not a regular file",
    ),
    Case(
        "json-symlink",
        "data-loss",
        ("bench", "{exp}", *BENCH_QUICK, "--json", "link.json"),
        B,
        lambda c: ((c.dir / "keep.txt").write_text("keep"), (c.dir / "link.json").symlink_to("keep.txt")),
        match="symbolic link",
    ),
    Case(
        "json-no-folder",
        "traceback",
        ("parity", "{exp}", "--cases", "1", "--json", "nope/p.json"),
        B,
        match="does not exist",
    ),
    Case(
        "plot-is-folder",
        "traceback",
        ("bench", "{exp}", *BENCH_QUICK, "--plot", "d.png"),
        B,
        lambda c: (c.dir / "d.png").mkdir(),
        match="not a regular file",
    ),
    Case(
        "plot-in-model-folder",
        "data-loss",
        ("bench", "m", *BENCH_QUICK, "--plot", "m/p.png"),
        B,
        export_copy(),
        match="inside the model folder",
    ),
    Case(
        "plot-same-as-json",
        "data-loss",
        ("bench", "{exp}", *BENCH_QUICK, "--json", "a.png", "--plot", "a.png"),
        B,
        match="give each its own file",
    ),
    Case(
        "csv-same-as-md",
        "data-loss",
        ("bench", "{exp}", *BENCH_QUICK, "--csv", "t.md", "--md", "./t.md"),
        B,
        match="name 't.md': give each its own file",
    ),
    Case(
        "json-regular-file-replaced",
        "data-loss",
        ("bench", "{exp}", *BENCH_QUICK, "--json", "old.json"),
        0,
        lambda c: (c.dir / "old.json").write_text("{}"),
        creates=("old.json",),
    ),
    # -- silent: facts from the graph win over the manifest and the configs -------------------------------------------
    Case("kv-cache-lie-shared", "silent", ("generate", "m", *GEN), 0, export_copy(manifest_edit(kv_cache="shared"))),
    Case(
        "kv-cache-lie-shared-deploy",
        "silent",
        ("deploy", "m", "--target", "genai", "-o", "out"),
        0,
        export_copy(manifest_edit(kv_cache="shared")),
        creates=("out",),
        check=genai_share_buffer(False),
    ),
    Case(
        "kv-cache-lie-concat",
        "silent",
        ("deploy", "m", "--target", "genai", "-o", "out"),
        0,
        export_copy(manifest_edit(kv_cache="concat"), what="skv"),
        creates=("out",),
        check=genai_share_buffer(True),
    ),
    Case(
        "skv-deploy-genai-share-buffer",
        "silent",
        ("deploy", "{skv}", "--target", "genai", "-o", "out"),
        0,
        creates=("out",),
        check=genai_share_buffer(True),
    ),
    Case(
        "skv-openvino-batch-2",
        "traceback",
        ("generate", "{skv}", "--ids", "1,2", "--ids", "3", "--max-new-tokens", "2", "--runtime", "openvino"),
        0,
    ),
    Case(
        "skv-genai-batch-2",
        "traceback",
        ("generate", "{skv}", "--ids", "1,2", "--ids", "3", "--max-new-tokens", "2", "--runtime", "genai"),
        0,
    ),
    *(
        Case(
            f"n-positions-raised-{name}",
            "silent",
            ("generate", "m", "--ids", ",".join(["5"] * 130), "--max-new-tokens", "2", *args),
            B,
            export_copy(edit_json("config.json", n_positions=4096), what=what),
            match="position table",
        )
        for name, what, args in (
            ("int4", "q4", ()),
            ("openvino", "exp", ("--runtime", "openvino")),
            ("genai", "exp", ("--runtime", "genai")),
            ("bench", "exp", ()),
        )
    ),
    *(
        Case(
            f"generation-config-{key}-{kind}",
            "silent",
            ("deploy", "m", "--target", "genai", "-o", "out"),
            B,
            export_copy(edit_json("generation_config.json", **{key: value})),
            match=key,
        )
        for key, kind, value in (
            ("do_sample", "string", "false"),
            ("top_k", "float", 2.5),
            ("top_p", "above-1", 3),
            ("temperature", "negative", -1),
            ("eos_token_id", "string", "50256"),
            ("max_length", "bool", True),
        )
    ),
    Case(
        "generation-config-string-genai-run",
        "silent",
        ("generate", "m", *GEN, "--runtime", "genai"),
        B,
        export_copy(edit_json("generation_config.json", do_sample="false")),
        match="do_sample",
    ),
    Case("ids-underscore", "silent", ("generate", "{exp}", "--ids", "1_0"), B, match="--ids"),
    Case("batch-underscore", "silent", ("bench", "{exp}", *BENCH_QUICK[2:], "--batch", "1_0"), B, match="--batch"),
    Case(
        "max-new-tokens-underscore",
        "silent",
        ("generate", "{exp}", "--ids", "1", "--max-new-tokens", "1_0"),
        B,
        match="underscores",
    ),
    Case("tolerance-underscore", "silent", (*EXPORT_TINY, "--tolerance=1_0", "-o", "out"), B, match="underscores"),
    Case(
        "bench-reference-other-architecture",
        "silent",
        ("bench", "{exp}", *BENCH_QUICK, "--baseline", "torch", "--reference", "other"),
        B,
        other_checkpoint(n_head=8),
        match="does not match",
    ),
    Case(
        "parity-reference-other-heads",
        "silent",
        ("parity", "{exp}", "--cases", "1", "--reference", "other"),
        B,
        other_checkpoint(n_head=8),
        match="does not match",
    ),
    Case(
        "quantization-record-garbage",
        "silent",
        ("generate", "m", *GEN),
        (0, B),
        export_copy(manifest_edit(quantization="int4")),
        match="unreadable",
    ),
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
        "optimize-block-size-without-int4",
        "options",
        ("optimize", "{exp}", "-o", "out", "--block-size", "16"),
        B,
        match="--block-size",
    ),
    Case(
        "partial-fusion-without-fusion",
        "options",
        (*EXPORT_TINY, "--allow-partial-fusion", "-o", "out"),
        B,
        match="--allow-partial-fusion",
    ),
    Case(
        "optimize-partial-fusion-none",
        "options",
        ("optimize", "{exp}", "-o", "out", "--fusion", "none", "--quantize", "int8", "--allow-partial-fusion"),
        B,
        match="--allow-partial-fusion",
    ),
    Case(
        "trt-cache-dir-on-cpu",
        "options",
        ("generate", "{exp}", "--ids", "1", "--trt-cache-dir", "c"),
        B,
        match="tensorrt",
    ),
    Case("device-id-on-cpu", "options", ("generate", "{exp}", "--ids", "1", "--device-id", "1"), B, match="device id"),
    Case(
        "no-spin-on-cuda",
        "options",
        ("generate", "{exp}", "--ids", "1", "--provider", "cuda", "--no-spin"),
        B,
        match="--no-spin",
    ),
    Case(
        "allow-fallback-on-cpu",
        "options",
        ("generate", "{exp}", "--ids", "1", "--allow-fallback"),
        B,
        match="--allow-fallback",
    ),
    Case(
        "reference-without-baseline",
        "options",
        ("bench", "{exp}", *BENCH_QUICK, "--reference", "{src}"),
        B,
        match="--baseline torch",
    ),
    Case(
        "ov-precision-on-onnxruntime",
        "options",
        ("generate", "{exp}", "--ids", "1", "--ov-precision", "bf16"),
        B,
        match="openvino",
    ),
    Case(
        "device-on-genai",
        "options",
        ("generate", "{exp}", "--ids", "1", "--runtime", "genai", "--device", "GPU"),
        B,
        match="openvino",
    ),
    Case(
        "provider-on-openvino",
        "options",
        ("generate", "{exp}", "--ids", "1", "--runtime", "openvino", "--provider", "cuda"),
        B,
        match="--provider",
    ),
    Case("threads-zero", "options", ("generate", "{exp}", "--ids", "1", "--threads", "0"), B, match="threads"),
    Case("runtime-bogus", "options", ("generate", "{exp}", "--ids", "1", "--runtime", "tflite"), B, match="tflite"),
    Case(
        "bench-runtime-twice",
        "options",
        ("bench", "{exp}", *BENCH_QUICK, "--runtime", "openvino,openvino"),
        B,
        match="twice",
    ),
    Case("bench-draft-missing", "message", ("bench", "{exp}", *BENCH_QUICK, "--draft", "nope"), B, match="draft"),
    Case(
        "bench-lookup-openvino",
        "options",
        ("bench", "{exp}", *BENCH_QUICK, "--prompt-lookup", "3", "--runtime", "openvino"),
        B,
        match="runtime openvino .* runs no step of several proposals",
    ),
    # -- check: a folder or a plan, read as export and generate read them, never run -------------------------------
    Case("check-folder-and-plan", "options", ("check", "{exp}", "--fusion", "ort"), B, match="drop the planned"),
    Case("check-model-typo", "message", ("check", "--model", "./nope", "--fusion", "ort"), B, match="no such file"),
    Case("check-draft-missing", "message", ("check", "{exp}", "--draft", "nope"), B, match="draft.*does not exist"),
    Case("check-target-bogus", "options", ("check", "{exp}", "--target", "bogus"), B, match="unknown --target"),
    Case(
        "check-config-fifo",
        "hang",
        ("check", "--model", "pipe.json"),
        B,
        lambda c: os.mkfifo(c.dir / "pipe.json"),
        match="not a regular file",
        timeout=60,
        process=True,
    ),
    Case(
        "check-config-not-gpt2",
        "message",
        ("check", "--model", "config.json"),
        B,
        config_file(model_type="llama"),
        match="expected 'gpt2'",
    ),
    Case("emulate-fp16-on-fp32", "options", ("parity", "{exp}", "--cases", "1", "--emulate-fp16"), B, match="fp16"),
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
    *(
        Case(
            f"manifest-{key}-garbage-{cmd}",
            "traceback",
            (cmd, "m", *args),
            (0, B),  # shown as unreadable, or refused in one line: never an internal error
            export_copy(manifest_edit(**{key: value})),
            match="unreadable",
        )
        for key, value in (("parity", "garbage"), ("fusion", [1, 2]), ("fp16", 7), ("deploy", "x"))
        for cmd, args in (("inspect", ()), ("generate", GEN))
    ),
    Case(
        "manifest-files-garbage",
        "traceback",
        ("inspect", "m"),
        B,
        export_copy(manifest_edit(files={"model.onnx": "x"})),
        match="model.onnx",
    ),
    Case(
        "bench-new-tokens-1",
        "traceback",
        ("bench", "{exp}", "--batch", "1", "--prompt-len", "4", "--new-tokens", "1", "--warmup", "0", "--repeat", "1"),
        B,
        match="new tokens",
    ),
    Case(
        "bench-new-tokens-0",
        "traceback",
        ("bench", "{exp}", "--batch", "1", "--prompt-len", "4", "--new-tokens", "0", "--warmup", "0", "--repeat", "1"),
        B,
        match="new tokens",
    ),
    Case(
        "temperature-subnormal",
        "traceback",
        ("generate", "{exp}", "--ids", "1,2", "--sample", "--temperature", "1e-310"),
        B,
        match="temperature",
    ),
    Case(
        "temperature-tiny",
        "traceback",
        ("generate", "{exp}", "--ids", "1,2", "--sample", "--temperature", "1e-9"),
        B,
        match="temperature",
    ),
    Case("stdout-full", "traceback", (), EXIT_OUTPUT, run=stdout_full, match="stdout|output", timeout=60),
    # -- misleading messages ------------------------------------------------------------------------------------------
    Case(
        "error-names-no-staging-folder",
        "message",
        (*EXPORT_TINY, "--gate", "logits=1e-12", "-o", "out"),
        F,
        match="validation failed",
        absent=r"\.tmp-",
    ),
    Case(
        "optimize-error-names-no-staging-folder",
        "message",
        ("optimize", "{exp}", "-o", "out", "--fusion", "none", "--quantize", "int8", "--gate", "kl_mean=1e-12"),
        F,
        absent=r"\.tmp-",
    ),
]


def int8_export(c: Ctx) -> None:
    """An int8 export of the tiny checkpoint as 'm' (per-token uint8 activations, MatMulInteger), not validated."""
    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.precisions.quantize_options import QuantizeOptions

    export(str(c.src), c.dir / "m", options=ExportOptions(quantization=QuantizeOptions("int8"), validate=False))


@contextlib.contextmanager
def environment(name: str, value: str):
    """An environment variable set for an in-process case."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


# -- GPU providers (issue 28): what a provider cannot run is refused from what it declares, before any session ----
CASES += [
    Case(
        "int8-on-cuda",
        "silent",
        ("generate", "m", *GEN, "--provider", "cuda"),
        EXIT_RUNTIME,
        int8_export,
        match=r"provider 'cuda' cannot run this model's MatMulInteger ×\d+ \(CUDA's takes int8 activations only; "
        r"this graph gives it uint8\)",
    ),
    Case(
        "int8-bench-on-cuda-writes-nothing",
        "data-loss",
        ("bench", "m", *BENCH_QUICK, "--provider", "cuda", "--json", "b.json"),
        EXIT_RUNTIME,
        int8_export,
        match="MatMulInteger",
    ),
    Case(
        "contrib-ops-on-tensorrt",
        "message",
        ("generate", "{q4}", *GEN, "--provider", "tensorrt"),
        EXIT_RUNTIME,
        match=r"takes no com.microsoft op \(TensorRT's parser\).*writes com.microsoft ops \(MatMulNBits\)",
    ),
    Case("tf32-on-cpu", "options", ("generate", "{exp}", *GEN, "--tf32"), B, match="--tf32 applies to the cuda"),
    Case(
        "tf32-against-the-override",
        "options",
        ("parity", "{exp}", "--cases", "1", "--provider", "cuda", "--tf32"),
        B,
        match="NVIDIA_TF32_OVERRIDE=0",
        inject=lambda c: environment("NVIDIA_TF32_OVERRIDE", "0"),
    ),
]


def _relocate(folder: Path, name: str) -> None:
    """model.onnx's weights read from ``name`` (a copy of its data file the manifest does not list); the
    manifest re-hashed for model.onnx only."""
    import onnx

    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for init in model.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                entry.value = name
    onnx.save(model, str(folder / "model.onnx"))
    rehash(folder)


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


def output_options() -> list[tuple[str, str, str]]:
    """Every (command, option, kind) of the CLI that names a path it writes: the options declared with the
    OutputPath parser (gpt2onnx.cli). Found from the commands themselves, so a new one cannot be missed."""
    from gpt2onnx.cli import OutputPath

    return sorted(
        (command, option, info.parser.kind)
        for command, _, option, info, _ in _parameters()
        if isinstance(info.parser, OutputPath)
    )


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


# The command line each output option is fed into, otherwise valid ({out}: the hostile path); {read}: the model
# folder that command reads (an output inside it, or that is it, is refused).
OUTPUT_COMMANDS = {
    ("generate", "--json"): (
        ("generate", "{exp}", "--ids", "1,2", "--max-new-tokens", "1", "--json", "{out}"),
        "{exp}",
    ),
    ("eval", "--json"): (("eval", "{exp}", "--text", "t.txt", "--greedy-tokens", "0", "--json", "{out}"), "{exp}"),
    ("parity", "--json"): (("parity", "{exp}", "--cases", "1", "--json", "{out}"), "{exp}"),
    ("bench", "--json"): (("bench", "{exp}", *BENCH_QUICK, "--json", "{out}"), "{exp}"),
    ("bench", "--plot"): (("bench", "{exp}", *BENCH_QUICK, "--plot", "{out}"), "{exp}"),
    ("bench", "--csv"): (("bench", "{exp}", *BENCH_QUICK, "--csv", "{out}"), "{exp}"),
    ("bench", "--md"): (("bench", "{exp}", *BENCH_QUICK, "--md", "{out}"), "{exp}"),
    ("bench generate", "--json"): (("bench", "generate", "{exp}", *GENERATE_QUICK, "--json", "{out}"), "{exp}"),
    ("bench speculative", "--json"): (("bench", "speculative", "{exp}", *SPEC_QUICK, "--json", "{out}"), "{exp}"),
    ("bench speculative", "--md"): (("bench", "speculative", "{exp}", *SPEC_QUICK, "--md", "{out}"), "{exp}"),
    ("bench constraint", "--json"): (("bench", "constraint", "{exp}", *COST_QUICK, "--json", "{out}"), "{exp}"),
    ("bench constraint", "--md"): (("bench", "constraint", "{exp}", *COST_QUICK, "--md", "{out}"), "{exp}"),
    ("bench generate", "--md"): (("bench", "generate", "{exp}", *GENERATE_QUICK, "--md", "{out}"), "{exp}"),
    ("bench memory", "--json"): (("bench", "memory", "{exp}", *MEMORY_QUICK, "--json", "{out}"), "{exp}"),
    ("bench memory", "--md"): (("bench", "memory", "{exp}", *MEMORY_QUICK, "--md", "{out}"), "{exp}"),
    ("check", "--json"): (("check", "{exp}", "--json", "{out}"), "{exp}"),
    **{
        ("compare", option): (("compare", "{src}", "--only", "gpt2onnx:fp32", option, "{out}"), "{src}")
        for option in ("--json", "--md", "--csv", "--plot", "--work")
    },
    ("bench web", "--json"): (("bench", "web", "{exp}", "--json", "{out}"), "{exp}"),
    ("bench web", "--md"): (("bench", "web", "{exp}", "--md", "{out}"), "{exp}"),
    ("bench served", "--json"): (("bench", "served", "{exp}", "--json", "{out}"), "{exp}"),
    ("bench served", "--md"): (("bench", "served", "{exp}", "--md", "{out}"), "{exp}"),
    **{
        ("bench precision", option): (
            ("bench", "precision", "{src}", "--text", "t.txt", "--only", "fp32", option, "{out}"),
            "{src}",
        )
        for option in ("--json", "--md", "--csv", "--work")
    },
    ("export", "--out"): (("export", "--model", "{src}", "--no-validate", "-o", "{out}"), "{src}"),
    ("optimize", "--out"): (("optimize", "{exp}", "-o", "{out}"), "{exp}"),
    ("deploy", "--out"): (("deploy", "{exp}", "--target", "genai", "-o", "{out}"), None),  # -o FOLDER itself: in place
    **{
        (cmd, "--trt-cache-dir"): ((*base, "--provider", "tensorrt", "--trt-cache-dir", "{out}"), None)
        for cmd, base in (
            ("generate", ("generate", "{exp}", "--ids", "1,2", "--max-new-tokens", "1")),
            ("parity", ("parity", "{exp}", "--cases", "1")),
            ("bench", ("bench", "{exp}", *BENCH_QUICK)),
            ("bench generate", ("bench", "generate", "{exp}", *GENERATE_QUICK)),
            ("bench speculative", ("bench", "speculative", "{exp}", *SPEC_QUICK)),
            ("bench constraint", ("bench", "constraint", "{exp}", *COST_QUICK)),
            ("eval", ("eval", "{exp}", "--text", "t.txt", "--greedy-tokens", "0")),
            ("check", ("check", "{exp}")),
        )
    },
}


def _hostile_place(kind: str) -> Callable[[Ctx], None]:
    def setup(c: Ctx) -> None:
        (c.dir / "t.txt").write_text("Hello, world. " * 40)
        (c.dir / "keep.txt").write_text("keep")
        (c.dir / "real").mkdir()
        (c.dir / "link").symlink_to("keep.txt" if kind == "file" else "real")
        (c.dir / "dangling").symlink_to(c.dir / "nowhere")
        (c.dir / "read-link").symlink_to(c.exp)
        os.mkfifo(c.dir / "pipe")
        (c.dir / "afile").write_text("mine")
        (c.dir / "d").mkdir()

    return setup


# the same hostile set for every output option: (name, path, applies to kinds)
HOSTILE_OUTPUTS = (
    ("model-file", "{read}/model.onnx", ("file",)),
    ("manifest", "{read}/gpt2onnx.json", ("file",)),
    ("config", "{read}/config.json", ("file",)),
    ("new-file-in-model-folder", "{read}/new.json", ("file",)),
    ("input-text", "t.txt", ("file",)),
    ("link", "link", ("file", "folder")),
    ("dangling-link", "dangling", ("file", "folder")),
    ("fifo", "pipe", ("file", "folder")),
    ("device", "/dev/null", ("file", "folder")),
    ("folder", "d", ("file",)),
    ("no-such-folder", "nope/x.json", ("file",)),
    ("a-file", "afile", ("folder",)),
    ("the-model-folder", "{read}", ("folder",)),
    ("link-to-the-model-folder", "read-link", ("folder",)),
    ("working-directory", ".", ("folder",)),
)


def _output_cases() -> list[Case]:
    cases = []
    for command, option, kind in output_options():
        argv, read = OUTPUT_COMMANDS[(command, option)]
        for name, path, kinds in HOSTILE_OUTPUTS:
            if kind not in kinds or ("{read}" in path and read is None) or (name == "input-text" and command != "eval"):
                continue
            if option == "--trt-cache-dir" and name in ("working-directory", "link-to-the-model-folder"):
                continue  # a cache is written into, never replaced: these are allowed
            if option == "--work" and name == "working-directory":
                continue  # a work folder is written into, never replaced: the working directory may be one
            out = path.replace("{read}", read or "")
            cases.append(
                Case(
                    f"output-{command}-{option.strip('-')}-{name}",
                    "data-loss",
                    tuple(a.replace("{out}", out) for a in argv),
                    B,
                    _hostile_place(kind),
                )
            )
    return cases


# -- serve: what it serves is what it checked ------------------------------------------------------------------
SECRET = "the-secret-outside-the-folder"
SITE = ("site", "secret.html")  # what a serve case sets up as it runs (served, never written by serve)


def _site(c: Ctx, **links: str) -> Path:
    """A served folder 'site' (index.html, a 4 MB file, a manifest naming a local path) beside a secret file;
    ``links``: site-relative path → link target ({secret}: the secret file)."""
    site = c.dir / "site"
    (site / "sub").mkdir(parents=True)
    (site / "index.html").write_text("<p>the page</p>")
    (site / "sub" / "index.html").write_text("<p>sub</p>")
    (site / "config.json").write_text('{"the": "config"}')
    (site / "big.bin").write_bytes(os.urandom(4 << 20))
    (site / "gpt2onnx.json").write_text(json.dumps({"source": {"path": str(c.dir / "private" / "checkpoint")}}))
    (c.dir / "secret.html").write_text(SECRET)
    for rel, target in links.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            path.unlink()
        path.symlink_to(target.format(secret=c.dir / "secret.html"))
    return site


def _serving(c: Ctx, cli, requests: Callable[[str], None], **links: str) -> Outcome:
    """``gpt2onnx serve site --port 0`` for real; ``requests(url)`` runs against it, then Ctrl-C (SIGINT) stops it."""
    _site(c, **links)
    proc = cli(["serve", "site", "--port", "0"], c, wait=False)
    try:
        line = proc.stdout.readline()
        url = line.split(" at ")[1].split()[0] if " at " in line else None
        assert url, f"serve printed no address: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        requests(url)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    return finish(proc, 30)


def _raw(url: str, request: bytes) -> bytes:
    """One raw HTTP/1.0 exchange (a request line the standard clients would never send)."""
    import socket

    host, port = url.split("//")[1].strip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    return data


def _status(url: str, path: str) -> tuple[int, bytes]:
    reply = _raw(url, f"GET {path} HTTP/1.0\r\n\r\n".encode())
    return int(reply.split(b" ", 2)[1]), reply


def _never_secret(path: str, allowed: tuple[int, ...]) -> Callable[[Ctx, Callable], Outcome]:
    def run(c: Ctx, cli) -> Outcome:
        def requests(url: str) -> None:
            code, reply = _status(url, path)
            assert SECRET.encode() not in reply, f"GET {path} served the file outside the folder"
            assert code in allowed, f"GET {path}: {code}"

        return _serving(c, cli, requests, **_SERVE_LINKS)

    return run


_SERVE_LINKS = {
    "index.html": "{secret}",
    "sub/index.html": "{secret}",
    "http:/x/config.json": "{secret}",  # what the absolute form used to be served from
}


def _absolute_form(c: Ctx, cli) -> Outcome:
    def requests(url: str) -> None:
        code, reply = _status(url, "http://x/config.json")
        assert SECRET.encode() not in reply and code == 200 and b'{"the": "config"}' in reply, reply[:300]

    return _serving(c, cli, requests, **_SERVE_LINKS)


def _manifest_not_served(c: Ctx, cli) -> Outcome:
    def requests(url: str) -> None:
        code, reply = _status(url, "/gpt2onnx.json")
        assert code == 404 and str(c.dir).encode() not in reply, reply[:300]

    return _serving(c, cli, requests)


def _clients_go_away(c: Ctx, cli) -> Outcome:
    """200 clients that reset the connection mid-download: no traceback, the server still serves."""
    import socket
    import struct

    def requests(url: str) -> None:
        host, port = url.split("//")[1].strip("/").split(":")
        for _ in range(200):
            with socket.create_connection((host, int(port)), timeout=20) as sock:
                sock.sendall(b"GET /big.bin HTTP/1.0\r\n\r\n")
                sock.recv(1024)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
        code, reply = _status(url, "/config.json")
        assert code == 200, reply[:200]

    out = _serving(c, cli, requests)
    assert len([line for line in out.stderr.splitlines() if line.strip()]) <= 1, out.stderr[-2000:]
    return out


# -- manifest claims the graph contradicts ---------------------------------------------------------------------
def _deployed_file(name: str, dtype: str) -> Callable[[Ctx, Outcome], None]:
    def check(c: Ctx, out: Outcome) -> None:
        config = json.loads((c.dir / "out" / "config.json").read_text())
        assert (c.dir / "out" / "onnx" / name).is_file(), sorted(p.name for p in (c.dir / "out" / "onnx").iterdir())
        assert config["transformers.js_config"]["dtype"] == dtype, config["transformers.js_config"]

    return check


def _quantization_claim(folder: Path) -> None:
    manifest_edit(quantization={"method": "int4", "block_size": 32, "ops": {"MatMulNBits": 9}})(folder)


def _eval_not_token_by_token(c: Ctx, out: Outcome) -> None:
    report = json.loads((c.dir / "e.json").read_text())
    assert [row["token_by_token"] for row in report["rows"]] == [False], report["rows"]


def _files_empty(swap: bool) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        if swap:
            swap_model(folder)
        manifest_edit(files={})(folder)

    return edit


# -- generation numbers: one typed reader -----------------------------------------------------------------------
def _generation_raw(**raw: str) -> Callable[[Ctx], None]:
    """A copy of the export as 'm' whose generation_config.json holds ``raw`` JSON values (NaN, Infinity, 1e30)."""

    def setup(c: Ctx) -> None:
        folder = c.copy("exp", "m")
        path = folder / "generation_config.json"
        text = path.read_text().rstrip().rstrip("}").rstrip()
        path.write_text(text + "".join(f',\n  "{k}": {v}' for k, v in raw.items()) + "\n}\n")

    return setup


def _low_memory(c: Ctx):
    """This machine has 2 GB available: a run is allowed only if its estimate fits."""
    from unittest import mock

    return mock.patch("gpt2onnx.runtimes.decoder.available_memory", return_value=2 << 30)


# -- text read in bounded pieces --------------------------------------------------------------------------------
def _big_text(kind: str, megabytes: int) -> Callable[[Ctx], None]:
    def setup(c: Ctx) -> None:
        import random

        rng = random.Random(0)
        words = ["the", "model", "of", "a", "text", "and", "runs", "hello", "world"]
        block = "a" * (1 << 20) if kind == "letter" else " ".join(rng.choices(words, k=200_000))[: (1 << 20) - 1] + " "
        with open(c.dir / "big.txt", "w") as fh:
            for _ in range(megabytes):  # one block of 1 MB, written again: no punctuation anywhere
                fh.write(block)

    return setup


def _bad_byte_at(position: int) -> Callable[[Ctx], None]:
    def setup(c: Ctx) -> None:
        data = bytearray(b"Hello, world. " * (position // 14 + 100))
        data[position] = 0xFF
        (c.dir / "bad.txt").write_bytes(bytes(data))

    return setup


# -- files read from a folder or an option ----------------------------------------------------------------------
def _fake_web_lib(root: Path, *, package_fifo: bool = False) -> Path:
    """A node_modules tree shaped like an npm install of transformers.js 4.3.2 and onnxruntime-web (files empty):
    the web target copies from it without npm."""
    package = root / "node_modules" / "@huggingface" / "transformers"
    ort = root / "node_modules" / "onnxruntime-web"
    for folder in (package / "dist", ort / "dist"):
        folder.mkdir(parents=True)
    if package_fifo:
        os.mkfifo(package / "package.json")
    else:
        meta = {"name": "@huggingface/transformers", "version": "4.3.2", "dependencies": {"onnxruntime-web": "1.0.0"}}
        (package / "package.json").write_text(json.dumps(meta))
    (ort / "package.json").write_text(json.dumps({"name": "onnxruntime-web", "version": "1.0.0"}))
    (package / "dist" / "transformers.min.js").write_text("// transformers.js")
    for name in ("ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm"):
        (ort / "dist" / name).write_text("")
    return root / "node_modules"


def _page_settings(c: Ctx, name: str) -> None:
    import html

    page = (c.dir / name / "index.html").read_text()
    start = page.index('id="gpt2onnx-settings">') + len('id="gpt2onnx-settings">')
    settings = json.loads(page[start : page.index("</script>", start)])
    assert settings["name"] == name, settings["name"]
    assert "<title>" + html.escape(name) + " ·" in page


def _user_tokenizer_json(c: Ctx) -> None:
    """An export whose tokenizer.json the user added later (not in the manifest), and an npm tree for the page."""
    folder = c.copy("exp", "m")
    manifest = json.loads((folder / "gpt2onnx.json").read_text())
    del manifest["files"]["tokenizer.json"]
    (folder / "gpt2onnx.json").write_text(json.dumps(manifest))
    _fake_web_lib(c.dir / "lib")


def _damaged_bpe(name: str) -> Callable[[Ctx], None]:
    """An export with vocab.json and merges.txt but no tokenizer.json, one of the two damaged."""

    def setup(c: Ctx) -> None:
        from transformers import GPT2TokenizerFast

        folder = c.copy("exp", "m")
        GPT2TokenizerFast.from_pretrained(folder).save_pretrained(c.dir / "tok", legacy_format=True)
        shutil.copy(c.dir / "tok" / "merges.txt", folder / "merges.txt")
        vocab = json.loads((c.dir / "tok" / "vocab.json").read_text())
        vocab.setdefault("<|endoftext|>", len(vocab))  # an added token there: GPT-2's vocab.json holds it
        (folder / "vocab.json").write_text(json.dumps(vocab))
        shutil.rmtree(c.dir / "tok")
        (folder / "tokenizer.json").unlink()
        (folder / name).write_text("not a merges file\n" if name == "merges.txt" else "[1, 2]")
        rehash_all(folder)

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


def _small_vocab_source(c: Ctx) -> None:
    """A checkpoint of 300 tokens whose tokenizer files give ids up to 999 (they belong to another model)."""
    from conftest import make_config, write_hf_folder, write_tokenizer

    config = make_config("h4-v1000")
    config.vocab_size, config.eos_token_id, config.bos_token_id = 300, 299, 299  # its merges have ids above 300
    folder = write_hf_folder(c.dir / "m", config)
    write_tokenizer(folder)
    (c.dir / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)


def _out_has(*names: str) -> Callable[[Ctx, Outcome], None]:
    def check(c: Ctx, out: Outcome) -> None:
        for name in names:
            assert (c.dir / "out" / name).exists(), f"out/{name} is missing"

    return check


def _user_files_beside(c: Ctx) -> None:
    folder = c.copy("exp", "m")
    (folder / "notes.txt").write_text("mine")
    (folder / "trt_cache").mkdir()
    (folder / "trt_cache" / "engine.bin").write_text("engine")


def _deployed_with_user_file_in_onnx(c: Ctx) -> None:
    from gpt2onnx.targets.deploy import deploy

    c.copy("exp", "m")
    deploy(c.dir / "m", "transformers-js", out=c.dir / "out")
    (c.dir / "out" / "onnx" / "mine.onnx").write_text("my own graph")


def _model_in_case_folder(c: Ctx) -> None:
    """The case folder itself is the model folder (the command runs from inside it: cd m && gpt2onnx deploy .)."""
    for path in c.exp.iterdir():
        shutil.copy(path, c.dir / path.name)


GEN1 = ("--ids", "1,2", "--max-new-tokens", "1")

CASES += [
    *_output_cases(),
    # -- serve -----------------------------------------------------------------------------------------------------
    *(
        Case(name, cls, (), 0, run=run, timeout=timeout, creates=SITE)
        for name, cls, run, timeout in (
            ("serve-index-link-outside", "security", _never_secret("/", (403, 404)), 60),
            ("serve-sub-index-link-outside", "security", _never_secret("/sub/", (403, 404)), 60),
            ("serve-absolute-form", "security", _absolute_form, 60),
            ("serve-manifest-local-paths", "security", _manifest_not_served, 60),
            ("serve-clients-go-away", "traceback", _clients_go_away, 120),
        )
    ),
    # -- deploy's outputs --------------------------------------------------------------------------------------------
    Case(
        "deploy-out-link-to-source",
        "data-loss",
        ("deploy", "m", "--target", "genai", "-o", "link"),
        B,
        lambda c: (c.copy("exp", "m"), (c.dir / "link").symlink_to("m")),
        match="symbolic link",
    ),
    Case(
        "deploy-in-place-from-inside",
        "data-loss",
        ("deploy", ".", "--target", "genai"),
        B,
        _model_in_case_folder,
        match="working directory",
    ),
    Case(
        "deploy-out-keeps-user-files",
        "data-loss",
        ("deploy", "m", "--target", "genai", "-o", "out"),
        0,
        _user_files_beside,
        creates=("out",),
        check=_out_has("notes.txt", "trt_cache/engine.bin", "genai_config.json"),
    ),
    Case(
        "deploy-force-user-file-in-target-folder",
        "data-loss",
        ("deploy", "m", "--target", "transformers-js", "-o", "out", "--force"),
        B,
        _deployed_with_user_file_in_onnx,
        match="onnx/mine.onnx",
    ),
    # -- graph facts over manifest claims: one case per field a command acts on ---------------------------------
    Case(
        "manifest-files-empty",
        "silent",
        ("generate", "m", *GEN1),
        B,
        export_copy(_files_empty(swap=False)),
        match="does not list 'model.onnx'",
    ),
    Case(
        "manifest-files-empty-swapped-model",
        "silent",
        ("generate", "m", *GEN1),
        B,
        export_copy(_files_empty(swap=True)),
        match="does not list 'model.onnx'",
    ),
    Case(
        "manifest-dtype-float16-on-fp32-graph",
        "silent",
        ("deploy", "m", "--target", "transformers-js", "-o", "out"),
        0,
        export_copy(manifest_edit(dtype="float16")),
        creates=("out",),
        check=_deployed_file("model.onnx", "fp32"),
    ),
    Case(
        "manifest-quantization-int4-on-fp32-graph",
        "silent",
        ("deploy", "m", "--target", "transformers-js", "-o", "out"),
        0,
        export_copy(_quantization_claim),
        creates=("out",),
        check=_deployed_file("model.onnx", "fp32"),
    ),
    Case(
        "manifest-logits-last-on-all-logits-graph",
        "silent",
        ("eval", "m", "--text", "t.txt", "--greedy-tokens", "0", "--json", "e.json"),
        0,
        lambda c: (
            export_copy(manifest_edit(options={"logits": "last"}))(c),
            (c.dir / "t.txt").write_text("the quick brown fox. " * 30),
        ),
        creates=("e.json",),
        check=_eval_not_token_by_token,
    ),
    Case(
        "eval-reference-other-architecture",
        "silent",
        ("eval", "{exp}", "--text", "t.txt", "--greedy-tokens", "0", "--reference", "other"),
        B,
        lambda c: (other_checkpoint(n_layer=1, n_head=2)(c), (c.dir / "t.txt").write_text("Hello, world. " * 30)),
        match="does not match",
    ),
    # -- numbers from generation_config.json and the command line ----------------------------------------------
    *(
        Case(
            f"ort-generate-{key}-{label}",
            "traceback",
            ("deploy", "m", "--target", "ort-generate", "-o", "out"),
            B,
            _generation_raw(**{key: raw}),
            match=f"{key} [^ ]+ in '.*generation_config.json' is not",
        )
        for key, label, raw in (
            ("temperature", "nan", "NaN"),
            ("temperature", "infinity", "Infinity"),
            ("no_repeat_ngram_size", "infinity", "Infinity"),
            ("no_repeat_ngram_size", "nan", "NaN"),
            ("no_repeat_ngram_size", "2-64", str(2**64)),
            ("no_repeat_ngram_size", "1e30", "1e30"),
        )
    ),
    Case(
        "genai-top-k-10-20",
        "silent",
        ("deploy", "m", "--target", "genai", "-o", "out"),
        B,
        _generation_raw(top_k=str(10**20)),
        match="top_k 100000000000000000000 in .* is not an integer from 0 to 2,147,483,647",
    ),
    *(
        Case(
            f"generate-{key}-{label}",
            "traceback",
            ("generate", "m", *GEN1),
            B,
            _generation_raw(**{key: raw}),
            match=f"{key} {re.escape(raw)} in .* is not a token id: an integer from 0 to 999",
        )
        for key, label, raw in (
            ("eos_token_id", "10-30", str(10**30)),
            ("pad_token_id", "10-30", str(10**30)),
            ("eos_token_id", "outside-vocab", "5000"),
            ("eos_token_id", "negative", "-1"),
            ("pad_token_id", "list", "[1, 2]"),
        )
    ),
    Case(
        "generate-length-penalty-1e300",
        "traceback",
        ("generate", "{exp}", *GEN1, "--num-beams", "2", "--length-penalty", "1e300"),
        B,
        match=r"length_penalty 1e\+300 \(--length-penalty\) is not a finite number from -10 to 10",
    ),
    Case(
        "generate-prompt-invalid-utf8",
        "traceback",
        ("generate", "{exp}", "--prompt", "hello \udcff there", "--max-new-tokens", "1"),
        B,
        match="--prompt is not valid UTF-8 text",
    ),
    Case(
        "generate-num-beams-150000-counted",
        "hang",
        ("generate", "{exp}", "--ids", "1", "--max-new-tokens", "1", "--num-beams", "150000"),
        B,
        inject=_low_memory,
        match="beam search.*2.1 GB available",
    ),
    # -- text read in bounded pieces (the runner caps each process at 3 GB of address space) ----------------------
    Case(
        "text-20mb-words-and-spaces",
        "hang",
        ("parity", "{exp}", "--cases", "1", "--text", "big.txt"),
        0,
        _big_text("words", 20),
        process=True,
        timeout=240,
    ),
    Case(
        "text-16mb-one-letter",
        "hang",
        ("parity", "{exp}", "--cases", "1", "--text", "big.txt"),
        0,
        _big_text("letter", 16),
        process=True,
        timeout=240,
    ),
    Case(
        "text-bad-byte-position-from-start",
        "message",
        ("eval", "{exp}", "--text", "bad.txt"),
        B,
        _bad_byte_at(1_067_482),
        match="at byte 1,067,482 from its start",
    ),
    # -- messages name the file at fault, where it is ----------------------------------------------------------------
    *(
        Case(
            f"deploy-damaged-{name.split('.')[0]}-names-the-source",
            "message",
            ("deploy", "m", "--target", "genai", "-o", "out"),
            B,
            _damaged_bpe(name),
            match=f"'m/{name}'",
            absent="out/",
        )
        for name in ("merges.txt", "vocab.json")
    ),
    Case(
        "export-eval-text-tokenizer-of-the-source",
        "message",
        ("export", "--model", "m", "-o", "out", "--no-validate", "--eval-text", "t.txt"),
        B,
        _small_vocab_source,
        match="the tokenizer of '[^']*m'",
        absent="'out'",
    ),
    Case(
        "deploy-web-user-tokenizer-json",
        "message",
        ("deploy", "m", "--target", "web", "-o", "out", "--web-lib", "lib"),
        0,
        _user_tokenizer_json,
        creates=("out",),
        check=_out_has("index.html", "tokenizer.json"),
    ),
    # -- files read from an option, and templates -------------------------------------------------------------------
    Case(
        "deploy-web-lib-package-json-fifo",
        "hang",
        ("deploy", "{exp}", "--target", "web", "-o", "out", "--web-lib", "lib"),
        B,
        lambda c: _fake_web_lib(c.dir / "lib", package_fifo=True),
        match="package.json.*not a regular file",
        process=True,
        timeout=120,
    ),
    Case(
        "deploy-web-title-template",
        "security",
        ("deploy", "{exp}", "--target", "web", "-o", 'x"__GPT2ONNX_TITLE__', "--web-lib", "lib"),
        0,
        lambda c: _fake_web_lib(c.dir / "lib"),
        creates=('x"__GPT2ONNX_TITLE__',),
        check=lambda c, out: _page_settings(c, 'x"__GPT2ONNX_TITLE__'),
    ),
]


# -- round four (issue 37): deploy's Triton output, the ort-generate files, weights the checkpoint cannot hold ----
def _export_link(name: str, *, rehashed: bool = True) -> Callable[[Ctx], None]:
    """A copy of the export as 'm' whose ``name`` is a link to a copy of it outside the folder (manifest
    re-hashed: a crafted folder)."""

    def setup(c: Ctx) -> None:
        folder = c.copy("exp", "m")
        shutil.copy(folder / name, c.dir / f"outside-{name}")
        (folder / name).unlink()
        (folder / name).symlink_to(c.dir / f"outside-{name}")
        if rehashed:
            rehash(folder)

    return setup


def _generation_config_link(c: Ctx) -> None:
    folder = c.copy("exp", "m")
    data = json.loads((folder / "generation_config.json").read_text())
    data["eos_token_id"] = 3  # what the outside file says: never followed
    (c.dir / "outside.json").write_text(json.dumps(data))
    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").symlink_to(c.dir / "outside.json")


CASES += [
    Case(
        "deploy-triton-tokenizer-json-link-out",
        "silent",
        ("deploy", "m", "--target", "triton", "-o", "out"),
        B,
        _export_link("tokenizer.json"),
        match="tokenizer.json.*(leads outside|link)",
    ),
    Case(
        "generate-generation-config-link-out",
        "silent",
        ("generate", "m", "--ids", "1,2", "--max-new-tokens", "2"),
        B,
        _generation_config_link,
        match="generation_config.json.*leads outside",
    ),
    Case(  # float32 stores 1e-46 as 0.0: sampling.onnx would hold top_p 0 while the manifest records 1e-46
        "deploy-ort-generate-top-p-below-float32",
        "silent",
        ("deploy", "m", "--target", "ort-generate", "-o", "out"),
        B,
        lambda c: _generation_config(c.copy("exp", "m"), do_sample=True, top_p=1e-46),
        match="top_p 1e-46 in 'm/generation_config.json'.*0 as a float32",  # the source's file, not staging's
    ),
    Case(
        "deploy-genai-names-the-source-file",
        "message",
        ("deploy", "m", "--target", "genai", "-o", "out"),
        B,
        lambda c: _generation_config(c.copy("exp", "m"), do_sample=True, top_p=1e-46),
        match="in 'm/generation_config.json'",
    ),
    Case(
        "generate-top-p-below-float32",
        "silent",
        ("generate", "{exp}", "--ids", "1,2", "--sample", "--top-p", "1e-46"),
        B,
        match="top_p 1e-46.*float32",
    ),
]


def _ort_generate_folder(edit: Callable[[Path, Ctx], None]) -> Callable[[Ctx], None]:
    """The export deployed as 'm' with ort-generate (its manifest lists the ort-generate files), then ``edit``."""

    def setup(c: Ctx) -> None:
        from gpt2onnx.targets.deploy import deploy

        folder = c.copy("exp", "m")
        deploy(folder, "ort-generate")
        edit(folder / "ort-generate", c)

    return setup


def _other_weights(sub: Path, c: Ctx) -> None:
    """Another checkpoint's weights of the same size: every byte of the data file changed."""
    path = sub / "weights.onnx_data"
    data = bytearray(path.read_bytes())
    data[: len(data) // 2] = bytes(len(data) // 2)
    path.unlink()
    path.write_bytes(bytes(data))


def _data_outside(sub: Path, c: Ctx) -> None:
    import onnx

    path = sub / "greedy_search.onnx"
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../../outside.bin"
    path.unlink()
    onnx.save(model, str(path))
    shutil.copy(sub / "weights.onnx_data", c.dir / "outside.bin")


def _linked_ort_folder(sub: Path, c: Ctx) -> None:
    shutil.move(sub, c.dir / "elsewhere")
    sub.symlink_to(c.dir / "elsewhere")


def _fifo_ort_file(sub: Path, c: Ctx) -> None:
    (sub / "greedy_search.onnx").unlink()
    os.mkfifo(sub / "greedy_search.onnx")


def _float8_weights(tensors: dict) -> None:
    import torch

    tensors["transformer.ln_f.weight"] = tensors["transformer.ln_f.weight"].to(torch.float8_e4m3fn)


def readonly_mount_deploy(c: Ctx, cli) -> Outcome:
    """An in-place deploy of a folder that is a read-only bind mount: the new folder cannot replace it, and no
    empty backup folder (.m.old-PID-*) is left beside it."""
    import pytest

    folder = c.copy("exp", "m")
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    mounted = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here ({mounted.stderr.strip()[:100]})")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True, capture_output=True)
        out = cli(["deploy", "m", "--target", "genai"], c)
        left = sorted(p.name for p in c.dir.iterdir() if p.name.startswith("."))
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
    assert left == [], f"left beside the folder: {left}"
    return out


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


HOSTILE_OUTPUT = (
    'x" data_type: TYPE_FP32 dims: [ -1 ] } ] instance_group [ { kind: KIND_GPU count: 1 } ] output [ { name: "y'
)


def _hostile_output_name(c: Ctx) -> None:
    """The export as 'm' with one more graph output whose name would close config.pbtxt's string and add an
    instance kind and an output, were it written unescaped (the manifest re-hashed: a crafted folder)."""
    import onnx
    from onnx import helper

    folder = c.copy("exp", "m")
    model = onnx.load(str(folder / "model.onnx"))
    model.graph.node.append(helper.make_node("Identity", ["logits"], [HOSTILE_OUTPUT]))
    extra = onnx.ValueInfoProto()
    extra.CopyFrom(next(o for o in model.graph.output if o.name == "logits"))
    extra.name = HOSTILE_OUTPUT
    model.graph.output.append(extra)
    (folder / "model.onnx").unlink()
    onnx.save(model, str(folder / "model.onnx"))
    rehash(folder)


def _config_reads_back(c: Ctx, out: Outcome) -> None:
    """Triton's config as protobuf text: one instance_group, one output list, the hostile name one string."""
    from google.protobuf import text_format

    text = (c.dir / "out" / "triton" / "out" / "config.pbtxt").read_text()
    tokenizer, top, strings, depth = text_format.Tokenizer(text.splitlines()), [], [], 0
    while not tokenizer.AtEnd():
        if tokenizer.token.startswith('"'):
            strings.append(tokenizer.ConsumeString())
            continue
        token = tokenizer.token
        depth += token in "[{" and len(token) == 1
        depth -= token in "]}" and len(token) == 1
        if depth == 0 and token[0].isalpha():
            top.append(token)
        tokenizer.NextToken()
    assert top.count("instance_group") == 1 and top.count("output") == 1, top
    assert HOSTILE_OUTPUT in strings and "KIND_GPU" not in top


ORT_GENERATE_RUN = ("generate", "m", "--runtime", "ort-generate", "--ids", "1,2", "--max-new-tokens", "2")
CASES += [
    Case(
        "ort-generate-other-weights",
        "silent",
        ORT_GENERATE_RUN,
        B,
        _ort_generate_folder(_other_weights),
        match="weights.onnx_data.*differs from what the manifest",
    ),
    Case(
        "ort-generate-data-outside",
        "traceback",
        ORT_GENERATE_RUN,
        B,
        _ort_generate_folder(_data_outside),
        match="outside.bin.*not a plain file name",
    ),
    Case(
        "ort-generate-linked-folder",
        "silent",
        ORT_GENERATE_RUN,
        B,
        _ort_generate_folder(_linked_ort_folder),
        match="ort-generate' is a symbolic link",
    ),
    Case(
        "ort-generate-file-fifo",
        "message",
        ORT_GENERATE_RUN,
        B,
        _ort_generate_folder(_fifo_ort_file),
        match="greedy_search.onnx' is a FIFO",
        process=True,
        timeout=120,
    ),
    Case(  # F8_E4M3 in the safetensors file: torch has no isfinite for it (was exit 70)
        "float8-weights",
        "traceback",
        ("export", "--model", "m", "-o", "out"),
        B,
        weights_edit(_float8_weights),
        match="ln_f.weight.*float8_e4m3fn",
    ),
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
    Case(
        "deploy-triton-hostile-output-name",
        "security",
        ("deploy", "m", "--target", "triton", "-o", "out"),
        0,
        _hostile_output_name,
        creates=("out",),
        check=_config_reads_back,
    ),
    Case("deploy-readonly-mount", "data-loss", (), EXIT_OUTPUT, run=readonly_mount_deploy, creates=("m",), timeout=240),
]


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


def _serve_per_request(c: Ctx, cli) -> Outcome:
    """Probes of an index.html that leads out of the folder poison nothing: once it is a page inside the folder,
    '/' serves it; a folder without index.html is 404, never a redirect to a listing; 'file/' on a file is 404."""

    def requests(url: str) -> None:
        for path in ("/", "/index.html", "/index.html/", "//index.html", "/"):
            code, reply = _status(url, path)
            assert SECRET.encode() not in reply and code in (403, 404), (path, code)
        index = c.dir / "site" / "index.html"
        index.unlink()
        (c.dir / "site" / "page.html").write_text("<p>the page</p>")
        index.symlink_to("page.html")  # a link inside the folder
        for path in ("/", "/index.html"):
            code, reply = _status(url, path)
            assert code == 200 and b"<p>the page</p>" in reply, (path, code, reply[:300])
        (c.dir / "site" / "lib").mkdir()
        (c.dir / "site" / "lib" / "a.js").write_text("export {}")
        for path, expected in (("/lib", 404), ("/lib/", 404), ("/config.json/", 404), ("/lib/a.js/", 404)):
            code, reply = _status(url, path)
            assert code == expected and b"Location" not in reply and b"a.js" not in reply, (path, code, reply[:300])

    return _serving(c, cli, requests, **{"index.html": "{secret}"})


CASES += [
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
    Case(
        "eval-json-interrupted",
        "data-loss",
        (),
        0,
        run=_interrupted(("eval", "{exp}", "--text", "t.txt", "--json", "e.json", "--greedy-tokens", "0"), ("e.json",)),
        creates=("e.json", "t.txt"),
        timeout=400,
    ),
    Case(
        "bench-json-plot-interrupted",
        "data-loss",
        (),
        0,
        run=_interrupted(
            (
                "bench",
                "{exp}",
                "--batch",
                "1,4",
                "--prompt-len",
                "32",
                "--new-tokens",
                "32",
                "--warmup",
                "1",
                "--repeat",
                "150",
                "--json",
                "b.json",
                "--plot",
                "b.png",
            ),
            ("b.json", "b.png"),
        ),
        creates=("b.json", "b.png", "t.txt"),
        timeout=400,
    ),
    Case("serve-decides-per-request", "security", (), 0, run=_serve_per_request, creates=(*SITE, "site"), timeout=60),
]


# -- round five (issue 47) -----------------------------------------------------------------------------------------
def _int4_external(c: Ctx) -> None:
    """An int4 export whose weights are in an external data file (deploy hard-links that file into its targets)."""
    from gpt2onnx.exporters.export import ExportOptions, export
    from gpt2onnx.precisions.quantize_options import QuantizeOptions

    options = ExportOptions(quantization=QuantizeOptions("int4"), external_data=True, validate=False)
    export(str(c.src), c.dir / "q", options=options)


def _deployed_files_load(c: Ctx, out: Outcome) -> None:
    import onnxruntime as ort

    for name in ("model_q4.onnx", "model_q4f16.onnx"):
        ort.InferenceSession(str(c.dir / "out" / "onnx" / name), providers=["CPUExecutionProvider"])


def _deployed_with_links(c: Ctx) -> None:
    from gpt2onnx.targets.deploy import deploy

    _int4_external(c)
    deploy(c.dir / "q", "triton", out=c.dir / "d")  # the data file now has three hard links
    assert (c.dir / "d" / "model.onnx_data").stat().st_nlink > 1


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
        paths = os.pathsep.join((str(site), str(Path(__file__).resolve().parents[1])))
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
    Case(
        "deploy-tjs-int4-external-data",  # once exit 70: onnx refused the data file's hard links
        "traceback",
        ("deploy", "q", "--target", "transformers-js", "-o", "out"),
        0,
        _int4_external,
        creates=("out",),
        check=_deployed_files_load,
        timeout=240,
    ),
    Case(
        "parity-of-a-deployed-folder",  # its data file hard-linked into triton/ and onnx/: once exit 70
        "traceback",
        # random weights in a local folder: the quality gates are loosened, the file check (which loads the data) not
        ("parity", "d", "--cases", "1", "--gate", "kl_mean=10", "--gate", "top1=0.01", "--gate", "top5=0.01"),
        0,
        _deployed_with_links,
        timeout=240,
    ),
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
    Case("markup-in-a-folder-name", "message", ("inspect", "[red]nope[/]"), B, match=r"'\[red\]nope\[/\]'"),
    Case("export-sigterm", "data-loss", (), 0, run=terminated_export, creates=("out",), timeout=200),
]


def _genai_worker_run(python: str, timeout: str | None = None) -> Callable[[Ctx, Callable], Outcome]:
    """generate on the genai runtime with its worker's Python set to ``python`` (the script 'hang.sh' in the case
    folder: one that never answers), and its answer time limit to ``timeout`` seconds."""

    def run(c: Ctx, cli) -> Outcome:
        script = c.dir / "hang.sh"
        script.write_text("#!/bin/sh\nsleep 600\n")
        script.chmod(0o755)
        changes = {"GPT2ONNX_GENAI_PYTHON": str(script) if python == "hang.sh" else python}
        if timeout is not None:
            changes["GPT2ONNX_GENAI_TIMEOUT"] = timeout
        argv = ["generate", str(c.exp), "--ids", "1,2", "--max-new-tokens", "2", "--runtime", "genai"]
        return cli(argv, c, env_changes=changes)

    return run


CASES += [
    Case(
        "compare-unknown-engine",  # refused before the engines are probed or anything is built
        "options",
        ("compare", "{src}", "--only", "llama.cpp:Q9_9", "--work", "w"),
        B,
        match="llama.cpp has no format 'Q9_9'",
    ),
    Case(
        "genai-python-not-python",  # once exit 70: JSONDecodeError on echo's answer
        "traceback",
        (),
        EXIT_RUNTIME,
        run=_genai_worker_run("echo"),
        creates=("hang.sh",),
        match="GPT2ONNX_GENAI_PYTHON must name a Python that has onnxruntime_genai",
    ),
    Case(
        "genai-worker-never-answers",  # once a hang with no time limit
        "hang",
        (),
        EXIT_RUNTIME,
        run=_genai_worker_run("hang.sh", timeout="3"),
        creates=("hang.sh",),
        match="gave no answer within 3 s",
        timeout=60,
    ),
]


def _two_named_m(c: Ctx) -> None:
    (c.dir / "a").mkdir()
    (c.dir / "b").mkdir()
    shutil.copytree(c.exp, c.dir / "a" / "m", symlinks=True)
    shutil.copytree(c.q4, c.dir / "b" / "m", symlinks=True)


def _both_kept(c: Ctx, out: Outcome) -> None:
    report = json.loads((c.dir / "b.json").read_text())
    assert [run["label"] for run in report["runs"]] == ["a/m", "b/m"], report["runs"]
    assert "a/m:" in out.stdout and "b/m:" in out.stdout, out.stdout


CASES += [
    Case(
        "bench-two-folders-named-alike",  # once one label for both: the ratios kept one of them
        "silent",
        ("bench", "a/m", "b/m", *BENCH_QUICK, "--json", "b.json"),
        0,
        _two_named_m,
        creates=("b.json",),
        check=_both_kept,
    ),
    Case("bench-one-folder-twice", "options", ("bench", "{exp}", "{exp}/", *BENCH_QUICK), B, match="given twice"),
]


def _named_by_its_graph(c: Ctx, out: Outcome) -> None:
    files = sorted(p.name for p in (c.dir / "m" / "onnx").iterdir())
    assert "model.onnx" in files and "model_quantized.onnx" not in files, files  # the manifest's int8 is not obeyed
    assert json.loads((c.dir / "m" / "config.json").read_text())["transformers.js_config"]["dtype"] == "fp32"


CASES += [
    Case(
        "tjs-manifest-says-int8",  # the graph is fp32: its files are named as fp32's, whatever the manifest says
        "silent",
        ("deploy", "m", "--target", "transformers-js"),
        0,
        export_copy(manifest_edit(precision="int8")),
        creates=("m",),
        check=_named_by_its_graph,
    ),
]


# -- round six: check answers what the command does ----------------------------------------------------------------
def _og_deployed(c: Ctx) -> None:
    """'og': the shared export deployed for ort-generate (its ops' attributes: greedy's, sampling's defaults)."""
    from typer.testing import CliRunner

    from gpt2onnx.cli import app

    result = CliRunner().invoke(app, ["deploy", str(c.exp), "--target", "ort-generate", "-o", str(c.dir / "og")])
    assert result.exit_code == 0, result.output


def _other_vocabulary_draft(c: Ctx) -> None:
    """'d': an export of a checkpoint with a vocabulary of 997 tokens (the shared export's has 1000)."""
    from conftest import make_config, write_hf_folder

    from gpt2onnx.exporters.export import ExportOptions, export

    source = write_hf_folder(c.dir / "ck", make_config("h3-v997"))
    export(str(source), c.dir / "d", options=ExportOptions(validate=False))


def _verdict(words: str) -> Callable[[Ctx, Outcome], None]:
    """check's --json report 'r.json' written, with the verdict: not supported, its first conflict matching."""

    def check(c: Ctx, out: Outcome) -> None:
        report = json.loads((c.dir / "r.json").read_text())
        assert report["supported"] is False and re.search(words, report["conflicts"][0]), report

    return check


OG_CHECK = ("check", "og", "--runtime", "ort-generate", "--json", "r.json")
TRAINED = str(Path(__file__).resolve().parent / "fixtures" / "trained-tiny")  # int4's quality gates need its weights
MIXED_STATIC = ("--quantize", "int4", "--mixed-int8", "25", "--fusion", "onnx-static-kv")
CASES += [
    *(
        Case(
            f"check-{algorithm}-prompt-kernel-verdict",  # once exit 2 without the report
            "message",
            ("check", "--quantize", "int4", "--algorithm", algorithm, "--prompt-kernel", "int8", "--json", "r.json"),
            F,
            match=f"not supported: prompt kernel int8 .* algorithm {algorithm}",
            creates=("r.json",),
            check=_verdict(f"algorithm {algorithm}"),
        )
        for algorithm in ("hqq", "gptq", "k-quant")
    ),
    Case(
        "check-draft-other-vocabulary-verdict",  # once exit 2 without the report
        "message",
        ("check", "{exp}", "--draft", "d", "--json", "r.json"),
        F,
        _other_vocabulary_draft,
        match="the draft .* has a vocabulary of 997 tokens, but the model .* has one of 1000",
        creates=("r.json",),
        check=_verdict("vocabulary of 997"),
    ),
    Case(
        "check-ort-generate-beams",  # once "supported", and generate refused it
        "message",
        (*OG_CHECK, "--num-beams", "2"),
        F,
        _og_deployed,
        match="length_penalty to 1.0: pass --length-penalty 0",
        creates=("r.json",),
        check=_verdict("length_penalty"),
    ),
    Case(
        "generate-ort-generate-beams-as-check-says",
        "message",
        ("generate", "og", "--runtime", "ort-generate", "--num-beams", "2", "--ids", "1,2", "--max-new-tokens", "1"),
        B,
        _og_deployed,
        match="length_penalty to 1.0: pass --length-penalty 0",
    ),
    Case(
        "check-ort-generate-no-repeat-ngram",
        "message",
        (*OG_CHECK, "--no-repeat-ngram-size", "2"),
        F,
        _og_deployed,
        match="no_repeat_ngram_size fixed at 0 .* sets no_repeat_ngram_size to 2: set no_repeat_ngram_size in",
        creates=("r.json",),
        check=_verdict("no_repeat_ngram_size"),
    ),
    Case(
        "check-ort-generate-temperature",
        "message",
        (*OG_CHECK, "--sample", "--temperature", "0.7"),
        F,
        _og_deployed,
        match="temperature fixed at 1.0 .* sets temperature to 0.7",
        creates=("r.json",),
        check=_verdict("temperature"),
    ),
    Case(
        "check-ort-generate-top-p",
        "message",
        (*OG_CHECK, "--sample", "--top-p", "0.9"),
        F,
        _og_deployed,
        match="top_p fixed at 1.0 .* sets top_p to 0.9",
        creates=("r.json",),
        check=_verdict("top_p"),
    ),
    Case(
        "check-ort-generate-not-deployed",  # once "supported", and generate refused the folder
        "message",
        ("check", "{exp}", "--runtime", "ort-generate", "--json", "r.json"),
        F,
        match="has no ort-generate/ files .*: deploy it first",
        creates=("r.json",),
        check=_verdict("ort-generate/ files"),
    ),
    Case(
        "generate-ort-generate-not-deployed-as-check-says",
        "message",
        ("generate", "{exp}", "--runtime", "ort-generate", "--ids", "1,2", "--max-new-tokens", "1"),
        B,
        match="has no ort-generate/ files .*: deploy it first",
    ),
    Case("check-matrix-json", "options", ("check", "--matrix", "--json", "r.json"), B, match="--matrix .* drop --json"),
    Case("check-matrix-folder", "options", ("check", "--matrix", "{exp}"), B, match="--matrix .* drop FOLDER"),
    Case("check-matrix-fusion-bogus", "options", ("check", "--matrix", "--fusion", "bogus"), B, match="drop --fusion"),
    Case(
        "check-matrix-planned",
        "options",
        ("check", "--matrix", "--quantize", "int4", "--num-beams", "2"),
        B,
        match="drop --dtype/--quantize and its options, the decoding options",
    ),
    Case(
        "export-mixed-int8-static-kv",  # once exit 70: TensorScatter's max_sequence_length (0)
        "traceback",
        ("export", "--model", TRAINED, "-o", "m", *MIXED_STATIC),
        0,
        creates=("m",),
        timeout=300,
    ),
]


# -- round six: the output rule ------------------------------------------------------------------------------------
# Every input of every command that writes a file, by its parameter's name: the command line that reads it as {in}
# (otherwise valid), and what it is: a copy of {exp} ("export", at 'in'), of {src} ("checkpoint", at 'in'), or a
# text ('in.txt'). Each of the command's file outputs is pointed at that input's file (a folder's model.onnx or
# config.json), and --json also at a hard link to it and at it through a symbolic link the input is given by: all
# refused before any work, nothing written. tests/test_output_rule.py checks that every input a command reads has
# its row here.
GEN_ONE = ("--ids", "1,2", "--max-new-tokens", "1")
EVAL_T = ("--text", "t.txt", "--greedy-tokens", "0")
PRECISION_T = ("--text", "t.txt", "--only", "fp32", "--work", "w")
SPEC_DRAFT = ("--new-tokens", "2", "--warmup", "0", "--repeat", "1")
OUTPUT_INPUTS: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    "generate": {
        "folder": (("generate", "{in}", *GEN_ONE), "export"),
        "draft": (("generate", "{exp}", *GEN_ONE, "--draft", "{in}"), "export"),
        "json_schema": (("generate", "{exp}", *GEN_ONE, "--json-schema", "{in}"), "text"),
        "grammar": (("generate", "{exp}", *GEN_ONE, "--grammar", "{in}"), "text"),
    },
    "check": {
        "folder": (("check", "{in}"), "export"),
        "model": (("check", "--model", "{in}"), "checkpoint"),
        "draft": (("check", "{exp}", "--draft", "{in}"), "export"),
        "json_schema": (("check", "{exp}", "--json-schema", "{in}"), "text"),
        "grammar": (("check", "{exp}", "--grammar", "{in}"), "text"),
        "calibration": (
            ("check", "--model", "{src}", "--quantize", "int4", "--algorithm", "gptq", "--calibration", "{in}"),
            "text",
        ),
    },
    "eval": {
        "folders": (("eval", "{in}", *EVAL_T), "export"),
        "text": (("eval", "{exp}", "--text", "{in}", "--greedy-tokens", "0"), "text"),
        "reference": (("eval", "{exp}", *EVAL_T, "--reference", "{in}"), "checkpoint"),
    },
    "parity": {
        "folder": (("parity", "{in}", "--cases", "1"), "export"),
        "text": (("parity", "{exp}", "--cases", "1", "--text", "{in}"), "text"),
        "reference": (("parity", "{exp}", "--cases", "1", "--reference", "{in}"), "checkpoint"),
    },
    "bench": {
        "folders": (("bench", "{in}", *BENCH_QUICK), "export"),
        "draft": (("bench", "{exp}", *BENCH_QUICK, "--draft", "{in}"), "export"),
        "reference": (("bench", "{exp}", *BENCH_QUICK, "--baseline", "torch", "--reference", "{in}"), "checkpoint"),
    },
    "bench generate": {
        "folder": (("bench", "generate", "{in}", *GENERATE_QUICK), "export"),
        "reference": (("bench", "generate", "{exp}", *GENERATE_QUICK, "--reference", "{in}"), "checkpoint"),
    },
    "bench speculative": {
        "folder": (("bench", "speculative", "{in}", *SPEC_QUICK), "export"),
        "draft": (("bench", "speculative", "{exp}", "--draft", "{in}", *SPEC_DRAFT), "export"),
    },
    "bench constraint": {
        "folder": (("bench", "constraint", "{in}", *COST_QUICK), "export"),
        "json_schema": (("bench", "constraint", "{exp}", "--json-schema", "{in}", *COST_QUICK[2:]), "text"),
        "grammar": (("bench", "constraint", "{exp}", "--grammar", "{in}", *COST_QUICK[2:]), "text"),
    },
    "bench memory": {"folders": (("bench", "memory", "{in}", *MEMORY_QUICK), "export")},
    "bench web": {"folder": (("bench", "web", "{in}"), "export")},
    "bench served": {
        "folder": (("bench", "served", "{in}"), "export"),
        "gguf": (("bench", "served", "{exp}", "--server", "openai", "--gguf", "{in}"), "text"),
        "llama_server": (
            ("bench", "served", "{exp}", "--server", "openai", "--gguf", "m.gguf", "--llama-server", "{in}"),
            "text",
        ),
    },
    "compare": {
        "model": (("compare", "{in}", "--only", "gpt2onnx:fp32", "--work", "w"), "checkpoint"),
        "text": (("compare", "{src}", "--only", "gpt2onnx:fp32", "--work", "w", "--text", "{in}"), "text"),
    },
    "bench precision": {
        "model": (("bench", "precision", "{in}", *PRECISION_T), "checkpoint"),
        "text": (("bench", "precision", "{src}", "--text", "{in}", "--only", "fp32", "--work", "w"), "text"),
        "calibration": (("bench", "precision", "{src}", *PRECISION_T, "--calibration", "{in}"), "text"),
    },
}
INPUT_FILE = {"export": "in/model.onnx", "checkpoint": "in/config.json", "text": "in.txt"}
INPUT_VARIANTS = ("itself", "hard-link", "through-link")  # the output names: the file, a hard link, the link's file


def _input_place(kind: str, variant: str) -> Callable[[Ctx], None]:
    def setup(c: Ctx) -> None:
        (c.dir / "t.txt").write_text("Hello, world. " * 40)
        if kind == "text":
            (c.dir / "in.txt").write_text("The user's own text, kept as it is.\n" * 20)
        else:
            shutil.copytree(c.exp if kind == "export" else c.src, c.dir / "in", symlinks=True)
        if variant == "hard-link":
            os.link(c.dir / INPUT_FILE[kind], c.dir / "hard.json")
        if variant == "through-link":
            (c.dir / "in-link").symlink_to("in.txt" if kind == "text" else "in")

    return setup


def _input_cases() -> list[Case]:
    cases = []
    for command, option, kind in output_options():
        if kind != "file":
            continue
        for name, (argv, what) in OUTPUT_INPUTS[command].items():
            for variant in INPUT_VARIANTS if option == "--json" else INPUT_VARIANTS[:1]:  # the links: one option
                given = "in-link" if variant == "through-link" else ("in.txt" if what == "text" else "in")
                out = "hard.json" if variant == "hard-link" else INPUT_FILE[what]
                line = tuple(a.replace("{in}", given) for a in argv) + (option, out)
                cases.append(
                    Case(
                        f"over-input-{command.replace(' ', '-')}-{option.strip('-')}-{name}-{variant}",
                        "data-loss",
                        line,
                        B,
                        _input_place(what, variant),
                    )
                )
    return cases


def _scored_text_in_work(how: str) -> Callable[[Ctx], None]:
    def setup(c: Ctx) -> None:
        (c.dir / "w").mkdir()
        text = "A line of the user's own text, longer than the characters scored.\n" * 40
        if how == "hard-link":
            (c.dir / "t.txt").write_text(text)
            os.link(c.dir / "t.txt", c.dir / "w" / "scored.txt")
        elif how == "variant":
            (c.dir / "w" / "fp32").mkdir()
            (c.dir / "w" / "fp32" / "t.txt").write_text(text)
        else:
            (c.dir / "w" / "scored.txt").write_text(text)

    return setup


def _t_txt(c: Ctx) -> None:
    (c.dir / "t.txt").write_text("Hello, world. " * 40)


PRECISION_W = ("bench", "precision", "{src}", "--work", "w", "--only", "fp32", "--max-chars", "200")
CASES += [
    *_input_cases(),
    Case(
        "precision-text-is-scored-txt",  # once cut to 187 bytes, exit 0: the grid writes scored.txt into --work
        "data-loss",
        (*PRECISION_W, "--text", "w/scored.txt"),
        B,
        _scored_text_in_work("itself"),
        match="writes 'w/scored.txt'",
    ),
    Case(
        "precision-text-hard-link-of-scored-txt",
        "data-loss",
        (*PRECISION_W, "--text", "t.txt"),
        B,
        _scored_text_in_work("hard-link"),
        match="writes 'w/scored.txt'",
    ),
    Case(
        "precision-text-in-variant-folder",  # the fp32 folder is built there with --force: the text would go
        "data-loss",
        (*PRECISION_W, "--text", "w/fp32/t.txt"),
        B,
        _scored_text_in_work("variant"),
        match="writes 'w/fp32'",
    ),
    Case(
        "precision-threads-0-writes-nothing",  # once W/fp32 exported first, then the refusal
        "options",
        ("bench", "precision", "{src}", "--text", "t.txt", "--work", "w", "--only", "fp32", "--threads", "0"),
        B,
        _t_txt,
        match="thread",
    ),
    Case(
        "precision-json-beside-the-text",  # once refused as 'inside the model folder .': the text's folder
        "message",
        ("bench", "precision", "tiny", "--random-init", "--text", "t.txt", "--json", "r.json", "--threads", "0"),
        B,
        _t_txt,
        match="thread",
    ),
    Case(
        "precision-repeat-0-writes-nothing",
        "options",
        ("bench", "precision", "{src}", "--text", "t.txt", "--work", "w", "--only", "fp32", "--repeat", "0"),
        B,
        _t_txt,
        match="--repeat",
    ),
]


# -- round six: compare and the grid -------------------------------------------------------------------------------
COMPARE_W = ("compare", "{src}", "--only", "gpt2onnx:fp32", "--work", "w")
COMPARE_QUICK = ("--prompt-len", "4", "--new-tokens", "2", "--batch", "1", "--warmup", "0", "--repeat", "1")


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


def _compare_after_config_change(c: Ctx, cli) -> Outcome:
    """compare builds into 'w' from 'ck'; 'ck/config.json' changes (its weights do not): the next compare refuses
    'w' (once: reused, the old build taken as this config's), and with --rebuild builds again and claims it."""
    shutil.copytree(c.src, c.dir / "ck")
    argv = ["compare", "ck", "--only", "gpt2onnx:fp32", "--work", "w", "--no-quality", *COMPARE_QUICK]
    first = cli(argv, c)
    assert first.code == 0, first.stderr[-800:]
    config = json.loads((c.dir / "ck" / "config.json").read_text())
    config["bos_token_id"] = 3  # the build's config: the exported folder's config.json and generation settings
    (c.dir / "ck" / "config.json").write_text(json.dumps(config))
    refused = cli(argv, c)
    assert refused.code == 2, (refused.code, refused.stderr[-800:])
    assert "its config, generation or tokenizer files" in refused.stderr and "--rebuild" in refused.stderr
    rebuilt = cli([*argv, "--rebuild"], c)
    assert rebuilt.code == 0, rebuilt.stderr[-800:]
    assert json.loads((c.dir / "w" / "gpt2onnx-fp32" / "config.json").read_text())["bos_token_id"] == 3
    return refused


CASES += [
    Case(
        "compare-stride-0",  # once accepted (eval refuses it)
        "options",
        (*COMPARE_W, *COMPARE_QUICK, "--stride", "0"),
        B,
        match=r"stride \(--stride\) must be an integer of at least 1",
    ),
    Case(
        "compare-stride-past-the-context",  # once refused by the scoring, after every build
        "options",
        (*COMPARE_W, *COMPARE_QUICK, "--context", "64", "--stride", "100"),
        B,
        match=r"stride \(--stride\) must be 1 to the context \(64\)",
    ),
    Case(
        "compare-warmup-1e8",  # once accepted (bench caps it)
        "options",
        (*COMPARE_W, *COMPARE_QUICK, "--warmup", "100000000"),
        B,
        match=r"--warmup must be an integer from 0 to 1,000",
    ),
    Case(
        "compare-repeat-1e8",
        "options",
        (*COMPARE_W, *COMPARE_QUICK, "--repeat", "100000000"),
        B,
        match=r"--repeat must be an integer from 1 to 10,000",
    ),
    Case(
        "compare-prompt-past-the-context",  # once exit 3 after building
        "options",
        (*COMPARE_W, "--prompt-len", "120", "--new-tokens", "16"),
        B,
        match="is 136, past the model's context of 128",
    ),
    Case(
        "compare-huge-batch",  # once exit 3 after building
        "options",
        (*COMPARE_W, "--prompt-len", "16", "--new-tokens", "16", "--batch", "100000"),
        B,
        match="more than 1,048,576 tokens",
    ),
    Case(
        "compare-record-fifo",  # once a hang
        "hang",
        (*COMPARE_W, *COMPARE_QUICK),
        B,
        _work_record("compare-source.json", "fifo"),
        match=r"compare-source\.json that is not a regular file \(a FIFO\).*--rebuild",
        process=True,
        timeout=90,
    ),
    Case(
        "compare-record-dev-zero",  # once grew past 2 GB
        "hang",
        (*COMPARE_W, *COMPARE_QUICK),
        B,
        _work_record("compare-source.json", "dev-zero"),
        match=r"not a regular file \(a symbolic link\)",
        process=True,
        timeout=90,
    ),
    Case(
        "compare-record-folder",  # once exit 70
        "traceback",
        (*COMPARE_W, *COMPARE_QUICK),
        B,
        _work_record("compare-source.json", "folder"),
        match=r"not a regular file \(a folder\)",
    ),
    Case(
        "compare-build-without-record",  # once taken as this checkpoint's build (KL 4.36 reported as ours)
        "silent",
        (*COMPARE_W, *COMPARE_QUICK),
        B,
        _work_record("compare-source.json", "gpt2onnx-fp32"),
        match="holds 'gpt2onnx-fp32' but no compare-source.json",
    ),
    Case(
        "compare-config-changed",  # once the build of the old config reused
        "silent",
        (),
        B,
        run=_compare_after_config_change,
        creates=("ck", "w"),
        timeout=400,
    ),
    Case(
        "precision-record-fifo",  # once a hang
        "hang",
        ("bench", "precision", "{src}", "--text", "t.txt", "--work", "w", "--only", "fp32"),
        B,
        _work_record("grid-source.json", "fifo"),
        match=r"grid-source\.json that is not a regular file \(a FIFO\)",
        process=True,
        timeout=90,
    ),
    Case(
        "precision-build-without-record",
        "silent",
        ("bench", "precision", "{src}", "--text", "t.txt", "--work", "w", "--only", "fp32"),
        B,
        _work_record("grid-source.json", "fp32"),
        match="holds 'fp32' but no grid-source.json",
    ),
]


# -- round six: bench's own options ---------------------------------------------------------------------------------
def _same_export_twice_named_m(c: Ctx) -> None:
    c.copy("exp", "a/m")
    c.copy("exp", "b/m")


def _both_labels(c: Ctx, out: Outcome) -> None:
    table = (c.dir / "mem.md").read_text()
    assert "| a/m |" in table and "| b/m |" in table, table  # once both 'm'


CASES += [
    Case(
        "memory-folder-twice",  # once measured twice under one label
        "message",
        ("bench", "memory", "{exp}", "{exp}", *MEMORY_QUICK),
        B,
        match="given twice",
    ),
    Case(
        "memory-two-folders-one-name",
        "message",
        ("bench", "memory", "a/m", "b/m", *MEMORY_QUICK, "--md", "mem.md"),
        0,
        _same_export_twice_named_m,
        creates=("a", "b", "mem.md"),
        check=_both_labels,
    ),
]

CASES += [
    Case(
        "speculative-prompt-past-context",  # once IndexError (exit 70): transformers' prompt lookup ran past it
        "traceback",
        (
            "bench",
            "speculative",
            "{exp}",
            *SPEC_QUICK,
            "--prompt-lookup",
            "4",
            "--new-tokens",
            "3",
            "--prompt-tokens",
            "500",
        ),
        0,
    ),
    Case(
        "speculative-no-room-for-proposals",
        "traceback",
        ("bench", "speculative", "{exp}", "--prompt-lookup", "4", "--new-tokens", "126", "--warmup", "0"),
        B,
        match="126 new tokens and 4 proposed leave no room",
    ),
]

CASES += [
    Case(
        f"{command.replace(' ', '-')}-{flag.strip('-')}-1e8",  # once accepted (hours of runs, or a hang)
        "message",
        (*argv, flag, "100000000"),
        B,
        match=rf"{flag} must be an integer from",
    )
    for command, argv in (
        ("bench generate", ("bench", "generate", "{exp}", *BENCH_QUICK)),
        ("bench speculative", ("bench", "speculative", "{exp}", *SPEC_QUICK)),
    )
    for flag in ("--warmup", "--repeat")
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


# -- constraints (issue 57): refused in one line before any decoding -------------------------------------------
def spec_file(name: str, text: str) -> Callable[[Ctx], None]:
    """A schema or grammar file in the case folder."""

    def setup(c: Ctx) -> None:
        (c.dir / name).write_text(text)

    return setup


CONSTRAIN = ("generate", "{exp}", "--ids", "1,2", "--max-new-tokens", "2")
CASES += [
    Case(
        "constraint-schema-invalid",
        "message",
        (*CONSTRAIN, "--json-schema", "s.json"),
        B,
        spec_file("s.json", '{"type": 5}'),
        match="not a valid JSON schema",
    ),
    Case(
        "constraint-schema-not-json",
        "message",
        (*CONSTRAIN, "--json-schema", "s.json"),
        B,
        spec_file("s.json", '{"type": '),
        match="is not JSON",
    ),
    Case("constraint-schema-missing", "message", (*CONSTRAIN, "--json-schema", "nope.json"), B, match="no such file"),
    Case(
        "constraint-schema-depth-bomb",
        "message",
        (*CONSTRAIN, "--json-schema", "s.json"),
        B,
        spec_file("s.json", '{"type": "array", "items": ' * 20_000 + "{}" + "}" * 20_000),
        match="nested too deeply",
    ),
    Case(
        "constraint-schema-unsupported",
        "message",
        (*CONSTRAIN, "--json-schema", "s.json"),
        B,
        spec_file("s.json", '{"not": {"type": "string"}}'),
        match="refused by llguidance.*not",
    ),
    Case(
        "constraint-regex-unsatisfiable",
        "message",
        (*CONSTRAIN, "--regex", r"a[^\s\S]b"),
        B,
        match="can match nothing",
    ),
    Case("constraint-regex-invalid", "message", (*CONSTRAIN, "--regex", "(a"), B, match="unclosed group"),
    Case(
        "constraint-grammar-10mb",
        "message",
        (*CONSTRAIN, "--grammar", "g.lark"),
        B,
        spec_file("g.lark", "start: " + " | ".join(f'"w{i}"' for i in range(1_000_000))),
        match="more than 1,048,576",
    ),
    Case(
        "constraint-grammar-depth-bomb",
        "message",
        (*CONSTRAIN, "--grammar", "g.lark"),
        B,
        spec_file("g.lark", "start: " + "(" * 50_000 + '"a"' + ")" * 50_000),
        match="too deeply nested",
    ),
    Case("constraint-two-kinds", "options", (*CONSTRAIN, "--regex", "a", "--choice", "a,b"), B, match="give one"),
    Case(
        "bench-constraint-schema-missing",
        "message",
        ("bench", "constraint", "{exp}", "--json-schema", "nope.json", *COST_QUICK[2:]),
        B,
        match="--json-schema 'nope.json': no such file",
    ),
    Case(
        "bench-constraint-two-kinds",
        "options",
        ("bench", "constraint", "{exp}", "--regex", "a", "--choice", "a,b", *COST_QUICK[2:]),
        B,
        match="give one constraint",
    ),
    Case(
        "bench-constraint-one-token",  # one new token: no decode step between two tokens to time
        "options",
        ("bench", "constraint", "{exp}", *COST_QUICK[:2], "--new-tokens", "1"),
        B,
        match="--new-tokens must be an integer from 2",
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
CASES.extend(
    [
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
)

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
    Case(
        "generate-adapter-not-switchable",
        "message",
        ("generate", "{exp}", "--ids", "1,2", "--adapter", "x"),
        B,
        match="has no adapter 'x'",
    ),
    # parity, eval, bench, check --adapter: one declaration, the same refusal before any work (issue 56)
    Case("parity-adapter-not-switchable", "message", ("parity", "{exp}", "--adapter", "x"), B, match="has no adapter"),
    Case(
        "eval-adapter-not-switchable",
        "message",
        ("eval", "{exp}", "--text", "t.txt", "--adapter", "x"),
        B,
        lambda c: (c.dir / "t.txt").write_text("Hello, world. " * 20),
        match="has no adapter 'x'",
    ),
    Case("bench-adapter-not-switchable", "message", ("bench", "{exp}", "--adapter", "x"), B, match="has no adapter"),
    Case("check-adapter-not-switchable", "message", ("check", "{exp}", "--adapter", "x"), B, match="has no adapter"),
    Case("check-adapter-no-folder", "options", ("check", "-m", "{src}", "--adapter", "x"), B, match="give the folder"),
]
