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
same breaker `name` and Redis shares one breaker. pybreaker still runs the state machine in
each process; the facts that must agree (consecutive failures, when the circuit opened, the
half-open probe's claim) live in Redis, kept by `middleware._breaker_redis` (its docstring
has the keys and the scripts). Each call reads them once and writes only on a counted
failure, a transition or a reset. Redis calls never block the event loop and each is
bounded by `redis_timeout`. When Redis is unreachable, slow, or answers nonsense, the
breaker fails open: the call proceeds on this process's own breaker state (what it last saw
of the shared state plus its own outcomes), a warning without request content is logged
(when an outage starts, then at most once a minute), and Redis is tried again after
`redis_retry_interval` seconds; a Redis error never reaches the caller. Building a pipeline
never contacts Redis (a server that is down then is fine); a malformed URL is a
`ValueError` at construction. When Redis answers again, its state wins over what this
process decided alone.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, ClassVar

import pybreaker
from opentelemetry import trace
from pydantic import Field, StringConstraints, field_validator

from middleware._breaker_redis import RedisBreakerState, from_ms, to_ms
from pipeline import _redis, _scope
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
        return None if value is None else _redis.check(value)


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
        self._shared: RedisBreakerState | None = None
        storage = None
        if self.settings.redis is not None:
            self._shared = RedisBreakerState(
                self.settings.redis,
                self.name,
                timeout=self.settings.redis_timeout,
                retry_interval=self.settings.redis_retry_interval,
                probe_claim_ttl=self.settings.probe_claim_ttl,
            )
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
            storage.opened_at = from_ms(opened)
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
            ticket = _Ticket(self._admit(), facts is not None and facts.failures > 0)
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
            count = await shared.count_failure()
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
                await shared.count_success()
            elif ticket.claim is not None:
                await shared.release_probe(ticket.claim, ticket.token)
            return
        new = None if after == _CLOSED else to_ms(opened_at or self._now())
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
