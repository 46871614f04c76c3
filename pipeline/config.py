"""Pipelines from TOML: routes, a router, layers, and per-environment overlays.

Every problem is reported at once, each with its key path, as one `ConfigError`, which
echoes nothing read from the file but numbers and names; loading a file without a semantic
router does not import numpy.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import abc
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    ClassVar,
    Generic,
    Literal,
    TypeAlias,
    TypeVar,
    get_args,
)

import pydantic
from pydantic import Field, model_validator

from middleware.breaker import BreakerSettings
from middleware.cache import CacheSettings, SemanticCacheSettings
from middleware.retry import RetrySettings
from middleware.routing._semantic_settings import SemanticSettings
from middleware.routing.affinity import (
    AffinitySettings,
    MemoryAffinityStore,
    RedisAffinityStore,
    SessionAffinity,
)
from middleware.routing.balanced import BalancedSettings
from middleware.routing.context import Route, RouteFacts
from middleware.routing.failover import FailoverSettings
from middleware.routing.health import HealthSettings, RouteHealth
from middleware.routing.hedging import HedgingSettings
from pipeline._settings import Settings, collecting_problems, problems_of, suggest
from pipeline.builder import ChatPipeline, ChatPipelineBuilder
from pipeline.client import ChatClient
from pipeline.errors import ConfigError
from pipeline.keys._settings import BudgetsSettings, KeysSettings
from pipeline.providers._settings import (
    AnthropicSettings,
    AzureOpenAISettings,
    BedrockSettings,
    Credentials,
    EnvironmentVariable,
    GeminiSettings,
    HashingEmbeddingsSettings,
    KeyedEndpoint,
    LocalEmbeddingsSettings,
    Name,
    OllamaSettings,
    OpenAIEmbeddingsSettings,
    OpenAIResponsesSettings,
    OpenAISettings,
    ScriptedSettings,
    VendorSettings,
    VertexSettings,
)
from pipeline.spend._settings import LedgerSettings

if TYPE_CHECKING:
    from pipeline.gateway.settings import GatewaySettings
    from pipeline.pricing import Price
    from pipeline.spend import SpendLedger

__all__ = [
    "ENVIRONMENT_VARIABLE",
    "AffinityConfig",
    "BalancedRouterConfig",
    "AnthropicRouteConfig",
    "AzureOpenAIRouteConfig",
    "BedrockRouteConfig",
    "BreakerConfig",
    "CacheConfig",
    "EmbeddingsConfig",
    "GeminiRouteConfig",
    "GroupConfig",
    "HealthConfig",
    "HedgedRouterConfig",
    "LayersConfig",
    "OllamaRouteConfig",
    "OpenAIResponsesRouteConfig",
    "OpenAIRouteConfig",
    "OrderedRouterConfig",
    "PipelineConfig",
    "RouteConfig",
    "RouterConfig",
    "ScriptedRouteConfig",
    "VendorRouteConfig",
    "SemanticCacheConfig",
    "SemanticRouterConfig",
    "SpendConfig",
    "TieredRouterConfig",
    "VertexRouteConfig",
    "build_pipeline",
    "load_config",
    "load_pipeline",
    "merge",
    "parse_config",
]

ENVIRONMENT_VARIABLE = "CHAT_PIPELINE_ENV"

_S = TypeVar("_S", bound=Settings)


def _settings_of(settings: type[_S], table: Settings, **changes: Any) -> _S:
    """The layer's `settings` from a table built on them (a table adds keys only a file
    needs, such as ``kind`` or ``redis_url_env``), with `changes`."""
    values = {key: value for key, value in table.given().items() if key in settings.model_fields}
    return settings(**{**values, **changes})


class _StoreTable(Settings):
    """Where a table's state is kept: in this process (``store = "memory"``) or in a Redis
    shared by replicas (``store = "redis"``), named by the variable holding its URL
    (`redis_url_env`) or, when the URL holds no password, by the URL itself (`redis_url`).
    The one shape of ``[router.affinity]``, ``[router.health]`` and ``[cache]``."""

    store: Literal["memory", "redis"] = "memory"
    """Where the state is kept: ``memory`` (this process) or ``redis`` (every replica; needs
    `redis_url_env` or `redis_url`)."""
    redis_url_env: EnvironmentVariable | None = None
    """The environment variable holding the Redis URL of ``store = "redis"`` (a URL may hold a
    password, so it is never written in the file)."""
    redis_url: str | None = None
    """The Redis URL itself, when it holds no password (else use `redis_url_env`)."""

    @model_validator(mode="after")
    def _redis_is_named(self) -> Any:
        if self.redis_url is not None:
            from pipeline import _redis

            _redis.check_url(self.redis_url)
            from redis.asyncio.connection import parse_url

            if parse_url(self.redis_url).get("password"):
                raise ValueError(
                    "redis_url holds a password: put the URL in an environment variable "
                    "and name it with redis_url_env"
                )
        if self.store == "redis" and self.redis_url is None and self.redis_url_env is None:
            raise ValueError("store = 'redis' needs redis_url_env (the URL's variable)")
        return self

    def shared_redis_url(self) -> str | None:
        """The Redis URL of ``store = "redis"`` (the variable was checked when the file was
        loaded); None for ``store = "memory"``."""
        if self.store != "redis":
            return None
        return self.redis_url or os.environ[self.redis_url_env or ""]


# -- routes ------------------------------------------------------------------------------------


class BreakerConfig(BreakerSettings):
    """``breaker = {...}``: a route's circuit breaker (`BreakerSettings`). A breaker shared
    between processes names its Redis URL's variable with `redis_url_env` (a URL may hold a
    password, so it is never written in the file)."""

    redis_url_env: EnvironmentVariable | None = None
    """The environment variable holding the Redis URL of a breaker shared by replicas (a URL may
    hold a password, so it is never written in the file); unset: this process only."""

    @model_validator(mode="before")
    @classmethod
    def _no_literal_redis(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "redis" in data:
            raise ValueError(
                "redis: a URL may hold a password; name its environment variable with redis_url_env"
            )
        return data

    def breaker_settings(self, route_name: str) -> BreakerSettings:
        """The layer's settings: named after the route unless named, Redis from the
        environment (checked when the file was loaded)."""
        redis = os.environ.get(self.redis_url_env) if self.redis_url_env else None
        return _settings_of(BreakerSettings, self, name=self.name or route_name, redis=redis)


class _RouteTable(RouteFacts):
    """What every route table holds besides its provider's settings: the facts tier
    selection uses (`RouteFacts`) and the route's own retry and breaker layers."""

    retry: RetrySettings | None = None
    """`retry = {...}`: the route's own retry layer (`RetrySettings`); unset: no retry."""
    breaker: BreakerConfig | None = None
    """`breaker = {...}`: the route's own circuit breaker; unset: no breaker."""

    def route(
        self,
        name: str,
        client: ChatClient,
        *,
        tracer_provider: Any = None,
        meter_provider: Any = None,
    ) -> Route:
        """The route: `client` behind this table's breaker and retry, with its facts. The
        telemetry providers reach the breaker (its state changes) as they reach the pipeline's
        own layers."""
        if self.breaker is not None or self.retry is not None:
            builder = ChatPipeline.builder(
                tracer_provider=tracer_provider, meter_provider=meter_provider
            )
            if self.breaker is not None:
                builder.use_circuit_breaker(self.breaker.breaker_settings(name))
            if self.retry is not None:
                builder.use_retry(self.retry)
            client = builder.build(client, name=name)
        return Route(
            name,
            client,
            max_input_tokens=self.max_input_tokens,
            capabilities=self.capabilities,
            price=self.price,
            instructions=self.instructions,
            weight=self.weight,
            rpm=self.rpm,
            tpm=self.tpm,
        )


