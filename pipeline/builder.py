"""`ChatPipeline` and its fluent builder.

The first ``use_*`` call is the outermost layer. A chain either ends in a router
(``use_router``, ``use_failover``, ``use_ordered_failover``, ``use_balanced_failover``,
``use_hedging``, ``use_semantic_routing``) and is built with ``build()``, or wraps a client
given to ``build(inner)``. Every ``use_*`` takes ``enabled``, so one code path serves every
environment: a disabled layer is simply absent (see `ChatPipeline.describe`).

Each ``use_*`` validates its arguments where it is written (the layer's settings class does
the checking) and `build()` builds every layer afresh, routers included: two pipelines
built from one builder share no state. Clients and generators handed to a router are
shared by those pipelines, and closed when the last of them closes.

Telemetry providers given to the builder (``ChatPipeline.builder(tracer_provider=...,
meter_provider=...)``) reach every layer it builds: telemetry, routers, breakers and tool
spans; without them every layer uses the global providers.

Middleware modules are imported inside the ``use_*`` methods, so ``pipeline`` never imports
``middleware`` at import time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

from pipeline.client import (
    Answer,
    AsyncClosing,
    ChatClient,
    ChatClientMetadata,
    DelegatingChatClient,
    EmbeddingGenerator,
    check_options,
    client_name,
    close_all,
    ensure_chat_client,
    metadata_of,
    raising,
)
from pipeline.types import ChatOptions, ChatResponseUpdate, Messages, as_messages

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

    from middleware.breaker import BreakerSettings
    from middleware.function_invocation import FunctionInvocationSettings
    from middleware.retry import RetrySettings
    from middleware.routing.balanced import BalancedFailoverChatClient, BalancedSettings
    from middleware.routing.context import Route, RoutingContext, SelectionResult
    from middleware.routing.failover import FailoverChatClient, FailoverSettings
    from middleware.routing.hedging import HedgingSettings
    from middleware.routing.semantic import RouteProfile

__all__ = ["ChatPipeline", "ChatPipelineBuilder", "LayerFactory", "SharedResources"]

LayerFactory = Callable[[ChatClient], ChatClient]


class ChatPipeline(AsyncClosing):
    """A built pipeline: a `ChatClient` that validates its input once and calls its layers.

    Messages may be a str, a `ChatMessage` or a sequence of them; anything else raises
    `TypeError`, an empty sequence `RequestRefusedError` (a `ValueError`), before any layer
    runs.
    """

    # Its layers' answers pass on as they come (`pipeline._forward`).
    keeps_raw_answers = True

    def __init__(
        self,
        client: ChatClient,
        *,
        name: str | None = None,
        on_close: Sequence[Callable[[], Awaitable[None]]] = (),
    ) -> None:
        self.client = ensure_chat_client(client)
        self._on_close = tuple(on_close)
        inner = metadata_of(self.client)
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
    def builder(
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> ChatPipelineBuilder:
        """A builder; the providers (default: the global ones) reach every layer it builds."""
        return ChatPipelineBuilder(tracer_provider=tracer_provider, meter_provider=meter_provider)

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

    def get_response(self, messages: Messages, options: ChatOptions | None = None) -> Answer:
        # The layers' coroutine itself, not one of our own around it: a request in flight
        # holds one object less (see the performance notes, "The library at concurrency").
        try:
            checked = as_messages(messages), check_options(options)
        except Exception as exc:
            return raising(exc)
        return self.client.get_response(*checked)

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return self.client.get_streaming_response(as_messages(messages), check_options(options))

    async def aclose(self) -> None:
        """Close every layer and the clients the pipeline owns, once."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.client.aclose()
        finally:
            for release in self._on_close:
                await release()

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


class SharedResources:
    """Clients (or generators) handed to a builder once and used by every pipeline it
    builds: each pipeline holds a lease, and the last lease released closes them, each
    once (closing errors of all are raised together)."""

    def __init__(self, resources: Iterable[object]) -> None:
        self._resources = list(resources)
        self._leases = 0

    def lease(self) -> Callable[[], Awaitable[None]]:
        """A lease; awaiting the returned release (once or more) gives it back."""
        self._leases += 1
        released = False

        async def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self._leases -= 1
            if self._leases == 0:
                await close_all(self._resources, "shared clients")

        return release


