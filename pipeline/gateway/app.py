"""The gateway's ASGI app: a configured pipeline behind OpenAI-compatible endpoints.

`create_app(config)` returns a Starlette app; its lifespan builds the pipeline (and a
client per route exposed by name) once, when the worker starts, and closes them when it
stops. Endpoints:

* ``POST /v1/chat/completions``: non-streaming and streaming (SSE) answers, tools, usage
  (the Chat Completions format, `pipeline.gateway._chat_completions`);
* ``POST /v1/responses``: the Responses API over the same pipeline
  (`pipeline.gateway._responses`), and its stored responses (``GET``/``DELETE
  /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``:
  `pipeline.gateway._stored_responses`, over ``[gateway] responses_store``);
* ``POST /v1/messages``: Anthropic's Messages API over the same pipeline
  (`pipeline.gateway._anthropic_messages`), and ``POST /v1/messages/count_tokens`` (an
  estimate); every other path under ``/v1/messages`` answers errors in Anthropic's shape;
* ``GET /v1/models``, ``GET /v1/models/{id}``: the model names `[gateway] models` exposes;
* ``GET /healthz``: the process answers; ``GET /readyz``: the pipeline is built and every
  Redis the configuration names answers a PING within ``readiness_timeout``;
* ``GET /metrics`` with ``prometheus_metrics``: the Prometheus text of the meters;
* ``GET /admin/spend`` with ``admin_key_env`` and ``[spend]``: the spend ledger's summary
  (`pipeline.gateway._endpoints`), for the admin key only.

An inbound format's endpoint runs these layers, each a module of its own, in this order,
in one call per request (`_Endpoint`: no coroutine and no frame per layer):

1. the exchange (`pipeline.gateway._exchange`): the request id (an incoming valid
   ``x-request-id``, else a fresh one, echoed on every response, errors included) and the
   request counted in flight, so shutdown can wait for it;
2. telemetry (`pipeline.gateway._telemetry`): the SERVER span telling the routing story,
   ``http.server.request.duration`` and one log line per request;
3. authentication (`pipeline.gateway._auth`): 401 before the body is read;
4. the body (`pipeline.gateway._body`): 405, 415 (not JSON), 413 (too large), 408 (too
   slow: the connection's deadline, `pipeline.gateway._protocol`);
5. limits (`pipeline.gateway._limits`): a slot per key (per client address without keys),
   taken once the body arrived; 429 beyond ``max_concurrent_per_key``;
6. the format's handler (`pipeline.gateway._handler`): the pipeline call, the failover
   boundary, disconnects and shutdown.

A new inbound format is a module with an `InboundFormat` (how a body becomes a request,
how answers, streams and errors are written) added to `FORMATS`: it gets every layer.
The plain endpoints are in `pipeline.gateway._endpoints` (the models ones behind the auth
layer too). No prompt, response, tool argument or key reaches a log line or a span.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fnmatch
import gc
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route, request_response

from pipeline._forward import forwarding_clients
from pipeline.client import ChatClient
from pipeline.errors import ConfigError
from pipeline.gateway._admin import KeysAdmin
from pipeline.gateway._anthropic_messages import COUNT_TOKENS, MESSAGES, CountTokensHandler
from pipeline.gateway._auth import Authenticator, AuthMiddleware
from pipeline.gateway._body import BodyReader
from pipeline.gateway._chat_completions import CHAT_COMPLETIONS
from pipeline.gateway._endpoints import Endpoints, prometheus_reader
from pipeline.gateway._exchange import (
    EXCHANGE,
    ASGIApp,
    Exchange,
    Receive,
    RequestIdMiddleware,
    Scope,
    Send,
    enter_request_id,
    exit_request_id,
)
from pipeline.gateway._exchange import SESSION_HEADER as _SESSION_HEADER
from pipeline.gateway._forwarding import CHAT_FORWARDER
from pipeline.gateway._governance import Governance, GovernanceMiddleware, MeteredClient
from pipeline.gateway._handler import AnswerHooks, FormatHandler, InboundFormat
from pipeline.gateway._limits import Slots
from pipeline.gateway._responses import RESPONSES
from pipeline.gateway._stored_responses import (
    PATH as STORED_RESPONSES_PATH,
)
from pipeline.gateway._stored_responses import (
    NoStoredResponses,
    StoredResponseEndpoint,
    StoredResponses,
)
from pipeline.gateway._telemetry import RequestTelemetry
from pipeline.gateway.response_store import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStore,
)
from pipeline.gateway.settings import PIPELINE_MODEL, GatewaySettings, api_keys, is_pattern
from pipeline.gateway.wire import WireError, now

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider
    from prometheus_client import CollectorRegistry

    from pipeline.config import PipelineConfig
    from pipeline.spend import SpendLedger

__all__ = ["FORMATS", "SESSION_HEADER", "Gateway", "Target", "create_app"]

SESSION_HEADER = _SESSION_HEADER.decode()
"""The request header carrying the session id (session affinity keeps its route)."""

FORMATS: tuple[InboundFormat, ...] = (CHAT_COMPLETIONS, RESPONSES, MESSAGES)
"""The inbound formats the gateway serves, each on its own path."""

_logger = logging.getLogger("chat_pipeline.gateway")


class _YoungThreshold:
    """The collector's young-generation threshold, raised while a worker serves.

    The requests in flight hold their objects across turns of the loop, so at concurrency
    they keep the young generation past CPython's default 700 and every few requests pay a
    young collection that finds almost nothing (and promotes the requests in flight, which
    brings full collections sooner): some 20 thousand instructions a request at
    concurrency 16 (docs/performance/gateway.md). Not as far as 10,000: a young
    collection's pause grows with the threshold, and every request in flight waits it out
    (at 10,000 some 4 ms of CPU, which showed in the p99 at concurrency 16); nor as low as
    2,000, where one request at a time meets a collection every 70 or so requests, more
    often than one in a hundred, and its p99 showed that. Process-wide, so counted: the
    first worker to start raises it, the last to stop puts back what was there."""

    RAISED = 5_000

    def __init__(self) -> None:
        self._workers = 0
        self._before: tuple[int, int, int] | None = None  # set while raised by us

    def worker_started(self) -> None:
        self._workers += 1
        before = gc.get_threshold()
        # Not when the collector is off (0) or someone raised it further already.
        if self._workers == 1 and 0 < before[0] < self.RAISED:
            self._before = before
            gc.set_threshold(self.RAISED, *before[1:])

    def worker_stopped(self) -> None:
        self._workers -= 1
        if self._workers == 0 and self._before is not None:
            if gc.get_threshold()[0] == self.RAISED:  # unless someone changed it since
                gc.set_threshold(*self._before)
            self._before = None


_YOUNG_COLLECTIONS = _YoungThreshold()


@dataclass(frozen=True, slots=True)
class Target:
    """What a model name serves: the pipeline or one route (with its instructions), and
    the route it serves when that is known before the request (a route by name, or a
    pipeline without a router); whether a client below may forward requests
    (`pipeline._forward`), and whether a response cache is among its layers."""

    client: ChatClient
    instructions: str | None = None
    route: str | None = None
    forwards: bool = False
    caches: bool = False


class Gateway:
    """One worker's gateway: what its model names serve, its keys, its requests in flight
    and its readiness (the state the request layers share).

    `start()` builds the pipeline and the exposed routes' clients (once per worker);
    `stop()` waits (briefly) for requests still finishing, then closes every client and
    the response store (`stored_responses`: ``[gateway] responses_store``, or the
    `response_store` given).
    Code tools cannot run in a server, so a configuration that turns
    ``layers.function_invocation`` on is refused: clients declare their tools and run them.
    """

    def __init__(
        self,
        config: PipelineConfig,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        source: str | None = None,
        response_store: ResponseStore | None = None,
    ) -> None:
        if config.layers.function_invocation:
            raise ConfigError(
                "layers.function_invocation",
                "a gateway runs no code tools (clients declare tools and run them): turn it off",
            )
        self.config = config
        self.settings: GatewaySettings = config.gateway or GatewaySettings()
        self.models = self.settings.exposed_models(config.route_names)
        keys: list[bytes] = []
        if self.settings.api_keys_env is not None:
            keys = [k.encode() for k in api_keys(os.environ.get(self.settings.api_keys_env, ""))]
            if not keys:
                raise ConfigError(
                    "gateway.api_keys_env",
                    f"the environment variable {self.settings.api_keys_env} holds no key",
                )
        self.keys = keys
        self.governance = Governance.of(
            config, retry_after=self.settings.retry_after, meter_provider=meter_provider
        )
        self._costs: dict[str, Any] = {}
        admin = self.settings.admin_key_env
        self.admin_key: bytes | None = (
            os.environ.get(admin, "").strip().encode() or None if admin is not None else None
        )
        self.spend: SpendLedger | None = None  # made at start, when [spend] is on
        self.source = source
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.targets: dict[str, Target] = {}
        self._patterns: list[tuple[str, Target]] = []
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._redis: dict[str, Any] = {}
        self._in_flight = 0  # requests of the inbound formats not yet ended
        # Set once no request is in flight; made only while someone waits (`wait_idle`), so
        # that a request in a quiet worker changes no event.
        self._idle: asyncio.Event | None = None
        self.started_at = now()
        self.ready = False
        self.stored_responses = _stored_responses(self.settings, response_store)
        self._frozen = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Build what the exposed models serve (the pipeline once, each named route once)."""
        from pipeline.builder import ChatPipeline

        config = self.config
        tracer_provider, meter_provider = self.tracer_provider, self.meter_provider
        built: dict[str, Target] = {}
        try:
            if config.spend is not None and config.spend.enabled:
                # One ledger per worker, for the pipeline and every route called by name.
                self.spend = config.spend.ledger(meter_provider=meter_provider)
            for target in dict.fromkeys(self.models.values()):
                if target == PIPELINE_MODEL:
                    pipeline = config.build(
                        tracer_provider=tracer_provider,
                        meter_provider=meter_provider,
                        spend_ledger=self.spend,
                    )
                    # Without a router the pipeline is its only route.
                    only = config.route_names[0] if config.router is None else None
                    built[target] = Target(pipeline, route=only)
                    self._closers.append(pipeline.aclose)
                    continue
                route = config.build_route(
                    target, tracer_provider=tracer_provider, meter_provider=meter_provider
                )
                # A route called by name gets the file's telemetry, logging and cache
                # layers too.
                builder = (
                    ChatPipeline.builder(
                        tracer_provider=tracer_provider, meter_provider=meter_provider
                    )
                    .use_telemetry(enabled=config.layers.telemetry)
                    .use_logging(enabled=config.layers.logging)
                )
                if self.spend is not None:
                    config.install_spend(builder, self.spend, price=route.price)
                config.install_cache(builder)
                client = builder.build(route.client, name=route.name)
                built[target] = Target(client, route.instructions, route=target)
                self._closers.append(client.aclose)
            if self.governance.governor is not None:
                built = {name: self._metered(target) for name, target in built.items()}
            built = _with_forwarding(
                built, caches=config.cache is not None and config.cache.enabled
            )
            targets = {model: built[target] for model, target in self.models.items()}
            self.targets = {m: t for m, t in targets.items() if not is_pattern(m)}
            self._patterns = [(m, t) for m, t in targets.items() if is_pattern(m)]
            self._redis = self._readiness_clients()
            self.governance.costs_for = self._costs_for
            await self.governance.start()
        except BaseException:
            await self._close()
            raise
        self.ready = True
        # What the worker built lives as long as it does (the modules, the pipeline, and with
        # [spend] the price data of genai-prices: some 50,000 objects): moved out of the
        # collector's sight, a full collection no longer walks it (with the price data, 115
        # ms instead of 17 ms each on a loaded 2-core machine, a tenth of the requests' CPU;
        # without, 5-10% of a streamed request's instructions). Undone when the worker stops.
        # The young objects are collected first; a full collection only with the price data
        # (it takes a tenth of a second in a large process).
        gc.collect() if self.spend is not None else gc.collect(1)
        gc.freeze()
        _YOUNG_COLLECTIONS.worker_started()
        self._frozen = True
        self._log_start()

    def target(self, model: str) -> Target | None:
        """What a model name a client sent serves: the exact name's target, else the first
        matching pattern's (`[gateway] models` may hold glob patterns), else None."""
        target = self.targets.get(model)
        if target is not None or not self._patterns:
            return target
        for pattern, matched in self._patterns:
            if fnmatch.fnmatchcase(model, pattern):
                return matched
        return None

    def _metered(self, target: Target) -> Target:
        """`target` logging its call as the request's attempt when no router beneath
        does (budgets settle with the attempt log) and no spend layer within does."""
        from pipeline.client import metadata_of

        if (
            self.spend is not None
            or target.route is None
            or metadata_of(target.client).provider_name == "router"
        ):
            return target
        price = self.config.routes[target.route].price
        client = MeteredClient(target.client, route=target.route, price=price)
        return Target(client, target.instructions, route=target.route)

    def _costs_for(self, model: str) -> Any:
        """What the routes a model name may use cost at most per token (for budget
        reservations): its route's price, or the dearest of every route's."""
        cost = self._costs.get(model)
        if cost is not None:
            return cost
        from pipeline._governance import RateCost

        target = self.target(model)
        names = [target.route] if target is not None and target.route else self.config.route_names
        cost = RateCost.of([p for p in map(self._route_price, names) if p is not None])
        if len(self._costs) < 1024:
            self._costs[model] = cost
        return cost

    def _route_price(self, name: str) -> tuple[Any, Any] | None:
        """A route's (input, output) price per million tokens: its own, else the book's."""
        from decimal import Decimal

        route = self.config.routes[name]
        price = route.price
        if price is not None:
            return Decimal(str(price.input_per_million)), Decimal(str(price.output_per_million))
        book = self.governance.prices
        provider = route.gen_ai_provider_name()
        model = getattr(route, "model", None)
        if book is None or provider is None or not model:
            return None
        from pipeline.pricing import priced
        from pipeline.types import UsageDetails

        at = datetime.now(UTC)
        rates = []
        for usage in (UsageDetails(1_000_000, 0, 1_000_000), UsageDetails(0, 1_000_000, 1_000_000)):
            cost = priced(None, book, provider, model, usage, at=at, estimated=False)
            if cost is None:
                return None
            rates.append(cost.amount)
        return rates[0], rates[1]

    def _log_start(self) -> None:
        _logger.info(
            "gateway worker %d serving %s, environment %s: models %s; %s",
            os.getpid(),
            self.source or "a configuration given in code",
            self.config.environment or "(none)",
            ", ".join(self.models),
            f"{len(self.keys)} API key(s) from {self.settings.api_keys_env}"
            if self.keys
            else "no API keys",
        )
        if self.governance.ring is not None:
            _logger.info("virtual keys on: %d key(s) known", len(self.governance.ring))
        elif not self.keys:
            _logger.warning(
                "no API keys configured ([gateway] api_keys_env): every caller is served; "
                "limits apply per client address"
            )

    async def stop(self, grace: float = 10.0) -> None:
        """Close everything; requests still running (the server cancelled those past its
        drain timeout) get `grace` seconds to finish writing their last event first."""
        self.ready = False
        if self._frozen:
            self._frozen = False
            gc.unfreeze()
            _YOUNG_COLLECTIONS.worker_stopped()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                await self.wait_idle()
        await self._close()

    def enter(self) -> None:
        """A request of an inbound format starts (it is in flight until `leave`: its
        response written, or it failed)."""
        self._in_flight += 1

    def leave(self) -> None:
        self._in_flight -= 1
        if not self._in_flight and self._idle is not None:
            self._idle.set()
            self._idle = None

    async def wait_idle(self) -> None:
        """Return once no request of an inbound format is in flight in this worker."""
        if not self._in_flight:
            return
        if self._idle is None:
            self._idle = asyncio.Event()
        await self._idle.wait()

    async def _close(self) -> None:
        closers, self._closers = self._closers, []
        errors: list[Exception] = []
        stored = [self.stored_responses.aclose] if self.stored_responses is not None else []
        spend, self.spend = self.spend, None
        # The ledger last: what the pipelines' last requests spent is written (or spooled).
        last = [spend.aclose] if spend is not None else []
        for close in [*closers, *(r.aclose for r in self._redis.values()), *stored, *last]:
            try:
                await close()
            except Exception as exc:  # close the others, then report every failure
                errors.append(exc)
        self._redis = {}
        try:
            await self.governance.aclose()
        except Exception as exc:
            errors.append(exc)
        if errors:
            raise ExceptionGroup("closing the gateway's clients failed", errors)

    def _readiness_clients(self) -> dict[str, Any]:
        """A Redis client per Redis the configuration names, by key path (never the URL)."""
        variables: dict[str, str] = {}
        if self.settings.redis_url_env:
            variables["gateway"] = self.settings.redis_url_env
        for name, route in self.config.routes.items():
            breaker = route.breaker
            if breaker is not None and breaker.redis_url_env:
                variables[f"routes.{name}.breaker"] = breaker.redis_url_env
        affinity = self.config.router.affinity if self.config.router is not None else None
        if affinity is not None and affinity.redis_url_env:
            variables["router.affinity"] = affinity.redis_url_env
        from pipeline import _redis

        timeout = self.settings.readiness_timeout
        return {
            where: _redis.RedisClient(os.environ[variable], timeout=timeout)
            for where, variable in variables.items()
        }

    async def readiness(self) -> tuple[bool, dict[str, str]]:
        """Whether this worker is ready, and each check's result (``ok`` or why not)."""
        checks = {"pipeline": "ok" if self.ready else "not started"}

        async def ping(where: str, client: Any) -> None:
            checks[f"redis:{where}"] = await client.ping()  # "ok" or "unavailable (...)"

        await asyncio.gather(*(ping(where, c) for where, c in self._redis.items()))
        return all(value == "ok" for value in checks.values()), checks


