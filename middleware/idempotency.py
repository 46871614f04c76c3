"""Idempotency for tool calls: where calls are claimed and their results recorded, and
their keys.

A key is claimed atomically before its call runs, so one key runs once; a holder that
dies frees it when its claim expires; `MemoryIdempotencyStore` serves one process,
`RedisIdempotencyStore` every process sharing the Redis.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import uuid
import weakref
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from pipeline import _redis

__all__ = [
    "Claim",
    "IdempotencyStore",
    "MemoryIdempotencyStore",
    "RedisIdempotencyStore",
    "claiming_store",
    "idempotency_key",
]

_logger = logging.getLogger("chat_pipeline.tools")


@dataclasses.dataclass(frozen=True, slots=True)
class Claim:
    """What `IdempotencyStore.claim` found for `key`: the recorded `result` when `done`,
    else a claim held under `token` (give it back with `complete` or `release`)."""

    key: str
    done: bool
    result: Any = None
    token: str = ""


@runtime_checkable
class IdempotencyStore(Protocol):
    """Where tool calls are claimed and their results recorded, by idempotency key."""

    async def claim(self, key: str, ttl: float) -> Claim:
        """The recorded result, or the right to run the call for at most `ttl` seconds;
        waits while another holder's claim is live (see the module docstring)."""
        ...

    async def complete(self, claim: Claim, result: Any) -> None:
        """Record `result` under the claim's key and give the claim up."""
        ...

    async def release(self, claim: Claim) -> None:
        """Give the claim up without a result, so the call may run again."""
        ...


@dataclasses.dataclass(slots=True)
class _Held:
    token: str
    done: asyncio.Future[None]
    expires: float


class MemoryIdempotencyStore:
    """An in-process store (the default). Bounded: the oldest results are forgotten
    first; claims live only while their calls run (at most their `ttl`)."""

    def __init__(self, max_entries: int = 10_000) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self._results: dict[str, Any] = {}
        self._claims: dict[str, _Held] = {}

    async def claim(self, key: str, ttl: float) -> Claim:
        loop = asyncio.get_running_loop()
        # Bounded: each wait ends when the holder completes, releases or expires, and
        # the whole wait ends after `ttl` (our own claim's lifetime) at the latest.
        give_up = loop.time() + ttl
        while True:
            if key in self._results:
                return Claim(key, True, self._results[key])
            now = loop.time()
            held = self._claims.get(key)
            if held is None or held.expires <= now or held.done.get_loop() is not loop:
                token = uuid.uuid4().hex
                self._claims[key] = _Held(token, loop.create_future(), now + ttl)
                return Claim(key, False, token=token)
            if now >= give_up:
                raise TimeoutError(f"another run of this tool call did not finish within {ttl:g} s")
            # `wait` never cancels the holder's future, also when this waiter is cancelled.
            await asyncio.wait({held.done}, timeout=min(held.expires, give_up) - now)

    async def complete(self, claim: Claim, result: Any) -> None:
        self._record(claim.key, result)
        self._give_up(claim)

    async def release(self, claim: Claim) -> None:
        self._give_up(claim)

    def _give_up(self, claim: Claim) -> None:
        held = self._claims.get(claim.key)
        if held is not None and held.token == claim.token:
            del self._claims[claim.key]
            if not held.done.done():
                held.done.set_result(None)

    def _record(self, key: str, result: Any) -> None:
        self._results[key] = result
        while len(self._results) > self.max_entries:
            del self._results[next(iter(self._results))]

    async def get(self, key: str) -> tuple[bool, Any]:
        """``(True, result)`` when `key` is recorded as completed, else ``(False, None)``."""
        if key in self._results:
            return True, self._results[key]
        return False, None

    async def put(self, key: str, result: Any) -> None:
        """Record `result` for `key` (without a claim)."""
        self._record(key, result)

    def __len__(self) -> int:
        return len(self._results)


# KEYS = result, claim; ARGV = token, lease (ms). The result if recorded, else the claim
# if free: {1, result} done, {2} claimed, {3} held by another.
_CLAIM = """
local done = redis.call('GET', KEYS[1])
if done then return {1, done} end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {2} end
return {3}
"""

# KEYS = claim; ARGV = token, lease (ms). Extends only our own claim: 1 when renewed, 0 when
# it is no longer ours (it ran out and may have been taken by another holder).
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# KEYS = result, claim; ARGV = token, result, result ttl (ms).
_COMPLETE = """
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
return 1
"""

