"""Session affinity: a session keeps the route that last served it, while that route is healthy.

A store that is slow, down or broken never fails a request nor delays it past the store's
`timeout`: the request is routed as if its session were new.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Protocol, TypeVar, runtime_checkable

from pydantic import Field

from pipeline import _redis, _scope
from pipeline._settings import Settings
from pipeline.errors import RedisUnavailable

__all__ = [
    "AffinitySettings",
    "AffinityStore",
    "MemoryAffinityStore",
    "RedisAffinityStore",
    "SessionAffinity",
]

_logger = logging.getLogger("chat_pipeline.routing.affinity")

_T = TypeVar("_T")

# What a request does while its store is unavailable (the end of each warning).
_FALLBACK = "routing without it"


@runtime_checkable
class AffinityStore(Protocol):
    """Where the route of each session is kept."""

    async def get(self, session_id: str) -> str | None:
        """The route recorded for `session_id`, or `None` (unknown or expired)."""
        ...

    async def set(self, session_id: str, route_name: str) -> None: ...


class AffinitySettings(Settings):
    """`ttl`: seconds a session's route is kept after its last request; `max_sessions`:
    the memory store's bound; `timeout`: seconds a shared store may take before the
    request goes on without it; `retry_interval`: seconds a store that failed is skipped
    before it is tried again."""

    ttl: Annotated[float, Field(gt=0)] = 3600.0
    """Seconds a session's route is kept after its last request."""
    max_sessions: Annotated[int, Field(ge=1)] = 10_000
    """Sessions the memory store keeps (the least recently used go first)."""
    timeout: Annotated[float, Field(gt=0)] = 0.25
    """Seconds a store call may take before the request goes on without affinity."""
    retry_interval: Annotated[float, Field(ge=0, le=3600)] = 1.0
    """Seconds a store that failed is skipped before it is tried again."""


