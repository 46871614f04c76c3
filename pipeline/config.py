"""Pipelines from TOML: routes, a router, layers, and per-environment overlays.

::

    [routes.small]
    provider = "openai"              # openai | azure_openai | ollama | anthropic | scripted
    model = "gpt-4o-mini"
    api_key_env = "OPENAI_API_KEY"   # secrets come only from environment variables
    max_input_tokens = 8000
    capabilities = ["tools", "json"]
    price = { input_per_million = 0.15, output_per_million = 0.6 }
    retry = { max_attempts = 2 }
    breaker = { fail_max = 5, reset_timeout = 30 }

    [router]
    kind = "tiered"                  # ordered | semantic | tiered
    default = "small"

    [layers]
    telemetry = true

    [gateway]                        # `chat-pipeline serve` (see pipeline.gateway)
    api_keys_env = "GATEWAY_KEYS"

    [environments.development.layers]
    telemetry = false

The environment is the `environment` argument, else ``CHAT_PIPELINE_ENV``; its table is
merged over the base (tables key by key, other values replaced; a route whose provider the
environment changes is replaced whole).

Validation uses the layers' own settings classes (`RetrySettings`, `BreakerSettings`,
`FailoverSettings`, `SemanticSettings`, `RouteFacts`), so a default or a check is never
written twice. Every problem is reported at once, each with its key path, as one
`ConfigError`; an unknown key is an error with a suggestion (``routes.a.modle: unknown
setting; did you mean 'model'?``); a named `api_key_env` that is unset is an error. Nothing
read from the file (a secret, a prompt) is echoed in an error message except numbers and
names.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

import pydantic
from pydantic import AfterValidator, Field, StringConstraints, model_validator

from pipeline._settings import Settings, collecting_problems, problems_of, suggest
from pipeline.builder import ChatPipeline, ChatPipelineBuilder
from pipeline.client import ChatClient
from pipeline.errors import ConfigError

if TYPE_CHECKING:
    from pipeline.gateway.settings import GatewaySettings

__all__ = [
    "ENVIRONMENT_VARIABLE",
    "PipelineConfig",
    "build_pipeline",
    "load_config",
    "load_pipeline",
    "merge",
    "parse_config",
]

ENVIRONMENT_VARIABLE = "CHAT_PIPELINE_ENV"

# -- values ----------------------------------------------------------------------------------

_Name = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
_Seconds = Annotated[float, Field(gt=0, le=86_400)]
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _env_name(value: str) -> str:
    if not _ENV_NAME.match(value):
        raise ValueError("expected the name of an environment variable (letters, digits, _)")
    return value


def _http_url(value: str) -> str:
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError:
        raise ValueError("expected an http(s) URL; this one does not parse") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http(s) URL with a host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            "credentials do not belong in a URL: secrets come only from environment variables"
        )
    return value


_EnvName = Annotated[str, AfterValidator(_env_name)]
_Url = Annotated[str, AfterValidator(_http_url)]


class _Section(Settings):
    """A table of the file: strict, closed, finite (like every settings class)."""


class _OpenAIEndpoint(_Section):
    """An OpenAI-compatible endpoint: its model, URL and the variable holding its key."""

    model: _Name
    base_url: _Url = "https://api.openai.com/v1"
    api_key_env: _EnvName | None = None


# The layers' settings classes are imported lazily (they live in `middleware`, which imports
# `pipeline`); the models below are built on first use.


@dataclass(frozen=True)
class _Models:
    routes: Mapping[str, type[pydantic.BaseModel]]
    routers: Mapping[str, type[pydantic.BaseModel]]
    layers: type[pydantic.BaseModel]
    breaker: type[pydantic.BaseModel]
    retry: type[pydantic.BaseModel]


_models_cache: list[_Models] = []


def _models() -> _Models:
    if _models_cache:
        return _models_cache[0]
    from middleware.breaker import BreakerSettings
    from middleware.retry import RetrySettings
    from middleware.routing.affinity import AffinitySettings
    from middleware.routing.context import RouteFacts
    from middleware.routing.failover import FailoverSettings
    from middleware.routing.semantic import SemanticSettings

    class _Breaker(BreakerSettings):
        """``breaker = {...}``: a shared breaker names its Redis URL's variable."""

        redis_url_env: _EnvName | None = None

        @model_validator(mode="before")
        @classmethod
        def _no_literal_redis(cls, data: Any) -> Any:
            if isinstance(data, Mapping) and "redis" in data:
                raise ValueError(
                    "redis: a URL may hold a password; name its environment variable with "
                    "redis_url_env"
                )
            return data

    class _Route(RouteFacts):
        provider: str
        retry: RetrySettings | None = None
        breaker: _Breaker | None = None

    class _Timeouts(_Route):
        timeout: _Seconds = 60.0
        first_chunk_timeout: _Seconds | None = None
        stream_idle_timeout: _Seconds | None = None

    class _ChatCompletions(_Timeouts):
        # Servers that ignore max_completion_tokens (llama.cpp, older ones) need max_tokens.
        max_tokens_field: Literal["max_completion_tokens", "max_tokens"] | None = None

    class _OpenAI(_ChatCompletions, _OpenAIEndpoint):
        provider: Literal["openai"]

    class _Azure(_ChatCompletions):
        provider: Literal["azure_openai"]
        endpoint: _Url
        deployment: _Name
        api_version: _Name = "2024-10-21"
        api_key_env: _EnvName | None = None

    class _Ollama(_ChatCompletions):
        provider: Literal["ollama"]
        model: _Name
        base_url: _Url = "http://localhost:11434/v1"

    class _Anthropic(_Timeouts):
        provider: Literal["anthropic"]
        model: _Name
        base_url: _Url = "https://api.anthropic.com"
        api_key_env: _EnvName | None = None
        max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 1024
        anthropic_version: _Name = "2023-06-01"

    class _Scripted(_Route):
        provider: Literal["scripted"]
        reply: str = "Simulated answer."
        model: _Name = "scripted-model"

    class _Affinity(AffinitySettings):
        """``[router.affinity]``: sessions keep their route (memory, or Redis for replicas)."""

        store: Literal["memory", "redis"] = "memory"
        redis_url_env: _EnvName | None = None

        @model_validator(mode="after")
        def _redis_needs_a_url(self) -> Any:
            if self.store == "redis" and self.redis_url_env is None:
                raise ValueError("store = 'redis' needs redis_url_env (the URL's variable)")
            return self

    class _Ordered(FailoverSettings):
        kind: Literal["ordered"]
        order: Annotated[list[_Name], Field(min_length=1)]
        affinity: _Affinity | None = None

    class _Tiered(FailoverSettings):
        kind: Literal["tiered"]
        default: _Name
        fallback: dict[str, list[_Name]] = Field(default_factory=dict)
        kinds: dict[str, _Name] = Field(default_factory=dict)
        sticky_sessions: bool = True
        affinity: _Affinity | None = None

    class _HashingEmbeddings(_Section):
        provider: Literal["hashing"]
        dimensions: Annotated[int, Field(ge=2, le=65_536)] = 384

    class _OpenAIEmbeddings(_OpenAIEndpoint):
        provider: Literal["openai"]

    class _Semantic(SemanticSettings):
        kind: Literal["semantic"]
        default: _Name
        profiles: Annotated[
            dict[str, Annotated[list[_Name], Field(min_length=1)]], Field(min_length=1)
        ]
        embeddings: Annotated[
            _HashingEmbeddings | _OpenAIEmbeddings, Field(discriminator="provider")
        ]

    class _Layers(_Section):
        telemetry: bool = False
        logging: bool = False
        function_invocation: bool = False

    models = _Models(
        routes={
            "openai": _OpenAI,
            "azure_openai": _Azure,
            "ollama": _Ollama,
            "anthropic": _Anthropic,
            "scripted": _Scripted,
        },
        routers={"ordered": _Ordered, "tiered": _Tiered, "semantic": _Semantic},
        layers=_Layers,
        breaker=_Breaker,
        retry=RetrySettings,
    )
    _models_cache.append(models)
    return models


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


