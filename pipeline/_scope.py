"""Request scope: what one request may still spend, and the operation it belongs to.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeVar

if TYPE_CHECKING:
    from pipeline.types import UsageDetails

# `pipeline.pricing` builds on this module (its `priced_attempt` makes `PricedAttempt`s), so
# its types are named here in words: `Cost` is `pipeline.pricing.Cost`, a book a
# `pipeline.pricing.PriceBook`.
Cost = Any
PriceBook = Any
_V = TypeVar("_V")

__all__ = [
    "AttemptLog",
    "AttemptMark",
    "PricedAttempt",
    "RequestBudget",
    "RouteReport",
    "attempt_timed_out",
    "current_attempt_log",
    "current_attempt_mark",
    "current_budget",
    "current_operation",
    "current_report",
    "enter_attempt_log",
    "enter_attempt_mark",
    "enter_attempt_timeout",
    "enter_budget",
    "enter_failover_check",
    "enter_report",
    "exit_attempt_log",
    "exit_attempt_mark",
    "exit_attempt_timeout",
    "exit_budget",
    "exit_failover_check",
    "failover_possible",
    "exit_report",
    "new_operation_id",
    "open_attempt_log",
    "open_operation",
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
# A string, or a router's request's `_PendingOperation` whose id is made when first read.
_operation: contextvars.ContextVar[str | _PendingOperation | None] = contextvars.ContextVar(
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


class _SlotVar(Generic[_V]):
    """A context variable that holds a request's object through a slot (a list of one, the
    cheapest object to make), emptied when the object is left: a copy of the context taken
    meanwhile (a timer's or a pooled connection's, which outlive the request) keeps an
    empty slot, not the request."""

    __slots__ = ("var",)

    def __init__(self, name: str) -> None:
        self.var: contextvars.ContextVar[list[_V | None] | None] = contextvars.ContextVar(
            name, default=None
        )

    def get(self) -> _V | None:
        slot = self.var.get()
        return slot[0] if slot is not None else None

    def enter(self, value: _V) -> contextvars.Token[list[_V | None] | None]:
        """Make `value` current; leave with `exit` in the same context."""
        return self.var.set([value])

    def exit(self, token: contextvars.Token[list[_V | None] | None]) -> None:
        """Leave what `enter` made current (its slot is emptied)."""
        slot = self.var.get()
        if slot is not None:
            slot[0] = None
        self.var.reset(token)


_failover_check = _SlotVar[FailoverCheck]("chat_pipeline_failover_check")


def failover_possible(error: BaseException) -> bool:
    """Whether the router running this attempt could move the request to another route if
    the attempt failed now, before output, with `error` (False outside a router)."""
    check = _failover_check.get()
    return check is not None and check.failover_possible(error)


enter_failover_check = _failover_check.enter
"""Make a router's request current while its attempt runs before output."""
exit_failover_check = _failover_check.exit


class RouteReport:
    """The routing story of one request, for the span above the router: the route of the
    last attempt (the one that served, when it succeeded), its client's metadata, how many
    attempts were made and whether a fallback served (an attempt after the first), and that
    route's price (None when it has none) and what that attempt cost (None when unpriced),
    so a cache above can tell what a hit saved."""

    __slots__ = ("attempts", "cost", "fallback", "metadata", "price", "route_name")

    def __init__(self) -> None:
        self.route_name: str | None = None
        self.price: Any = None
        self.cost: Cost | None = None
        self.metadata: Any = None
        self.attempts = 0
        self.fallback = False


_report: contextvars.ContextVar[RouteReport | None] = contextvars.ContextVar(
    "chat_pipeline_route_report", default=None
)


current_report = _report.get
enter_report = _report.set
exit_report = _report.reset


class PricedAttempt(NamedTuple):
    """One attempt that reached a provider, as the ledger records it: its route, number and
    outcome (a `FailoverAttempt`'s), the provider and the models asked for and served, what
    it used (`usage`: the provider's counts, or estimates where none came, then `estimated`)
    and what that cost (None: no price known), when it started (seconds since the epoch)
    and how long it took. A cache hit is one too: `cache` is ``"hit"``, nothing was used,
    and `saved` is what the stored answer had cost. Immutable (a named tuple)."""

    route: str
    number: int
    outcome: str
    provider: str | None
    model_requested: str | None
    model_served: str | None
    usage: UsageDetails
    estimated: bool
    cost: Cost | None
    started_at: float
    duration: float
    time_to_first_update: float | None
    cache: str | None = None
    saved: Cost | None = None


