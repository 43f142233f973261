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
import secrets
import shutil
import signal
import stat
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from gpt2onnx.artifact.graph import GraphFacts, external_data_files, graph_facts, load_graph
from gpt2onnx.artifact.manifest import MANIFEST_FORMAT_VERSION, MODEL_FILE, FileRecord, Manifest
from gpt2onnx.artifact.paths import check_output_path, file_in_folder, real_location
from gpt2onnx.errors import BadInput, ContractError, Gpt2OnnxError, IntegrityError, OutputError
from gpt2onnx.files import (
    descriptor_path,
    kind_of,
    open_regular,
    read_regular_text,
    sha256_and_stamp,
    sha256_file,
    sha256_of,
    stamp,
)

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
    text = read_regular_text(path, what, limit=MAX_JSON_BYTES)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as err:
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


def check_integrity(
    folder: Path, manifest: Manifest, *, data_files: tuple[str, ...] | None = None, held: dict | None = None
) -> dict[Path, tuple[int, ...]]:
    """Each model file must have the size and sha256 the manifest records (about 1 s for the 124M model), and
    every external data file the graph names (``data_files``, read from the graph when not given) must be one
    of them: the check covers every file onnxruntime will load. Returns each file's stamp as it was hashed
    (:meth:`ModelFolder.check_unchanged` compares them once a runtime has loaded the files). ``held``: each
    file's descriptor that was hashed is kept open there (path → file), for a runtime to load those very bytes
    (:meth:`ModelFolder.place_files`); a file already in it is hashed from that descriptor."""
    folder = Path(folder)
    where = folder / MANIFEST_NAME
    if data_files is None:
        data_files = graph_data_files(folder / MODEL_FILE)
    listed = manifest.model_files
    if MODEL_FILE not in manifest.files:
        raise IntegrityError(
            f"the manifest '{where}' does not list '{MODEL_FILE}', so it cannot be checked: export the folder again,"
            " or skip the check (--no-verify-files) if you changed it on purpose"
        )
    for name in data_files:
        if name not in manifest.files:
            raise IntegrityError(
                f"'{folder / MODEL_FILE}' loads '{name}', which the manifest '{where}' does not list:"
                " export the folder again, or skip the check (--no-verify-files) if you changed it on purpose"
            )
    listed = {**listed, **{name: manifest.files[name] for name in data_files}}
    stamps = {}
    for name, info in listed.items():
        path = file_in_folder(folder, name, what="model file", where=where, must_exist=False)
        if not path.exists():
            raise IntegrityError(f"'{path}' is missing but the manifest lists it: export the folder again")
        path = file_in_folder(folder, name, what="model file", where=where)
        handle = (held or {}).get(path) or open_regular(path, "file")
        try:
            hashed = stamp(os.fstat(handle.fileno()))
            digest = sha256_of(handle)
            stamps[path] = (hashed, digest)
            matches = hashed[2] == info.bytes and digest == info.sha256
        except PermissionError as err:
            raise BadInput(
                f"'{path}' cannot be read ({err.strerror}): give read permission to the folder's files"
            ) from None
        finally:
            if held is None:
                handle.close()
            else:
                held[path] = handle
        if not matches:
            raise IntegrityError(
                f"'{path}' differs from what the manifest '{where}' records (size or sha256):"
                " export the folder again, or skip the check (--no-verify-files, verify_files=False) if you changed it"
                " on purpose"
            )
    return stamps


def _still_named(handle, path: Path) -> bool:
    """Whether the name ``handle`` was opened by is still its name (the kernel's: a name renamed over reads
    '… (deleted)' even once the file is back under a new one); True where the system does not say."""
    try:
        return os.readlink(f"/proc/self/fd/{handle.fileno()}") == os.path.realpath(path)
    except (OSError, ValueError):
        return True


def _copy_descriptor(handle, target: Path) -> None:
    """The bytes of the open file ``handle``, from its start, into a new private file ``target`` (0600)."""
    offset = 0
    with os.fdopen(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "wb") as out:
        while chunk := os.pread(handle.fileno(), 1 << 24, offset):
            out.write(chunk)
            offset += len(chunk)