class _Problems:
    """Every problem found, each with its key path; raised together at the end."""

    def __init__(self) -> None:
        self.found: list[tuple[str, str]] = []

    def add(self, path: str, message: str) -> None:
        self.found.append((path, message))

    def validate(self, model: type[pydantic.BaseModel], data: Any, path: str) -> Any:
        """`data` validated by `model`, or `None` with its problems recorded."""
        if not isinstance(data, Mapping):
            self.add(path, f"expected a table, got {type(data).__name__}")
            return None
        try:
            with collecting_problems():
                return model.model_validate(dict(data))
        except pydantic.ValidationError as exc:
            prefix = tuple(part for part in _split(path))
            for where, message, _ in problems_of(exc, model, prefix):
                self.add(where, message)
            return None

    def raise_if_any(self) -> None:
        if self.found:
            raise ConfigError.from_problems(self.found)


def _split(path: str) -> list[str]:
    return path.split(".") if path else []


def _choice(
    problems: _Problems, table: Mapping[str, Any], key: str, choices: Sequence[str], path: str
) -> str | None:
    value = table.get(key)
    where = f"{path}.{key}"
    if value is None:
        problems.add(where, f"is required (one of {list(choices)})")
        return None
    if value not in choices:
        shown = repr(value) if isinstance(value, str) and len(value) <= 40 else type(value).__name__
        problems.add(
            where, f"expected one of {list(choices)}, got {shown}{suggest(str(value), choices)}"
        )
        return None
    return str(value)


