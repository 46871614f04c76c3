"""`ChatPipeline` and its fluent builder.

The first ``use_*`` call is the outermost layer. A chain either ends in a router
(``use_router``, ``use_failover``, ``use_ordered_failover``, ``use_semantic_routing``) and
is built with ``build()``, or wraps a client given to ``build(inner)``. Every ``use_*``
takes ``enabled``, so one code path serves every environment: a disabled layer is simply
absent (see `ChatPipeline.describe`).

Middleware modules are imported inside the ``use_*`` methods, so ``pipeline`` never imports
``middleware`` at import time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

from pipeline.client import (
    AsyncClosing,
    ChatClient,
    ChatClientMetadata,
    DelegatingChatClient,
    EmbeddingGenerator,
    check_options,
    client_name,
    ensure_chat_client,
)
from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages, as_messages

if TYPE_CHECKING:
    from middleware.routing.context import Route, RoutingContext, SelectionResult
    from middleware.routing.failover import FailoverChatClient

__all__ = ["ChatPipeline", "ChatPipelineBuilder", "LayerFactory"]

LayerFactory = Callable[[ChatClient], ChatClient]


class ChatPipeline(AsyncClosing):
    """A built pipeline: a `ChatClient` that validates its input once and calls its layers.

    Messages may be a str, a `ChatMessage` or a sequence of them; anything else raises
    `TypeError`, an empty sequence `ValueError`, before any layer runs.
    """

    def __init__(self, client: ChatClient, *, name: str | None = None) -> None:
        self.client = ensure_chat_client(client)
        inner = self.client.metadata
        self._metadata = (
            inner
            if name is None
            else ChatClientMetadata(
                provider_name=inner.provider_name,
                model_id=inner.model_id,
                server_address=inner.server_address,
                server_port=inner.server_port,
                name=name,
            )
        )
        self._closed = False

    @staticmethod
    def builder() -> ChatPipelineBuilder:
        return ChatPipelineBuilder()

    @classmethod
    def from_config(
        cls,
        path: str | os.PathLike[str],
        environment: str | None = None,
        *,
        tools: Sequence[Any] = (),
    ) -> ChatPipeline:
        """Build the pipeline a TOML file describes (see `pipeline.config`).

        The environment overlay is `environment`, else ``CHAT_PIPELINE_ENV``. Tools are code,
        so they are passed here when the file turns ``layers.function_invocation`` on.
        """
        from pipeline.config import load_pipeline

        return load_pipeline(path, environment, tools=tools)

    @property
    def metadata(self) -> ChatClientMetadata:
        return self._metadata

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        return await self.client.get_response(as_messages(messages), check_options(options))

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return self.client.get_streaming_response(as_messages(messages), check_options(options))

    async def aclose(self) -> None:
        """Close every layer and the clients the pipeline owns, once."""
        if self._closed:
            return
        self._closed = True
        await self.client.aclose()

    def describe(self) -> list[str]:
        """The layers, outermost first, ending with the router or the innermost client."""
        return describe_chain(self.client)

    def __repr__(self) -> str:
        return f"ChatPipeline({' -> '.join(self.describe())})"


def describe_chain(client: ChatClient) -> list[str]:
    """Describe `client` and every layer beneath it, outermost first."""
    layers: list[str] = []
    current: object = client
    while True:
        if isinstance(current, ChatPipeline):
            current = current.client
            continue
        describe_layer = getattr(current, "describe_layer", None)
        if isinstance(current, DelegatingChatClient):
            layers.append(current.describe_layer())
            current = current.inner
            continue
        if callable(describe_layer):
            layers.append(str(describe_layer()))
        elif isinstance(current, ChatClient):
            layers.append(f"{type(current).__name__}({client_name(current)})")
        else:  # pragma: no cover - ensure_chat_client guards every link
            layers.append(type(current).__name__)
        return layers


class ChatPipelineBuilder:
    """Composes layers; the first ``use_*`` call is the outermost layer."""

    def __init__(self) -> None:
        self._factories: list[LayerFactory] = []
        self._router: Callable[[], ChatClient] | None = None

    # -- generic ---------------------------------------------------------------------------

    def use(self, factory: LayerFactory, *, enabled: bool = True) -> Self:
        """Add a custom layer: `factory(inner)` returns the layer wrapping `inner`."""
        if not callable(factory):
            raise TypeError("use() needs a callable that takes the inner client")
        if self._router is not None:
            raise ValueError("a router ends the chain: add layers before the router")
        if enabled:
            self._factories.append(factory)
        return self

    def _end_with(self, router: Callable[[], ChatClient], enabled: bool) -> Self:
        if self._router is not None:
            raise ValueError("the chain already ends in a router")
        if enabled:
            self._router = router
        return self

    def build(self, inner: ChatClient | None = None, name: str | None = None) -> ChatPipeline:
        """Build the pipeline around `inner`, or around the router that ends the chain."""
        if self._router is not None:
            if inner is not None:
                raise ValueError("this chain ends in a router: build() takes no inner client")
            client = self._router()
        elif inner is None:
            raise ValueError("build() needs an inner client unless the chain ends in a router")
        else:
            client = ensure_chat_client(inner, "inner")
        for factory in reversed(self._factories):
            client = ensure_chat_client(factory(client), "the result of a layer factory")
        return ChatPipeline(client, name=name)

    # -- layers ----------------------------------------------------------------------------

    def configure_options(
        self, configure: Callable[[ChatOptions], ChatOptions | None], *, enabled: bool = True
    ) -> Self:
        """Shape each request's options on a clone; the caller's object is never touched."""
        from middleware.configure_options import ConfigureOptionsChatClient

        if not callable(configure):
            raise TypeError("configure_options() needs a callable")
        return self.use(lambda inner: ConfigureOptionsChatClient(inner, configure), enabled=enabled)

    def use_logging(self, logger: logging.Logger | None = None, *, enabled: bool = True) -> Self:
        """Log request start/end, duration, model and outcome; never content."""
        from middleware.logging import LoggingChatClient

        return self.use(lambda inner: LoggingChatClient(inner, logger), enabled=enabled)

    def use_retry(
        self,
        *,
        max_attempts: int = 3,
        initial_delay: float = 0.5,
        max_delay: float = 8.0,
        jitter: bool = True,
        respect_retry_after: bool = True,
        max_retry_after: float = 30.0,
        retry_on: Callable[[BaseException], bool] | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        enabled: bool = True,
    ) -> Self:
        """Retry this client's deployment failures (see `middleware.retry`)."""
        from middleware.retry import RetryChatClient, RetryPolicy

        extra: dict[str, Any] = {}
        if retry_on is not None:
            extra["retry_on"] = retry_on
        if sleep is not None:
            extra["sleep"] = sleep
        policy = RetryPolicy(
            max_attempts=max_attempts,
            initial_delay=initial_delay,
            max_delay=max_delay,
            jitter=jitter,
            respect_retry_after=respect_retry_after,
            max_retry_after=max_retry_after,
            **extra,
        )
        return self.use(lambda inner: RetryChatClient(inner, policy), enabled=enabled)

    def use_circuit_breaker(
        self,
        *,
        fail_max: int = 5,
        reset_timeout: float = 30.0,
        name: str | None = None,
        counts: Callable[[BaseException], bool] | None = None,
        redis: Any = None,
        on_state_change: Callable[[str, str, str], None] | None = None,
        meter_provider: Any = None,
        enabled: bool = True,
    ) -> Self:
        """Fail fast while this client's deployment is failing (see `middleware.breaker`).

        Each `build()` makes its own breaker; share one by sharing the built pipeline.
        """
        from middleware.breaker import CircuitBreakerChatClient, counts_as_deployment_failure

        options: dict[str, Any] = {
            "fail_max": fail_max,
            "reset_timeout": reset_timeout,
            "name": name,
            "counts": counts or counts_as_deployment_failure,
            "redis": redis,
            "on_state_change": on_state_change,
            "meter_provider": meter_provider,
        }
        # Validate now, so a bad argument fails where it was written, not at build().
        CircuitBreakerChatClient.validate_options(**options)
        return self.use(lambda inner: CircuitBreakerChatClient(inner, **options), enabled=enabled)

    def use_telemetry(
        self,
        *,
        tracer_provider: Any = None,
        meter_provider: Any = None,
        enabled: bool = True,
    ) -> Self:
        """A ``chat {model}`` span and GenAI metrics per request (see `middleware.telemetry`).

        Providers default to the global ones; nothing is recorded until an SDK is configured
        (`pipeline.telemetry.configure`). No message content is ever recorded.
        """
        from middleware.telemetry import TelemetryChatClient

        return self.use(
            lambda inner: TelemetryChatClient(
                inner, tracer_provider=tracer_provider, meter_provider=meter_provider
            ),
            enabled=enabled,
        )

    def use_function_invocation(
        self,
        tools: Sequence[Any] = (),
        *,
        max_iterations: int = 10,
        allow_concurrent: bool = True,
        idempotency_store: Any = None,
        include_detailed_errors: bool = False,
        enabled: bool = True,
    ) -> Self:
        """Run the model's tool calls in a loop (see `middleware.function_invocation`)."""
        from middleware.function_invocation import FunctionInvokingChatClient, Tool

        FunctionInvokingChatClient.validate_options(tools=tools, max_iterations=max_iterations)
        # Build the tools once, here, so a bad tool fails where it was written; each built
        # pipeline shares them and the idempotency store.
        definitions = [t if isinstance(t, Tool) else Tool.from_function(t) for t in tools]
        store = idempotency_store
        if store is None:
            from middleware.function_invocation import MemoryIdempotencyStore

            store = MemoryIdempotencyStore()
        return self.use(
            lambda inner: FunctionInvokingChatClient(
                inner,
                definitions,
                max_iterations=max_iterations,
                allow_concurrent=allow_concurrent,
                idempotency_store=store,
                include_detailed_errors=include_detailed_errors,
            ),
            enabled=enabled,
        )

    # -- routers (end the chain) -------------------------------------------------------------

    def use_router(
        self,
        selector: Callable[[RoutingContext], SelectionResult | Any],
        *,
        enabled: bool = True,
    ) -> Self:
        """End the chain with a one-shot router calling `selector` once per request."""
        from middleware.routing.router import RoutingChatClient

        router = RoutingChatClient.create(selector)
        return self._end_with(lambda: router, enabled)

    def use_failover(self, policy_client: FailoverChatClient, *, enabled: bool = True) -> Self:
        """End the chain with a custom `FailoverChatClient`."""
        from middleware.routing.failover import FailoverChatClient

        if not isinstance(policy_client, FailoverChatClient):
            raise TypeError("use_failover() needs a FailoverChatClient")
        return self._end_with(lambda: policy_client, enabled)

    def use_ordered_failover(
        self,
        routes: Sequence[Route | ChatClient],
        *,
        enabled: bool = True,
        **options: Any,
    ) -> Self:
        """End the chain with an `OrderedFailoverChatClient` over `routes`."""
        from middleware.routing.failover import OrderedFailoverChatClient

        router = OrderedFailoverChatClient(routes, **options)
        return self._end_with(lambda: router, enabled)

    def use_semantic_routing(
        self,
        embedding_generator: EmbeddingGenerator,
        profiles: Mapping[Route | ChatClient, Sequence[str]],
        default: Route | ChatClient,
        *,
        enabled: bool = True,
        **options: Any,
    ) -> Self:
        """End the chain with a `SemanticRoutingChatClient` (see `middleware.routing.semantic`)."""
        from middleware.routing.semantic import SemanticRoutingChatClient

        router = SemanticRoutingChatClient(embedding_generator, profiles, default, **options)
        return self._end_with(lambda: router, enabled)
