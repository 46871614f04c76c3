"""Request scope: what one request may still spend, and the operation it belongs to.

Routers open a scope per request (and make it current while a route runs); layers beneath
read it through this small API, so no layer needs to know about routing:

* `current_budget()`: the request's `RequestBudget` (provider calls left, deadline), or
  `None` outside a router with limits. The retry layer spends a call per retry from it and
  never sleeps past its deadline.
* `current_operation()`: the operation id tool calls are idempotent within, set by
  `operation_scope` (public, in `middleware.function_invocation`), by a router for its
  routes, or by the function-invocation layer for its loop;
* `current_report()`: the `RouteReport` a telemetry layer above a router holds open, which
  the router fills as its attempts end (the served route, the attempt count, whether a
  fallback served), so the request's span can tell the failover story;
* `attempt_timed_out()`: true while a router is cancelling the current attempt because the
  attempt's time is up (not because the caller cancelled), so a breaker beneath counts the
  timeout against its deployment instead of ignoring it like a caller's cancellation;
* `failover_possible(error)`: whether the router running this attempt could still move the
  request to another route if the attempt failed now with `error`, before any output, so a
  retry layer beneath does not wait out a ``Retry-After`` while another route could serve.

Everything here is request-local (context variables); nothing outlives the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Protocol

__all__ = [
    "RequestBudget",
    "RouteReport",
    "attempt_timed_out",
    "current_budget",
    "current_operation",
    "current_report",
    "enter_attempt_timeout",
    "enter_budget",
    "enter_failover_check",
    "enter_report",
    "exit_attempt_timeout",
    "exit_budget",
    "exit_failover_check",
    "failover_possible",
    "exit_report",
    "new_operation_id",
    "operation_scope",
    "set_operation",
    "reset_operation",
]


class RequestBudget:
    """What a request may still spend across every layer: provider calls and time.

    `calls_left` is `None` for no call limit; `deadline` is a time on `clock`, or `None`.
    """

    __slots__ = ("calls_left", "clock", "deadline")

    def __init__(
        self, calls_left: int | None, deadline: float | None, clock: Callable[[], float]
    ) -> None:
        self.calls_left = calls_left
        self.deadline = deadline
        self.clock = clock

    def remaining(self) -> float | None:
        """Seconds left before the deadline (never negative), or `None` without one."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - self.clock())

    def take_call(self) -> bool:
        """Spend one provider call; `False` (and nothing spent) when none is left."""
        if self.calls_left is None:
            return True
        if self.calls_left <= 0:
            return False
        self.calls_left -= 1
        return True

    def __repr__(self) -> str:
        return f"RequestBudget(calls_left={self.calls_left}, remaining={self.remaining()})"


_budget: contextvars.ContextVar[RequestBudget | None] = contextvars.ContextVar(
    "chat_pipeline_request_budget", default=None
)
_operation: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "chat_pipeline_operation_id", default=None
)


# The accessors are the context variables' own methods: they run on every request and
# every retry, where a Python function around them would cost a frame each.
current_budget = _budget.get
"""The budget of the request being served in this context, if a router set one."""
enter_budget = _budget.set
"""Make a budget current (a router does this around each call into a route)."""
exit_budget = _budget.reset


_attempt_timeout: contextvars.ContextVar[asyncio.Timeout | None] = contextvars.ContextVar(
    "chat_pipeline_attempt_timeout", default=None
)


def attempt_timed_out() -> bool:
    """True while the router is cancelling this attempt because its time ran out."""
    timeout = _attempt_timeout.get()
    return timeout is not None and timeout.expired()


enter_attempt_timeout = _attempt_timeout.set
exit_attempt_timeout = _attempt_timeout.reset


class FailoverCheck(Protocol):
    """What a router makes current while an attempt runs before output (its request)."""

    def failover_possible(self, error: BaseException) -> bool: ...


_failover_check: contextvars.ContextVar[FailoverCheck | None] = contextvars.ContextVar(
    "chat_pipeline_failover_check", default=None
)


def failover_possible(error: BaseException) -> bool:
    """Whether the router running this attempt could move the request to another route if
    the attempt failed now, before output, with `error` (False outside a router)."""
    check = _failover_check.get()
    return check is not None and check.failover_possible(error)


enter_failover_check = _failover_check.set
exit_failover_check = _failover_check.reset


class RouteReport:
    """The routing story of one request, for the span above the router: the route of the
    last attempt (the one that served, when it succeeded), its client's metadata, how many
    attempts were made and whether a fallback served (an attempt after the first), and that
    route's price (None when it has none), so a cache above can tell what a hit saved."""

    __slots__ = ("attempts", "fallback", "metadata", "price", "route_name")

    def __init__(self) -> None:
        self.route_name: str | None = None
        self.price: Any = None
        self.metadata: Any = None
        self.attempts = 0
        self.fallback = False


_report: contextvars.ContextVar[RouteReport | None] = contextvars.ContextVar(
    "chat_pipeline_route_report", default=None
)


current_report = _report.get
enter_report = _report.set
exit_report = _report.reset


_OPERATION_PREFIX = uuid.uuid4().hex[:12]
_operation_counter = itertools.count(1)


def new_operation_id() -> str:
    """A process-unique (and, by its random prefix, practically globally unique) id."""
    return f"{_OPERATION_PREFIX}-{next(_operation_counter):x}"


current_operation = _operation.get
"""The operation id of the request being served, if one was set."""
set_operation = _operation.set
reset_operation = _operation.reset


@contextlib.contextmanager
def operation_scope(operation_id: str | None = None) -> Iterator[str]:
    """Run requests under one operation id (a fresh one unless given), so tool calls are
    idempotent across them, for example when the caller retries a whole request."""
    if operation_id is not None and (not isinstance(operation_id, str) or not operation_id):
        raise ValueError("operation_id must be a non-empty string or None")
    value = operation_id or new_operation_id()
    token = _operation.set(value)
    try:
        yield value
    finally:
        _operation.reset(token)