def _with_forwarding(targets: dict[str, Target], *, caches: bool) -> dict[str, Target]:
    """`targets` with what forwards and caches: the clients below layers that keep the
    providers' answers whole (in every target) are told to forward (`pipeline._forward`)."""
    forwarding = forwarding_clients(target.client for target in targets.values())
    for client in forwarding:
        client.forwarding = True
    allowed = {id(client) for client in forwarding}
    return {
        name: dataclasses.replace(
            target,
            forwards=any(id(c) in allowed for c in forwarding_clients([target.client])),
            caches=caches,
        )
        for name, target in targets.items()
    }


def _stored_responses(
    settings: GatewaySettings, store: ResponseStore | None
) -> StoredResponses | None:
    """The stored responses a worker serves: over `store`, else the one ``[gateway]
    responses_store`` names (None for ``"none"``)."""
    if store is None:
        if settings.responses_store == "none":
            return None
        ttl, max_bytes = settings.responses_ttl, settings.responses_max_bytes
        max_count = settings.responses_max_count
        if settings.responses_store == "redis":
            url = os.environ[settings.redis_url_env or ""]  # checked when the file was loaded
            store = RedisResponseStore(
                url,
                ttl=ttl,
                max_bytes=max_bytes,
                max_count=max_count,
                timeout=settings.responses_timeout,
            )
        else:
            store = MemoryResponseStore(ttl=ttl, max_bytes=max_bytes, max_count=max_count)
    return StoredResponses(store, timeout=settings.responses_timeout)