def graph_data_files(model_path: Path) -> tuple[str, ...]:
    """The external data files ``model_path`` names, each checked (a plain name, a regular file inside its
    folder): the graph is the one place onnxruntime reads these paths from."""
    names = tuple(external_data_files(load_graph(model_path)))
    for name in names:
        file_in_folder(model_path.parent, name, what="external data file", where=model_path)
    return names


@dataclass
class ModelFolder:
    """An exported decoder folder, opened: where its model is, its manifest (None for optimum's), its context,
    and what its graph says (``facts``: read from the graph; they win over the manifest and the configs)."""

    folder: Path
    model_path: Path
    manifest: Manifest | None
    n_positions: int
    facts: GraphFacts | None = None  # read from model_path when not given
    verified: bool = False  # its model files were checked against the manifest (a runtime checks its own too)
    stamps: dict = field(default_factory=dict)  # each checked file: (its stamp as it was hashed, its sha256)
    held: dict = field(default_factory=dict, repr=False)  # each checked file: the descriptor hashed, kept open

    def __post_init__(self) -> None:
        if self.facts is None:
            self.facts = graph_facts(load_graph(self.model_path))

    def place_files(self, into: Path, *, copy: tuple[str, ...] = ()) -> Path:
        """Put the files a runtime loads (model.onnx and the data files its graph names) in the private folder
        ``into``, and return the model's path there: each checked file as a symbolic link to the descriptor that
        was hashed (/proc/PID/fd/N of this process: it opens those bytes whatever the folder's names name by
        then, in this process or a worker of this user; nothing is copied). A file swapped in at the folder's
        path and back while the runtime loads is never what it reads. ``copy``: names copied from their hashed
        descriptor instead (OpenVINO refuses a data file whose link leads outside the model's folder; the copy
        costs that file's size on disk, in ``into``, until it is removed). Files not checked (no manifest,
        --no-verify-files), or where there is no /proc: links to the folder's files, as before."""
        for name in (self.model_path.name, *self.data_files):
            source, target = self.folder / name, Path(into) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            handle = self.held.get(source)
            held = descriptor_path(handle) if handle is not None else None
            if held is None:
                try:
                    os.symlink(source.resolve(), target)
                except OSError:
                    shutil.copyfile(source, target)
            elif name in copy:
                _copy_descriptor(handle, target)
            else:
                os.symlink(held, target)
        return Path(into) / self.model_path.name

    def fill_external(self, tensor) -> None:
        """Move a tensor's external bytes into it, read from the hashed descriptor of its data file; a tensor
        whose file is not held (not checked) is left to be read by path, as before."""
        import onnx

        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            return
        info = {entry.key: entry.value for entry in tensor.external_data}
        handle = self.held.get(self.folder / info.get("location", ""))
        if handle is None:
            return
        offset, length = int(info.get("offset") or 0), int(info.get("length") or 0)
        data = os.pread(handle.fileno(), length, offset) if length else b""
        if len(data) != length or not length:
            raise ContractError(
                f"'{self.model_path}': the weight '{tensor.name}' is not inside '{info.get('location')}' as the graph"
                " says: export the folder again"
            )
        tensor.raw_data = data
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]

    @contextlib.contextmanager
    def loading(self, *, copy: tuple[str, ...] = ()):
        """Yield the path a runtime loads the model from (:meth:`place_files`, in a private temporary folder),
        then check what it loaded (:meth:`check_unchanged`); the folder is removed after. A load that fails while
        the folder's files changed (onnxruntime refuses a data file whose name was renamed over) is refused as
        the change it is. A message naming the temporary folder names the model's folder instead."""
        if not any(descriptor_path(handle) for handle in self.held.values()):  # nothing checked, or no /proc
            yield self.model_path
            self.check_unchanged()
            return
        tmp = Path(tempfile.mkdtemp(prefix="gpt2onnx-load-"))  # 0700: no one else adds or swaps a file in it
        try:
            try:
                yield self.place_files(tmp, copy=copy)
            except Exception:
                self.check_unchanged()  # the folder changed under the load: that is the reason, said as such
                raise
            self.check_unchanged()
        except Gpt2OnnxError as err:
            if err.args and isinstance(err.args[0], str):
                err.args = (err.args[0].replace(str(tmp), str(self.folder)), *err.args[1:])
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def check_unchanged(self) -> None:
        """After a runtime has loaded the files: each checked file is still the one hashed, unwritten, and the
        folder still names it by the name it was opened by; IntegrityError otherwise. Where the descriptor that
        was hashed is held (what :meth:`place_files` loads), its size and modification time are compared, and the
        name it was opened by must still lead to it: a rename over that name unlinks it for good, so a file
        swapped away and back between two hard links (the same inode, bytes and stamp but for its change time)
        is caught even once it is back. A file whose change time alone moved (a hard link made to it, as deploy
        makes, or a chmod) is the same file, unwritten by size and modification time: its bytes settle it,
        hashed again (from the descriptor; from the path where none is held)."""
        for path, (hashed, digest) in self.stamps.items():
            handle = self.held.get(path)
            try:
                now = stamp(os.fstat(handle.fileno()) if handle is not None else os.stat(path))
                named = stamp(os.stat(path))[:2] if handle is not None else now[:2]
            except (OSError, ValueError):  # ValueError: a descriptor closed
                now = named = None
            moved = handle is not None and not _still_named(handle, path)
            if now == hashed and named == hashed[:2] and not moved:
                continue
            if (
                now is None
                or moved
                or now[:4] != hashed[:4]
                or named != hashed[:2]
                or (sha256_of(handle) if handle is not None else sha256_and_stamp(path)[0]) != digest
            ):
                raise IntegrityError(
                    f"'{path}' was replaced or written to after its sha256 was checked, while it was being loaded:"
                    " make sure nothing changes the folder while gpt2onnx reads it, then run the command again"
                )

    def close(self) -> None:
        """Close the descriptors held for loading (a runtime already loaded keeps what it loaded)."""
        for handle in self.held.values():
            handle.close()
        self.held.clear()

    @property
    def data_files(self) -> tuple[str, ...]:
        """The external data files the graph names, checked to lie inside the folder."""
        return self.facts.data_files

    @property
    def dtype(self) -> str:
        return self.facts.dtype


