"""The shared state behind a circuit breaker with ``redis=``: the facts every process using
the same breaker `name` must agree on, kept in Redis under
``chat_pipeline:breaker:{<name>}:...``. The layer (`middleware.breaker`) still runs
pybreaker's state machine in each process and reads and writes these facts around its
steps:

* ``:failures``: the consecutive counted failures of all processes together (each failure
  adds one; a success resets it when that call was admitted with a nonzero count, so a
  success racing a failure of another process errs towards opening early, never late);
* ``:opened``: when the circuit opened, in milliseconds since the epoch (sub-second; from
  the breaker's clock, so replicas' clocks should agree, as NTP keeps them); absent while
  closed. Transitions are compare-and-set scripts, so two processes tripping together
  agree on one opening, and a late probe result cannot undo a newer opening;
* ``:probe:<opening>``: the half-open probe's claim, taken with ``SET NX PX``: exactly one
  probe per opening across every process. It expires after `probe_claim_ttl` seconds, so
  a process that dies mid-probe does not keep the circuit open for ever; a probe the
  caller cancels gives it back at once.

Each process reads the facts once per call (one ``MGET``; calls that arrive while a read
is on the wire share its answer, so a burst of a thousand calls costs Redis one read) and
writes only on a counted failure (the failures of one turn of the event loop with one
``INCRBY``), a transition or a reset. Every method is bounded by
`redis_timeout` and never raises a Redis error: when Redis is unreachable, slow, or answers
nonsense, it answers "unavailable" (``None``), the layer goes on with this process's own
state, and Redis is skipped for `redis_retry_interval` seconds (`pipeline._redis.Outage`
warns when an outage starts, then at most once a minute).

A policy that needs more shared facts (outcomes in a sliding window, slow calls) adds its
keys to `read` (fields of `Facts`) and its own counting beside `count_failure`, in one
script; admission, probes and transitions stay as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from typing import Any, NamedTuple, TypeVar

import pybreaker

from pipeline import _redis

__all__ = ["Facts", "LocalStorage", "RedisBreakerState", "from_ms", "to_ms"]

_logger = logging.getLogger("chat_pipeline.breaker")

_T = TypeVar("_T")


class Facts(NamedTuple):
    """What Redis holds for one breaker: the opening (``None`` while closed) and the
    consecutive counted failures of every process."""

    opening: str | None
    failures: int


class LocalStorage(pybreaker.CircuitMemoryStorage):
    """This process's copy of a shared breaker's state: pybreaker's memory storage, whose
    failure count can be set to the shared one."""

    def set_counter(self, count: int) -> None:
        self._fail_counter = count


def to_ms(moment: datetime) -> str:
    """An opening as stored: milliseconds since the epoch, to the microsecond."""
    return f"{moment.timestamp() * 1000:.3f}"


def from_ms(value: str) -> datetime:
    """The moment a stored opening names (`ValueError` for nonsense)."""
    return datetime.fromtimestamp(float(value) / 1000, UTC)


# Compare-and-set of the opening: KEYS = opened, failures; ARGV = the opening expected
# ('' for closed), the new one ('' to close, which also resets the failures). Returns
# what is stored afterwards ('' for closed).
_TRANSITION = """
local current = redis.call('GET', KEYS[1]) or ''
if current ~= ARGV[1] then return current end
if ARGV[2] == '' then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[2], '0')
else
  redis.call('SET', KEYS[1], ARGV[2])
