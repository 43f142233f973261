"""Writing an exported folder: staged in a temporary folder beside the target, moved into place only when
complete, so a failed or interrupted export leaves nothing behind and an existing folder is never lost."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import onnx

from gpt2onnx.errors import Gpt2OnnxError

log = logging.getLogger(__name__)

PROTOBUF_LIMIT = 2**31  # a single ONNX protobuf file cannot exceed 2 GB
DATA_FILE_SUFFIX = "_data"


@contextlib.contextmanager
def staged_folder(target: Path, *, force: bool):
    """Yield a fresh temporary folder; on success it replaces ``target``, on any failure it is removed."""
    target = Path(target)
    if target.exists() and not force:
        raise Gpt2OnnxError(f"output folder '{target}' already exists: choose another --out, or add --force to replace it")
    if target.exists() and not target.is_dir():
        raise Gpt2OnnxError(f"output '{target}' exists and is not a folder: choose another --out")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as err:
        raise Gpt2OnnxError(f"cannot write to output folder '{target}' ({err.strerror or err}); choose a writable --out") from None
    try:
        yield staging
        _apply_umask(staging)
        if target.exists():
            # Move the old folder aside first, so that a failure here still leaves one complete folder.
            backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, backup / target.name)
            os.replace(staging, target)
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
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def tensor_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer)


def save_onnx(model: onnx.ModelProto, path: Path, *, external_data: bool | None) -> list[str]:
    """Save ``model``; weights go to ``<name>_data`` when asked, or automatically past the 2 GB limit.
    Returns the names of the files written."""
    if external_data is None:
        external_data = tensor_bytes(model) > PROTOBUF_LIMIT - 2**26  # leave room for the graph itself
        if external_data:
            log.info("model exceeds protobuf's 2 GB limit: writing weights to an external data file")
    if not external_data:
        onnx.save_model(model, str(path))
        return [path.name]
    data_name = path.name + DATA_FILE_SUFFIX
    onnx.save_model(
        model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data_name, size_threshold=1024
    )
    return [path.name, data_name]
