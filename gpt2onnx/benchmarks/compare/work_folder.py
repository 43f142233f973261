"""The work folder of ``gpt2onnx compare`` and ``bench precision``: files built there are reused only for the same
build. Its record (a small JSON file) names everything that defines a build: the checkpoint's weights (a GGUF's
sha256, its config and tokenizer within), its config, generation and tokenizer files, the build options and
gpt2onnx's version. A folder that holds files but no record,
a record that is not a small regular file, or one that names another build is refused before any work, or, with
``rebuild``, the built entries are removed and the record written anew."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from gpt2onnx.errors import BadInput, OutputError
from gpt2onnx.files import kind_of, read_regular_text, sha256_file, write_text_atomic

RECORD_LIMIT = 1 << 20  # bytes: a record is a few hundred; anything larger is not one
# the record's parts, in words
_PARTS = {
    "checkpoint": "the checkpoint's weights",
    "files": "its config, generation or tokenizer files",
    "options": "the build options",
    "version": "gpt2onnx's version",
}


def build_source(ckpt, **options) -> dict:
    """What a build from ``ckpt`` depends on: its source (the weights' sha256, or the random weights' seed), the
    sha256 of its config, generation config and tokenizer files, ``options``, and gpt2onnx's version."""
    from gpt2onnx import __version__

    files = {}
    folder = getattr(ckpt, "companion_dir", None)
    if folder is not None:  # a GGUF's config is its metadata, in the file its sha256 names: no config.json
        config = () if ckpt.source.get("kind") == "gguf" else ("config.json",)
        for name in (*config, *getattr(ckpt, "companion_files", ())):
            files[name] = sha256_file(Path(folder) / name)
    source = {k: v for k, v in ckpt.source.items() if k != "path"}  # the bytes say which checkpoint, not where
    return {"checkpoint": source, "files": files, "options": options, "version": __version__}


def claim_work(work: Path, source: dict, record_name: str, *, built: Iterable[str] = (), rebuild: bool = False) -> None:
    """``work`` holds files built from this ``source`` only: its record is written when the folder holds none of
    a build's entries (``built``: glob patterns of what a build writes under ``work``), and checked after; on
    ``rebuild``, a folder that cannot be claimed loses those entries and its record first. Raises BadInput (a
    folder that cannot be claimed, without ``rebuild``), OutputError."""
    record = work / record_name
    text = json.dumps(source, sort_keys=True, default=str)
    built = tuple(built)
    why = _refusal(work, record, json.loads(text), built)
    if why is not None and not rebuild:
        raise BadInput(f"--work '{work}' {why}: give another --work folder, or --rebuild to build there again")
    if why is not None:
        entries = [entry for pattern in built for entry in work.glob(pattern)]
        for entry in [record, *entries] if os.path.lexists(record) else entries:
            _remove(entry)
    if why is not None or not record.exists():
        try:
            work.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OutputError(f"cannot write --work '{work}' ({err.strerror or err}): choose another path") from None
        write_text_atomic(record, text + "\n")


def _refusal(work: Path, record: Path, source: dict, built: tuple[str, ...]) -> str | None:
    """Why ``work`` cannot be claimed for ``source`` (None: it can): a build's entries (``built``) without a record,
    a record that is not a small regular JSON file, or one of another build."""
    try:
        info = os.lstat(record)
    except FileNotFoundError:
        info = None
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    if info is None:
        try:
            held = next((entry for pattern in built for entry in sorted(work.glob(pattern))), None)
        except OSError as err:
            return f"cannot be read ({err.strerror or err})"
        if held is None:
            return None
        return f"holds '{held.name}' but no {record.name} (what it was built from is unknown)"
    if not stat.S_ISREG(info.st_mode):
        return f"has a {record.name} that is not a regular file ({kind_of(info.st_mode)})"
    if info.st_size > RECORD_LIMIT:
        return f"has a {record.name} of {info.st_size:,} bytes, not a record"
    try:
        found = json.loads(read_regular_text(record, "the record", limit=RECORD_LIMIT))
    except BadInput as err:  # changed since the lstat, or not UTF-8
        return f"has a {record.name} that cannot be read as a record ({err})"
    except ValueError:
        found = None
    if not isinstance(found, dict):
        return f"has a {record.name} that is not a record (not a JSON object)"
    if found == source:
        return None
    differ = [_PARTS.get(k, k) for k in sorted(set(found) | set(source)) if found.get(k) != source.get(k)]
    return (
        f"holds files built from another checkpoint or with other options ({record.name} differs in"
        f" {', '.join(differ)})"
    )


def _remove(entry: Path) -> None:
    """An entry of the work folder, whatever it is (a folder's tree; a link itself, never what it leads to)."""
    try:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    except OSError as err:
        raise OutputError(f"cannot remove '{entry}' to build again ({err.strerror or err})") from None
