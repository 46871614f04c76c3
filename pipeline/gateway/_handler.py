"""The innermost layer of an inbound format's endpoint: the pipeline call itself.

An inbound format (`InboundFormat`: Chat Completions, `pipeline.gateway._chat_completions`;
OpenAI Responses, `pipeline.gateway._responses`; Anthropic Messages,
`pipeline.gateway._anthropic_messages`) says how a body becomes a `ChatRequest` and how an
answer, a stream and an error are written. `FormatHandler` runs
one request of any format on the configured pipeline, with the promises every format
shares:

* a stream's status line is sent only once the pipeline produced its first update, so
  whatever the router did before that (failover included) is invisible to the client, and
  a failure before output is a real HTTP status;
* a failure after output reached the client is the format's in-band error event, then the
  end of the stream: never a silent truncation;
* a client that disconnects cancels its request: the pipeline's attempt ends ``canceled``
  (never failed over), the upstream stream is closed;
* a request cancelled by the server (shutdown past ``drain_timeout``) ends with a 503, or
  with an in-band error when its stream had started;
* the routing story (served route, attempts, fallback, served model, response id) is left
  on the `Exchange` for the server span and the log line;
* with ``[spend]``, the request's `AttemptLog` (`pipeline._scope`) is open while it runs,
  with whose request it is (`attribution`), and left on the `Exchange` (``attempts``);
* with a `Forwarder` (the format's forwarded path, `pipeline._forward`), a request whose
  body may go as it came is forwarded by the routes that can, and their own answers are
  written back (`pipeline.gateway._forwarding`).

Authentication, the body, limits, request ids and telemetry are the layers around it
(`pipeline.gateway.app` assembles them): a new format adds a module with its
`InboundFormat` and is listed in `pipeline.gateway.app.FORMATS`.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any, Protocol

from pipeline import _scope
from pipeline._cache_scope import CacheReport, enter_cache_report, exit_cache_report
from pipeline._forward import Forward, enter_forward, exit_forward
from pipeline._scope import RouteReport
from pipeline.gateway._exchange import EXCHANGE, Exchange, Receive, Scope, Send, loggable
from pipeline.gateway._shared import ON_DISCONNECT, Forwarder, InboundFormat, StreamEncoder
from pipeline.gateway._shared import GatewayState as Gateway
from pipeline.gateway._shared import ServedTarget as Target
from pipeline.gateway.wire import ChatRequest, WireError, error_for, now
from pipeline.spend import Attribution
from pipeline.types import ANTHROPIC_EXTRAS, CacheMode, ChatMessage

__all__ = ["AnswerHooks", "FormatHandler", "InboundFormat", "StreamEncoder", "attribution"]

_logger = logging.getLogger("chat_pipeline.gateway")


def _pass_betas(request: ChatRequest, header: bytes) -> None:
    """The caller's ``anthropic-beta`` values go to Anthropic routes (as the betas of
    `ANTHROPIC_EXTRAS`: the features its Messages fields use may need them), and nowhere
    else."""
    betas = [b.strip() for b in header.decode("latin-1").split(",") if b.strip()]
    if betas:
        extras = request.options.additional_properties
        scoped = extras.get(ANTHROPIC_EXTRAS)
        extras[ANTHROPIC_EXTRAS] = {**(scoped if isinstance(scoped, dict) else {}), "betas": betas}


class AnswerHooks(Protocol):
    """What a format's handler does around the pipeline call besides answering (the
    Responses format's stored responses: `pipeline.gateway._stored_responses`)."""

    async def before(self, exchange: Exchange, request: ChatRequest) -> None:
        """Before the pipeline is called: complete the request, or refuse it
        (`WireError`)."""

    async def after(self, exchange: Exchange, request: ChatRequest) -> None:
        """Once the whole answer is encoded, before its last bytes are sent (so a client
        that reads the end of an answer finds whatever this did done). Never raises."""


