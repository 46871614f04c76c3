"""`SemanticRoutingChatClient`: pick the route whose example utterances best match the query.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import logging
import math
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from middleware.routing._semantic_fit import (
    FitReport,
    LinearHead,
    RoutingMetrics,
    fit_thresholds,
    stratified_split,
    train_head,
)
from middleware.routing._semantic_settings import Aggregation, SemanticSettings
from middleware.routing.context import (
    Route,
    RoutingContext,
    RoutingSelection,
    SelectionResult,
    as_route,
)
from middleware.routing.router import RoutingChatClient, router_keywords
from pipeline import _vectors
from pipeline._semconv import SEMANTIC_REASON, SEMANTIC_SCORE
from pipeline._vectors import VectorIndex, VectorShapeError, unit_rows
from pipeline.client import ChatClient, EmbeddingGenerator
from pipeline.errors import RoutingError, SemanticIndexError
from pipeline.types import ChatMessage, ChatRole

__all__ = [
    "SEMANTIC_REASON",
    "SEMANTIC_SCORE",
    "Aggregation",
    "FitReport",
    "RouteDecision",
    "RouteProfile",
    "RouteScore",
    "RoutingMetrics",
    "SemanticRoutingChatClient",
    "SemanticSettings",
]

logger = logging.getLogger(__name__)

OFF_LOOP_ELEMENTS = 1 << 22
"""Above this many matrix elements (about 11,000 utterances of 384 dimensions) a query is
scored in a worker thread instead of on the event loop."""

INDEX_FORMAT = "chat-pipeline-semantic-index"
INDEX_VERSION = 1
PROBES = (
    "Where can I see the invoice for last month?",
    "The build fails with a segmentation fault.",
    "Recommend a quiet hotel near the old town.",
)
"""Texts embedded when an index is saved and again when it is loaded: the same embedder
gives the same vectors (cosine at least `PROBE_AGREEMENT`), another one does not."""
PROBE_AGREEMENT = 0.999

Example: TypeAlias = tuple[str, str | None]
"""A labelled utterance for `fit`: its text and the route it belongs to (None: no route)."""


@dataclass(frozen=True, slots=True)
class RouteScore:
    """One route's score for a query. `in_top_k` is False for a route none of whose
    utterances is among the `top_k` best: its score is then its best single utterance's
    similarity, below every route that had one there."""

    route_name: str
    score: float
    in_top_k: bool = True


@dataclass(frozen=True, slots=True, init=False)
class RouteProfile:
    """A route's example utterances and, optionally, its own `threshold` (instead of the
    router's): the value of a profiles mapping, where a plain list of utterances also does."""

    utterances: tuple[str, ...]
    threshold: float | None = None

    def __init__(self, utterances: Sequence[str], *, threshold: float | None = None) -> None:
        if isinstance(utterances, str) or not isinstance(utterances, Sequence):
            raise TypeError("RouteProfile utterances must be a list of strings")
        if threshold is not None and (
            isinstance(threshold, bool)
            or not isinstance(threshold, int | float)
            or not math.isfinite(threshold)
        ):
            raise TypeError(f"RouteProfile threshold must be a finite number, got {threshold!r}")
        object.__setattr__(self, "utterances", tuple(utterances))
        object.__setattr__(self, "threshold", None if threshold is None else float(threshold))


class RouteDecision:
    """What the router decided for one query, without calling any route.

    `route`: the chosen route, or None (the router would use its default). `score`: the best
    route's score (a similarity, or a probability with a fitted head), None when there was
    nothing to score. `candidate`: that best route's name, chosen or not. `threshold`: what
    its score was compared with. `reason`: ``match``, ``below_threshold``, ``out_of_scope``
    (the head's own class won), ``no_user_text``, ``embedding_error``, ``embedding_timeout``
    or ``zero_query_vector``. `scores`: every route's `RouteScore`, best first (computed
    when first read).
    """

    __slots__ = ("_ranking", "_scores", "candidate", "reason", "route", "score", "threshold")

    def __init__(
        self,
        route: Route | None,
        reason: str,
        *,
        score: float | None = None,
        candidate: str | None = None,
        threshold: float | None = None,
        ranking: Callable[[], tuple[RouteScore, ...]] | None = None,
    ) -> None:
        self.route = route
        self.reason = reason
        self.score = score
        self.candidate = candidate
        self.threshold = threshold
        self._ranking = ranking
        self._scores: tuple[RouteScore, ...] | None = None

    @property
    def route_name(self) -> str | None:
        return None if self.route is None else self.route.name

    @property
    def scores(self) -> tuple[RouteScore, ...]:
        if self._scores is None:
            self._scores = () if self._ranking is None else self._ranking()
        return self._scores

    def __repr__(self) -> str:
        return (
            f"RouteDecision(route={self.route_name!r}, reason={self.reason!r}, "
            f"score={self.score!r}, candidate={self.candidate!r}, threshold={self.threshold!r})"
        )


