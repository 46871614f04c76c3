"""Pipelines from TOML: routes, a router, layers, and per-environment overlays.

::

    [routes.small]
    provider = "openai"              # openai | azure_openai | ollama | scripted
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

    [environments.development.layers]
    telemetry = false

The environment is the `environment` argument, else ``CHAT_PIPELINE_ENV``; its table is
merged over the base (tables key by key, other values replaced; a route whose provider the
environment changes is replaced whole). Every error is a
`ConfigError` naming the key path and what was expected; unknown keys are errors too, so a
typo never silently does nothing.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.builder import ChatPipeline, ChatPipelineBuilder
from pipeline.client import ChatClient
from pipeline.errors import ConfigError

__all__ = ["ENVIRONMENT_VARIABLE", "build_pipeline", "load_pipeline", "merge"]

ENVIRONMENT_VARIABLE = "CHAT_PIPELINE_ENV"
_PROVIDERS = ("openai", "azure_openai", "ollama", "scripted")
_ROUTERS = ("ordered", "semantic", "tiered")
_LAYERS = ("telemetry", "logging", "function_invocation")


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


class _Table:
    """A TOML table that knows its key path and refuses keys nobody read."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(path, f"expected a table, got {type(data).__name__}")
        self.data = data
        self.path = path
        self._read: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def _get(self, name: str, kinds: tuple[type, ...], expected: str, default: Any) -> Any:
        self._read.add(name)
        if name not in self.data:
            if default is _REQUIRED:
                raise ConfigError(self.key(name), f"is required ({expected})")
            return default
        value = self.data[name]
        if isinstance(value, bool) and bool not in kinds:
            raise ConfigError(self.key(name), f"expected {expected}, got a boolean")
        if not isinstance(value, kinds):
            raise ConfigError(self.key(name), f"expected {expected}, got {type(value).__name__}")
        return value

    def text(self, name: str, default: Any = None) -> Any:
        value = self._get(name, (str,), "a string", default)
        if isinstance(value, str) and not value.strip():
            raise ConfigError(self.key(name), "expected a non-empty string")
        return value

    def choice(self, name: str, choices: Sequence[str], default: Any = None) -> Any:
        value = self.text(name, default)
        if value is not None and value not in choices:
            raise ConfigError(self.key(name), f"expected one of {list(choices)}, got {value!r}")
        return value

    def integer(self, name: str, default: Any = None, *, minimum: int = 1) -> Any:
        value = self._get(name, (int,), f"an integer of at least {minimum}", default)
        if isinstance(value, int) and value < minimum:
            raise ConfigError(
                self.key(name), f"expected an integer of at least {minimum}, got {value}"
            )
        return value

    def number(self, name: str, default: Any = None, *, minimum: float | None = 0.0) -> Any:
        expected = "a number" if minimum is None else f"a number of at least {minimum:g}"
        value = self._get(name, (int, float), expected, default)
        if minimum is not None and isinstance(value, int | float) and value < minimum:
            raise ConfigError(
                self.key(name), f"expected a number of at least {minimum:g}, got {value}"
            )
        return None if value is None else float(value)

    def flag(self, name: str, default: Any = None) -> Any:
        return self._get(name, (bool,), "true or false", default)

    def strings(self, name: str, default: Any = None) -> Any:
        value = self._get(name, (list,), "a list of strings", default)
        if isinstance(value, list):
            for index, item in enumerate(value):
                if not isinstance(item, str) or not item.strip():
                    raise ConfigError(f"{self.key(name)}[{index}]", "expected a non-empty string")
        return value

    def table(self, name: str) -> _Table | None:
        self._read.add(name)
        if name not in self.data:
            return None
        return _Table(self.data[name], self.key(name))

    def required_table(self, name: str) -> _Table:
        table = self.table(name)
        if table is None:
            raise ConfigError(self.key(name), "is required (a table)")
        return table

    def tables(self) -> list[tuple[str, _Table]]:
        self._read.update(self.data)
        return [(name, _Table(value, self.key(name))) for name, value in self.data.items()]

    def done(self) -> None:
        unknown = sorted(set(self.data) - self._read)
        if unknown:
            raise ConfigError(self.key(unknown[0]), "is not a known setting")


_REQUIRED: Any = object()


def _secret(table: _Table, default_env: str | None, required: bool) -> str | None:
    if "api_key" in table.data:
        raise ConfigError(
            table.key("api_key"),
            "secrets come only from environment variables: name one with api_key_env",
        )
    variable = table.text("api_key_env", default_env)
    if variable is None:
        return None
    value = os.environ.get(variable)
    if not value and required:
        raise ConfigError(
            table.key("api_key_env"), f"the environment variable {variable} is not set"
        )
    return value or None