def _names(
    problems: _Problems, path: str, names: str | Sequence[str], routes: Mapping[str, Any]
) -> None:
    """Each name must be a defined route; a single name is reported without an index."""
    if isinstance(names, str):
        if names not in routes:
            problems.add(path, f"names no route: {names!r}{suggest(names, routes)}")
        return
    for index, name in enumerate(names):
        if name not in routes:
            problems.add(f"{path}[{index}]", f"names no route: {name!r}{suggest(name, routes)}")


_SECTIONS = ("routes", "router", "layers", "gateway", "environments")
_DEFAULT_KEYS = {
    "openai": "OPENAI_API_KEY",
    "azure_openai": "AZURE_OPENAI_API_KEY",
    "anthropic": "ANTHROPIC_API_KEY",
}
# Where a key is required (the vendors' own endpoints); compatible servers may need none.
_KEYED_ENDPOINTS = ("https://api.openai.com", "https://api.anthropic.com")


@dataclass(frozen=True)
class PipelineConfig:
    """A validated configuration: its routes, its router and layers, ready to build.

    `build()` makes the pipeline; `build_route(name)` makes one route alone (its client with
    its own retry and breaker), for evaluation or direct calls. Secrets were read from the
    environment when the file was loaded.
    """

    routes: Mapping[str, Any]
    router: Any
    layers: Any
    environment: str | None
    _secrets: Mapping[str, str | None] = field(repr=False, default_factory=dict)
    gateway: GatewaySettings | None = None
    """The ``[gateway]`` table (`pipeline.gateway.settings.GatewaySettings`), if any."""

    @property
    def route_names(self) -> list[str]:
        return list(self.routes)

    def build(
        self,
        *,
        tools: Sequence[Any] = (),
        tracer_provider: Any = None,
        meter_provider: Any = None,
    ) -> ChatPipeline:
        """The pipeline the file describes. Tools are code: pass them when the file turns
        ``layers.function_invocation`` on."""
        problems = _Problems()
        layers = self.layers
        if layers.function_invocation and not tools:
            problems.add("layers.function_invocation", "is on, but no tools were given")
        providers = {"tracer_provider": tracer_provider, "meter_provider": meter_provider}
        routes = {name: self._route(name, problems, providers) for name in self.routes}
        problems.raise_if_any()
        builder = ChatPipeline.builder(**providers)
        builder.use_telemetry(enabled=layers.telemetry)
        builder.use_logging(enabled=layers.logging)
        builder.use_function_invocation(list(tools), enabled=layers.function_invocation)
        if self.router is None:
            only = next(iter(routes.values()))
            return builder.build(only.client, name=only.name)
        try:
            _use_router(builder, self.router, routes, self._secrets)
        except (TypeError, ValueError) as exc:
            raise ConfigError("router", str(exc)) from exc
        return builder.build()

    def build_route(
        self, name: str, *, tracer_provider: Any = None, meter_provider: Any = None
    ) -> Any:
        """One route (a `middleware.routing.Route`) with its own layers."""
        if name not in self.routes:
            raise ConfigError(f"routes.{name}", f"is not defined{suggest(name, self.routes)}")
        problems = _Problems()
        providers = {"tracer_provider": tracer_provider, "meter_provider": meter_provider}
        route = self._route(name, problems, providers)
        problems.raise_if_any()
        return route

    def _route(self, name: str, problems: _Problems, providers: dict[str, Any]) -> Any:

        table = self.routes[name]
        path = f"routes.{name}"
        try:
            client = _client(name, table, self._secrets.get(name))
        except (TypeError, ValueError) as exc:
            problems.add(path, f"rejected: {exc}")
            return None
        try:
            return self._route_layers(name, table, client, providers)
        except (TypeError, ValueError) as exc:
            problems.add(path, f"rejected: {exc}")
            return None

    def _route_layers(
        self, name: str, table: Any, client: ChatClient, providers: dict[str, Any]
    ) -> Any:
        from middleware.routing.context import Route

        # The file's telemetry providers reach the route's breaker too (its state changes).
        builder = ChatPipeline.builder(**providers)
        breaker = table.breaker
        if breaker is not None:
            fields = {key: getattr(breaker, key) for key in type(breaker).model_fields}
            variable = fields.pop("redis_url_env")
            fields["name"] = fields["name"] or name
            fields["redis"] = os.environ.get(variable) if variable else None
            builder.use_circuit_breaker(**fields)
        if table.retry is not None:
            builder.use_retry(table.retry)
        if breaker is not None or table.retry is not None:
            client = builder.build(client, name=name)
        return Route(
            name,
            client,
            max_input_tokens=table.max_input_tokens,
            capabilities=table.capabilities,
            price=table.price,
            instructions=table.instructions,
        )