@dataclass(frozen=True, slots=True, eq=False)
class _Snapshot:
    """The router's routes, utterances and index at one moment: replaced whole, never
    changed, so a request that took it routes on one consistent picture."""

    routes: tuple[Route, ...]
    profiles: tuple[RouteProfile, ...]
    index: VectorIndex | None = None
    head: LinearHead | None = None
    # Derived: utterances route after route, their owners and each route's first row.
    utterances: tuple[str, ...] = field(init=False)
    owners: npt.NDArray[np.intp] = field(init=False)
    starts: npt.NDArray[np.intp] = field(init=False)
    explicit: npt.NDArray[np.float64] = field(init=False)

    def __post_init__(self) -> None:
        utterances = [u for p in self.profiles for u in p.utterances]
        counts = [len(p.utterances) for p in self.profiles]
        object.__setattr__(self, "utterances", tuple(utterances))
        object.__setattr__(self, "owners", np.repeat(np.arange(len(counts), dtype=np.intp), counts))
        object.__setattr__(
            self, "starts", np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.intp)
        )
        object.__setattr__(
            self,
            "explicit",
            np.asarray(
                [np.nan if p.threshold is None else p.threshold for p in self.profiles],
                dtype=np.float64,
            ),
        )

    def with_(self, **changes: Any) -> _Snapshot:
        return dataclasses.replace(self, **changes)

    def position(self, name: str) -> int:
        for i, route in enumerate(self.routes):
            if route.name == name:
                return i
        raise KeyError(name)


def _last_user_text(messages: Sequence[ChatMessage]) -> str:
    for message in reversed(messages):
        if message.role is ChatRole.USER:
            return message.text
    return ""


def _is_async_callable(value: object) -> bool:
    return inspect.iscoroutinefunction(value) or inspect.iscoroutinefunction(
        getattr(value, "__call__", None)  # noqa: B004 - an object whose __call__ is async
    )


def as_embedding_generator(embedder: object) -> EmbeddingGenerator:
    """`embedder` as an `EmbeddingGenerator`: an async one as it is; a synchronous
    ``generate`` or an ``encode`` (a sentence-transformers model) wrapped in a
    `LocalEmbeddingGenerator`; anything else is a `TypeError` (now, not on a request)."""
    generate = getattr(embedder, "generate", None)
    if callable(generate):
        if _is_async_callable(generate):
            if not callable(getattr(embedder, "aclose", None)):
                raise TypeError("embedding_generator must have async generate(values) and aclose()")
            return embedder  # type: ignore[return-value]
        from pipeline.providers.local import LocalEmbeddingGenerator

        return LocalEmbeddingGenerator.wrapping(embedder)
    if callable(getattr(embedder, "encode", None)):
        from pipeline.providers.local import LocalEmbeddingGenerator

        return LocalEmbeddingGenerator(embedder)  # type: ignore[arg-type]
    raise TypeError(
        "embedding_generator must have async generate(values) and aclose(), a synchronous "
        "generate(values) -> array, or encode(list[str]) -> array (a sentence-transformers "
        f"model); got {type(embedder).__name__}"
    )


def embedder_identity(generator: object) -> str:
    """What a saved index records as the embedder: its `identity` attribute, else its class."""
    identity = getattr(generator, "identity", None)
    if isinstance(identity, str) and identity:
        return identity
    return f"{type(generator).__module__}.{type(generator).__qualname__}"


