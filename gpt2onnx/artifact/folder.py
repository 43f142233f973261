"""The exported folder: its files, its manifest (gpt2onnx.json), how it is written and how it is opened.

A folder is written in a staging folder beside the target and moved into place only when complete, under a
lock, so that a failed, interrupted or concurrent export never leaves half a folder or loses an old one.
It is opened with its manifest checked: the sha256 of each model file must match what the manifest records.
Only onnx and json here: a deployment machine without torch can open, inspect and run a folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import platform
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from gpt2onnx.artifact.manifest import MANIFEST_FORMAT_VERSION, MODEL_FILE, FileRecord, Manifest
from gpt2onnx.errors import BadInput, ContractError, IntegrityError, OutputError
from gpt2onnx.files import sha256_file

log = logging.getLogger(__name__)

MANIFEST_NAME = "gpt2onnx.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
)
# Files a Hugging Face folder may hold, besides its weights, that belong next to the exported model.
COMPANION_FILES = (GENERATION_CONFIG_FILE, *TOKENIZER_FILES)
MAX_JSON_BYTES = 16 << 20  # a config, manifest or generation config larger than this is not one
_STAGING = ".tmp-"
_BACKUP = ".old-"


# -- reading --------------------------------------------------------------------------------------------------
def read_json_file(path: Path, what: str) -> dict:
    """A small JSON object from a regular file, or BadInput naming the file."""
    path = Path(path)
    try:
        info = path.stat()
    except OSError as err:
        raise BadInput(f"{what} '{path}' cannot be read ({err.strerror or err})") from None
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_JSON_BYTES:
        raise BadInput(f"{what} '{path}' is not a regular JSON file of at most {MAX_JSON_BYTES >> 20} MB")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise BadInput(
            f"{what} '{path}' is not valid JSON ({str(err).splitlines()[0][:120]}): fix or replace the file"
        ) from None
    if not isinstance(data, dict):
        raise BadInput(f"{what} '{path}' holds a JSON {type(data).__name__}, not an object: fix or replace the file")
    return data


def read_manifest(folder: str | Path) -> Manifest | None:
    """The folder's manifest, or None when it has none (an optimum folder); a damaged one is an error."""
    path = Path(folder) / MANIFEST_NAME
    if not path.exists() and not path.is_symlink():
        return None
    return Manifest.from_dict(read_json_file(path, "manifest"), where=f"manifest '{path}'")


def read_n_positions(folder: str | Path) -> int:
    """The model's context length, from the folder's config.json."""
    config = read_json_file(Path(folder) / CONFIG_FILE, "config")
    value = config.get("n_positions")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadInput(f"'{Path(folder) / CONFIG_FILE}' has no valid n_positions (a positive integer): fix the config")
    return value


def eos_token_id(folder: str | Path) -> int | None:
    """End-of-sequence id from generation_config.json, else config.json."""
    for name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
        if not (Path(folder) / name).is_file():
            continue
        value = read_json_file(Path(folder) / name, name).get("eos_token_id")
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def generation_token_ids(folder: str | Path) -> tuple[tuple[int, ...], int | None]:
    """(end-of-sequence ids, padding id) as transformers' generate() reads them: generation_config.json first,
    else config.json; eos may be one id or a list; no pad id: None (generate then pads with the first eos)."""
    found: dict[str, object] = {}
    for name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
        if (Path(folder) / name).is_file():
            data = read_json_file(Path(folder) / name, name)
            for key in ("eos_token_id", "pad_token_id"):
                if found.get(key) is None and data.get(key) is not None:
                    found[key] = data[key]
    is_id = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    eos = found.get("eos_token_id")
    eos_ids = tuple(v for v in (eos if isinstance(eos, list) else [eos]) if is_id(v))
    pad = found.get("pad_token_id")
    return eos_ids, pad if is_id(pad) else None


def check_integrity(folder: Path, manifest: Manifest) -> None:
    """Each model file must have the size and sha256 the manifest records (about 1 s for the 124M model)."""
    for name, info in manifest.model_files.items():
        path = folder / name
        if not path.is_file():
            raise IntegrityError(f"'{path}' is missing but the manifest lists it: export the folder again")
        if path.stat().st_size != info.bytes or sha256_file(path) != info.sha256:
            raise IntegrityError(
                f"'{path}' differs from what the manifest '{folder / MANIFEST_NAME}' records (size or sha256):"
                " export the folder again, or skip the check (--no-verify-files, verify_files=False) if you changed it"
                " on purpose"
            )


