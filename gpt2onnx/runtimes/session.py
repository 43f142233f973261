"""ONNX Runtime sessions."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import onnxruntime as ort

log = logging.getLogger(__name__)


def cpu_session(path: str | Path, *, threads: int | None = None) -> ort.InferenceSession:
    """A CPU session with ``threads`` intra-op threads (default: all cores)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or os.cpu_count() or 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
