"""A hashable, immutable numpy array, so scale vectors stay out of NNX state.

Flax NNX treats numpy array attributes as pytree leaves, which would turn a per-channel weight
scale into a jit argument. Scales are calibration constants: they belong in the compiled program
as literals (XLA can then fold them into the epilogue), so layers hold them as ``StaticArray``,
which NNX keeps in the graph definition and ``jax.jit`` sees as a Python constant.
"""

from __future__ import annotations

import numpy as np


class StaticArray:
    """Read-only numpy array compared and hashed by value."""

    __slots__ = ("_array", "_key")

    def __init__(self, value: np.ndarray | float):
        array = np.array(value, copy=True)
        array.setflags(write=False)
        self._array = array
        self._key = (array.dtype.str, array.shape, array.tobytes())

    @property
    def array(self) -> np.ndarray:
        return self._array

    @property
    def shape(self) -> tuple[int, ...]:
        return self._array.shape

    @property
    def dtype(self) -> np.dtype:
        return self._array.dtype

    def __array__(self, dtype=None, copy=None):
        return self._array if dtype is None else self._array.astype(dtype)

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StaticArray) and self._key == other._key

    def __repr__(self) -> str:
        a = self._array
        if a.size <= 4:
            return f"StaticArray({a.tolist()!r}, {a.dtype})"
        return f"StaticArray(shape={a.shape}, dtype={a.dtype}, min={a.min():.4g}, max={a.max():.4g})"