class OpenAIRouteConfig(_RouteTable, OpenAISettings):
    """``provider = "openai"``: OpenAI or any Chat Completions server."""


class OpenAIResponsesRouteConfig(_RouteTable, OpenAIResponsesSettings):
    """``provider = "openai_responses"``: OpenAI's Responses API."""


class AzureOpenAIRouteConfig(_RouteTable, AzureOpenAISettings):
    """``provider = "azure_openai"``: an Azure OpenAI deployment."""


class OllamaRouteConfig(_RouteTable, OllamaSettings):
    """``provider = "ollama"``: a local Ollama server."""


class AnthropicRouteConfig(_RouteTable, AnthropicSettings):
    """``provider = "anthropic"``: the Anthropic Messages API."""


class BedrockRouteConfig(_RouteTable, BedrockSettings):
    """``provider = "bedrock"``: Amazon Bedrock's Converse API."""


class VendorRouteConfig(_RouteTable, VendorSettings):
    """``provider = "groq"`` (or another vendor): an OpenAI-compatible vendor by name."""


class GeminiRouteConfig(_RouteTable, GeminiSettings):
    """``provider = "gemini"``: Google's Gemini API."""


class VertexRouteConfig(_RouteTable, VertexSettings):
    """``provider = "vertex"``: a Gemini or an Anthropic model on Vertex AI."""


class ScriptedRouteConfig(_RouteTable, ScriptedSettings):
    """``provider = "scripted"``: an in-process simulated model."""


RouteConfig: TypeAlias = Annotated[
    OpenAIRouteConfig
    | OpenAIResponsesRouteConfig
    | AzureOpenAIRouteConfig
    | OllamaRouteConfig
    | AnthropicRouteConfig
    | BedrockRouteConfig
    | VendorRouteConfig
    | GeminiRouteConfig
    | VertexRouteConfig
    | ScriptedRouteConfig,
    Field(discriminator="provider"),
]
"""A ``[routes.NAME]`` table: the class its `provider` names."""

# -- routers -----------------------------------------------------------------------------------


class AffinityConfig(AffinitySettings, _StoreTable):
    """``[router.affinity]``: sessions keep their route (memory, or Redis for replicas)."""

    def session_affinity(self) -> SessionAffinity:
        """The `SessionAffinity` this table describes."""
        url = self.shared_redis_url()
        if url is not None:
            return SessionAffinity(
                RedisAffinityStore(
                    url, self.ttl, timeout=self.timeout, retry_interval=self.retry_interval
                )
            )
        return SessionAffinity(MemoryAffinityStore(self.max_sessions, self.ttl))


_Reference = Literal["names", "keys", "values", "keys_and_values"]
_Routes = Mapping[str, Route]


class _RouterTable(Settings):
    """What every router table does: name the routes it refers to, and install itself.

    `route_references` maps each key whose value names routes to how: ``names`` (a name
    or a list of names), ``keys``, ``values`` or ``keys_and_values`` of a table.
    """

    route_references: ClassVar[Mapping[str, _Reference]] = {}

    @abc.abstractmethod
    def install(
        self, builder: ChatPipelineBuilder, routes: _Routes, secrets: Mapping[str, str | None]
    ) -> None:
        """End `builder`'s chain with this router over `routes`."""


class _FailoverRouterTable(FailoverSettings, _RouterTable):
    """A failover router: its limits (`FailoverSettings`) and session affinity."""

    affinity: AffinityConfig | None = None
    """`[router.affinity]`: requests with a session id start on the route that last served the
    session."""

    def failover_settings(self) -> FailoverSettings:
        return _settings_of(FailoverSettings, self)

    def session_affinity(self) -> SessionAffinity | None:
        return self.affinity.session_affinity() if self.affinity is not None else None


class OrderedRouterConfig(_FailoverRouterTable):
    """``kind = "ordered"``: the routes of `order`, each tried in turn before output."""

    route_references: ClassVar[Mapping[str, _Reference]] = {"order": "names"}

    kind: Literal["ordered"] = "ordered"
    """`ordered`: the routes of `order`, each tried in turn until one answers before output
    (`OrderedFailoverChatClient`)."""
    order: Annotated[list[Name], Field(min_length=1)]
    """The route (or group) names, in the order they are tried."""

    def install(
        self, builder: ChatPipelineBuilder, routes: _Routes, secrets: Mapping[str, str | None]
    ) -> None:
        builder.use_ordered_failover(
            [routes[name] for name in self.order],
            self.failover_settings(),
            affinity=self.session_affinity(),
        )