def _client(name: str, table: Any, key: str | None) -> ChatClient:
    provider = table.provider
    if provider == "scripted":
        from pipeline._scripted import ScriptedChatClient, reply

        return ScriptedChatClient(reply(table.reply), name=name, model_id=table.model)
    timeouts = {
        "timeout": table.timeout,
        "first_chunk_timeout": table.first_chunk_timeout,
        "stream_idle_timeout": table.stream_idle_timeout,
        "name": name,
    }
    if provider == "anthropic":
        from pipeline.providers import AnthropicChatClient

        return AnthropicChatClient(
            table.model,
            api_key=key,
            base_url=table.base_url,
            max_tokens=table.max_tokens,
            anthropic_version=table.anthropic_version,
            **timeouts,
        )
    timeouts["max_tokens_field"] = table.max_tokens_field
    if provider == "openai":
        from pipeline.providers import OpenAIChatClient

        return OpenAIChatClient(table.model, api_key=key, base_url=table.base_url, **timeouts)
    if provider == "azure_openai":
        from pipeline.providers import AzureOpenAIChatClient

        return AzureOpenAIChatClient(
            endpoint=table.endpoint,
            deployment=table.deployment,
            api_version=table.api_version,
            api_key=key,
            **timeouts,
        )
    from pipeline.providers import OllamaChatClient

    return OllamaChatClient(table.model, base_url=table.base_url, **timeouts)


def _limits(router: Any) -> dict[str, Any]:
    from middleware.routing.failover import FailoverSettings

    return {
        key: getattr(router, key)
        for key in FailoverSettings.model_fields
        if key not in FailoverSettings.code_only
    }


def _affinity(table: Any) -> Any:
    """The `SessionAffinity` a ``[router.affinity]`` table describes (or None)."""
    if table is None:
        return None
    from middleware.routing.affinity import (
        MemoryAffinityStore,
        RedisAffinityStore,
        SessionAffinity,
    )

    if table.store == "redis":
        url = os.environ[table.redis_url_env]  # checked when the file was loaded
        return SessionAffinity(RedisAffinityStore(url, table.ttl, timeout=table.timeout))
    return SessionAffinity(MemoryAffinityStore(table.max_sessions, table.ttl))


def _use_router(
    builder: ChatPipelineBuilder,
    router: Any,
    routes: Mapping[str, Any],
    secrets: Mapping[str, str | None],
) -> None:
    if router.kind == "ordered":
        builder.use_ordered_failover(
            [routes[n] for n in router.order],
            affinity=_affinity(router.affinity),
            **_limits(router),
        )
        return
    if router.kind == "tiered":
        from middleware.routing.tiered import TieredRoutingChatClient

        def tiered() -> TieredRoutingChatClient:
            return TieredRoutingChatClient(
                list(routes.values()),
                default=router.default,
                fallback=router.fallback,
                kinds=router.kinds,
                sticky_sessions=router.sticky_sessions,
                affinity=_affinity(router.affinity),
                **_limits(router),
            )

        tiered()  # any refusal surfaces now, as a configuration error
        builder.use_failover(tiered)
        return
    from middleware.routing.semantic import SemanticSettings

    embeddings = router.embeddings
    if embeddings.provider == "hashing":
        from pipeline.providers import HashingEmbeddingGenerator

        generator: Any = HashingEmbeddingGenerator(dimensions=embeddings.dimensions)
    else:
        from pipeline.providers import OpenAIEmbeddingGenerator

        generator = OpenAIEmbeddingGenerator(
            embeddings.model, api_key=secrets.get("router.embeddings"), base_url=embeddings.base_url
        )
    settings = {key: getattr(router, key) for key in SemanticSettings.model_fields}
    builder.use_semantic_routing(
        generator,
        {routes[name]: utterances for name, utterances in router.profiles.items()},
        routes[router.default],
        **settings,
    )


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
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError:
        problems.add(where, f"the environment variable {variable} holds a malformed URL")
        return
    if parts.scheme not in ("redis", "rediss", "unix") or (
        parts.scheme != "unix" and not parts.hostname
    ):
        problems.add(
            where,
            f"the environment variable {variable} must hold a redis://, rediss:// or unix:// URL",
        )


