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
* with ``redis=`` the state lives in Redis (`pybreaker.CircuitRedisStorage`), shared by
  every process using the same breaker name. Its calls are synchronous and short; keep the
  Redis server close (it is consulted on every call);
* state changes go to `on_state_change(name, old, new)`, become events
  (`chat_pipeline.circuit_breaker.state_change`) on the current span and count in the
  `chat_pipeline.circuit_breaker.state_changes` metric.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, ClassVar

import pybreaker
from opentelemetry import metrics, trace
from pydantic import Field, StringConstraints

from pipeline import _scope
from pipeline._settings import Settings
from pipeline._streams import StreamEnd, StreamWatcher, forward
from pipeline.client import ChatClient, DelegatingChatClient, client_name
from pipeline.errors import AttemptTimeoutError, CircuitOpenError, FailureKind, classify
from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages

__all__ = [
    "BreakerSettings",
    "STATE_CHANGE_EVENT",
    "STATE_CHANGE_METRIC",
    "CircuitBreakerChatClient",
    "StateChangeListener",
    "counts_as_deployment_failure",
]

STATE_CHANGE_EVENT = "chat_pipeline.circuit_breaker.state_change"
STATE_CHANGE_METRIC = "chat_pipeline.circuit_breaker.state_changes"
BREAKER_NAME = "chat_pipeline.circuit_breaker.name"
BREAKER_FROM = "chat_pipeline.circuit_breaker.from"
BREAKER_TO = "chat_pipeline.circuit_breaker.to"

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


def counts_as_deployment_failure(exc: BaseException) -> bool:
    """Default `counts`: rate limits, transient, invalid-response and unknown failures open
    the circuit."""
    return isinstance(exc, Exception) and classify(exc) in _DEPLOYMENT_FAILURES


class _StateChangeAdapter(pybreaker.CircuitBreakerListener):
    def __init__(self, listener: StateChangeListener | None, meter_provider: Any) -> None:
        from pipeline import __version__

        self._listener = listener
        meter = metrics.get_meter("chat_pipeline.breaker", __version__, meter_provider)
        self._changes = meter.create_counter(
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
    seconds; `counts` decides what counts (code only); `redis` (a URL or a client) shares
    its state between processes under `name`; `on_state_change(name, old, new)` hears every
    state change (code only)."""

    code_only: ClassVar[frozenset[str]] = frozenset({"counts", "on_state_change"})

    fail_max: Annotated[int, Field(ge=1)] = 5
    reset_timeout: Annotated[float, Field(gt=0)] = 30.0
    name: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)] | None = None
    counts: Callable[[BaseException], bool] = counts_as_deployment_failure
    redis: Any = None
    on_state_change: Callable[[str, str, str], None] | None = None


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
        storage = None
        if self.settings.redis is not None:
            storage = pybreaker.CircuitRedisStorage(
                pybreaker.STATE_CLOSED, _redis_client(self.settings.redis), namespace=self.name
            )
        self._now = now or (lambda: datetime.now(UTC))
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
        """``closed``, ``open`` or ``half-open``, as the (possibly shared) storage says."""
        return str(self.breaker.current_state)

    def describe_layer(self) -> str:
        return f"CircuitBreakerChatClient({self.name})"

    # -- the state machine, one short synchronous step at a time --------------------------

    def _open_error(self) -> CircuitOpenError:
        return CircuitOpenError(f"circuit open for {self.name!r}", provider=self.name)

    def _admit(self) -> bool:
        """Let a call through or raise `CircuitOpenError`; True when the call is a probe."""
        breaker = self.breaker
        with breaker._lock:
            state = breaker.state  # re-reads shared storage and notices remote changes
            if state.name == pybreaker.STATE_OPEN:
                opened_at = breaker._state_storage.opened_at
                if opened_at is not None and self._now() < opened_at + timedelta(
                    seconds=breaker.reset_timeout
                ):
                    raise self._open_error()
                breaker.half_open()
                state = breaker.state
            if state.name == pybreaker.STATE_HALF_OPEN:
                if self._probe_in_flight:
                    raise self._open_error()
                self._probe_in_flight = True
                return True
            return False

    def _record(self, probe: bool, error: BaseException | None) -> None:
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
            self._record(probe, AttemptTimeoutError(f"{self.name!r} did not answer in time"))
        else:
            self._release(probe)

    def _release(self, probe: bool) -> None:
        if probe:
            with self.breaker._lock:
                self._probe_in_flight = False

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
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
        return forward(
            lambda: self.inner.get_streaming_response(messages, options), _BreakerWatch(self)
        )


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


def _redis_client(redis: Any) -> Any:
    if isinstance(redis, str):
        import redis as redis_module

        return redis_module.Redis.from_url(redis)
    return redis
