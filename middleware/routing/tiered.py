"""`TieredRoutingChatClient`: start on the right tier, escalate along a fallback chain.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from middleware.routing.affinity import MemoryAffinityStore, SessionAffinity
from middleware.routing.context import FailoverAttempt, Route, RoutingContext, SelectionResult
from middleware.routing.failover import FailoverChatClient, FailoverSettings
from pipeline.client import ChatClient
from pipeline.errors import RoutingError
from pipeline.pricing import estimate_input_tokens
from pipeline.types import ChatMessage, DataContent

__all__ = [
    "KIND_HINT",
    "PIN_HINT",
    "TieredRoutingChatClient",
    "estimate_input_tokens",
    "required_capabilities",
]

PIN_HINT = "chat_pipeline.route"
KIND_HINT = "chat_pipeline.kind"
_CHAIN = "tiered.chain"

_logger = logging.getLogger("chat_pipeline.routing.tiered")


def required_capabilities(context: RoutingContext) -> frozenset[str]:
    """What a route must offer to serve this request."""
    needed: set[str] = set()
    if context.options.tools:
        needed.add("tools")
    if context.options.response_format is not None:
        needed.add("json")
    if any(isinstance(c, DataContent) for m in context.messages for c in m.contents):
        needed.add("vision")
    return frozenset(needed)


class TieredRoutingChatClient(FailoverChatClient):
    """Tier selection and escalation (see the module docstring)."""

    def __init__(
        self,
        routes: Sequence[Route],
        *,
        default: str,
        fallback: Mapping[str, Sequence[str]] | None = None,
        kinds: Mapping[str, str] | None = None,
        sticky_sessions: bool = True,
        max_sessions: int = 10_000,
        token_estimator: Callable[[Sequence[ChatMessage]], int] = estimate_input_tokens,
        settings: FailoverSettings | None = None,
        **options: Any,
    ) -> None:
        super().__init__(settings, **options)
        if isinstance(routes, str) or not isinstance(routes, Sequence) or not routes:
            raise ValueError("routes must be a non-empty sequence of Route")
        for route in routes:
            if not isinstance(route, Route):
                raise TypeError("tiered routes must be Route objects (they carry the tier facts)")
        self.routes: dict[str, Route] = {}
        for route in routes:
            if route.name in self.routes:
                raise ValueError(f"two routes are named {route.name!r}")
            self.routes[route.name] = route
        if default not in self.routes:
            raise ValueError(f"default route {default!r} is not one of the routes")
        self.default = default
        self.fallback: dict[str, tuple[str, ...]] = {}
        for source, targets in (fallback or {}).items():
            for name in (source, *targets):
                if name not in self.routes:
                    raise ValueError(f"fallback names unknown route {name!r}")
            self.fallback[source] = tuple(targets)
        self.kinds = dict(kinds or {})
        for kind, name in self.kinds.items():
            if name not in self.routes:
                raise ValueError(f"kind {kind!r} names unknown route {name!r}")
        self.sticky_sessions = sticky_sessions
        if sticky_sessions and self.affinity is None:
            self.affinity = SessionAffinity(MemoryAffinityStore(max_sessions=max_sessions))
        elif not sticky_sessions:
            self.affinity = None
        self._token_estimator = token_estimator

    def owned_clients(self) -> Iterable[ChatClient]:
        return [route.client for route in self.routes.values()]

    def routes_by_name(self) -> Mapping[str, Route]:
        return self.routes

    def describe_layer(self) -> str:
        return f"TieredRoutingChatClient({', '.join(self.routes)}; default {self.default})"

    # -- selection -------------------------------------------------------------------------

    def _start(self, context: RoutingContext, hints: dict[str, Any]) -> str:
        pin = hints.get(PIN_HINT)
        if pin is not None:
            if pin not in self.routes:
                raise RoutingError(f"the pinned route {pin!r} is not one of the routes")
            return str(pin)
        if context.preferred_route is not None:
            return context.preferred_route
        kind = hints.get(KIND_HINT)
        if kind is not None:
            if kind not in self.kinds:
                raise RoutingError(f"no route is configured for request kind {kind!r}")
            return self.kinds[kind]
        return self.default

    def _chain(self, start: str) -> list[str]:
        chain: list[str] = []
        pending = [start]
        while pending:
            name = pending.pop(0)
            if name not in chain:
                chain.append(name)
                pending.extend(self.fallback.get(name, ()))
        return chain

    def plan(self, context: RoutingContext) -> list[Route]:
        """The eligible routes for this request, in the order they would be tried."""
        hints = {
            key: context.options.additional_properties.pop(key)
            for key in (PIN_HINT, KIND_HINT)
            if key in context.options.additional_properties
        }
        start = self._start(context, hints)
        tokens = self._token_estimator(context.messages)
        needed = required_capabilities(context)
        eligible: list[Route] = []
        for name in self._chain(start):
            route = self.routes[name]
            if route.max_input_tokens is not None and tokens > route.max_input_tokens:
                _logger.info(
                    "escalation: route %s skipped, ~%d input tokens exceed its %d",
                    name,
                    tokens,
                    route.max_input_tokens,
                )
                continue
            missing = needed - route.capabilities
            if missing:
                _logger.info(
                    "escalation: route %s skipped, it lacks %s", name, ", ".join(sorted(missing))
                )
                continue
            eligible.append(route)
        if not eligible:
            raise RoutingError(
                f"no route can serve this request (from {start!r}: ~{tokens} input tokens, "
                f"capabilities {sorted(needed) or 'none'})"
            )
        return eligible

    async def select_client(self, context: RoutingContext) -> SelectionResult:
        chain: list[Route] | None = context.state.get(_CHAIN)
        if chain is None:
            chain = context.state[_CHAIN] = self.plan(context)
        return chain[len(context.attempts)]

    def should_failover(
        self, context: RoutingContext, exception: BaseException
    ) -> bool | Awaitable[bool]:
        # The chain's length is known only per request, so the end of the chain stops
        # failover here rather than through the attempt limit.
        chain = context.state.get(_CHAIN, ())
        if len(context.attempts) + 1 >= len(chain):
            return False
        return super().should_failover(context, exception)

    def on_routing_update(
        self, context: RoutingContext, attempt: FailoverAttempt, is_terminal: bool
    ) -> None:
        if is_terminal:
            context.state.pop(_CHAIN, None)
        else:
            _logger.info(
                "escalation: route %s failed before output (%s), trying the next tier",
                attempt.route_name,
                type(attempt.exception).__name__,
            )
