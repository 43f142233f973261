"""The one rule for paths: a file named inside another file, and a file an option asks us to write.

- :func:`file_in_folder`: every path read from a file (an external-data ``location``, a manifest's file names,
  the tokenizer files, a shard index entry) must be a plain file name in its folder that stays inside the
  folder once links are resolved, and name a regular file. Anything else is refused in one line, naming the file that
  holds the path.
- :func:`check_output_path`: every path a command writes (``--json``, ``--plot``, ``-o``, deploy in place) is
  checked before any work: a new path or an existing entry of its kind (a regular file, a folder), never a link,
  a FIFO or a device, outside the folders being read (model folders, a draft, a checkpoint), never an input file
  nor a hard link to one (the same device and inode), and a folder never holds the working directory or an input
  file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable

from gpt2onnx.errors import BadInput, OutputError
from gpt2onnx.files import kind_of, require_regular


def plain_name(name: object, *, what: str, where: Path | str) -> str:
    """``name`` as a plain file name (no folder part, no '..', not absolute, no NUL); else BadInput."""
    if not isinstance(name, str) or not name.strip() or "\x00" in name:
        raise BadInput(f"{what} {name!r} in '{where}' is not a file name: export or write the folder again")
    if "/" in name or "\\" in name or name in (".", ".."):
        raise BadInput(
            f"{what} {name!r} in '{where}' is not a plain file name inside its folder (a path, absolute or with"
            " '..'): the folder is refused; export it again"
        )
    return name


def file_in_folder(folder: Path, name: object, *, what: str, where: Path | str, must_exist: bool = True) -> Path:
    """The file ``name`` (read from the file ``where``) inside ``folder``: a plain relative name, resolved
    inside the folder, a regular file. Returns its path (under ``folder``, not resolved)."""
    folder = Path(folder)
    path = folder / plain_name(name, what=what, where=where)
    try:
        real = path.resolve(strict=must_exist)
    except (OSError, RuntimeError) as err:  # missing, or a loop of links
        if isinstance(err, FileNotFoundError):
            raise BadInput(f"{what} '{path}' named in '{where}' does not exist: export the folder again") from None
        raise BadInput(f"{what} '{path}' named in '{where}' cannot be read ({err}): export the folder again") from None
    if not real.is_relative_to(folder.resolve()):
        raise BadInput(
            f"{what} '{path}' named in '{where}' leads outside the folder (to '{real}'): replace the link with the"
            " file itself"
        )
    if must_exist or path.exists():
        require_regular(path, f"{what} '{path}' named in '{where}'", "export the folder again")
    return path


def real_location(path: Path | str) -> Path:
    """Where ``path`` is: absolute, its folder resolved (links followed), its own name kept (a link stays the
    link); '.' and '..' resolved, so that the output '.' is the working directory's own name in its parent."""
    path = Path(path)
    if path.name in ("", ".", ".."):
        return path.resolve()
    return path.parent.resolve() / path.name


