"""The circuit-breaker layer: stop calling a deployment that keeps failing.

Built on a `pybreaker.CircuitBreaker` per client. pybreaker's own async support needs
Tornado, so this layer drives pybreaker's state machine from asyncio: each state change
and each recorded outcome is a short synchronous step under pybreaker's lock, and the lock
is never held across an ``await``.

Promises, for `get_response` and `get_streaming_response` alike:

* only deployment failures count (`counts` decides; default: rate limits, transient and
  unknown failures, and answers that failed a response-validation layer beneath the
  breaker). Request errors (invalid, too long, filtered, unauthenticated) prove the
  deployment answered, so they count as successes; caller cancellation and a caller
  abandoning a stream count as nothing;
* an attempt the router cuts for time (`attempt_timeout`, or the time it keeps for a
  backup) counts as a failure: the deployment did not answer in time;
* after `fail_max` consecutive counted failures the circuit opens: calls fail at once with
  `CircuitOpenError` (kind `CIRCUIT_OPEN`), before any output, so failover moves on;
* after `reset_timeout` one probe is let through (half-open); its success closes the
  circuit, its failure opens it again. Other calls meanwhile fail fast;
* a stream that fails after output still counts as a failure of the deployment;
* state changes go to `on_state_change(name, old, new)`, become events
  (`chat_pipeline.circuit_breaker.state_change`) on the current span and count in the
  `chat_pipeline.circuit_breaker.state_changes` metric.

Shared state (``redis=``, a URL or a ``redis.asyncio`` client): every process using the
same breaker `name` and Redis shares one breaker. pybreaker still runs the state machine
in each process; the facts that must agree live in Redis, under
``chat_pipeline:breaker:{<name>}:...``:

* ``:failures``: the consecutive counted failures of all processes together (``INCR`` per
  failure; a success resets it when that call was admitted with a nonzero count, so a
  success racing a failure of another process errs towards opening early, never late);
* ``:opened``: when the circuit opened, in milliseconds since the epoch (sub-second; from
  the breaker's clock, so replicas' clocks should agree, as NTP keeps them); absent while
  closed. Transitions are compare-and-set scripts, so two processes tripping together
  agree on one opening, and a late probe result cannot undo a newer opening;
* ``:probe:<opening>``: the half-open probe's claim, taken with ``SET NX PX``: exactly one
  probe per opening across every process. It expires after `probe_claim_ttl` seconds, so
  a process that dies mid-probe does not keep the circuit open for ever; a probe the
  caller cancels gives it back at once.

Each process reads the shared facts once per call (one ``MGET``) and writes only on a
counted failure, a transition or a reset. Redis calls never block the event loop (they
use ``redis.asyncio``) and each is bounded by `redis_timeout`. When Redis is unreachable,
slow, or answers nonsense, the breaker fails open: the call proceeds on this process's own
breaker state (what it last saw of the shared state plus its own outcomes), a warning
without request content is logged (once per outage, then at most once a minute), and
Redis is tried again after `redis_retry_interval` seconds; a Redis error never reaches
the caller. Building a pipeline never contacts Redis (a server that is down then is fine);
a malformed URL is a `ValueError` at construction. When Redis answers again, its state
wins over what this process decided alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, ClassVar

import pybreaker
from opentelemetry import trace
from pydantic import Field, StringConstraints, field_validator

from pipeline import _scope
from pipeline._semconv import (
    BREAKER_FROM,
    BREAKER_NAME,
    BREAKER_SCOPE,
    BREAKER_TO,
    STATE_CHANGE_EVENT,
    STATE_CHANGE_METRIC,
    meter,
)
from pipeline._settings import Settings
from pipeline._streams import StreamEnd, StreamWatcher, forward
from pipeline.client import ChatClient, DelegatingChatClient, client_name
from pipeline.errors import (
    AttemptTimeoutError,
    CircuitOpenError,
    FailureKind,
    UnsendableRequestError,
    classify,
)
from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages

__all__ = [
    "BreakerSettings",
    "STATE_CHANGE_EVENT",
    "STATE_CHANGE_METRIC",
    "CircuitBreakerChatClient",
    "StateChangeListener",
    "counts_as_deployment_failure",
]

StateChangeListener = Callable[[str, str, str], None]

_logger = logging.getLogger("chat_pipeline.breaker")

# A malformed answer (INVALID_RESPONSE) is the deployment's failure too: the model behind
# it is not producing the shape asked for, and opening the circuit moves traffic away.
_DEPLOYMENT_FAILURES = frozenset(
    {
        FailureKind.RATE_LIMITED,
        FailureKind.TRANSIENT,
        FailureKind.INVALID_RESPONSE,
        FailureKind.UNKNOWN,
    }
)
_CLOSED = pybreaker.STATE_CLOSED
_OPEN = pybreaker.STATE_OPEN
_HALF_OPEN = pybreaker.STATE_HALF_OPEN


def counts_as_deployment_failure(exc: BaseException) -> bool:
    """Default `counts`: rate limits, transient, invalid-response and unknown failures open
    the circuit."""
    return isinstance(exc, Exception) and classify(exc) in _DEPLOYMENT_FAILURES


class _StateChangeAdapter(pybreaker.CircuitBreakerListener):
    def __init__(self, listener: StateChangeListener | None, meter_provider: Any) -> None:
        self._listener = listener
        self._changes = meter(BREAKER_SCOPE, meter_provider).create_counter(
            STATE_CHANGE_METRIC, unit="{change}", description="Circuit breaker state changes"
        )

    def state_change(self, cb: pybreaker.CircuitBreaker, old: Any, new: Any) -> None:
        old_name = old.name if old is not None else "none"
        attributes = {
            BREAKER_NAME: cb.name or "",
            BREAKER_FROM: old_name,
            BREAKER_TO: new.name,
        }
        trace.get_current_span().add_event(STATE_CHANGE_EVENT, attributes)
        self._changes.add(1, attributes)
        if self._listener is not None:
            self._listener(cb.name or "", old_name, new.name)


class _Breaker(pybreaker.CircuitBreaker):
    """pybreaker's breaker with an injectable clock for `opened_at`, so timing is testable."""

    def __init__(self, now: Callable[[], datetime], **options: Any) -> None:
        self._now = now
        super().__init__(**options)

    def open(self) -> bool:
        with self._lock:
            throw_new_error = bool(super().open())
            self._state_storage.opened_at = self._now()
            return throw_new_error


