"""`HedgingChatClient`: when an attempt is slow to produce its first update, start the next
route too, and keep whichever answers first.

The first attempt to answer wins and alone reaches the caller; every other is cancelled
and awaited; hedges spend a budget that bounds the load they add.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import functools
import math
import random
import re
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from opentelemetry.util.types import AttributeValue
from pydantic import Field, field_validator

from middleware.routing._engine import (
    AttemptState,
    AttemptWatch,
    FailoverSettings,
    RequestState,
    _held_against,
)
from middleware.routing.balanced import BalancedFailoverChatClient, BalancedSettings
from middleware.routing.context import AttemptOutcome, Route, RoutingContext, RoutingSelection
from middleware.routing.health import HealthStore, RouteHealth
from pipeline import _scope
from pipeline._semconv import (
    HEDGES_STARTED_METRIC,
    HEDGES_WON_METRIC,
    ROUTE_HEDGE,
    ROUTE_NAME,
    ROUTE_SELECTION,
    ROUTING_SCOPE,
    meter,
)
from pipeline._streams import caller_cancelling, close_stream
from pipeline.client import ChatClient
from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages, UsageDetails

__all__ = ["HedgingChatClient", "HedgingSettings"]

_PERCENTILE = re.compile(r"p(\d{1,2}(?:\.\d+)?)")


@functools.lru_cache(maxsize=16)
def _quantile(delay: str) -> float:
    """``"p90"`` as 0.9 (`delay` was validated by `HedgingSettings`)."""
    match = _PERCENTILE.fullmatch(delay)
    return float(match.group(1)) / 100.0 if match is not None else 0.9


class HedgingSettings(BalancedSettings):
    """A hedging router's settings: a balanced router's, and when and how often to hedge.

    * `delay`: seconds an attempt may go without a first update before the next route
      starts too, or ``"pNN"`` (``"p90"``, ``"p99.9"``): that percentile of the route's
      recent times to first update, over its last `delay_window` attempts (an attempt that
      lost a race before its first update counts with its wait, the least it would have
      taken); while a route has fewer than `min_delay_samples`, that percentile of every
      route's samples together, and while they too have fewer, `fallback_delay` seconds;
    * `max_hedged_attempts`: extra attempts running at once beside the first (at least 1);
    * `budget`: the fraction of requests that may hedge: each request adds `budget` tokens
      to a bucket of `budget_burst` tokens at most (it starts full), each hedge takes one.
    """

    delay: float | str = "p90"
    """When the next route starts too: seconds without a first update, or `"pNN"` (`"p90"`,
    `"p99.9"`), that percentile of the route's recent times to first update."""
    max_hedged_attempts: Annotated[int, Field(ge=1)] = 1
    """Extra attempts running at once beside the first."""
    budget: Annotated[float, Field(ge=0, le=1)] = 0.1
    """The fraction of requests that may hedge: each request adds this many tokens to a bucket, each
    hedge takes one."""
    budget_burst: Annotated[float, Field(ge=1)] = 10.0
    """The most tokens the hedge bucket holds (it starts full)."""
    delay_window: Annotated[int, Field(ge=1)] = 200
    """Attempts per route (streamed and whole requests apart) whose times to first update a
    percentile `delay` is taken over."""
    min_delay_samples: Annotated[int, Field(ge=1)] = 20
    """Samples a route needs before its own percentile is used (before: every route's samples
    together)."""
    fallback_delay: Annotated[float, Field(gt=0)] = 1.0
    """Seconds of `delay` while the routes together have fewer than `min_delay_samples` samples."""

    @field_validator("delay", mode="before")
    @classmethod
    def _seconds_or_a_percentile(cls, value: Any) -> Any:
        if isinstance(value, str):
            match = _PERCENTILE.fullmatch(value)
            if match is None or not 0 < float(match.group(1)) < 100:
                # The value is not echoed: the message says what is allowed.
                raise ValueError("expected a percentile such as 'p90' or 'p99.9', or seconds")
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(
                "expected seconds (a positive number) or a percentile such as 'p90', "
                f"got {type(value).__name__}"
            )
        if not 0 < value < math.inf:
            raise ValueError(f"expected positive, finite seconds, got {value!r}")
        return float(value)


