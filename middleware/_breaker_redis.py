"""The shared state behind a circuit breaker with ``redis=``: the facts every process using
the same breaker `name` must agree on, kept in Redis under
``chat_pipeline:breaker:{<name>}:...``. The layer (`middleware.breaker`) still runs
pybreaker's state machine in each process and reads and writes these facts around its
steps:

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from typing import Any, NamedTuple, TypeVar

import pybreaker

from middleware._breaker_window import BUCKETS, Counts, SlidingWindow
from pipeline import _redis
from pipeline.errors import RedisUnavailable

__all__ = ["Facts", "LocalStorage", "RedisBreakerState", "SharedWindow", "from_ms", "to_ms"]

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


# Compare-and-set of the opening: KEYS = opened, failures, the window (if any); ARGV = the
# opening expected ('' for closed), the new one ('' to close, which also resets the
# failures and empties the window). Returns what is stored afterwards ('' for closed).
_TRANSITION = """
local current = redis.call('GET', KEYS[1]) or ''
if current ~= ARGV[1] then return current end
if ARGV[2] == '' then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[2], '0')
  if KEYS[3] then redis.call('DEL', KEYS[3]) end
else
  redis.call('SET', KEYS[1], ARGV[2])
end
return ARGV[2]
"""

# The read (and a failure's write) of a breaker with a window: KEYS = opened, failures, the
# window; ARGV = failures to add (INCRBY), the window's expiry (ms), the caller's current
# bucket (on its own clock), the buckets in a window, "<bucket> <calls> <failures> <slow>
# ..." for the buckets this process adds outcomes to (only while closed, on its clock), a
# bucket's width in microseconds, and the shared current bucket ('' for Redis' TIME's).
# Returns the opening (nil while closed), the failures, and "<bucket> <calls> <failures>
# <slow> ..." of the buckets in the window, on the caller's clock. (A few strings rather
# than many numbers each way: redis-py's cost is per argument and per reply element, and
# is most of a call's.)
_SYNC = """
local opened = redis.call('GET', KEYS[1])
local failures
if ARGV[1] ~= '0' then
  failures = redis.call('INCRBY', KEYS[2], ARGV[1])
else
  failures = redis.call('GET', KEYS[2])
end
local current
if ARGV[7] ~= '' then
  current = tonumber(ARGV[7])
else
  local now = redis.call('TIME')
  current = math.floor((tonumber(now[1]) * 1000000 + tonumber(now[2])) / tonumber(ARGV[6]))
