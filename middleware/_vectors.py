"""A small index of unit-length float32 vectors that grows one row at a time and forgets its
oldest rows past a capacity: the semantic cache's candidates of one partition.

The semantic router's index (`middleware.routing.semantic`) is built once from its profiles
and never changes; a cache's candidates arrive one answer at a time, so this one keeps a
preallocated ring of rows and scores the filled part with one matrix-vector product.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["RingIndex", "unit_vector"]

Vector = npt.NDArray[np.float32]


def unit_vector(values: Sequence[float] | npt.NDArray[np.floating]) -> Vector | None:
    """`values` as a unit-length float32 vector, or None when it is empty, zero or not
    finite (such a vector matches nothing)."""
    vector = np.asarray(values, dtype=np.float32).reshape(-1)
    if vector.size == 0 or not np.all(np.isfinite(vector)):
        return None
    norm = float(np.linalg.norm(vector))
    if not norm > 0.0 or not np.isfinite(norm):
        return None
    unit: Vector = vector / np.float32(norm)
    return unit


_KEY_BYTES = 64
"""Bytes counted per row beyond its vector and its key's characters (the key's string
object and its slot in the list)."""


class RingIndex:
    """At most `capacity` unit vectors, each with a key; adding past the capacity replaces
    the oldest row. `best(query)` is the key and cosine similarity of the closest row.

    Memory follows what is held: the rows are one matrix grown by doubling from a single
    row (and halved when removals leave it a quarter full), so an index holds at most twice
    the rows it has; `nbytes` counts it."""

    __slots__ = ("_keys", "_next", "_rows", "capacity", "dimensions", "size")

    def __init__(self, dimensions: int, capacity: int) -> None:
        if dimensions < 1 or capacity < 1:
            raise ValueError("a vector index needs positive dimensions and capacity")
        self.dimensions = dimensions
        self.capacity = capacity
        self._rows: Vector = np.empty((1, dimensions), dtype=np.float32)
        self._keys: list[str] = []
        self._next = 0
        self.size = 0

    @property
    def nbytes(self) -> int:
        """The bytes this index holds: its matrix and its keys."""
        return int(self._rows.nbytes) + sum(len(key) + _KEY_BYTES for key in self._keys)

    def _resize(self, rows: int) -> None:
        resized = np.empty((rows, self.dimensions), dtype=np.float32)
        resized[: self.size] = self._rows[: self.size]
        self._rows = resized

    def add(self, vector: Vector, key: str) -> None:
        """Add `vector` (unit length, `dimensions` long) under `key`."""
        if vector.shape != (self.dimensions,):
            raise ValueError(f"expected a vector of {self.dimensions} dimensions")
        if key in self._keys:  # the same answer again (a refresh): keep one row for it
            self._rows[self._keys.index(key)] = vector
            return
        if self.size < self.capacity:
            if self.size == self._rows.shape[0]:
                self._resize(min(self.capacity, 2 * self._rows.shape[0]))
            self._rows[self.size] = vector
            self._keys.append(key)
            self.size += 1
            return
        self._rows[self._next] = vector
        self._keys[self._next] = key
        self._next = (self._next + 1) % self.capacity

    def remove(self, key: str) -> None:
        """Forget `key`'s row (its answer expired from the store)."""
        if key not in self._keys:
            return
        index = self._keys.index(key)
        last = self.size - 1
        self._rows[index] = self._rows[last]
        self._keys[index] = self._keys[last]
        self._keys.pop()
        self.size = last
        self._next = 0 if self.size < self.capacity else self._next % max(1, self.size)
        if 0 < self.size <= self._rows.shape[0] // 4:
            self._resize(self._rows.shape[0] // 2)

    def best(self, query: Vector) -> tuple[str, float] | None:
        """The closest row's key and its cosine similarity to the unit `query`."""
        if self.size == 0 or query.shape != (self.dimensions,):
            return None
        scores = self._rows[: self.size] @ query
        index = int(np.argmax(scores))
        return self._keys[index], float(scores[index])