class _Latencies:
    """The recent times to first update of one route, in arrival order and sorted."""

    __slots__ = ("_recent", "_sorted")

    def __init__(self) -> None:
        self._recent: collections.deque[float] = collections.deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, sample: float, size: int) -> None:
        recent, ordered = self._recent, self._sorted
        while len(recent) >= size:
            del ordered[bisect.bisect_left(ordered, recent.popleft())]
        recent.append(sample)
        bisect.insort(ordered, sample)

    def __iter__(self) -> Iterator[float]:
        return iter(self._recent)

    def percentile(self, quantile: float) -> float:
        return _percentile(self._sorted, quantile)


def _percentile(ordered: list[float], quantile: float) -> float:
    """The `quantile` of the sorted, non-empty `ordered`, interpolating linearly between
    the closest ranks (numpy's default method)."""
    position = quantile * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class _Sampled:
    """An attempt's watch: the balanced router's (route health), plus the route's delay
    samples."""

    __slots__ = ("_clock", "_inner", "_router", "_start", "_window")

    def __init__(self, router: HedgingChatClient, inner: AttemptWatch, window: _Latencies) -> None:
        self._router = router
        self._inner = inner
        self._window = window
        self._clock = router._clock
        self._start: float | None = self._clock()

    def _sample(self) -> None:
        start = self._start
        if start is not None:
            self._start = None
            self._window.add(self._clock() - start, self._router.settings.delay_window)

    def first_update(self) -> None:
        self._sample()
        self._inner.first_update()

    def ended(
        self, outcome: AttemptOutcome, error: BaseException | None, usage: UsageDetails | None
    ) -> None:
        # A response is a first update; so, as a bound, is the wait of a race's loser.
        if outcome in ("completed", "abandoned"):
            self._sample()
        self._inner.ended(outcome, error, usage)


class _Racer:
    """One attempt of a hedged request, run in a task of its own until its first update
    (or, not streaming, its response). It is also what the layers beneath ask whether
    the request could move on (`_scope.failover_possible`)."""

    __slots__ = (
        "error",
        "first",
        "hedge",
        "hedge_at",
        "race",
        "response",
        "settled_at",
        "started",
        "state",
        "stream",
        "task",
    )

    def __init__(self, race: _Race, state: AttemptState, started: float, hedge: bool) -> None:
        self.race = race
        self.state = state
        self.started = started
        self.hedge = hedge
        self.hedge_at = math.inf  # when the next route starts too, if this is still waiting
        self.task: asyncio.Task[None] | None = None
        self.settled_at: float | None = None
        self.error: BaseException | None = None
        self.response: ChatResponse | None = None
        self.stream: AsyncGenerator[ChatResponseUpdate, None] | None = None
        self.first: ChatResponseUpdate | None = None

    def failover_possible(self, error: BaseException) -> bool:
        race = self.race
        for other in race.running:
            if other is not self:
                return True  # it may still serve
        return race.request.failover_possible(error)

    @property
    def won(self) -> bool:
        """Whether it answered (its task ended without an error)."""
        return self.settled_at is not None and self.error is None


_RACE = "hedging.race"  # the request's `_Race`, in its context's state


class _Race:
    """One request's attempts: those still running (in start order) and how many started."""

    __slots__ = ("request", "running", "settings", "started", "waiting", "wake")

    def __init__(self, request: RequestState, settings: HedgingSettings) -> None:
        self.request = request
        self.settings = settings
        self.running: list[_Racer] = []
        self.started = 0
        self.waiting = True  # false once a hedge was refused, until an attempt ends
        # What the request waits on: an attempt settling, or the next hedge coming due.
        self.wake: asyncio.Future[None] | None = None

    def story(self) -> None:
        """The request's routing story counts every attempt started, hedges included (the
        engine wrote the one of the attempt reported last: the winner's, when one won)."""
        report = self.request.report
        if report is not None and self.started:
            report.attempts = self.started


_HEDGE: Mapping[str, AttributeValue] = {ROUTE_SELECTION: "hedge", ROUTE_HEDGE: True}


def _wake_up(wake: asyncio.Future[None]) -> None:
    if not wake.done():
        wake.set_result(None)