class HealthConfig(HealthSettings, _StoreTable):
    """``[router.health]``: how a balanced router reads route health, kept in this process
    (``store = "memory"``) or shared by replicas through Redis (``store = "redis"``, synced in
    the background; `sync_interval` and `timeout` in seconds)."""

    sync_interval: Annotated[float, Field(gt=0)] = 0.5
    """Seconds between two syncs of this replica's route health with Redis, at most, while it has
    traffic."""
    timeout: Annotated[float, Field(gt=0)] = 0.25
    """Seconds each Redis call of a sync may take."""

    def route_health(self, meter_provider: Any = None) -> RouteHealth:
        """A `RouteHealth` as this table describes (one per built router), its metrics on
        `meter_provider` (the pipeline's; ``None``: the global one)."""
        from middleware.routing import RedisHealthStore

        url = self.shared_redis_url()
        store = None
        if url is not None:
            store = RedisHealthStore(url, sync_interval=self.sync_interval, timeout=self.timeout)
        return RouteHealth(
            _settings_of(HealthSettings, self), store=store, meter_provider=meter_provider
        )


class _BalancedTable(BalancedSettings, _RouterTable):
    """A router spreading requests over `routes` (default: every route) by route health:
    `[router.health]` and `[router.affinity]` as their tables say."""

    route_references: ClassVar[Mapping[str, _Reference]] = {"routes": "names"}

    routes: Annotated[list[Name], Field(min_length=1)] | None = None
    """The route (or group) names to balance over (unset: every route)."""
    affinity: AffinityConfig | None = None
    """`[router.affinity]`: a session starts on its route while that route is healthy."""
    health: HealthConfig | None = None
    """`[router.health]`: how route health is read and where it is kept (unset: in this process, at
    the defaults)."""

    def install(
        self, builder: ChatPipelineBuilder, routes: _Routes, secrets: Mapping[str, str | None]
    ) -> None:
        chosen = [routes[name] for name in self.routes] if self.routes else list(routes.values())
        health = self.health
        self._end_chain(
            builder,
            chosen,
            affinity=self.affinity.session_affinity() if self.affinity is not None else None,
            health=(health.route_health(builder.meter_provider) if health is not None else None),
        )

    @abc.abstractmethod
    def _end_chain(
        self, builder: ChatPipelineBuilder, routes: list[Route], **keywords: Any
    ) -> None:
        """End `builder`'s chain with this router over `routes` (`keywords`: its health
        and affinity)."""


class BalancedRouterConfig(_BalancedTable):
    """``kind = "balanced"``: each attempt on a healthy route of `routes` (default: every
    route) chosen by `strategy` (`BalancedFailoverChatClient`); `[router.health]` and
    `[router.affinity]` as their tables say."""

    kind: Literal["balanced"] = "balanced"
    """`balanced`: each attempt on a healthy route chosen by `strategy`
    (`BalancedFailoverChatClient`)."""

    def _end_chain(
        self, builder: ChatPipelineBuilder, routes: list[Route], **keywords: Any
    ) -> None:
        builder.use_balanced_failover(routes, _settings_of(BalancedSettings, self), **keywords)


class HedgedRouterConfig(HedgingSettings, _BalancedTable):
    """``kind = "hedged"``: a balanced router over `routes` (default: every route) that
    also starts the next route when an attempt has no first update after `delay`
    (`HedgingChatClient`, `HedgingSettings`); `[router.health]` and `[router.affinity]` as
    for ``kind = "balanced"``."""

    kind: Literal["hedged"] = "hedged"
    """`hedged`: a balanced router that also starts the next route beside an attempt slow to answer,
    and keeps whichever answers first (`HedgingChatClient`)."""

    def _end_chain(
        self, builder: ChatPipelineBuilder, routes: list[Route], **keywords: Any
    ) -> None:
        builder.use_hedging(routes, _settings_of(HedgingSettings, self), **keywords)


class GroupConfig(BalancedSettings):
    """``[groups.NAME]``: routes that serve as one (``kind = "balanced"``: each attempt on a
    healthy member by `strategy`, as `BalancedFailoverChatClient`), which a router names
    like a route (a tier may be a group). Its context window is its members' smallest and
    its capabilities those every member has, unless the table says."""

    kind: Literal["balanced"] = "balanced"
    """`balanced`: each attempt on a healthy member chosen by `strategy`."""
    routes: Annotated[list[Name], Field(min_length=1)]
    """The member routes' names (they then serve only through the group)."""
    health: HealthConfig | None = None
    """`[groups.<name>.health]`: how the group reads its members' health (unset: in this process, at
    the defaults)."""
    max_input_tokens: Annotated[int, Field(ge=1)] | None = None
    """The group's context window (unset: its members' smallest)."""
    capabilities: Annotated[frozenset[Name], Field(strict=False)] | None = None
    """The group's capabilities (unset: those every member has)."""

    def route(self, name: str, members: Sequence[Route], providers: Mapping[str, Any]) -> Route:
        """The group as one route over `members` (built routes, each with its layers)."""
        windows = [m.max_input_tokens for m in members]
        window = self.max_input_tokens
        if window is None and all(w is not None for w in windows):
            window = min(w for w in windows if w is not None)
        capabilities = self.capabilities
        if capabilities is None:
            capabilities = frozenset.intersection(*(m.capabilities for m in members))
        client = (
            ChatPipeline.builder(**providers)
            .use_balanced_failover(
                list(members),
                _settings_of(BalancedSettings, self),
                health=(
                    self.health.route_health(providers.get("meter_provider"))
                    if self.health is not None
                    else None
                ),
            )
            .build(name=name)
        )
        return Route(name, client, max_input_tokens=window, capabilities=capabilities)