class _RouterSpec:
    """How `build()` makes the chain's router: afresh each time, with the shared clients
    it routes to leased for the pipeline's lifetime."""

    __slots__ = ("make", "once", "shared", "used")

    def __init__(
        self,
        make: Callable[[], ChatClient],
        shared: SharedResources | None,
        *,
        once: bool = False,
    ) -> None:
        self.make = make
        self.shared = shared
        self.once = once
        self.used = False


class ChatPipelineBuilder:
    """Composes layers; the first ``use_*`` call is the outermost layer (see the module
    docstring). Layer options are the fields of each layer's settings class."""

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        self._factories: list[LayerFactory] = []
        self._router: _RouterSpec | None = None
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider

    def _providers(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The builder's providers, unless the call gave its own."""
        return {
            "tracer_provider": options.get("tracer_provider", self.tracer_provider),
            "meter_provider": options.get("meter_provider", self.meter_provider),
        }

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

    def _end_with(self, router: _RouterSpec, enabled: bool) -> Self:
        if self._router is not None:
            raise ValueError("the chain already ends in a router")
        if enabled:
            self._router = router
        return self

    def build(self, inner: ChatClient | None = None, name: str | None = None) -> ChatPipeline:
        """Build the pipeline around `inner`, or around the router that ends the chain.

        Every layer and router is new; clients given to a router are shared with the
        other pipelines of this builder and closed when the last of them closes.
        """
        on_close: list[Callable[[], Awaitable[None]]] = []
        spec = self._router
        if spec is not None:
            if inner is not None:
                raise ValueError("this chain ends in a router: build() takes no inner client")
            if spec.once and spec.used:
                raise ValueError(
                    "use_failover() was given a router instance, which one pipeline owns: "
                    "give it a factory (a callable returning a new router) to build again"
                )
            spec.used = True
            client = ensure_chat_client(spec.make(), "the router")
            if spec.shared is not None:
                on_close.append(spec.shared.lease())
        elif inner is None:
            raise ValueError("build() needs an inner client unless the chain ends in a router")
        else:
            client = ensure_chat_client(inner, "inner")
        for factory in reversed(self._factories):
            client = ensure_chat_client(factory(client), "the result of a layer factory")
        return ChatPipeline(client, name=name, on_close=on_close)

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
        self, settings: RetrySettings | None = None, *, enabled: bool = True, **options: Any
    ) -> Self:
        """Retry this client's deployment failures (see `middleware.retry`); `options` are
        `RetrySettings` fields (``max_attempts=2``, ``sleep=...``)."""
        from middleware.retry import RetryChatClient, RetrySettings

        checked = RetrySettings.from_options(settings, options)
        return self.use(lambda inner: RetryChatClient(inner, checked), enabled=enabled)

    def use_circuit_breaker(
        self, settings: BreakerSettings | None = None, *, enabled: bool = True, **options: Any
    ) -> Self:
        """Fail fast while this client's deployment is failing (see `middleware.breaker`);
        `options` are `BreakerSettings` fields, plus ``meter_provider`` and ``now``.

        Each `build()` makes its own breaker (shared state only through ``redis``).
        """
        from middleware.breaker import BreakerSettings, CircuitBreakerChatClient

        extra = {key: options.pop(key) for key in ("now",) if key in options}
        extra["meter_provider"] = self._providers(options)["meter_provider"]
        options.pop("meter_provider", None)
        checked = BreakerSettings.from_options(settings, options)
        return self.use(
            lambda inner: CircuitBreakerChatClient(inner, checked, **extra), enabled=enabled
        )

    def use_telemetry(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        enabled: bool = True,
    ) -> Self:
        """A ``chat {model}`` span and GenAI metrics per request (see `middleware.telemetry`).

        Providers default to the builder's, else the global ones; nothing is recorded until
        an SDK is configured (`pipeline.telemetry.configure`). No content is ever recorded.
        """
        from middleware.telemetry import TelemetryChatClient

        tracer_provider = tracer_provider or self.tracer_provider
        meter_provider = meter_provider or self.meter_provider
        return self.use(
            lambda inner: TelemetryChatClient(
                inner, tracer_provider=tracer_provider, meter_provider=meter_provider
            ),
            enabled=enabled,
        )

    def use_function_invocation(
        self,
        tools: Sequence[Any] = (),
        settings: FunctionInvocationSettings | None = None,
        *,
        idempotency_store: Any = None,
        enabled: bool = True,
        **options: Any,
    ) -> Self:
        """Run the model's tool calls in a loop (see `middleware.function_invocation`);
        `options` are `FunctionInvocationSettings` fields, plus ``tracer_provider``.

        Without an `idempotency_store`, each built pipeline has its own memory store.
        """
        from middleware.function_invocation import (
            FunctionInvocationSettings,
            FunctionInvokingChatClient,
            tool_table,
        )

        tracer_provider = self._providers(options)["tracer_provider"]
        options.pop("tracer_provider", None)
        checked = FunctionInvocationSettings.from_options(settings, options)
        # Built once, here, so a bad tool fails where it was written.
        definitions = list(tool_table(tools).values())
        return self.use(
            lambda inner: FunctionInvokingChatClient(
                inner,
                definitions,
                checked,
                idempotency_store=idempotency_store,
                tracer_provider=tracer_provider,
            ),
            enabled=enabled,
        )

    def use_response_validation(
        self,
        validator: Any,
        *,
        buffer_streams: bool = False,
        strip_fences: bool = False,
        enabled: bool = True,
    ) -> Self:
        """Validate every response against `validator`: a pydantic model class, a JSON
        schema dict or a callable taking the `ChatResponse` (see
        `middleware.response_validation`). An invalid answer raises
        `ResponseValidationError`, which a router above fails over; a valid one carries the
        validated object as ``response.value``. With `buffer_streams`, streamed updates are
        held until the response validated, so a streamed request can still fail over."""
        from middleware.response_validation import (
            ResponseValidationChatClient,
            ResponseValidationSettings,
        )
        from pipeline._validation import ShapeCheck

        checked = ResponseValidationSettings(
            buffer_streams=buffer_streams, strip_fences=strip_fences
        )
        ShapeCheck(validator)  # a bad validator fails where it was written
        return self.use(
            lambda inner: ResponseValidationChatClient(inner, validator, checked),
            enabled=enabled,
        )

    def use_cache(
        self,
        store: Any = None,
        *,
        ttl: float = 3600.0,
        scope: Callable[[list[Any], ChatOptions], str | None] | None = None,
        semantic: Any = None,
        single_flight: bool = True,
        enabled: bool = True,
        **options: Any,
    ) -> Self:
        """Answer repeated requests from a cache (see `middleware.cache`): `store` is a
        `MemoryCacheStore` or `RedisCacheStore` (default: a memory store per built
        pipeline), `ttl` seconds an answer is kept, `scope` a function of the request whose
        value keeps entries apart, `semantic` a `SemanticCacheSettings` (or an embedding
        generator, with the default threshold) for lookups by meaning; `options` are the
        other `CacheSettings` fields (``per_session``, ``finish_reasons``, ...), plus
        ``meter_provider``.

        Outside a router: one lookup per request; inside a tool loop
        (after ``use_function_invocation``): each model turn is cached, and tools still run.
        """
        from middleware.cache import (
            CacheSettings,
            CacheStore,
            CachingChatClient,
            MemoryCacheStore,
            SemanticCacheSettings,
        )

        meter_provider = self._providers(options)["meter_provider"]
        options.pop("meter_provider", None)
        checked = CacheSettings(ttl=ttl, scope=scope, single_flight=single_flight, **options)
        if store is not None and not isinstance(store, CacheStore):
            raise TypeError("store must have async get(key) and set(key, value, ttl)")
        if semantic is not None and not isinstance(semantic, SemanticCacheSettings):
            semantic = SemanticCacheSettings(embeddings=semantic)
        return self.use(
            lambda inner: CachingChatClient(
                inner,
                store if store is not None else MemoryCacheStore(),
                checked,
                semantic=semantic,
                meter_provider=meter_provider,
                close_store=store is None,
            ),
            enabled=enabled,
        )

    def use_budgets(
        self,
        redis: str,
        *,
        scope: str = "default",
        budget: Any = None,
        rpm: int | None = None,
        tpm: int | None = None,
        price: Any = None,
        fail_closed: bool = False,
        enabled: bool = True,
    ) -> Self:
        """Hold this client's calls to a `pipeline.keys.Budget` and rate limits counted in
        the Redis at `redis`, shared by every process using the same `scope` (see
        `middleware.budgets`). `price` (a `pipeline.pricing.Price`) bounds each call's
        reservation and prices a call no router beneath logs."""
        from middleware.budgets import BudgetChatClient

        return self.use(
            lambda inner: BudgetChatClient(
                inner,
                redis,
                scope=scope,
                budget=budget,
                rpm=rpm,
                tpm=tpm,
                price=price,
                fail_closed=fail_closed,
            ),
            enabled=enabled,
        )

    def use_spend(
        self,
        ledger: Any,
        *,
        attribution: Any = None,
        price: Any = None,
        enabled: bool = True,
    ) -> Self:
        """Record what each request spent in `ledger` (a `pipeline.spend.SpendLedger`): a
        record per provider call the routers beneath make (each retried call too), and per
        cache hit beneath (see `middleware.spend`). `attribution` says whose requests they
        are: a fixed `pipeline.spend.Attribution` (or a mapping of its fields), or a
        function of the request, ``(messages, options) -> Attribution | None``. `price` (a
        `pipeline.pricing.Price`) prices the call when no router is beneath, over the
        ledger's book. The ledger is yours to close (`SpendLedger.aclose`) when every
        pipeline using it is closed."""
        from middleware.spend import SpendChatClient
        from pipeline.pricing import Price
        from pipeline.spend import Attribution, SpendLedger

        if not isinstance(ledger, SpendLedger):
            raise TypeError(f"ledger must be a SpendLedger, not {type(ledger).__name__}")
        if attribution is not None and not callable(attribution):
            attribution = Attribution.of(attribution)  # a bad one fails where it was written
        if price is not None and not isinstance(price, Price):
            raise TypeError(f"price must be a Price, not {type(price).__name__}")
        return self.use(
            lambda inner: SpendChatClient(inner, ledger, attribution=attribution, price=price),
            enabled=enabled,
        )

    # -- routers (end the chain) -------------------------------------------------------------

    def use_router(
        self,
        selector: Callable[[RoutingContext], SelectionResult | Awaitable[SelectionResult]],
        *,
        enabled: bool = True,
        name: str | None = None,
    ) -> Self:
        """End the chain with a one-shot router calling `selector` once per request (it
        never closes the clients it selects)."""
        from middleware.routing.router import RoutingChatClient

        def make() -> ChatClient:
            return RoutingChatClient.create(selector, name=name, **self._providers({}))

        make()  # validates the selector where it was written
        return self._end_with(_RouterSpec(make, None), enabled)

    def use_failover(
        self,
        router: FailoverChatClient | Callable[[], FailoverChatClient],
        *,
        enabled: bool = True,
    ) -> Self:
        """End the chain with a custom `FailoverChatClient`: a factory returning a new one
        per `build()`, or an instance, which only one pipeline can own."""
        from middleware.routing.failover import FailoverChatClient

        if isinstance(router, FailoverChatClient):
            instance = router
            return self._end_with(_RouterSpec(lambda: instance, None, once=True), enabled)
        if not callable(router):
            raise TypeError("use_failover() needs a FailoverChatClient or a factory of one")

        def make() -> ChatClient:
            made = router()
            if not isinstance(made, FailoverChatClient):
                raise TypeError("the use_failover() factory must return a FailoverChatClient")
            return made

        return self._end_with(_RouterSpec(make, None), enabled)

    def use_ordered_failover(
        self,
        routes: Sequence[Route | ChatClient],
        settings: FailoverSettings | None = None,
        *,
        enabled: bool = True,
        **options: Any,
    ) -> Self:
        """End the chain with an `OrderedFailoverChatClient` over `routes`; `options` are
        `FailoverSettings` fields and the router's keywords (``name``, ``clock``, ...)."""
        from middleware.routing.failover import OrderedFailoverChatClient

        leave_open = bool(options.pop("leave_open", False))
        providers = self._providers(options)
        options.update(providers)

        def make() -> OrderedFailoverChatClient:
            return OrderedFailoverChatClient(routes, settings, leave_open=True, **options)

        first = make()  # validates routes and options where they were written
        shared = None if leave_open else SharedResources(first.owned_clients())
        return self._end_with(_RouterSpec(make, shared), enabled)

    def use_balanced_failover(
        self,
        routes: Sequence[Route | ChatClient],
        settings: BalancedSettings | None = None,
        *,
        enabled: bool = True,
        **options: Any,
    ) -> Self:
        """End the chain with a `BalancedFailoverChatClient` over `routes`: each attempt
        goes to a healthy route chosen by `strategy` (default ``peak_ewma``); `options` are
        `BalancedSettings` fields, ``health=`` (a `RouteHealth` several routers share, or a
        `RedisHealthStore`), ``affinity=`` and the router's keywords. Each built pipeline
        has a `RouteHealth` of its own unless one is given."""
        from middleware.routing.balanced import BalancedFailoverChatClient

        return self._end_with_balanced(
            BalancedFailoverChatClient, routes, settings, enabled, options
        )

    def use_hedging(
        self,
        routes: Sequence[Route | ChatClient],
        settings: HedgingSettings | None = None,
        *,
        enabled: bool = True,
        **options: Any,
    ) -> Self:
        """End the chain with a `HedgingChatClient` over `routes`: a balanced router that
        starts the next route too when an attempt has no first update after `delay`
        (seconds, or ``"p90"``: that percentile of the route's recent times to first
        update), keeps the first to answer and cancels the others, with hedges under
        `budget` (a fraction of requests); `options` are `HedgingSettings` fields,
        ``health=``, ``affinity=`` and the router's keywords. Each built pipeline has a
        hedge budget of its own, and a `RouteHealth` of its own unless one is given."""
        from middleware.routing.hedging import HedgingChatClient

        return self._end_with_balanced(HedgingChatClient, routes, settings, enabled, options)

    def _end_with_balanced(
        self,
        router: type[BalancedFailoverChatClient],
        routes: Sequence[Route | ChatClient],
        settings: BalancedSettings | None,
        enabled: bool,
        options: dict[str, Any],
    ) -> Self:
        leave_open = bool(options.pop("leave_open", False))
        options.update(self._providers(options))

        def make() -> BalancedFailoverChatClient:
            return router(routes, settings, leave_open=True, **options)

        first = make()  # validates routes and options where they were written
        shared = None if leave_open else SharedResources(first.owned_clients())
        return self._end_with(_RouterSpec(make, shared), enabled)

    def use_semantic_routing(
        self,
        embedding_generator: EmbeddingGenerator,
        profiles: Mapping[Route | ChatClient, Sequence[str] | RouteProfile],
        default: Route | ChatClient,
        *,
        enabled: bool = True,
        **options: Any,
    ) -> Self:
        """End the chain with a `SemanticRoutingChatClient` (see `middleware.routing.semantic`);
        `options` are `SemanticSettings` fields and the router's keywords. Each built
        pipeline embeds the profiles once, lazily."""
        from middleware.routing.semantic import SemanticRoutingChatClient, as_embedding_generator

        # One generator (a local model wrapped once) for every pipeline this builder builds.
        embedding_generator = as_embedding_generator(embedding_generator)
        leave_open = bool(options.pop("leave_open", False))
        options.update(self._providers(options))

        def make() -> SemanticRoutingChatClient:
            return SemanticRoutingChatClient(
                embedding_generator, profiles, default, leave_open=True, **options
            )

        first = make()
        shared = (
            None if leave_open else SharedResources([*first.owned_clients(), embedding_generator])
        )
        return self._end_with(_RouterSpec(make, shared), enabled)