class SemanticRoutingChatClient(RoutingChatClient):
    """Routes each request by embedding similarity (see the module docstring).

    `profiles` maps each route (a `Route` or a client) to its utterances: a list of strings
    or a `RouteProfile` (utterances and the route's own threshold). Keyword `options` are
    the fields of `SemanticSettings` and the router keywords (see `RoutingChatClient`).
    """

    def __init__(
        self,
        embedding_generator: EmbeddingGenerator,
        profiles: Mapping[Route | ChatClient, Sequence[str] | RouteProfile],
        default: Route | ChatClient,
        settings: SemanticSettings | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**router_keywords(options))
        if not isinstance(profiles, Mapping) or not profiles:
            raise ValueError("profiles must be a non-empty mapping of route -> utterances")
        self.settings = SemanticSettings.from_options(settings, options)
        self.threshold = self.settings.threshold
        self.top_k = self.settings.top_k
        self.aggregation: Aggregation = self.settings.aggregation
        self.embedding_timeout = self.settings.embedding_timeout
        self.on_embedding_error = self.settings.on_embedding_error
        routes: list[Route] = []
        checked: list[RouteProfile] = []
        for position, (key, examples) in enumerate(profiles.items()):
            route = as_route(key, f"profiles key {position}")
            routes.append(route)
            checked.append(self._profile(route.name, examples))
        if len({r.name for r in routes}) != len(routes):
            raise ValueError("profile routes must have distinct names")
        total = sum(len(p.utterances) for p in checked)
        if self.top_k > total:
            raise ValueError(f"top_k ({self.top_k}) exceeds the number of utterances ({total})")
        self.generator = as_embedding_generator(embedding_generator)
        self.default = as_route(default, "default")
        self._snapshot = _Snapshot(tuple(routes), tuple(checked))
        self._building: asyncio.Future[_Snapshot] | None = None
        self._building_loop: asyncio.AbstractEventLoop | None = None
        self._changing: asyncio.Lock | None = None
        self._sync_lock = threading.Lock()

    def _profile(self, name: str, examples: object) -> RouteProfile:
        if isinstance(examples, RouteProfile):
            profile = examples
        elif isinstance(examples, str) or not isinstance(examples, Sequence):
            raise ValueError(f"profile {name!r} needs a non-empty list of utterances")
        else:
            profile = RouteProfile(examples)
        if not profile.utterances:
            raise ValueError(f"profile {name!r} needs a non-empty list of utterances")
        for index, utterance in enumerate(profile.utterances):
            if not isinstance(utterance, str) or not utterance.strip():
                raise ValueError(f"profile {name!r}: utterance {index} is blank")
        if profile.threshold is not None:
            reach = float(self.top_k) if self.aggregation == "sum" else 1.0
            if not -reach <= profile.threshold <= reach:
                raise ValueError(
                    f"profile {name!r}: threshold {profile.threshold} cannot be reached: "
                    f"{self.aggregation} of cosine scores lies in [{-reach:g}, {reach:g}]"
                )
        return profile

    # -- what it holds ---------------------------------------------------------------------

    @property
    def routes(self) -> tuple[Route, ...]:
        """The profile routes now (the default route is `default`)."""
        return self._snapshot.routes

    @property
    def profiles(self) -> dict[str, RouteProfile]:
        """Each route's profile now, by route name."""
        snapshot = self._snapshot
        return {r.name: p for r, p in zip(snapshot.routes, snapshot.profiles, strict=True)}

    @property
    def thresholds(self) -> dict[str, float]:
        """The similarity threshold each route's score is compared with now."""
        snapshot = self._snapshot
        return {
            r.name: self.threshold if p.threshold is None else p.threshold
            for r, p in zip(snapshot.routes, snapshot.profiles, strict=True)
        }

    @property
    def head(self) -> LinearHead | None:
        """The fitted linear head that decides, or None (similarity and thresholds decide)."""
        return self._snapshot.head

    @property
    def is_warm(self) -> bool:
        """Whether the index is built (no request will wait for the profiles' embedding)."""
        return self._snapshot.index is not None

    def owned_clients(self) -> Iterable[ChatClient]:
        return [route.client for route in (*self._snapshot.routes, self.default)]

    async def aclose(self) -> None:
        closing_generator = not self._closed and not self.leave_open
        try:
            await super().aclose()
        finally:
            if closing_generator:
                await self.generator.aclose()

    def describe_layer(self) -> str:
        names = ", ".join(r.name for r in self._snapshot.routes)
        return f"SemanticRoutingChatClient({names}; default {self.default.name})"

    # -- the index -------------------------------------------------------------------------

    async def warm(self) -> None:
        """Build the index now (embedding every profile utterance), so that no request waits
        for it; a local model given by name is loaded first. Returns at once when built."""
        warm_model = getattr(self.generator, "warm", None)
        if self._snapshot.index is None and _is_async_callable(warm_model):
            await warm_model()  # type: ignore[misc]
        await self._ensure_index()

    async def _ensure_index(self) -> _Snapshot:
        snapshot = self._snapshot
        if snapshot.index is not None:
            return snapshot
        loop = asyncio.get_running_loop()
        if self._building is None or self._building_loop is not loop:
            # One build for every concurrent first request; shielded so a caller that is
            # cancelled does not cancel the build the others wait for.
            self._building = asyncio.ensure_future(self._build())
            self._building_loop = loop
        building = self._building
        try:
            return await asyncio.shield(building)
        except BaseException:
            failed = building.done() and not building.cancelled() and building.exception()
            if failed and self._building is building:
                self._building = None  # the next request tries again
            raise

    async def _build(self) -> _Snapshot:
        snapshot = self._snapshot
        vectors = await self.generator.generate(list(snapshot.utterances))
        built = snapshot.with_(
            index=VectorIndex(
                self._unit(vectors, len(snapshot.utterances), None, "profile utterances")
            )
        )
        self._install(snapshot, built)
        return self._snapshot

    def _install(self, expected: _Snapshot, new: _Snapshot) -> None:
        """Swap in `new` if the router still holds `expected` (else a change won meanwhile:
        keep it; the build's vectors were for an older picture)."""
        with self._sync_lock:
            if self._snapshot is expected:
                self._snapshot = new

    @staticmethod
    def _unit(vectors: object, count: int, dimensions: int | None, what: str) -> _vectors.Matrix:
        item = "utterance" if "utterances" in what else "vector"
        try:
            return unit_rows(vectors, count, dimensions, f"embedding {what}", item)
        except VectorShapeError as exc:
            raise RoutingError(str(exc)) from None

    def _lock(self) -> asyncio.Lock:
        if self._changing is None:
            self._changing = asyncio.Lock()
        return self._changing

    async def _settled(self) -> _Snapshot:
        """The snapshot once any build under way has ended (a failed one leaves no index)."""
        if self._building is not None and self._snapshot.index is None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._building)
        return self._snapshot

    # -- live routes -----------------------------------------------------------------------

    async def add_route(
        self,
        route: Route | ChatClient,
        utterances: Sequence[str] | RouteProfile,
        *,
        threshold: float | None = None,
    ) -> None:
        """Add a route (embedding its utterances first, while requests keep routing on the
        index without it). The router owns its client from now on (closes it, unless
        ``leave_open``). A fitted head does not know the new route: it is dropped (fit again).
        """
        added = as_route(route, "route")
        profile = self._profile(added.name, utterances)
        if threshold is not None:
            profile = self._profile(
                added.name, RouteProfile(profile.utterances, threshold=threshold)
            )
        async with self._lock():
            snapshot = await self._settled()
            if any(r.name == added.name for r in snapshot.routes):
                raise ValueError(f"a route named {added.name!r} is already routed to")
            index = snapshot.index
            if index is not None:
                vectors = await self.generator.generate(list(profile.utterances))
                rows = self._unit(
                    vectors, len(profile.utterances), index.dimensions, f"route {added.name!r}"
                )
                index = VectorIndex(np.concatenate([index.matrix, rows], axis=0))
            if snapshot.head is not None:
                logger.warning(
                    "semantic router: the fitted head was dropped: it does not know the new "
                    "route %r (fit() again)",
                    added.name,
                )
            self._replace(
                snapshot.with_(
                    routes=(*snapshot.routes, added),
                    profiles=(*snapshot.profiles, profile),
                    index=index,
                    head=None,
                )
            )

    async def remove_route(self, route: Route | ChatClient | str) -> Route:
        """Remove a route and return it. Requests already routed to it finish there; its
        client is not closed (the caller may close it once they have). A fitted head keeps
        deciding among the routes left."""
        async with self._lock():
            snapshot = await self._settled()
            name = route if isinstance(route, str) else None
            found = [
                i
                for i, candidate in enumerate(snapshot.routes)
                if candidate.name == name or candidate is route or candidate.client is route
            ]
            if not found:
                raise KeyError(f"no route {name or route!r} to remove")
            i = found[0]
            if len(snapshot.routes) == 1:
                raise ValueError("the last profile route cannot be removed")
            left = len(snapshot.utterances) - len(snapshot.profiles[i].utterances)
            if self.top_k > left:
                raise ValueError(
                    f"removing {snapshot.routes[i].name!r} leaves {left} utterances, fewer than "
                    f"top_k ({self.top_k})"
                )
            index = snapshot.index
            if index is not None:
                start = int(snapshot.starts[i])
                stop = start + len(snapshot.profiles[i].utterances)
                index = VectorIndex(np.delete(index.matrix, np.s_[start:stop], axis=0))
            head = None if snapshot.head is None else snapshot.head.without(i)
            self._replace(
                snapshot.with_(
                    routes=snapshot.routes[:i] + snapshot.routes[i + 1 :],
                    profiles=snapshot.profiles[:i] + snapshot.profiles[i + 1 :],
                    index=index,
                    head=head,
                )
            )
            return snapshot.routes[i]

    def _replace(self, new: _Snapshot) -> None:
        with self._sync_lock:
            self._snapshot = new
            if new.index is None:
                self._building = None  # a build under way is for the old picture

    # -- scoring ---------------------------------------------------------------------------

    def _aggregate(
        self, snapshot: _Snapshot, similarities: _vectors.Matrix
    ) -> npt.NDArray[np.float64]:
        routes = len(snapshot.routes)
        owners = snapshot.owners
        if self.top_k == 1:
            best = int(np.argmax(similarities))
            scores = np.full(routes, -np.inf)
            scores[owners[best]] = float(similarities[best])
            return scores
        if self.top_k < similarities.shape[0]:
            top = np.argpartition(-similarities, self.top_k - 1)[: self.top_k]
        else:
            top = np.arange(similarities.shape[0])
        top_owners = owners[top]
        values = similarities[top].astype(np.float64)
        if self.aggregation == "max":
            scores = np.full(routes, -np.inf)
            np.maximum.at(scores, top_owners, values)
            return scores
        sums = np.bincount(top_owners, weights=values, minlength=routes)
        counts = np.bincount(top_owners, minlength=routes)
        if self.aggregation == "sum":
            return np.where(counts > 0, sums, -np.inf)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(counts > 0, sums / np.maximum(counts, 1), -np.inf)

    def _effective(self, snapshot: _Snapshot) -> npt.NDArray[np.float64]:
        return np.where(np.isnan(snapshot.explicit), self.threshold, snapshot.explicit)

    def _decide(
        self, snapshot: _Snapshot, query: _vectors.Matrix, *, ranked: bool
    ) -> RouteDecision:
        """The decision for the unit `query` on `snapshot` (which has an index)."""
        assert snapshot.index is not None
        head = snapshot.head
        if head is not None:
            probabilities = head.probabilities(query)
            routes_p = probabilities[:-1]
            best = int(np.argmax(routes_p))
            score = float(routes_p[best])
            limit = float(head.thresholds[best])
            ranking = (lambda: self._ranking(snapshot, routes_p, None)) if ranked else None
            if float(probabilities[-1]) > score:
                return RouteDecision(
                    None,
                    "out_of_scope",
                    score=score,
                    candidate=snapshot.routes[best].name,
                    threshold=limit,
                    ranking=ranking,
                )
        else:
            similarities = snapshot.index.similarities(query)
            if self.top_k == 1:
                # The single best utterance decides: no per-route array on the hot path (the
                # ranking, when read, is built from the similarities).
                row = int(np.argmax(similarities))
                best = int(snapshot.owners[row])
                score = float(similarities[row])
            else:
                aggregated = self._aggregate(snapshot, similarities)
                best = int(np.argmax(aggregated))
                score = float(aggregated[best])
            explicit = float(snapshot.explicit[best])
            limit = self.threshold if math.isnan(explicit) else explicit
            ranking = (
                (
                    lambda: self._ranking(
                        snapshot, self._aggregate(snapshot, similarities), similarities
                    )
                )
                if ranked
                else None
            )
        candidate = snapshot.routes[best]
        if score < limit:
            return RouteDecision(
                None,
                "below_threshold",
                score=score,
                candidate=candidate.name,
                threshold=limit,
                ranking=ranking,
            )
        return RouteDecision(
            candidate,
            "match",
            score=score,
            candidate=candidate.name,
            threshold=limit,
            ranking=ranking,
        )

    @staticmethod
    def _ranking(
        snapshot: _Snapshot,
        scores: npt.NDArray[np.float64],
        similarities: _vectors.Matrix | None,
    ) -> tuple[RouteScore, ...]:
        in_top = np.isfinite(scores)
        filled = scores.astype(np.float64, copy=True)
        if similarities is not None and not in_top.all():
            # A route with no utterance in the top k: its best utterance's similarity.
            best = np.maximum.reduceat(similarities, snapshot.starts).astype(np.float64)
            filled = np.where(in_top, filled, best)
        order = np.lexsort((-filled, ~in_top))
        return tuple(
            RouteScore(snapshot.routes[i].name, float(filled[i]), bool(in_top[i])) for i in order
        )

    async def _embed_query(self, text: str, dimensions: int) -> _vectors.Matrix | str:
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
        return self._query_vector(raw, dimensions)

    def _query_vector(self, raw: object, dimensions: int) -> _vectors.Matrix | str:
        try:
            unit: _vectors.Matrix = unit_rows(raw, 1, dimensions, "embedding of the query")[0]
        except VectorShapeError as exc:
            if exc.zero and self.on_embedding_error != "raise":
                return "zero_query_vector"
            raise RoutingError(str(exc)) from None
        return unit

    # -- deciding without calling a route ----------------------------------------------------

    async def route(self, text: str) -> RouteDecision:
        """Where `text` would be routed (builds the index if needed; embeds `text`)."""
        if not isinstance(text, str):
            raise TypeError("route() takes the query text (route_sync() also takes a vector)")
        if not text.strip():
            return RouteDecision(None, "no_user_text")
        snapshot = await self._ensure_index()
        assert snapshot.index is not None
        vector = await self._embed_query(text, snapshot.index.dimensions)
        if isinstance(vector, str):
            return RouteDecision(None, vector)
        return self._decide(self._current(snapshot), vector, ranked=True)

    def route_sync(self, query: str | npt.ArrayLike) -> RouteDecision:
        """`route`, blocking: for a query text the embedder must encode synchronously (a
        `LocalEmbeddingGenerator`, which the router makes of a sentence-transformers model);
        a query vector is routed as it is (no embedding at all). Builds the index first if
        needed (with a synchronous embedder); it blocks the calling thread meanwhile."""
        if isinstance(query, str):
            if not query.strip():
                return RouteDecision(None, "no_user_text")
            snapshot = self._built_sync()
            assert snapshot.index is not None
            raw = self._encode_sync([query])
            vector = self._query_vector(raw, snapshot.index.dimensions)
            if isinstance(vector, str):
                return RouteDecision(None, vector)
        else:
            snapshot = self._snapshot
            if snapshot.index is None:
                raise RoutingError(
                    "route_sync(vector) needs the index built: await router.warm() (or "
                    "load() a saved index) first"
                )
            vector = self._unit(
                np.asarray(query, dtype=np.float32).reshape(1, -1),
                1,
                snapshot.index.dimensions,
                "query vector",
            )[0]
        return self._decide(snapshot, vector, ranked=True)

    def _encode_sync(self, texts: list[str]) -> object:
        encode = getattr(self.generator, "encode", None)
        if not callable(encode):
            raise TypeError(
                f"route_sync(text) needs an embedder that encodes synchronously; "
                f"{type(self.generator).__name__} is async only: await route(text), or pass "
                "route_sync() the query's vector"
            )
        return encode(texts)

    def _built_sync(self) -> _Snapshot:
        snapshot = self._snapshot
        if snapshot.index is not None:
            return snapshot
        raw = self._encode_sync(list(snapshot.utterances))
        built = snapshot.with_(
            index=VectorIndex(self._unit(raw, len(snapshot.utterances), None, "profile utterances"))
        )
        self._install(snapshot, built)
        return self._snapshot if self._snapshot.index is not None else built

    def _current(self, fallback: _Snapshot) -> _Snapshot:
        """The latest snapshot with an index (a change may have landed while embedding)."""
        current = self._snapshot
        if (
            current.index is not None
            and fallback.index is not None
            and current.index.dimensions == fallback.index.dimensions
        ):
            return current
        return fallback

    async def explain(self, query: str) -> list[RouteScore]:
        """Every route ranked by score for `query` (see `RouteDecision.scores`). For
        debugging; does not call any route."""
        snapshot = await self._ensure_index()
        assert snapshot.index is not None
        vector = await self._embed_query(query, snapshot.index.dimensions)
        if isinstance(vector, str):
            raise RoutingError(f"the query could not be embedded ({vector})")
        return list(self._decide(self._current(snapshot), vector, ranked=True).scores)

    async def select_client(self, context: RoutingContext) -> SelectionResult:
        text = _last_user_text(context.messages)
        if not text.strip():
            return RoutingSelection(self.default, attributes={SEMANTIC_REASON: "no_user_text"})
        snapshot = await self._ensure_index()
        assert snapshot.index is not None
        vector = await self._embed_query(text, snapshot.index.dimensions)
        if isinstance(vector, str):
            return RoutingSelection(self.default, attributes={SEMANTIC_REASON: vector})
        snapshot = self._current(snapshot)
        assert snapshot.index is not None
        if snapshot.index.size * snapshot.index.dimensions > OFF_LOOP_ELEMENTS:
            # A product this large would hold the event loop for milliseconds: score in a
            # worker thread (numpy releases the GIL) so other requests keep flowing.
            decision = await asyncio.to_thread(self._decide, snapshot, vector, ranked=False)
        else:
            decision = self._decide(snapshot, vector, ranked=False)
        attributes: dict[str, str | float] = {SEMANTIC_REASON: decision.reason}
        if decision.score is not None:
            attributes[SEMANTIC_SCORE] = decision.score
        return RoutingSelection(decision.route or self.default, attributes=attributes)

    # -- fitting ---------------------------------------------------------------------------

    async def fit(
        self,
        examples: Iterable[Example],
        *,
        validation: float | Iterable[Example] | None = 0.2,
        head: bool = False,
        apply: bool = True,
        seed: int = 0,
    ) -> FitReport:
        """Fit per-route thresholds (and, with ``head=True``, a linear head over the
        embeddings with an out-of-scope class) from labelled utterances; return the
        validation report.

        `examples` are ``(text, route name)`` pairs, ``(text, None)`` for text that belongs
        to no route (needed: it is what thresholds reject). `validation`: the fraction of
        each label held out for the report (stratified, `seed`), a separate labelled set, or
        None (the report is then on the fitting examples themselves). An example equal to a
        profile utterance is scored without that utterance (no self-match). Too few
        examples is a `ValueError` saying how many are needed. With ``apply=False`` nothing
        changes: the report says what fitting would do.
        """
        snapshot = await self._ensure_index()
        assert snapshot.index is not None
        names = [r.name for r in snapshot.routes]
        fitting = self._labelled(examples, names, "examples")
        if isinstance(validation, bool):
            raise TypeError("validation must be a fraction, labelled examples or None")
        if validation is None:
            held: list[Example] = []
        elif isinstance(validation, float | int):
            if not 0 <= validation < 1:
                raise ValueError(f"validation must be a fraction in [0, 1), got {validation}")
            fitting, held = stratified_split(fitting, float(validation), seed)
        else:
            held = self._labelled(validation, names, "validation")
        minimum_route, minimum_out = (5, 10) if head else (2, 5)
        counts = {name: 0 for name in names}
        out_of_scope = 0
        for _, label in fitting:
            if label is None:
                out_of_scope += 1
            else:
                counts[label] += 1
        short = {n: c for n, c in counts.items() if c < minimum_route}
        if short or out_of_scope < minimum_out:
            parts = [f"{n!r} has {c}" for n, c in short.items()]
            if out_of_scope < minimum_out:
                parts.append(f"out of scope (label None) has {out_of_scope}")
            split = (
                ""
                if not isinstance(validation, float)
                else (f" after holding out {validation:g} of each label for validation")
            )
            raise ValueError(
                f"fit({'head=True' if head else ''}) needs at least {minimum_route} labelled "
                f"examples per route and {minimum_out} out-of-scope ones{split}; "
                + "; ".join(parts)
            )
        texts = [t for t, _ in fitting] + [t for t, _ in held]
        vectors = self._unit(
            await self.generator.generate(texts),
            len(texts),
            snapshot.index.dimensions,
            "fit examples",
        )
        fit_vectors, held_vectors = vectors[: len(fitting)], vectors[len(fitting) :]
        fit_labels = [label for _, label in fitting]
        held_labels = [label for _, label in held]
        report_vectors = held_vectors if held else fit_vectors
        report_labels = held_labels if held else fit_labels
        report_texts = [t for t, _ in (held or fitting)]
        before = RoutingMetrics.of(
            report_labels, self._predict_many(snapshot, report_vectors, report_texts), names
        )
        scores, candidates = self._best_many(snapshot, fit_vectors, [t for t, _ in fitting])
        thresholds = fit_thresholds(
            scores,
            candidates,
            fit_labels,
            names,
            self._effective(snapshot),
            reach=float(self.top_k) if self.aggregation == "sum" else 1.0,
        )
        profiles = tuple(
            RouteProfile(p.utterances, threshold=float(t))
            for p, t in zip(snapshot.profiles, thresholds, strict=True)
        )
        fitted = snapshot.with_(profiles=profiles, head=None)
        trained: LinearHead | None = None
        if head:
            trained = train_head(
                np.concatenate([fit_vectors, snapshot.index.matrix], axis=0),
                [*fit_labels, *(names[o] for o in snapshot.owners)],
                names,
                seed=seed,
            )
            fitted = fitted.with_(head=trained)
        after = RoutingMetrics.of(
            report_labels, self._predict_many(fitted, report_vectors, report_texts), names
        )
        if apply:
            async with self._lock():
                current = self._snapshot
                if current.routes != snapshot.routes or current.index is not snapshot.index:
                    raise RoutingError("the routes changed while fitting: fit() again")
                self._replace(fitted)
        return FitReport(
            mode="head" if head else "thresholds",
            thresholds=dict(zip(names, (float(t) for t in thresholds), strict=True)),
            head_thresholds=None
            if trained is None
            else dict(zip(names, (float(t) for t in trained.thresholds), strict=True)),
            before=before,
            after=after,
            fitted_examples=len(fitting),
            validation_examples=len(held),
            applied=apply,
        )

    @staticmethod
    def _labelled(examples: Iterable[Example], names: list[str], what: str) -> list[Example]:
        known = set(names)
        checked: list[Example] = []
        for position, item in enumerate(examples):
            if not isinstance(item, tuple | list) or len(item) != 2:
                raise TypeError(f"{what}[{position}] must be a (text, route name or None) pair")
            text, label = item
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{what}[{position}]: the text is blank or not a string")
            if label is not None and label not in known:
                raise ValueError(
                    f"{what}[{position}]: no route named {label!r} (routes: {sorted(known)})"
                )
            checked.append((text, label))
        return checked

    def _best_many(
        self, snapshot: _Snapshot, vectors: _vectors.Matrix, texts: Sequence[str]
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.intp]]:
        """Per example: the best route's aggregated score and position, leaving out the
        profile utterances equal to the example's text."""
        assert snapshot.index is not None
        rows = {u: [] for u in snapshot.utterances}  # type: dict[str, list[int]]
        for i, u in enumerate(snapshot.utterances):
            rows[u].append(i)
        similarities = vectors @ snapshot.index.matrix.T
        scores = np.empty(len(texts))
        best = np.empty(len(texts), dtype=np.intp)
        for i, text in enumerate(texts):
            row = similarities[i]
            same = rows.get(text)
            if same:
                row = row.copy()
                row[same] = -np.inf
            aggregated = self._aggregate(snapshot, row)
            best[i] = int(np.argmax(aggregated))
            scores[i] = float(aggregated[best[i]])
        return scores, best

    def _predict_many(
        self, snapshot: _Snapshot, vectors: _vectors.Matrix, texts: Sequence[str]
    ) -> list[str | None]:
        names = [r.name for r in snapshot.routes]
        if snapshot.head is not None:
            return snapshot.head.predict(vectors)
        scores, best = self._best_many(snapshot, vectors, texts)
        limits = self._effective(snapshot)
        return [names[b] if s >= limits[b] else None for s, b in zip(scores, best, strict=True)]

    # -- saving and loading the index ----------------------------------------------------------

    async def save(self, path: str | os.PathLike[str]) -> None:
        """Write the embedded index (vectors, utterances, thresholds, a fitted head, and the
        embedder's identity with the vectors of a few probe texts) to `path` (``.npz``),
        building it first if needed. The file is replaced atomically."""
        snapshot = await self._ensure_index()
        assert snapshot.index is not None
        probes = self._unit(
            await self.generator.generate(list(PROBES)),
            len(PROBES),
            snapshot.index.dimensions,
            "probe texts",
        )
        meta = {
            "format": INDEX_FORMAT,
            "version": INDEX_VERSION,
            "embedder": embedder_identity(self.generator),
            "dimensions": snapshot.index.dimensions,
            "routes": [
                {"name": r.name, "utterances": list(p.utterances), "threshold": p.threshold}
                for r, p in zip(snapshot.routes, snapshot.profiles, strict=True)
            ],
            "head": None if snapshot.head is None else list(snapshot.head.routes),
        }
        arrays: dict[str, npt.NDArray[Any]] = {
            "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
            "vectors": snapshot.index.matrix,
            "probes": probes,
        }
        if snapshot.head is not None:
            arrays["head_weights"] = snapshot.head.weights
            arrays["head_bias"] = snapshot.head.bias
            arrays["head_thresholds"] = snapshot.head.thresholds
        await asyncio.to_thread(_write_index, Path(path), arrays)

    async def load(self, path: str | os.PathLike[str], *, fitted: bool = True) -> int:
        """Use the index saved in `path` instead of embedding the profiles: its vector for
        every utterance it has; utterances it lacks are embedded now (the count is
        returned). With `fitted`, its thresholds (for routes of the same name) and its
        head (when it was fitted on exactly these routes) are used too.

        A file that is not such an index, or was made by another embedder (its identity,
        its dimension, or different vectors for the probe texts), raises
        `SemanticIndexError` and changes nothing.
        """
        where = os.fspath(path)
        try:
            arrays = await asyncio.to_thread(_read_index, where)
        except Exception as exc:  # empty, truncated, not a zip, one .npy, pickled objects
            raise SemanticIndexError(
                f"{where}: not a saved semantic index ({type(exc).__name__})"
            ) from None
        saved_index = _SavedIndex.read(arrays, where)
        meta, vectors, saved_probes = saved_index.meta, saved_index.vectors, saved_index.probes
        identity = embedder_identity(self.generator)
        if meta["embedder"] != identity:
            raise SemanticIndexError(
                f"{where} was made with embedder {meta['embedder']!r}; this router embeds "
                f"with {identity!r}: embed again (warm()) and save"
            )
        probes = self._unit(
            await self.generator.generate(list(PROBES)), len(PROBES), None, "probe texts"
        )
        saved_dimensions = saved_index.dimensions
        if probes.shape[1] != saved_dimensions:
            raise SemanticIndexError(
                f"{where} holds vectors of dimension {saved_dimensions}; this router's embedder "
                f"gives dimension {probes.shape[1]}"
            )
        agreement = np.sum(probes * saved_probes, axis=1)
        if not np.all(agreement >= PROBE_AGREEMENT):
            raise SemanticIndexError(
                f"{where}: the embedder {identity!r} gives other vectors than the one that "
                f"saved this index (probe similarity {float(np.min(agreement)):.4f}): a "
                "different model or version; embed again (warm()) and save"
            )
        saved: dict[str, int] = {}
        thresholds: dict[str, float | None] = {}
        row = 0
        for entry in meta["routes"]:
            thresholds[entry["name"]] = entry["threshold"]
            for utterance in entry["utterances"]:
                saved.setdefault(utterance, row)
                row += 1
        async with self._lock():
            snapshot = await self._settled()
            missing = [u for u in dict.fromkeys(snapshot.utterances) if u not in saved]
            extra = (
                self._unit(
                    await self.generator.generate(missing),
                    len(missing),
                    saved_dimensions,
                    "profile utterances",
                )
                if missing
                else np.zeros((0, saved_dimensions), dtype=np.float32)
            )
            fresh = {u: i for i, u in enumerate(missing)}
            matrix = np.empty((len(snapshot.utterances), saved_dimensions), dtype=np.float32)
            for i, utterance in enumerate(snapshot.utterances):
                matrix[i] = (
                    vectors[saved[utterance]] if utterance in saved else extra[fresh[utterance]]
                )
            profiles = snapshot.profiles
            head = None
            if fitted:
                profiles = tuple(
                    RouteProfile(p.utterances, threshold=thresholds[r.name])
                    if thresholds.get(r.name) is not None
                    else p
                    for r, p in zip(snapshot.routes, profiles, strict=True)
                )
                names = tuple(r.name for r in snapshot.routes)
                if saved_index.head is not None and saved_index.head.routes == names:
                    head = saved_index.head
            self._replace(snapshot.with_(profiles=profiles, index=VectorIndex(matrix), head=head))
            return len(missing)


