"""Routing identities and the per-request routing state.

A `Route` names a client for routing and telemetry. A `RoutingContext` lives exactly as long
as one request (one enumeration, when streaming): selectors shape its `messages`, keep their
per-request state in `state`, and read the `attempts` so far. A selector answers with a
client, a `Route`, or a `RoutingSelection` whose `options` apply to that one attempt only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeAlias

from opentelemetry.util.types import AttributeValue
from pydantic import Field, StringConstraints

from pipeline._settings import Settings
from pipeline.client import ChatClient, client_name, ensure_chat_client
from pipeline.pricing import Price
from pipeline.types import ChatMessage, ChatOptions, ChatRole

__all__ = [
    "AttemptOutcome",
    "FailoverAttempt",
    "Price",
    "Route",
    "RouteFacts",
    "RoutingContext",
    "RoutingSelection",
    "SelectionResult",
    "as_route",
    "with_instructions",
]

AttemptOutcome: TypeAlias = Literal[
    "completed", "failed_before_output", "failed_after_output", "abandoned", "canceled"
]


_Capability = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]


class RouteFacts(Settings):
    """What tier selection and telemetry know about a route, besides its name and client:
    validated once here for `Route` and for the TOML loader."""

    max_input_tokens: Annotated[int, Field(ge=1)] | None = None
    """The route's context window: tier selection skips the route for a request whose estimated
    input is larger (unset: no limit known)."""
    capabilities: Annotated[frozenset[_Capability], Field(strict=False)] = frozenset()
    """What the route can do (`tools`, `json`, `vision`, or names of your own): tier selection skips
    it for a request that needs one it lacks."""
    price: Price | None = None
    """What the route costs per million tokens (`{ input_per_million, output_per_million,
    cache_read_per_million, cache_write_per_million }`): it wins over the price book for this
    route's attempts (their cost, the spend ledger, the `chat_pipeline.route.cost` metric, eval
    reports)."""
    instructions: Annotated[str, StringConstraints(min_length=1)] | None = None
    """The route's own system prompt: for this route's attempts it replaces the conversation's first
    system message (or comes first when there is none), in a copy of the messages."""
    weight: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    """The route's share of traffic under a balanced router's `weighted` strategy, relative to the
    other routes' weights."""
    rpm: Annotated[int, Field(ge=1)] | None = None
    """Requests per minute the route is declared to take: a balanced router sends it no more
    (counted in this process) while another route can serve."""
    tpm: Annotated[int, Field(ge=1)] | None = None
    """Tokens per minute the route is declared to take, counted like `rpm`."""