def _recorded_ops(manifest: Manifest) -> list[str] | None:
    """The quantized op kinds the manifest records (none without a quantization record; no claim where an old
    record has no op counts)."""
    if manifest.quantization is None:
        return []
    return sorted(manifest.quantization.ops) or None


def _claims(manifest: Manifest, facts: GraphFacts) -> list[str]:
    """What the manifest says of the graph that the graph contradicts (each: 'what: manifest vs graph')."""
    claims = {
        "dtype": (manifest.dtype, facts.dtype),
        "quantized ops": (_recorded_ops(manifest), sorted(facts.quantized_ops)),
        "kv_cache": (manifest.cache_layout, facts.layout.name),
        "kv_cache_quantization.dtype": (
            manifest.kv_cache_quantization.dtype if manifest.kv_cache_quantization else None,
            facts.kv_dtype,
        ),
        "options.logits": (manifest.options.get("logits"), "last" if facts.logits_last else "all"),
    }
    return [f"{key} {said}, the graph's {found}" for key, (said, found) in claims.items() if said not in (None, found)]


def open_folder(folder: str | Path, *, verify_files: bool = True) -> ModelFolder:
    """An exported decoder folder, checked: it holds model.onnx and config.json, it is not a single block, the
    external data its graph names lies inside it, the config's context fits the graph's position table, and
    (with ``verify_files``) the files the graph loads match the manifest's size and sha256. What a command
    acts on (dtype, quantization, logits, K/V cache, data files) comes from the graph: a manifest that says
    otherwise is named in a warning and not followed."""
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
    verify = manifest is not None and verify_files
    held: dict = {}
    facts = _facts_of(model_path, held if verify else None)
    for name in facts.data_files:
        file_in_folder(folder, name, what="external data file", where=model_path)
    n_positions = read_n_positions(folder)
    rows = facts.position_rows
    if rows is not None and n_positions > rows:  # config.json edited: trust the graph, not the config
        raise ContractError(
            f"'{folder / CONFIG_FILE}' gives n_positions {n_positions}, but the graph's position table has"
            f" {rows} rows: set n_positions to {rows} or less in config.json, or export the folder again"
        )
    stamps = {}
    if verify:
        stamps = check_integrity(folder, manifest, data_files=facts.data_files, held=held)
    if manifest is not None and _claims(manifest, facts):
        log.warning("'%s' says %s: the graph's are used", folder / MANIFEST_NAME, "; ".join(_claims(manifest, facts)))
    return ModelFolder(folder, model_path, manifest, n_positions, facts, verified=verify, stamps=stamps, held=held)


