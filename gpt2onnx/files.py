"""Small file helpers: hashing, and JSON written so that a reader never sees half a file."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from gpt2onnx.errors import OutputError


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomic(path: str | Path, data) -> Path:
    """Write ``data`` as JSON next to ``path``, then rename it into place."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh, indent=2)
                fh.write("\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as err:
        raise OutputError(f"cannot write '{path}' ({err.strerror or err}); choose a writable path") from None
    return path


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
    A hard link shares the data: write new files next to it, never into it."""
    try:
        os.link(source, target)
        return "link"
    except OSError:
        import shutil

        shutil.copyfile(source, target)
        return "copy"
