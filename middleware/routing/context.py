"""Routing identities and the per-request routing state.

A `Route` names a client for routing and telemetry. A `RoutingContext` lives exactly as long
as one request (one enumeration, when streaming): selectors shape its `messages`, keep their
per-request state in `state`, and read the `attempts` so far. A selector answers with a
client, a `Route`, or a `RoutingSelection` whose `options` apply to that one attempt only.
"""

from __future__ import annotations

import contextvars
import itertools
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from opentelemetry.util.types import AttributeValue

from pipeline.client import ChatClient, client_name, ensure_chat_client
from pipeline.types import ChatMessage, ChatOptions

__all__ = [
    "AttemptOutcome",
    "FailoverAttempt",
    "Price",
    "RequestBudget",
    "Route",
    "RoutingContext",
    "RoutingSelection",
    "SelectionResult",
    "as_route",
    "current_budget",
    "current_budget_var",
    "new_operation_id",
    "operation_id_var",
]

AttemptOutcome: TypeAlias = Literal[
    "completed", "failed_before_output", "failed_after_output", "abandoned", "canceled"
]


@dataclass(frozen=True, slots=True)
class Price:
    """What a route costs, in currency units per million tokens."""

    input_per_million: float
    output_per_million: float

    def __post_init__(self) -> None:
        if self.input_per_million < 0 or self.output_per_million < 0:
            raise ValueError("Price: per-million prices must not be negative")

    def cost(self, input_tokens: int | None, output_tokens: int | None) -> float:
        return (
            (input_tokens or 0) * self.input_per_million
            + (output_tokens or 0) * self.output_per_million
        ) / 1_000_000


@dataclass(frozen=True, slots=True, eq=False)
class Route:
    """A named routing identity for `client`.

    `max_input_tokens` and `capabilities` let tier selection skip routes that cannot serve a
    request; `price` feeds the cost metric.
    """

    name: str
    client: ChatClient
    max_input_tokens: int | None = field(default=None, kw_only=True)
    capabilities: frozenset[str] = field(default=frozenset(), kw_only=True)
    price: Price | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("Route.name must be a non-empty string")
        ensure_chat_client(self.client, f"Route {self.name!r} client")
        if self.max_input_tokens is not None and (
            not isinstance(self.max_input_tokens, int) or self.max_input_tokens < 1
        ):
            raise ValueError(f"Route {self.name!r}: max_input_tokens must be a positive int")
        if not isinstance(self.capabilities, frozenset):
            object.__setattr__(self, "capabilities", frozenset(self.capabilities))

    def __repr__(self) -> str:
        return f"Route({self.name!r})"


def as_route(item: Route | ChatClient, what: str = "route") -> Route:
    """A `Route` as is; a bare client becomes a route named from its metadata."""
    if isinstance(item, Route):
        return item
    client = ensure_chat_client(item, what)
    return Route(client_name(client), client)


@dataclass(frozen=True, slots=True)
class RoutingSelection:
    """A selector's answer: the client (or route) for one attempt and, optionally, the
    complete options for that attempt only, shaped on a clone of ``context.options``, and
    span attributes describing the choice (for example a score; never request text)."""

    client: ChatClient | Route
    options: ChatOptions | None = None
    attributes: Mapping[str, AttributeValue] | None = None


SelectionResult: TypeAlias = ChatClient | Route | RoutingSelection | None


@dataclass(frozen=True, slots=True)
class FailoverAttempt:
    """One invocation of one route, as the router saw it.

    `duration` (seconds) excludes the time the caller spent between streamed updates;
    `time_to_first_update` is set exactly when output was committed (a streamed update
    reached the caller, or a non-streamed response was returned).
    """

    route_name: str
    client: ChatClient
    number: int
    outcome: AttemptOutcome
    exception: BaseException | None
    duration: float
    time_to_first_update: float | None
    response_completed: bool
    output_committed: bool

    def __repr__(self) -> str:
        error = type(self.exception).__name__ if self.exception is not None else None
        return (
            f"FailoverAttempt(route={self.route_name!r}, number={self.number}, "
            f"outcome={self.outcome!r}, error={error}, committed={self.output_committed})"
        )


class RoutingContext:
    """The routing state of one request; gone when the request ends.

    `messages` is the router's own list copy (a selector may change it; the client gets the
    changed list); `options` is a clone of the caller's options, the baseline every attempt
    starts from; `state` belongs to the routing policy; `attempts` are the attempts so far.
    """

    __slots__ = ("__weakref__", "attempts", "messages", "options", "state", "streaming")

    def __init__(
        self, messages: Iterable[ChatMessage], options: ChatOptions, *, streaming: bool
    ) -> None:
        self.messages: list[ChatMessage] = list(messages)
        self.options: ChatOptions = options
        self.state: dict[str, Any] = {}
        self.attempts: list[FailoverAttempt] = []
        self.streaming = streaming

    def __repr__(self) -> str:
        return (
            f"RoutingContext(messages={len(self.messages)}, attempts={len(self.attempts)}, "
            f"streaming={self.streaming})"
        )


class RequestBudget:
    """What a request may still spend across every layer: provider calls and time.

    Set by a router for the duration of each attempt; the retry layer reads it with
    `current_budget()`, so retries inside a route count against the same allowance.
    """

    __slots__ = ("calls_left", "clock", "deadline")

    def __init__(
        self, calls_left: int | None, deadline: float | None, clock: Callable[[], float]
    ) -> None:
        self.calls_left = calls_left
        self.deadline = deadline
        self.clock = clock

    def remaining(self) -> float | None:
        """Seconds left before the request's deadline (never negative), or `None`."""
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


# Set by routers around each call into a route; read by the retry layer.
current_budget_var: contextvars.ContextVar[RequestBudget | None] = contextvars.ContextVar(
    "chat_pipeline_request_budget", default=None
)


# The operation a request belongs to: tool calls are idempotent within one operation. Set by
# `operation_scope`, by the function-invocation layer, or by a router for a non-streaming
# request (its routes share it). Never left set in a caller's context by a stream.
operation_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "chat_pipeline_operation_id", default=None
)
_OPERATION_PREFIX = uuid.uuid4().hex[:12]
_operation_counter = itertools.count(1)


def new_operation_id() -> str:
    """A process-unique (and, by its random prefix, practically globally unique) id."""
    return f"{_OPERATION_PREFIX}-{next(_operation_counter):x}"


def current_budget() -> RequestBudget | None:
    """The budget of the request being served in this context, if a router set one."""
    return current_budget_var.get()