end
return ARGV[2]
"""

# Give back a claim only if it is still ours (it may have expired and been re-taken).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisBreakerState:
    """The shared facts of the breaker `name` (see the module docstring). `redis` is a
    URL or a ``redis.asyncio`` client (already checked by the settings)."""

    def __init__(
        self,
        redis: Any,
        name: str,
        *,
        timeout: float,
        retry_interval: float,
        probe_claim_ttl: float,
    ) -> None:
        self.name = name
        self.redis = _redis.RedisClient(redis, timeout=timeout)
        self.outage = _redis.Outage(
            _logger,
            f"circuit breaker {name!r}: Redis",
            "using this process's breaker state",
            retry_interval,
        )
        prefix = f"chat_pipeline:breaker:{{{name}}}"
        self.opened_key = f"{prefix}:opened"
        self.failures_key = f"{prefix}:failures"
        self.probe_prefix = f"{prefix}:probe:"
        self.claim_ms = max(1, round(probe_claim_ttl * 1000))
        self.local = LocalStorage(pybreaker.STATE_CLOSED)
        # Calls that share one Redis call: the read on the wire, the failures and the
        # successes of this turn of the event loop.
        self._reading: asyncio.Task[Facts | None] | None = None
        self._failures = _redis.Batched(self._count_failures)
        self._successes = _redis.Batched(self._reset)
        self._background: set[asyncio.Task[Any]] = set()

    async def _attempt(self, operation: Callable[[Any], Awaitable[_T]]) -> _T:
        return await self.redis.attempt(self.outage, operation)

    # -- the facts -------------------------------------------------------------------------

    async def read(self) -> Facts | None:
        """The facts, or ``None`` when Redis is unavailable. A call that arrives while a
        read is on the wire shares its answer (cancelling one caller never cancels the
        read the others wait for)."""
        reading = self._reading
        if reading is None or reading.get_loop() is not asyncio.get_running_loop():
            reading = self._reading = self._start(self._read())
            reading.add_done_callback(self._read_done)
        return await asyncio.shield(reading)

    def _read_done(self, reading: asyncio.Task[Facts | None]) -> None:
        if self._reading is reading:
            self._reading = None

    async def _read(self) -> Facts | None:
        async def fetch(client: Any) -> Facts:
            opened, failures = await client.mget(self.opened_key, self.failures_key)
            opening = _text(opened)
            if opening is not None:
                from_ms(opening)  # nonsense fails here, as an unavailable Redis
            return Facts(opening, int(_text(failures) or 0))

        try:
            return await self._attempt(fetch)
        except _redis.Unavailable:
            return None

    async def claim_probe(self, opening: str, token: str) -> bool | None:
        """Claim the probe of `opening`: True when ours, False when another process has
        it, ``None`` when Redis is unavailable (this process then decides alone)."""

        async def claim(client: Any) -> bool:
            taken = await client.set(self.probe_prefix + opening, token, nx=True, px=self.claim_ms)
            return bool(taken)

        try:
            return await self._attempt(claim)
        except _redis.Unavailable:
            return None

    async def release_probe(self, opening: str, token: str) -> None:
        with contextlib.suppress(_redis.Unavailable):  # the claim expires by itself
            await self._attempt(
                lambda client: self.redis.evaluate(
                    client, _RELEASE, [self.probe_prefix + opening], [token]
                )
            )

    def release_later(self, opening: str, token: str) -> None:
        """Give a claim back from a task of its own (the caller is being cancelled)."""
        self._start(self.release_probe(opening, token))

    async def count_failure(self) -> int | None:
        """Count a failure; the shared count after it (each failure its own), or ``None``
        when Redis is unavailable. The failures of one turn of the event loop are counted
        together, with one ``INCRBY``."""
        total, index, size = await self._failures.add(None)
        return None if total is None else total - size + index + 1

    async def _count_failures(self, failures: list[None]) -> int | None:
        async def increment(client: Any) -> int:
            return int(await client.incrby(self.failures_key, len(failures)))

        try:
            return await self._attempt(increment)
        except _redis.Unavailable:
            return None

    async def count_success(self) -> None:
        """A success ends the run of consecutive failures (the successes of one turn of
        the event loop reset it once)."""
        await self._successes.add(None)

    async def _reset(self, successes: list[None]) -> None:
        async def reset(client: Any) -> None:
            await client.set(self.failures_key, 0)

        with contextlib.suppress(_redis.Unavailable):  # the next failure counts on from it
            await self._attempt(reset)

    def _start(self, work: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        """Run `work` in a task of its own (shared by callers, or outliving its caller;
        awaited on `aclose`)."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def transition(self, expected: str | None, new: str | None) -> tuple[bool, str | None]:
        """Move the opening from `expected` to `new` (``None``: closed) if it is still
        `expected`. Returns ``(True, what is stored afterwards)``, or ``(False, None)``
        when Redis is unavailable."""

        async def move(client: Any) -> str | None:
            stored = await self.redis.evaluate(
                client,
                _TRANSITION,
                [self.opened_key, self.failures_key],
                [expected or "", new or ""],
            )
            opening = _text(stored) or None
            if opening is not None:
                from_ms(opening)
            return opening

        try:
            stored = await self._attempt(move)
        except _redis.Unavailable:
            return False, None
        return True, stored

    async def aclose(self) -> None:
        await self._failures.aclose()
        await self._successes.aclose()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        try:
            await self.redis.aclose()
        except Exception as exc:  # closing a dead connection is no failure of ours
            _logger.debug("circuit breaker %r: closing Redis: %s", self.name, type(exc))


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode()
    return str(value)
