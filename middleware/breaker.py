"""The circuit-breaker layer: stop calling a deployment that keeps failing.

Only the deployment's own failures count; an open circuit fails a call at once with
`CircuitOpenError`, before any output, so failover moves on; with ``redis=`` every process
using the breaker's name shares one breaker, and goes on with its own state while Redis is
away.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, ClassVar

import pybreaker
from opentelemetry import trace
from pydantic import Field, StringConstraints, ValidationInfo, field_validator

from middleware._breaker_redis import RedisBreakerState, SharedWindow, from_ms, to_ms
from middleware._breaker_window import RatioPolicy, SlidingWindow
from pipeline import _redis, _scope
from pipeline._semconv import (
    BREAKER_FROM,
    BREAKER_NAME,
    BREAKER_REASON,
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
        FailureKind.QUOTA_EXHAUSTED,
        FailureKind.TRANSIENT,
        FailureKind.INVALID_RESPONSE,
        FailureKind.UNKNOWN,
    }
)
_CLOSED = pybreaker.STATE_CLOSED
_OPEN = pybreaker.STATE_OPEN
_HALF_OPEN = pybreaker.STATE_HALF_OPEN


def counts_as_deployment_failure(exc: BaseException) -> bool:
    """Default `counts`: rate limits, exhausted quotas, transient, invalid-response and
    unknown failures open the circuit."""
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
        self._changes.add(1, attributes)
        reason = getattr(cb, "opening_reason", None)
        event = attributes if reason is None else {**attributes, BREAKER_REASON: reason}
        trace.get_current_span().add_event(STATE_CHANGE_EVENT, event)
        if self._listener is not None:
            self._listener(cb.name or "", old_name, new.name)


class _WindowReset(pybreaker.CircuitBreakerListener):
    """Empties the window at every state change: it counts while closed, afresh."""

    def __init__(self, window: SlidingWindow | SharedWindow) -> None:
        self.window = window

    def state_change(self, cb: pybreaker.CircuitBreaker, old: Any, new: Any) -> None:
        self.window.clear()


class _Breaker(pybreaker.CircuitBreaker):
    """pybreaker's breaker with an injectable clock for `opened_at`, so timing is testable,
    and the reason of an opening (for the state-change event)."""

    def __init__(self, now: Callable[[], datetime], **options: Any) -> None:
        self._now = now
        self.opening_reason: str | None = None
        super().__init__(**options)

    def open(self, reason: str | None = None) -> bool:
        with self._lock:
            # pybreaker opens on its own for `fail_max` (closed) and a failed probe.
            if reason is None:
                reason = "probe" if self._state.name == _HALF_OPEN else "fail_max"
            self.opening_reason = reason
            try:
                throw_new_error = bool(super().open())
            finally:
                self.opening_reason = None
            self._state_storage.opened_at = self._now()
            return throw_new_error


class BreakerSettings(Settings):
    """One breaker: `fail_max` consecutive counted failures open it for `reset_timeout`
    seconds; `counts` decides what counts (code only); `on_state_change(name, old, new)`
    hears every state change (code only).

    Ratio policies (off unless set), over the calls that ended in the last `window`
    seconds, once there are at least `minimum_calls` of them: `failure_ratio` opens the
    circuit when that share of them failed, and `slow_call_duration` (seconds) with
    `slow_call_ratio` when that share took longer than `slow_call_duration` (see the
    module docstring for what a call's duration is). Ratios are in (0, 1];
    `slow_call_ratio` given without `slow_call_duration` is an error (it would do nothing).

    `redis` (a ``redis://``, ``rediss://`` or ``unix://`` URL, or a ``redis.asyncio``
    client) shares the state between processes under `name`; each Redis call is bounded
    by `redis_timeout` seconds; after a Redis failure the breaker uses this process's state
    for `redis_retry_interval` seconds before trying Redis again; a half-open probe's claim
    expires after `probe_claim_ttl` seconds (longer than a call may take).
    """

    code_only: ClassVar[frozenset[str]] = frozenset({"counts", "on_state_change"})

    fail_max: Annotated[int, Field(ge=1)] = 5
    """Consecutive counted failures that open the circuit."""
    # Bounded so the open time is a valid date offset (a year is plenty).
    reset_timeout: Annotated[float, Field(gt=0, le=31_536_000)] = 30.0
    """Seconds the circuit stays open before one probe call is let through (its success closes it,
    its failure opens it again)."""
    name: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)] | None = None
    """The breaker's name, in telemetry and logs, and the key replicas share it under in Redis (in a
    file: the route's name unless set)."""
    counts: Callable[[BaseException], bool] = counts_as_deployment_failure
    """Which failures count towards opening the circuit (code only; default: deployment failures, an
    attempt the router cut for time included)."""
    redis: Any = None
    """A `redis://`, `rediss://` or `unix://` URL, or a `redis.asyncio` client, to share the
    breaker's state between processes under `name` (in code; a file names the URL's variable with
    `redis_url_env`)."""
    redis_timeout: Annotated[float, Field(gt=0, le=60)] = 0.25
    """Seconds each Redis call of a shared breaker may take before the breaker goes on with this
    process's own state."""
    redis_retry_interval: Annotated[float, Field(ge=0, le=3600)] = 1.0
    """Seconds a shared breaker uses this process's state after a Redis failure before it tries
    Redis again."""
    probe_claim_ttl: Annotated[float, Field(ge=0.001, le=86_400)] = 60.0
    """Seconds a half-open probe's claim in Redis lasts, so a replica that dies mid-probe does not
    keep the circuit open (longer than a call may take)."""
    on_state_change: Callable[[str, str, str], None] | None = None
    """Called as `on_state_change(name, old, new)` on every state change (code only)."""
    failure_ratio: Annotated[float, Field(gt=0, le=1)] | None = None
    """Open the circuit when this share of the calls in the window failed (a ratio policy, off
    unless set)."""
    minimum_calls: Annotated[int, Field(ge=1)] = 20
    """Calls the window must hold before a ratio policy may open the circuit."""
    window: Annotated[float, Field(gt=0, le=86_400)] = 30.0
    """Seconds of ended calls the ratio policies look at."""
    slow_call_duration: Annotated[float, Field(gt=0, le=86_400)] | None = None
    """Seconds after which a call counts as slow (for a stream: the time to its first update); with
    `slow_call_ratio`, a ratio policy (off unless set)."""
    slow_call_ratio: Annotated[float, Field(gt=0, le=1)] = 0.5
    """Open the circuit when this share of the calls in the window were slow (needs
    `slow_call_duration`)."""

    @field_validator("redis")
    @classmethod
    def _redis_url_or_async_client(cls, value: Any) -> Any:
        return None if value is None else _redis.check(value)

    @field_validator("slow_call_ratio")
    @classmethod
    def _slow_call_ratio_needs_a_duration(cls, value: float, info: ValidationInfo) -> float:
        # Checked only when the ratio is given (a default is not validated); a duration
        # that failed its own check is not in `data` and is reported on its own.
        if "slow_call_duration" in info.data and info.data["slow_call_duration"] is None:
            raise ValueError("needs slow_call_duration (the time after which a call is slow)")
        return value


def _ratio_policy(settings: BreakerSettings) -> RatioPolicy | None:
    """The window's policy, or ``None`` when neither ratio is set."""
    if settings.failure_ratio is None and settings.slow_call_duration is None:
        return None
    return RatioPolicy(
        window=settings.window,
        minimum_calls=settings.minimum_calls,
        failure_ratio=settings.failure_ratio,
        slow_call_ratio=None if settings.slow_call_duration is None else settings.slow_call_ratio,
    )


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

    Keyword `options` are the fields of `BreakerSettings`. Three clocks, each injectable so
    a test can drive it:

    * `now` (``datetime.now(UTC)`` unless given): when the circuit opened and when a probe
      is due (with ``redis``, the opening is shared, so replicas' wall clocks should agree,
      as NTP keeps them);
    * `clock` (seconds, `time.monotonic` unless given): how long a call took (slow calls)
      and the buckets of this process's window. Monotonic, so a wall clock stepped back or
      forward neither drops outcomes from the window nor makes calls in flight slow;
    * `redis_clock` (seconds; with ``redis`` and a ratio policy): the shared window's
      time. Unless given, Redis' own (``TIME``, read inside the script that adds and reads
      the window), so replicas whose clocks differ or jump still put outcomes in the same
      buckets: each sends its outcomes numbered by its own `clock`, and the script moves
      them onto Redis' time (and the buckets it returns back onto the caller's) by the
      difference of the two current buckets, measured in that call. Outcomes are then off
      by at most that call's round trip; only Redis' own clock jumping moves the shared
      window, which then starts afresh (a jump forward empties it, one back ignores the
      buckets ahead of it until they expire): the breaker opens late, never spuriously.
    """

    keeps_raw_answers = True  # observes, never changes answers (`pipeline._forward`)

    def __init__(
        self,
        inner: ChatClient,
        settings: BreakerSettings | None = None,
        *,
        meter_provider: Any = None,
        now: Callable[[], datetime] | None = None,
        clock: Callable[[], float] | None = None,
        redis_clock: Callable[[], float] | None = None,
        leave_open: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(inner, leave_open=leave_open)
        self.settings = BreakerSettings.from_options(settings, options)
        self.name = self.settings.name or client_name(inner)
        self._now = now or (lambda: datetime.now(UTC))
        self._seconds: Callable[[], float] = clock or time.monotonic
        self._reset_after = timedelta(seconds=self.settings.reset_timeout)
        self._policy = _ratio_policy(self.settings)
        self._slow_after = self.settings.slow_call_duration
        self._shared: RedisBreakerState | None = None
        storage = None
        window: SlidingWindow | SharedWindow | None = None
        if self.settings.redis is not None:
            policy = self._policy
            self._shared = RedisBreakerState(
                self.settings.redis,
                self.name,
                timeout=self.settings.redis_timeout,
                retry_interval=self.settings.redis_retry_interval,
                probe_claim_ttl=self.settings.probe_claim_ttl,
                window=None if policy is None else self.settings.window,
                bucket=None if policy is None else (lambda: policy.bucket(self._seconds())),
                shared_bucket=(
                    None
                    if policy is None or redis_clock is None
                    else (lambda: policy.bucket(redis_clock()))
                ),
            )
            storage = self._shared.local
            window = self._shared.window
        elif self._policy is not None:
            window = SlidingWindow()
        self._window = window
        counts = self.settings.counts
        listeners: list[pybreaker.CircuitBreakerListener] = [
            _StateChangeAdapter(self.settings.on_state_change, meter_provider)
        ]
        if window is not None:
            listeners.append(_WindowReset(window))
        self.breaker = _Breaker(
            self._now,
            fail_max=self.settings.fail_max,
            reset_timeout=self.settings.reset_timeout,
            exclude=[lambda exc: not counts(exc)],
            listeners=listeners,
            state_storage=storage,
            name=self.name,
            throw_new_error_on_trip=False,
        )
        self._probe_in_flight = False
        # This process alone, no window and no slow calls: a success while closed changes
        # nothing but a failure count that may already be zero (pybreaker's closed state
        # resets it; our own listener hears nothing of successes), so `_record` can tell
        # that without the state machine.
        self._plain = window is None and self._slow_after is None and storage is None
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

    def _open_error(self, opened_at: datetime | None = None) -> CircuitOpenError:
        # `retry_after`: when the breaker lets a probe through (so a gateway can tell its
        # client when a retry may help); None when that is not known.
        retry_after = None
        if opened_at is not None:
            remaining = (opened_at + self._reset_after - self._now()).total_seconds()
            retry_after = max(0.0, remaining)
        return CircuitOpenError(
            f"circuit open for {self.name!r}", provider=self.name, retry_after=retry_after
        )

    def _admit(self) -> bool:
        """Let a call through or raise `CircuitOpenError`; True when the call is a probe."""
        breaker = self.breaker
        if breaker._state.name == _CLOSED and breaker._state_storage.state == _CLOSED:
            return False  # (what `breaker.state` would say, with nothing to bring up to date)
        with breaker._lock:
            state = breaker.state
            if state.name == _OPEN:
                opened_at = breaker._state_storage.opened_at
                if opened_at is not None and self._now() < opened_at + self._reset_after:
                    raise self._open_error(opened_at)
                breaker.half_open()
                state = breaker.state
            if state.name == _HALF_OPEN:
                if self._probe_in_flight:
                    raise self._open_error()
                self._probe_in_flight = True
                return True
            return False

    def _started(self) -> float:
        """When a call started, for telling whether it was slow (0 when nothing is)."""
        return self._seconds() if self._slow_after is not None else 0.0

    def _slow_since(self, started: float) -> bool:
        slow_after = self._slow_after
        return slow_after is not None and self._seconds() - started > slow_after

    def _slow_stream(self, started: float, first: float | None) -> bool:
        """Whether a stream was slow: by the time to its first update (`first`), or to
        now if it ended before one."""
        if first is None:
            return self._slow_since(started)
        slow_after = self._slow_after
        return slow_after is not None and first - started > slow_after

    def _record(
        self, probe: bool, error: BaseException | None, slow: bool = False, windowed: bool = False
    ) -> None:
        """Record how an admitted call ended (`slow`: it took longer than
        `slow_call_duration`; `windowed`: it is already in the window)."""
        breaker = self.breaker
        if error is None and not probe and self._plain:
            storage = breaker._state_storage
            if (
                breaker._state.name == _CLOSED
                and storage.state == _CLOSED
                and storage.counter == 0
                and len(breaker._listeners) == 1  # ours alone: none added that hears successes
            ):
                return
        if isinstance(error, UnsendableRequestError):
            self._release(probe)  # never sent: the deployment was not asked
            return
        with breaker._lock:
            closed = self._window is not None and breaker._state.name == _CLOSED
            if probe:
                self._probe_in_flight = False
                if slow and breaker._state.name == _HALF_OPEN:
                    breaker.open("probe")  # still slow: as a failed probe
                    return
            if error is None:
                breaker.state._handle_success()
            else:
                try:
                    breaker.state._handle_error(error, reraise=False)
                except BaseException as raised:
                    # pybreaker re-raises the failure from on_failure when it trips the
                    # circuit; the caller raises it anyway, so only a different error
                    # escapes.
                    if raised is not error:
                        raise
            # The window counts the calls that ended while it was closed, and stays so.
            if closed and breaker._state.name == _CLOSED:
                self._check_window(None if windowed else (error, slow))

    def _count(self, error: BaseException | None, slow: bool, bucket: int | None = None) -> None:
        """Count an outcome in the window (under the lock, while closed)."""
        assert self._policy is not None
        assert self._window is not None
        if bucket is None:
            bucket = self._policy.bucket(self._seconds())
        failed = error is not None and self.breaker.is_system_error(error)
        self._window.add(bucket, 1, int(failed), int(slow))

    def _check_window(self, outcome: tuple[BaseException | None, bool] | None = None) -> bool:
        """Count `outcome` (how a call ended, and whether it was slow) if given, then open
        the circuit if the window passes a threshold (under the lock, while closed);
        whether it did."""
        assert self._window is not None
        policy = self._policy
        assert policy is not None
        bucket = policy.bucket(self._seconds())
        if outcome is not None:
            self._count(*outcome, bucket)
        reason = policy.passed(self._window.counts(bucket))
        if reason is None:
            return False
        self.breaker.open(reason)
        return True

    def _cancelled(self, probe: bool, slow: bool) -> None:
        """A call cancelled under way: the router cutting it for time is a failure of the
        deployment (it did not answer in time); the caller cancelling is neither."""
        if _scope.attempt_timed_out():
            self._record(probe, self._timed_out(), slow)
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
        slow_after = self._slow_after
        started = 0.0 if slow_after is None else self._seconds()
        try:
            response = await self.inner.get_response(messages, options)
        except asyncio.CancelledError:
            self._cancelled(probe, self._slow_since(started))
            raise
        except BaseException as exc:
            self._record(probe, exc, self._slow_since(started))
            raise
        self._record(probe, None, slow_after is not None and self._seconds() - started > slow_after)
        return response

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        watcher: StreamWatcher
        if self._slow_after is None:
            watcher = _BreakerWatch(self) if self._shared is None else _SharedBreakerWatch(self)
        else:
            watcher = (
                _TimedBreakerWatch(self) if self._shared is None else _TimedSharedBreakerWatch(self)
            )
        return forward(lambda: self.inner.get_streaming_response(messages, options), watcher)

    # -- the shared breaker: the same steps, with the shared facts read and written around
    # -- them (never under the lock)

    async def _get_response_shared(
        self, messages: Messages, options: ChatOptions | None
    ) -> ChatResponse:
        ticket = await self._admit_shared()
        started = self._started()
        try:
            response = await self.inner.get_response(messages, options)
        except asyncio.CancelledError:
            await self._cancelled_shared(ticket, self._slow_since(started))
            raise
        except BaseException as exc:
            await self._record_shared(ticket, exc, self._slow_since(started))
            raise
        await self._record_shared(ticket, None, self._slow_since(started))
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
        breaker = self.breaker
        with breaker._lock:
            if facts is not None:
                self._adopt(*facts)
            # The read brought the other processes' outcomes: together they may pass a
            # threshold that none of them passed alone.
            if (
                facts is not None
                and self._window is not None
                and breaker._state.name == _CLOSED
                and self._check_window()
            ):
                tripped_at = breaker._state_storage.opened_at
            else:
                tripped_at = None
                ticket = _Ticket(self._admit(), facts is not None and facts.failures > 0)
                opening = self._opening if ticket.probe and facts is not None else None
        if tripped_at is not None:
            await self._publish(None, _OPEN, tripped_at)
            raise self._open_error(tripped_at)
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

    async def _record_shared(
        self, ticket: _Ticket, error: BaseException | None, slow: bool = False
    ) -> None:
        if isinstance(error, UnsendableRequestError):
            await self._release_shared(ticket)  # never sent: the deployment was not asked
            return
        shared = self._shared
        assert shared is not None
        breaker = self.breaker
        counted = error is not None and breaker.is_system_error(error)
        windowed = False
        if self._window is not None:
            # In the window before any write, so the write carries it to Redis.
            with breaker._lock:
                if breaker._state.name == _CLOSED:
                    self._count(error, slow)
                    windowed = True
        count = None
        if counted and breaker._state.name == _CLOSED:
            count = await shared.count_failure()
        with breaker._lock:
            before = breaker._state.name
            if count is not None and before == _CLOSED:
                shared.local.set_counter(count - 1)  # pybreaker adds this one
            self._record(ticket.probe, error, slow, windowed)
            after = breaker._state.name
            opened_at = breaker._state_storage.opened_at
            expected = None if before == _CLOSED else self._opening
        if after == before:
            if not counted and after == _CLOSED and ticket.failures_seen:
                await shared.count_success()
            elif ticket.claim is not None:
                await shared.release_probe(ticket.claim, ticket.token)
            return
        await self._publish(expected, after, opened_at)

    async def _publish(self, expected: str | None, after: str, opened_at: datetime | None) -> None:
        """Tell Redis of this process's transition from the opening `expected` (``None``:
        closed) to `after`; when another process's transition came first, take its view."""
        shared = self._shared
        assert shared is not None
        new = None if after == _CLOSED else to_ms(opened_at or self._now())
        available, stored = await shared.transition(expected, new)
        breaker = self.breaker
        with breaker._lock:
            if not available or stored == new:
                self._opening = new
            elif breaker._state.name == after:
                # Another process's transition came first (it opened the circuit first,
                # or re-opened it after a newer probe): take its view.
                self._adopt(stored, shared.local.counter)

    async def _cancelled_shared(self, ticket: _Ticket, slow: bool) -> None:
        """`_cancelled` for a shared breaker (decided when awaited, before any await)."""
        if _scope.attempt_timed_out():
            await self._record_shared(ticket, self._timed_out(), slow)
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

    def slow(self) -> bool:
        return False

    def end(self, how: StreamEnd, error: BaseException | None) -> None:
        if how == "completed":
            self.layer._record(self.probe, None, self.slow())
        elif how == "failed":
            self.layer._record(self.probe, error, self.slow())
        elif how == "canceled":
            self.layer._cancelled(self.probe, self.slow())
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

    def slow(self) -> bool:
        return False

    def end(self, how: StreamEnd, error: BaseException | None) -> Awaitable[None]:
        if how == "completed":
            return self.layer._record_shared(self.ticket, None, self.slow())
        if how == "failed":
            return self.layer._record_shared(self.ticket, error, self.slow())
        if how == "canceled":
            return self.layer._cancelled_shared(self.ticket, self.slow())
        return self.layer._release_shared(self.ticket)


# With `slow_call_duration`, a stream's watcher times it from admission to its first update
# (`forward` calls `update` only on a watcher that overrides it: the others pay nothing
# per update, nor for reading the clock).


class _TimesFirstUpdate:
    """What a timed watcher adds: when its first update came, and whether it was slow."""

    layer: CircuitBreakerChatClient
    started: float
    first: float | None

    def update(self, update: ChatResponseUpdate) -> None:
        if self.first is None:
            self.first = self.layer._seconds()

    def slow(self) -> bool:
        return self.layer._slow_stream(self.started, self.first)


class _TimedBreakerWatch(_TimesFirstUpdate, _BreakerWatch):
    __slots__ = ("first", "started")

    def start(self) -> None:
        super().start()
        self.started = self.layer._seconds()
        self.first = None


class _TimedSharedBreakerWatch(_TimesFirstUpdate, _SharedBreakerWatch):
    __slots__ = ("first", "started")

    async def _start(self) -> None:
        await super()._start()
        self.started = self.layer._seconds()
        self.first = None