@dataclass
class ModelFolder:
    """An exported decoder folder, opened: where its model is, its manifest (None for optimum's), its context."""

    folder: Path
    model_path: Path
    manifest: Manifest | None
    n_positions: int

    @property
    def dtype(self) -> str:
        return self.manifest.dtype if self.manifest else "float32"

    @property
    def precision(self) -> str:
        """The quantization method if the weights are quantized, else the dtype: the key of the parity gates."""
        return self.manifest.precision if self.manifest else "float32"


def open_folder(folder: str | Path, *, verify_files: bool = True) -> ModelFolder:
    """An exported decoder folder, checked: it holds model.onnx and config.json, it is not a single block, and
    (with ``verify_files``) its model files match the manifest's sha256."""
    folder = Path(folder)
    if not folder.exists():
        raise BadInput(f"model folder '{folder}' does not exist: export one first (gpt2onnx export) or give its path")
    if not folder.is_dir():
        raise BadInput(
            f"'{folder}' is a file, not a folder: give the exported folder that holds model.onnx and config.json"
        )
    model_path = folder / MODEL_FILE
    if not model_path.is_file():
        raise ContractError(f"'{folder}' holds no model.onnx: give a folder written by gpt2onnx export (or optimum)")
    manifest = read_manifest(folder)
    if manifest is not None and manifest.kind == "block":
        raise ContractError(f"'{folder}' holds a single-block export: give a whole decoder folder")
    if manifest is not None and verify_files:
        check_integrity(folder, manifest)
    return ModelFolder(folder, model_path, manifest, read_n_positions(folder))


# -- writing --------------------------------------------------------------------------------------------------
def versions() -> dict[str, str | None]:
    """Versions of what made the folder, read from package metadata (nothing is imported)."""
    from gpt2onnx import __version__

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    onnxruntime = version("onnxruntime-gpu") or version("onnxruntime")
    found = {name: version(name) for name in ("torch", "onnx", "transformers")}
    return {"gpt2onnx": __version__, **found, "onnxruntime": onnxruntime, "python": platform.python_version()}


def write_manifest(folder: Path, manifest: Manifest) -> Manifest:
    """Add the file hashes, versions and date, and write gpt2onnx.json (the last file of a folder)."""
    manifest = dataclasses.replace(
        manifest,
        format_version=MANIFEST_FORMAT_VERSION,
        files={
            p.name: FileRecord(p.stat().st_size, sha256_file(p))
            for p in sorted(folder.iterdir())
            if p.is_file() and p.name != MANIFEST_NAME
        },
        versions=versions(),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest.as_dict(), indent=2) + "\n")
    return manifest


def copy_regular_file(source: Path, target: Path, *, within: Path) -> None:
    """Copy a companion file as a new regular file with ordinary permissions; refuse one that is not a regular
    file or whose real path leaves ``within`` (a symlink to /etc/passwd, say)."""
    real, root = source.resolve(), within.resolve()
    if not real.is_relative_to(root):
        raise BadInput(f"'{source}' points outside '{within}' (to '{real}'): replace the link with the file itself")
    if not real.is_file():
        raise BadInput(f"'{source}' is not a regular file: remove it or replace it with the file itself")
    shutil.copyfile(real, target)  # the new file gets the umask's permissions, not the source's


def check_output(target: Path, *, force: bool, protect: tuple[Path, ...] = ()) -> None:
    """Refuse an output that exists (without ``force``), that is not a folder this tool wrote or an empty one,
    or that is, or contains, a protected path (the source checkpoint) or the working directory."""
    target = Path(target)
    if target.is_symlink():
        raise BadInput(f"output '{target}' is a symbolic link: give the real folder's path")
    if not target.exists():
        return
    if not target.is_dir():
        raise BadInput(f"output '{target}' exists and is not a folder: choose another output folder")
    if not force:
        raise BadInput(
            f"output folder '{target}' already exists: choose another output folder, or replace it (--force,"
            " force=True)"
        )
    real = target.resolve()
    for path, what in [*((p, "the source model") for p in protect), (Path.cwd(), "the working directory")]:
        if Path(path).resolve() == real:
            raise BadInput(
                f"output folder '{target}' is {what} '{path}', which --force would delete: choose another output folder"
            )
        if Path(path).resolve().is_relative_to(real):
            raise BadInput(
                f"output folder '{target}' holds {what} '{path}', which --force would delete: choose another output"
                " folder"
            )
    if any(real.iterdir()) and not (real / MANIFEST_NAME).is_file():
        raise BadInput(
            f"output folder '{target}' is not empty and was not written by gpt2onnx (no {MANIFEST_NAME}):"
            " it is never replaced; choose another output folder"
        )


