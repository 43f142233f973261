"""The bad-input corpus: every case is one row of CASES, run by tests/test_bad_input.py: in process through
Typer's CliRunner, or as a real CLI subprocess where the fault needs one (``process`` or ``run``).

A row says what is set up (files in the case's own folder, which is also the working directory), the command
line, the exit code the CLI must give (EXIT_BAD_INPUT for bad arguments or input files, EXIT_CHECK_FAILED for a
failed validation or parity gate, EXIT_RUNTIME for a provider that cannot run here) and, optionally, a pattern
the one-line error must match. The runner also checks that stderr is that one line, with no traceback, and that
no file was written or lost anywhere it can see.

Placeholders in the command line: {src} a tiny Hugging Face checkpoint with tokenizer files, {exp} its export,
{ext} an export with external data (all three shared, read-only), {dir} the case's folder.

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
        timeout=60,
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
    Case("parity-cases-zero", "options", ("parity", "{exp}", "--cases", "0"), B, match="cases"),
    Case("bench-folder-without-model", "options", ("bench", "{src}"), B, match="model.onnx"),
    # -- deploy ------------------------------------------------------------------------------------------------------
    Case("deploy-missing-folder", "message", ("deploy", "nope", "--target", "genai"), B, match="does not exist"),
    Case(
        "deploy-target-bogus",
        "options",
        ("deploy", "{exp}", "--target", "onnxruntime-web", "-o", "out"),
        B,
        match="unknown deploy target",
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
    # -- the browser: deploy --target web, serve ---------------------------------------------------------------------
    Case(
        "deploy-web-lib-missing",
        "message",
        ("deploy", "{exp}", "--target", "web", "-o", "out", "--web-lib", "{dir}"),
        B,
        match="transformers.js is not installed in",
    ),
    Case("serve-missing-folder", "message", ("serve", "nope"), B, match="is not a folder"),
    Case("serve-not-a-web-folder", "message", ("serve", "{exp}"), B, match="has no index.html"),
    Case(
        "serve-port-bogus",
        "options",
        ("serve", "{dir}", "--port", "70000"),
        B,
        lambda c: (c.dir / "index.html").write_text("<p>hi</p>"),
        match="not a port number",
    ),
]
