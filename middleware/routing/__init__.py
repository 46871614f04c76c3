"""Routers: choose a route per request, and fail over while it is still safe."""

from middleware.routing.context import (
    AttemptOutcome,
    FailoverAttempt,
    Price,
    RequestBudget,
    Route,
    RoutingContext,
    RoutingSelection,
    current_budget,
)
from middleware.routing.failover import FailoverChatClient, OrderedFailoverChatClient
from middleware.routing.router import RoutingChatClient
from middleware.routing.semantic import RouteScore, SemanticRoutingChatClient
from middleware.routing.tiered import TieredRoutingChatClient

__all__ = [
    "AttemptOutcome",
    "FailoverAttempt",
    "FailoverChatClient",
    "OrderedFailoverChatClient",
    "Price",
    "RequestBudget",
    "Route",
    "RoutingChatClient",
    "RoutingContext",
    "RoutingSelection",
    "RouteScore",
    "SemanticRoutingChatClient",
    "TieredRoutingChatClient",
    "current_budget",
]
