"""`RedisHealthStore`: route health shared by replicas, never on a request's path.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from middleware.routing.health import HealthStore, RouteHealth, _Signals
from pipeline import _redis
from pipeline.errors import RedisUnavailable

__all__ = ["RedisHealthStore"]

_logger = logging.getLogger("chat_pipeline.routing.health")

# KEYS[1]: the cooldown key; ARGV[1]: its end (ms since the epoch), ARGV[2]: its length (ms).
_COOL = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) > current then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
return 1
"""


class RedisHealthStore(HealthStore):
    """Shares route health through Redis (see the module docstring).

    `redis` is a ``redis://`` URL or a ``redis.asyncio`` client (yours: left open). Routers
    of every replica that use the same `namespace` and route names share health.
    """

    def __init__(
        self,
        redis: Any,
        *,
        namespace: str = "chat_pipeline:health",
        sync_interval: float = 0.5,
        timeout: float = 0.25,
        retry_interval: float = 1.0,
        ttl: float = 30.0,
        replica: str | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        for name, value in (
            ("sync_interval", sync_interval),
            ("timeout", timeout),
            ("retry_interval", retry_interval),
            ("ttl", ttl),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (0 < value < math.inf)
            ):
                raise ValueError(f"RedisHealthStore: {name} must be a positive number of seconds")
        if not isinstance(namespace, str) or not namespace:
            raise ValueError("RedisHealthStore: namespace must be a non-empty string")
        self._shared = _redis.RedisClient(redis, timeout=timeout)
        self.namespace = namespace
        self.sync_interval = float(sync_interval)
        self.ttl = float(ttl)
        self.replica = replica or uuid.uuid4().hex[:16]
        self._wall = wall_clock
        self._outage = _redis.Outage(
            _logger,
            "route health store",
            "routing on this replica's own route health",
            float(retry_interval),
        )
        # The ends (wall-clock ms) of the cooldowns this replica started, while they run.
        self._cooling: dict[str, int] = {}
        self._attached: dict[int, RouteHealth] = {}
        self._last_sync: dict[int, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"RedisHealthStore(namespace={self.namespace!r}, replica={self.replica!r})"

    def _key(self, route: str) -> str:
        return f"{self.namespace}:{{{route}}}"

    # -- HealthStore -------------------------------------------------------------------------

    def attach(self, health: RouteHealth) -> None:
        self._attached[id(health)] = health

    def touched(self, health: RouteHealth, now: float) -> None:
        last = self._last_sync.get(id(health), -math.inf)
        if now - last < self.sync_interval:
            return
        self._last_sync[id(health)] = now
        self._spawn(self.sync(health))

    def cooled(self, health: RouteHealth, route: str, until: float, now: float) -> None:
        seconds = until - now
        if seconds <= 0:
            return
        end = int((self._wall() + seconds) * 1000)
        if end > self._cooling.get(route, 0):
            self._cooling[route] = end
        self._spawn(self._write_cooldown(route, end, max(1, int(seconds * 1000))))

    async def detach(self, health: RouteHealth) -> None:
        self._attached.pop(id(health), None)
        self._last_sync.pop(id(health), None)
        if self._attached:
            return
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel the syncs under way and close the client made here."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                if (current := asyncio.current_task()) is not None and current.cancelling():
                    raise
        await self._shared.aclose()

    # -- the work, in the background -----------------------------------------------------------

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write_cooldown(self, route: str, end_ms: int, length_ms: int) -> None:
        key = f"{self._key(route)}:cooldown"
        # On failure the outage is logged; this replica keeps its own cooldown.
        with contextlib.suppress(RedisUnavailable):
            await self._shared.attempt(
                self._outage,
                lambda client: self._shared.evaluate(client, _COOL, [key], [end_ms, length_ms]),
            )

    async def sync(self, health: RouteHealth) -> bool:
        """Publish `health`'s routes and read the other replicas' (one round trip);
        whether Redis answered. Called in the background by `touched`; tests call it."""
        now = health._clock()
        wall_ms = int(self._wall() * 1000)
        routes = list(health._routes.items())
        if not routes:
            return True
        ttl_ms = int(self.ttl * 1000)
        writes: list[tuple[str, str]] = []
        for name, signals in routes:
            health._decay_outcomes(signals, now)
            peak = health._own_latency(signals, now)
            typical = health._own_latency(signals, now, typical=True)
            writes.append(
                (
                    name,
                    ",".join(
                        (
                            "" if peak is None else repr(peak),
                            "" if typical is None else repr(typical),
                            repr(signals.failures),
                            repr(signals.attempts),
                            str(wall_ms),
                        )
                    ),
                )
            )

        async def exchange(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name, value in writes:
                key = self._key(name)
                pipe.hset(key, self.replica, value)
                pipe.pexpire(key, ttl_ms)
                pipe.hgetall(key)
                pipe.get(f"{key}:cooldown")
            result: list[Any] = await pipe.execute()
            return result

        try:
            replies = await self._shared.attempt(self._outage, exchange)
        except RedisUnavailable:
            return False
        now = health._clock()
        wall = self._wall()
        for index, (name, signals) in enumerate(routes):
            fields, cooldown = replies[4 * index + 2], replies[4 * index + 3]
            self._merge(health, signals, fields, cooldown, now, wall)
            await self._republish(name, cooldown, int(wall * 1000))
        return True

    async def _republish(self, route: str, stored: Any, wall_ms: int) -> None:
        """Write this replica's cooldown of `route` again when Redis holds a shorter one, or
        none (`stored`, what the sync read): its first write failed, or Redis restarted."""
        end = self._cooling.get(route)
        if end is None:
            return
        if end <= wall_ms:
            del self._cooling[route]
            return
        try:
            held = int(_text(stored)) if stored is not None else 0
        except (ValueError, UnicodeDecodeError):
            held = 0  # nonsense: ours replaces it
        if held < end:
            await self._write_cooldown(route, end, end - wall_ms)

    def _merge(
        self,
        health: RouteHealth,
        signals: _Signals,
        fields: Any,
        cooldown: Any,
        now: float,
        wall: float,
    ) -> None:
        peak: float | None = None
        typical: float | None = None
        failures = attempts = 0.0
        decay = health.settings.failure_decay
        for replica, value in (fields or {}).items():
            if _text(replica) == self.replica:
                continue
            try:
                their_peak, their_typical, their_failures, their_attempts, stamp = _text(
                    value
                ).split(",")
                age = wall - int(stamp) / 1000
                if age > self.ttl:
                    continue
                weight = math.exp(-max(0.0, age) / decay)
                failures += max(0.0, float(their_failures)) * weight
                attempts += max(0.0, float(their_attempts)) * weight
                peak = _slowest(peak, their_peak)
                typical = _slowest(typical, their_typical)
            except (ValueError, TypeError, UnicodeDecodeError):
                continue  # another version's or a damaged field: not ours to trust
        signals.shared = (peak, typical, failures, attempts) if (peak or attempts) else None
        if cooldown is not None:
            try:
                end = int(_text(cooldown)) / 1000
            except (ValueError, TypeError, UnicodeDecodeError):
                return
            settings = health.settings
            left = min(end - wall, max(settings.max_cooldown, settings.quota_cooldown))
            if left > 0 and now + left > signals.cooldown_until:
                signals.cooldown_until = now + left


def _slowest(known: float | None, text: str) -> float | None:
    """The slower of `known` and the latency `text` (empty: none); `ValueError` if bad."""
    if not text:
        return known
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError("not a latency")
    return value if known is None else max(known, value)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
