from __future__ import annotations

from typing import Any

from middleware.routing import FailoverAttempt, OrderedFailoverChatClient, RoutingContext


class RecordingFailover(OrderedFailoverChatClient):
    """Ordered failover that records every routing update and every request context."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.updates: list[tuple[FailoverAttempt, bool]] = []
        self.contexts: list[RoutingContext] = []

    async def select_client(self, context: RoutingContext):  # type: ignore[no-untyped-def]
        if not context.attempts:
            self.contexts.append(context)
        return await super().select_client(context)

    def on_routing_update(
        self, context: RoutingContext, attempt: FailoverAttempt, is_terminal: bool
    ) -> None:
        self.updates.append((attempt, is_terminal))

    def summary(self) -> list[tuple[str, str, bool]]:
        return [(a.route_name, a.outcome, terminal) for a, terminal in self.updates]
