"""`HashingEmbeddingGenerator`: deterministic, offline embeddings for tests and demos.

**Not a semantic model.** It hashes character n-grams into a fixed-size vector, so texts
that share spelling score high and texts that share meaning but not words do not. Use it
where no embedding model is available (tests, the demo, offline development); use
`OpenAIEmbeddingGenerator` (or any `EmbeddingGenerator`) for real routing.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["HashingEmbeddingGenerator"]


class HashingEmbeddingGenerator:
    """Hashed character n-grams (default 3- and 4-grams of lower-cased, padded words),
    signed by a second hash bit, normalized to unit length; float32 ``(n, dimensions)``.

    An empty or whitespace-only text embeds as the zero vector.
    """

    def __init__(self, dimensions: int = 384, ngrams: Sequence[int] = (3, 4)) -> None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 2:
            raise ValueError("dimensions must be an int of at least 2")
        if not ngrams or any(not isinstance(n, int) or n < 1 for n in ngrams):
            raise ValueError("ngrams must be positive ints")
        self.dimensions = dimensions
        self.ngrams = tuple(ngrams)
        self.calls = 0
        self.texts_embedded = 0

    @property
    def identity(self) -> str:
        """What a saved semantic index records as its embedder."""
        return f"hashing(dimensions={self.dimensions}, ngrams={self.ngrams})"

    def _vector(self, text: str) -> npt.NDArray[np.float32]:
        vector = np.zeros(self.dimensions, dtype=np.float32)
        for word in text.lower().split():
            padded = f" {word} "
            for n in self.ngrams:
                for start in range(max(1, len(padded) - n + 1)):
                    digest = zlib.crc32(padded[start : start + n].encode())
                    sign = 1.0 if digest & 0x80000000 else -1.0
                    vector[digest % self.dimensions] += sign
        norm = float(np.linalg.norm(vector))
        return vector / norm if norm > 0 else vector

    async def generate(self, values: Sequence[str]) -> npt.NDArray[np.float32]:
        if isinstance(values, str) or not all(isinstance(v, str) for v in values):
            raise TypeError("values must be a sequence of str")
        self.calls += 1
        self.texts_embedded += len(values)
        if not values:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        return np.stack([self._vector(v) for v in values])

    async def aclose(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"HashingEmbeddingGenerator(dimensions={self.dimensions}, ngrams={self.ngrams})"