_LEFTOVER = re.compile(r"^\.(?P<name>.+)(?P<kind>\.tmp-|\.old-)(?P<pid>\d+)-[^/]*$")
_LOCK_SUFFIX = ".lock"


def _remove_stale_staging(parent: Path, keep: Path | None = None) -> None:
    """What runs that were killed (kill -9, power loss) left in ``parent``, for any output name: staging and
    backup folders whose process is gone, and lock files no run holds. ``keep``: this run's own lock file."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for path in entries:
        found = _LEFTOVER.match(path.name)
        if found and path.is_dir() and not path.is_symlink() and not _alive(int(found["pid"])):
            log.info("removing '%s', left by an interrupted run", path)
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.startswith(".") and path.name.endswith(_LOCK_SUFFIX) and path != keep and path.is_file():
            _remove_free_lock(path)


def _remove_free_lock(path: Path) -> None:
    """A lock file no run holds (its run was killed) is removed, holding its lock while doing so."""
    try:
        handle = open(path, "a+")
    except OSError:
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # held: a live run
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _output_lock(target: Path):
    """One writer per output folder: a second export into it fails at once, clearly. Yields the lock file's path;
    the lock file is removed when the run ends (only by the run that holds it)."""
    lock_path = target.parent / f".{target.name}{_LOCK_SUFFIX}"
    try:
        handle = open(lock_path, "a+")
    except OSError as err:
        raise OutputError(
            f"cannot write to output folder '{target}' ({err.strerror or err}); choose a writable one"
        ) from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # A lock file removed (or replaced) since it was opened: the lock counts only if the path still names it.
            if os.stat(lock_path).st_ino != os.fstat(handle.fileno()).st_ino:
                raise OSError(errno.EAGAIN, "lock file replaced")
        except OSError:
            raise OutputError(
                f"output folder '{target}' is being written by another gpt2onnx run: wait for it, or choose another"
                " output folder"
            ) from None
        try:
            yield lock_path
        finally:
            with contextlib.suppress(OSError):
                lock_path.unlink()  # while still holding the lock


@contextlib.contextmanager
def staged_folder(target: Path, *, force: bool, protect: tuple[Path, ...] = ()):
    """Yield a fresh temporary folder; on success it replaces ``target``, on any failure it is removed.

    ``protect``: paths (the source checkpoint) that the output must not be, nor contain."""
    target = Path(target)
    check_output(target, force=force, protect=protect)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(
            f"cannot write to output folder '{target}' ({err.strerror or err}); choose a writable one"
        ) from None
    with _output_lock(target) as lock_path:
        check_output(target, force=force, protect=protect)  # again, now that no other run can write it
        _remove_stale_staging(target.parent, keep=lock_path)
        try:
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}{_STAGING}{os.getpid()}-", dir=target.parent))
        except OSError as err:
            raise OutputError(
                f"cannot write to output folder '{target}' ({err.strerror or err}); choose a writable one"
            ) from None
        try:
            try:
                yield staging
            except OSError as err:
                if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS):
                    raise OutputError(
                        f"cannot write the output folder '{target}' ({err.strerror}); free space or choose another one;"
                        " nothing was written"
                    ) from None
                raise
            _apply_umask(staging)
            if target.exists():
                # Move the old folder aside first, so that a failure here still leaves one complete folder.
                backup = Path(tempfile.mkdtemp(prefix=f".{target.name}{_BACKUP}{os.getpid()}-", dir=target.parent))
                try:
                    os.replace(target, backup / target.name)
                    os.replace(staging, target)
                finally:
                    shutil.rmtree(backup, ignore_errors=True)
            else:
                os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def _apply_umask(folder: Path) -> None:
    """mkdtemp makes the folder private (0700) and some writers make files 0600; give the finished folder
    the permissions a plain mkdir and open would have."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
