"""The one rule for paths: a file named inside another file, and a file an option asks us to write.

- :func:`file_in_folder`: every path read from a file (an external-data ``location``, a manifest's file names,
  the tokenizer files, a shard index entry) must be a plain file name in its folder that stays inside the
  folder once links are resolved, and name a regular file. Anything else is refused in one line, naming the file that
  holds the path.
- :func:`check_output_file`: a file an option asks us to write (``--json``, ``--plot``) must be a new path or
  an existing regular file, outside the model folders being read, and not a link.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpt2onnx.errors import BadInput


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
        try:
            mode = path.stat().st_mode
        except OSError as err:
            raise BadInput(f"{what} '{path}' cannot be read ({err.strerror or err})") from None
        if not stat.S_ISREG(mode):
            raise BadInput(f"{what} '{path}' named in '{where}' is not a regular file: export the folder again")
    return path


def check_output_file(path: Path | str, *, option: str, inputs: tuple[Path, ...] = ()) -> Path:
    """A file we are asked to write: a new path or an existing regular file (not a link, a folder or a
    device), in a folder that exists, and not inside one of the model folders ``inputs`` being read."""
    path = Path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    except OSError as err:
        raise BadInput(f"{option} '{path}' cannot be used ({err.strerror or err}): choose another path") from None
    if info is not None and stat.S_ISLNK(info.st_mode):
        raise BadInput(f"{option} '{path}' is a symbolic link: give the real path, or a new one")
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise BadInput(f"{option} '{path}' exists and is not a regular file: give a new file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise BadInput(f"{option} '{path}': its folder '{parent}' does not exist; create it or choose another path")
    real = parent.resolve() / path.name
    for folder in inputs:
        folder = Path(folder)
        root = (folder.parent if folder.is_file() else folder).resolve()
        if real.is_relative_to(root):
            raise BadInput(
                f"{option} '{path}' is inside the model folder '{folder}' being read: write it somewhere else"
            )
    return path