class MemoryAffinityStore:
    """Sessions of this process: at most `max_sessions` (least recently used first out),
    each forgotten `ttl` seconds after it was last recorded. `clock` is injectable."""

    def __init__(
        self,
        max_sessions: int = 10_000,
        ttl: float = 3600.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = AffinitySettings(max_sessions=max_sessions, ttl=ttl)
        self._clock = clock
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()

    async def get(self, session_id: str) -> str | None:
        entry = self._sessions.get(session_id)
        if entry is None:
            return None
        route_name, expires = entry
        if self._clock() >= expires:
            del self._sessions[session_id]
            return None
        self._sessions.move_to_end(session_id)
        return route_name

    async def set(self, session_id: str, route_name: str) -> None:
        self._sessions[session_id] = (route_name, self._clock() + self.settings.ttl)
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.settings.max_sessions:
            self._sessions.popitem(last=False)

    def __len__(self) -> int:
        return len(self._sessions)


class RedisAffinityStore:
    """Sessions shared by every replica through Redis (a URL or a ``redis.asyncio``
    client; see `pipeline._redis` for the connection pool): one key per session under
    `namespace`, expiring `ttl` seconds after its last record. The lookups of one turn of
    the event loop are one ``MGET``, its records one pipelined round trip, so a thousand
    requests at once cost Redis two calls, not two thousand. Each call gives up after
    `timeout` seconds; errors and timeouts are logged (when an outage starts, then at most
    once a minute) and treated as "no affinity", never raised; after one, Redis is skipped
    for `retry_interval` seconds."""

    def __init__(
        self,
        redis: Any,
        ttl: float = 3600.0,
        *,
        namespace: str = "chat_pipeline:affinity",
        timeout: float = 0.25,
        retry_interval: float = 1.0,
    ) -> None:
        self.settings = AffinitySettings(ttl=ttl, timeout=timeout, retry_interval=retry_interval)
        try:
            self._redis = _redis.RedisClient(redis, timeout=timeout)
        except ValueError as exc:
            raise ValueError(f"redis: {exc}") from None
        self.namespace = namespace
        self._outage = _redis.Outage(
            _logger, "session affinity store: Redis", _FALLBACK, retry_interval
        )
        # The lookups and the records of one turn of the event loop: one call each.
        self._lookups = _redis.Batched(self._look_up)
        self._records = _redis.Batched(self._record)

    async def get(self, session_id: str) -> str | None:
        routes, index, _ = await self._lookups.add(f"{self.namespace}:{session_id}")
        raw = routes[index] if routes is not None else None
        if raw is None:
            return None
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    async def _look_up(self, keys: list[str]) -> list[Any] | None:
        try:
            return list(await self._redis.attempt(self._outage, lambda client: client.mget(keys)))
        except RedisUnavailable:
            return None

    async def set(self, session_id: str, route_name: str) -> None:
        await self._records.add((f"{self.namespace}:{session_id}", route_name))

    async def _record(self, records: list[tuple[str, str]]) -> None:
        ttl_ms = max(1, round(self.settings.ttl * 1000))

        async def write(client: Any) -> None:
            async with client.pipeline(transaction=False) as pipe:
                for key, route_name in records:
                    pipe.set(key, route_name, px=ttl_ms)
                await pipe.execute()

        with contextlib.suppress(RedisUnavailable):  # logged; the next record may land
            await self._redis.attempt(self._outage, write)

    async def aclose(self) -> None:
        """Close the client made from a URL (a client of your own stays open)."""
        await self._lookups.aclose()
        await self._records.aclose()
        await self._redis.aclose()


class SessionAffinity:
    """The affinity a failover router keeps (see the module docstring).

    Every call into `store` is bounded and guarded. The built-in stores bring their own
    bounds (the memory store never waits; the Redis store has its `timeout` and
    `retry_interval`); any other store's calls are bounded by `timeout` seconds, and after
    one fails (raises, or runs out of time) the store is skipped for `retry_interval`
    seconds. Every call also ends by the request's deadline: the `budget` a router passes,
    else the current one.
    """

    def __init__(
        self,
        store: AffinityStore | None = None,
        *,
        timeout: float = 0.25,
        retry_interval: float = 1.0,
    ) -> None:
        if store is not None and not isinstance(store, AffinityStore):
            raise TypeError("store must have async get(session_id) and set(session_id, route)")
        self.settings = AffinitySettings(timeout=timeout, retry_interval=retry_interval)
        self.store: AffinityStore = store if store is not None else MemoryAffinityStore()
        kind = type(self.store)
        # The memory store never waits: a bound would only cost time.
        self._direct = kind is MemoryAffinityStore
        # The Redis store bounds and guards itself; only the request's deadline is added.
        self._bounded: float | None = None if kind is RedisAffinityStore else timeout
        self._outage = _redis.Outage(_logger, "session affinity store", _FALLBACK, retry_interval)

    async def preferred(
        self, session_id: str, budget: _scope.RequestBudget | None = None
    ) -> str | None:
        """The route recorded for the session, or ``None`` (unknown, or the store failed
        or ran out of time). `budget`: the request's (default: the current one)."""
        if self._direct:
            return await self.store.get(session_id)
        route = await self._guarded(lambda: self.store.get(session_id), budget)
        return route if isinstance(route, str) else None

    async def record(
        self, session_id: str, route_name: str, budget: _scope.RequestBudget | None = None
    ) -> None:
        """Record the route that served the session (a failure is logged, never raised)."""
        if self._direct:
            await self.store.set(session_id, route_name)
            return
        await self._guarded(lambda: self.store.set(session_id, route_name), budget)

    async def _guarded(
        self, call: Callable[[], Awaitable[_T]], budget: _scope.RequestBudget | None
    ) -> _T | None:
        """`call()` within the bound (store timeout, request deadline); ``None`` when the
        store is being skipped, fails or runs out of time."""
        bound = self._bounded
        budget = budget if budget is not None else _scope.current_budget()
        remaining = budget.remaining() if budget is not None else None
        by_request = remaining is not None and (bound is None or remaining < bound)
        if by_request:
            bound = remaining
        return await self._outage.guard(call, bound, bound_by_request=by_request)

    async def aclose(self) -> None:
        close = getattr(self.store, "aclose", None)
        if close is not None:
            await close()

    def __repr__(self) -> str:
        return f"SessionAffinity({type(self.store).__name__})"
