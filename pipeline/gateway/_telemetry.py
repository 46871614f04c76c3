"""The telemetry layer of an inbound format's endpoint: the SERVER span, the HTTP duration
histogram and the request's log line.

* The span (``POST /v1/chat/completions``, HTTP semantic conventions) continues an incoming
  ``traceparent``/``tracestate`` and is the parent of the pipeline's spans; without one it
  is the trace's root. It carries the request id (``http.response.header.x-request-id``),
  the model asked for, and, once the request ended, the routing story a trace list shows:
  ``chat_pipeline.route.name`` (the route that served, or the last one tried),
  ``chat_pipeline.route.attempts``, ``chat_pipeline.route.fallback``, the served model as
  ``gen_ai.response.model``, the response id as
  ``gen_ai.response.id``, and OpenInference's span kind (``CHAIN``: the request runs a chain
  of attempts; the chat span beneath, when the telemetry layer is on, is the ``LLM`` one).
* ``http.server.request.duration`` uses the duration buckets the GenAI conventions advise
  (10 ms to 82 s), never the SDK's default ones (0, 5, 10 ... s), so an LLM request's p95
  means something.
* One log line per request (``chat_pipeline.gateway``): request id and response id,
  status, duration, model, route, attempts, fallback, served model, the key's position,
  what was done with the built-in tools it offered (``builtin_tools=dropped=web_search``,
  only when it offered any), and for a failure its class (never its message). A request
  refused or answered
  (2xx-4xx) is INFO; a failure of the service (5xx, or a stream cut after output) is
  WARNING; a client that left is INFO.
* Nothing from the body, the answer or a key reaches the span, the metric or the line.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
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

from pipeline._genai import ERROR_STATUS
from pipeline._metrics import duration_histogram
from pipeline._semconv import (
    CLIENT_DISCONNECTED,
    GATEWAY_MODEL,
    GATEWAY_REQUEST_ID,
    GATEWAY_SCOPE,
    OPENINFERENCE_CHAIN,
    OPENINFERENCE_SPAN_KIND,
    ROUTE_ATTEMPTS,
    ROUTE_FALLBACK,
    ROUTE_NAME,
    global_meter_provider_set,
    global_tracer_provider_set,
    meter,
    tracer,
)
from pipeline.gateway._exchange import (
    Exchange,
    Scope,
    loggable,
)
from pipeline.gateway.wire import WireError

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

__all__ = ["RequestTelemetry"]

_logger = logging.getLogger("chat_pipeline.gateway")


class RequestTelemetry:
    """Traces, measures and logs the requests of one endpoint (see the module docstring):
    `begin` when a request starts, `end` once it ended (its response written, or it
    failed), whatever happened in between."""

    __slots__ = ("_bases", "_duration", "_global", "_models", "_route", "_tracer", "_unmetered")

    def __init__(
        self,
        *,
        route: str,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        self._route = route
        self._bases: dict[tuple[Any, ...], dict[str, Any]] = {}
        # The model names requests asked for, as log fields (`loggable`): a worker sees few.
        self._models: dict[str, str] = {}
        self._tracer = tracer(GATEWAY_SCOPE, tracer_provider)
        # With no provider given, spans are made once a global one is set (until then the
        # API's would record nothing: the span and its context are skipped).
        self._global = tracer_provider is None
        if self._global:
            trace.get_tracer_provider()  # sets the one the environment names, if any
        # The global meter's instruments record nothing until a provider is set (then
        # False: once set, it stays).
        self._unmetered = meter_provider is None
        self._duration = duration_histogram(
            meter(GATEWAY_SCOPE, meter_provider),
            HTTP_SERVER_REQUEST_DURATION,
            "Duration of HTTP server requests.",
        )

    def begin(self, exchange: Exchange, scope: Scope) -> _Traced | None:
        """Start the request's span and make it current (None when nothing is traced: no
        tracer provider, and no caller's trace to pass on upstream)."""
        carrier = exchange.carrier
        if not carrier and self._global and not global_tracer_provider_set():
            return None
        parent = propagate.extract(carrier) if carrier else None
        method = scope["method"]
        span = self._tracer.start_span(
            f"{method} {self._route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=self._start_attributes(scope, method, exchange.request_id),
        )
        return span, otel_context.attach(trace.set_span_in_context(span, parent))

    def end(self, traced: _Traced | None, exchange: Exchange, scope: Scope) -> None:
        """End the request's span (made current by `begin`), record its duration and write
        its log line."""
        span: trace.Span | None = None
        if traced is not None:
            span, token = traced
            otel_context.detach(token)
        method = scope["method"]
        status = exchange.status
        failure = exchange.failure
        duration = time.perf_counter() - exchange.started
        error_type = None
        if status >= 500 or (status == 200 and failure is not None):
            error_type = type(failure).__name__ if failure is not None else str(status)
        if not self._unmetered or global_meter_provider_set():
            self._unmetered = False
            # The HTTP server conventions require `url.scheme` on the duration metric and
            # recommend `network.protocol.version`: the same values the span starts with.
            attributes: dict[str, Any] = {
                HTTP_REQUEST_METHOD: method,
                HTTP_ROUTE: self._route,
                URL_SCHEME: scope.get("scheme", "http"),
                NETWORK_PROTOCOL_VERSION: scope.get("http_version", "1.1"),
            }
            if status:
                attributes[HTTP_RESPONSE_STATUS_CODE] = status
            if error_type is not None:
                attributes[ERROR_TYPE] = error_type
            self._duration.record(duration, attributes)
        route, attempts, fallback, served = _story(exchange)
        if span is not None and span.is_recording():
            ending: dict[str, Any] = {}
            if status:
                ending[HTTP_RESPONSE_STATUS_CODE] = status
            if exchange.model is not None:
                ending[GATEWAY_MODEL] = exchange.model
            if route is not None:
                ending[ROUTE_NAME] = route
                ending[ROUTE_ATTEMPTS] = attempts
                ending[ROUTE_FALLBACK] = fallback
            if served:
                ending[gen_ai.GEN_AI_RESPONSE_MODEL] = served
            if exchange.response_id is not None:
                ending[gen_ai.GEN_AI_RESPONSE_ID] = exchange.response_id
            if exchange.disconnected:
                # The client's choice, never an error: the request was cancelled.
                ending[CLIENT_DISCONNECTED] = True
            if error_type is not None:
                ending[ERROR_TYPE] = error_type
                span.set_status(ERROR_STATUS)
            span.set_attributes(ending)
        if span is not None:
            span.end()
        level = logging.INFO
        if exchange.disconnected:
            outcome = "client disconnected"
        elif failure is not None:
            # A failure of the service (5xx, or a stream cut after output) is a warning; a
            # request refused for what it asked (4xx) is information.
            if status >= 500 or status == 200:
                level = logging.WARNING
            code = failure.code if isinstance(failure, WireError) else None
            outcome = type(failure).__name__ + (f" {code}" if code else "")
        else:
            outcome = "ok"
        if _logger.isEnabledFor(level):
            key = exchange.key_name
            builtin = exchange.builtin_tools
            args = (
                method,
                self._route,
                status or "-",
                duration * 1000,
                # What the client wrote is escaped: it cannot forge a field or a line.
                exchange.logged_id,
                exchange.response_id or "-",
                self._logged_model(exchange.model) if exchange.model else "-",
                route or "-",
                attempts if route is not None else "-",
                ("true" if fallback else "false") if route is not None else "-",
                served or "-",
                key or "-",
                # Only a request that offered built-in tools says what became of them.
                # Percent-encoded tokens (`_builtin_tools.header_value`).
                "" if builtin is None else f" builtin_tools={builtin}",
                outcome,
            )
            handler = _only_handler()
            if handler is None or not handler.write_line(level, _LINE, args):
                _logger.handle(_line_record(level, args))

    def _start_attributes(self, scope: Scope, method: str, request_id: str) -> dict[str, Any]:
        # What a connection's requests share is built once (a worker has few listeners).
        server = scope.get("server")
        if server is not None and type(server) is not tuple:
            server = tuple(server)  # a list, from some servers: the cache key must hash
        key = (method, scope.get("scheme"), scope.get("http_version"), server)
        base = self._bases.get(key)
        if base is None:
            base = {
                HTTP_REQUEST_METHOD: method,
                HTTP_ROUTE: self._route,
                URL_PATH: self._route,
                URL_SCHEME: scope.get("scheme", "http"),
                NETWORK_PROTOCOL_VERSION: scope.get("http_version", "1.1"),
                OPENINFERENCE_SPAN_KIND: OPENINFERENCE_CHAIN,
            }
            if server:
                base[SERVER_ADDRESS] = server[0]
                if server[1] is not None:
                    base[SERVER_PORT] = server[1]
            if len(self._bases) < 64:
                self._bases[key] = base
        attributes = dict(base)
        attributes[GATEWAY_REQUEST_ID] = (request_id,)
        return attributes

    def _logged_model(self, model: str) -> str:
        logged = self._models.get(model)
        if logged is None:
            logged = loggable(model)
            if len(self._models) < _MODELS_KEPT:
                self._models[model] = logged
        return logged