class _Endpoint:
    """One endpoint's layers (see the module docstring), folded into one call per request:
    the request's `Exchange` (its id, current for log lines) counted in flight until its
    response is written; its telemetry; its caller's key (a virtual key only when
    `virtual`); its body (when `body` reads one) and a slot of the caller's (with a limit),
    then `app`, the handler."""

    __slots__ = ("_auth", "_body", "_format", "_gateway", "_slots", "_telemetry", "app")

    def __init__(
        self,
        app: ASGIApp,
        *,
        gateway: Gateway,
        format: InboundFormat,
        route: str,
        body: BodyReader | None = None,
        slots: Slots | None = None,
        virtual: bool = True,
    ) -> None:
        self.app = app
        self._gateway = gateway
        self._format = format
        self._telemetry = RequestTelemetry(
            route=route,
            tracer_provider=gateway.tracer_provider,
            meter_provider=gateway.meter_provider,
        )
        self._auth = Authenticator(
            keys=gateway.keys,
            x_api_key=format.x_api_key,
            ring=gateway.governance.ring if virtual else None,
        )
        self._body = body
        self._slots = slots if slots is not None and slots.limit is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = Exchange(scope, send, self._format)
        scope[EXCHANGE] = exchange
        gateway = self._gateway
        gateway.enter()
        token = enter_request_id(exchange.request_id)
        telemetry = self._telemetry
        traced = telemetry.begin(exchange, scope)
        try:
            error = self._auth.admit(exchange)
            if error is not None:  # 401, before the body is read
                exchange.failure = error
                await exchange.error(error)
                return
            body = self._body
            if body is not None and await body.read(exchange, scope, receive) is None:
                return  # answered, or the client left
            slots = self._slots
            if slots is None:
                await self.app(scope, receive, send)
                return
            try:
                caller = slots.take(exchange, scope)  # once the body arrived
            except WireError as refused:
                exchange.failure = refused
                await exchange.error(refused)
                return
            try:
                await self.app(scope, receive, send)
            finally:
                slots.give_back(caller)
        finally:
            telemetry.end(traced, exchange, scope)
            exit_request_id(token)
            # The scope and its exchange refer to each other: parted, what the request made
            # is freed as it ends instead of left to the cyclic collector.
            del scope[EXCHANGE]
            gateway.leave()


