"""Failover routers: select again after a failure before output, while it is still safe.

`FailoverChatClient` runs on the attempt engine every router shares
(`middleware.routing._engine`, which holds the promise: another attempt happens only while
no output reached the caller, the caller is not cancelling, and the limits and the policy
allow it). Its policy hooks (`select_client`, `on_routing_update`, `should_failover`) may
be plain functions or coroutine functions. A failover router makes at most
`DEFAULT_MAX_ATTEMPTS` attempts per request unless told otherwise (``None`` explicitly means
no limit), so a policy that keeps choosing a failing client ends with its last error.
`OrderedFailoverChatClient` walks its routes in order.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from middleware.routing._engine import (
    DEFAULT_MAX_ATTEMPTS,
    Alternatives,
    FailoverPolicy,
    FailoverSettings,
    MayFailOver,
    OnAttempt,
    RequestState,
    Watch,
)
from middleware.routing.context import (
    FailoverAttempt,
    Route,
    RoutingContext,
    SelectionResult,
    as_route,
)
from middleware.routing.router import RoutingChatClient, router_keywords
from pipeline import _scope
from pipeline.client import ChatClient

if TYPE_CHECKING:
    from middleware.routing.affinity import SessionAffinity

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "FailoverAttempt",
    "FailoverChatClient",
    "FailoverPolicy",
    "FailoverSettings",
    "OrderedFailoverChatClient",
]


class FailoverChatClient(RoutingChatClient):
    """A router that may select again after a failure before output.

    Subclasses implement `select_client`; they may override `on_routing_update` (called
    once after every attempt, with ``is_terminal`` telling whether the request ends there)
    and `should_failover`. Each may be sync or async. The limits live in `settings`
    (`FailoverSettings`); keyword `options` are its fields and the router keywords
    (see `RoutingChatClient`).

    With ``affinity=SessionAffinity(store)``, a request carrying ``options.session_id``
    finds the route that last completed for that session in ``context.preferred_route``
    (when this router has that route, named in `routes_by_name()`, and its breaker is not
    open); the route that completes a request is recorded for its session. The ordered
    and tiered policies start on the preferred route.
    """

    settings_class: ClassVar[type[FailoverSettings]] = FailoverSettings
    """The class of `settings` (a router with more settings names a subclass)."""

    def __init__(
        self,
        settings: FailoverSettings | None = None,
        *,
        affinity: SessionAffinity | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**router_keywords(options))
        self.settings = self.settings_class.from_options(settings, options)
        if affinity is not None and not callable(getattr(affinity, "preferred", None)):
            raise TypeError("affinity must be a SessionAffinity")
        self.affinity = affinity

    def routes_by_name(self) -> Mapping[str, Route]:
        """The routes this policy can start on, by name (for session affinity)."""
        return {}

    # -- settings as attributes ------------------------------------------------------------

    @property
    def max_attempts_per_request(self) -> int | None:
        return self.settings.max_attempts_per_request

    @max_attempts_per_request.setter
    def max_attempts_per_request(self, value: int | None) -> None:
        self.settings = self.settings.replace(max_attempts_per_request=value)

    @property
    def request_timeout(self) -> float | None:
        return self.settings.request_timeout

    @property
    def min_attempt_budget(self) -> float:
        return self.settings.min_attempt_budget

    @property
    def max_provider_calls_per_request(self) -> int | None:
        return self.settings.max_provider_calls_per_request

    # -- policy hooks ----------------------------------------------------------------------

    @abc.abstractmethod
    def select_client(
        self, context: RoutingContext
    ) -> SelectionResult | Awaitable[SelectionResult]:
        """Choose the client (or `Route`, or `RoutingSelection`) for the next attempt."""

    def on_routing_update(
        self, context: RoutingContext, attempt: FailoverAttempt, is_terminal: bool
    ) -> Awaitable[None] | None:
        """Called once after every attempt. Override to keep per-request policy state."""
        return None

    def should_failover(
        self, context: RoutingContext, exception: BaseException
    ) -> bool | Awaitable[bool]:
        """Whether a failure before output may move to another attempt."""
        decision: bool | Awaitable[bool] = self.settings.should_failover(exception)
        return decision

    # -- what the engine asks -------------------------------------------------------------

    # The policy hooks, bound once: three bound methods made per request would be three more
    # objects every request in flight holds (see the performance notes, "The library at
    # concurrency").
    _hooks: tuple[OnAttempt | None, MayFailOver, Alternatives] | None = None

    def _new_request(self, context: RoutingContext) -> RequestState:
        settings = self.settings
        hooks = self._hooks
        if hooks is None:
            # A policy that keeps nothing per request is not told of its attempts.
            told = type(self).on_routing_update is not FailoverChatClient.on_routing_update
            hooks = self._hooks = (
                self.on_routing_update if told else None,
                self.should_failover,
                self._alternatives,
            )
        # Without limits of its own the request runs in the enclosing budget, if any.
        budget = (
            _scope.current_budget()
            if settings.request_timeout is None and settings.max_provider_calls_per_request is None
            else self._new_budget(settings)
        )
        return RequestState(
            context,
            settings,
            self._attempt_limit(settings),
            budget,
            _scope.current_report(),
            self.affinity,
            hooks[0],
            hooks[1],
            hooks[2],
            self._watch_attempt,
        )

    def _alternatives(self, context: RoutingContext, running: str) -> bool:
        """Whether a route other than `running` could take the request after a failure
        (inside the limits, which the engine checks): by default, yes."""
        return True

    # Routers that learn from their attempts (route health) make a watch per attempt.
    _watch_attempt: Watch | None = None

    def _attempt_limit(self, settings: FailoverSettings) -> int | None:
        """Most attempts one request may make under `settings`."""
        return settings.max_attempts_per_request

    def _affinity_routes(self) -> Mapping[str, Route]:
        return self.routes_by_name()


class ListedRoutesFailover(FailoverChatClient):
    """A failover router over one list of routes (ordered, balanced): each listed route
    checked once, at most one attempt per listed position, and the routes' clients owned.
    With `unique_names`, two routes of one name are a configuration error (a router that
    keeps state by name needs that)."""

    def __init__(
        self,
        routes: Sequence[Route | ChatClient],
        settings: FailoverSettings | None = None,
        *,
        unique_names: bool = False,
        **options: Any,
    ) -> None:
        kind = type(self).__name__
        if isinstance(routes, str | bytes) or not isinstance(routes, Sequence):
            raise TypeError("routes must be a sequence of Route or ChatClient")
        self.routes: tuple[Route, ...] = tuple(
            as_route(item, f"routes[{index}]") for index, item in enumerate(routes)
        )
        if not self.routes:
            raise ValueError(f"{kind} needs at least one route")
        self._by_name: dict[str, Route] = {}
        for route in self.routes:
            if unique_names and route.name in self._by_name:
                raise ValueError(
                    f"{kind}: two routes are named {route.name!r} (route health is kept by name)"
                )
            self._by_name.setdefault(route.name, route)
        super().__init__(settings, **options)

    def routes_by_name(self) -> Mapping[str, Route]:
        return self._by_name

    def _attempt_limit(self, settings: FailoverSettings) -> int | None:
        limit = settings.max_attempts_per_request
        return len(self.routes) if limit is None else min(limit, len(self.routes))

    def owned_clients(self) -> Iterable[ChatClient]:
        return (route.client for route in self.routes)


_PLAN = "ordered.plan"


class OrderedFailoverChatClient(ListedRoutesFailover):
    """Tries `routes` in order until one succeeds or failover is no longer allowed.

    A client listed twice is tried once per position. When every allowed attempt failed,
    the last failure is re-raised. The router keeps no state between requests: the next
    position is the number of attempts the request has made. `max_attempts_per_request`
    caps the attempts below the number of routes (``None``: every route once).
    """

    def __init__(
        self,
        routes: Sequence[Route | ChatClient],
        settings: FailoverSettings | None = None,
        **options: Any,
    ) -> None:
        super().__init__(routes, settings, **options)
        if type(self).select_client is OrderedFailoverChatClient.select_client:
            self._select_now = self._next_route

    async def select_client(self, context: RoutingContext) -> SelectionResult:
        return self._next_route(context)

    def _next_route(self, context: RoutingContext) -> Route:
        preferred = context.preferred_route
        if preferred is None:
            return self.routes[len(context.attempts)]
        plan: list[Route] | None = context.state.get(_PLAN)
        if plan is None:
            # The session's route first, then the others in their order.
            first = next(r for r in self.routes if r.name == preferred)
            plan = context.state[_PLAN] = [first, *(r for r in self.routes if r is not first)]
        return plan[len(context.attempts)]

    def describe_layer(self) -> str:
        return f"OrderedFailoverChatClient({', '.join(r.name for r in self.routes)})"
