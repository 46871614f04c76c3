"""Attempt spans and routing metrics, emitted by every router's engine.

Each attempt is a ``route_attempt {route}`` span, current while the route runs (so retry
events, breaker events and provider HTTP spans nest under it). The names are
`pipeline._semconv`'s; nothing about messages, options or responses is recorded, and an
exception is recorded by its type only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.trace import ProxyTracer, Span, SpanKind, TracerProvider
from opentelemetry.util.types import AttributeValue

from pipeline._genai import ERROR_STATUS, client_attributes, provider_key
from pipeline._metrics import duration_histogram
from pipeline._semconv import (
    BACKUP_CALLS_METRIC,
    COMMITTED_FAILURES_METRIC,
    COST,
    COST_ESTIMATED,
    COST_METRIC,
    OPENINFERENCE_CHAIN,
    OPENINFERENCE_SPAN_KIND,
    ROUTE_ATTEMPT,
    ROUTE_ATTEMPT_COUNT_METRIC,
    ROUTE_ATTEMPT_SPAN,
    ROUTE_DURATION,
    ROUTE_NAME,
    ROUTE_OUTCOME,
    ROUTE_OUTPUT_COMMITTED,
    ROUTE_SELECTION,
    ROUTE_TERMINAL,
    ROUTE_TIME_TO_FIRST_UPDATE,
    ROUTING_SCOPE,
    TIME_TO_FIRST_UPDATE_METRIC,
    global_meter_provider_set,
    global_tracer_provider_set,
    meter,
    tracer,
)
from pipeline.client import metadata_of

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider

    from middleware.routing.context import FailoverAttempt
    from pipeline.pricing import Cost

__all__ = ["RouteTelemetry"]

_FAILED = frozenset({"failed_before_output", "failed_after_output"})


class RouteTelemetry:
    """The tracer and instruments of one router (global providers unless given)."""

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        self.tracer = tracer(ROUTING_SCOPE, tracer_provider)
        # The global provider's proxy makes no-op spans until a provider is set (then False).
        self._proxy = type(self.tracer) is ProxyTracer
        if self._proxy:
            trace.get_tracer_provider()  # sets the one the environment names, if any
        self.meter_provider = meter_provider  # for what a router makes beside it (health)
        # The global meter's instruments record nothing until a provider is set (then False).
        self._unmetered = meter_provider is None
        self._provider_key = provider_key()
        self._clients: dict[int, tuple[object, dict[str, AttributeValue]]] = {}
        instruments = meter(ROUTING_SCOPE, meter_provider)
        self.attempts = instruments.create_counter(
            ROUTE_ATTEMPT_COUNT_METRIC,
            unit="{attempt}",
            description="Route attempts by route and outcome",
        )
        self.backup_calls = instruments.create_counter(
            BACKUP_CALLS_METRIC, unit="{call}", description="Attempts after the first of a request"
        )
        self.committed_failures = instruments.create_counter(
            COMMITTED_FAILURES_METRIC,
            unit="{failure}",
            description="Failures after output reached the caller (no failover possible)",
        )
        self.time_to_first_update = duration_histogram(
            instruments,
            TIME_TO_FIRST_UPDATE_METRIC,
            "Time from an attempt's start to its first update reaching the caller",
        )
        self.cost = instruments.create_counter(
            COST_METRIC, unit="{currency}", description="Cost of attempts by route"
        )

    def _client_attributes(self, client: object) -> dict[str, AttributeValue]:
        # A route's provider, server and model never change: computed once per client
        # (bounded), with the span kind OpenInference readers (Arize Phoenix) show.
        cached = self._clients.get(id(client))
        if cached is None or cached[0] is not client:
            metadata = metadata_of(client)
            attributes = client_attributes(metadata, self._provider_key)
            if metadata.model_id:
                attributes[gen_ai.GEN_AI_REQUEST_MODEL] = metadata.model_id
            attributes[OPENINFERENCE_SPAN_KIND] = OPENINFERENCE_CHAIN
            if len(self._clients) < 1024:
                self._clients[id(client)] = (client, attributes)
            return attributes
        return cached[1]

    def traced(self) -> bool:
        """Whether an attempt's span could record or carry a context of its own: not while
        the tracer is the global one and no global provider is set (the API would return the
        current span or a no-op one carrying the current span's context, which stays current
        anyway). Asked per attempt: a provider set later traces the attempts after it."""
        if self._proxy and not global_tracer_provider_set():
            return False
        self._proxy = False  # a global provider, once set, stays
        return True

    def counted(self) -> bool:
        """Whether the attempt metrics record anything: not while the meter is the global
        one and no global provider is set (asked per attempt, as `traced`)."""
        if self._unmetered and not global_meter_provider_set():
            return False
        self._unmetered = False  # a global provider, once set, stays
        return True

    def start(self, route_name: str, number: int, client: object, model: str | None) -> Span:
        """The span of one attempt, with its route's GenAI provider, server and model (the
        attempt's own model when its options name one)."""
        # All attributes at the start: one SDK call instead of a start and a second
        # set_attributes (the client's part is cached, so the no-op API pays a dict merge).
        attributes = {
            ROUTE_NAME: route_name,
            ROUTE_ATTEMPT: number,
            **self._client_attributes(client),
        }
        if model:
            attributes[gen_ai.GEN_AI_REQUEST_MODEL] = model
        return self.tracer.start_span(
            f"{ROUTE_ATTEMPT_SPAN} {route_name}", kind=SpanKind.INTERNAL, attributes=attributes
        )

    def finish(
        self,
        span: Span | None,
        attempt: FailoverAttempt,
        cost: Cost | None,
        response_model: str | None,
        *,
        terminal: bool,
        selection: AttributeValue | None = None,
    ) -> None:
        """End the attempt's span (if it has one) and count it (by route, outcome, terminal
        and, when the router said why it chose the route, `selection`), with its `cost` when
        it was priced (`chat_pipeline.cost` on the span, the cost counter). Only a failed
        attempt is an error (ERROR status and `error.type`); a canceled or abandoned one ends
        with UNSET status, its outcome telling what happened."""
        failed = attempt.outcome in _FAILED
        if span is not None:
            if span.is_recording():
                attributes: dict[str, AttributeValue] = {
                    ROUTE_OUTCOME: attempt.outcome,
                    ROUTE_OUTPUT_COMMITTED: attempt.output_committed,
                    ROUTE_DURATION: attempt.duration,
                    ROUTE_TERMINAL: terminal,
                }
                if attempt.time_to_first_update is not None:
                    attributes[ROUTE_TIME_TO_FIRST_UPDATE] = attempt.time_to_first_update
                if response_model:
                    attributes[gen_ai.GEN_AI_RESPONSE_MODEL] = response_model
                if failed and attempt.exception is not None:
                    attributes[ERROR_TYPE] = type(attempt.exception).__name__
                if cost is not None:
                    attributes[COST] = float(cost.amount)
                    attributes[COST_ESTIMATED] = cost.estimated
                span.set_attributes(attributes)
                if failed:
                    # No description: exception messages may quote provider bodies or prompts.
                    span.set_status(ERROR_STATUS)
            span.end()
        if not self.counted():
            return
        # Terminal or not tells a failure that moved on to another route (a fallback) from
        # one that ended the request (nowhere left to go).
        labels: dict[str, AttributeValue] = {
            ROUTE_NAME: attempt.route_name,
            ROUTE_OUTCOME: attempt.outcome,
            ROUTE_TERMINAL: terminal,
        }
        if selection is not None:
            labels[ROUTE_SELECTION] = selection
        self.attempts.add(1, labels)
        if attempt.time_to_first_update is not None:
            self.time_to_first_update.record(
                attempt.time_to_first_update, {ROUTE_NAME: attempt.route_name}
            )
        if attempt.number > 1:
            self.backup_calls.add(1, {ROUTE_NAME: attempt.route_name})
        if attempt.outcome == "failed_after_output":
            self.committed_failures.add(1, {ROUTE_NAME: attempt.route_name})
        if cost is not None and cost.amount:
            self.cost.add(float(cost.amount), {ROUTE_NAME: attempt.route_name})
