"""`SemanticRoutingChatClient`: pick the route whose example utterances best match the query.

Promises:

* profile utterances are embedded lazily, once, even under concurrent first requests; a
  failed build is retried by the next request. The index holds the normalized float32
  vectors; a query is scored with single-threaded BLAS products and ``argpartition``;
* the query is the text of the last user message; with none, `default` is chosen;
* the `top_k` best utterances across all routes are aggregated per route by ``mean``,
  ``sum`` or ``max`` (``top_k=1``: the single best match); below `threshold` the default
  route is chosen;
* embedding the query has a time limit (`embedding_timeout`); when it fails, times out or
  returns a zero or non-finite vector, `default` is chosen (or, with
  ``on_embedding_error="raise"``, the error is raised). A wrong embedding count or
  dimension is a `RoutingError` naming what was expected;
* invalid configuration fails at construction with a clear message;
* the chosen route, its score and why it was chosen go on the attempt span (never text).

It is a one-shot router: the chosen route is called once. Put an ordered failover inside
a route (or around this router) for failover.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from middleware.routing._semantic_settings import Aggregation, SemanticSettings
from middleware.routing.context import (
    Route,
    RoutingContext,
    RoutingSelection,
    SelectionResult,
    as_route,
)
from middleware.routing.router import RoutingChatClient, router_keywords
from pipeline._semconv import SEMANTIC_REASON, SEMANTIC_SCORE
from pipeline.client import ChatClient, EmbeddingGenerator
from pipeline.errors import RoutingError
from pipeline.types import ChatMessage, ChatRole

__all__ = [
    "SEMANTIC_REASON",
    "SEMANTIC_SCORE",
    "Aggregation",
    "RouteScore",
    "SemanticRoutingChatClient",
    "SemanticSettings",
]

OFF_LOOP_ELEMENTS = 1 << 22
"""Above this many matrix elements (about 11,000 utterances of 384 dimensions) a query is
scored in a worker thread instead of on the event loop."""
TILE_ELEMENTS = 400_000
"""The index is scored in products of at most this many elements: small enough that OpenBLAS
runs each one on the calling thread (its vector-matrix product fans out to its threads from
460,800 elements)."""
BLOCK_UTTERANCES = 1 << 14
"""Utterances per block of the index: each block is scored by products over a slice of the
dimensions, accumulated."""


@dataclass(frozen=True, slots=True)
class RouteScore:
    route_name: str
    score: float


_Matrix = npt.NDArray[np.float32]  # (utterances, d): one unit-length row per utterance


class _Index:
    """The unit-length utterance vectors, stored for a fast single-threaded scan.

    Utterances are kept in blocks of up to `BLOCK_UTTERANCES`, each a contiguous
    (dimensions, utterances) array, and scored by BLAS's vector-matrix kernel over slices of
    the dimensions of at most `TILE_ELEMENTS` elements, accumulated. Why: one BLAS product
    over the whole matrix fans out to OpenBLAS's threads, and when the other cores are busy
    the hand-off costs milliseconds (10,000 x 384 with the second core busy: p99 8 ms);
    numpy's own loops (``einsum``) stay on one thread but run at half BLAS's speed; and
    OpenBLAS's thread count is process-wide, so limiting it would slow the application's own
    numpy code.
    """

    __slots__ = ("_blocks", "_width", "dimensions", "size")

    def __init__(self, matrix: _Matrix) -> None:
        self.size, self.dimensions = matrix.shape
        self._width = min(self.size, BLOCK_UTTERANCES)
        depth = max(1, TILE_ELEMENTS // self._width)
        # Per block: its utterances' span, then its tiles: (the query's dimensions, tile).
        blocks: list[tuple[int, int, list[tuple[slice, _Matrix]]]] = []
        for start in range(0, self.size, self._width):
            block = np.ascontiguousarray(matrix[start : start + self._width].T)
            tiles = [
                (slice(d, d + depth), block[d : d + depth])
                for d in range(0, self.dimensions, depth)
            ]
            blocks.append((start, start + block.shape[1], tiles))
        self._blocks = tuple(blocks)

    def similarities(self, query: _Matrix) -> _Matrix:
        """Cosine similarity of the unit `query` to every utterance, in profile order."""
        out: _Matrix = np.empty(self.size, dtype=np.float32)
        partial: _Matrix = np.empty(self._width, dtype=np.float32)
        for start, end, tiles in self._blocks:
            target = out[start:end]
            scratch = partial[: end - start]
            dims, tile = tiles[0]
            np.matmul(query[dims], tile, out=target)
            for dims, tile in tiles[1:]:
                np.matmul(query[dims], tile, out=scratch)
                target += scratch
        return out


def _last_user_text(messages: Sequence[ChatMessage]) -> str:
    for message in reversed(messages):
        if message.role is ChatRole.USER:
            return message.text
    return ""


class SemanticRoutingChatClient(RoutingChatClient):
    """Routes each request by embedding similarity (see the module docstring).

    Keyword `options` are the fields of `SemanticSettings` and the router keywords (see
    `RoutingChatClient`).
    """

    def __init__(
        self,
        embedding_generator: EmbeddingGenerator,
        profiles: Mapping[Route | ChatClient, Sequence[str]],
        default: Route | ChatClient,
        settings: SemanticSettings | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**router_keywords(options))
        if not isinstance(embedding_generator, EmbeddingGenerator):
            raise TypeError("embedding_generator must have async generate(values) and aclose()")
        if not isinstance(profiles, Mapping) or not profiles:
            raise ValueError("profiles must be a non-empty mapping of route -> utterances")
        self.settings = SemanticSettings.from_options(settings, options)
        routes: list[Route] = []
        utterances: list[str] = []
        owners: list[int] = []
        for position, (key, examples) in enumerate(profiles.items()):
            route = as_route(key, f"profiles key {position}")
            if isinstance(examples, str) or not isinstance(examples, Sequence) or not examples:
                raise ValueError(f"profile {route.name!r} needs a non-empty list of utterances")
            for index, utterance in enumerate(examples):
                if not isinstance(utterance, str) or not utterance.strip():
                    raise ValueError(f"profile {route.name!r}: utterance {index} is blank")
                utterances.append(utterance)
                owners.append(len(routes))
            routes.append(route)
        if len({r.name for r in routes}) != len(routes):
            raise ValueError("profile routes must have distinct names")
        if self.settings.top_k > len(utterances):
            raise ValueError(
                f"top_k ({self.settings.top_k}) exceeds the number of utterances "
                f"({len(utterances)})"
            )
        self.generator = embedding_generator
        self.routes: tuple[Route, ...] = tuple(routes)
        self.default = as_route(default, "default")
        self.threshold = self.settings.threshold
        self.top_k = self.settings.top_k
        self.aggregation: Aggregation = self.settings.aggregation
        self.embedding_timeout = self.settings.embedding_timeout
        self.on_embedding_error = self.settings.on_embedding_error
        self._utterances = utterances
        self._owners = np.asarray(owners, dtype=np.intp)
        self._index: _Index | None = None
        self._building: asyncio.Future[_Index] | None = None

    # -- ownership -------------------------------------------------------------------------

    def owned_clients(self) -> Iterable[ChatClient]:
        return [route.client for route in (*self.routes, self.default)]

    async def aclose(self) -> None:
        closing_generator = not self._closed and not self.leave_open
        try:
            await super().aclose()
        finally:
            if closing_generator:
                await self.generator.aclose()

    def describe_layer(self) -> str:
        names = ", ".join(r.name for r in self.routes)
        return f"SemanticRoutingChatClient({names}; default {self.default.name})"

    # -- the index -------------------------------------------------------------------------

    async def _ensure_index(self) -> _Index:
        if self._index is not None:
            return self._index
        if self._building is None:
            # One build for every concurrent first request; shielded so a caller that is
            # cancelled does not cancel the build the others wait for.
            self._building = asyncio.ensure_future(self._build())
        building = self._building
        try:
            return await asyncio.shield(building)
        except BaseException:
            failed = building.done() and not building.cancelled() and building.exception()
            if failed and self._building is building:
                self._building = None  # the next request tries again
            raise

    async def _build(self) -> _Index:
        vectors = await self.generator.generate(list(self._utterances))
        matrix = self._check(vectors, len(self._utterances), None, "profile utterances")
        norms = np.linalg.norm(matrix, axis=1)
        if not np.all(norms > 0):
            bad = int(np.argmin(norms))
            raise RoutingError(f"the embedding of profile utterance {bad} is the zero vector")
        index = _Index((matrix / norms[:, None]).astype(np.float32, copy=False))
        self._index = index
        return index

    @staticmethod
    def _check(
        vectors: object, count: int, dimensions: int | None, what: str
    ) -> npt.NDArray[np.float32]:
        array = np.asarray(vectors, dtype=np.float32)
        if array.ndim != 2 or array.shape[0] != count:
            raise RoutingError(
                f"embedding {what}: expected {count} vectors, got an array of shape {array.shape}"
            )
        if dimensions is not None and array.shape[1] != dimensions:
            raise RoutingError(
                f"embedding {what}: expected dimension {dimensions}, got {array.shape[1]}"
            )
        if not np.all(np.isfinite(array)):
            raise RoutingError(f"embedding {what}: the vectors contain NaN or infinity")
        return array

    # -- scoring ---------------------------------------------------------------------------

    def _scores(self, index: _Index, query: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
        """Aggregated score per route (-inf for routes with no utterance in the top k)."""
        similarities = index.similarities(query)
        routes = len(self.routes)
        if self.top_k == 1:
            best = int(np.argmax(similarities))
            scores = np.full(routes, -np.inf)
            scores[self._owners[best]] = float(similarities[best])
            return scores
        if self.top_k < similarities.shape[0]:
            top = np.argpartition(-similarities, self.top_k - 1)[: self.top_k]
        else:
            top = np.arange(similarities.shape[0])
        owners = self._owners[top]
        values = similarities[top].astype(np.float64)
        if self.aggregation == "max":
            scores = np.full(routes, -np.inf)
            np.maximum.at(scores, owners, values)
            return scores
        sums = np.bincount(owners, weights=values, minlength=routes)
        counts = np.bincount(owners, minlength=routes)
        if self.aggregation == "sum":
            return np.where(counts > 0, sums, -np.inf)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(counts > 0, sums / np.maximum(counts, 1), -np.inf)

    async def _embed_query(self, text: str, dimensions: int) -> npt.NDArray[np.float32] | str:
        """The unit query vector, or the reason it could not be had."""
        try:
            if self.embedding_timeout is None:
                raw = await self.generator.generate([text])
            else:
                async with asyncio.timeout(self.embedding_timeout):
                    raw = await self.generator.generate([text])
        except TimeoutError:
            if self.on_embedding_error == "raise":
                raise
            return "embedding_timeout"
        except Exception:
            if self.on_embedding_error == "raise":
                raise
            return "embedding_error"
        vector = self._check(raw, 1, dimensions, "of the query")[0]
        norm = float(np.linalg.norm(vector))
        if norm == 0.0:
            if self.on_embedding_error == "raise":
                raise RoutingError("the embedding of the query is the zero vector")
            return "zero_query_vector"
        unit: npt.NDArray[np.float32] = (vector / norm).astype(np.float32, copy=False)
        return unit

    def _rank(self, scores: npt.NDArray[np.float64]) -> list[RouteScore]:
        order = np.argsort(-scores, kind="stable")
        return [
            RouteScore(self.routes[i].name, float(scores[i]))
            for i in order
            if math.isfinite(scores[i])
        ]

    async def explain(self, query: str) -> list[RouteScore]:
        """The routes ranked by aggregated score for `query` (routes with no utterance among
        the top k are left out). For debugging; does not call any route."""
        index = await self._ensure_index()
        vector = await self._embed_query(query, index.dimensions)
        if isinstance(vector, str):
            raise RoutingError(f"the query could not be embedded ({vector})")
        return self._rank(self._scores(index, vector))

    async def select_client(self, context: RoutingContext) -> SelectionResult:
        text = _last_user_text(context.messages)
        if not text.strip():
            return RoutingSelection(self.default, attributes={SEMANTIC_REASON: "no_user_text"})
        index = await self._ensure_index()
        vector = await self._embed_query(text, index.dimensions)
        if isinstance(vector, str):
            return RoutingSelection(self.default, attributes={SEMANTIC_REASON: vector})
        if index.size * index.dimensions > OFF_LOOP_ELEMENTS:
            # A product this large would hold the event loop for milliseconds: score in a
            # worker thread (numpy releases the GIL) so other requests keep flowing.
            scores = await asyncio.to_thread(self._scores, index, vector)
        else:
            scores = self._scores(index, vector)
        best = int(np.argmax(scores))
        score = float(scores[best])
        if score < self.threshold:
            return RoutingSelection(
                self.default, attributes={SEMANTIC_REASON: "below_threshold", SEMANTIC_SCORE: score}
            )
        return RoutingSelection(
            self.routes[best], attributes={SEMANTIC_REASON: "match", SEMANTIC_SCORE: score}
        )
