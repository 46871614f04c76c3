"""`BalancedFailoverChatClient`: spread requests over a fleet by route health, and fail
over before output like every failover router.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import collections
import itertools
import random
import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from opentelemetry.util.types import AttributeValue
from pydantic import Field

from middleware.routing._engine import AttemptState, AttemptWatch, FailoverSettings
from middleware.routing.context import Route, RoutingContext, RoutingSelection
from middleware.routing.failover import ListedRoutesFailover
from middleware.routing.health import AttemptTicket, HealthStore, Judgement, RouteHealth
from pipeline._retry_signal import NOTHING as NO_SIGNAL
from pipeline._retry_signal import RetrySignal
from pipeline._semconv import ROUTE_SELECTION
from pipeline.client import ChatClient, circuit_open
from pipeline.errors import RoutingError
from pipeline.types import UsageDetails

__all__ = ["BalancedFailoverChatClient", "BalancedSettings", "Strategy"]

Strategy = Literal["peak_ewma", "least_busy", "weighted", "round_robin"]

_WINDOW = 60.0  # seconds: what rpm and tpm are "per"


class BalancedSettings(FailoverSettings):
    """A balanced router's settings: the failover limits, and how it spreads requests.

    * `strategy`: ``peak_ewma`` | ``least_busy`` | ``weighted`` | ``round_robin``;
    * `exploration`: the fraction of ``peak_ewma`` choices made at random among the healthy
      routes, so a route the estimates undervalue keeps getting samples;
    * `failure_penalty`: ``peak_ewma``'s cost is multiplied by
      (1 + failure_penalty x failure ratio).
    """

    strategy: Strategy = "peak_ewma"
    """How each attempt's route is chosen among the healthy ones: `peak_ewma` (the lower latency x
    load x failures of two drawn at random), `least_busy`, `weighted` (by the routes' `weight`) or
    `round_robin`."""
    exploration: Annotated[float, Field(ge=0, le=1)] = 0.02
    """The fraction of `peak_ewma` choices made at random among the healthy routes, so a route the
    estimates undervalue keeps getting samples."""
    failure_penalty: Annotated[float, Field(ge=0)] = 10.0
    """`peak_ewma`'s cost of a route is multiplied by (1 + failure_penalty x its failure ratio)."""


class _Usage:
    """Requests and tokens one route took in the last minute, in this process."""

    __slots__ = ("requests", "tokens", "total_tokens")

    def __init__(self) -> None:
        self.requests: collections.deque[float] = collections.deque()
        self.tokens: collections.deque[tuple[float, int]] = collections.deque()
        self.total_tokens = 0

    def prune(self, now: float) -> None:
        horizon = now - _WINDOW
        requests = self.requests
        while requests and requests[0] <= horizon:
            requests.popleft()
        tokens = self.tokens
        while tokens and tokens[0][0] <= horizon:
            self.total_tokens -= tokens.popleft()[1]


_STRATEGY: Mapping[str, AttributeValue] = {ROUTE_SELECTION: "strategy"}
_FAILOVER: Mapping[str, AttributeValue] = {ROUTE_SELECTION: "failover"}
_PREFERRED: Mapping[str, AttributeValue] = {ROUTE_SELECTION: "preferred"}
_PROBE: Mapping[str, AttributeValue] = {ROUTE_SELECTION: "probe"}


class BalancedFailoverChatClient(ListedRoutesFailover):
    """Spreads each request's attempts over `routes` by route health (module docstring).

    `health` is a `RouteHealth` (yours: shared with other routers, left open), a
    `HealthStore` such as `RedisHealthStore` (the router makes a `RouteHealth` on it and
    closes it with itself), or ``None`` (a `RouteHealth` of the router's own). Route names
    must be unique: health is kept by name. `random_source` makes the draws (injectable for
    tests). Other keywords are `BalancedSettings` fields, ``affinity=`` and the router
    keywords.
    """

    settings_class: ClassVar[type[FailoverSettings]] = BalancedSettings
    settings: BalancedSettings

    def __init__(
        self,
        routes: Sequence[Route | ChatClient],
        settings: BalancedSettings | None = None,
        *,
        health: RouteHealth | HealthStore | None = None,
        random_source: random.Random | None = None,
        **options: Any,
    ) -> None:
        if settings is not None and not isinstance(settings, BalancedSettings):
            raise TypeError(f"settings must be BalancedSettings, not {type(settings).__name__}")
        super().__init__(routes, settings, unique_names=True, **options)
        if health is None or isinstance(health, HealthStore):
            self.health = RouteHealth(store=health, meter_provider=self._telemetry.meter_provider)
            self._owns_health = True
        elif isinstance(health, RouteHealth):
            self.health = health
            self._owns_health = False
        else:
            raise TypeError("health must be a RouteHealth, a HealthStore or None")
        self._random = random_source if random_source is not None else random.Random()
        self._turn = itertools.count()
        self._usage: dict[str, _Usage] = {
            route.name: _Usage()
            for route in self.routes
            if route.rpm is not None or route.tpm is not None
        }

    @property
    def strategy(self) -> Strategy:
        return self.settings.strategy

    def describe_layer(self) -> str:
        names = ", ".join(route.name for route in self.routes)
        return f"BalancedFailoverChatClient({names}; {self.settings.strategy})"

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            if self._owns_health:
                await self.health.aclose()

    # -- what the engine asks --------------------------------------------------------------

    def _watch_attempt(self, attempt: AttemptState) -> AttemptWatch:
        name = attempt.route_name
        usage = self._usage.get(name)
        if usage is not None:
            usage.requests.append(self.health._clock())
        probe = attempt.attributes is _PROBE
        return _Watch(self.health.attempt_started(name, probe=probe), usage)

    def _alternatives(self, context: RoutingContext, running: str) -> bool:
        now = self.health._clock()
        tried = self._tried(context)
        tried.add(running)
        return any(route.name not in tried and self._available(route, now) for route in self.routes)

    def _standing_signal(self) -> RetrySignal:
        # A route cooling down said (to an earlier request) when it may serve again.
        left = [self.health.cooldown_left(route.name) for route in self.routes]
        soonest = min((seconds for seconds in left if seconds > 0), default=None)
        return NO_SIGNAL if soonest is None else RetrySignal(time.monotonic() + soonest)

    # -- choosing --------------------------------------------------------------------------

    def _available(self, route: Route, now: float) -> bool:
        if self.health.cooling_down(route.name) or circuit_open(route.client):
            return False
        usage = self._usage.get(route.name)
        if usage is None:
            return True
        usage.prune(now)
        if route.rpm is not None and len(usage.requests) >= route.rpm:
            return False
        return route.tpm is None or usage.total_tokens < route.tpm

    def _tried(self, context: RoutingContext) -> set[str]:
        """The routes the request has taken already (a router that runs attempts at once
        counts the running ones too): the next attempt goes elsewhere while it can."""
        return {attempt.route_name for attempt in context.attempts}

    def select_client(self, context: RoutingContext) -> RoutingSelection:
        health = self.health
        now = health._clock()
        routes = self.routes
        tried = self._tried(context)
        if tried:
            untried = [route for route in routes if route.name not in tried] or list(routes)
        else:
            untried = list(routes)
        available = [route for route in untried if self._available(route, now)]
        pool = available or untried
        judgement = health.judge(route.name for route in routes)
        outliers = judgement.outliers
        healthy = [route for route in pool if route.name not in outliers] if outliers else pool
        if not tried:
            for route in pool:
                if route.name in outliers and judgement.probe_due(health, route.name):
                    return RoutingSelection(
                        route, attributes=_PROBE, attempt_timeout=judgement.probe_deadline
                    )
            preferred = context.preferred_route
            if preferred is not None:
                for route in healthy:
                    if route.name == preferred:
                        return RoutingSelection(route, attributes=_PREFERRED)
            return RoutingSelection(self._pick(healthy or pool, judgement), attributes=_STRATEGY)
        return RoutingSelection(self._pick(healthy or pool, judgement), attributes=_FAILOVER)

    def _pick(self, candidates: list[Route], judgement: Judgement) -> Route:
        if len(candidates) == 1:
            return candidates[0]
        try:
            return self._draw(candidates, judgement)
        except (ArithmeticError, ValueError, IndexError, KeyError) as exc:
            # Not the route's failure nor the caller's: typed, and without the values.
            raise RoutingError(
                f"route selection failed ({self.settings.strategy}): {type(exc).__name__}"
            ) from exc

    def _draw(self, candidates: list[Route], judgement: Judgement) -> Route:
        strategy = self.settings.strategy
        draw = self._random
        if strategy == "round_robin":
            return candidates[next(self._turn) % len(candidates)]
        if strategy == "weighted":
            # Relative to the largest, so the total stays finite however large each is
            # (two weights of 1e308 would sum to infinity).
            largest = max(route.weight for route in candidates)
            weights = [route.weight / largest for route in candidates]
            return draw.choices(candidates, weights=weights)[0]
        signals = judgement.signals
        if strategy == "least_busy":
            fewest = min(signals[route.name].in_flight for route in candidates)
            return draw.choice(
                [route for route in candidates if signals[route.name].in_flight == fewest]
            )
        if draw.random() < self.settings.exploration:
            return draw.choice(candidates)
        first, second = draw.sample(candidates, 2)
        return first if self._cost(first, judgement) <= self._cost(second, judgement) else second

    def _cost(self, route: Route, judgement: Judgement) -> float:
        """``peak_ewma``'s cost: latency x (in flight + 1) x failure penalty."""
        name = route.name
        latency = judgement.latency[name]
        if latency is None:
            latency = judgement.typical_latency
        in_flight = judgement.signals[name].in_flight
        penalty = 1.0 + self.settings.failure_penalty * judgement.ratio[name]
        return latency * (in_flight + 1) * penalty


class _Watch:
    """Feeds one attempt into route health (and the route's rpm/tpm window)."""

    __slots__ = ("_ticket", "_usage")

    def __init__(self, ticket: AttemptTicket, usage: _Usage | None) -> None:
        self._ticket = ticket
        self._usage = usage

    def first_update(self) -> None:
        self._ticket.first_update()

    def ended(self, outcome: str, error: BaseException | None, usage: UsageDetails | None) -> None:
        self._ticket.ended(outcome, error)
        window = self._usage
        if window is not None and usage is not None:
            tokens = usage.total_tokens or (usage.input_tokens or 0) + (usage.output_tokens or 0)
            if tokens:
                window.tokens.append((self._ticket.now(), tokens))
                window.total_tokens += tokens