class _Disconnect:
    """Watches the connection while a request runs: a client that goes away cancels the
    task serving it (so the pipeline sees its caller cancelled, never a failure). The
    gateway's own connections call it when their client leaves (`ON_DISCONNECT`); under
    another server a task waits on ``receive`` for ``http.disconnect``."""

    __slots__ = ("_task", "_watch", "disconnected", "done")

    def __init__(self, scope: Scope, receive: Receive, task: asyncio.Task[Any]) -> None:
        self.disconnected = False
        self.done = False  # set before the last write: the end of a response is no disconnect
        self._task = task
        self._watch: asyncio.Future[None] | None = None
        if ON_DISCONNECT in scope:
            scope[ON_DISCONNECT] = self._left
        else:
            self._watch = asyncio.ensure_future(self._run(receive))

    def _left(self) -> None:
        if not self.done:
            self.disconnected = True
            self._task.cancel()

    async def _run(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._left()
                return

    def close(self) -> None:
        self.done = True
        watch = self._watch
        if watch is not None:
            # Let go of it: its cancellation's traceback holds `_run`'s frame, and so this
            # watcher, which would otherwise make a cycle only the collector frees.
            self._watch = None
            watch.cancel()


class _Started:
    """The encoder of a request's stream, once its status line went out: a failure after
    that ends the stream with the encoder's own error event (it may number its events)."""

    __slots__ = ("encoder",)

    def __init__(self) -> None:
        self.encoder: StreamEncoder | None = None


def _cache(exchange: Exchange, request: ChatRequest) -> Any:
    """The response cache's side of a request (`middleware.cache`): its partition (the
    caller's identity and the model asked for: entries never cross them; the user the
    request names, for a cache partitioned by user), the mode the
    ``cache-control`` request header asks for (``no-store``: bypass, ``no-cache``:
    refresh), and ``x-cache`` (``hit``, ``miss``, ``bypass``) with ``age`` on the response
    when a cache answered. Returns the token that ends the cache's report."""
    report = CacheReport(f"{exchange.key}\x00{request.model}", request.user)
    if request.options.cache is None:
        for name, value in exchange.scope["headers"]:
            if name == b"cache-control":
                directives = {part.strip().lower() for part in value.split(b",")}
                if b"no-store" in directives:
                    request.options.cache = CacheMode.BYPASS
                elif b"no-cache" in directives:
                    request.options.cache = CacheMode.REFRESH
    send = exchange.send

    async def send_with_cache(message: Any) -> None:
        result = report.result
        if result is not None and message["type"] == "http.response.start":
            headers = [*message.get("headers", ()), (b"x-cache", _X_CACHE[result])]
            if report.age is not None and result == "hit":
                headers.append((b"age", str(report.age).encode()))
            message["headers"] = headers
        await send(message)

    exchange.send = send_with_cache
    return enter_cache_report(report)


_X_CACHE = {"hit": b"hit", "miss": b"miss", "refresh": b"miss", "bypass": b"bypass"}


def _reached(exchange: Exchange) -> str | None:
    """The route a request reached: the router's last attempt's, else the one its model
    name serves (an error that names a route names this one)."""
    report = exchange.report
    if report is not None and report.route_name is not None:
        return report.route_name
    return exchange.route


def attribution(exchange: Exchange, request: ChatRequest, endpoint: str) -> Attribution:
    """Whose request it is, for the spend ledger: the caller's key (its id and name when it
    is a virtual key, its identity for an ``api_keys_env`` key; never the key), the body's
    ``user`` and ``metadata`` (``user``/``user_id``, ``team``, ``tags``, ``session``), the
    ``x-chat-pipeline-tags`` header, the endpoint's path and the session header. A virtual
    key's own team and user win over what the body says."""
    caller = request.caller or {}
    tags = [*(caller.get("tags") or "").split(",")]
    if exchange.tags:
        tags += exchange.tags.decode("latin-1").split(",")
    key_id = key_name = team = user = None
    virtual = exchange.virtual_key
    if virtual is not None:  # a virtual key: what it says of itself
        key_id = _text(getattr(virtual, "id", None))
        key_name = _text(getattr(virtual, "name", None))
        team = _text(getattr(virtual, "team", None))
        user = _text(getattr(virtual, "user", None))
    elif exchange.key:  # an api_keys_env key: its identity (a keyed hash), never its place
        key_id = exchange.key
        key_name = exchange.key_name
    return Attribution(
        key=key_id,
        key_name=key_name,
        user=user or caller.get("user") or caller.get("user_id") or request.user,
        team=team or caller.get("team"),
        tags=tuple(tags),
        endpoint=endpoint,
        session=exchange.session or caller.get("session") or caller.get("session_id"),
    )


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def _bytes(data: str | bytes) -> bytes:
    """What an encoder wrote, as the bytes to send (a forwarded stream writes bytes)."""
    return data.encode() if isinstance(data, str) else data


class FormatHandler:
    """Runs the request of one inbound format on the pipeline (see the module docstring).

    The layers outside it read and parsed the body (`Exchange.request`) and took the
    caller's slot. `hooks` run before the pipeline call and after a complete answer;
    `forwarder` is the format's forwarded path, if it has one."""

    __slots__ = ("format", "forwarder", "gateway", "hooks")

    def __init__(
        self,
        gateway: Gateway,
        format: InboundFormat,
        hooks: AnswerHooks | None = None,
        forwarder: Forwarder | None = None,
    ) -> None:
        self.gateway = gateway
        self.format = format
        self.hooks = hooks
        self.forwarder = forwarder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange: Exchange = scope[EXCHANGE]
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - ASGI servers run each request in a task
            raise RuntimeError("the gateway serves requests from inside an asyncio task")
        watch: _Disconnect | None = None
        cache_token: Any = None
        forward_token: Any = None
        forward: Forward | None = None
        started: _Started | None = None  # a stream's, once it runs
        report = RouteReport()
        exchange.report = report
        token = _scope.enter_report(report)
        request = exchange.request
        if request is None:  # pragma: no cover - the body layer runs first
            raise RuntimeError("the request's body was not read")
        log_token = None
        if self.gateway.spend is not None:
            # The request's priced attempts, with whose request it is, for the spend layer.
            log = exchange.attempts = _scope.AttemptLog(
                attribution=attribution(exchange, request, self.format.path),
                request_id=exchange.request_id,
            )
            log_token = _scope.enter_attempt_log(log)
        try:
            target = self.gateway.target(request.model)
            if target is None:
                raise WireError(
                    404,
                    "the model does not exist here; GET /v1/models lists the models",
                    param="model",
                    code="model_not_found",
                )
            exchange.route = target.route
            if self.hooks is not None:
                await self.hooks.before(exchange, request)
            if exchange.anthropic_beta is not None:
                _pass_betas(request, exchange.anthropic_beta)
            if target.caches:
                cache_token = _cache(exchange, request)
            if self.forwarder is not None and target.forwards and target.instructions is None:
                forward = self.forwarder.forward(request)
                if forward is not None:
                    forward_token = enter_forward(forward)
            watch = _Disconnect(scope, receive, task)
            if request.stream:
                started = _Started()
                exchange.failure = await self._stream(
                    exchange, request, target, watch, started, forward
                )
            else:
                exchange.failure = await self._complete(exchange, request, target, watch, forward)
        except WireError as exc:
            exchange.failure = exc
            if exchange.status:
                raise  # pragma: no cover - every WireError is raised before the response
            await exchange.error(exc)
        except asyncio.CancelledError as exc:
            if task.cancelling() == 0:
                # A client's stray CancelledError, not this request being cancelled: a
                # failure of the pipeline like any other.
                exchange.failure = exc
                await self._unfinished(
                    exchange, error_for(exc, self.gateway.settings.retry_after), started
                )
                return
            if watch is not None and watch.disconnected:
                # The client went away: the pipeline saw its caller cancelled (its attempt
                # ended `canceled`, the upstream stream closed). Nothing is left to answer.
                exchange.disconnected = True
                if task.uncancel() == 0:
                    return
                raise
            # The server cancelled the request (shutdown past the drain timeout): say so.
            if task.uncancel() != 0:
                raise
            error = WireError(
                503,
                "the gateway is shutting down; retry",
                type="server_error",
                code="shutting_down",
                retry_after=self.gateway.settings.retry_after,
            )
            exchange.failure = error
            await self._unfinished(exchange, error, started)
        except Exception as exc:
            # A bug of ours (the pipeline's failures were mapped where they happened).
            exchange.failure = exc
            _logger.error(
                "%s %s failed: %s (request %s)",
                exchange.scope["method"],
                self.format.path,
                type(exc).__name__,
                loggable(exchange.request_id),
                exc_info=exc,
            )
            await self._unfinished(
                exchange,
                WireError(500, "internal error", type="server_error", code=None),
                started,
            )
        finally:
            _scope.exit_report(token)
            if log_token is not None:
                _scope.exit_attempt_log(log_token)
            if cache_token is not None:
                exit_cache_report(cache_token)
            if forward_token is not None:
                exit_forward(forward_token)
            if watch is not None:
                watch.close()

    async def _unfinished(
        self, exchange: Exchange, error: WireError, started: _Started | None
    ) -> None:
        """End a response that could not complete: a status, or an in-band error (a body
        cut short by its end when it is no stream)."""
        if not exchange.status:
            await exchange.error(error)
            return
        encoder = started.encoder if started is not None else None
        event = encoder.error(error) if encoder is not None else ""
        await exchange.body_part(_bytes(event), False)

    @staticmethod
    def _messages(request: ChatRequest, target: Target) -> list[ChatMessage]:
        if target.instructions is None:
            return request.messages
        from middleware.routing.context import with_instructions

        return with_instructions(request.messages, target.instructions)

    async def _before_output(
        self, exchange: Exchange, watch: _Disconnect, exc: Exception
    ) -> BaseException:
        """Answer a failure before any output with its status (the route it reached named
        where the error names one); the request's failure."""
        error = error_for(exc, self.gateway.settings.retry_after, route=_reached(exchange))
        watch.done = True
        await exchange.error(error)
        return exc

    async def _complete(
        self,
        exchange: Exchange,
        request: ChatRequest,
        target: Target,
        watch: _Disconnect,
        forward: Forward | None,
    ) -> BaseException | None:
        try:
            response = await target.client.get_response(
                self._messages(request, target), request.options
            )
        except Exception as exc:
            return await self._before_output(exchange, watch, exc)
        response_id = exchange.response_id = self.format.new_response_id()
        exchange.response_model = response.model_id
        created = now()
        body = None
        raw = response.raw_representation
        if forward is not None and raw is not None and self.forwarder is not None:
            body = self.forwarder.completion(raw, request, response_id=response_id, created=created)
        if body is None:
            body = self.format.completion(
                response, request, response_id=response_id, created=created
            )
        if self.hooks is not None:
            await self.hooks.after(exchange, request)
        watch.done = True
        await exchange.whole(200, body)
        return None

    async def _stream(
        self,
        exchange: Exchange,
        request: ChatRequest,
        target: Target,
        watch: _Disconnect,
        started: _Started,
        forward: Forward | None,
    ) -> BaseException | None:
        try:
            stream = target.client.get_streaming_response(
                self._messages(request, target), request.options
            )
        except Exception as exc:
            # Refused before any stream began (the pipeline's own checks): a status, as a
            # failure before the first update is.
            return await self._before_output(exchange, watch, exc)
        send = exchange.send
        try:
            # The status line waits for the first update: until then the router may still
            # fail over, and a failure is a real HTTP status.
            try:
                first = await anext(stream)
            except StopAsyncIteration:
                first = None
            except Exception as exc:
                return await self._before_output(exchange, watch, exc)
            model = first.model_id if first is not None else None
            exchange.response_model = model
            response_id = exchange.response_id = self.format.new_response_id()
            created = now()
            encoder: StreamEncoder
            if forward is not None and self.forwarder is not None:
                # The format's own encoder only if an update comes unforwarded.
                encoder = self.forwarder.encoder(
                    partial(
                        self.format.encoder,
                        request,
                        model=model or request.model,
                        response_id=response_id,
                        created=created,
                    ),
                    request,
                    model=model or request.model,
                    response_id=response_id,
                    created=created,
                )
            else:
                encoder = self.format.encoder(
                    request, model=model or request.model, response_id=response_id, created=created
                )
            started.encoder = encoder
            await exchange.start(200, self.format.stream_headers)
            if first is not None:
                data = encoder.update(first)
                if data:
                    await send(
                        {"type": "http.response.body", "body": _bytes(data), "more_body": True}
                    )
                async for update in stream:
                    data = encoder.update(update)
                    if data:
                        await send(
                            {"type": "http.response.body", "body": _bytes(data), "more_body": True}
                        )
            end = _bytes(encoder.end())
            if self.hooks is not None:
                await self.hooks.after(exchange, request)
            watch.done = True
            await send({"type": "http.response.body", "body": end, "more_body": False})
            return None
        except Exception as exc:
            # Output reached the client: the failure is told in-band, then the stream ends.
            # It is one route's failure mid-answer, not every route's: asking again may help.
            error = error_for(exc, self.gateway.settings.retry_after, after_output=True)
            watch.done = True
            await send(
                {
                    "type": "http.response.body",
                    "body": _bytes(encoder.error(error)),
                    "more_body": False,
                }
            )
            return exc
        finally:
            await stream.aclose()