def _facts_of(model_path: Path, held: dict | None) -> GraphFacts:
    """The graph's facts. ``held`` (a folder to be checked): read from a descriptor kept open there, the one
    :func:`check_integrity` then hashes and the runtime loads, so that the facts, the check and the load are of
    one file; messages name the model's path."""
    handle = None
    if held is not None:
        with contextlib.suppress(BadInput):  # unreadable or not a file: load_graph says so, by its path
            handle = open_regular(model_path, "model file")
    opened = descriptor_path(handle) if handle is not None else None
    if opened is None:
        if handle is not None:
            handle.close()
        return graph_facts(load_graph(model_path))
    held[model_path] = handle
    try:
        return graph_facts(load_graph(Path(opened)))
    except Gpt2OnnxError as err:
        if err.args and isinstance(err.args[0], str):
            err.args = (err.args[0].replace(opened, str(model_path)), *err.args[1:])
        raise


def check_deployed_files(folder: Path, manifest: Manifest, names: list[str]) -> None:
    """Each of ``names`` (paths relative to ``folder``, in a deployment target's sub-folder) is a regular file
    inside the folder, reached through no link, with the size and sha256 the manifest records: what a runtime
    loads from a target's files is what deploy wrote."""
    folder = Path(folder)
    where = folder / MANIFEST_NAME
    root = folder.resolve()
    for name in names:
        path = folder / name
        parts = Path(name).parts
        if ".." in parts or Path(name).is_absolute():
            raise IntegrityError(f"'{name}' in '{where}' is not a path inside the folder: deploy the folder again")
        for depth in range(1, len(parts) + 1):  # every folder on the way, and the file: none of them a link
            entry, last = folder.joinpath(*parts[:depth]), depth == len(parts)
            try:
                mode = os.lstat(entry).st_mode
            except OSError as err:
                raise IntegrityError(
                    f"'{entry}' cannot be read ({err.strerror or err}): deploy the folder again"
                ) from None
            if not (stat.S_ISREG(mode) if last else stat.S_ISDIR(mode)):
                raise IntegrityError(
                    f"'{entry}' is {kind_of(mode)}, not the {'file' if last else 'folder'} deploy wrote: deploy the"
                    " folder again"
                )
        if not path.resolve().is_relative_to(root):
            raise IntegrityError(f"'{path}' leads outside '{folder}': deploy the folder again")
        info = manifest.files.get(name)
        if info is None:
            raise IntegrityError(
                f"'{path}' is not listed in the manifest '{where}', so it cannot be checked: deploy the folder again,"
                " or skip the check (--no-verify-files) if you changed it on purpose"
            )
        if path.stat().st_size != info.bytes or sha256_file(path) != info.sha256:
            raise IntegrityError(
                f"'{path}' differs from what the manifest '{where}' records (size or sha256): deploy the folder"
                " again, or skip the check (--no-verify-files, verify_files=False) if you changed it on purpose"
            )


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