def _route_client(name: str, table: _Table) -> ChatClient:
    provider = table.choice("provider", _PROVIDERS, _REQUIRED)
    if provider == "scripted":
        from pipeline.testing import ScriptedChatClient, reply

        text = table.text("reply", "Simulated answer.")
        model = table.text("model", "scripted-model")
        return ScriptedChatClient(reply(text), name=name, model_id=model)
    timeout = table.number("timeout", 60.0)
    first_chunk = table.number("first_chunk_timeout")
    idle = table.number("stream_idle_timeout")
    if provider == "openai":
        from pipeline.providers import OpenAIChatClient

        base_url = table.text("base_url", "https://api.openai.com/v1")
        key = _secret(
            table, "OPENAI_API_KEY", required=base_url.startswith("https://api.openai.com")
        )
        return OpenAIChatClient(
            table.text("model", _REQUIRED),
            api_key=key,
            base_url=base_url,
            timeout=timeout,
            first_chunk_timeout=first_chunk,
            stream_idle_timeout=idle,
            name=name,
        )
    if provider == "azure_openai":
        from pipeline.providers import AzureOpenAIChatClient

        key = _secret(table, "AZURE_OPENAI_API_KEY", required=True)
        return AzureOpenAIChatClient(
            endpoint=table.text("endpoint", _REQUIRED),
            deployment=table.text("deployment", _REQUIRED),
            api_version=table.text("api_version", "2024-10-21"),
            api_key=key,
            timeout=timeout,
            first_chunk_timeout=first_chunk,
            stream_idle_timeout=idle,
            name=name,
        )
    from pipeline.providers import OllamaChatClient

    return OllamaChatClient(
        table.text("model", _REQUIRED),
        base_url=table.text("base_url", "http://localhost:11434/v1"),
        timeout=timeout,
        first_chunk_timeout=first_chunk,
        stream_idle_timeout=idle,
        name=name,
    )


def _route(name: str, table: _Table) -> Any:
    from middleware.routing import Price, Route

    client: ChatClient = _route_client(name, table)
    builder = ChatPipeline.builder()
    breaker = table.table("breaker")
    if breaker is not None:
        redis_env = breaker.text("redis_url_env")
        redis_url = os.environ.get(redis_env) if redis_env else None
        if redis_env and not redis_url:
            raise ConfigError(
                breaker.key("redis_url_env"), f"the environment variable {redis_env} is not set"
            )
        builder.use_circuit_breaker(
            fail_max=breaker.integer("fail_max", 5),
            reset_timeout=breaker.number("reset_timeout", 30.0),
            name=breaker.text("name", name),
            redis=redis_url,
        )
        breaker.done()
    retry = table.table("retry")
    if retry is not None:
        builder.use_retry(
            max_attempts=retry.integer("max_attempts", 3),
            initial_delay=retry.number("initial_delay", 0.5),
            max_delay=retry.number("max_delay", 8.0),
            jitter=retry.flag("jitter", True),
            respect_retry_after=retry.flag("respect_retry_after", True),
            max_retry_after=retry.number("max_retry_after", 30.0),
        )
        retry.done()
    if breaker is not None or retry is not None:
        client = builder.build(client, name=name)
    price_table = table.table("price")
    price = None
    if price_table is not None:
        price = Price(
            input_per_million=price_table.number("input_per_million", _REQUIRED),
            output_per_million=price_table.number("output_per_million", _REQUIRED),
        )
        price_table.done()
    route = Route(
        name,
        client,
        max_input_tokens=table.integer("max_input_tokens"),
        capabilities=frozenset(table.strings("capabilities", [])),
        price=price,
    )
    table.done()
    return route


def _route_names(
    table: _Table, field: str, names: str | Sequence[str], routes: Mapping[str, Any]
) -> None:
    """Each name must be a defined route; a single name is reported without an index."""
    listed = [names] if isinstance(names, str) else list(names)
    for index, name in enumerate(listed):
        if name not in routes:
            where = table.key(field) if isinstance(names, str) else f"{table.key(field)}[{index}]"
            raise ConfigError(where, f"names no route: {name!r}")