@dataclass(frozen=True, slots=True, eq=False)
class Route:
    """A named routing identity for `client`.

    `max_input_tokens` and `capabilities` let tier selection skip routes that cannot serve a
    request; `price` feeds the cost metric; `instructions` are this route's system prompt:
    for an attempt on this route they replace the conversation's first system message (or
    come first when there is none), in a copy of the messages, so they never reach another
    route's attempt nor the caller's list. `weight` is its share under a balanced router's
    ``weighted`` strategy; `rpm` and `tpm` are the deployment's declared limits (requests
    and tokens per minute), which a balanced router keeps under in each process.
    """

    name: str
    client: ChatClient
    max_input_tokens: int | None = field(default=None, kw_only=True)
    capabilities: frozenset[str] = field(default=frozenset(), kw_only=True)
    price: Price | None = field(default=None, kw_only=True)
    instructions: str | None = field(default=None, kw_only=True)
    weight: float = field(default=1.0, kw_only=True)
    rpm: int | None = field(default=None, kw_only=True)
    tpm: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("Route.name must be a non-empty string")
        ensure_chat_client(self.client, f"Route {self.name!r} client")
        capabilities = self.capabilities
        if isinstance(capabilities, str) or not isinstance(capabilities, Iterable):
            raise TypeError(f"Route {self.name!r}: capabilities must be a set of strings")
        try:
            facts = RouteFacts(
                max_input_tokens=self.max_input_tokens,
                capabilities=frozenset(capabilities),
                price=self.price,
                instructions=self.instructions,
                weight=float(self.weight) if type(self.weight) is int else self.weight,
                rpm=self.rpm,
                tpm=self.tpm,
            )
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"Route {self.name!r}: {exc}") from None
        object.__setattr__(self, "capabilities", facts.capabilities)
        object.__setattr__(self, "weight", facts.weight)

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
    complete options for that attempt only, shaped on a clone of ``context.options``, span
    attributes describing the choice (for example a score; never request text), and
    `attempt_timeout`: seconds this attempt may take before its first update (the shorter
    of it and the router's own `attempt_timeout` applies; a cut attempt fails before output
    with `AttemptTimeoutError`, so the router may fail over)."""

    client: ChatClient | Route
    options: ChatOptions | None = None
    attributes: Mapping[str, AttributeValue] | None = None
    attempt_timeout: float | None = None

    def __post_init__(self) -> None:
        timeout = self.attempt_timeout
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout < float("inf")
        ):
            raise ValueError("RoutingSelection.attempt_timeout must be a positive number or None")


SelectionResult: TypeAlias = ChatClient | Route | RoutingSelection | None


def with_instructions(messages: list[ChatMessage], instructions: str) -> list[ChatMessage]:
    """A copy of `messages` whose first system message is `instructions` (prepended when
    there is none); `messages` itself is not changed."""
    system = ChatMessage(ChatRole.SYSTEM, instructions)
    for index, message in enumerate(messages):
        if message.role is ChatRole.SYSTEM:
            return [*messages[:index], system, *messages[index + 1 :]]
    return [system, *messages]


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


# A frozen dataclass sets each field through `object.__setattr__`. The engine, which makes
# one record per attempt, fills a mutable twin of the same slots and then makes it a
# `FailoverAttempt` (a `__class__` assignment between layouts CPython holds identical): half
# the instructions of setting the slots through their descriptors. The twin has the record's
# slots, so a field added to `FailoverAttempt` is a slot the engine must set too.
class _OpenRecord:
    __slots__ = FailoverAttempt.__slots__


if tuple(f.name for f in dataclasses.fields(FailoverAttempt)) != _OpenRecord.__slots__:
    raise RuntimeError("FailoverAttempt's fields and slots differ")  # pragma: no cover

_new_object = object.__new__


def attempt_record(
    route_name: str,
    client: ChatClient,
    number: int,
    outcome: AttemptOutcome,
    exception: BaseException | None,
    duration: float,
    time_to_first_update: float | None,
) -> FailoverAttempt:
    """`FailoverAttempt` of these fields (`response_completed` and `output_committed` from
    them), made the engine's cheaper way."""
    record: Any = _new_object(_OpenRecord)
    record.route_name = route_name
    record.client = client
    record.number = number
    record.outcome = outcome
    record.exception = exception
    record.duration = duration
    record.time_to_first_update = time_to_first_update
    record.response_completed = outcome == "completed"
    record.output_committed = time_to_first_update is not None
    record.__class__ = FailoverAttempt
    made: FailoverAttempt = record
    return made


class RoutingContext:
    """The routing state of one request; gone when the request ends.

    `messages` is the router's own list copy (a selector may change it; the client gets the
    changed list); `options` is a clone of the caller's options, the baseline every attempt
    starts from; `state` belongs to the routing policy; `attempts` are the attempts so far;
    `preferred_route` names the route the session last completed on, when the router has
    session affinity and that route is healthy (policies start there).
    """

    __slots__ = (
        "__weakref__",
        "attempts",
        "messages",
        "options",
        "preferred_route",
        "state",
        "streaming",
    )

    def __init__(
        self, messages: Iterable[ChatMessage], options: ChatOptions, *, streaming: bool
    ) -> None:
        self.messages: list[ChatMessage] = list(messages)
        self.options: ChatOptions = options
        self.state: dict[str, Any] = {}
        self.attempts: list[FailoverAttempt] = []
        self.streaming = streaming
        self.preferred_route: str | None = None

    def __repr__(self) -> str:
        return (
            f"RoutingContext(messages={len(self.messages)}, attempts={len(self.attempts)}, "
            f"streaming={self.streaming})"
        )
