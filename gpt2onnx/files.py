"""Small file helpers: reading only regular files, hashing, and JSON written so that a reader never sees half a
file."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO

from gpt2onnx.errors import BadInput, OutputError


def kind_of(mode: int) -> str:
    """What a file system entry is, in words (for messages): 'a regular file', 'a FIFO', 'a folder', …"""
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a file"


def require_regular(path: Path, named: str, advice: str) -> os.stat_result:
    """``path``'s stat, if it is a regular file; else BadInput: '{named} cannot be read (why)', or '{named} is not a
    regular file: {advice}' (a FIFO would block a reader forever, a device would never end)."""
    try:
        info = path.stat()
    except OSError as err:
        raise BadInput(f"{named} cannot be read ({err.strerror or err})") from None
    if not stat.S_ISREG(info.st_mode):
        raise BadInput(f"{named} is not a regular file: {advice}")
    return info


def open_regular(path: str | Path, what: str, *, limit: int | None = None) -> BinaryIO:
    """``path`` opened for reading (binary), only if it is a regular file of at most ``limit`` bytes; else
    BadInput naming ``what`` and the path. It is opened without blocking (an ordinary open of a FIFO waits for a
    writer forever) and checked with fstat on the opened descriptor, so what is checked is what is read: a FIFO,
    a device (/dev/zero never ends), a socket or a folder is refused, never read."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise BadInput(f"{what} '{path}' cannot be read ({err.strerror or err})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadInput(f"{what} '{path}' is not a regular file ({kind_of(info.st_mode)}): give a file")
        if limit is not None and info.st_size > limit:
            raise BadInput(
                f"{what} '{path}' is {info.st_size:,} bytes, more than the {limit:,} such a file can be: give the"
                " right file"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_bytes(path: str | Path, what: str, *, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (see :func:`open_regular`)."""
    with open_regular(path, what, limit=limit) as fh:
        try:
            return fh.read(limit + 1)[:limit]
        except OSError as err:
            raise BadInput(f"{what} '{path}' cannot be read ({err.strerror or err})") from None


def read_regular_text(path: str | Path, what: str, *, limit: int) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes; BadInput for anything else."""
    data = read_regular_bytes(path, what, limit=limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadInput(
            f"{what} '{path}' is not UTF-8 text ({err.reason} at byte {err.start:,}): replace the file"
        ) from None


def sha256_file(path: Path) -> str:
    return sha256_and_stamp(path)[0]


def sha256_and_stamp(path: Path) -> tuple[str, tuple[int, ...]]:
    """The file's sha256 and the stamp of what was hashed (:func:`stamp` of the opened descriptor)."""
    with open_regular(path, "file") as fh:
        before = stamp(os.fstat(fh.fileno()))
        return sha256_of(fh), before


def sha256_of(fh: BinaryIO) -> str:
    """The sha256 of an opened file's bytes, read from its start with pread (its offset is left alone)."""
    digest, offset, fd = hashlib.sha256(), 0, fh.fileno()
    while chunk := os.pread(fd, 1 << 24, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def descriptor_path(fh: BinaryIO, *, pid: int | None = None) -> str | None:
    """A path that opens the very file ``fh`` has open, whatever its name now names (/proc/PID/fd/N: another
    process of this user opens it too, while ``fh`` stays open); None where the system has no /proc."""
    path = f"/proc/{pid or os.getpid()}/fd/{fh.fileno()}"
    try:
        same = os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino
    except OSError:
        return None
    return path if same else None


def stamp(info: os.stat_result) -> tuple[int, ...]:
    """Which file this is and whether it was written since: device, inode, size, modification and change times (a
    file replaced by a rename has another inode; one written to, or renamed away and back, a later change time)."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def write_json_atomic(path: str | Path, data) -> Path:
    """Write ``data`` as JSON next to ``path``, then rename it into place."""
    return write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) into a new file next to ``path``, with the mode a new file gets, then rename it into
    place: a reader sees the old file or the new one, never half of it. OutputError where it cannot be written."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            os.chmod(tmp, new_file_mode())  # mkstemp makes 0600: give the file the mode a new file gets
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as err:
        raise OutputError(f"cannot write '{path}' ({err.strerror or err}); choose a writable path") from None
    return path


def new_file_mode() -> int:
    """The mode a new file gets here (0o666 less the umask): for files made with mkstemp (0600) and renamed."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes, or None where the kernel does not say (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def link_or_copy(source: Path, target: Path) -> str:
    """``target`` as a hard link to ``source`` (no second copy of a large model file), or a copy where the two
    are on different filesystems or the filesystem has no hard links. Returns "link" or "copy".
    A hard link shares the data: write new files next to it, never into it. A symbolic link is never linked or
    copied as a link (it would dangle beside the copy): its regular file is, and anything else is refused."""
    source = Path(os.path.realpath(source))
    require_regular(source, f"'{source}'", "give a regular file")
    try:
        os.link(source, target)
        return "link"
    except OSError:
        import shutil

        shutil.copyfile(source, target)
        return "copy"