class TieredRouterConfig(_FailoverRouterTable):
    """``kind = "tiered"``: start on `default` (or the route of the request's kind, a pin,
    the session's route) and escalate along `fallback` (`TieredRoutingChatClient`)."""

    route_references: ClassVar[Mapping[str, _Reference]] = {
        "default": "names",
        "fallback": "keys_and_values",
        "kinds": "values",
    }

    kind: Literal["tiered"] = "tiered"
    """`tiered`: start on a tier and escalate along `fallback`, skipping routes whose context window
    or capabilities do not fit the request (`TieredRoutingChatClient`)."""
    default: Name
    """The route a request starts on when nothing else chooses one."""
    fallback: dict[str, list[Name]] = Field(default_factory=dict)
    """For each route, the routes to escalate to, in order (`{ small = ["standard"] }`)."""
    kinds: dict[str, Name] = Field(default_factory=dict)
    """For each request kind (`additional_properties["chat_pipeline.kind"]`), the route it starts
    on."""
    sticky_sessions: bool = True
    """Whether a request with a session id starts on the route that last served the session (a
    memory store unless `[router.affinity]` says otherwise)."""

    def install(
        self, builder: ChatPipelineBuilder, routes: _Routes, secrets: Mapping[str, str | None]
    ) -> None:
        from middleware.routing.tiered import TieredRoutingChatClient

        def tiered() -> TieredRoutingChatClient:
            return TieredRoutingChatClient(
                list(routes.values()),
                default=self.default,
                fallback=self.fallback,
                kinds=self.kinds,
                sticky_sessions=self.sticky_sessions,
                affinity=self.session_affinity(),
                settings=self.failover_settings(),
            )

        tiered()  # any refusal surfaces now, as a configuration error
        builder.use_failover(tiered)


EmbeddingsConfig: TypeAlias = Annotated[
    HashingEmbeddingsSettings | LocalEmbeddingsSettings | OpenAIEmbeddingsSettings,
    Field(discriminator="provider"),
]
"""``embeddings = {...}`` of a semantic router: the class its `provider` names."""


class SemanticProfileConfig(Settings):
    """``profiles.<route> = { utterances = [...], threshold = 0.5 }``: a route's utterances
    with its own threshold (a plain list of utterances takes the router's)."""

    utterances: Annotated[list[Name], Field(min_length=1)]
    """The route's example utterances."""
    threshold: Annotated[float, Field(ge=-65_536, le=65_536)] | None = None
    """The score this route needs (instead of the router's `threshold`)."""


class SemanticRouterConfig(SemanticSettings, _RouterTable):
    """``kind = "semantic"``: the route whose `profiles` utterances best match the query,
    else `default` (`SemanticRoutingChatClient`; numpy is loaded when it is built)."""

    route_references: ClassVar[Mapping[str, _Reference]] = {
        "default": "names",
        "profiles": "keys",
    }

    kind: Literal["semantic"] = "semantic"
    """`semantic`: the route whose profile utterances best match the request's last user message,
    else `default` (`SemanticRoutingChatClient`; numpy is loaded when it is built)."""
    default: Name
    """The route chosen when no route scores `threshold` or more, or the embedding fails."""
    profiles: Annotated[
        dict[str, Annotated[list[Name], Field(min_length=1)] | SemanticProfileConfig],
        Field(min_length=1),
    ]
    """For each route, the utterances that describe what it serves (a list, or a table with
    `utterances` and the route's own `threshold`)."""
    embeddings: EmbeddingsConfig
    """`router.embeddings`: how utterances and queries are embedded (`provider = "hashing"` or
    `"openai"`)."""

    @property
    def affinity(self) -> AffinityConfig | None:
        """None: a semantic router chooses by content, never by session."""
        return None

    def install(
        self, builder: ChatPipelineBuilder, routes: _Routes, secrets: Mapping[str, str | None]
    ) -> None:
        from middleware.routing.semantic import RouteProfile

        builder.use_semantic_routing(
            self.embeddings.generator(secrets.get("router.embeddings")),
            {
                routes[name]: (
                    RouteProfile(profile.utterances, threshold=profile.threshold)
                    if isinstance(profile, SemanticProfileConfig)
                    else profile
                )
                for name, profile in self.profiles.items()
            },
            routes[self.default],
            settings=_settings_of(SemanticSettings, self),
        )


RouterConfig: TypeAlias = Annotated[
    OrderedRouterConfig
    | BalancedRouterConfig
    | HedgedRouterConfig
    | TieredRouterConfig
    | SemanticRouterConfig,
    Field(discriminator="kind"),
]
"""The ``[router]`` table: the class its `kind` names."""


class LayersConfig(Settings):
    """``[layers]``: the layers around the router (tools are code: see `build`)."""

    telemetry: bool = False
    """The telemetry layer (`use_telemetry`): a `chat {model}` span and the GenAI metrics per
    request."""
    logging: bool = False
    """The logging layer (`use_logging`): a log line per request, without content."""
    function_invocation: bool = False
    """The tool loop (`use_function_invocation`), over the tools given in code (`from_config(path,
    tools=[...])`); the gateway refuses a file that turns it on."""


# -- the response cache ----------------------------------------------------------------------


class SemanticCacheConfig(Settings):
    """``[cache.semantic]``: semantic lookups after an exact miss (`SemanticCacheSettings`;
    numpy is loaded when the pipeline is built)."""

    embeddings: EmbeddingsConfig
    """The embedding generator, as a semantic router's ``embeddings`` table."""
    threshold: Annotated[float, Field(gt=0, le=1)] = SemanticCacheSettings.model_fields[
        "threshold"
    ].default
    """The cosine similarity at or above which a stored answer is a hit."""
    max_candidates: Annotated[int, Field(ge=1)] = 1000
    """Answers per semantic partition kept as candidates."""
    max_partitions: Annotated[int, Field(ge=1)] = 10_000
    """Semantic partitions kept per process."""
    max_bytes: Annotated[int, Field(ge=1)] = 64 << 20
    """Bytes the candidates (vectors and keys) may hold per process; with ``store =
    "memory"`` they count in the store's `max_bytes` too."""
    embedding_timeout: Annotated[float, Field(gt=0)] = 2.0
    """Seconds embedding a query may take before the lookup is a miss."""
    max_query_chars: Annotated[int, Field(ge=1)] = 2000
    """Longer queries are looked up exactly only."""

    def settings(self, secret: str | None) -> SemanticCacheSettings:
        return SemanticCacheSettings(
            embeddings=self.embeddings.generator(secret),
            threshold=self.threshold,
            max_candidates=self.max_candidates,
            max_partitions=self.max_partitions,
            max_bytes=self.max_bytes,
            embedding_timeout=self.embedding_timeout,
            max_query_chars=self.max_query_chars,
        )