class HedgingChatClient(BalancedFailoverChatClient):
    """Hedges slow attempts over `routes` (see the module docstring).

    `health` and `random_source` are as for `BalancedFailoverChatClient`; other keywords are
    `HedgingSettings` fields, ``affinity=`` and the router keywords. Route names must be
    unique.
    """

    settings_class: ClassVar[type[FailoverSettings]] = HedgingSettings
    # Two attempts race and one answer is taken: its routes answer on the parsed path
    # (`pipeline._forward`), whose updates are the same whichever attempt wins.
    keeps_raw_answers = False
    settings: HedgingSettings

    def __init__(
        self,
        routes: Sequence[Route | ChatClient],
        settings: HedgingSettings | None = None,
        *,
        health: RouteHealth | HealthStore | None = None,
        random_source: random.Random | None = None,
        **options: Any,
    ) -> None:
        if settings is not None and not isinstance(settings, HedgingSettings):
            raise TypeError(f"settings must be HedgingSettings, not {type(settings).__name__}")
        super().__init__(routes, settings, health=health, random_source=random_source, **options)
        # Per route and call shape: a non-streamed "first update" is the whole response.
        self._latencies = {
            (route.name, streaming): _Latencies()
            for route in self.routes
            for streaming in (False, True)
        }
        self._tokens = self.settings.budget_burst
        instruments = meter(ROUTING_SCOPE, self._telemetry.meter_provider)
        self._hedges_started = instruments.create_counter(
            HEDGES_STARTED_METRIC, unit="{attempt}", description="Hedged attempts started"
        )
        self._hedges_won = instruments.create_counter(
            HEDGES_WON_METRIC,
            unit="{attempt}",
            description="Hedged attempts whose answer reached the caller",
        )

    def describe_layer(self) -> str:
        names = ", ".join(route.name for route in self.routes)
        settings = self.settings
        return (
            f"HedgingChatClient({names}; {settings.strategy}, delay {settings.delay}, "
            f"budget {settings.budget:g})"
        )

    def hedge_delay(self, route: str, *, streaming: bool = True) -> float:
        """Seconds an attempt on `route` may go without a first update (not streaming: its
        response) before the next route starts too: the `delay` setting, read for that
        route and call shape now."""
        settings = self.settings
        delay = settings.delay
        if not isinstance(delay, str):
            return delay
        quantile = _quantile(delay)
        window = self._latencies.get((route, streaming))
        if window is not None and len(window) >= settings.min_delay_samples:
            return window.percentile(quantile)
        # A route with too few samples yet: the routes' samples together (a hedging
        # router's routes serve the same requests), else the fallback.
        pooled = sorted(
            sample
            for (_, shape), each in self._latencies.items()
            if shape == streaming
            for sample in each
        )
        if len(pooled) < settings.min_delay_samples:
            return settings.fallback_delay
        return _percentile(pooled, quantile)

    # -- what the balanced router asks -------------------------------------------------------

    def _tried(self, context: RoutingContext) -> set[str]:
        tried = super()._tried(context)
        race: _Race | None = context.state.get(_RACE)
        if race is not None:
            tried.update(racer.state.route_name for racer in race.running)
        return tried

    def select_client(self, context: RoutingContext) -> RoutingSelection:
        selection = super().select_client(context)
        race: _Race | None = context.state.get(_RACE)
        if race is not None and race.running:
            # Started while another attempt runs: a hedge (never a probe of an outlier: with
            # a route running, the balanced choice is a failover's).
            return RoutingSelection(selection.client, attributes=_HEDGE)
        return selection

    # -- requests ----------------------------------------------------------------------------

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        context = self._context(messages, options, streaming=False)
        # Every route of this request shares one operation id, as on every router.
        operation = _scope.open_operation()
        try:
            race = await self._open(context)
            try:
                winner = await self._race(race, streaming=False)
                response = winner.response
                assert response is not None  # a non-streamed attempt wins with its response
                answered = winner.settled_at if winner.settled_at is not None else winner.started
                duration = answered - winner.started
                pending = self._finish(
                    race.request,
                    winner.state,
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
                race.story()
        finally:
            if operation is not None:
                _scope.reset_operation(operation)

    async def _stream(self, context: RoutingContext) -> AsyncGenerator[ChatResponseUpdate, None]:
        # Started at the first read, inside the step of the telemetry layer above (if any):
        # each attempt's span is made here, a child of the request's.
        race = await self._open(context)
        try:
            winner = await self._race(race, streaming=True)
            request = race.request
            attempt = winner.state
            clock = self._clock
            answered = winner.settled_at if winner.settled_at is not None else winner.started
            elapsed = answered - winner.started  # time spent inside the route
            stream, update = winner.stream, winner.first
            first_update: float | None = None
            error: BaseException | None = None
            counting = request.log is not None  # an estimate may need the output's size
            if stream is not None and update is not None:  # else an empty stream won
                first_update = elapsed  # its first update was tallied as it arrived
                budget = request.budget
                plain = attempt.span_context is None and budget is None
                while True:
                    try:
                        yield update
                    except BaseException:
                        # The caller closed the stream (GeneratorExit) or threw into it.
                        await self._caller_left(request, attempt, stream, elapsed, first_update)
                        raise
                    # Output reached the caller: only the request's deadline applies now.
                    deadline = timeout = None
                    tokens: Any = None
                    if not plain:
                        deadline = self._deadline(
                            request, attempt, winner.started, attempt.number, output=True
                        )
                        timeout = self._timeout(deadline)
                        tokens = self._enter(attempt, budget, timeout, output=True)
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
                        if tokens is not None:
                            self._exit(tokens)
                    attempt.tally(update, counting)
                error, closing = await self._close_route_stream(attempt, stream, error)
                elapsed += closing
            if error is not None:
                await self._failed(
                    request, attempt, error, duration=elapsed, time_to_first_update=first_update
                )
                return  # _failed raised: output reached the caller, the failure is terminal
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
        finally:
            race.story()

    # -- the race ----------------------------------------------------------------------------

    async def _open(self, context: RoutingContext) -> _Race:
        request = self._new_request(context)
        if request.affinity is not None:
            await self._prefer(request, request.affinity)
        settings = self.settings
        self._tokens = min(settings.budget_burst, self._tokens + settings.budget)
        race = context.state[_RACE] = _Race(request, settings)
        return race

    async def _race(self, race: _Race, *, streaming: bool) -> _Racer:
        """Run the request's attempts until one answers (returned; every other attempt is
        cancelled and reported), or the request ends with an error (raised)."""
        loop = asyncio.get_running_loop()
        try:
            await self._launch(race, streaming=streaming)
            while True:
                finished = [racer for racer in race.running if racer.settled_at is not None]
                if not finished:
                    # One future for "an attempt settled" and "a hedge is due", set by the
                    # attempt itself (one turn of the loop less than waiting on its task).
                    delay = self._until_hedge(race)
                    wake = race.wake = loop.create_future()
                    timer = None if delay is None else loop.call_later(delay, _wake_up, wake)
                    try:
                        await wake
                    finally:
                        race.wake = None
                        if timer is not None:
                            timer.cancel()
                    finished = [racer for racer in race.running if racer.settled_at is not None]
                if not finished:  # the attempt started last is past its delay
                    if self._may_hedge(race):
                        await self._launch(race, streaming=streaming)
                    else:
                        race.waiting = False
                    continue
                winner = next((racer for racer in finished if racer.won), None)
                for racer in finished:
                    if not racer.won:  # another that answered in the same turn loses below
                        await self._fell(race, racer, streaming=streaming)
                race.waiting = True
                if winner is not None:
                    # The winner stays in the race while the others shut down: a caller
                    # cancelling meanwhile cancels it too (below), so nothing is left
                    # unreported, open or counted in flight.
                    await self._dismiss(race, "abandoned", terminal=False, keep=winner)
                    race.running.remove(winner)
                    if winner.hedge:
                        self._hedges_won.add(1, {ROUTE_NAME: winner.state.route_name})
                    return winner
        except BaseException:
            # The caller cancelled, or the request ends with an error of its own (the
            # selector's, a report's): nothing may be left running.
            await self._dismiss(
                race, "canceled" if caller_cancelling() else "abandoned", terminal=True
            )
            raise

    async def _fell(self, race: _Race, racer: _Racer, *, streaming: bool) -> None:
        """`racer` failed before output: report it. The request goes on with the attempts
        still running, fails over when it was the last one (as every failover router does),
        or ends with its error (raised)."""
        error = racer.error if racer.error is not None else asyncio.CancelledError()
        alone = race.running == [racer]
        race.running.remove(racer)
        # Not a failure of the route (KeyboardInterrupt, ...): it ends the request, after
        # every other attempt is cancelled.
        fatal = not isinstance(error, Exception | asyncio.CancelledError)
        if fatal:
            await self._dismiss(race, "abandoned", terminal=False)
        if alone or fatal:
            await self._failed(
                race.request,
                racer.state,
                error,
                duration=self._spent(racer),
                time_to_first_update=None,
            )  # raises when the request ends here
            await self._launch(race, streaming=streaming)
            return
        pending = self._finish(
            race.request,
            racer.state,
            outcome="failed_before_output",
            exception=error,
            duration=self._spent(racer),
            time_to_first_update=None,
            terminal=False,
        )
        if pending is not None:
            await pending

    def _spent(self, racer: _Racer) -> float:
        answered = racer.settled_at
        return (answered if answered is not None else self._clock()) - racer.started

    def _until_hedge(self, race: _Race) -> float | None:
        """Seconds until the next hedge is due, or None when none can start."""
        running = race.running
        if not race.waiting or not running or len(running) > race.settings.max_hedged_attempts:
            return None
        limit = race.request.limit
        if limit is not None and race.started >= limit:
            return None
        return max(0.0, running[-1].hedge_at - self._clock())

    def _may_hedge(self, race: _Race) -> bool:
        """Whether a hedge may start now (inside the request's limits, with a route to take
        it), taking a token from the budget if so."""
        request = race.request
        # The count of attempts started is `_until_hedge`'s; the calls and time left, these.
        if not request.room_for_another(request.settings.min_attempt_budget):
            return False
        if not self._alternatives(request.context, race.running[-1].state.route_name):
            return False
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    async def _launch(self, race: _Race, *, streaming: bool) -> None:
        """Select a route and start an attempt on it, in a task of its own (a hedge when
        another attempt is running)."""
        request = race.request
        hedge = bool(race.running)
        attempt = await self._select(request.context)
        attempt.number = race.started + 1
        self._begin(request, attempt)  # in the request's context: the span is a sibling
        race.started += 1
        span = attempt.span
        if not hedge and span is not None and span.is_recording():
            span.set_attribute(ROUTE_HEDGE, False)
        window = self._latencies.get((attempt.route_name, streaming))
        if window is not None and attempt.watch is not None:
            # Its time to a first update (or response) feeds the route's percentile delay.
            attempt.watch = _Sampled(self, attempt.watch, window)
        racer = _Racer(race, attempt, self._clock(), hedge)
        racer.hedge_at = racer.started + self.hedge_delay(attempt.route_name, streaming=streaming)
        race.running.append(racer)
        racer.task = asyncio.create_task(
            self._first_update(racer) if streaming else self._answer(racer)
        )
        if hedge:
            self._hedges_started.add(1, {ROUTE_NAME: attempt.route_name})

    def _limits(self, racer: _Racer) -> tuple[Any, asyncio.Timeout | None]:
        """The deadline and timeout of an attempt before its first update."""
        request = racer.race.request
        attempt = racer.state
        if (
            request.budget is None
            and request.settings.attempt_timeout is None
            and attempt.timeout is None
        ):
            return None, None
        deadline = self._deadline(request, attempt, racer.started, attempt.number, output=False)
        return deadline, self._timeout(deadline)

    def _settle(self, racer: _Racer) -> None:
        """The attempt's task is done with it (the last thing it does): wake the request."""
        racer.settled_at = self._clock()
        wake = racer.race.wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _answered(self, racer: _Racer) -> None:
        watch = racer.state.watch
        if watch is not None:
            watch.first_update()
        self._settle(racer)

    async def _answer(self, racer: _Racer) -> None:
        """A non-streamed attempt, to its response (its task)."""
        request = racer.race.request
        attempt = racer.state
        deadline, timeout = self._limits(racer)
        tokens = self._enter(attempt, request.budget, _held_against(timeout, deadline), racer)
        try:
            if timeout is None:
                response = await attempt.client.get_response(attempt.messages, attempt.options)
            else:
                async with timeout:
                    response = await attempt.client.get_response(attempt.messages, attempt.options)
        except BaseException as exc:  # the race reads it (this task is never awaited for it)
            racer.error = self._timed_out(request, exc, timeout, deadline, attempt)
            self._settle(racer)
            return
        finally:
            self._exit(tokens)
        racer.response = response
        self._answered(racer)

    async def _first_update(self, racer: _Racer) -> None:
        """A streamed attempt, to its first update (its task). The stream stays open for
        the winner; any other ending closes it here."""
        request = racer.race.request
        attempt = racer.state
        budget = request.budget
        tokens = self._enter(attempt, budget, None, racer)
        try:
            stream = attempt.client.get_streaming_response(attempt.messages, attempt.options)
        except BaseException as exc:
            racer.error = exc
            self._settle(racer)
            return
        finally:
            self._exit(tokens)
        deadline, timeout = self._limits(racer)
        tokens = self._enter(attempt, budget, _held_against(timeout, deadline), racer)
        update: ChatResponseUpdate | None = None
        error: BaseException | None = None
        try:
            if timeout is None:
                update = await stream.__anext__()
            else:
                async with timeout:
                    update = await stream.__anext__()
        except StopAsyncIteration:
            pass  # an empty stream: complete
        except BaseException as exc:
            error = self._timed_out(request, exc, timeout, deadline, attempt)
        finally:
            self._exit(tokens)
        if update is not None:
            attempt.tally(update, request.log is not None)
            racer.stream = stream
            racer.first = update
            self._answered(racer)
            return
        racer.error, _ = await self._close_route_stream(attempt, stream, error)
        self._settle(racer)

    async def _dismiss(
        self,
        race: _Race,
        outcome: Literal["abandoned", "canceled"],
        *,
        terminal: bool,
        keep: _Racer | None = None,
    ) -> None:
        """Cancel every attempt still in the race but `keep`, await each task, close a stream
        that holds an update nobody will see, and report each: `outcome`, or
        ``failed_before_output`` for one that had failed already (with `terminal`, the
        last reported ends the request).

        A caller cancelling while this runs does not cut it short: every attempt is still
        shut down and reported (``canceled`` from then on), then the cancellation goes on."""
        racers = [racer for racer in race.running if racer is not keep]
        if not racers:
            return
        race.running = [keep] if keep is not None else []
        ended = {racer: racer.settled_at is not None for racer in racers}
        tasks = {racer.task for racer in racers if racer.task is not None}
        for task in tasks:
            task.cancel()
        cancelled = False
        while tasks:  # each task is cancelled: it ends at its next step
            try:
                _, tasks = await asyncio.wait(tasks)  # never raises for a task's own ending
            except asyncio.CancelledError:
                cancelled = True
        request = race.request
        failure: BaseException | None = None
        for index, racer in enumerate(racers):
            if cancelled:
                outcome = "canceled"
            how: Literal["abandoned", "canceled", "failed_before_output"] = outcome
            exception: BaseException | None = None
            if ended[racer] and racer.error is not None:
                how, exception = "failed_before_output", racer.error
            elif racer.stream is not None:
                exception = await close_stream(racer.stream)  # its update never reaches anyone
                if isinstance(exception, asyncio.CancelledError) and caller_cancelling():
                    cancelled, exception = True, None  # the caller's, not the route's
            try:
                pending = self._finish(
                    request,
                    racer.state,
                    outcome=how,
                    exception=exception,
                    duration=self._spent(racer),
                    time_to_first_update=None,
                    terminal=terminal and index == len(racers) - 1,
                    response=racer.response,  # a loser that answered too: what it used
                )
                if pending is not None:
                    await pending
            except asyncio.CancelledError:
                cancelled = True  # the report was cut short; the others are reported still
            except Exception as exc:  # a report that raised: the others are reported still
                if failure is None:
                    failure = exc
        if cancelled:
            raise asyncio.CancelledError
        if failure is not None:
            raise failure