_MODELS_KEPT = 256

_LINE = (
    "%s %s %s %.1f ms request_id=%s response_id=%s model=%s route=%s attempts=%s "
    "fallback=%s served_model=%s key=%s%s: %s"
)

# What the request line's records share within a process and thread (name, level, file,
# process and thread ids and names), by (level, thread): copied into each new record
# instead of computed again by `LogRecord.__init__` (a quarter of the line's cost). Emptied
# in a forked child, whose process differs.
_TEMPLATES: dict[tuple[int, int], dict[str, Any]] = {}
os.register_at_fork(after_in_child=_TEMPLATES.clear)


def _only_handler() -> Any:
    """The one handler the request line's record would reach, when it is one that can
    write the line without the record (``write_line``: `log_config`'s), the gateway's
    logger filtering nothing; else None. Asked at every line: a configuration may change
    while the gateway serves."""
    logger: logging.Logger | None = _logger
    if _logger.filters or _logger.disabled:
        return None
    found = None
    while logger is not None:
        for handler in logger.handlers:
            if found is not None:
                return None
            found = handler
        if not logger.propagate:
            break
        logger = logger.parent
    return found if found is not None and hasattr(found, "write_line") else None


def _line_record(level: int, args: tuple[Any, ...]) -> logging.LogRecord:
    """The request line's record: as `Logger.makeRecord` makes it (never through
    `Logger.log`, which walks the stack for the caller's file and line the line does not
    show), from a template when the record factory is logging's own."""
    if logging.getLogRecordFactory() is not logging.LogRecord:
        return _logger.makeRecord(_logger.name, level, __file__, 0, _LINE, args, None)
    key = (level, threading.get_ident())
    template = _TEMPLATES.get(key)
    if template is None:
        made = logging.LogRecord(_logger.name, level, __file__, 0, _LINE, None, None)
        template = _TEMPLATES[key] = dict(made.__dict__)
    record = _new_record(logging.LogRecord)
    record.__dict__.update(template)
    now = time.time_ns()
    created = now / 1e9
    record.args = args
    record.created = created
    record.msecs = (now % 1_000_000_000) // 1_000_000 + 0.0
    record.relativeCreated = template["relativeCreated"] + (created - template["created"]) * 1000
    if "taskName" in template and getattr(logging, "logAsyncioTasks", False):
        # Python 3.12 and later name the current task, as `LogRecord.__init__` does.
        try:
            record.taskName = asyncio.current_task().get_name()  # type: ignore[union-attr]
        except Exception:
            record.taskName = None
    return record


_new_record = object.__new__


_Traced = tuple[trace.Span, "contextvars.Token[otel_context.Context]"]


def _story(exchange: Exchange) -> tuple[str | None, int, bool, str | None]:
    """(route, attempts, fallback, served model) of a request that reached the pipeline:
    the router's report when a router ran (its last route: the one that served, or the
    last one tried), else the route the model name serves. No model served a request that
    failed before output."""
    report = exchange.report
    served = exchange.response_model
    if report is not None and report.route_name is not None:
        if not served and exchange.failure is None:  # an answer without a model named
            served = getattr(report.metadata, "model_id", None)
        return report.route_name, report.attempts, report.fallback, served
    if exchange.route is not None and exchange.report is not None:
        return exchange.route, 1, False, served
    return None, 0, False, served