end
local shift = current - tonumber(ARGV[3])
local size = tonumber(ARGV[4])
local first = current - size + 1
if not opened and ARGV[5] ~= '' then
  for b, c, f, s in string.gmatch(ARGV[5], '(%d+) (%d+) (%d+) (%d+)') do
    local bucket = tonumber(b) + shift
    if bucket >= first and bucket <= current then
      local slot = bucket % size
      local calls, failed, slow = tonumber(c), tonumber(f), tonumber(s)
      local held = redis.call('HGET', KEYS[3], slot)
      if held then
        local hb, hc, hf, hs = string.match(held, '^(%d+) (%d+) (%d+) (%d+)$')
        if tonumber(hb) == bucket then
          calls, failed, slow = calls + tonumber(hc), failed + tonumber(hf), slow + tonumber(hs)
        end
      end
      redis.call('HSET', KEYS[3], slot, string.format('%d %d %d %d', bucket, calls, failed, slow))
    end
  end
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
end
local counts = {}
for _, held in ipairs(redis.call('HVALS', KEYS[3])) do
  local hb, rest = string.match(held, '^(%d+)( %d+ %d+ %d+)$')
  local bucket = tonumber(hb)
  if bucket and bucket >= first and bucket <= current then
    counts[#counts + 1] = string.format('%d', bucket - shift) .. rest
  end
end
return {opened, failures, table.concat(counts, ' ')}
"""


class SharedWindow:
    """A process's view of the shared window: the buckets Redis last returned (which hold
    the outcomes this process sent) plus the outcomes it has not sent yet. `clear` (the
    circuit changed state) also makes answers to calls sent before it void."""

    __slots__ = ("_loaded", "_sent", "generation", "seen", "unsent")

    def __init__(self) -> None:
        self.seen = SlidingWindow()
        self.unsent = SlidingWindow()
        self.generation = 0
        self._sent = 0  # calls sent to Redis, numbered
        self._loaded = 0  # the number of the call whose answer `seen` is

    def add(self, bucket: int, calls: int, failures: int, slow: int) -> None:
        self.unsent.add(bucket, calls, failures, slow)

    def counts(self, bucket: int) -> Counts:
        seen, unsent = self.seen, self.unsent
        seen.slide(bucket)
        unsent.slide(bucket)
        return Counts(
            seen.calls + unsent.calls, seen.failures + unsent.failures, seen.slow + unsent.slow
        )

    def clear(self) -> None:
        self.seen.clear()
        self.unsent.clear()
        self.generation += 1

    def take(self, bucket: int) -> tuple[int, list[tuple[int, int, int, int]]]:
        """A number for a call about to be sent, and the unsent outcomes still in the window
        ending with `bucket`, now on their way with it."""
        self._sent += 1
        self.unsent.slide(bucket)
        taken = self.unsent.buckets()
        if taken:
            self.unsent.clear()
        return self._sent, taken

    def give_back(self, taken: list[tuple[int, int, int, int]], generation: int) -> None:
        """Outcomes that did not reach Redis: to be sent with the next call."""
        if generation == self.generation:
            for outcome in taken:
                self.add(*outcome)

    def load(self, values: list[int], generation: int, sent: int) -> None:
        """What Redis answered call number `sent`: bucket, calls, failures and slow of each
        bucket in the window. An answer to a call sent before the one `seen` holds is older
        news (calls share a pool of connections, so answers may cross): dropped."""
        if generation != self.generation or sent < self._loaded:
            return
        self._loaded = sent
        seen = self.seen
        seen.clear()
        for index in range(0, len(values) - 3, 4):
            seen.add(values[index], values[index + 1], values[index + 2], values[index + 3])


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
        window: float | None = None,
        bucket: Callable[[], int] | None = None,
        shared_bucket: Callable[[], int] | None = None,
    ) -> None:
        """`window` (seconds) and `bucket` (the current bucket, from the breaker's clock)
        when the breaker has a ratio policy; `shared_bucket`, the shared window's current
        bucket (None: from Redis' ``TIME``)."""
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
        self.window_key = f"{prefix}:window"
        self.window: SharedWindow | None = None
        self._bucket = bucket
        self._shared_bucket = shared_bucket
        self._expiry_ms = 0
        self._width_us = 1
        if window is not None and bucket is not None:
            self.window = SharedWindow()
            self._expiry_ms = max(1, round(2 * window * 1000))
            self._width_us = max(1, round(window / BUCKETS * 1_000_000))
        # Encoded once: redis-py sends bytes as they are.
        self._sync_keys = [
            key.encode() for key in (self.opened_key, self.failures_key, self.window_key)
        ]
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
        if self.window is not None:
            synced = await self._sync(0)
            return None if synced is None else Facts(synced[0], synced[1])

        async def fetch(client: Any) -> Facts:
            opened, failures = await client.mget(self.opened_key, self.failures_key)
            opening = _text(opened)
            if opening is not None:
                from_ms(opening)  # nonsense fails here, as an unavailable Redis
            return Facts(opening, int(_text(failures) or 0))

        try:
            return await self._attempt(fetch)
        except RedisUnavailable:
            return None

    async def claim_probe(self, opening: str, token: str) -> bool | None:
        """Claim the probe of `opening`: True when ours, False when another process has
        it, ``None`` when Redis is unavailable (this process then decides alone)."""

        async def claim(client: Any) -> bool:
            taken = await client.set(self.probe_prefix + opening, token, nx=True, px=self.claim_ms)
            return bool(taken)

        try:
            return await self._attempt(claim)
        except RedisUnavailable:
            return None

    async def release_probe(self, opening: str, token: str) -> None:
        with contextlib.suppress(RedisUnavailable):  # the claim expires by itself
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
        if self.window is not None:
            synced = await self._sync(len(failures))
            return None if synced is None else synced[1]

        async def increment(client: Any) -> int:
            return int(await client.incrby(self.failures_key, len(failures)))

        try:
            return await self._attempt(increment)
        except RedisUnavailable:
            return None

    async def _sync(self, failures: int) -> tuple[str | None, int] | None:
        """`_SYNC`: add `failures` and this process's unsent outcomes, and read the facts
        and the window (loaded into `window`); ``None`` when Redis is unavailable."""
        window, current = self.window, self._bucket
        assert window is not None
        assert current is not None
        bucket = current()
        generation = window.generation
        sent, taken = window.take(bucket)
        outcomes = " ".join(str(number) for outcome in taken for number in outcome)
        shared = self._shared_bucket
        args = [
            failures,
            self._expiry_ms,
            bucket,
            BUCKETS,
            outcomes,
            self._width_us,
            "" if shared is None else shared(),
        ]
        keys = self._sync_keys

        async def sync(client: Any) -> tuple[str | None, int, list[int]]:
            opened, failures_now, held = await self.redis.evaluate(client, _SYNC, keys, args)
            opening = _text(opened)
            if opening is not None:
                from_ms(opening)  # nonsense fails here, as an unavailable Redis
            counts = [int(value) for value in (_text(held) or "").split()]
            if len(counts) % 4:
                raise ValueError("the window's buckets came back malformed")
            return opening, int(_text(failures_now) or 0), counts

        try:
            opening, failures_now, counts = await self._attempt(sync)
        except RedisUnavailable:
            window.give_back(taken, generation)
            return None
        window.load(counts, generation, sent)
        return opening, failures_now

    async def count_success(self) -> None:
        """A success ends the run of consecutive failures (the successes of one turn of
        the event loop reset it once)."""
        await self._successes.add(None)

    async def _reset(self, successes: list[None]) -> None:
        async def reset(client: Any) -> None:
            await client.set(self.failures_key, 0)

        with contextlib.suppress(RedisUnavailable):  # the next failure counts on from it
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

        keys = [self.opened_key, self.failures_key]
        if new is None and self.window is not None:
            keys.append(self.window_key)

        async def move(client: Any) -> str | None:
            stored = await self.redis.evaluate(
                client, _TRANSITION, keys, [expected or "", new or ""]
            )
            opening = _text(stored) or None
            if opening is not None:
                from_ms(opening)
            return opening

        try:
            stored = await self._attempt(move)
        except RedisUnavailable:
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