class _FormatEndpoints:
    """Sends the requests of the inbound formats' paths to their stacks, the stored
    responses' paths (``/v1/responses/{id}`` and ``.../input_items``) to theirs, and
    everything else on (to the plain endpoints)."""

    __slots__ = ("_endpoints", "_stored", "app")

    def __init__(
        self,
        app: ASGIApp,
        *,
        endpoints: dict[str, ASGIApp],
        stored: tuple[ASGIApp, ASGIApp] | None = None,
    ) -> None:
        self.app = app
        self._endpoints = endpoints
        self._stored = stored

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = self._endpoints.get(path)
        if endpoint is None and self._stored is not None and path.startswith(STORED_RESPONSES_PATH):
            one, items = self._stored
            endpoint = items if path.endswith("/input_items") else one
        await (endpoint or self.app)(scope, receive, send)


def _format_endpoint(
    gateway: Gateway, format: InboundFormat, slots: Slots, handler: ASGIApp | None = None
) -> ASGIApp:
    """The endpoint of one inbound format (see the module docstring) around its handler
    (the pipeline call, unless given)."""
    settings = gateway.settings
    inner: ASGIApp
    if handler is None:
        hooks: AnswerHooks | None = None
        if format is RESPONSES:
            stored = gateway.stored_responses
            hooks = stored if stored is not None else NoStoredResponses()
        forwarder = CHAT_FORWARDER if format is CHAT_COMPLETIONS else None
        inner = FormatHandler(gateway, format, hooks, forwarder)
        governance = gateway.governance
        if governance.active:
            inner = GovernanceMiddleware(inner, governance=governance, path=format.path)
    else:
        inner = handler
    body = BodyReader(max_body_bytes=settings.max_body_bytes, builtin_tools=settings.builtin_tools)
    return _Endpoint(
        inner, gateway=gateway, format=format, route=format.path, body=body, slots=slots
    )