# KEYS = claim; ARGV = token. Only our own claim (it may have expired and been re-taken).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisIdempotencyStore:
    """Shares claims and completed tool calls between processes through Redis (a URL or a
    ``redis.asyncio`` client; see `pipeline._redis` for the connection pool).

    Results are stored as JSON (tools used with it must return JSON-serializable values)
    under ``{namespace}:{key}`` for `ttl` seconds; a claim is ``{namespace}:{key}:claim``,
    taken with ``SET NX PX`` in the same script that checks for a result.

    A claim is a lease of `lease` seconds (at most the claim's own `ttl`), renewed every
    third of it (every tenth after a failed renewal) while its holder runs, for at most the
    claim's `ttl` in all: a holder that is gone frees the key after `lease` seconds. That
    includes a caller that gave up: when Redis stalls, a claim the caller stopped waiting
    for may still be queued in Redis and taken when it resumes, by nobody. A Redis outage
    longer than the lease can let a claim run out while its holder still runs (a warning
    says so: another process may then run the call too).

    The callers waiting for claims held by other processes are polled for together: one
    ``MGET`` of every claim waited for, every 10 ms at first, backing off to
    `max_poll_interval` while none ends (so a thousand waiters cost Redis one read per
    poll, not a thousand); a caller whose claim ended claims again. Each Redis call is
    bounded by `timeout` seconds; a Redis failure is raised (the layer turns it into a tool
    result: the call did not run).
    """

    def __init__(
        self,
        redis: Any,
        *,
        namespace: str = "chat_pipeline:tool",
        ttl: float = 86_400,
        timeout: float = 1.0,
        max_poll_interval: float = 0.25,
        lease: float = 10.0,
    ) -> None:
        for name, value in (
            ("ttl", ttl),
            ("timeout", timeout),
            ("max_poll_interval", max_poll_interval),
            ("lease", lease),
        ):
            if not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds")
        try:
            self._redis = _redis.RedisClient(redis, timeout=timeout)
        except ValueError as exc:
            raise ValueError(f"redis: {exc}") from None
        self.namespace = namespace
        self.ttl = ttl
        self.timeout = timeout
        self.max_poll_interval = max_poll_interval
        self.lease = lease
        # The renewal of each claim held here, by (key, token).
        self._renewals: dict[tuple[str, str], asyncio.Task[None]] = {}
        # The callers waiting for a claim held elsewhere, by key, and the task polling for
        # them (running while anyone waits).
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        self._poller: asyncio.Task[None] | None = None
        self._poll_delay = _FIRST_POLL

    def _keys(self, key: str) -> list[str]:
        return [f"{self.namespace}:{key}", f"{self.namespace}:{key}:claim"]

    async def claim(self, key: str, ttl: float) -> Claim:
        loop = asyncio.get_running_loop()
        token = uuid.uuid4().hex
        lease = min(self.lease, ttl)
        give_up = loop.time() + ttl
        while True:
            answer = await self._redis.script(_CLAIM, self._keys(key), [token, _ms(lease)])
            if int(answer[0]) == 1:
                return Claim(key, True, json.loads(answer[1]))
            if int(answer[0]) == 2:
                renewal = loop.create_task(self._renew(key, token, lease, loop.time() + ttl))
                self._renewals[key, token] = renewal
                renewal.add_done_callback(lambda _: self._renewals.pop((key, token), None))
                return Claim(key, False, token=token)
            # Held by another process: bounded by our ttl (its claim expires by then too,
            # unless yet another process keeps re-taking it).
            left = give_up - loop.time()
            if left <= 0:
                raise TimeoutError(f"another run of this tool call did not finish within {ttl:g} s")
            await self._pause(key, left)

    async def _pause(self, key: str, seconds: float) -> None:
        """Wait (at most `seconds`) until the claim on `key`, held elsewhere, may have
        ended: the poller saw it gone, or could not look."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()
        waiters = self._waiters.setdefault(key, set())
        waiters.add(ended)
        self._poll_delay = _FIRST_POLL  # a new wait: look again soon
        if self._poller is None or self._poller.done():
            self._poller = loop.create_task(self._poll())
        try:
            await asyncio.wait({ended}, timeout=seconds)
        finally:
            waiters.discard(ended)
            if not waiters and self._waiters.get(key) is waiters:
                del self._waiters[key]

    async def _poll(self) -> None:
        """While anyone waits: one ``MGET`` of the claims waited for, then wake the callers
        whose claim is gone (completed, released, run out); every caller when Redis could
        not be read (each then finds out for itself)."""
        while self._waiters:
            await asyncio.sleep(self._poll_delay)
            keys = list(self._waiters)
            try:
                held = await self._claims_of(keys)
            except Exception:
                held = [None] * len(keys)
            ended = [key for key, claim in zip(keys, held, strict=True) if claim is None]
            for key in ended:
                for waiter in self._waiters.get(key, ()):
                    if not waiter.done():
                        waiter.set_result(None)
            self._poll_delay = (
                _FIRST_POLL if ended else min(self._poll_delay * 2, self.max_poll_interval)
            )

    async def _claims_of(self, keys: list[str]) -> list[Any]:
        """The claim (its token) on each of `keys`, ``None`` where there is none."""
        claims = [self._keys(key)[1] for key in keys]
        return list(await self._redis.call(lambda client: client.mget(claims)))

    async def _renew(self, key: str, token: str, lease: float, until: float) -> None:
        """Keep the claim until `until` (the claim's ttl): renewed every third of a lease,
        and after a failed renewal, tried again every tenth (each try bounded by the
        timeout) while the lease may still hold."""
        loop = asyncio.get_running_loop()
        claim_key = self._keys(key)[1]
        wait = lease / 3
        while (left := until - loop.time()) > 0:
            await self._wait_to_renew(min(wait, left))
            # Never past `until`: a run that hangs frees its key when its ttl is up.
            extended = min(lease, until - loop.time())
            if extended <= 0:
                return
            try:
                held = await self._redis.script(_RENEW, [claim_key], [token, _ms(extended)])
            except Exception:  # Redis unavailable or slow: try again soon
                wait = lease / 10
                continue
            wait = lease / 3
            if not int(held):
                _logger.warning(
                    "a tool call's idempotency claim ran out before the call finished (Redis "
                    "was unavailable for longer than its %g s lease); another process may "
                    "run the call too",
                    lease,
                )
                return

    async def _wait_to_renew(self, seconds: float) -> None:
        """Wait until a claim is renewed again."""
        await asyncio.sleep(seconds)

    def _stop_renewing(self, claim: Claim) -> None:
        renewal = self._renewals.pop((claim.key, claim.token), None)
        if renewal is not None:
            renewal.cancel()

    async def complete(self, claim: Claim, result: Any) -> None:
        encoded = json.dumps(result)
        self._stop_renewing(claim)
        await self._redis.script(
            _COMPLETE, self._keys(claim.key), [claim.token, encoded, _ms(self.ttl)]
        )

    async def release(self, claim: Claim) -> None:
        self._stop_renewing(claim)
        await self._redis.script(_RELEASE, self._keys(claim.key)[1:], [claim.token])

    async def get(self, key: str) -> tuple[bool, Any]:
        """``(True, result)`` when `key` is recorded as completed, else ``(False, None)``."""
        raw = await self._redis.call(lambda client: client.get(self._keys(key)[0]))
        if raw is None:
            return False, None
        return True, json.loads(raw)

    async def put(self, key: str, result: Any) -> None:
        """Record `result` for `key` (without a claim)."""
        encoded = json.dumps(result)
        await self._redis.call(
            lambda client: client.set(self._keys(key)[0], encoded, px=_ms(self.ttl))
        )

    async def aclose(self) -> None:
        tasks = [*self._renewals.values(), *([self._poller] if self._poller else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._redis.aclose()


_FIRST_POLL = 0.01  # seconds before a claim waited for is first looked at again


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class _GetPutStore:
    """A store of the earlier protocol (``get``/``put`` only) with claims kept in this
    process: one key runs once per process, not across processes."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._claims = MemoryIdempotencyStore(max_entries=1)

    async def claim(self, key: str, ttl: float) -> Claim:
        local = await self._claims.claim(key, ttl)
        try:
            found, result = await self.store.get(key)
        except BaseException:
            await self._claims.release(local)
            raise
        if found:
            await self._claims.release(local)
            return Claim(key, True, result)
        return local

    async def complete(self, claim: Claim, result: Any) -> None:
        try:
            await self.store.put(claim.key, result)
        finally:
            await self._claims.release(claim)

    async def release(self, claim: Claim) -> None:
        await self._claims.release(claim)


_adapters: weakref.WeakValueDictionary[int, _GetPutStore] = weakref.WeakValueDictionary()


def claiming_store(store: Any) -> IdempotencyStore:
    """`store` as an `IdempotencyStore`: itself when it has ``claim``/``complete``/
    ``release``, wrapped with process-local claims when it has only ``get``/``put``;
    `TypeError` otherwise."""
    if all(callable(getattr(store, name, None)) for name in ("claim", "complete", "release")):
        return store  # type: ignore[no-any-return]
    if callable(getattr(store, "get", None)) and callable(getattr(store, "put", None)):
        # One adapter per store object while any layer uses it, so every layer sharing
        # the store shares its claims. (Keyed by id: the adapter keeps the store alive, so
        # the id cannot be reused while the entry exists.)
        adapter = _adapters.get(id(store))
        if adapter is None or adapter.store is not store:
            adapter = _adapters[id(store)] = _GetPutStore(store)
        return adapter
    raise TypeError(
        "idempotency_store must have claim/complete/release (or get/put), "
        f"not {type(store).__name__}"
    )


def idempotency_key(operation_id: str, tool_name: str, arguments: Mapping[str, Any]) -> str:
    """A stable key for one tool call: operation id, tool name, canonical JSON arguments."""
    canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(f"{operation_id}\0{tool_name}\0{canonical}".encode())
    return digest.hexdigest()
