"""Freed memory given back to the system, so that a process's resident size is what it holds.

Loading a session frees far more than it keeps: onnxruntime parses the file, copies each initializer, folds
constants and prepacks weights, and glibc's malloc keeps the freed blocks in its arenas (one per thread that
allocated) for the next request. Resident memory then counts them until the process ends. Measured on the 124M
int8 file (171 MB on disk, 2-vCPU Intel Xeon, onnxruntime 1.31): 744 MB resident after the session is created,
227 MB after ``malloc_trim(0)``; a decode run's freed buffers the same way. glibc only: elsewhere (musl, macOS,
Windows) the allocator returns memory by its own rules, and this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # no C library by that name, or one without malloc_trim (musl)
        return None


def release_freed_memory() -> bool:
    """Give the heap's free blocks back to the system (glibc's ``malloc_trim(0)``, every arena); whether it could."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
