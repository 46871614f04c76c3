"""The attempt engine every router runs on.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import abc
import asyncio
import inspect
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import CoroutineType
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Protocol

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue
from pydantic import Field

from middleware.routing._telemetry import RouteTelemetry
from middleware.routing.context import (
    AttemptOutcome,
    FailoverAttempt,
    Route,
    RoutingContext,
    RoutingSelection,
    SelectionResult,
    attempt_record,
    with_instructions,
)
from pipeline import _scope
from pipeline._retry_signal import NOTHING as NO_SIGNAL
from pipeline._retry_signal import RetrySignal
from pipeline._retry_signal import attach as attach_retry_signal
from pipeline._retry_signal import signal_of as retry_signal_of
from pipeline._semconv import ROUTE_SELECTION
from pipeline._settings import Settings
from pipeline._streams import caller_cancelling, close_stream, ending_of, left_open
from pipeline.client import ChatClient, circuit_open, client_name, ensure_chat_client, metadata_of
from pipeline.errors import (
    AttemptTimeoutError,
    RequestBudgetExceededError,
    RequestTimeoutError,
    RoutingError,
    is_failover_eligible,
)
from pipeline.pricing import (
    Cost,
    Price,
    priced_attempt,
    reached_provider,
    response_characters,
    streamed_characters,
)
from pipeline.types import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    Messages,
    UsageDetails,
    as_messages,
)

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

    from middleware.routing.affinity import SessionAffinity

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "ONE_ATTEMPT",
    "AttemptEngine",
    "AttemptState",
    "FailoverPolicy",
    "FailoverSettings",
    "MayFailOver",
    "OnAttempt",
    "RequestState",
]

DEFAULT_MAX_ATTEMPTS = 10
"""Attempts per request a failover router makes unless told otherwise."""

FailoverPolicy = Callable[[BaseException], bool | Awaitable[bool]]


class FailoverSettings(Settings):
    """The limits and policy of a failover router, each captured when a request starts.

    * `max_attempts_per_request`: positive, or ``None`` (explicitly) for no limit;
    * `request_timeout`: seconds for the whole request, every attempt and retry included;
    * `min_attempt_budget`: no new attempt starts with less time than this left;
    * `max_provider_calls_per_request`: attempts plus retries inside routes;
    * `attempt_timeout`: seconds one attempt may take before the router cuts it (for a
      stream: until its first update; once output reached the caller nothing can move to
      a backup, so only the request deadline applies);
    * `should_failover`: whether a failure before output may move on (code only).

    With a `request_timeout` and a `min_attempt_budget`, an attempt that a backup could
    still follow is cut when only `min_attempt_budget` is left, so the backup gets that
    time. A cut attempt fails with `AttemptTimeoutError` (a transient failure: the route's
    breaker counts it, the router may fail over); when the request's own deadline passes,
    the request fails with `RequestTimeoutError`. Both are `TimeoutError`s.
    """

    code_only: ClassVar[frozenset[str]] = frozenset({"should_failover"})

    max_attempts_per_request: Annotated[int, Field(gt=0)] | None = DEFAULT_MAX_ATTEMPTS
    """Attempts a request may make in all (in code, `None` passed explicitly: no limit); the ordered
    and balanced routers never make more attempts than they have routes."""
    request_timeout: Annotated[float, Field(gt=0)] | None = None
    """Seconds the whole request may take, every attempt and retry included; past it the request
    fails with `RequestTimeoutError` (unset: no deadline)."""
    min_attempt_budget: Annotated[float, Field(ge=0)] = 0.0
    """Seconds: no new attempt starts with less time than this left of `request_timeout`, and an
    attempt a backup could still follow is cut when only this much is left."""
    max_provider_calls_per_request: Annotated[int, Field(gt=0)] | None = None
    """Provider calls a request may make in all, attempts plus retries inside routes (unset: no
    limit)."""
    attempt_timeout: Annotated[float, Field(gt=0)] | None = None
    """Seconds an attempt may go without its first update (for a whole response: without the
    response) before the router cuts it with `AttemptTimeoutError` and moves on; once output reached
    the caller it no longer applies (unset: no limit)."""
    should_failover: Callable[[BaseException], Any] = is_failover_eligible
    """Whether a failure before output, inside every limit, may move to another attempt (code only;
    default: the failure kinds that allow failover)."""


ONE_ATTEMPT = FailoverSettings(max_attempts_per_request=1)
"""The limits of a one-shot router: one attempt, no time or call budget of its own (the
enclosing request's budget, if any, still applies)."""


_Deadline = tuple[float, Literal["attempt", "selection", "reserve", "request"]]

# (OpenTelemetry context, request budget, attempt timeout, failover check, attempt mark)
# tokens, or None each.
_Tokens = tuple[Any, Any, Any, Any, Any]
_NO_TOKENS: _Tokens = (None, None, None, None, None)  # nothing was made current


def _held_against(
    timeout: asyncio.Timeout | None, deadline: _Deadline | None
) -> asyncio.Timeout | None:
    """The timeout layers beneath may hold against the route when it fires (a breaker
    counts it): not a limit the selection set, tighter than the route's own (a probe's)."""
    if deadline is not None and deadline[1] == "selection":
        return None
    return timeout


async def _in_turn(first: Awaitable[Any], then: Awaitable[Any] | None) -> None:
    await first
    if then is not None:
        await then


OnAttempt = Callable[[RoutingContext, FailoverAttempt, bool], Awaitable[None] | None]
"""Told of every attempt: ``(context, attempt, is_terminal)``; may return an awaitable."""
MayFailOver = Callable[[RoutingContext, BaseException], bool | Awaitable[bool]]
"""Whether a failure before output, inside every limit, may move to another attempt."""
Alternatives = Callable[[RoutingContext, str], bool]
"""Whether a route other than the running one (named) could still take the request."""


class AttemptWatch(Protocol):
    """What a router learns from one attempt as it runs (see `RequestState.watch`)."""

    def first_update(self) -> None:
        """The attempt produced its first update (or, not streaming, its response)."""

    def ended(
        self, outcome: AttemptOutcome, error: BaseException | None, usage: UsageDetails | None
    ) -> None:
        """The attempt ended (called once, before the attempt is reported)."""


Watch = Callable[["AttemptState"], AttemptWatch | None]
"""Makes the watch of an attempt that is starting (or None: nothing to watch)."""


@dataclass(slots=True, eq=False)
class RequestState:
    """One request's routing state: its context and what was captured when it started.

    `report` is how the telemetry layer above (if any) is told the routing story.
    """

    context: RoutingContext
    settings: FailoverSettings
    limit: int | None
    budget: _scope.RequestBudget | None
    report: _scope.RouteReport | None
    affinity: SessionAffinity | None = None
    on_attempt: OnAttempt | None = None
    may_fail_over: MayFailOver | None = None
    alternatives: Alternatives | None = None
    watch: Watch | None = None
    running: str | None = None  # the route of the attempt in progress
    # What the attempts that failed before output said about asking again, together.
    signal: RetrySignal = NO_SIGNAL
    # The request's attempt log (a spend layer or the gateway above opened it), taken when
    # the request starts: each attempt is priced and added to it as it ends.
    log: _scope.AttemptLog | None = field(default_factory=_scope.current_attempt_log)
    # The attempt of a router (or a logged call) above whose route this request runs in: its
    # records stand for that attempt, which is told so and adds none.
    within: _scope.AttemptMark | None = field(default_factory=_scope.current_attempt_mark)

    def room_for_another(self, needed: float) -> bool:
        """Whether the limits leave room for an attempt after the one in progress (not in
        ``context.attempts`` yet: it is number len + 1), with at least `needed` seconds."""
        if self.limit is not None and len(self.context.attempts) + 1 >= self.limit:
            return False
        budget = self.budget
        if budget is None:
            return True
        if budget.calls_left is not None and budget.calls_left <= 0:
            return False
        remaining = budget.remaining()
        return remaining is None or remaining >= max(needed, 1e-9)

    def failover_possible(self, error: BaseException) -> bool:
        """Whether the attempt in progress, failing now with `error` before any output,
        could be followed by another (what the request scope answers the layers beneath).
        A policy that can only answer asynchronously counts as no."""
        alternatives = self.alternatives
        running = self.running
        if alternatives is None or running is None:
            return False
        context = self.context
        if not self.room_for_another(self.settings.min_attempt_budget):
            return False
        if self.may_fail_over is not None:
            decision = self.may_fail_over(context, error)
            if inspect.isawaitable(decision):
                if inspect.iscoroutine(decision):
                    decision.close()
                return False
            if not decision:
                return False
        return alternatives(context, running)


@dataclass(slots=True, eq=False)
class AttemptState:
    """What the engine knows about the attempt in progress."""

    route_name: str
    client: ChatClient
    messages: list[ChatMessage]
    options: ChatOptions
    price: Price | None
    attributes: Mapping[str, AttributeValue] | None
    span: Span | None = None
    span_context: otel_context.Context | None = None
    cut_for_backup: bool = False  # the router cut it to keep time for a backup
    timeout: float | None = None  # the selection's own limit before the first update
    watch: AttemptWatch | None = None
    # Its number within the request, by start: set by `_begin` unless the router set it (a
    # router running attempts at once numbers them as they start, not as they end).
    number: int = 0
    # What its updates said so far (streaming): the usage reported, the model that served,
    # and, when the request is logged, the characters generated (an estimate's basis).
    usage: UsageDetails | None = None
    model: str | None = None
    characters: int = 0
    started_at: float = 0.0  # seconds since the epoch, when the request is logged
    # When the request is logged, the attempt is the current `AttemptMark` while its route
    # runs before output; `beneath` counts the records layers beneath logged for it.
    logged: bool = False
    beneath: int = 0

    def tally(self, update: ChatResponseUpdate, counting: bool) -> None:
        """Take what `update` says of the attempt's usage, model and output."""
        if update.usage is not None:
            self.usage = update.usage if self.usage is None else self.usage + update.usage
        if update.model_id is not None:
            self.model = update.model_id
        if counting:
            self.characters += streamed_characters(update)


class AttemptEngine(abc.ABC):
    """Runs each request of a router as attempts (see the module docstring).

    Subclasses implement `select_client`; a router that may fail over overrides
    `_new_request` (the default is a one-shot router's) and, with session affinity,
    `_affinity_routes`.
    """

    def __init__(
        self,
        *,
        name: str,
        clock: Callable[[], float] = time.perf_counter,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        self._router_name = name
        self._clock = clock
        self._telemetry = RouteTelemetry(tracer_provider, meter_provider)

    @abc.abstractmethod
    def select_client(
        self, context: RoutingContext
    ) -> SelectionResult | Awaitable[SelectionResult]:
        """Choose the client (or `Route`, or `RoutingSelection`) for the next attempt."""

    # -- what the router tells the engine ----------------------------------------------------

    def _new_request(self, context: RoutingContext) -> RequestState:
        """What a request starting now runs under (the caller then awaits `_prefer` when
        there is an affinity): here a one-shot router's one attempt, within the enclosing
        request's budget, if any."""
        budget = _scope.current_budget()
        return RequestState(context, ONE_ATTEMPT, 1, budget, _scope.current_report())

    def _affinity_routes(self) -> Mapping[str, Route]:
        """The routes a session's preferred route may name."""
        return {}

    def _standing_signal(self) -> RetrySignal:
        """What the router knows of when its routes may serve again beside what this
        request's attempts said (a balanced router: its routes' cooldowns)."""
        return NO_SIGNAL

    # -- the pieces of a request -------------------------------------------------------------

    def _context(
        self, messages: Messages, options: ChatOptions | None, *, streaming: bool
    ) -> RoutingContext:
        if options is not None and not isinstance(options, ChatOptions):
            raise TypeError(f"options must be ChatOptions or None, not {type(options).__name__}")
        return RoutingContext(
            as_messages(messages),
            options.clone() if options is not None else ChatOptions(),
            streaming=streaming,
        )

    def _new_budget(self, settings: FailoverSettings) -> _scope.RequestBudget | None:
        """The request's call and time budget, or `None` when no limit applies."""
        outer = _scope.current_budget()
        if settings.request_timeout is None and settings.max_provider_calls_per_request is None:
            return outer
        clock = self._clock
        deadline = None if settings.request_timeout is None else clock() + settings.request_timeout
        if outer is not None and outer.deadline is not None and outer.clock is clock:
            deadline = outer.deadline if deadline is None else min(deadline, outer.deadline)
        return _scope.RequestBudget(settings.max_provider_calls_per_request, deadline, clock)

    async def _prefer(self, request: RequestState, affinity: SessionAffinity) -> None:
        """Set ``context.preferred_route`` from the session's affinity, if it still holds
        (the store's call is bounded by the request's deadline too)."""
        context = request.context
        session = context.options.session_id
        if session is None:
            return
        name = await affinity.preferred(session, request.budget)
        route = self._affinity_routes().get(name) if name is not None else None
        if route is not None and not circuit_open(route.client):
            context.preferred_route = name

    # The router's own selection as a plain function, when `select_client` is that router's
    # and only wraps it in a coroutine (the ordered router): each attempt is chosen without
    # a coroutine of its own. A subclass that overrides `select_client` is asked as usual.
    _select_now: Callable[[RoutingContext], SelectionResult] | None = None

    async def _select(self, context: RoutingContext) -> AttemptState:
        result = self.select_client(context)
        if type(result) is CoroutineType or (
            result is not None
            and not isinstance(result, Route | RoutingSelection)
            and inspect.isawaitable(result)
        ):
            result = await result
        return self._attempt_of(context, result)

    def _attempt_of(self, context: RoutingContext, result: object) -> AttemptState:
        """The attempt on what the selector chose (awaited, if it had to be)."""
        options: ChatOptions | None = None
        attributes: Mapping[str, AttributeValue] | None = None
        timeout: float | None = None
        if isinstance(result, RoutingSelection):
            options = result.options
            attributes = result.attributes
            timeout = result.attempt_timeout
            result = result.client
        if result is None:
            raise RoutingError(f"{self._router_name}: the selector chose no client")
        price = None
        messages = context.messages
        if isinstance(result, Route):
            name, client, price = result.name, result.client, result.price
            if result.instructions is not None:
                messages = with_instructions(messages, result.instructions)
        else:
            client = ensure_chat_client(result, "the selected client")
            name = client_name(client)
        if options is None:
            # Each attempt gets its own copy, so nothing one attempt's layers do to its
            # options can reach the next attempt or the request baseline.
            options = context.options.clone()
        elif not isinstance(options, ChatOptions):
            raise TypeError("RoutingSelection.options must be ChatOptions or None")
        # Positionally, up to `timeout` (a keyword costs the call a search of the names).
        return AttemptState(
            name, client, messages, options, price, attributes, None, None, False, timeout
        )

    async def _is_terminal(
        self,
        request: RequestState,
        attempt: AttemptState,
        error: BaseException,
        outcome: AttemptOutcome,
    ) -> bool:
        if outcome != "failed_before_output" or not isinstance(
            error, Exception | asyncio.CancelledError
        ):
            return True
        context = request.context
        needed = 0.0 if attempt.cut_for_backup else request.settings.min_attempt_budget
        if not request.room_for_another(needed):
            return True
        may_fail_over = request.may_fail_over
        if may_fail_over is None:
            return True
        decision = may_fail_over(context, error)
        if inspect.isawaitable(decision):
            decision = await decision
        return not decision

    def _begin(self, request: RequestState, attempt: AttemptState) -> None:
        """Spend the attempt's provider call and start its span."""
        budget = request.budget
        if budget is not None and not budget.take_call():
            exhausted = RequestBudgetExceededError(
                f"{self._router_name}: the request used every provider call it was allowed"
            )
            attach_retry_signal(exhausted, request.signal.joined(self._standing_signal()))
            raise exhausted
        if not attempt.number:
            attempt.number = len(request.context.attempts) + 1
        telemetry = self._telemetry
        if telemetry.traced():
            span = telemetry.start(
                attempt.route_name,
                attempt.number,
                attempt.client,
                attempt.options.model_id,
            )
            attempt.span = span
            if attempt.attributes and span.is_recording():
                span.set_attributes(attempt.attributes)
            # A sampled-out span still carries a valid context its children must inherit (or
            # they would start traces of their own); only the no-op API's span has none.
            if span.get_span_context().is_valid:
                attempt.span_context = trace.set_span_in_context(span)
        request.running = attempt.route_name
        if request.log is not None:
            attempt.started_at = time.time()
            attempt.logged = True
        if request.watch is not None:
            attempt.watch = request.watch(attempt)

    def _deadline(
        self,
        request: RequestState,
        attempt: AttemptState,
        started: float,
        number: int,
        *,
        output: bool,
    ) -> _Deadline | None:
        """When the next step of an attempt must end (on the router's clock), and why:
        ``attempt`` (its own limit), ``selection`` (the tighter limit its selection set),
        ``reserve`` (the time kept for a backup) or ``request`` (the request's deadline).
        Once `output` reached the caller, only the request's deadline applies."""
        settings = request.settings
        end: float | None = None
        why: Literal["attempt", "selection", "reserve"] = "attempt"
        if not output:
            limit_of_attempt = settings.attempt_timeout
            if attempt.timeout is not None and (
                limit_of_attempt is None or attempt.timeout < limit_of_attempt
            ):
                limit_of_attempt, why = attempt.timeout, "selection"
            if limit_of_attempt is not None:
                end = started + limit_of_attempt
        budget = request.budget
        if budget is None or budget.deadline is None:
            return None if end is None else (end, why)
        request_end = budget.deadline
        limit = request.limit
        if not output and settings.min_attempt_budget > 0 and (limit is None or number < limit):
            # Keep the backup's time: cut this attempt when only that is left (unless that
            # leaves this attempt nothing at all).
            reserve = request_end - settings.min_attempt_budget
            if reserve > started and (end is None or reserve < end):
                end, why = reserve, "reserve"
        if end is not None and end < request_end:
            return end, why
        return request_end, "request"

    def _timeout(self, deadline: _Deadline | None) -> asyncio.Timeout | None:
        if deadline is None:
            return None
        return asyncio.timeout(max(0.0, deadline[0] - self._clock()))

    def _timed_out(
        self,
        request: RequestState,
        error: BaseException,
        timeout: asyncio.Timeout | None,
        deadline: _Deadline | None,
        attempt: AttemptState,
    ) -> BaseException:
        """Our own timeout's `TimeoutError` as the error it stands for; anything else as is."""
        if timeout is None or deadline is None or not timeout.expired():
            return error
        if not isinstance(error, TimeoutError):
            return error
        replaced: BaseException
        if deadline[1] != "request":
            # Cut to keep the backup's time: the backup may start with less than
            # min_attempt_budget left (that time was kept for it).
            attempt.cut_for_backup = deadline[1] == "reserve"
            replaced = AttemptTimeoutError(
                f"route {attempt.route_name!r} was cut at the router's attempt limit",
                provider=attempt.route_name,
            )
        else:
            request_timeout = request.settings.request_timeout
            replaced = RequestTimeoutError(
                f"{self._router_name}: the request's deadline passed "
                f"(request_timeout={request_timeout:g} s)"
                if request_timeout is not None
                else f"{self._router_name}: the request's deadline passed"
            )
        replaced.__cause__ = error
        return replaced

    @staticmethod
    def _enter(
        attempt: AttemptState,
        budget: _scope.RequestBudget | None,
        timeout: asyncio.Timeout | None,
        movable: _scope.FailoverCheck | None = None,
        *,
        output: bool = False,
    ) -> _Tokens:
        """Make the attempt span, the request budget, the attempt's timeout and (before
        output: for a router that can move on) the failover check and (for a logged
        request) the attempt mark current while the route runs."""
        return (
            otel_context.attach(attempt.span_context) if attempt.span_context is not None else None,
            _scope.enter_budget(budget) if budget is not None else None,
            _scope.enter_attempt_timeout(timeout) if timeout is not None else None,
            _scope.enter_failover_check(movable) if movable is not None else None,
            _scope.enter_attempt_mark(attempt) if attempt.logged and not output else None,
        )

    @staticmethod
    def _exit(tokens: _Tokens) -> None:
        span_token, budget_token, timeout_token, failover_token, mark_token = tokens
        if mark_token is not None:
            _scope.exit_attempt_mark(mark_token)
        if failover_token is not None:
            _scope.exit_failover_check(failover_token)
        if timeout_token is not None:
            _scope.exit_attempt_timeout(timeout_token)
        if budget_token is not None:
            _scope.exit_budget(budget_token)
        if span_token is not None:
            otel_context.detach(span_token)

    def _finish(
        self,
        request: RequestState,
        attempt: AttemptState,
        *,
        outcome: AttemptOutcome,
        exception: BaseException | None,
        duration: float,
        time_to_first_update: float | None,
        terminal: bool,
        response: ChatResponse | None = None,
    ) -> Awaitable[Any] | None:
        """Record the attempt, price it (once: the span, the cost metric, the `RouteReport`
        and the request's attempt log all take that cost), trace it, tell the telemetry
        above and report it (``request.on_attempt``); returns what is left to await, if
        anything (the caller awaits it: on the common path nothing is, and no coroutine is
        made). `response` is a whole response's (its usage and model); a stream's are the
        attempt's, tallied as its updates went by."""
        context = request.context
        if response is not None:
            attempt.usage, attempt.model = response.usage, response.model_id
        usage = attempt.usage
        watch = attempt.watch
        if watch is not None:
            watch.ended(outcome, exception, usage)
        record = attempt_record(
            attempt.route_name,
            attempt.client,
            attempt.number,
            outcome,
            exception,
            duration,
            time_to_first_update,
        )
        context.attempts.append(record)
        cost: Cost | None = None
        log = request.log
        if attempt.beneath:
            # Layers beneath logged this attempt's provider calls (a router, a cache hit):
            # their records stand for it, and for the attempt above this request.
            within = request.within
            if within is not None:
                within.beneath += 1
        elif (log is not None or attempt.price is not None) and reached_provider(exception):
            cost = self._price(request, attempt, record, response, log)
        self._telemetry.finish(
            attempt.span,
            record,
            cost,
            attempt.model,
            terminal=terminal,
            selection=attempt.attributes.get(ROUTE_SELECTION) if attempt.attributes else None,
        )
        report = request.report
        if report is not None:
            report.route_name = record.route_name
            report.metadata = metadata_of(record.client)
            report.attempts = record.number
            report.fallback = record.number > 1
            if not attempt.beneath:  # else the attempt beneath that served told them
                report.price = attempt.price
                report.cost = cost
        on_attempt = request.on_attempt
        reported = on_attempt(context, record, terminal) if on_attempt is not None else None
        if reported is not None and not inspect.isawaitable(reported):
            reported = None
        affinity = request.affinity
        session = context.options.session_id
        if outcome == "completed" and affinity is not None and session is not None:
            return _in_turn(affinity.record(session, record.route_name, request.budget), reported)
        return reported

    @staticmethod
    def _price(
        request: RequestState,
        attempt: AttemptState,
        record: FailoverAttempt,
        response: ChatResponse | None,
        log: _scope.AttemptLog | None,
    ) -> Cost | None:
        """Price the attempt (`pipeline.pricing.priced_attempt`: the route's `Price`, else
        the log's book) and, when the request is logged, add it to the log."""
        characters = attempt.characters
        if response is not None and (response.usage is None or record.outcome != "completed"):
            characters = response_characters(response)
        metadata = metadata_of(attempt.client)
        requested = attempt.options.model_id or metadata.model_id
        spent = priced_attempt(
            route=record.route_name,
            number=record.number,
            outcome=record.outcome,
            provider=metadata.provider_name,
            model_requested=requested,
            model_served=attempt.model,
            reported=attempt.usage,
            characters=characters,
            messages=attempt.messages,
            error=record.exception,
            price=attempt.price,
            book=log.prices if log is not None else None,
            started_at=attempt.started_at or time.time() - record.duration,
            duration=record.duration,
            time_to_first_update=record.time_to_first_update,
        )
        if log is not None:
            log.add(spent, request.within)
        return spent.cost

    async def _caller_left(
        self,
        request: RequestState,
        attempt: AttemptState,
        stream: AsyncGenerator[ChatResponseUpdate, None],
        elapsed: float,
        time_to_first_update: float | None,
    ) -> None:
        """The caller closed a stream it had updates of (or threw into it): close the
        route's stream and report the attempt, terminal: ``canceled`` while the caller is
        being cancelled, else ``abandoned``. Raises what closing raised (it replaces the
        caller's exception), else returns and the caller's exception propagates."""
        clock = self._clock
        mark = clock()
        close_error = await close_stream(stream)
        pending = self._finish(
            request,
            attempt,
            outcome="canceled" if caller_cancelling() else "abandoned",
            exception=close_error,
            duration=elapsed + clock() - mark,
            time_to_first_update=time_to_first_update,
            terminal=True,
        )
        if pending is not None:
            await pending
        if close_error is not None:
            raise close_error from None

    async def _close_route_stream(
        self,
        attempt: AttemptState,
        stream: AsyncGenerator[ChatResponseUpdate, None],
        error: BaseException | None,
    ) -> tuple[BaseException | None, float]:
        """Close a route's stream that ran out, or failed with `error`: returns the error the
        attempt ends with (what closing raised, or `error` with a note when closing failed
        too) and the seconds closing took."""
        clock = self._clock
        mark = clock()
        close_error = None
        try:  # (`close_stream`, inline: every attempt's stream is closed here)
            await stream.aclose()
        except BaseException as exc:
            close_error = exc
        closing = clock() - mark
        if error is None:
            return close_error, closing
        if close_error is not None:
            error.add_note(
                f"closing the stream of route {attempt.route_name!r} also failed: "
                f"{type(close_error).__name__}"
            )
        return error, closing

    async def _failed(
        self,
        request: RequestState,
        attempt: AttemptState,
        error: BaseException,
        *,
        duration: float,
        time_to_first_update: float | None,
    ) -> None:
        """Report a failed attempt; raise `error` when the request ends with it."""
        outcome: AttemptOutcome
        if ending_of(error) == "canceled":
            outcome = "canceled"
        elif time_to_first_update is not None:
            outcome = "failed_after_output"
            error.add_note(
                f"chat-pipeline: route {attempt.route_name!r} failed after output was "
                "committed to the caller; the streamed response is incomplete"
            )
        else:
            outcome = "failed_before_output"
            request.signal = request.signal.joined(retry_signal_of(error))
        terminal = await self._is_terminal(request, attempt, error, outcome)
        pending = self._finish(
            request,
            attempt,
            outcome=outcome,
            exception=error,
            duration=duration,
            time_to_first_update=time_to_first_update,
            terminal=terminal,
        )
        if pending is not None:
            await pending
        if terminal:
            if outcome == "failed_before_output":
                # Whoever answers the caller hears every attempt, not the last one alone.
                attach_retry_signal(error, request.signal.joined(self._standing_signal()))
            raise error

    # -- requests ----------------------------------------------------------------------------

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        context = self._context(messages, options, streaming=False)
        # Every route of this request shares one operation id, so a tool call that a route
        # completed before failing is not repeated by the next one.
        operation = _scope.open_operation()
        try:
            request = self._new_request(context)
            if request.affinity is not None:
                await self._prefer(request, request.affinity)
            budget = request.budget
            clock = self._clock
            timed = budget is not None or request.settings.attempt_timeout is not None
            movable = request if request.alternatives is not None else None
            deadline = timeout = None
            while True:
                select_now = self._select_now
                attempt = (
                    await self._select(context)
                    if select_now is None
                    else self._attempt_of(context, select_now(context))
                )
                self._begin(request, attempt)
                started = clock()
                if timed or attempt.timeout is not None:
                    deadline = self._deadline(
                        request, attempt, started, len(context.attempts) + 1, output=False
                    )
                    timeout = self._timeout(deadline)
                else:
                    deadline = timeout = None
                # The common attempt (no span context, budget, timeout or log) has at most
                # the failover check to make current: made so here, without `_enter`'s tuple.
                check = None
                if (
                    timeout is None
                    and budget is None
                    and attempt.span_context is None
                    and (not attempt.logged)
                ):
                    tokens = _NO_TOKENS
                    if movable is not None:
                        check = _scope.enter_failover_check(movable)
                else:
                    tokens = self._enter(attempt, budget, _held_against(timeout, deadline), movable)
                failure: BaseException | None = None
                try:
                    if timeout is None:
                        response = await attempt.client.get_response(
                            attempt.messages, attempt.options
                        )
                    else:
                        async with timeout:
                            response = await attempt.client.get_response(
                                attempt.messages, attempt.options
                            )
                except BaseException as exc:
                    failure = self._timed_out(request, exc, timeout, deadline, attempt)
                finally:
                    if check is not None:
                        _scope.exit_failover_check(check)
                    elif tokens is not _NO_TOKENS:
                        self._exit(tokens)
                duration = clock() - started
                if failure is not None:
                    await self._failed(
                        request,
                        attempt,
                        failure,
                        duration=duration,
                        time_to_first_update=None,
                    )
                    continue
                pending = self._finish(
                    request,
                    attempt,
                    outcome="completed",
                    exception=None,
                    duration=duration,
                    time_to_first_update=duration,
                    terminal=True,
                    response=response,
                )
                if pending is not None:
                    await pending
                return response
        finally:
            if operation is not None:
                _scope.reset_operation(operation)

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return self._stream(self._context(messages, options, streaming=True))

    async def _stream(self, context: RoutingContext) -> AsyncGenerator[ChatResponseUpdate, None]:
        # Started at the first read, inside the step of the telemetry layer above (if any).
        request = self._new_request(context)
        if request.affinity is not None:
            await self._prefer(request, request.affinity)
        budget = request.budget
        clock = self._clock
        movable = request if request.alternatives is not None else None
        while True:
            select_now = self._select_now
            attempt = (
                await self._select(context)
                if select_now is None
                else self._attempt_of(context, select_now(context))
            )
            self._begin(request, attempt)
            elapsed = 0.0  # time spent inside the route, not with the caller
            first_update: float | None = None
            error: BaseException | None = None
            stream: AsyncGenerator[ChatResponseUpdate, None] | None = None
            started = clock()
            number = len(context.attempts) + 1
            counting = request.log is not None  # an estimate may need the output's size
            # As in `get_response`: at most the failover check to make current, made so here.
            simple = budget is None and attempt.span_context is None and not attempt.logged
            check = None
            if simple:
                tokens = _NO_TOKENS
                if movable is not None:
                    check = _scope.enter_failover_check(movable)
            else:
                tokens = self._enter(attempt, budget, None, movable)
            try:
                stream = attempt.client.get_streaming_response(attempt.messages, attempt.options)
            except BaseException as exc:
                error = exc
            finally:
                if check is not None:
                    _scope.exit_failover_check(check)
                    check = None
                elif tokens is not _NO_TOKENS:
                    self._exit(tokens)
            elapsed += clock() - started
            if stream is not None:
                # Without a span context, a budget or an attempt limit there is nothing to
                # make current or to time: skip the bookkeeping on every update.
                plain = (
                    attempt.span_context is None
                    and budget is None
                    and request.settings.attempt_timeout is None
                    and attempt.timeout is None
                )
                watch = attempt.watch
                rest = False  # the rest of a plain stream is read by the loop below
                while True:
                    if plain and first_update is not None:
                        rest = True
                        break
                    if plain and simple:
                        # Before the first update (a plain stream's only step here): at most
                        # the failover check to make current.
                        deadline = timeout = None
                        tokens = _NO_TOKENS
                        if movable is not None:
                            check = _scope.enter_failover_check(movable)
                    else:
                        output = first_update is not None
                        if plain:  # only the failover check or the attempt mark to make current
                            deadline = timeout = None
                        else:
                            deadline = self._deadline(
                                request, attempt, started, number, output=output
                            )
                            timeout = self._timeout(deadline)
                        tokens = self._enter(
                            attempt,
                            budget,
                            _held_against(timeout, deadline),
                            None if output else movable,
                            output=output,
                        )
                    mark = clock()
                    try:
                        if timeout is None:
                            update = await stream.__anext__()
                        else:
                            async with timeout:
                                update = await stream.__anext__()
                    except StopAsyncIteration:
                        break
                    except BaseException as exc:
                        error = self._timed_out(request, exc, timeout, deadline, attempt)
                        break
                    finally:
                        elapsed += clock() - mark
                        if check is not None:
                            _scope.exit_failover_check(check)
                            check = None
                        elif tokens is not _NO_TOKENS:
                            self._exit(tokens)
                    if first_update is None:
                        first_update = elapsed
                        if watch is not None:
                            watch.first_update()
                    # A stream may name its model on every update (Chat Completions does):
                    # only usage, a new model or counted output need the tally.
                    model = update.model_id
                    if (
                        update.usage is not None
                        or counting
                        or (model is not None and model != attempt.model)
                    ):
                        attempt.tally(update, counting)
                    try:
                        yield update
                    except BaseException:
                        # The caller closed the stream (GeneratorExit) or threw into it.
                        await self._caller_left(request, attempt, stream, elapsed, first_update)
                        raise
                if rest:
                    # Past the first update of a plain stream nothing is made current or
                    # timed out: each step only reads the clock around the route's work.
                    anext = stream.__anext__
                    while True:
                        mark = clock()
                        try:
                            update = await anext()
                        except StopAsyncIteration:
                            elapsed += clock() - mark
                            break
                        except BaseException as exc:
                            elapsed += clock() - mark
                            error = exc
                            break
                        elapsed += clock() - mark
                        model = update.model_id
                        if (
                            update.usage is not None
                            or counting
                            or (model is not None and model != attempt.model)
                        ):
                            attempt.tally(update, counting)
                        try:
                            yield update
                        except BaseException:
                            await self._caller_left(request, attempt, stream, elapsed, first_update)
                            raise
                # A native generator that ran out has nothing left to close.
                if error is not None or left_open(stream):
                    error, closing = await self._close_route_stream(attempt, stream, error)
                    elapsed += closing
            if error is not None:
                await self._failed(
                    request,
                    attempt,
                    error,
                    duration=elapsed,
                    time_to_first_update=first_update,
                )
                continue
            pending = self._finish(
                request,
                attempt,
                outcome="completed",
                exception=None,
                duration=elapsed,
                time_to_first_update=first_update,
                terminal=True,
            )
            if pending is not None:
                await pending
            return