class CacheConfig(CacheSettings, _StoreTable):
    """``[cache]``: the response cache, between the tool loop and the router (each model
    turn is looked up once; tools still run). Answers are kept in this process (``store =
    "memory"``) or in Redis, shared by replicas (``store = "redis"``)."""

    enabled: bool = True
    """Whether the cache layer is built (an environment may turn it off)."""
    max_bytes: Annotated[int, Field(ge=1)] = 64 << 20
    """The memory store's bound: bytes of keys and answers kept (least recently used out)."""
    namespace: Annotated[str, Field(min_length=1)] = "chat_pipeline:cache"
    """The prefix of the Redis store's keys."""
    semantic: SemanticCacheConfig | None = None
    """``[cache.semantic]``: lookups by meaning after an exact miss."""

    def install(self, builder: ChatPipelineBuilder, secrets: Mapping[str, str | None]) -> None:
        """Add the cache layer this table describes to `builder`."""
        from middleware.cache import MemoryCacheStore, RedisCacheStore

        store: Any
        url = self.shared_redis_url()
        if url is not None:
            store = RedisCacheStore(
                url,
                namespace=self.namespace,
                timeout=self.timeout,
                retry_interval=self.retry_interval,
            )
        else:
            store = None
        semantic = (
            self.semantic.settings(secrets.get("cache.semantic.embeddings"))
            if self.semantic is not None
            else None
        )
        max_bytes = self.max_bytes

        def layer(inner: ChatClient) -> ChatClient:
            from middleware.cache import CachingChatClient

            return CachingChatClient(
                inner,
                store if store is not None else MemoryCacheStore(max_bytes),
                _settings_of(CacheSettings, self),
                semantic=semantic,
                meter_provider=builder.meter_provider,
                close_store=True,
            )

        builder.use(layer)


# -- the spend ledger ------------------------------------------------------------------------


class SpendConfig(LedgerSettings):
    """``[spend]``: the spend ledger, one record per provider attempt (`pipeline.spend`), kept
    in a SQLite file (``store = "sqlite"``, the default: no server) or in PostgreSQL (``store =
    "postgres"``, shared by replicas; the URL comes from the variable `dsn_env` names)."""

    enabled: bool = True
    """Whether spend is recorded (an environment may turn it off)."""
    store: Literal["sqlite", "postgres"] = "sqlite"
    """Where records are kept: ``sqlite`` (the file `path`) or ``postgres`` (the database `dsn_env`
    names)."""
    path: Annotated[str, Field(min_length=1)] = "chat-pipeline-spend.db"
    """The SQLite file (relative paths are taken from the working directory)."""
    dsn_env: EnvironmentVariable | None = None
    """The environment variable holding the PostgreSQL URL (``postgresql://user:password@host/db``)
    for ``store = "postgres"``: a URL may hold a password, so it is never written in the file."""
    auto_upgrade: bool | None = None
    """Whether the ledger applies missing migrations itself when it first connects (unset: yes for
    SQLite, no for PostgreSQL, whose schema `chat-pipeline db upgrade` applies)."""

    @model_validator(mode="after")
    def _postgres_is_named(self) -> Any:
        if self.store == "postgres" and self.dsn_env is None:
            raise ValueError("store = 'postgres' needs dsn_env (the URL's variable)")
        return self

    def database_url(self) -> str:
        """The database's URL (read from the environment for PostgreSQL)."""
        if self.store == "postgres":
            return os.environ[self.dsn_env or ""]
        return self.path

    def ledger(self, *, meter_provider: Any = None) -> SpendLedger:
        """A `SpendLedger` writing to the store this table names (nothing is connected yet)."""
        from pipeline.spend import PostgresSpendStore, SpendLedger, SQLiteSpendStore

        store: PostgresSpendStore | SQLiteSpendStore
        if self.store == "postgres":
            store = PostgresSpendStore(
                self.database_url(), timeout=self.timeout, auto_upgrade=bool(self.auto_upgrade)
            )
        else:
            store = SQLiteSpendStore(
                self.path,
                timeout=self.timeout,
                auto_upgrade=self.auto_upgrade is None or self.auto_upgrade,
            )
        return SpendLedger(store, _settings_of(LedgerSettings, self), meter_provider=meter_provider)


# -- overlays ----------------------------------------------------------------------------------