def check_output_path(
    path: Path | str,
    *,
    option: str,
    kind: str = "file",
    folders: Iterable[Path | str] = (),
    files: Iterable[Path | str] = (),
    reading: str = "the model folder",
    replaced: bool = True,
) -> Path:
    """The one rule for every path a command writes, checked before any work: ``kind`` "file" (--json, --plot)
    or "folder" (-o of export, optimize and deploy; deploy in place; a cache folder). Refused, in one line
    naming ``option``: a symbolic link (it would be replaced, or written through), an existing entry of the
    other kind or one that is no file or folder at all (a FIFO, a device, a socket), a file whose folder does
    not exist, one of the model ``folders`` being read, a file inside one, a folder that holds one, one of the
    input ``files``, and a folder that is, or holds, the working directory (unless it is written
    into, never ``replaced``: a cache). Returns ``path``."""
    path = Path(path)
    if str(path) == "" or "\x00" in str(path):
        raise BadInput(f"{option} '{path}' is not a path: give a {kind} path")
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    except OSError as err:  # a folder on the way that is a file, or that we may not read
        what = "to output folder" if kind == "folder" else option
        raise OutputError(f"cannot write {what} '{path}' ({err.strerror or err}): choose another path") from None
    if info is not None and stat.S_ISLNK(info.st_mode):
        raise BadInput(f"{option} '{path}' is a symbolic link: give the real path, or a new one")
    wanted = stat.S_ISREG if kind == "file" else stat.S_ISDIR
    if info is not None and not wanted(info.st_mode):
        raise BadInput(
            f"{option} '{path}' exists and is not a {'regular file' if kind == 'file' else 'folder'}"
            f" ({kind_of(info.st_mode)}): give a new {kind} path"
        )
    parent = path.parent if str(path.parent) else Path(".")
    if kind == "file" and not parent.is_dir():
        raise BadInput(f"{option} '{path}': its folder '{parent}' does not exist; create it or choose another path")
    if kind == "file" and not os.access(
        parent, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids
    ):
        # the file is written beside itself, then renamed: its folder must take a new file (before minutes of work)
        raise OutputError(f"cannot write {option} '{path}': its folder '{parent}' is not writable; choose another path")
    try:
        real = real_location(path)
        read_folders = [(Path(f), Path(f).resolve()) for f in folders]
        read_files = [(Path(f), Path(f).resolve()) for f in files]
    except (OSError, RuntimeError) as err:
        raise BadInput(f"{option} '{path}' cannot be used ({err}): choose another path") from None
    for folder, root in read_folders:
        if real == root:
            replacing = ", which --force would delete" if kind == "folder" else ""
            raise BadInput(f"{option} '{path}' is {reading} '{folder}' being read{replacing}: choose another {kind}")
        if kind == "file" and real.is_relative_to(root):
            raise BadInput(f"{option} '{path}' is inside {reading} '{folder}' being read: write it somewhere else")
        if kind == "folder" and root.is_relative_to(real):
            raise BadInput(
                f"{option} '{path}' holds {reading} '{folder}' being read, which --force would delete: choose another"
                " folder"
            )
    for file, target in read_files:
        if real == target or (info is not None and _same_file(info, file)):
            raise BadInput(f"{option} '{path}' is the input file '{file}': write it somewhere else")
        if kind == "folder" and replaced and target.is_relative_to(real):
            raise BadInput(f"{option} '{path}' holds the input file '{file}', which writing it would replace")
    if info is not None and stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
        for folder, _ in read_folders:  # a hard link to a file of a folder read: that file, by another name
            twin = _hard_link_in(folder, info)
            if twin is not None:
                raise BadInput(
                    f"{option} '{path}' is a hard link to '{twin}' of {reading} '{folder}' being read: write it"
                    " somewhere else"
                )
    if kind == "folder" and replaced and Path.cwd().resolve().is_relative_to(real):
        raise BadInput(
            f"{option} '{path}' is, or holds, the working directory, which writing it would replace: run from"
            " another folder, or choose another output folder"
        )
    return path


def _same_file(info: os.stat_result, other: Path | str) -> bool:
    """Whether ``other`` (links followed) is the file ``info`` describes: the same device and inode."""
    try:
        seen = os.stat(other)
    except (OSError, ValueError):
        return False
    return (seen.st_dev, seen.st_ino) == (info.st_dev, info.st_ino)


def _hard_link_in(folder: Path, info: os.stat_result, *, most: int = 10_000) -> Path | None:
    """The file in ``folder`` (its tree, links not followed, at most ``most`` entries) that is the file ``info``
    describes, or None."""
    walked = 0
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in filenames:
            try:
                seen = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (seen.st_dev, seen.st_ino) == (info.st_dev, info.st_ino):
                return Path(dirpath) / name
        walked += len(dirnames) + len(filenames)
        if walked > most:
            break
    return None


def read_folders_of(inputs: Iterable[Path | str | None]) -> tuple[Path, ...]:
    """The folders read, from what a command reads (folders, model files, Hub ids): a file's folder, and only what
    exists here (a Hub id is not a folder)."""
    found = []
    for p in inputs:
        if p is not None and str(p) and Path(p).exists():
            found.append(Path(p).parent if Path(p).is_file() else Path(p))
    return tuple(found)


def check_output_file(
    path: Path | str, *, option: str, inputs: Iterable[Path | str | None] = (), files: Iterable = ()
) -> Path:
    """A file we are asked to write, next to the folders ``inputs`` being read (model folders, model files, a
    draft, a checkpoint) and the input ``files`` (a text; see check_output_path)."""
    files = tuple(Path(f) for f in files if f is not None and str(f))
    return check_output_path(path, option=option, kind="file", folders=read_folders_of(inputs), files=files)


def check_output_files(
    outputs: dict[str, Path | str | None], *, inputs: Iterable[Path | str | None] = (), files: Iterable = ()
) -> None:
    """Each file a command will write (by option; None: not asked for), checked as check_output_file does, and
    none of them named twice."""
    inputs, files = tuple(inputs), tuple(files)
    seen: dict[Path, str] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        check_output_file(path, option=option, inputs=inputs, files=files)
        other = seen.setdefault(Path(path).resolve(), option)
        if other != option:
            raise BadInput(f"{other} and {option} both name '{path}': give each its own file")


def folder_labels(folders) -> list[str]:
    """Each folder's label: its name, or as many of its last path parts as tell it from the others (two folders
    named 'model' are 'a/model' and 'b/model': the ratios and tables keep both). A folder given twice is refused."""
    paths = [Path(f).resolve() for f in folders]
    for index, path in enumerate(paths):
        if path in paths[:index]:
            raise BadInput(f"'{folders[index]}' is given twice (as '{path}'): give each folder once")
    depth = 1
    while True:
        labels = ["/".join(path.parts[-depth:]) for path in paths]
        if len(set(labels)) == len(labels):
            return labels
        depth += 1