class AttemptLog:
    """The priced attempts of one request, in the order they ended (see the module
    docstring); `prices` is the book attempts without a route price are priced by (None:
    only routes with a `Price` are priced); `attribution` is whose request it is, as the
    server in front says (the spend layer's to read), and `request_id` its id there;
    `recorded` counts the attempts a ledger has already taken; `late`, when set (by a
    ledger that already took the request's attempts), is called with the log for an
    attempt added after that (a response cache's call that went on for other requests after
    this one's caller left)."""

    __slots__ = ("attempts", "attribution", "late", "prices", "recorded", "request_id")

    def __init__(
        self,
        prices: PriceBook | None = None,
        attribution: Any = None,
        request_id: str | None = None,
    ) -> None:
        self.attempts: list[PricedAttempt] = []
        self.prices = prices
        self.attribution = attribution
        self.request_id = request_id
        self.recorded = 0
        self.late: Callable[[AttemptLog], None] | None = None

    def add(self, attempt: PricedAttempt, within: AttemptMark | None = None) -> None:
        """Add an attempt that ended (a router, or a cache for its hit, does); `within` is
        the attempt above it stands for (the `current_attempt_mark()` where the logger
        started), told so. A retried call is added beside its attempt: without `within`."""
        self.attempts.append(attempt)
        if within is not None:
            within.beneath += 1
        late = self.late
        if late is not None:
            late(self)

    def __repr__(self) -> str:
        return f"AttemptLog(attempts={len(self.attempts)}, recorded={self.recorded})"


_attempt_log: contextvars.ContextVar[AttemptLog | None] = contextvars.ContextVar(
    "chat_pipeline_attempt_log", default=None
)
AttemptLogToken = contextvars.Token[AttemptLog | None]

current_attempt_log = _attempt_log.get
"""The attempt log of the request being served in this context, if a layer opened one."""
enter_attempt_log = _attempt_log.set
exit_attempt_log = _attempt_log.reset


class AttemptMark(Protocol):
    """An attempt whose route is running, as layers beneath see it (see the module
    docstring): its route, its number in its router's request and the route's price (None:
    the book's), and `beneath`, the records layers beneath logged for it."""

    route_name: str
    number: int
    price: Any
    beneath: int


_attempt_mark = _SlotVar[AttemptMark]("chat_pipeline_attempt_mark")
AttemptMarkToken = contextvars.Token[list[AttemptMark | None] | None]

current_attempt_mark = _attempt_mark.get
"""The attempt whose route is running in this context, while its request is logged."""
enter_attempt_mark = _attempt_mark.enter
exit_attempt_mark = _attempt_mark.exit


def open_attempt_log(
    prices: PriceBook | None = None,
) -> tuple[AttemptLog, AttemptLogToken | None]:
    """The request's attempt log: the one already open (a layer or server above opened it:
    `prices` fills its book when it has none), else a new one made current. Give the token
    back with `exit_attempt_log` in the same context when it is not None."""
    log = _attempt_log.get()
    if log is not None:
        if log.prices is None:
            log.prices = prices
        return log, None
    log = AttemptLog(prices)
    return log, _attempt_log.set(log)


_OPERATION_PREFIX = uuid.uuid4().hex[:12]
_operation_counter = itertools.count(1)


def new_operation_id() -> str:
    """A process-unique (and, by its random prefix, practically globally unique) id."""
    return f"{_OPERATION_PREFIX}-{next(_operation_counter):x}"


# A router's request's operation before anything read its id: a slot (a list of one, the
# cheapest object to make) the first reader fills.
_PendingOperation = list[str | None]


def current_operation() -> str | None:
    """The operation id of the request being served, if one was set."""
    value = _operation.get()
    if value is None or isinstance(value, str):
        return value
    made = value[0]
    if made is None:
        made = value[0] = new_operation_id()
    return made


OperationToken = contextvars.Token[str | _PendingOperation | None]


def open_operation() -> OperationToken | None:
    """Start an operation for a router's request unless one is current (its id is made
    when first read); give the token back with `reset_operation` when it is not None."""
    if _operation.get() is not None:
        return None
    return _operation.set([None])


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