class _LocalStorage(pybreaker.CircuitMemoryStorage):
    """This process's copy of a shared breaker's state: pybreaker's memory storage, whose
    failure count can be set to the shared one."""

    def set_counter(self, count: int) -> None:
        self._fail_counter = count


class BreakerSettings(Settings):
    """One breaker: `fail_max` consecutive counted failures open it for `reset_timeout`
    seconds; `counts` decides what counts (code only); `on_state_change(name, old, new)`
    hears every state change (code only).

    `redis` (a ``redis://``, ``rediss://`` or ``unix://`` URL, or a ``redis.asyncio``
    client) shares the state between processes under `name`; each Redis call is bounded
    by `redis_timeout` seconds; after a Redis failure the breaker uses this process's state
    for `redis_retry_interval` seconds before trying Redis again; a half-open probe's claim
    expires after `probe_claim_ttl` seconds (longer than a call may take).
    """

    code_only: ClassVar[frozenset[str]] = frozenset({"counts", "on_state_change"})

    fail_max: Annotated[int, Field(ge=1)] = 5
    # Bounded so the open time is a valid date offset (a year is plenty).
    reset_timeout: Annotated[float, Field(gt=0, le=31_536_000)] = 30.0
    name: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)] | None = None
    counts: Callable[[BaseException], bool] = counts_as_deployment_failure
    redis: Any = None
    redis_timeout: Annotated[float, Field(gt=0, le=60)] = 0.25
    redis_retry_interval: Annotated[float, Field(ge=0, le=3600)] = 1.0
    probe_claim_ttl: Annotated[float, Field(ge=0.001, le=86_400)] = 60.0
    on_state_change: Callable[[str, str, str], None] | None = None

    @field_validator("redis")
    @classmethod
    def _redis_url_or_async_client(cls, value: Any) -> Any:
        if value is None:
            return value
        if isinstance(value, str):
            _check_redis_url(value)
            return value
        sync_client = _sync_redis_class()
        if sync_client is not None and isinstance(value, sync_client):
            raise TypeError(
                "redis must be a URL or a redis.asyncio client: a synchronous redis.Redis "
                "client would block the event loop"
            )
        if not callable(getattr(value, "mget", None)):
            raise TypeError(
                f"redis must be a URL or a redis.asyncio client, not {type(value).__name__}"
            )
        return value


