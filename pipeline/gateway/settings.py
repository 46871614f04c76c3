"""`GatewaySettings`: the ``[gateway]`` table of a pipeline's TOML file.

This module imports neither Starlette nor uvicorn, so the config loader can validate a
``[gateway]`` table without the ``gateway`` extra installed. Secrets are never settings:
the API keys and the Redis URL are read from the environment variables the table names.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, StringConstraints

from pipeline._settings import Settings, suggest

__all__ = ["PIPELINE_MODEL", "GatewaySettings", "api_keys", "is_pattern"]

PIPELINE_MODEL = "pipeline"
"""The model name that means the whole configured pipeline (router, failover and layers)."""

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
# A glob pattern of model names (fnmatch: `*`, `?`, `[...]`), e.g. ``claude-*``.
_MODEL_PATTERN = re.compile(r"[A-Za-z0-9*?\[][A-Za-z0-9._:/*?\[\]!-]{0,127}")
_GLOB = re.compile(r"[*?\[]")


def is_pattern(name: str) -> bool:
    """Whether a `GatewaySettings.models` key is a glob pattern rather than a name."""
    return _GLOB.search(name) is not None


def _env_name(value: str) -> str:
    if not _ENV_NAME.fullmatch(value):
        raise ValueError("expected the name of an environment variable (letters, digits, _)")
    return value


def _model_names(value: dict[str, str]) -> dict[str, str]:
    for alias in value:
        if not (_MODEL_PATTERN if is_pattern(alias) else _MODEL_NAME).fullmatch(alias):
            raise ValueError(
                "model names are 1-128 letters, digits and . _ : / - (starting with a letter "
                "or digit), or glob patterns of them (* ? [...])"
            )
    return value


_EnvName = Annotated[str, AfterValidator(_env_name)]
_Target = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]


def api_keys(value: str) -> list[str]:
    """The keys of a comma-separated list (blanks around and between keys ignored)."""
    return [key.strip() for key in value.split(",") if key.strip()]


class GatewaySettings(Settings):
    """How `chat-pipeline serve` serves the pipeline.

    * `api_keys_env`: the variable holding the accepted API keys, comma-separated; clients
      send one as ``Authorization: Bearer KEY``. Without it the gateway accepts any caller
      (for a private network or a load balancer that authenticates);
    * `max_body_bytes`: larger request bodies get 413;
    * `max_concurrent_per_key`: requests one key (without keys: one client address) may
      have in flight in one worker process (``None``: no limit); one more gets 429 with
      ``Retry-After: retry_after``;
    * `retry_after`: seconds the gateway's own 429s and shutdown 503s, a stream cut after
      output, and a rate limit that said no time ask to wait. A 503 because every route
      failed asks to wait until the earliest time any route said it may serve again (a
      provider's ``Retry-After``, an open breaker, a cooldown); when none said, it says
      ``x-should-retry: false`` (a retry cannot help soon);
    * `drain_timeout`: on shutdown, seconds the requests in flight may take to finish
      before they are cancelled (a stream cancelled this way ends with an in-band error);
    * `models`: the model names clients may ask for, each naming a route or ``"pipeline"``
      (default: ``pipeline`` and every route by its own name). A key may be a glob pattern
      (``"claude-*" = "pipeline"``: ``*``, ``?``, ``[...]``), so the names coding agents
      send reach a configured model; a name is looked up exactly first, then against the
      patterns in the order the table lists them;
    * `redis_url_env`: a Redis that `/readyz` checks (the Redis of shared breakers and
      session affinity is checked too); `readiness_timeout` bounds each check;
    * `prometheus_metrics`: serve ``GET /metrics`` in the Prometheus text format, from the
      meters the spans' metrics come from (``chat-pipeline serve --prometheus-metrics``
      turns it on too);
    * `responses_store`, `responses_ttl`, `responses_max_bytes`, `responses_max_count`,
      `responses_timeout`: where and how long the Responses API's stored responses are
      kept (``store``, ``previous_response_id``, ``item_reference``, ``GET /v1/responses/{id}``).

    Slow and idle clients (what `chat-pipeline serve` enforces on each connection, see
    `pipeline.gateway.server`):

    * `header_timeout`: seconds a connection has to send a whole request head, from its
      first byte (or from the connection's opening); past it: 408 and the connection closed
      (a connection that sent nothing is closed silently);
    * `body_timeout`: seconds a request has to send its whole body once its head arrived;
      past it: 408 and the connection closed;
    * `keep_alive_timeout`: seconds an idle connection stays open between requests. Longer
      than the clients' own idle expiry (5 s for httpx and the openai SDK, 4-5 s for Node),
      so the client, not the gateway, ends an idle connection, and no request is sent on a
      connection the gateway is closing;
    * `max_connections`: open connections per worker process. A connection beyond it closes
      the connection idle the longest; with none idle, the new connection is answered 503
      with ``Retry-After`` and closed.

    A request takes its `max_concurrent_per_key` slot once its body has arrived: a slow body
    holds a connection (until `body_timeout`), never a slot; and without keys each client
    address has slots of its own, so one client cannot take every other client's.
    """

    api_keys_env: _EnvName | None = None
    """The environment variable holding the accepted API keys, comma-separated; clients send one as
    `Authorization: Bearer KEY` (or `x-api-key`). Unset: any caller is accepted (a warning says so
    at startup)."""
    max_body_bytes: Annotated[int, Field(ge=1024, le=256 * 1024 * 1024)] = 4 * 1024 * 1024
    """The largest request body, in bytes: a larger one gets 413."""
    max_concurrent_per_key: Annotated[int, Field(ge=1, le=1_000_000)] | None = 64
    """Requests one key (without keys: one client address) may have in flight in one worker process;
    one more gets 429 with `Retry-After` (in code, `None`: no limit)."""
    retry_after: Annotated[float, Field(gt=0, le=3600)] = 1.0
    """Seconds the gateway's own 429s (and a route's rate limit that said no time) ask the client
    to wait."""
    drain_timeout: Annotated[float, Field(ge=0, le=3600)] = 30.0
    """On shutdown, seconds the requests in flight may take to finish before they are cancelled (a
    stream cancelled this way ends with an in-band error)."""
    models: Annotated[dict[str, _Target], AfterValidator(_model_names)] | None = None
    """The model names clients may ask for, each naming a route or `"pipeline"` (unset: `pipeline`
    and every route by its own name)."""
    redis_url_env: _EnvName | None = None
    """The environment variable holding the URL of a Redis that `/readyz` checks (the Redis of
    shared breakers and session affinity is checked too)."""
    readiness_timeout: Annotated[float, Field(gt=0, le=60)] = 0.5
    """Seconds each `/readyz` check may take."""
    prometheus_metrics: bool = False
    """Serve `GET /metrics` in the Prometheus text format, from the meters the spans' metrics come
    from (`--prometheus-metrics` turns it on too)."""
    header_timeout: Annotated[float, Field(gt=0, le=3600)] = 10.0
    """Seconds a connection has to send a whole request head (from its first byte, or from the
    connection's opening); past it: 408 and the connection closed."""
    body_timeout: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """Seconds a request has to send its whole body once its head arrived; past it: 408 and the
    connection closed."""
    keep_alive_timeout: Annotated[int, Field(ge=1, le=3600)] = 75
    """Seconds an idle connection stays open between requests: longer than the clients' own idle
    expiry (5 s for httpx and the openai SDK), so the client, not the gateway, ends it."""
    max_connections: Annotated[int, Field(ge=1, le=1_000_000)] = 1024
    """Open connections per worker process: one more closes the connection idle the longest, or,
    with none idle, is answered 503 with `Retry-After`."""
    admin_key_env: _EnvName | None = None
    """The environment variable holding the admin key, which the admin endpoints (`GET
    /admin/spend`, `/admin/keys`) take as `Authorization: Bearer KEY` (or `x-api-key`); unset:
    no admin endpoint is served."""
    builtin_tools: Literal["drop", "refuse"] = "drop"
    """What happens to a provider's built-in tools a request offers (``web_search``, Anthropic
    server tools), which no route behind the gateway can run: ``"drop"`` serves the request
    without them, ``"refuse"`` answers 400 naming the tool. Either way the response header
    ``x-chat-pipeline-builtin-tools`` and the log line say what was done."""

    responses_store: Literal["memory", "redis", "none"] = "memory"
    """Where the Responses API's stored responses are kept (a request stores its response
    unless it says `store: false`, as OpenAI's API does), for `previous_response_id`,
    `item_reference` input items and `GET`/`DELETE /v1/responses/{id}`: `"memory"` (this worker
    process's own: with several workers or replicas, a continuation served by another one finds
    nothing), `"redis"` (the Redis `redis_url_env` names, shared by every worker and replica), or
    `"none"` (nothing is stored: `store: true` and the fields that need a stored response are a
    400). Each caller's key sees only its own."""
    responses_ttl: Annotated[float, Field(gt=0, le=30 * 86400)] = 86400.0
    """Seconds a stored response is kept after it was stored (at most 30 days, OpenAI's own)."""
    responses_max_bytes: Annotated[int, Field(ge=1024, le=1 << 40)] = 64 << 20
    """Bytes of stored responses kept (per worker in memory, in all in Redis), the oldest dropped
    first; a response larger than this is not stored. A response continued with
    `previous_response_id` holds the whole conversation before it."""
    responses_max_count: Annotated[int, Field(ge=1, le=100_000_000)] = 10_000
    """Stored responses kept (per worker in memory, in all in Redis), the oldest dropped first."""
    responses_timeout: Annotated[float, Field(gt=0, le=60)] = 0.5
    """Seconds a call to the response store may take; past it (or while the store fails) a stored
    response is answered as not found, with an error saying the store is unavailable, and an
    answer is not stored. A failed store is skipped for a second before it is tried again."""

    def exposed_models(self, route_names: Collection[str]) -> dict[str, str]:
        """Model name (or glob pattern) -> route name or ``"pipeline"``: what clients may
        ask for."""
        if self.models is not None:
            return dict(self.models)
        return {PIPELINE_MODEL: PIPELINE_MODEL, **{name: name for name in route_names}}

    def problems(self, route_names: Collection[str]) -> list[tuple[str, str]]:
        """What the environment and the routes say is wrong with these settings, as
        ``(key path, what is wrong)``: a named variable unset (or holding no key), a model
        naming no route."""
        found: list[tuple[str, str]] = []
        if self.api_keys_env is not None:
            value = os.environ.get(self.api_keys_env)
            if not value:
                found.append(
                    (
                        "gateway.api_keys_env",
                        f"the environment variable {self.api_keys_env} is not set",
                    )
                )
            elif not api_keys(value):
                found.append(
                    (
                        "gateway.api_keys_env",
                        f"the environment variable {self.api_keys_env} holds no key "
                        "(expected comma-separated keys)",
                    )
                )
        if self.admin_key_env is not None and not os.environ.get(self.admin_key_env, "").strip():
            found.append(
                (
                    "gateway.admin_key_env",
                    f"the environment variable {self.admin_key_env} is not set",
                )
            )
        if self.responses_store == "redis" and self.redis_url_env is None:
            found.append(
                (
                    "gateway.responses_store",
                    "'redis' needs redis_url_env (the environment variable holding the URL)",
                )
            )
        if self.redis_url_env is not None and not os.environ.get(self.redis_url_env):
            found.append(
                (
                    "gateway.redis_url_env",
                    f"the environment variable {self.redis_url_env} is not set",
                )
            )
        elif self.responses_store == "redis" and self.redis_url_env is not None:
            from pipeline import _redis

            try:
                _redis.check_url(os.environ[self.redis_url_env])
            except ValueError as exc:  # never the URL: it may hold a password
                variable = self.redis_url_env
                found.append(
                    ("gateway.redis_url_env", f"the environment variable {variable} {exc}")
                )
        for alias, target in (self.models or {}).items():
            if target != PIPELINE_MODEL and target not in route_names:
                found.append(
                    (
                        f"gateway.models.{alias}",
                        f"names no route: {target!r} (a route name or {PIPELINE_MODEL!r})"
                        + suggest(target, [*route_names, PIPELINE_MODEL]),
                    )
                )
        return found