def _stored_endpoint(gateway: Gateway, route: str) -> ASGIApp:
    """The endpoint of one stored responses' path: request id, telemetry, auth (the
    caller's key is the partition; virtual keys are not taken here), then the store."""
    endpoint = StoredResponseEndpoint(gateway.stored_responses)
    return _Endpoint(endpoint, gateway=gateway, format=RESPONSES, route=route, virtual=False)


def create_app(
    config: PipelineConfig,
    *,
    tracer_provider: TracerProvider | None = None,
    meter_provider: MeterProvider | None = None,
    on_shutdown: Callable[[], None] | None = None,
    prometheus_registry: CollectorRegistry | None = None,
    prometheus_close: bool = False,
    source: str | None = None,
    formats: Sequence[InboundFormat] = FORMATS,
    response_store: ResponseStore | None = None,
) -> Starlette:
    """The gateway for `config` as an ASGI app (its lifespan builds and closes the
    pipeline). `on_shutdown` runs last, after every client closed (e.g. to flush
    telemetry).

    With ``[gateway] prometheus_metrics``, ``GET /metrics`` serves `prometheus_registry`,
    which a `PrometheusMetricReader` of `meter_provider` fills; without a meter provider
    the app makes one with such a reader (and shuts it down when it stops).
    `prometheus_close` answers ``/metrics`` with ``connection: close`` (so that, with
    several workers, each scrape may reach another one). `source` names where the
    configuration came from, for the startup log line. `response_store` keeps the Responses
    API's stored responses instead of the store ``[gateway] responses_store`` names."""
    settings = config.gateway or GatewaySettings()
    owned_meters = None
    if settings.prometheus_metrics and prometheus_registry is None:
        if meter_provider is not None:
            raise ValueError(
                "prometheus_metrics with a meter_provider of yours needs the "
                "prometheus_registry its PrometheusMetricReader fills"
            )
        from opentelemetry.sdk.metrics import MeterProvider as SDKMeterProvider

        reader, prometheus_registry = prometheus_reader()
        meter_provider = owned_meters = SDKMeterProvider(metric_readers=[reader])
    gateway = Gateway(
        config,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        source=source,
        response_store=response_store,
    )
    slots = Slots(settings.max_concurrent_per_key, settings.retry_after)
    stacks = {format.path: _format_endpoint(gateway, format, slots) for format in formats}
    if MESSAGES in formats:
        stacks[COUNT_TOKENS.path] = _format_endpoint(
            gateway, COUNT_TOKENS, slots, CountTokensHandler(gateway)
        )
    stored = None
    if RESPONSES in formats:
        one = f"{STORED_RESPONSES_PATH}{{response_id}}"
        stored = (_stored_endpoint(gateway, one), _stored_endpoint(gateway, f"{one}/input_items"))
    endpoints = Endpoints(
        gateway,
        registry=prometheus_registry if settings.prometheus_metrics else None,
        close=prometheus_close,
    )

    def keyed(endpoint: Callable[..., Awaitable[Any]]) -> ASGIApp:
        # /v1/models takes keys as the formats do (Anthropic clients send x-api-key).
        return AuthMiddleware(
            request_response(endpoint),
            keys=gateway.keys,
            x_api_key=True,
            ring=gateway.governance.ring,
        )

    routes = [
        Route("/v1/models", keyed(endpoints.models), methods=["GET"]),
        Route("/v1/models/{model:path}", keyed(endpoints.model), methods=["GET"]),
        Route("/healthz", endpoints.healthz, methods=["GET"]),
        Route("/readyz", endpoints.readyz, methods=["GET"]),
    ]
    if settings.prometheus_metrics:
        routes.append(Route("/metrics", endpoints.metrics, methods=["GET"]))
    if settings.admin_key_env is not None and config.spend is not None:
        routes.append(Route("/admin/spend", endpoints.spend, methods=["GET"]))
    if settings.admin_key_env is not None and gateway.governance.store is not None:
        admin = KeysAdmin(gateway.governance, gateway.admin_key)
        routes += [
            Route("/admin/keys", admin.handle, methods=["GET", "POST"]),
            Route("/admin/keys/{ref}", admin.handle, methods=["GET", "PATCH"]),
            Route("/admin/keys/{ref}/{action:str}", admin.handle, methods=["POST"]),
        ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            try:
                await gateway.stop()
            finally:
                if owned_meters is not None:
                    owned_meters.shutdown()
                if on_shutdown is not None:
                    on_shutdown()

    app = _GatewayApp(
        stacks,
        routes=routes,
        middleware=[
            Middleware(_FormatEndpoints, endpoints=stacks, stored=stored),
            Middleware(RequestIdMiddleware),
        ],
        exception_handlers={404: endpoints.not_found, 405: endpoints.not_found},
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    return app


class _GatewayApp(Starlette):
    """The Starlette app, with the inbound formats' paths sent straight to their stacks:
    those handle every failure of theirs (Starlette's error layer would only wrap each
    request and its every ``send`` in one more call)."""

    def __init__(self, formats: dict[str, ASGIApp], **options: Any) -> None:
        super().__init__(**options)
        self._formats = formats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A coroutine function: servers tell ASGI 3 apps from ASGI 2 ones by that.
        if scope["type"] == "http":
            endpoint = self._formats.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