def merge(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """`overlay` over `base`: tables merge key by key, anything else is replaced."""
    merged = dict(base)
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _overlay(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """An environment over the base; a route whose provider it changes is replaced whole
    (the other provider's settings would not apply to it)."""
    merged = merge(base, overlay)
    base_routes = base.get("routes")
    overlay_routes = overlay.get("routes")
    if isinstance(base_routes, Mapping) and isinstance(overlay_routes, Mapping):
        for name, route in overlay_routes.items():
            previous = base_routes.get(name)
            if (
                isinstance(route, Mapping)
                and isinstance(previous, Mapping)
                and route.get("provider", previous.get("provider")) != previous.get("provider")
            ):
                merged["routes"][name] = dict(route)
    return merged


# -- validation --------------------------------------------------------------------------------

_T = TypeVar("_T")


class _Schema(Generic[_T]):
    """A table's type and its validator, built once."""

    def __init__(self, annotation: Any) -> None:
        self.annotation = annotation
        self.adapter: pydantic.TypeAdapter[_T] = pydantic.TypeAdapter(annotation)


_ROUTE: _Schema[RouteConfig] = _Schema(RouteConfig)
_GROUP: _Schema[GroupConfig] = _Schema(GroupConfig)
_ROUTER: _Schema[RouterConfig] = _Schema(RouterConfig)
_LAYERS: _Schema[LayersConfig] = _Schema(LayersConfig)
_CACHE: _Schema[CacheConfig] = _Schema(CacheConfig)
_SPEND: _Schema[SpendConfig] = _Schema(SpendConfig)
_KEYS: _Schema[KeysSettings] = _Schema(KeysSettings)
_BUDGETS: _Schema[BudgetsSettings] = _Schema(BudgetsSettings)
_ROUTER_KINDS: dict[str, type[_RouterTable]] = {
    kind: table
    for table in get_args(get_args(RouterConfig)[0])
    for kind in get_args(table.model_fields["kind"].annotation)
}


class _Problems:
    """Every problem found, each with its key path; raised together at the end."""

    def __init__(self) -> None:
        self.found: list[tuple[str, str]] = []

    def add(self, path: str, message: str) -> None:
        self.found.append((path, message))

    def validate(self, schema: _Schema[_T], data: Any, path: str) -> _T | None:
        """`data` validated, or `None` with its problems recorded."""
        if not isinstance(data, Mapping):
            self.add(path, f"expected a table, got {type(data).__name__}")
            return None
        try:
            with collecting_problems():
                return schema.adapter.validate_python(dict(data))
        except pydantic.ValidationError as exc:
            for where, message, _ in problems_of(exc, schema.annotation, _split(path)):
                self.add(where, message)
            return None

    def raise_if_any(self) -> None:
        if self.found:
            raise ConfigError.from_problems(self.found)


def _split(path: str) -> list[str]:
    return path.split(".") if path else []


def _names(
    problems: _Problems, path: str, names: str | Sequence[str], routes: Mapping[str, Any]
) -> None:
    """Each name must be a defined route; a single name is reported without an index."""
    items = (
        [(path, names)]
        if isinstance(names, str)
        else [(f"{path}[{index}]", name) for index, name in enumerate(names)]
    )
    for where, name in items:
        if name in routes:
            continue
        group = getattr(routes, "group_of", {}).get(name)
        if group is not None:
            problems.add(where, f"{name!r} serves in group {group!r}: name the group")
        else:
            problems.add(where, f"names no route: {name!r}{suggest(name, routes)}")


_SECTIONS = (
    "routes",
    "groups",
    "router",
    "layers",
    "cache",
    "gateway",
    "spend",
    "keys",
    "budgets",
    "environments",
)


@dataclass(frozen=True)
class PipelineConfig:
    """A validated configuration: its routes, its router and layers, ready to build.

    `build()` makes the pipeline; `build_route(name)` makes one route alone (its client with
    its own retry and breaker), for evaluation or direct calls. Secrets were read from the
    environment when the file was loaded.
    """

    routes: Mapping[str, RouteConfig]
    router: RouterConfig | None
    layers: LayersConfig
    environment: str | None
    _secrets: Mapping[str, str | None] = field(repr=False, default_factory=dict)
    gateway: GatewaySettings | None = None
    """The ``[gateway]`` table (`pipeline.gateway.settings.GatewaySettings`), if any."""
    groups: Mapping[str, GroupConfig] = field(default_factory=dict)
    """The ``[groups.NAME]`` tables: routes a router names as one."""
    cache: CacheConfig | None = None
    """The ``[cache]`` table, if any."""
    spend: SpendConfig | None = None
    """The ``[spend]`` table, if any."""
    keys: KeysSettings | None = None
    """The ``[keys]`` table (virtual keys, `pipeline.keys`), if any."""
    budgets: BudgetsSettings | None = None
    """The ``[budgets]`` table (budgets and rate limits shared by replicas), if any."""

    @property
    def route_names(self) -> list[str]:
        return list(self.routes)

    def build(
        self,
        *,
        tools: Sequence[Any] = (),
        tracer_provider: Any = None,
        meter_provider: Any = None,
        spend_ledger: SpendLedger | None = None,
    ) -> ChatPipeline:
        """The pipeline the file describes. Tools are code: pass them when the file turns
        ``layers.function_invocation`` on. With a ``[spend]`` table, its spend layer records
        in `spend_ledger` (yours to close), or in a ledger of the pipeline's own, closed
        with it."""
        problems = _Problems()
        layers = self.layers
        if layers.function_invocation and not tools:
            problems.add("layers.function_invocation", "is on, but no tools were given")
        providers = {"tracer_provider": tracer_provider, "meter_provider": meter_provider}
        built = {name: self._route(name, problems, providers) for name in self.routes}
        problems.raise_if_any()
        routes = {name: route for name, route in built.items() if route is not None}
        for name, group in self.groups.items():
            # A group's members serve only through it: the router sees the group.
            members = [routes.pop(member) for member in group.routes]
            try:
                routes[name] = group.route(name, members, providers)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"groups.{name}", str(exc)) from exc
        builder = ChatPipeline.builder(**providers)
        builder.use_telemetry(enabled=layers.telemetry)
        builder.use_logging(enabled=layers.logging)
        router = self.router
        # Without a router the one route is the call: the spend layer prices it at its price.
        only = next(iter(routes.values()))
        self.install_spend(builder, spend_ledger, price=only.price if router is None else None)
        builder.use_function_invocation(list(tools), enabled=layers.function_invocation)
        self.install_cache(builder)
        if router is None:
            return builder.build(only.client, name=only.name)
        try:
            router.install(builder, routes, self._secrets)
        except (TypeError, ValueError) as exc:
            raise ConfigError("router", str(exc)) from exc
        return builder.build()

    def install_spend(
        self,
        builder: ChatPipelineBuilder,
        ledger: SpendLedger | None = None,
        *,
        price: Price | None = None,
    ) -> None:
        """Add the ``[spend]`` layer to `builder`, when the file has one and it is enabled:
        recording in `ledger`, or in a ledger made here that the layer closes; `price` is
        the route's, when the layer is over one route with no router (it wins over the
        book)."""
        spend = self.spend
        if spend is None or not spend.enabled:
            return
        owned = ledger is None
        used = ledger if ledger is not None else spend.ledger(meter_provider=builder.meter_provider)

        def layer(inner: ChatClient) -> ChatClient:
            from middleware.spend import SpendChatClient

            return SpendChatClient(inner, used, close_ledger=owned, price=price)

        builder.use(layer)

    def install_cache(self, builder: ChatPipelineBuilder) -> None:
        """Add the ``[cache]`` layer to `builder`, when the file has one and it is enabled."""
        if self.cache is not None and self.cache.enabled:
            self.cache.install(builder, self._secrets)

    def build_route(
        self, name: str, *, tracer_provider: Any = None, meter_provider: Any = None
    ) -> Route:
        """One route (a `middleware.routing.Route`) with its own layers."""
        if name not in self.routes:
            raise ConfigError(f"routes.{name}", f"is not defined{suggest(name, self.routes)}")
        problems = _Problems()
        providers = {"tracer_provider": tracer_provider, "meter_provider": meter_provider}
        route = self._route(name, problems, providers)
        problems.raise_if_any()
        assert route is not None  # a route that could not be built is a problem, raised
        return route

    def _route(self, name: str, problems: _Problems, providers: dict[str, Any]) -> Route | None:
        table = self.routes[name]
        try:
            client = table.client(name, self._secrets.get(name))
            return table.route(name, client, **providers)
        except (TypeError, ValueError) as exc:
            problems.add(f"routes.{name}", f"rejected: {exc}")
            return None


def _variable_set(problems: _Problems, path: str, variable: str | None) -> None:
    """A ``redis_url_env`` named in the file must be set, to a Redis URL (never echoed: it
    may hold a password)."""
    if not variable:
        return
    where = f"{path}.redis_url_env"
    url = os.environ.get(variable)
    if not url:
        problems.add(where, f"the environment variable {variable} is not set")
        return
    from pipeline import _redis

    try:
        _redis.check_url(url)
    except ValueError as exc:
        problems.add(where, f"the environment variable {variable} {exc}")


def _secret(problems: _Problems, settings: Credentials, path: str) -> str | None:
    """The API key `settings` names (or its provider's default variable holds): a
    variable named in the file, or the key of a vendor's own endpoint, must be set."""
    variable = settings.key_variable()
    if variable is None:
        return None
    value = os.environ.get(variable)
    named = isinstance(settings, KeyedEndpoint) and settings.api_key_env is not None
    if not value and (settings.requires_key() or named):
        problems.add(f"{path}.api_key_env", f"the environment variable {variable} is not set")
    return value or None


def parse_config(data: Mapping[str, Any], environment: str | None = None) -> PipelineConfig:
    """Validate already-parsed configuration (see the module docstring)."""
    problems = _Problems()
    if not isinstance(data, Mapping):
        raise ConfigError("", f"expected a table, got {type(data).__name__}")
    environment = environment or os.environ.get(ENVIRONMENT_VARIABLE) or None
    environments = data.get("environments", {})
    if not isinstance(environments, Mapping):
        raise ConfigError("environments", f"expected a table, got {type(environments).__name__}")
    base = {key: value for key, value in data.items() if key != "environments"}
    if environment is not None:
        if environment not in environments:
            known = sorted(environments)
            raise ConfigError(
                f"environments.{environment}", f"is not defined (defined: {known or 'none'})"
            )
        overlay = environments[environment]
        if not isinstance(overlay, Mapping):
            raise ConfigError(f"environments.{environment}", "expected a table")
        if "environments" in overlay:
            raise ConfigError(
                f"environments.{environment}.environments", "environments cannot be nested"
            )
        base = _overlay(base, overlay)
    for key in base:
        if key not in _SECTIONS[:-1]:
            problems.add(
                str(key),
                f"unknown setting{suggest(str(key), _SECTIONS)}",
            )
    raw_routes = base.get("routes")
    routes: dict[str, RouteConfig] = {}
    secrets: dict[str, str | None] = {}
    if raw_routes is None:
        problems.add("routes", "is required (a table of routes)")
    elif not isinstance(raw_routes, Mapping):
        problems.add("routes", f"expected a table, got {type(raw_routes).__name__}")
    elif not raw_routes:
        problems.add("routes", "expected at least one route")
    else:
        for name, table in raw_routes.items():
            path = f"routes.{name}"
            if not str(name).strip():
                problems.add(path, "a route needs a non-empty name")
                continue
            if isinstance(table, Mapping) and "api_key" in table:
                problems.add(
                    f"{path}.api_key",
                    "secrets come only from environment variables: name one with api_key_env",
                )
                table = {k: v for k, v in table.items() if k != "api_key"}
            validated = problems.validate(_ROUTE, table, path)
            if validated is None:
                continue
            routes[str(name)] = validated
            secrets[str(name)] = _secret(problems, validated, path)
            if validated.breaker is not None:
                _variable_set(problems, f"{path}.breaker", validated.breaker.redis_url_env)
    groups, members = _groups(problems, base.get("groups"), raw_routes)
    layers = problems.validate(_LAYERS, base.get("layers", {}), "layers")
    raw_router = base.get("router")
    router: RouterConfig | None = None
    if raw_router is None:
        grouped = sum(map(len, members.values()))
        if isinstance(raw_routes, Mapping) and len(raw_routes) - grouped + len(members) > 1:
            problems.add("router", "is required when there is more than one route")
    elif not isinstance(raw_router, Mapping):
        problems.add("router", f"expected a table, got {type(raw_router).__name__}")
    else:
        if isinstance(raw_routes, Mapping):
            _check_router_names(problems, raw_router, _served(raw_routes, members))
        router = problems.validate(_ROUTER, raw_router, "router")
        if router is not None and router.affinity is not None:
            _variable_set(problems, "router.affinity", router.affinity.redis_url_env)
        if isinstance(router, _BalancedTable) and router.health is not None:
            _variable_set(problems, "router.health", router.health.redis_url_env)
        if isinstance(router, SemanticRouterConfig):
            secrets["router.embeddings"] = _secret(problems, router.embeddings, "router.embeddings")
    gateway = None
    if "gateway" in base:
        from pipeline.gateway.settings import GatewaySettings

        schema: _Schema[GatewaySettings] = _Schema(GatewaySettings)
        gateway = problems.validate(schema, base["gateway"], "gateway")
        names = [str(n) for n in raw_routes] if isinstance(raw_routes, Mapping) else []
        for where, message in gateway.problems(names) if gateway is not None else ():
            problems.add(where, message)
    cache = None
    if "cache" in base:
        cache = problems.validate(_CACHE, base["cache"], "cache")
        if cache is not None and cache.store == "redis" and cache.redis_url is None:
            _variable_set(problems, "cache", cache.redis_url_env)
        if cache is not None and cache.semantic is not None:
            secrets["cache.semantic.embeddings"] = _secret(
                problems, cache.semantic.embeddings, "cache.semantic.embeddings"
            )
    spend = None
    if "spend" in base:
        spend = problems.validate(_SPEND, base["spend"], "spend")
        variable = spend.dsn_env if spend is not None and spend.store == "postgres" else None
        if variable and not os.environ.get(variable):
            problems.add("spend.dsn_env", f"the environment variable {variable} is not set")
    keys = budgets = None
    if "keys" in base:
        keys = problems.validate(_KEYS, base["keys"], "keys")
        if keys is not None and spend is None:
            problems.add("keys", "virtual keys live in the spend database: add a [spend] table")
    if "budgets" in base:
        budgets = problems.validate(_BUDGETS, base["budgets"], "budgets")
        if budgets is not None:
            _variable_set(problems, "budgets", budgets.redis_url_env)
    problems.raise_if_any()
    assert layers is not None  # no problem was found, so every table validated
    return PipelineConfig(
        routes,
        router,
        layers,
        environment,
        secrets,
        gateway,
        groups,
        cache,
        spend,
        keys=keys,
        budgets=budgets,
    )


def _groups(
    problems: _Problems, raw: Any, raw_routes: Any
) -> tuple[dict[str, GroupConfig], dict[str, list[str]]]:
    """The ``[groups]`` tables, validated: each names routes (at least one, none in two
    groups), and no group is named like a route. Also the members each group's table
    names, read from the raw table (so a router naming a group whose other settings are
    wrong, or a member, is told the right thing)."""
    groups: dict[str, GroupConfig] = {}
    members: dict[str, list[str]] = {}
    if raw is None:
        return groups, members
    if not isinstance(raw, Mapping):
        problems.add("groups", f"expected a table, got {type(raw).__name__}")
        return groups, members
    names = raw_routes if isinstance(raw_routes, Mapping) else {}
    owner: dict[str, str] = {}
    for name, table in raw.items():
        path = f"groups.{name}"
        if name in names:
            problems.add(path, f"a route is named {name!r} too: a group needs a name of its own")
            continue
        listed = table.get("routes") if isinstance(table, Mapping) else None
        members[str(name)] = []
        if isinstance(listed, list) and all(isinstance(member, str) for member in listed):
            for index, member in enumerate(listed):
                where = f"{path}.routes[{index}]"
                if member not in names:
                    problems.add(where, f"names no route: {member!r}{suggest(member, names)}")
                elif member in owner:
                    problems.add(where, f"{member!r} is in group {owner[member]!r} already")
                else:
                    owner[member] = str(name)
                    members[str(name)].append(member)
        group = problems.validate(_GROUP, table, path)
        if group is None:
            continue
        if group.health is not None:
            _variable_set(problems, f"{path}.health", group.health.redis_url_env)
        groups[str(name)] = group
    return groups, members


class _Served(dict[str, Any]):
    """What a router may name: the groups, and the routes in no group (`group_of`: the
    group each other route serves in, for the message)."""

    group_of: dict[str, str]


def _served(raw_routes: Mapping[str, Any], members: Mapping[str, list[str]]) -> _Served:
    group_of = {member: name for name, listed in members.items() for member in listed}
    served = _Served((name, table) for name, table in raw_routes.items() if name not in group_of)
    served.update(dict.fromkeys(members))
    served.group_of = group_of
    return served


def _check_router_names(
    problems: _Problems, router: Mapping[str, Any], routes: Mapping[str, Any]
) -> None:
    """Route names the router refers to must be routes (checked on the raw table, so they
    are reported even when other router settings are wrong; wrong types are reported by
    the validation). An unknown kind's table is checked for every kind's references."""

    def names(path: str, value: Any) -> None:
        if isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        ):
            _names(problems, path, value, routes)

    kind = router.get("kind")
    tables = (
        [_ROUTER_KINDS[kind]]
        if isinstance(kind, str) and kind in _ROUTER_KINDS
        else list(_ROUTER_KINDS.values())
    )
    references = {key: how for table in tables for key, how in table.route_references.items()}
    for key, how in references.items():
        if key not in router:
            continue
        value = router[key]
        if how == "names":
            names(f"router.{key}", value)
            continue
        if not isinstance(value, Mapping):
            continue
        for item, names_in in value.items():
            if how in ("keys", "keys_and_values"):
                names(f"router.{key}.{item}", str(item))
            if how in ("values", "keys_and_values"):
                names(f"router.{key}.{item}", names_in)


def load_config(path: str | os.PathLike[str], environment: str | None = None) -> PipelineConfig:
    """Read and validate a TOML file (see the module docstring)."""
    file = Path(path)
    try:
        text = file.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError("", f"cannot read {file}: {exc.strerror or type(exc).__name__}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"{file} is not UTF-8 text (byte {exc.start})") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"{file} is not valid TOML: {exc}") from exc
    return parse_config(data, environment)


def build_pipeline(
    data: Mapping[str, Any],
    environment: str | None = None,
    *,
    tools: Sequence[Any] = (),
) -> ChatPipeline:
    """Build a pipeline from already-parsed configuration (see the module docstring)."""
    return parse_config(data, environment).build(tools=tools)


def load_pipeline(
    path: str | os.PathLike[str],
    environment: str | None = None,
    *,
    tools: Sequence[Any] = (),
) -> ChatPipeline:
    """Read a TOML file and build its pipeline (`ChatPipeline.from_config`)."""
    return load_config(path, environment).build(tools=tools)
