"""Session affinity: a session keeps the route that last served it, while that route is healthy.

Switching routes every turn discards a provider's prompt cache, so a failover router with
``affinity=SessionAffinity(store)`` does this for requests whose options carry a
``session_id``:

* the request starts on the route that last completed for that session (the policy puts
  it first), unless the router no longer has that route or its circuit breaker is open;
* the route that completes the request is recorded for the session, so a failover moves
  the session to the backup (and an open breaker, by the rule above, too);
* nothing else: a failure, cancellation or abandoned stream records nothing.

Stores: `MemoryAffinityStore` (one process; bounded, least recently used first out, each
entry expiring after `ttl` seconds) and `RedisAffinityStore` (shared by every replica;
each entry expiring after `ttl`). A store that is slow or down never fails a request: the
lookup gives up after the store's timeout (the request then routes as if the session
were new) and a failed write is logged as a warning, without the session id's value.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Annotated, Any, Protocol, runtime_checkable

from pydantic import Field

from pipeline._settings import Settings

__all__ = [
    "AffinitySettings",
    "AffinityStore",
    "MemoryAffinityStore",
    "RedisAffinityStore",
    "SessionAffinity",
]

_logger = logging.getLogger("chat_pipeline.routing.affinity")


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
    request goes on without it."""

    ttl: Annotated[float, Field(gt=0)] = 3600.0
    max_sessions: Annotated[int, Field(ge=1)] = 10_000
    timeout: Annotated[float, Field(gt=0)] = 0.25


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
    """Sessions shared by every replica through Redis (``redis.asyncio``): one key per
    session under `namespace`, expiring `ttl` seconds after its last record. Each call
    gives up after `timeout` seconds; errors and timeouts are logged (rate-limited) and
    treated as "no affinity", never raised."""

    def __init__(
        self,
        redis: Any,
        ttl: float = 3600.0,
        *,
        namespace: str = "chat_pipeline:affinity",
        timeout: float = 0.25,
    ) -> None:
        self.settings = AffinitySettings(ttl=ttl, timeout=timeout)
        if isinstance(redis, str):
            import redis.asyncio as redis_asyncio

            try:
                redis = redis_asyncio.Redis.from_url(
                    redis, socket_timeout=timeout, socket_connect_timeout=timeout
                )
            except ValueError:
                raise ValueError("RedisAffinityStore: the Redis URL is malformed") from None
        self._redis = redis
        self.namespace = namespace
        self._last_warning = -1e9

    def _warn(self, what: str, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 10.0:  # at most one warning per 10 s
            self._last_warning = now
            _logger.warning(
                "session affinity store unavailable (%s failed: %s); routing without it",
                what,
                type(exc).__name__,
            )

    async def get(self, session_id: str) -> str | None:
        try:
            async with asyncio.timeout(self.settings.timeout):
                raw = await self._redis.get(f"{self.namespace}:{session_id}")
        except Exception as exc:  # a store that is down must not fail requests
            self._warn("lookup", exc)
            return None
        if raw is None:
            return None
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    async def set(self, session_id: str, route_name: str) -> None:
        try:
            async with asyncio.timeout(self.settings.timeout):
                await self._redis.set(
                    f"{self.namespace}:{session_id}",
                    route_name,
                    px=int(self.settings.ttl * 1000),
                )
        except Exception as exc:  # a store that is down must not fail requests
            self._warn("record", exc)

    async def aclose(self) -> None:
        await self._redis.aclose()


class SessionAffinity:
    """The affinity a failover router keeps (see the module docstring)."""

    def __init__(self, store: AffinityStore | None = None) -> None:
        if store is not None and not isinstance(store, AffinityStore):
            raise TypeError("store must have async get(session_id) and set(session_id, route)")
        self.store: AffinityStore = store if store is not None else MemoryAffinityStore()

    async def preferred(self, session_id: str) -> str | None:
        return await self.store.get(session_id)

    async def record(self, session_id: str, route_name: str) -> None:
        await self.store.set(session_id, route_name)

    async def aclose(self) -> None:
        close = getattr(self.store, "aclose", None)
        if close is not None:
            await close()

    def __repr__(self) -> str:
        return f"SessionAffinity({type(self.store).__name__})"
