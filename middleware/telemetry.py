"""The telemetry layer: an OpenTelemetry ``chat {model}`` span and GenAI metrics per request.

Promises:

* one CLIENT span per request, current while the layers beneath run (so router attempt
  spans and provider HTTP spans nest under it), with GenAI semantic-convention attributes:
  operation, provider, request and response model, response id, finish reasons, token
  usage (with the reasoning and prompt-cache parts, `pipeline._semconv.USAGE_DETAILS`),
  server address and port, and `error.type` with ERROR status on failure;
* metrics ``gen_ai.client.operation.duration``, ``gen_ai.client.token.usage`` and
  ``gen_ai.client.operation.time_to_first_chunk`` (streaming);
* never any message content, tool arguments or results, stop sequences, or exception
  messages: an exception is recorded by its type only, and the status has no description;
* ``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental`` switches to the newest
  names (``gen_ai.provider.name`` for ``gen_ai.system``; the time to first chunk as a span
  attribute too);
* without a configured SDK the OpenTelemetry API is a no-op and the layer costs little;
  a telemetry layer directly around another one does not wrap it again.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.semconv.attributes.server_attributes import SERVER_ADDRESS, SERVER_PORT
from opentelemetry.trace import Span, SpanKind

from pipeline import _scope
from pipeline._genai import (
    ERROR_STATUS,
    client_attributes,
    latest_experimental_semconv,
    provider_key,
)
from pipeline._metrics import gen_ai_client_histograms
from pipeline._scope import RouteReport
from pipeline._semconv import (
    PIPELINE_SCOPE,
    REQUEST_END,
    ROUTE_ATTEMPTS,
    ROUTE_FALLBACK,
    ROUTE_NAME,
    USAGE_DETAILS,
    meter,
    tracer,
)
from pipeline._streams import StreamEnd, StreamWatcher, ending_of, forward
from pipeline.client import ChatClient, DelegatingChatClient, metadata_of
from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages, UsageDetails

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

__all__ = ["REQUEST_END", "TelemetryChatClient", "latest_experimental_semconv"]

_CHAT = gen_ai.GenAiOperationNameValues.CHAT.value
_INPUT = gen_ai.GenAiTokenTypeValues.INPUT.value
_OPERATION = gen_ai.GEN_AI_OPERATION_NAME
_PROVIDER = gen_ai.GEN_AI_PROVIDER_NAME
_SYSTEM = gen_ai.GEN_AI_SYSTEM
_MODEL = gen_ai.GEN_AI_REQUEST_MODEL
_METRIC_KEYS = (_OPERATION, _PROVIDER, _SYSTEM, _MODEL, SERVER_ADDRESS, SERVER_PORT)
_OUTPUT = gen_ai.GenAiTokenTypeValues.OUTPUT.value


class TelemetryChatClient(DelegatingChatClient):
    """Traces and measures each request (see the module docstring)."""

    def __new__(cls, inner: ChatClient, **_: Any) -> TelemetryChatClient:
        # Never wrap twice: a telemetry layer directly around another is that layer.
        if type(inner) is cls:
            return inner
        return super().__new__(cls)

    def __init__(
        self,
        inner: ChatClient,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        leave_open: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if self is inner:
            return
        super().__init__(inner, leave_open=leave_open)
        self._tracer = tracer(PIPELINE_SCOPE, tracer_provider)
        self._duration, self._tokens, self._first_chunk = gen_ai_client_histograms(
            meter(PIPELINE_SCOPE, meter_provider)
        )
        self._clock = clock
        self._latest = latest_experimental_semconv()
        self._provider_key = provider_key(self._latest)
        metadata = metadata_of(inner)
        self._base: dict[str, Any] = {gen_ai.GEN_AI_OPERATION_NAME: _CHAT}
        if metadata.provider_name != "router":  # a router's served route says, per request
            self._base.update(client_attributes(metadata, self._provider_key))
        self._default_model = metadata.model_id
        # The attributes of a request that sets no model and no number: most requests.
        self._plain = dict(self._base)
        if self._default_model:
            self._plain[gen_ai.GEN_AI_REQUEST_MODEL] = self._default_model
        self._label_cache: dict[tuple[object, ...], dict[str, Any]] = {}

    def describe_layer(self) -> str:
        return "TelemetryChatClient"

    # -- attributes ------------------------------------------------------------------------

    def _request_attributes(self, options: ChatOptions | None) -> dict[str, Any]:
        """The span's start attributes. The dict may be shared between requests: callers
        never change it (they copy it to add to it)."""
        if options is None:
            return self._plain
        # Numbers only: stop sequences, tools and formats may carry user text.
        temperature, top_p = options.temperature, options.top_p
        max_tokens, seed = options.max_output_tokens, options.seed
        model = options.model_id or self._default_model
        if (
            model == self._default_model
            and temperature is None
            and top_p is None
            and max_tokens is None
            and seed is None
        ):
            return self._plain
        attributes = dict(self._base)
        if model:
            attributes[gen_ai.GEN_AI_REQUEST_MODEL] = model
        for key, value in (
            (gen_ai.GEN_AI_REQUEST_TEMPERATURE, temperature),
            (gen_ai.GEN_AI_REQUEST_TOP_P, top_p),
            (gen_ai.GEN_AI_REQUEST_MAX_TOKENS, max_tokens),
            (gen_ai.GEN_AI_REQUEST_SEED, seed),
        ):
            if value is not None:
                attributes[key] = value
        return attributes

    def _metric_attributes(
        self, attributes: dict[str, Any], response_model: str | None, error: BaseException | None
    ) -> dict[str, Any]:
        get = attributes.get  # spelled out: a generator here costs more than the lookup
        key = (
            get(_OPERATION),
            get(_PROVIDER),
            get(_SYSTEM),
            get(_MODEL),
            get(SERVER_ADDRESS),
            get(SERVER_PORT),
            response_model,
            type(error),
        )
        cached = self._label_cache.get(key)
        if cached is not None:
            return cached
        labels = {k: attributes[k] for k in _METRIC_KEYS if k in attributes}
        if response_model:
            labels[gen_ai.GEN_AI_RESPONSE_MODEL] = response_model
        if error is not None:
            labels[ERROR_TYPE] = type(error).__name__
        if len(self._label_cache) < 256:  # bounded: models, routes and error types are few
            self._label_cache[key] = labels
        return labels

    def _start(self, options: ChatOptions | None) -> tuple[Span, dict[str, Any]]:
        attributes = self._request_attributes(options)
        model = attributes.get(gen_ai.GEN_AI_REQUEST_MODEL)
        span = self._tracer.start_span(
            f"{_CHAT} {model}" if model else _CHAT, kind=SpanKind.CLIENT, attributes=attributes
        )
        return span, attributes

    def _routed(self, span: Span, request: dict[str, Any], report: RouteReport) -> dict[str, Any]:
        """The request's attributes once a router below said which route served: that
        route's provider, server and (when the caller named none) model, and the routing
        story (`chat_pipeline.route.name`, `chat_pipeline.route.attempts`,
        `chat_pipeline.route.fallback`)."""
        served = dict(request)
        for key in (self._provider_key, SERVER_ADDRESS, SERVER_PORT):
            served.pop(key, None)
        served.update(client_attributes(report.metadata, self._provider_key))
        if gen_ai.GEN_AI_REQUEST_MODEL not in served:
            model = getattr(report.metadata, "model_id", None)
            if model:
                served[gen_ai.GEN_AI_REQUEST_MODEL] = model
                span.update_name(f"{_CHAT} {model}")
        served[ROUTE_NAME] = report.route_name
        served[ROUTE_ATTEMPTS] = report.attempts
        served[ROUTE_FALLBACK] = report.fallback
        return served

    def _end(
        self,
        span: Span,
        request: dict[str, Any],
        started: float,
        report: RouteReport,
        *,
        how: StreamEnd,
        error: BaseException | None,
        response_id: str | None = None,
        response_model: str | None = None,
        finish_reason: str | None = None,
        usage: UsageDetails | None = None,
        first_chunk: float | None = None,
    ) -> None:
        duration = self._clock() - started
        attributes = request if report.route_name is None else self._routed(span, request, report)
        failed = how == "failed" or (error is not None and how == "completed")
        if span.is_recording():
            ending: dict[str, Any] = {} if attributes is request else dict(attributes)
            if response_id:
                ending[gen_ai.GEN_AI_RESPONSE_ID] = response_id
            if response_model:
                ending[gen_ai.GEN_AI_RESPONSE_MODEL] = response_model
            if finish_reason:
                ending[gen_ai.GEN_AI_RESPONSE_FINISH_REASONS] = (finish_reason,)
            if usage is not None:
                if usage.input_tokens is not None:
                    ending[gen_ai.GEN_AI_USAGE_INPUT_TOKENS] = usage.input_tokens
                if usage.output_tokens is not None:
                    ending[gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS] = usage.output_tokens
                for field, attribute, _ in USAGE_DETAILS:
                    count = getattr(usage, field)
                    if count is not None:
                        ending[attribute] = count
            if first_chunk is not None and self._latest:
                ending[gen_ai.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = first_chunk
            if failed and error is not None:
                ending[ERROR_TYPE] = type(error).__name__
                # No description and no recorded exception: messages may hold prompt text.
                span.set_status(ERROR_STATUS)
            elif how in ("canceled", "abandoned"):
                # The caller's choice, not an error: UNSET status, no error.type.
                ending[REQUEST_END] = how
            if ending:
                span.set_attributes(ending)
        span.end()
        labels = self._metric_attributes(attributes, response_model, error if failed else None)
        if first_chunk is not None:
            self._first_chunk.record(first_chunk, labels)
        if how in ("canceled", "abandoned"):
            return  # an unfinished request's duration and usage would skew the histograms
        self._duration.record(duration, labels)
        if usage is not None:
            if usage.input_tokens is not None:
                self._tokens.record(
                    usage.input_tokens, {**labels, gen_ai.GEN_AI_TOKEN_TYPE: _INPUT}
                )
            if usage.output_tokens is not None:
                self._tokens.record(
                    usage.output_tokens, {**labels, gen_ai.GEN_AI_TOKEN_TYPE: _OUTPUT}
                )
            for field, _, token_type in USAGE_DETAILS:
                count = getattr(usage, field)
                if count:
                    self._tokens.record(count, {**labels, gen_ai.GEN_AI_TOKEN_TYPE: token_type})

    # -- calls -----------------------------------------------------------------------------

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        span, request = self._start(options)
        started = self._clock()
        report = RouteReport()
        outer = _scope.current_report()
        token = otel_context.attach(trace.set_span_in_context(span))
        report_token = _scope.enter_report(report)
        try:
            response = await self.inner.get_response(messages, options)
        except BaseException as exc:
            _scope.exit_report(report_token)
            otel_context.detach(token)
            _pass_up(report, outer)
            self._end(span, request, started, report, how=ending_of(exc), error=exc)
            raise
        _scope.exit_report(report_token)
        otel_context.detach(token)
        _pass_up(report, outer)
        self._end(
            span,
            request,
            started,
            report,
            how="completed",
            error=None,
            response_id=response.response_id,
            response_model=response.model_id,
            finish_reason=response.finish_reason,
            usage=response.usage,
        )
        return response

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return forward(
            lambda: self.inner.get_streaming_response(messages, options),
            _StreamTrace(self, options),
        )


def _pass_up(report: RouteReport, outer: RouteReport | None) -> None:
    """Tell the routing story a router below wrote in this layer's report to the report
    held open above this layer (another telemetry layer's, or a framework adapter's), so
    the caller there learns which route served too."""
    if outer is not None and report.route_name is not None:
        outer.route_name = report.route_name
        outer.metadata = report.metadata
        outer.attempts = report.attempts
        outer.fallback = report.fallback
        outer.price = report.price
        outer.cost = report.cost


class _StreamTrace(StreamWatcher):
    """The span of one streamed request: started at the first read, current only while the
    layers beneath run (never while the caller holds an update, so the caller's own spans
    do not nest under it), ended with what the updates said."""

    __slots__ = (
        "finish_reason",
        "first_chunk",
        "layer",
        "options",
        "outer",
        "propagate",
        "report",
        "request",
        "response_id",
        "response_model",
        "scoped",
        "span",
        "span_context",
        "started",
        "usage",
    )

    def __init__(self, layer: TelemetryChatClient, options: ChatOptions | None) -> None:
        self.scoped = True
        self.layer = layer
        self.options = options
        self.report = RouteReport()
        self.outer: RouteReport | None = None
        self.response_id: str | None = None
        self.response_model: str | None = None
        self.finish_reason: str | None = None
        self.usage: UsageDetails | None = None
        self.first_chunk: float | None = None

    def start(self) -> None:
        # Taken at the first read, in the caller's context: a report held open above.
        self.outer = _scope.current_report()
        layer = self.layer
        self.span, self.request = layer._start(self.options)
        self.started = layer._clock()
        self.span_context = trace.set_span_in_context(self.span)
        # Only the no-op API's span has no valid context: then no span needs to be current
        # for each update. A sampled-out span must still be current, so the spans beneath
        # inherit its decision instead of starting traces of their own.
        self.propagate = self.span.get_span_context().is_valid

    def enter(self) -> Any:
        span_token = otel_context.attach(self.span_context) if self.propagate else None
        # The report is needed only in the first step, where a router beneath starts and
        # takes it; without a span to make current, later steps need no scope at all.
        report_token = _scope.enter_report(self.report)
        self.scoped = self.propagate
        return span_token, report_token

    def exit(self, token: Any) -> None:
        span_token, report_token = token
        _scope.exit_report(report_token)
        if span_token is not None:
            otel_context.detach(span_token)

    def update(self, update: ChatResponseUpdate) -> None:
        if self.first_chunk is None:
            self.first_chunk = self.layer._clock() - self.started
        self.response_id = update.response_id or self.response_id
        self.response_model = update.model_id or self.response_model
        self.finish_reason = update.finish_reason or self.finish_reason
        if update.usage is not None:
            self.usage = update.usage if self.usage is None else self.usage + update.usage

    def end(self, how: StreamEnd, error: BaseException | None) -> None:
        _pass_up(self.report, self.outer)
        self.layer._end(
            self.span,
            self.request,
            self.started,
            self.report,
            how=how,
            error=error,
            response_id=self.response_id,
            response_model=self.response_model,
            finish_reason=self.finish_reason,
            usage=self.usage,
            first_chunk=self.first_chunk,
        )