def _write_index(target: Path, arrays: dict[str, npt.NDArray[Any]]) -> None:
    handle, temporary = tempfile.mkstemp(dir=target.parent, suffix=".npz.tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            np.savez(stream, **arrays)  # type: ignore[arg-type]
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _read_index(where: str) -> dict[str, npt.NDArray[Any]]:
    loaded = np.load(where, allow_pickle=False)
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError("not an .npz archive")
    with loaded as data:
        return {key: data[key] for key in data.files}


_UNIT_TOLERANCE = 1e-3
"""How far from 1 a saved vector's norm may be (float32 rounding is far smaller)."""


def _refused(where: str, what: str) -> SemanticIndexError:
    return SemanticIndexError(f"{where}: not a saved semantic index ({what})")


def _unit_matrix(value: Any, rows: int | None, dimensions: int, where: str, what: str) -> Any:
    """`value` as a float32 matrix of finite unit rows of `dimensions` (and `rows`), or
    `SemanticIndexError`."""
    if not isinstance(value, np.ndarray) or value.dtype.kind != "f" or value.ndim != 2:
        raise _refused(where, f"{what}: not a matrix of floats")
    if value.shape[1] != dimensions or (rows is not None and value.shape[0] != rows):
        raise _refused(where, f"{what}: of shape {value.shape}")
    matrix = value.astype(np.float32)
    if not np.all(np.isfinite(matrix)):
        raise _refused(where, f"{what}: NaN or infinity")
    if matrix.shape[0] and not np.all(
        np.abs(np.linalg.norm(matrix, axis=1) - 1.0) <= _UNIT_TOLERANCE
    ):
        raise _refused(where, f"{what}: vectors that are not of unit length")
    return matrix


def _finite_array(value: Any, shape: tuple[int, ...], where: str, what: str) -> Any:
    if not isinstance(value, np.ndarray) or value.dtype.kind != "f" or value.shape != shape:
        raise _refused(where, f"{what}: not floats of shape {shape}")
    if not np.all(np.isfinite(value)):
        raise _refused(where, f"{what}: NaN or infinity")
    return value


def _is_text_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(item) is str for item in value)


