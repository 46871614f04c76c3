"""Failover routers: select again after a failure, while it is still safe.

`FailoverChatClient` runs `select_client` before every attempt and `on_routing_update` once
after every attempt. Whether another attempt may follow is decided by the engine of
`RoutingChatClient` (see its module docstring for the boundaries), the attempt limit, the
request budget (`request_timeout`, `min_attempt_budget`, `max_provider_calls_per_request`)
and `should_failover`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from middleware.routing.context import (
    FailoverAttempt,
    RequestBudget,
    Route,
    RoutingContext,
    SelectionResult,
    as_route,
    current_budget_var,
)
from middleware.routing.router import RoutingChatClient
from pipeline.client import ChatClient
from pipeline.errors import is_failover_eligible

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

__all__ = ["FailoverAttempt", "FailoverChatClient", "OrderedFailoverChatClient"]

FailoverPolicy = Callable[[BaseException], bool]


def _positive_or_none(value: object, name: str, *, integer: bool) -> None:
    if value is None:
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{name} must be a positive {'int' if integer else 'number'} or None")
    if not value > 0 or (not integer and not math.isfinite(float(value))):
        raise ValueError(f"{name} must be positive or None, got {value!r}")


class FailoverChatClient(RoutingChatClient):
    """A router that may select again after a failure before output.

    Subclasses implement `select_client`; they may override `on_routing_update` (called
    once after every attempt, with ``is_terminal`` telling whether the request ends there)
    and `should_failover`. Raising from `on_routing_update` on a terminal update replaces
    the request's result; on a nonterminal one it stops routing with that exception.

    Limits, each captured when a request starts: `max_attempts_per_request` (positive or
    None), `request_timeout` (seconds for the whole request, every attempt and retry
    included), `min_attempt_budget` (no new attempt starts with less time left) and
    `max_provider_calls_per_request` (attempts plus retries inside routes).
    """

    def __init__(
        self,
        *,
        leave_open: bool = False,
        max_attempts_per_request: int | None = None,
        request_timeout: float | None = None,
        min_attempt_budget: float = 0.0,
        max_provider_calls_per_request: int | None = None,
        should_failover: FailoverPolicy = is_failover_eligible,
        name: str | None = None,
        clock: Callable[[], float] = time.perf_counter,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        super().__init__(
            leave_open=leave_open,
            name=name,
            clock=clock,
            tracer_provider=tracer_provider,
            meter_provider=meter_provider,
        )
        self.max_attempts_per_request = max_attempts_per_request
        _positive_or_none(request_timeout, "request_timeout", integer=False)
        _positive_or_none(
            max_provider_calls_per_request, "max_provider_calls_per_request", integer=True
        )
        if isinstance(min_attempt_budget, bool) or not isinstance(min_attempt_budget, int | float):
            raise TypeError("min_attempt_budget must be a number of seconds")
        if min_attempt_budget < 0:
            raise ValueError("min_attempt_budget must not be negative")
        if not callable(should_failover):
            raise TypeError("should_failover must be a callable taking the exception")
        self.request_timeout = request_timeout
        self.min_attempt_budget = float(min_attempt_budget)
        self.max_provider_calls_per_request = max_provider_calls_per_request
        self._should_failover = should_failover

    @property
    def max_attempts_per_request(self) -> int | None:
        return self._max_attempts

    @max_attempts_per_request.setter
    def max_attempts_per_request(self, value: int | None) -> None:
        _positive_or_none(value, "max_attempts_per_request", integer=True)
        self._max_attempts = value

    def on_routing_update(
        self, context: RoutingContext, attempt: FailoverAttempt, is_terminal: bool
    ) -> None:
        """Called once after every attempt. Override to keep per-request policy state."""

    def should_failover(self, context: RoutingContext, exception: BaseException) -> bool:
        """Whether a failure before output may move to another attempt."""
        return self._should_failover(exception)

    # -- engine hooks ----------------------------------------------------------------------

    def _attempt_limit(self) -> int | None:
        return self._max_attempts

    def _new_budget(self) -> RequestBudget | None:
        if self.request_timeout is None and self.max_provider_calls_per_request is None:
            return current_budget_var.get()
        deadline = None if self.request_timeout is None else self._clock() + self.request_timeout
        outer = current_budget_var.get()
        if outer is not None and outer.deadline is not None and outer.clock is self._clock:
            deadline = outer.deadline if deadline is None else min(deadline, outer.deadline)
        return RequestBudget(self.max_provider_calls_per_request, deadline, self._clock)

    @property
    def _min_attempt_budget(self) -> float:
        return self.min_attempt_budget

    def _may_fail_over(self, context: RoutingContext, exc: BaseException) -> bool:
        return self.should_failover(context, exc)

    def _report(self, context: RoutingContext, attempt: FailoverAttempt, terminal: bool) -> None:
        self.on_routing_update(context, attempt, terminal)


class OrderedFailoverChatClient(FailoverChatClient):
    """Tries `routes` in order until one succeeds or failover is no longer allowed.

    A client listed twice is tried once per position. When every allowed attempt failed,
    the last failure is re-raised. The router keeps no state between requests: the next
    position is the number of attempts the request has made.
    """

    def __init__(
        self,
        routes: Sequence[Route | ChatClient],
        *,
        leave_open: bool = False,
        max_attempts_per_request: int | None = None,
        should_failover: FailoverPolicy = is_failover_eligible,
        request_timeout: float | None = None,
        min_attempt_budget: float = 0.0,
        max_provider_calls_per_request: int | None = None,
        name: str | None = None,
        clock: Callable[[], float] = time.perf_counter,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        if isinstance(routes, str | bytes) or not isinstance(routes, Sequence):
            raise TypeError("routes must be a sequence of Route or ChatClient")
        self.routes: tuple[Route, ...] = tuple(
            as_route(item, f"routes[{index}]") for index, item in enumerate(routes)
        )
        if not self.routes:
            raise ValueError("OrderedFailoverChatClient needs at least one route")
        super().__init__(
            leave_open=leave_open,
            max_attempts_per_request=max_attempts_per_request,
            request_timeout=request_timeout,
            min_attempt_budget=min_attempt_budget,
            max_provider_calls_per_request=max_provider_calls_per_request,
            should_failover=should_failover,
            name=name,
            clock=clock,
            tracer_provider=tracer_provider,
            meter_provider=meter_provider,
        )

    async def select_client(self, context: RoutingContext) -> SelectionResult:
        return self.routes[len(context.attempts)]

    def _attempt_limit(self) -> int | None:
        limit = self.max_attempts_per_request
        return len(self.routes) if limit is None else min(limit, len(self.routes))

    def owned_clients(self) -> Iterable[ChatClient]:
        return (route.client for route in self.routes)

    def describe_layer(self) -> str:
        return f"OrderedFailoverChatClient({', '.join(r.name for r in self.routes)})"