def write_manifest(folder: Path, manifest: Manifest, *, exclude: tuple[str, ...] = ()) -> Manifest:
    """Add the file hashes, versions and date, and write gpt2onnx.json (the last file of a folder).
    ``exclude``: files in the folder that are not ours (what deploy in place keeps): not listed, so never
    replaced by a later --force."""
    hashed: dict[tuple[int, int], FileRecord] = {}  # by inode: a target's hard link of model.onnx is hashed once

    def record(path: Path) -> FileRecord:
        info = path.stat()
        key = (info.st_dev, info.st_ino)
        if key not in hashed:
            hashed[key] = FileRecord(info.st_size, sha256_file(path))
        return hashed[key]

    files = {
        p.name: record(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and not p.is_symlink() and p.name != MANIFEST_NAME and p.name not in exclude
    }
    # the files deployment targets wrote: a runtime that loads them checks them as it checks the model's
    deployed = [f for names in (manifest.deploy.targets.values() if manifest.deploy else ()) for f in names]
    for name in sorted(set(deployed)):
        path = folder / name
        if "/" in name and path.is_file() and not path.is_symlink():
            files[name] = record(path)
    manifest = dataclasses.replace(
        manifest,
        format_version=MANIFEST_FORMAT_VERSION,
        files=files,
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


def foreign_entries(folder: Path, manifest: Manifest) -> list[str]:
    """What in ``folder`` gpt2onnx did not write, by its manifest (paths relative to the folder, sorted): every
    entry but the regular files the manifest lists (its files, itself, and each deployment target's files), and
    the folders that lead to them. A file you put into a target's folder (onnx/mine.onnx) is yours; so is any
    link, FIFO or device, and a folder holding nothing of ours is yours whole."""
    listed = {MANIFEST_NAME, *(str(n) for n in manifest.files)}
    if manifest.deploy is not None:
        for files in manifest.deploy.targets.values():
            listed |= {str(f) for f in files}
    parents = {"/".join(f.split("/")[:i]) for f in listed for i in range(1, f.count("/") + 1)}
    foreign: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        rel = Path(dirpath).relative_to(folder)
        for name in sorted(filenames + dirnames):
            path = (rel / name).as_posix()
            mode = os.lstat(Path(dirpath) / name).st_mode
            if stat.S_ISREG(mode) and path in listed:
                continue
            if stat.S_ISDIR(mode) and path in parents:
                continue
            foreign.append(path)
        dirnames[:] = [d for d in dirnames if (rel / d).as_posix() in parents]  # links are never descended
    return sorted(foreign)


def check_output(target: Path, *, force: bool, protect: tuple[Path, ...] = ()) -> None:
    """Refuse an output that exists (without ``force``), that is not a folder this tool wrote (a manifest that
    parses and validates, listing everything in it) or an empty one, or that is, or contains, a protected
    path (the source checkpoint) or the working directory."""
    target = Path(target)
    check_output_path(target, option="output (-o)", kind="folder", folders=protect, reading="the source model")
    if not target.exists():
        return
    if not force:
        raise BadInput(
            f"output folder '{target}' already exists: choose another output folder, or replace it (--force,"
            " force=True)"
        )
    real = target.resolve()
    try:
        entries = sorted(p.name for p in real.iterdir())
    except OSError as err:
        raise OutputError(
            f"output folder '{target}' cannot be read ({err.strerror or err}): choose another one"
        ) from None
    if not entries:
        return
    never = "it is never replaced; choose another output folder"
    if not (real / MANIFEST_NAME).is_file() or (real / MANIFEST_NAME).is_symlink():
        raise BadInput(
            f"output folder '{target}' is not empty and was not written by gpt2onnx (no {MANIFEST_NAME}): {never}"
        )
    try:
        manifest = read_manifest(real)
    except BadInput:
        raise BadInput(
            f"output folder '{target}' has a {MANIFEST_NAME} that is not a valid gpt2onnx manifest: {never}"
        ) from None
    foreign = foreign_entries(real, manifest)
    if foreign:
        raise BadInput(
            f"output folder '{target}' holds '{foreign[0]}', which its {MANIFEST_NAME} does not list (not written by"
            f" gpt2onnx): move it out first, or {never.split('; ')[1]}"
        )


# -- one writer per output, and what a killed run left -------------------------------------------------------
# The lock file .NAME.lock beside an output is this tool's record: its first line is _LOCK_HEADER, then one line
# per staging folder or old folder the run made ("staging .NAME.tmp-…"; "aside .NAME.old-…": the old folder itself,
# renamed beside it; "backup .NAME.old-…": a folder holding the old one, as earlier versions wrote it). Only folders
# a record names, and only records no run holds, are ever cleaned up; anything else in the parent is left alone.
_LOCK_SUFFIX = ".lock"
_LOCK_HEADER = "gpt2onnx output lock 1"


def _open_lock(lock_path: Path):
    """The lock file, opened without following a link, as a regular file; None if it cannot be opened."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError:
        return None
    handle = os.fdopen(fd, "r+")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        handle.close()
        return None
    return handle


def _record(handle) -> list[tuple[str, str]] | None:
    """The (kind, folder name) lines of a lock file, or None when it is not one of ours."""
    handle.seek(0)
    lines = handle.read(1 << 16).splitlines()
    if not lines or lines[0] != _LOCK_HEADER:
        return None
    entries = []
    for line in lines[1:]:
        kind, _, name = line.partition(" ")
        if kind in ("staging", "aside", "backup") and name and "/" not in name and name not in (".", ".."):
            entries.append((kind, name))
    return entries


def _recover(parent: Path, name: str, entries: list[tuple[str, str]]) -> None:
    """Undo what a killed run into ``parent/name`` left: its staging folders are removed; the old folder it had
    moved aside is moved back when the output is missing (killed between the two renames of a replace), else
    removed. Only folders named in its record, with this output's prefixes, are touched."""
    target = parent / name
    for kind, entry in entries:
        path = parent / entry
        prefix = f".{name}{_STAGING if kind == 'staging' else _BACKUP}"
        if not entry.startswith(prefix) or path.is_symlink() or not path.is_dir():
            continue
        old = {"aside": path, "backup": path / name}.get(kind)
        if old is not None and old.is_dir() and not target.exists() and not target.is_symlink():
            log.info("restoring '%s' from '%s', left by an interrupted replace", target, path)
            os.replace(old, target)
            if kind == "aside":
                continue
        log.info("removing '%s', left by an interrupted run", path)
        remove_tree(path)


def _remove_stale_staging(parent: Path, keep: Path | None = None) -> None:
    """What runs that were killed (kill -9, power loss) left in ``parent``, for any output name: the staging
    and backup folders their lock files record, once no run holds that lock. ``keep``: this run's lock."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for path in entries:
        if path.name.startswith(".") and path.name.endswith(_LOCK_SUFFIX) and path != keep and not path.is_symlink():
            name = path.name[1 : -len(_LOCK_SUFFIX)]
            if name and path.is_file():
                _remove_free_lock(path, parent, name)


def _remove_free_lock(path: Path, parent: Path, name: str) -> None:
    """A lock file of ours that no run holds (its run was killed): its record is recovered, then it is removed,
    holding its lock while doing so."""
    handle = _open_lock(path)
    if handle is None:
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # held: a live run
        entries = _record(handle)
        if entries is None:
            return  # not ours (someone else's .NAME.lock): left alone
        with contextlib.suppress(OSError):
            _recover(parent, name, entries)
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                path.unlink()


@contextlib.contextmanager
def _output_lock(target: Path):
    """One writer per output folder: a second export into it fails at once, clearly. Yields the lock file's
    handle (append a line with :func:`_note`); it is removed when the run ends, by the run that holds it."""
    lock_path = target.parent / f".{target.name}{_LOCK_SUFFIX}"
    cannot = f"cannot write to output folder '{target}'"
    if lock_path.is_symlink():
        raise OutputError(f"{cannot}: its lock file '{lock_path}' is a symbolic link; remove it")
    handle = _open_lock(lock_path)
    if handle is None:
        raise OutputError(
            f"{cannot}: its lock file '{lock_path}' cannot be created or is not a regular file;"
            " choose a writable folder"
        )
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
        previous = _record(handle)
        handle.seek(0, os.SEEK_END)
        if previous is None and handle.tell() > 0:
            raise OutputError(f"{cannot}: '{lock_path}' exists and is not a gpt2onnx lock file; move it out of the way")
        if previous:
            _recover(target.parent, target.name, previous)  # a killed run into this same output
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(f"{_LOCK_HEADER}\n")
            handle.flush()
        except OSError as err:  # a full disk: the lock is ours, so it goes (nothing else was written)
            with contextlib.suppress(OSError):
                lock_path.unlink()
            with contextlib.suppress(OSError):  # the unwritten line would fail the close again, hiding this error
                handle.close()
            raise OutputError(
                f"{cannot}: its lock file '{lock_path}' cannot be written ({err.strerror or err}); free space or"
                " choose a writable one"
            ) from None
        try:
            yield handle
        finally:
            with contextlib.suppress(OSError):
                lock_path.unlink()  # while still holding the lock


def remove_tree(path: Path) -> bool:
    """Remove a folder this tool wrote or moved aside, whole, also where it holds read-only sub-folders of the user
    running it (an old folder made read-only with chmod -R a-w): each folder of theirs is made writable before it
    is listed and emptied. Returns whether it is gone."""

    def open_up(folder: str) -> None:
        with contextlib.suppress(OSError):
            info = os.lstat(folder)
            if (
                stat.S_ISDIR(info.st_mode)
                and info.st_uid == os.geteuid()
                and info.st_mode & stat.S_IRWXU != stat.S_IRWXU
            ):
                os.chmod(folder, stat.S_IMODE(info.st_mode) | stat.S_IRWXU)

    open_up(str(path))
    for dirpath, dirnames, _ in os.walk(path):  # top-down: each sub-folder opened up before the walk lists it
        for name in dirnames:
            open_up(os.path.join(dirpath, name))
    shutil.rmtree(path, ignore_errors=True)
    return not path.exists() and not path.is_symlink()


def removable(folder: Path) -> Path | None:
    """The first folder in ``folder`` (itself included) whose entries the user running this could not remove: one
    neither writable nor theirs to make writable (another user's read-only or private sub-folder). None: the
    whole folder can be removed once it is replaced."""
    effective = os.access in os.supports_effective_ids

    def stuck(path: str) -> bool:
        try:
            info = os.lstat(path)
        except OSError:
            return True
        if not stat.S_ISDIR(info.st_mode) or info.st_uid == os.geteuid():
            return False
        return not os.access(path, os.R_OK | os.W_OK | os.X_OK, effective_ids=effective)

    if stuck(str(folder)):
        return folder
    for dirpath, dirnames, _ in os.walk(folder):  # links are not followed
        for name in dirnames:
            if stuck(os.path.join(dirpath, name)):
                return Path(dirpath) / name
    return None


def _note(handle, kind: str, folder: Path) -> None:
    """Record a folder this run made, before anything is moved into it (so a kill leaves it recoverable)."""
    handle.write(f"{kind} {folder.name}\n")
    handle.flush()
    os.fsync(handle.fileno())


def _unstaged(err: BaseException, staging: Path, target: Path) -> None:
    """Messages name the output the user gave, never the internal staging folder."""
    if isinstance(err, Gpt2OnnxError) and err.args and isinstance(err.args[0], str):
        err.args = (err.args[0].replace(str(staging), str(target)), *err.args[1:])


@contextlib.contextmanager
def staged_folder(target: Path, *, force: bool, protect: tuple[Path, ...] = (), check: bool = True):
    """Yield a fresh temporary folder; on success it replaces ``target``, on any failure it is removed.

    ``protect``: paths (the source checkpoint) that the output must not be, nor contain. ``check=False``: the
    caller checked the output itself (deploy in place, which carries what it does not own). The replace can be
    recovered at every instant: the old folder is renamed aside first (beside it, under a recorded name: a
    folder renamed within its parent needs no write permission of its own, so a read-only old folder is
    replaced too), and a run killed between the two renames gets it back at the next run. An old folder that
    could not be removed once replaced (another user's read-only sub-folder in it) is refused before any work."""
    given, target = Path(target), real_location(target)  # '.' has no name for a lock or a staging folder
    if check:
        check_output(given, force=force, protect=protect)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(
            f"cannot write to output folder '{target}' ({err.strerror or err}); choose a writable one"
        ) from None
    with _output_lock(target) as lock:
        if check:
            check_output(given, force=force, protect=protect)  # again, now that no other run can write it
        _remove_stale_staging(target.parent, keep=target.parent / f".{target.name}{_LOCK_SUFFIX}")
        stuck = removable(target) if target.is_dir() and not target.is_symlink() else None
        if stuck is not None:
            raise OutputError(
                f"cannot replace '{given}': '{stuck}' cannot be removed by this user (another user's, or not"
                " writable); ask its owner to remove it, or write elsewhere (-o)"
            )
        staging = None
        try:
            with _signals_held():  # made and recorded at once: a Ctrl-C or SIGTERM lands after, then cleans it up
                try:
                    staging = Path(
                        tempfile.mkdtemp(prefix=f".{target.name}{_STAGING}{os.getpid()}-", dir=target.parent)
                    )
                    _note(lock, "staging", staging)
                except OSError as err:
                    raise OutputError(
                        f"cannot write to output folder '{target}' ({err.strerror or err}); choose a writable one"
                    ) from None
            try:
                yield staging
            except OSError as err:
                if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.EPERM):
                    raise OutputError(
                        f"cannot write the output folder '{target}' ({err.strerror}); free space or choose another one;"
                        " nothing was written"
                    ) from None
                raise
            except BaseException as err:
                _unstaged(err, staging, given)
                raise
            _apply_umask(staging)
            try:
                if target.exists():
                    # Rename the old folder aside first, so that a failure here still leaves one complete folder.
                    aside = _aside_name(target)
                    _note(lock, "aside", aside)
                    os.rename(target, aside)  # nothing moved on failure (a mount point, a read-only parent)
                    try:
                        os.replace(staging, target)
                    except BaseException:
                        os.rename(aside, target)  # put the old folder back
                        raise
                    if not remove_tree(aside):
                        log.warning("the old '%s' could not be removed whole: remove '%s' yourself", given, aside)
                else:
                    os.replace(staging, target)
            except OSError as err:
                raise OutputError(
                    f"cannot move the new folder into '{target}' ({err.strerror or err}); the old one is kept:"
                    " check the permissions of its parent folder"
                ) from None
        except BaseException:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            raise


@contextlib.contextmanager
def _signals_held():
    """Ctrl-C and SIGTERM held back for the block (a folder made and its name recorded, never one without the
    other), then delivered as they would have been; where signals cannot be held (another platform), nothing."""
    held = {signal.SIGINT, signal.SIGTERM}
    try:
        before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    except (AttributeError, OSError, ValueError):
        before = None
    try:
        yield
    finally:
        if before is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _aside_name(target: Path) -> Path:
    """A new name beside ``target`` for its old folder while it is replaced (.NAME.old-PID-RANDOM)."""
    while True:
        aside = target.parent / f".{target.name}{_BACKUP}{os.getpid()}-{secrets.token_hex(4)}"
        if not aside.exists() and not aside.is_symlink():
            return aside


def _apply_umask(folder: Path) -> None:
    """mkdtemp makes the folder private (0700) and some writers make files 0600; give the finished folder
    the permissions a plain mkdir and open would have. Links are left alone, and so are files with other
    names (hard links to the source's model files, or to what deploy carries over): chmod would change them
    there too."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            info = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISDIR(info.st_mode):
                os.chmod(os.path.join(dirpath, name), 0o777 & ~umask)
            elif stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
                os.chmod(os.path.join(dirpath, name), 0o666 & ~umask)
