"""Redis, for the state that processes share: the breaker's facts, session affinity, tool
idempotency, and the gateway's readiness. One place checks what the caller gave, connects,
bounds each call, runs Lua scripts, backs off and warns through an outage, and pings.

Building never contacts Redis; each call is bounded as a whole by the caller's timeout;
a component that can do without Redis fails open through an `Outage`, which warns at most
once a minute and never echoes a URL or a reply.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

from pipeline.errors import RedisUnavailable

__all__ = [
    "POOL_SIZE",
    "Batched",
    "Outage",
    "RedisClient",
    "check",
    "check_url",
]

POOL_SIZE = 32
"""Calls of one component on Redis at once, and connections of a client made here (see the
module docstring for why)."""

_URL_REQUIRED = "must be a redis://, rediss:// or unix:// URL with a valid host and port"

_T = TypeVar("_T")
_I = TypeVar("_I")


def _parse_url() -> Callable[[str], Any]:
    try:
        from redis.asyncio.connection import parse_url
    except ImportError as exc:  # pragma: no cover - only without the redis extra
        raise ValueError("needs the redis package: pip install 'chat-pipeline[redis]'") from exc
    return parse_url


def check_url(url: str) -> None:
    """`ValueError` unless `url` is a Redis URL redis-py accepts, with a host
    (``redis://``, ``rediss://``) or a socket path (``unix://``). The message is ours
    alone: the URL may hold a password."""
    parse_url = _parse_url()
    try:
        options = parse_url(url)
    except (ValueError, TypeError):
        raise ValueError(_URL_REQUIRED) from None
    if not options.get("host") and not options.get("path"):
        raise ValueError(_URL_REQUIRED)


def check(redis: Any) -> Any:
    """`redis` itself when it is a Redis URL (checked: `ValueError`) or a
    ``redis.asyncio`` client; `TypeError` for a synchronous client or anything else."""
    if isinstance(redis, str):
        check_url(redis)
        return redis
    execute = getattr(redis, "execute_command", None)
    if not callable(execute):
        raise TypeError(
            f"redis must be a URL or a redis.asyncio client, not {type(redis).__name__}"
        )
    if not inspect.iscoroutinefunction(execute):
        raise TypeError(
            "redis must be a URL or a redis.asyncio client: a synchronous "
            f"{type(redis).__name__} client would block the event loop"
        )
    return redis


def _connector(timeout: float) -> Callable[[str], Any]:
    """Makes a client for a URL (a pool of `POOL_SIZE` connections, each bounded by
    `timeout`, no retries). The modules are imported now, while a pipeline is built, so a
    request's first call does not pay for the import inside its bound."""
    import redis.asyncio as redis_asyncio
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    def made(url: str) -> Any:
        pool = redis_asyncio.ConnectionPool.from_url(
            url,
            max_connections=POOL_SIZE,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            # Our own bound is one try within the caller's timeout: no hidden retries.
            retry=Retry(NoBackoff(), 0),
        )
        return redis_asyncio.Redis.from_pool(pool)

    return made


class Outage:
    """How a component fails open while Redis (or any shared store) is down: after a
    failure, `skipping()` is true for `retry_interval` seconds. A failure is a warning
    when none was logged in the last minute: so an outage is warned about when it starts,
    then once a minute while it lasts, and a Redis that flaps (or a burst of calls that
    outlast their bound) is at most one warning a minute. The first success after an outage
    that was warned about is an info line. Messages: `subject` (``"session affinity
    store"``), the error's type, what the component does meanwhile (`fallback`). `clock`
    (seconds, monotonic) is what the interval is measured on."""

    WARN_EVERY = 60.0

    def __init__(
        self,
        logger: logging.Logger,
        subject: str,
        fallback: str,
        retry_interval: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.subject = subject
        self.fallback = fallback
        self.retry_interval = retry_interval
        self.clock = clock
        self._down_until: float | None = None
        self._last_warning = -float("inf")
        self._warned = False  # about the outage under way

    @property
    def down(self) -> bool:
        """Whether the last call failed (and no call has succeeded since)."""
        return self._down_until is not None

    def skipping(self) -> bool:
        """Whether to do without the store for now (a failure less than `retry_interval`
        seconds ago)."""
        return self._down_until is not None and self.clock() < self._down_until

    def failed(self, exc: BaseException) -> None:
        now = self.clock()
        self._down_until = now + self.retry_interval
        if now - self._last_warning >= self.WARN_EVERY:
            self._last_warning = now
            self._warned = True
            # The exception's type only: its text may name hosts or echo a reply.
            self.logger.warning(
                "%s unavailable (%s); %s; trying again in %.3g s",
                self.subject,
                type(exc).__name__,
                self.fallback,
                self.retry_interval,
            )

    def succeeded(self) -> None:
        if self._down_until is not None:
            self._down_until = None
            if self._warned:
                self._warned = False
                self.logger.info("%s is reachable again", self.subject)

    async def guard(
        self,
        call: Callable[[], Awaitable[_T]],
        bound: float | None,
        *,
        bound_by_request: bool = False,
    ) -> _T | None:
        """`call()` within `bound` seconds (None: unbounded), failing open: None while the
        store is skipped, or when the call fails or runs out of time (counted as the store's
        failure unless `bound_by_request` and the bound ran out: the request's deadline, not
        the store). The caller's own cancellation is raised; the store's stray one is its
        failure."""
        if self.skipping():
            return None
        try:
            async with asyncio.timeout(bound) as limit:
                result = await call()
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # the caller is cancelling
            self.failed(exc)
            return None
        except Exception as exc:  # a broken store must not fail the request
            if not (bound_by_request and limit.expired()):
                self.failed(exc)
            return None
        self.succeeded()
        return result


class RedisClient:
    """The Redis one component talks to: a URL (its client is made here, lazily, in the
    running event loop, and closed by `aclose`) or a ``redis.asyncio`` client of the
    caller's own (used as it is, never closed here). Every call is bounded by `timeout`
    seconds. `check` rules apply to `redis` (`ValueError`, `TypeError`)."""

    def __init__(self, redis: Any, *, timeout: float) -> None:
        given = check(redis)
        self.timeout = timeout
        self._url: str | None = given if isinstance(given, str) else None
        self._given: Any = None if self._url is not None else given
        self._connect = _connector(timeout) if self._url is not None else None
        # Per event loop (asyncio's primitives and connections belong to one loop).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self._turns = asyncio.Semaphore(POOL_SIZE)
        self._scripts: dict[str, Any] = {}

    @property
    def owned(self) -> bool:
        """Whether the client is made (and closed) here, from a URL."""
        return self._url is not None

    def client(self) -> Any:
        """The client for the running event loop."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._connect is not None:
                assert self._url is not None
                self._client = self._connect(self._url)
            else:
                self._client = self._given
            self._loop = loop
            self._turns = asyncio.Semaphore(POOL_SIZE)
            self._scripts = {}
        return self._client

    async def call(self, operation: Callable[[Any], Awaitable[_T]]) -> _T:
        """`operation(client)` within the timeout, in its turn; raises what went wrong
        (`TimeoutError` when the time ran out)."""
        async with asyncio.timeout(self.timeout):
            client = self.client()
            async with self._turns:
                return await operation(client)

    async def evaluate(
        self, client: Any, source: str, keys: Sequence[str | bytes], args: Sequence[Any]
    ) -> Any:
        """Run the Lua script `source` on `client` (``EVALSHA``; registered once per
        client, loaded again on ``NOSCRIPT``): an operation for `call` or `attempt`."""
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = client.register_script(source)
        return await script(keys=list(keys), args=list(args), client=client)

    async def script(self, source: str, keys: Sequence[str | bytes], args: Sequence[Any]) -> Any:
        """`evaluate` within the timeout."""
        return await self.call(lambda client: self.evaluate(client, source, keys, args))

    async def attempt(self, outage: Outage, operation: Callable[[Any], Awaitable[_T]]) -> _T:
        """`call`, failing open through `outage`: `RedisUnavailable` (and nothing else) when
        Redis is being skipped or this call failed; the failure is `outage`'s to report."""
        if outage.skipping():
            raise RedisUnavailable
        try:
            result = await self.call(operation)
        except Exception as exc:  # any failure of Redis: the component goes on without it
            outage.failed(exc)
            raise RedisUnavailable from None
        outage.succeeded()
        return result

    async def ping(self) -> str:
        """``ok``, or ``unavailable (<error type>)`` (a readiness answer: never raises)."""
        try:
            await self.call(lambda client: client.ping())
        except Exception as exc:  # the answer, not an error of the caller
            return f"unavailable ({type(exc).__name__})"
        return "ok"

    async def aclose(self) -> None:
        """Close the client made here (a caller's own client stays open)."""
        client, self._client, self._loop = self._client, None, None
        if client is not None and self._connect is not None:
            await client.aclose()

    def __repr__(self) -> str:  # never the URL: it may hold a password
        return f"RedisClient({'url' if self.owned else type(self._given).__name__})"


class Batched(Generic[_I, _T]):
    """The items added in one turn of the event loop, sent together by one call of
    `send(items)` in a task of its own (which starts at the next turn, once every caller
    of this turn has added its item). Each caller gets the call's result and its item's
    index; cancelling a caller never cancels the call the others wait for."""

    def __init__(self, send: Callable[[list[_I]], Awaitable[_T]]) -> None:
        self._send = send
        self._items: list[_I] | None = None
        self._task: asyncio.Task[_T] | None = None
        self._tasks: set[asyncio.Task[_T]] = set()

    async def add(self, item: _I) -> tuple[_T, int, int]:
        """``(result, index of item, how many items the call sent)``."""
        items, task = self._items, self._task
        if items is None or task is None:
            items = self._items = []
            task = self._task = asyncio.get_running_loop().create_task(self._run(items))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        items.append(item)
        index = len(items) - 1
        return await asyncio.shield(task), index, len(items)

    async def _run(self, items: list[_I]) -> _T:
        if self._items is items:  # items added from now on make the next batch
            self._items = self._task = None
        return await self._send(items)

    async def aclose(self) -> None:
        """Wait for the calls under way."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