def _sync_redis_class() -> type | None:
    try:
        from redis import Redis
    except ImportError:  # pragma: no cover - only without the redis extra
        return None
    return Redis


def _check_redis_url(url: str) -> None:
    # Our own words only: the URL may hold a password.
    try:
        from redis.asyncio.connection import parse_url
    except ImportError as exc:  # pragma: no cover - only without the redis extra
        raise ValueError(
            "redis needs the redis package: pip install 'chat-pipeline[redis]'"
        ) from exc
    try:
        parse_url(url)
    except ValueError:
        raise ValueError(
            "must be a redis://, rediss:// or unix:// URL with a valid host and port"
        ) from None


class _Ticket:
    """One admitted call of a shared breaker: whether it is the probe, the opening whose
    probe claim it holds, and whether the shared count was nonzero when it was admitted."""

    __slots__ = ("claim", "failures_seen", "probe", "token")

    def __init__(self, probe: bool, failures_seen: bool) -> None:
        self.probe = probe
        self.failures_seen = failures_seen
        self.claim: str | None = None
        self.token = ""


class CircuitBreakerChatClient(DelegatingChatClient):
    """Fails fast with `CircuitOpenError` while the inner client's deployment is failing.

    Keyword `options` are the fields of `BreakerSettings`.
    """

    def __init__(
        self,
        inner: ChatClient,
        settings: BreakerSettings | None = None,
        *,
        meter_provider: Any = None,
        now: Callable[[], datetime] | None = None,
        leave_open: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(inner, leave_open=leave_open)
        self.settings = BreakerSettings.from_options(settings, options)
        self.name = self.settings.name or client_name(inner)
        self._now = now or (lambda: datetime.now(UTC))
        self._reset_after = timedelta(seconds=self.settings.reset_timeout)
        self._shared: _SharedState | None = None
        storage = None
        if self.settings.redis is not None:
            self._shared = _SharedState(self.settings, self.name)
            storage = self._shared.local
        counts = self.settings.counts
        self.breaker = _Breaker(
            self._now,
            fail_max=self.settings.fail_max,
            reset_timeout=self.settings.reset_timeout,
            exclude=[lambda exc: not counts(exc)],
            listeners=[_StateChangeAdapter(self.settings.on_state_change, meter_provider)],
            state_storage=storage,
            name=self.name,
            throw_new_error_on_trip=False,
        )
        self._probe_in_flight = False
        # The shared opening this process knows of (the `:opened` value), if any.
        self._opening: str | None = None

    @property
    def circuit_open(self) -> bool:
        """Whether a call would fail fast now (open, and not yet due for a probe)."""
        breaker = self.breaker
        if breaker.current_state != pybreaker.STATE_OPEN:
            return False
        opened_at = breaker._state_storage.opened_at
        return opened_at is not None and self._now() < opened_at + timedelta(
            seconds=breaker.reset_timeout
        )

    @property
    def state(self) -> str:
        """``closed``, ``open`` or ``half-open``: this process's view (with ``redis``, as
        of its last call: every call refreshes it from Redis)."""
        return str(self.breaker.current_state)

    def describe_layer(self) -> str:
        return f"CircuitBreakerChatClient({self.name})"

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            if self._shared is not None:
                await self._shared.aclose()

    # -- the state machine, one short synchronous step at a time --------------------------

    def _open_error(self) -> CircuitOpenError:
        return CircuitOpenError(f"circuit open for {self.name!r}", provider=self.name)

    def _admit(self) -> bool:
        """Let a call through or raise `CircuitOpenError`; True when the call is a probe."""
        breaker = self.breaker
        with breaker._lock:
            state = breaker.state
            if state.name == _OPEN:
                opened_at = breaker._state_storage.opened_at
                if opened_at is not None and self._now() < opened_at + self._reset_after:
                    raise self._open_error()
                breaker.half_open()
                state = breaker.state
            if state.name == _HALF_OPEN:
                if self._probe_in_flight:
                    raise self._open_error()
                self._probe_in_flight = True
                return True
            return False

    def _record(self, probe: bool, error: BaseException | None) -> None:
        if isinstance(error, UnsendableRequestError):
            self._release(probe)  # never sent: the deployment was not asked
            return
        breaker = self.breaker
        with breaker._lock:
            if probe:
                self._probe_in_flight = False
            if error is None:
                breaker.state._handle_success()
                return
            try:
                breaker.state._handle_error(error, reraise=False)
            except BaseException as raised:
                # pybreaker re-raises the failure from on_failure when it trips the
                # circuit; the caller raises it anyway, so only a different error escapes.
                if raised is not error:
                    raise

    def _cancelled(self, probe: bool) -> None:
        """A call cancelled under way: the router cutting it for time is a failure of the
        deployment (it did not answer in time); the caller cancelling is neither."""
        if _scope.attempt_timed_out():
            self._record(probe, self._timed_out())
        else:
            self._release(probe)

    def _timed_out(self) -> AttemptTimeoutError:
        return AttemptTimeoutError(f"{self.name!r} did not answer in time")

    def _release(self, probe: bool) -> None:
        if probe:
            with self.breaker._lock:
                self._probe_in_flight = False

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        if self._shared is not None:
            return await self._get_response_shared(messages, options)
        probe = self._admit()
        try:
            response = await self.inner.get_response(messages, options)
        except asyncio.CancelledError:
            self._cancelled(probe)
            raise
        except BaseException as exc:
            self._record(probe, exc)
            raise
        self._record(probe, None)
        return response

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        watcher: StreamWatcher = (
            _BreakerWatch(self) if self._shared is None else _SharedBreakerWatch(self)
        )
        return forward(lambda: self.inner.get_streaming_response(messages, options), watcher)

    # -- the shared breaker: the same steps, with the shared facts read and written around
    # -- them (never under the lock)

    async def _get_response_shared(
        self, messages: Messages, options: ChatOptions | None
    ) -> ChatResponse:
        ticket = await self._admit_shared()
        try:
            response = await self.inner.get_response(messages, options)
        except asyncio.CancelledError:
            await self._cancelled_shared(ticket)
            raise
        except BaseException as exc:
            await self._record_shared(ticket, exc)
            raise
        await self._record_shared(ticket, None)
        return response

    def _adopt(self, opened: str | None, failures: int) -> None:
        """Make this process's pybreaker agree with the shared facts (under the lock)."""
        breaker = self.breaker
        assert self._shared is not None
        storage = self._shared.local
        local = breaker._state.name
        if opened is None:
            self._opening = None
            if local != _CLOSED:
                breaker.close()
        elif opened != self._opening or local == _CLOSED:
            # Another process opened (or re-opened) the circuit.
            self._opening = opened
            storage.opened_at = _from_ms(opened)
            if local != _OPEN:
                storage.state = _OPEN
                breaker.state = _OPEN  # pybreaker's setter takes the state's name
        storage.set_counter(failures)

    async def _admit_shared(self) -> _Ticket:
        shared = self._shared
        assert shared is not None
        facts = await shared.read()
        with self.breaker._lock:
            if facts is not None:
                self._adopt(*facts)
            ticket = _Ticket(self._admit(), facts is not None and facts[1] > 0)
            opening = self._opening if ticket.probe and facts is not None else None
        if opening is None:
            return ticket
        ticket.token = uuid.uuid4().hex
        try:
            claimed = await shared.claim_probe(opening, ticket.token)
        except BaseException:
            # Cancelled while claiming: the claim may have been taken; give it back.
            self._release(True)
            shared.release_later(opening, ticket.token)
            raise
        if claimed is False:  # another process is probing this opening
            self._release(True)
            raise self._open_error()
        if claimed is True:
            ticket.claim = opening
        return ticket

    async def _record_shared(self, ticket: _Ticket, error: BaseException | None) -> None:
        if isinstance(error, UnsendableRequestError):
            await self._release_shared(ticket)  # never sent: the deployment was not asked
            return
        shared = self._shared
        assert shared is not None
        breaker = self.breaker
        counted = error is not None and breaker.is_system_error(error)
        count = None
        if counted and breaker._state.name == _CLOSED:
            count = await shared.increment_failures()
        with breaker._lock:
            before = breaker._state.name
            if count is not None and before == _CLOSED:
                shared.local.set_counter(count - 1)  # pybreaker adds this one
            self._record(ticket.probe, error)
            after = breaker._state.name
            opened_at = breaker._state_storage.opened_at
            expected = None if before == _CLOSED else self._opening
        if after == before:
            if not counted and after == _CLOSED and ticket.failures_seen:
                await shared.reset_failures()
            elif ticket.claim is not None:
                await shared.release_probe(ticket.claim, ticket.token)
            return
        new = None if after == _CLOSED else _to_ms(opened_at or self._now())
        available, stored = await shared.transition(expected, new)
        with breaker._lock:
            if not available or stored == new:
                self._opening = new
            elif breaker._state.name == after:
                # Another process's transition came first (it opened the circuit first,
                # or re-opened it after a newer probe): take its view.
                self._adopt(stored, shared.local.counter)

    async def _cancelled_shared(self, ticket: _Ticket) -> None:
        """`_cancelled` for a shared breaker (decided when awaited, before any await)."""
        if _scope.attempt_timed_out():
            await self._record_shared(ticket, self._timed_out())
        else:
            await self._release_shared(ticket)

    async def _release_shared(self, ticket: _Ticket) -> None:
        self._release(ticket.probe)
        if ticket.claim is not None:
            assert self._shared is not None
            await self._shared.release_probe(ticket.claim, ticket.token)


class _BreakerWatch(StreamWatcher):
    """Admits the stream when it is first read, then records how it ended: a failure (also
    after output) counts against the deployment, a completed stream for it, an abandoned or
    canceled one as nothing."""

    __slots__ = ("layer", "probe")

    def __init__(self, layer: CircuitBreakerChatClient) -> None:
        self.layer = layer
        self.probe = False

    def start(self) -> None:
        self.probe = self.layer._admit()

    def end(self, how: StreamEnd, error: BaseException | None) -> None:
        if how == "completed":
            self.layer._record(self.probe, None)
        elif how == "failed":
            self.layer._record(self.probe, error)
        elif how == "canceled":
            self.layer._cancelled(self.probe)
        else:
            self.layer._release(self.probe)


class _SharedBreakerWatch(StreamWatcher):
    """`_BreakerWatch` for a shared breaker: admission and recording talk to Redis, so
    `start` and `end` return awaitables (`forward` awaits them)."""

    __slots__ = ("layer", "ticket")

    def __init__(self, layer: CircuitBreakerChatClient) -> None:
        self.layer = layer
        self.ticket = _Ticket(False, False)

    def start(self) -> Awaitable[None]:
        return self._start()

    async def _start(self) -> None:
        self.ticket = await self.layer._admit_shared()

    def end(self, how: StreamEnd, error: BaseException | None) -> Awaitable[None]:
        if how == "completed":
            return self.layer._record_shared(self.ticket, None)
        if how == "failed":
            return self.layer._record_shared(self.ticket, error)
        if how == "canceled":
            return self.layer._cancelled_shared(self.ticket)
        return self.layer._release_shared(self.ticket)


def _to_ms(moment: datetime) -> str:
    return f"{moment.timestamp() * 1000:.3f}"


def _from_ms(value: str) -> datetime:
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


class _Unavailable(Exception):
    """Redis could not be used for this call (the cause is logged, not raised)."""


class _SharedState:
    """A breaker's shared facts in Redis, each call bounded and never raising a Redis
    error: every method returns ``None`` (or does nothing) when Redis is unavailable."""

    _WARN_EVERY = 60.0

    def __init__(self, settings: BreakerSettings, name: str) -> None:
        given = settings.redis
        self._url: str | None = given if isinstance(given, str) else None
        self._given: Any = None if isinstance(given, str) else given
        self._connect: Callable[[str], Any] = _connector(settings.redis_timeout)
        self._client: Any = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._scripts: dict[str, Any] = {}
        self.name = name
        prefix = f"chat_pipeline:breaker:{{{name}}}"
        self.opened_key = f"{prefix}:opened"
        self.failures_key = f"{prefix}:failures"
        self.probe_prefix = f"{prefix}:probe:"
        self.timeout = settings.redis_timeout
        self.retry_interval = settings.redis_retry_interval
        self.claim_ms = max(1, round(settings.probe_claim_ttl * 1000))
        self._down_until: float | None = None
        self._last_warning = -float("inf")
        self._background: set[asyncio.Task[None]] = set()
        self.local = _LocalStorage(_CLOSED)

    # -- the client, made lazily in the running loop (building never connects) -------------

    def _redis(self) -> Any:
        if self._given is not None:
            if self._client is None:
                self._client = self._given
            return self._given
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            assert self._url is not None
            self._client = self._connect(self._url)
            self._client_loop = loop
            self._scripts = {}
        return self._client

    def _script(self, client: Any, source: str) -> Any:
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = client.register_script(source)
        return script

    async def _run(self, operation: Callable[[Any], Awaitable[Any]]) -> Any:
        """Run `operation(client)` within the timeout; `_Unavailable` when it cannot be."""
        if self._down_until is not None and time.monotonic() < self._down_until:
            raise _Unavailable
        try:
            async with asyncio.timeout(self.timeout):
                result = await operation(self._redis())
        except Exception as exc:  # any failure of Redis: fail open, never raise it
            self._failed(exc)
            raise _Unavailable from None
        if self._down_until is not None:
            self._down_until = None
            _logger.info("circuit breaker %r: Redis is reachable again", self.name)
        return result

    def _failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        first = self._down_until is None
        self._down_until = now + self.retry_interval
        if first or now - self._last_warning >= self._WARN_EVERY:
            self._last_warning = now
            # The exception's type only: its text may name hosts or echo a reply.
            _logger.warning(
                "circuit breaker %r: Redis unavailable (%s); using this process's breaker "
                "state, trying Redis again in %.3g s",
                self.name,
                type(exc).__name__,
                self.retry_interval,
            )

    # -- the facts -------------------------------------------------------------------------

    async def read(self) -> tuple[str | None, int] | None:
        """``(opening, consecutive failures)``, or ``None`` when Redis is unavailable."""

        async def fetch(client: Any) -> tuple[str | None, int]:
            opened, failures = await client.mget(self.opened_key, self.failures_key)
            opening = _text(opened)
            if opening is not None:
                _from_ms(opening)  # nonsense fails here, as an unavailable Redis
            return opening, int(_text(failures) or 0)

        try:
            result: tuple[str | None, int] = await self._run(fetch)
        except _Unavailable:
            return None
        return result

    async def claim_probe(self, opening: str, token: str) -> bool | None:
        """Claim the probe of `opening`: True when ours, False when another process has
        it, ``None`` when Redis is unavailable (this process then decides alone)."""

        async def claim(client: Any) -> bool:
            taken = await client.set(self.probe_prefix + opening, token, nx=True, px=self.claim_ms)
            return bool(taken)

        try:
            claimed: bool = await self._run(claim)
        except _Unavailable:
            return None
        return claimed

    async def release_probe(self, opening: str, token: str) -> None:
        async def release(client: Any) -> None:
            script = self._script(client, _RELEASE)
            await script(keys=[self.probe_prefix + opening], args=[token])

        with contextlib.suppress(_Unavailable):  # the claim expires by itself
            await self._run(release)

    def release_later(self, opening: str, token: str) -> None:
        """Give a claim back from a task of its own (the caller is being cancelled)."""
        task = asyncio.get_running_loop().create_task(self.release_probe(opening, token))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def increment_failures(self) -> int | None:
        async def increment(client: Any) -> int:
            return int(await client.incr(self.failures_key))

        try:
            count: int = await self._run(increment)
        except _Unavailable:
            return None
        return count

    async def reset_failures(self) -> None:
        async def reset(client: Any) -> None:
            await client.set(self.failures_key, 0)

        with contextlib.suppress(_Unavailable):  # the next failure counts on from it
            await self._run(reset)

    async def transition(self, expected: str | None, new: str | None) -> tuple[bool, str | None]:
        """Move the shared opening from `expected` to `new` (``None``: closed) if it is
        still `expected`. Returns ``(True, what is stored afterwards)``, or ``(False,
        None)`` when Redis is unavailable."""

        async def move(client: Any) -> str | None:
            script = self._script(client, _TRANSITION)
            stored = await script(
                keys=[self.opened_key, self.failures_key], args=[expected or "", new or ""]
            )
            opening = _text(stored) or None
            if opening is not None:
                _from_ms(opening)
            return opening

        try:
            stored: str | None = await self._run(move)
        except _Unavailable:
            return False, None
        return True, stored

    async def aclose(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        client, self._client = self._client, None
        if client is not None and self._url is not None:
            try:
                await client.aclose()
            except Exception as exc:  # closing a dead connection is no failure of ours
                _logger.debug("circuit breaker %r: closing Redis: %s", self.name, type(exc))


def _connector(timeout: float) -> Callable[[str], Any]:
    """Makes a client for a URL. The modules are imported now, while the pipeline is
    built, not inside a request's first Redis call (where importing would eat into its
    timeout); connecting waits for that first call."""
    import redis.asyncio as redis_asyncio
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    def connect(url: str) -> Any:
        return redis_asyncio.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            # Our own bound is one try within `redis_timeout`: no hidden retries.
            retry=Retry(NoBackoff(), 0),
        )

    return connect


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode()
    return str(value)
