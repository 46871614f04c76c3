"""`RoutingChatClient`: pick a client per request and call it once.

A one-shot router runs on the attempt engine every router shares
(`middleware.routing._engine`) with its one-shot defaults: the selected client is invoked
once, its attempt is recorded and traced like a failover attempt, and the stream boundaries
(``completed``, ``failed_*``, ``abandoned``, ``canceled``) are the same.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from middleware.routing._engine import AttemptEngine
from middleware.routing.context import RoutingContext, SelectionResult
from pipeline.client import AsyncClosing, ChatClient, ChatClientMetadata, client_name, close_all

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

__all__ = ["ROUTER_KEYWORDS", "RoutingChatClient", "Selector", "router_keywords"]

Selector = Callable[[RoutingContext], SelectionResult | Awaitable[SelectionResult]]

ROUTER_KEYWORDS = ("leave_open", "name", "clock", "tracer_provider", "meter_provider")
"""The keywords every router takes (see `RoutingChatClient`); subclasses pass them on in
their ``**options`` next to their settings' fields."""


def router_keywords(options: dict[str, Any]) -> dict[str, Any]:
    """Take the router keywords out of `options` (what is left are settings fields)."""
    return {key: options.pop(key) for key in ROUTER_KEYWORDS if key in options}


class RoutingChatClient(AsyncClosing, AttemptEngine):
    """A chat client that selects the client to call for each request.

    `select_client(context)` (sync or async) runs once per request and the selected client
    is invoked once. A `None` selection raises `RoutingError`; a selector that raises ends
    the request with its exception, and no attempt is reported. Subclasses that own their
    routes list them in `owned_clients()`; `aclose()` closes each of them once unless
    ``leave_open``.
    """

    # Routes' answers pass on as they come (`pipeline._forward`).
    keeps_raw_answers = True

    def __init__(
        self,
        *,
        leave_open: bool = False,
        name: str | None = None,
        clock: Callable[[], float] = time.perf_counter,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        name = name or type(self).__name__
        super().__init__(
            name=name, clock=clock, tracer_provider=tracer_provider, meter_provider=meter_provider
        )
        self.leave_open = leave_open
        self._metadata = ChatClientMetadata(provider_name="router", name=name)
        self._closed = False

    @classmethod
    def create(
        cls,
        selector: Selector,
        *,
        name: str | None = None,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> RoutingChatClient:
        """A router around a plain (sync or async) `selector(context)`.

        It never closes the clients the selector returns: it does not own them.
        """
        if not callable(selector):
            raise TypeError("RoutingChatClient.create() needs a callable selector")
        return _SelectorRoutingChatClient(
            selector, name=name, tracer_provider=tracer_provider, meter_provider=meter_provider
        )

    @abc.abstractmethod
    def select_client(
        self, context: RoutingContext
    ) -> SelectionResult | Awaitable[SelectionResult]:
        """Choose the client (or `Route`, or `RoutingSelection`) for the request."""

    def owned_clients(self) -> Iterable[ChatClient]:
        """The clients this router closes on `aclose()` (none by default)."""
        return ()

    @property
    def metadata(self) -> ChatClientMetadata:
        return self._metadata

    def describe_layer(self) -> str:
        names = [client_name(c) for c in self.owned_clients()]
        return f"{type(self).__name__}({', '.join(names)})" if names else type(self).__name__

    async def aclose(self) -> None:
        """Close every owned client exactly once (unless ``leave_open``)."""
        if self._closed:
            return
        self._closed = True
        if self.leave_open:
            return
        await close_all(self.owned_clients(), "routed clients")


class _SelectorRoutingChatClient(RoutingChatClient):
    def __init__(
        self,
        selector: Selector,
        *,
        name: str | None,
        tracer_provider: TracerProvider | None,
        meter_provider: MeterProvider | None,
    ) -> None:
        super().__init__(
            leave_open=True,
            name=name,
            tracer_provider=tracer_provider,
            meter_provider=meter_provider,
        )
        self._selector = selector

    def describe_layer(self) -> str:
        return f"RoutingChatClient({getattr(self._selector, '__name__', 'selector')})"

    def select_client(
        self, context: RoutingContext
    ) -> SelectionResult | Awaitable[SelectionResult]:
        return self._selector(context)