def _router(builder: ChatPipelineBuilder, table: _Table, routes: Mapping[str, Any]) -> None:
    kind = table.choice("kind", _ROUTERS, _REQUIRED)
    limits = {
        "max_attempts_per_request": table.integer("max_attempts_per_request"),
        "request_timeout": table.number("request_timeout", minimum=1e-9),
        "min_attempt_budget": table.number("min_attempt_budget", 0.0),
        "max_provider_calls_per_request": table.integer("max_provider_calls_per_request"),
    }
    if kind == "ordered":
        order = table.strings("order", _REQUIRED)
        if not order:
            raise ConfigError(table.key("order"), "expected at least one route")
        _route_names(table, "order", order, routes)
        table.done()
        builder.use_ordered_failover([routes[n] for n in order], **limits)
        return
    default = table.text("default", _REQUIRED)
    _route_names(table, "default", default, routes)
    if kind == "tiered":
        from middleware.routing.tiered import TieredRoutingChatClient

        fallback: dict[str, list[str]] = {}
        fallback_table = table.table("fallback")
        if fallback_table is not None:
            for source in list(fallback_table.data):
                if source not in routes:
                    raise ConfigError(fallback_table.key(source), f"names no route: {source!r}")
                targets = fallback_table.strings(source, _REQUIRED)
                _route_names(fallback_table, source, targets, routes)
                fallback[source] = targets
            fallback_table.done()
        kinds: dict[str, str] = {}
        kinds_table = table.table("kinds")
        if kinds_table is not None:
            for kind_name in list(kinds_table.data):
                target = kinds_table.text(kind_name, _REQUIRED)
                _route_names(kinds_table, kind_name, target, routes)
                kinds[kind_name] = target
            kinds_table.done()
        sticky = table.flag("sticky_sessions", True)
        table.done()
        router = TieredRoutingChatClient(
            list(routes.values()),
            default=default,
            fallback=fallback,
            kinds=kinds,
            sticky_sessions=sticky,
            **limits,
        )
        builder.use_failover(router)
        return
    # semantic
    for field, value in limits.items():
        if value not in (None, 0.0):
            raise ConfigError(table.key(field), "applies to ordered and tiered routers only")
    profiles_table = table.required_table("profiles")
    profiles = {}
    for route_name in list(profiles_table.data):
        if route_name not in routes:
            raise ConfigError(profiles_table.key(route_name), f"names no route: {route_name!r}")
        profiles[routes[route_name]] = profiles_table.strings(route_name, _REQUIRED)
    profiles_table.done()
    threshold = table.number("threshold", 0.3, minimum=None)
    top_k = table.integer("top_k", 1)
    aggregation = table.choice("aggregation", ("mean", "sum", "max"), "mean")
    generator = _embeddings(table.required_table("embeddings"))
    table.done()
    try:
        builder.use_semantic_routing(
            generator,
            profiles,
            routes[default],
            threshold=threshold,
            top_k=top_k,
            aggregation=aggregation,
        )
    except ValueError as exc:
        raise ConfigError(table.path, str(exc)) from exc


def _embeddings(table: _Table) -> Any:
    provider = table.choice("provider", ("openai", "hashing"), _REQUIRED)
    if provider == "hashing":
        from pipeline.providers import HashingEmbeddingGenerator

        generator: Any = HashingEmbeddingGenerator(
            dimensions=table.integer("dimensions", 384, minimum=2)
        )
    else:
        from pipeline.providers import OpenAIEmbeddingGenerator

        base_url = table.text("base_url", "https://api.openai.com/v1")
        key = _secret(
            table, "OPENAI_API_KEY", required=base_url.startswith("https://api.openai.com")
        )
        generator = OpenAIEmbeddingGenerator(
            table.text("model", _REQUIRED), api_key=key, base_url=base_url
        )
    table.done()
    return generator


def build_pipeline(
    data: Mapping[str, Any],
    environment: str | None = None,
    *,
    tools: Sequence[Any] = (),
) -> ChatPipeline:
    """Build a pipeline from already-parsed configuration (see the module docstring)."""
    root = _Table(data, "")
    environments = root.table("environments")
    environment = environment or os.environ.get(ENVIRONMENT_VARIABLE) or None
    if environment is not None:
        if environments is None or environment not in environments.data:
            known = sorted(environments.data) if environments is not None else []
            raise ConfigError(
                f"environments.{environment}", f"is not defined (defined: {known or 'none'})"
            )
        overlay = _Table(environments.data[environment], f"environments.{environment}")
        for name in overlay.data:
            if name == "environments":
                raise ConfigError(overlay.key(name), "environments cannot be nested")
        root = _Table(
            _overlay({k: v for k, v in data.items() if k != "environments"}, overlay.data), ""
        )
        root._read.add("environments")
    routes_table = root.required_table("routes")
    routes = {name: _route(name, table) for name, table in routes_table.tables()}
    if not routes:
        raise ConfigError("routes", "expected at least one route")
    layers = root.table("layers")
    builder = ChatPipeline.builder()
    if layers is not None:
        enabled = {name: layers.flag(name, False) for name in _LAYERS}
        layers.done()
    else:
        enabled = dict.fromkeys(_LAYERS, False)
    builder.use_telemetry(enabled=enabled["telemetry"])
    builder.use_logging(enabled=enabled["logging"])
    if enabled["function_invocation"] and not tools:
        raise ConfigError(
            "layers.function_invocation", "is on, but no tools were given to from_config"
        )
    builder.use_function_invocation(list(tools), enabled=enabled["function_invocation"])
    router = root.table("router")
    if router is None:
        if len(routes) != 1:
            raise ConfigError("router", "is required when there is more than one route")
        only = next(iter(routes.values()))
        root.done()
        return builder.build(only.client, name=only.name)
    _router(builder, router, routes)
    root.done()
    return builder.build()


def load_pipeline(
    path: str | os.PathLike[str],
    environment: str | None = None,
    *,
    tools: Sequence[Any] = (),
) -> ChatPipeline:
    """Read a TOML file and build its pipeline (`ChatPipeline.from_config`)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("", f"cannot read {file}: {exc.strerror or exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"{file} is not valid TOML: {exc}") from exc
    return build_pipeline(data, environment, tools=tools)