@dataclass(frozen=True, slots=True)
class _SavedIndex:
    """What a saved index holds, every part checked (types, shapes, finiteness, norms)
    before the router uses any of it: `read` raises `SemanticIndexError` otherwise."""

    meta: dict[str, Any]
    dimensions: int
    vectors: Any
    probes: Any
    head: LinearHead | None

    @classmethod
    def read(cls, arrays: dict[str, npt.NDArray[Any]], where: str) -> _SavedIndex:
        raw = arrays.get("meta")
        if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 1:
            raise _refused(where, "no metadata")
        try:
            meta = json.loads(raw.tobytes().decode())
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise _refused(where, "unreadable metadata") from None
        if not isinstance(meta, dict) or meta.get("format") != INDEX_FORMAT:
            raise _refused(where, "another format")
        if meta.get("version") != INDEX_VERSION:
            raise SemanticIndexError(
                f"{where}: index format version {meta.get('version')!r}; this version reads "
                f"{INDEX_VERSION}"
            )
        dimensions = meta.get("dimensions")
        if type(dimensions) is not int or dimensions < 1:
            raise _refused(where, "dimensions: not a positive integer")
        if type(meta.get("embedder")) is not str:
            raise _refused(where, "embedder: not a string")
        routes = meta.get("routes")
        if not isinstance(routes, list):
            raise _refused(where, "routes: not a list")
        count = 0
        for entry in routes:
            threshold = entry.get("threshold") if isinstance(entry, dict) else None
            if (
                not isinstance(entry, dict)
                or type(entry.get("name")) is not str
                or not _is_text_list(entry.get("utterances"))
                or not (
                    threshold is None
                    or (type(threshold) in (int, float) and math.isfinite(threshold))
                )
            ):
                raise _refused(where, "routes: an entry that is no route")
            count += len(entry["utterances"])
        vectors = _unit_matrix(arrays.get("vectors"), count, dimensions, where, "vectors")
        probes = _unit_matrix(arrays.get("probes"), len(PROBES), dimensions, where, "probes")
        names = meta.get("head")
        head = None
        if names is not None:
            if not _is_text_list(names) or not names:
                raise _refused(where, "head: not a list of route names")
            classes = len(names) + 1  # the routes, then out of scope
            head = LinearHead(
                tuple(names),
                _finite_array(
                    arrays.get("head_weights"), (dimensions, classes), where, "head weights"
                ).astype(np.float32),
                _finite_array(arrays.get("head_bias"), (classes,), where, "head bias").astype(
                    np.float32
                ),
                _finite_array(
                    arrays.get("head_thresholds"), (len(names),), where, "head thresholds"
                ).astype(np.float64),
            )
        return cls(meta, dimensions, vectors, probes, head)


Decision: TypeAlias = Literal[
    "match",
    "below_threshold",
    "out_of_scope",
    "no_user_text",
    "embedding_error",
    "embedding_timeout",
    "zero_query_vector",
]
"""The values of `RouteDecision.reason` (and of the span's
``chat_pipeline.route.semantic.reason``)."""
