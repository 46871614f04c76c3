"""Routers: choose a route per request, and fail over while it is still safe.

`RoutingChatClient` calls one selected client per request; `FailoverChatClient` (with
`OrderedFailoverChatClient`, `TieredRoutingChatClient`, `BalancedFailoverChatClient`) may
select again after a failure before output; `HedgingChatClient` also starts the next route
beside an attempt slow to answer; `SemanticRoutingChatClient` picks a route by embedding
similarity. Every router runs on one attempt engine: every attempt is reported as a
`FailoverAttempt` and traced as a span.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from middleware.routing._health_redis import RedisHealthStore
from middleware.routing.affinity import (
    AffinitySettings,
    MemoryAffinityStore,
    RedisAffinityStore,
    SessionAffinity,
)
from middleware.routing.balanced import (
    BalancedFailoverChatClient,
    BalancedSettings,
)
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
from middleware.routing.health import HealthSettings, HealthStore, RouteHealth, RouteStats
from middleware.routing.hedging import HedgingChatClient, HedgingSettings
from middleware.routing.router import RoutingChatClient
from middleware.routing.tiered import TieredRoutingChatClient

if TYPE_CHECKING:
    from middleware.routing.semantic import (
        FitReport,
        RouteDecision,
        RouteProfile,
        RouteScore,
        RoutingMetrics,
        SemanticRoutingChatClient,
        SemanticSettings,
    )

# Semantic routing needs numpy: it is imported when one of its names is first used.
_SEMANTIC = frozenset(
    {
        "FitReport",
        "RouteDecision",
        "RouteProfile",
        "RouteScore",
        "RoutingMetrics",
        "SemanticRoutingChatClient",
        "SemanticSettings",
    }
)

__all__ = [
    "BalancedFailoverChatClient",
    "BalancedSettings",
    "HealthSettings",
    "HealthStore",
    "HedgingChatClient",
    "HedgingSettings",
    "RouteHealth",
    "RouteStats",
    "AffinitySettings",
    "AttemptOutcome",
    "FailoverAttempt",
    "FailoverChatClient",
    "FailoverSettings",
    "FitReport",
    "MemoryAffinityStore",
    "OrderedFailoverChatClient",
    "Price",
    "RedisAffinityStore",
    "RedisHealthStore",
    "Route",
    "RouteDecision",
    "RouteProfile",
    "RouteScore",
    "RoutingChatClient",
    "RoutingContext",
    "RoutingMetrics",
    "RoutingSelection",
    "SemanticRoutingChatClient",
    "SemanticSettings",
    "SessionAffinity",
    "TieredRoutingChatClient",
]


def __getattr__(name: str) -> Any:
    if name in _SEMANTIC:
        from middleware.routing import semantic

        value = getattr(semantic, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'middleware.routing' has no attribute {name!r}")
