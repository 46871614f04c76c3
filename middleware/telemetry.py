"""The telemetry layer: an OpenTelemetry ``chat {model}`` span and GenAI metrics per request.

Promises:

* one CLIENT span per request, current while the layers beneath run (so router attempt
  spans and provider HTTP spans nest under it), with GenAI semantic-convention attributes:
  operation, provider, request and response model, response id, finish reasons, token
  usage, server address and port, and `error.type` with ERROR status on failure;
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

import os
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.semconv.attributes.server_attributes import SERVER_ADDRESS, SERVER_PORT
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from pipeline._metrics import gen_ai_client_histograms
from pipeline.client import ChatClient, DelegatingChatClient
from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages, UsageDetails

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

__all__ = ["TelemetryChatClient", "latest_experimental_semconv"]

INSTRUMENTATION_NAME = "chat_pipeline"
_CHAT = gen_ai.GenAiOperationNameValues.CHAT.value
_INPUT = gen_ai.GenAiTokenTypeValues.INPUT.value
_METRIC_KEYS = (
    gen_ai.GEN_AI_OPERATION_NAME,
    gen_ai.GEN_AI_PROVIDER_NAME,
    gen_ai.GEN_AI_SYSTEM,
    gen_ai.GEN_AI_REQUEST_MODEL,
    SERVER_ADDRESS,
    SERVER_PORT,
)
_OUTPUT = gen_ai.GenAiTokenTypeValues.OUTPUT.value


def latest_experimental_semconv() -> bool:
    """Whether ``OTEL_SEMCONV_STABILITY_OPT_IN`` asks for the newest GenAI conventions."""
    value = os.environ.get("OTEL_SEMCONV_STABILITY_OPT_IN", "")
    return "gen_ai_latest_experimental" in {part.strip() for part in value.split(",")}


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
        from pipeline import __version__

        self._tracer = trace.get_tracer(INSTRUMENTATION_NAME, __version__, tracer_provider)
        meter = metrics.get_meter(INSTRUMENTATION_NAME, __version__, meter_provider)
        self._duration, self._tokens, self._first_chunk = gen_ai_client_histograms(meter)
        self._clock = clock
        self._latest = latest_experimental_semconv()
        metadata = inner.metadata
        provider_key = gen_ai.GEN_AI_PROVIDER_NAME if self._latest else gen_ai.GEN_AI_SYSTEM
        self._base: dict[str, Any] = {gen_ai.GEN_AI_OPERATION_NAME: _CHAT}
        if metadata.provider_name:
            self._base[provider_key] = metadata.provider_name
        if metadata.server_address:
            self._base[SERVER_ADDRESS] = metadata.server_address
        if metadata.server_port:
            self._base[SERVER_PORT] = metadata.server_port
        self._default_model = metadata.model_id
        self._label_cache: dict[tuple[object, ...], dict[str, Any]] = {}

    def describe_layer(self) -> str:
        return "TelemetryChatClient"

    # -- attributes ------------------------------------------------------------------------

    def _request_attributes(self, options: ChatOptions | None) -> dict[str, Any]:
        attributes = dict(self._base)
        model = (options.model_id if options else None) or self._default_model
        if model:
            attributes[gen_ai.GEN_AI_REQUEST_MODEL] = model
        if options is not None:
            # Numbers only: stop sequences, tools and formats may carry user text.
            for key, value in (
                (gen_ai.GEN_AI_REQUEST_TEMPERATURE, options.temperature),
                (gen_ai.GEN_AI_REQUEST_TOP_P, options.top_p),
                (gen_ai.GEN_AI_REQUEST_MAX_TOKENS, options.max_output_tokens),
                (gen_ai.GEN_AI_REQUEST_SEED, options.seed),
            ):
                if value is not None:
                    attributes[key] = value
        return attributes

    def _metric_attributes(
        self, request: dict[str, Any], response_model: str | None, error: BaseException | None
    ) -> dict[str, Any]:
        key = (request.get(gen_ai.GEN_AI_REQUEST_MODEL), response_model, type(error))
        cached = self._label_cache.get(key)
        if cached is not None:
            return cached
        labels = {k: request[k] for k in _METRIC_KEYS if k in request}
        if response_model:
            labels[gen_ai.GEN_AI_RESPONSE_MODEL] = response_model
        if error is not None:
            labels[ERROR_TYPE] = type(error).__name__
        if len(self._label_cache) < 256:  # bounded: models and error types are few
            self._label_cache[key] = labels
        return labels

    def _start(self, options: ChatOptions | None) -> tuple[Span, dict[str, Any]]:
        attributes = self._request_attributes(options)
        model = attributes.get(gen_ai.GEN_AI_REQUEST_MODEL)
        span = self._tracer.start_span(
            f"{_CHAT} {model}" if model else _CHAT, kind=SpanKind.CLIENT, attributes=attributes
        )
        return span, attributes

    def _end(
        self,
        span: Span,
        request: dict[str, Any],
        started: float,
        *,
        response_id: str | None,
        response_model: str | None,
        finish_reason: str | None,
        usage: UsageDetails | None,
        error: BaseException | None,
        first_chunk: float | None = None,
    ) -> None:
        duration = self._clock() - started
        if span.is_recording():
            attributes: dict[str, Any] = {}
            if response_id:
                attributes[gen_ai.GEN_AI_RESPONSE_ID] = response_id
            if response_model:
                attributes[gen_ai.GEN_AI_RESPONSE_MODEL] = response_model
            if finish_reason:
                attributes[gen_ai.GEN_AI_RESPONSE_FINISH_REASONS] = (finish_reason,)
            if usage is not None:
                if usage.input_tokens is not None:
                    attributes[gen_ai.GEN_AI_USAGE_INPUT_TOKENS] = usage.input_tokens
                if usage.output_tokens is not None:
                    attributes[gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS] = usage.output_tokens
            if first_chunk is not None and self._latest:
                attributes[gen_ai.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = first_chunk
            if error is not None:
                attributes[ERROR_TYPE] = type(error).__name__
                # No description and no recorded exception: messages may hold prompt text.
                span.set_status(Status(StatusCode.ERROR))
            if attributes:
                span.set_attributes(attributes)
        span.end()
        labels = self._metric_attributes(request, response_model, error)
        self._duration.record(duration, labels)
        if first_chunk is not None:
            self._first_chunk.record(first_chunk, labels)
        if usage is not None:
            if usage.input_tokens is not None:
                self._tokens.record(
                    usage.input_tokens, {**labels, gen_ai.GEN_AI_TOKEN_TYPE: _INPUT}
                )
            if usage.output_tokens is not None:
                self._tokens.record(
                    usage.output_tokens, {**labels, gen_ai.GEN_AI_TOKEN_TYPE: _OUTPUT}
                )

    def _fail(
        self, span: Span, request: dict[str, Any], started: float, error: BaseException
    ) -> None:
        self._end(
            span,
            request,
            started,
            response_id=None,
            response_model=None,
            finish_reason=None,
            usage=None,
            error=error,
        )

    # -- calls -----------------------------------------------------------------------------

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        span, request = self._start(options)
        started = self._clock()
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            response = await self.inner.get_response(messages, options)
        except BaseException as exc:
            otel_context.detach(token)
            self._fail(span, request, started, exc)
            raise
        otel_context.detach(token)
        self._end(
            span,
            request,
            started,
            response_id=response.response_id,
            response_model=response.model_id,
            finish_reason=response.finish_reason,
            usage=response.usage,
            error=None,
        )
        return response

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return self._stream(messages, options)

    async def _stream(
        self, messages: Messages, options: ChatOptions | None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        span, request = self._start(options)
        started = self._clock()
        span_context = trace.set_span_in_context(span)
        response_id = response_model = finish_reason = None
        usage: UsageDetails | None = None
        first_chunk: float | None = None
        error: BaseException | None = None
        token = otel_context.attach(span_context)
        try:
            stream = self.inner.get_streaming_response(messages, options)
        except BaseException as exc:
            otel_context.detach(token)
            self._fail(span, request, started, exc)
            raise
        otel_context.detach(token)
        # Only the no-op API's span has no valid context: then there is nothing to make
        # current for each update. A sampled-out span must still be current, so the spans
        # beneath inherit its decision instead of starting traces of their own.
        propagate = span.get_span_context().is_valid
        try:
            while True:
                # The span is current only while the layers beneath run, never while the
                # caller holds an update (its own spans must not nest under ours).
                if propagate:
                    token = otel_context.attach(span_context)
                try:
                    update = await stream.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    if propagate:
                        otel_context.detach(token)
                if first_chunk is None:
                    first_chunk = self._clock() - started
                response_id = update.response_id or response_id
                response_model = update.model_id or response_model
                finish_reason = update.finish_reason or finish_reason
                if update.usage is not None:
                    usage = update.usage if usage is None else usage + update.usage
                yield update
        except GeneratorExit:
            raise  # the caller stopped reading: not an error of the request
        except BaseException as exc:
            error = exc
            raise
        finally:
            try:
                await stream.aclose()
            finally:
                self._end(
                    span,
                    request,
                    started,
                    response_id=response_id,
                    response_model=response_model,
                    finish_reason=finish_reason,
                    usage=usage,
                    error=error,
                    first_chunk=first_chunk,
                )