def _secret(
    problems: _Problems, table: Any, path: str, default_variable: str | None, required: bool
) -> str | None:
    variable = getattr(table, "api_key_env", None) or default_variable
    if variable is None:
        return None
    value = os.environ.get(variable)
    if not value and (required or getattr(table, "api_key_env", None)):
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
        if key not in ("routes", "router", "layers", "gateway"):
            problems.add(
                str(key),
                f"unknown setting{suggest(str(key), _SECTIONS)}",
            )
    models = _models()
    raw_routes = base.get("routes")
    routes: dict[str, Any] = {}
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
            if not isinstance(table, Mapping):
                problems.add(path, f"expected a table, got {type(table).__name__}")
                continue
            provider = _choice(problems, table, "provider", list(models.routes), path)
            if provider is None:
                continue
            validated = problems.validate(models.routes[provider], table, path)
            if validated is None:
                continue
            routes[str(name)] = validated
            if provider in _DEFAULT_KEYS:
                required = provider == "azure_openai" or validated.base_url.startswith(
                    _KEYED_ENDPOINTS
                )
                secrets[str(name)] = _secret(
                    problems, validated, path, _DEFAULT_KEYS[provider], required
                )
            if validated.breaker is not None:
                _variable_set(problems, f"{path}.breaker", validated.breaker.redis_url_env)
    raw_layers = base.get("layers", {})
    layers = problems.validate(models.layers, raw_layers, "layers")
    raw_router = base.get("router")
    router = None
    if raw_router is None:
        if isinstance(raw_routes, Mapping) and len(raw_routes) > 1:
            problems.add("router", "is required when there is more than one route")
    elif not isinstance(raw_router, Mapping):
        problems.add("router", f"expected a table, got {type(raw_router).__name__}")
    else:
        kind = _choice(problems, raw_router, "kind", list(models.routers), "router")
        if isinstance(raw_routes, Mapping):
            _check_router_names(problems, raw_router, raw_routes)
        if kind is not None:
            router = problems.validate(models.routers[kind], raw_router, "router")
        if router is not None and getattr(router, "affinity", None) is not None:
            _variable_set(problems, "router.affinity", router.affinity.redis_url_env)
        if (
            router is not None
            and router.kind == "semantic"
            and router.embeddings.provider == "openai"
        ):
            secrets["router.embeddings"] = _secret(
                problems,
                router.embeddings,
                "router.embeddings",
                "OPENAI_API_KEY",
                router.embeddings.base_url.startswith("https://api.openai.com"),
            )
    gateway = None
    if "gateway" in base:
        from pipeline.gateway.settings import GatewaySettings

        gateway = problems.validate(GatewaySettings, base["gateway"], "gateway")
        names = [str(n) for n in raw_routes] if isinstance(raw_routes, Mapping) else []
        for where, message in gateway.problems(names) if gateway is not None else ():
            problems.add(where, message)
    problems.raise_if_any()
    return PipelineConfig(routes, router, layers, environment, secrets, gateway)


def _check_router_names(
    problems: _Problems, router: Mapping[str, Any], routes: Mapping[str, Any]
) -> None:
    """Route names the router refers to must be routes (checked on the raw table, so they
    are reported even when other router settings are wrong; wrong types are reported by
    the validation)."""

    def names(path: str, value: Any) -> None:
        if isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        ):
            _names(problems, path, value, routes)

    if "order" in router:
        names("router.order", router["order"])
    if "default" in router:
        names("router.default", router["default"])
    for table_name in ("fallback", "kinds", "profiles"):
        table = router.get(table_name)
        if not isinstance(table, Mapping):
            continue
        for key, value in table.items():
            if table_name != "kinds":
                names(f"router.{table_name}.{key}", str(key))
            if table_name != "profiles":
                names(f"router.{table_name}.{key}", value)


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
