"""The gateway's ASGI app: a configured pipeline behind the OpenAI Chat Completions API.

`create_app(config)` returns a Starlette app; its lifespan builds the pipeline (and a
client per route exposed by name) once, when the worker starts, and closes them when it
stops. Endpoints:

* ``POST /v1/chat/completions``: non-streaming and streaming (SSE) answers, tools, usage;
* ``GET /v1/models``: the model names `[gateway] models` exposes;
* ``GET /healthz``: the process answers; ``GET /readyz``: the pipeline is built and every
  Redis the configuration names answers a PING within ``readiness_timeout``.

Promises of the chat endpoint, streaming or not:

* authentication: with ``api_keys_env``, ``Authorization: Bearer KEY`` must hold one of the
  keys (compared in constant time); anything else is 401 with no detail. The key itself is
  never logged: a key is known by its position in the list;
* limits: a body over ``max_body_bytes`` is 413 (refused from ``Content-Length`` before it
  is read, or as soon as it grows past the limit); one request more than
  ``max_concurrent_per_key`` in flight for a key is 429 with ``Retry-After``;
* a failure before any output is an HTTP error with the OpenAI error body (see
  `pipeline.gateway.wire.error_for`): a stream's status line is sent only once the
  pipeline produced its first update, so whatever the router did before that (failover
  included) is invisible to the client, and a failure is a real status;
* a failure after output reached the client is an in-band ``error`` event, then the end of
  the stream, without ``[DONE]``: never a silent truncation;
* a client that disconnects cancels its request: the pipeline's attempt ends
  ``canceled`` (never failed over), the upstream stream is closed;
* a request cancelled by the server (shutdown past ``drain_timeout``) ends with a 503, or
  with an in-band error when its stream had started;
* an incoming ``traceparent``/``tracestate`` continues the caller's trace: the gateway's
  SERVER span is the parent of the pipeline's spans;
* no prompt, response, tool argument or key reaches a log line or a span.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.semconv.attributes.http_attributes import (
    HTTP_REQUEST_METHOD,
    HTTP_RESPONSE_STATUS_CODE,
    HTTP_ROUTE,
)
from opentelemetry.semconv.attributes.network_attributes import NETWORK_PROTOCOL_VERSION
from opentelemetry.semconv.attributes.server_attributes import SERVER_ADDRESS, SERVER_PORT
from opentelemetry.semconv.attributes.url_attributes import URL_PATH, URL_SCHEME
from opentelemetry.semconv.metrics.http_metrics import HTTP_SERVER_REQUEST_DURATION
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pipeline._genai import ERROR_STATUS
from pipeline._semconv import CLIENT_DISCONNECTED, GATEWAY_MODEL, GATEWAY_SCOPE, meter, tracer
from pipeline.client import ChatClient
from pipeline.errors import ConfigError
from pipeline.gateway.settings import PIPELINE_MODEL, GatewaySettings, api_keys
from pipeline.gateway.wire import (
    ChatRequest,
    ChunkEncoder,
    WireError,
    completion,
    error_body,
    error_for,
    new_id,
    now,
    parse_request,
)
from pipeline.types import ChatMessage

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

    from pipeline.config import PipelineConfig

__all__ = ["CHAT_ROUTE", "SESSION_HEADER", "Gateway", "create_app"]

CHAT_ROUTE = "/v1/chat/completions"
SESSION_HEADER = "x-session-id"
"""The request header carrying the session id (session affinity keeps its route)."""

_logger = logging.getLogger("chat_pipeline.gateway")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = [(b"content-type", b"application/json")]
_SSE = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # Proxies (nginx) must pass each event on as it comes, not buffer the stream.
    (b"x-accel-buffering", b"no"),
]
_NO_KEY = -1  # the key label of an unauthenticated gateway


@dataclass(frozen=True, slots=True)
class _Target:
    """What a model name serves: the pipeline, or one route (with its instructions)."""

    client: ChatClient
    instructions: str | None = None


class _Disconnect:
    """Watches the connection while a request runs: a client that goes away cancels the
    task serving it (so the pipeline sees its caller cancelled, never a failure)."""

    __slots__ = ("_watch", "disconnected", "done")

    def __init__(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        self.disconnected = False
        self.done = False  # set before the last write: the end of a response is no disconnect
        self._watch = asyncio.ensure_future(self._run(receive, task))

    async def _run(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self.done:
                    self.disconnected = True
                    task.cancel()
                return

    def close(self) -> None:
        self.done = True
        self._watch.cancel()


class _Responder:
    """The response of one request: whether its head was sent, and the status sent."""

    __slots__ = ("send", "started", "status")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False
        self.status = 0

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def whole(
        self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = _JSON
    ) -> None:
        await self.start(status, [*headers, (b"content-length", str(len(body)).encode())])
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def error(self, error: WireError) -> None:
        headers = [*_JSON, *error.headers()]
        if error.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await self.whole(error.status, error.body(), headers)


class Gateway:
    """One worker's gateway: the clients it serves, its keys, limits and telemetry.

    `start()` builds the pipeline and the exposed routes' clients (once per worker);
    `stop()` waits (briefly) for requests still finishing, then closes every client.
    Code tools cannot run in a server, so a configuration that turns
    ``layers.function_invocation`` on is refused: clients declare their tools and run them.
    """

    def __init__(
        self,
        config: PipelineConfig,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
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
        self._keys = keys
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self._tracer = tracer(GATEWAY_SCOPE, tracer_provider)
        self._duration = meter(GATEWAY_SCOPE, meter_provider).create_histogram(
            HTTP_SERVER_REQUEST_DURATION, unit="s", description="Duration of HTTP server requests"
        )
        self._targets: dict[str, _Target] = {}
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._redis: dict[str, Any] = {}
        self._in_flight: dict[int, int] = {}
        self._requests: set[asyncio.Task[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.started_at = now()
        self.ready = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Build what the exposed models serve (the pipeline once, each named route once)."""
        from pipeline.builder import ChatPipeline

        config = self.config
        tracer_provider, meter_provider = self._tracer_provider, self._meter_provider
        built: dict[str, _Target] = {}
        try:
            for target in dict.fromkeys(self.models.values()):
                if target == PIPELINE_MODEL:
                    pipeline = config.build(
                        tracer_provider=tracer_provider, meter_provider=meter_provider
                    )
                    built[target] = _Target(pipeline)
                    self._closers.append(pipeline.aclose)
                    continue
                route = config.build_route(target)
                # A route called by name gets the file's telemetry and logging layers too.
                client = (
                    ChatPipeline.builder(
                        tracer_provider=tracer_provider, meter_provider=meter_provider
                    )
                    .use_telemetry(enabled=config.layers.telemetry)
                    .use_logging(enabled=config.layers.logging)
                    .build(route.client, name=route.name)
                )
                built[target] = _Target(client, route.instructions)
                self._closers.append(client.aclose)
            self._targets = {model: built[target] for model, target in self.models.items()}
            self._redis = self._readiness_clients()
        except BaseException:
            await self._close()
            raise
        self.ready = True

    async def stop(self, grace: float = 10.0) -> None:
        """Close everything; requests still running (the server cancelled those past its
        drain timeout) get `grace` seconds to finish writing their last event first."""
        self.ready = False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                await self.wait_idle()
        await self._close()

    async def wait_idle(self) -> None:
        """Return once no chat request is in flight in this worker."""
        await self._idle.wait()

    async def _close(self) -> None:
        closers, self._closers = self._closers, []
        errors: list[Exception] = []
        for close in [*closers, *(r.aclose for r in self._redis.values())]:
            try:
                await close()
            except Exception as exc:  # close the others, then report every failure
                errors.append(exc)
        self._redis = {}
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

    # -- the chat endpoint -------------------------------------------------------------------

    def _authenticate(self, header: bytes | None) -> int:
        """The position of the caller's key (or `_NO_KEY` without keys); 401 otherwise."""
        if not self._keys:
            return _NO_KEY
        token = b""
        if header is not None and header[:7].lower() == b"bearer ":
            token = header[7:].strip()
        found = _NO_KEY
        # Every key is compared, each in constant time: the time taken tells nothing about
        # which key (or how much of one) matched.
        for index, key in enumerate(self._keys):
            if hmac.compare_digest(key, token) and found == _NO_KEY:
                found = index
        if found == _NO_KEY or not token:
            raise WireError(
                401,
                "missing or invalid API key",
                type="invalid_request_error",
                code="invalid_api_key",
            )
        return found

    def _acquire(self, key: int) -> None:
        limit = self.settings.max_concurrent_per_key
        count = self._in_flight.get(key, 0)
        if limit is not None and count >= limit:
            raise WireError(
                429,
                "too many requests in flight for this API key; retry later",
                type="rate_limit_error",
                code="concurrency_limit_exceeded",
                retry_after=self.settings.retry_after,
            )
        self._in_flight[key] = count + 1

    def _release(self, key: int) -> None:
        count = self._in_flight[key] - 1
        if count:
            self._in_flight[key] = count
        else:
            del self._in_flight[key]

    async def chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ``/v1/chat/completions`` request (see the module docstring)."""
        started = time.perf_counter()
        authorization = length = session = None
        carrier: dict[str, str] = {}
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"content-length":
                length = value
            elif name == b"x-session-id":
                session = value.decode("latin-1")
            elif name in (b"traceparent", b"tracestate", b"baggage"):
                carrier[name.decode()] = value.decode("latin-1")
        method = scope["method"]
        parent = propagate.extract(carrier) if carrier else None
        span = self._tracer.start_span(
            f"{method} {CHAT_ROUTE}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=_span_attributes(scope, method),
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        task = asyncio.current_task()
        assert task is not None
        self._requests.add(task)
        self._idle.clear()
        responder = _Responder(send)
        watch: _Disconnect | None = None
        key: int | None = None
        failure: BaseException | None = None
        try:
            if method != "POST":
                raise WireError(405, "use POST", code="method_not_allowed")
            key = self._authenticate(authorization)
            self._acquire(key)
            try:
                body = await _read_body(receive, length, self.settings.max_body_bytes)
                if body is None:
                    return  # the client left before sending its request
                request = parse_request(body, session_id=session)
                target = self._targets.get(request.model)
                if target is None:
                    raise WireError(
                        404,
                        "the model does not exist here; GET /v1/models lists the models",
                        param="model",
                        code="model_not_found",
                    )
                if span.is_recording():
                    span.set_attribute(GATEWAY_MODEL, request.model)
                watch = _Disconnect(receive, task)
                if request.stream:
                    failure = await self._stream(request, target, responder, watch)
                else:
                    failure = await self._complete(request, target, responder, watch)
            finally:
                self._release(key)
        except WireError as exc:
            failure = exc
            if responder.started:
                raise  # pragma: no cover - every WireError is raised before the response
            await responder.error(exc)
        except asyncio.CancelledError as exc:
            if task.cancelling() == 0:
                # A client's stray CancelledError, not this request being cancelled: a
                # failure of the pipeline like any other.
                failure = exc
                await self._unfinished(responder, error_for(exc, self.settings.retry_after))
                return
            if watch is not None and watch.disconnected:
                # The client went away: the pipeline saw its caller cancelled (its attempt
                # ended `canceled`, the upstream stream closed). Nothing is left to answer.
                if task.uncancel() == 0:
                    return
                raise
            # The server cancelled the request (shutdown past the drain timeout): say so.
            if task.uncancel() != 0:
                raise
            failure = WireError(
                503,
                "the gateway is shutting down; retry",
                type="server_error",
                code="shutting_down",
                retry_after=self.settings.retry_after,
            )
            await self._unfinished(responder, failure)
        except Exception as exc:
            # A bug of ours (the pipeline's failures were mapped where they happened).
            failure = exc
            _logger.error("%s %s failed: %s", method, CHAT_ROUTE, type(exc).__name__, exc_info=exc)
            await self._unfinished(
                responder, WireError(500, "internal error", type="server_error", code=None)
            )
        finally:
            if watch is not None:
                watch.close()
            self._requests.discard(task)
            if not self._requests:
                self._idle.set()
            otel_context.detach(token)
            disconnected = watch is not None and watch.disconnected
            self._finish_span(span, responder.status, failure, started, method, key, disconnected)

    async def _unfinished(self, responder: _Responder, error: WireError) -> None:
        """End a response that could not complete: a status, or an in-band error."""
        if not responder.started:
            await responder.error(error)
            return
        data = ChunkEncoder.error(error).encode()
        await responder.send({"type": "http.response.body", "body": data, "more_body": False})

    def _messages(self, request: ChatRequest, target: _Target) -> list[ChatMessage]:
        if target.instructions is None:
            return request.messages
        from middleware.routing.context import with_instructions

        return with_instructions(request.messages, target.instructions)

    async def _complete(
        self, request: ChatRequest, target: _Target, responder: _Responder, watch: _Disconnect
    ) -> BaseException | None:
        try:
            response = await target.client.get_response(
                self._messages(request, target), request.options
            )
        except Exception as exc:
            error = error_for(exc, self.settings.retry_after)
            watch.done = True
            await responder.error(error)
            return exc
        body = completion(response, model=request.model, response_id=new_id(), created=now())
        watch.done = True
        await responder.whole(200, body)
        return None

    async def _stream(
        self, request: ChatRequest, target: _Target, responder: _Responder, watch: _Disconnect
    ) -> BaseException | None:
        stream = target.client.get_streaming_response(
            self._messages(request, target), request.options
        )
        send = responder.send
        try:
            # The status line waits for the first update: until then the router may still
            # fail over, and a failure is a real HTTP status.
            try:
                first = await anext(stream)
            except StopAsyncIteration:
                first = None
            except Exception as exc:
                error = error_for(exc, self.settings.retry_after)
                watch.done = True
                await responder.error(error)
                return exc
            encoder = ChunkEncoder(
                model=(first.model_id if first is not None else None) or request.model,
                response_id=new_id(),
                created=now(),
                include_usage=request.include_usage,
            )
            await responder.start(200, _SSE)
            if first is not None:
                data = encoder.update(first)
                if data:
                    await send(
                        {"type": "http.response.body", "body": data.encode(), "more_body": True}
                    )
                async for update in stream:
                    data = encoder.update(update)
                    if data:
                        await send(
                            {"type": "http.response.body", "body": data.encode(), "more_body": True}
                        )
            watch.done = True
            await send(
                {"type": "http.response.body", "body": encoder.end().encode(), "more_body": False}
            )
            return None
        except Exception as exc:
            # Output reached the client: the failure is told in-band, then the stream ends.
            error = error_for(exc, self.settings.retry_after)
            watch.done = True
            await send(
                {
                    "type": "http.response.body",
                    "body": ChunkEncoder.error(error).encode(),
                    "more_body": False,
                }
            )
            return exc
        finally:
            await stream.aclose()

    def _finish_span(
        self,
        span: trace.Span,
        status: int,
        failure: BaseException | None,
        started: float,
        method: str,
        key: int | None,
        disconnected: bool,
    ) -> None:
        attributes: dict[str, Any] = {HTTP_REQUEST_METHOD: method, HTTP_ROUTE: CHAT_ROUTE}
        if status:
            attributes[HTTP_RESPONSE_STATUS_CODE] = status
        error_type = None
        if status >= 500 or (status == 200 and failure is not None):
            error_type = type(failure).__name__ if failure is not None else str(status)
        if error_type is not None:
            attributes[ERROR_TYPE] = error_type
        self._duration.record(time.perf_counter() - started, attributes)
        if span.is_recording():
            if disconnected:
                # The client's choice, never an error: the request was cancelled.
                span.set_attribute(CLIENT_DISCONNECTED, True)
            if status:
                span.set_attribute(HTTP_RESPONSE_STATUS_CODE, status)
            if error_type is not None:
                span.set_attribute(ERROR_TYPE, error_type)
                span.set_status(ERROR_STATUS)
        span.end()
        if failure is not None and not disconnected:
            # A failure of the service (5xx, or a stream cut after output) is a warning; a
            # request refused for what it asked (4xx) is information.
            level = logging.WARNING if status >= 500 or status == 200 else logging.INFO
            _logger.log(
                level,
                "%s %s -> %s (%s, key #%s)",
                method,
                CHAT_ROUTE,
                status or "-",
                type(failure).__name__,
                "-" if key is None or key == _NO_KEY else key,
            )
        elif _logger.isEnabledFor(logging.DEBUG):
            _logger.debug("%s %s -> %s", method, CHAT_ROUTE, status or "-")


class _ChatEndpoint:
    """The chat endpoint as a plain ASGI app (it streams, and watches the connection)."""

    __slots__ = ("_gateway",)

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._gateway.chat(scope, receive, send)


def _span_attributes(scope: Scope, method: str) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        HTTP_REQUEST_METHOD: method,
        HTTP_ROUTE: CHAT_ROUTE,
        URL_PATH: CHAT_ROUTE,
        URL_SCHEME: scope.get("scheme", "http"),
        NETWORK_PROTOCOL_VERSION: scope.get("http_version", "1.1"),
    }
    server = scope.get("server")
    if server:
        attributes[SERVER_ADDRESS] = server[0]
        if server[1] is not None:
            attributes[SERVER_PORT] = server[1]
    return attributes


async def _read_body(receive: Receive, length: bytes | None, limit: int) -> bytes | None:
    """The request body (None when the client left), refused past `limit` bytes."""
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise WireError(400, "invalid Content-Length", code="invalid_request") from None
        if declared > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _too_large(limit: int) -> WireError:
    return WireError(
        413, f"the request body is larger than {limit} bytes", code="request_too_large"
    )


def create_app(
    config: PipelineConfig,
    *,
    tracer_provider: TracerProvider | None = None,
    meter_provider: MeterProvider | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> Starlette:
    """The gateway for `config` as an ASGI app (its lifespan builds and closes the
    pipeline). `on_shutdown` runs last, after every client closed (e.g. to flush
    telemetry)."""
    gateway = Gateway(config, tracer_provider=tracer_provider, meter_provider=meter_provider)

    async def models(request: Request) -> Response:
        try:
            gateway._authenticate(request.headers.get("authorization", "").encode("latin-1"))
        except WireError as exc:
            return Response(
                exc.body(),
                exc.status,
                {"www-authenticate": "Bearer"},
                media_type="application/json",
            )
        data = [
            {
                "id": name,
                "object": "model",
                "created": gateway.started_at,
                "owned_by": "chat-pipeline",
            }
            for name in gateway.models
        ]
        return JSONResponse({"object": "list", "data": data})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ready, checks = await gateway.readiness()
        return JSONResponse(
            {"status": "ready" if ready else "not ready", "checks": checks},
            200 if ready else 503,
        )

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        code = "method_not_allowed" if status == 405 else "not_found"
        message = "method not allowed" if status == 405 else "no such endpoint"
        return Response(
            error_body(message, "invalid_request_error", code),
            status,
            media_type="application/json",
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            try:
                await gateway.stop()
            finally:
                if on_shutdown is not None:
                    on_shutdown()

    app = Starlette(
        routes=[
            Route(CHAT_ROUTE, _ChatEndpoint(gateway)),
            Route("/v1/models", models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
        ],
        exception_handlers={404: not_found, 405: not_found},
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    return app
