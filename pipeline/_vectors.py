"""Unit-vector matrices scored against a query: the semantic router's index, reusable by
anything that looks up the nearest stored texts (a semantic cache, say).

`unit_rows` checks and normalizes what an embedder returned; `VectorIndex` holds the unit
rows and computes every row's cosine similarity to a unit query on the calling thread.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pipeline.errors import _VectorShapeError

__all__ = [
    "BLOCK_UTTERANCES",
    "TILE_ELEMENTS",
    "Matrix",
    "VectorIndex",
    "VectorShapeError",
    "unit_rows",
]

TILE_ELEMENTS = 400_000
"""The index is scored in products of at most this many elements: small enough that OpenBLAS
runs each one on the calling thread (its vector-matrix product fans out to its threads from
460,800 elements)."""
BLOCK_UTTERANCES = 1 << 14
"""Rows per block of the index: each block is scored by products over a slice of the
dimensions, accumulated."""

Matrix = npt.NDArray[np.float32]
"""(rows, d) float32: one vector per row."""


VectorShapeError = _VectorShapeError
"""What an embedder returned is not the matrix expected (defined in `pipeline.errors`, where
every exception class lives; private: callers turn it into their own typed error)."""


def unit_rows(
    vectors: object, count: int, dimensions: int | None, what: str, item: str = "vector"
) -> Matrix:
    """`vectors` as a float32 ``(count, d)`` matrix of unit rows, or `VectorShapeError`.

    Refused: another count or dimension than expected, NaN or infinity, a zero row.
    """
    try:
        array = np.asarray(vectors, dtype=np.float32)
    except (TypeError, ValueError):
        raise VectorShapeError(f"{what}: not a numeric matrix (ragged or non-numeric)") from None
    if array.ndim != 2 or array.shape[0] != count:
        raise VectorShapeError(
            f"{what}: expected {count} vectors, got an array of shape {array.shape}"
        )
    if dimensions is not None and array.shape[1] != dimensions:
        raise VectorShapeError(f"{what}: expected dimension {dimensions}, got {array.shape[1]}")
    if array.shape[1] == 0:
        raise VectorShapeError(f"{what}: the vectors have no dimensions")
    if not np.all(np.isfinite(array)):
        raise VectorShapeError(f"{what}: the vectors contain NaN or infinity")
    norms = np.linalg.norm(array, axis=1)
    if not np.all(norms > 0):
        bad = int(np.argmin(norms))
        raise VectorShapeError(f"{what}: {item} {bad} is the zero vector", zero=True)
    unit: Matrix = (array / norms[:, None]).astype(np.float32, copy=False)
    return unit


class VectorIndex:
    """Unit-length rows, stored for a fast single-threaded scan; immutable once built.

    Rows are kept in blocks of up to `BLOCK_UTTERANCES`, each a contiguous
    (dimensions, rows) array, and scored by BLAS's vector-matrix kernel over slices of the
    dimensions of at most `TILE_ELEMENTS` elements, accumulated. Why: one BLAS product over
    the whole matrix fans out to OpenBLAS's threads, and when the other cores are busy the
    hand-off costs milliseconds (10,000 x 384 with the second core busy: p99 8 ms); numpy's
    own loops (``einsum``) stay on one thread but run at half BLAS's speed; and OpenBLAS's
    thread count is process-wide, so limiting it would slow the application's own numpy code.
    """

    __slots__ = ("_blocks", "_width", "dimensions", "matrix", "size")

    def __init__(self, matrix: Matrix) -> None:
        # The rows as given: kept for saving, and to build the next index from.
        self.matrix = matrix
        self.size, self.dimensions = matrix.shape
        self._width = max(1, min(self.size, BLOCK_UTTERANCES))
        depth = max(1, TILE_ELEMENTS // self._width)
        # Per block: its rows' span, then its tiles: (the query's dimensions, tile).
        blocks: list[tuple[int, int, list[tuple[slice, Matrix]]]] = []
        for start in range(0, self.size, self._width):
            block = np.ascontiguousarray(matrix[start : start + self._width].T)
            tiles = [
                (slice(d, d + depth), block[d : d + depth])
                for d in range(0, self.dimensions, depth)
            ]
            blocks.append((start, start + block.shape[1], tiles))
        self._blocks = tuple(blocks)

    def similarities(self, query: Matrix) -> Matrix:
        """Cosine similarity of the unit `query` (shape ``(d,)``) to every row, in order."""
        out: Matrix = np.empty(self.size, dtype=np.float32)
        partial: Matrix = np.empty(self._width, dtype=np.float32)
        for start, end, tiles in self._blocks:
            target = out[start:end]
            scratch = partial[: end - start]
            dims, tile = tiles[0]
            np.matmul(query[dims], tile, out=target)
            for dims, tile in tiles[1:]:
                np.matmul(query[dims], tile, out=scratch)
                target += scratch
        return out
