"""Routers: choose a route per request, and fail over while it is still safe.

`RoutingChatClient` calls one selected client per request; `FailoverChatClient` (the
attempt engine, with `OrderedFailoverChatClient`, `TieredRoutingChatClient`) may select
again after a failure before output; `SemanticRoutingChatClient` picks a route by embedding
similarity. Every attempt is reported as a `FailoverAttempt` and traced as a span.
"""

from middleware.routing.context import (
    AttemptOutcome,
    FailoverAttempt,
    Price,
    Route,
    RoutingContext,
    RoutingSelection,
)
from middleware.routing.failover import (
    FailoverChatClient,
    FailoverSettings,
    OrderedFailoverChatClient,
)
from middleware.routing.router import RoutingChatClient
from middleware.routing.semantic import RouteScore, SemanticRoutingChatClient, SemanticSettings
from middleware.routing.tiered import TieredRoutingChatClient

__all__ = [
    "AttemptOutcome",
    "FailoverAttempt",
    "FailoverChatClient",
    "FailoverSettings",
    "OrderedFailoverChatClient",
    "Price",
    "Route",
    "RouteScore",
    "RoutingChatClient",
    "RoutingContext",
    "RoutingSelection",
    "SemanticRoutingChatClient",
    "SemanticSettings",
    "TieredRoutingChatClient",
]
