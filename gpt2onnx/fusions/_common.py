"""Helpers shared by the fusion rules."""

from __future__ import annotations

import numpy as np


def constant_value(value) -> float | None:
    """The scalar a value holds when it is a constant (initializer or folded Constant), else None."""
    if value is None or value.const_value is None:
        return None
    array = np.asarray(value.const_value.numpy())
    if array.size != 1:
        return None
    return float(array.reshape(()))


def static_dim(value, axis: int) -> int | None:
    shape = value.shape if value is not None else None
    if shape is None or len(shape) <= abs(axis):
        return None
    dim = shape[axis]
    return dim if isinstance(dim, int) else None
