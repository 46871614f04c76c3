"""Attempt spans and routing metrics, emitted by every router's engine.

Each attempt is a ``route_attempt {route}`` span, current while the route runs (so retry
events, breaker events and provider HTTP spans nest under it). Attribute names are defined
here once; nothing about messages, options or responses is recorded, and an exception is
recorded by its type only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry import metrics, trace
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, TracerProvider
from opentelemetry.util.types import AttributeValue

from pipeline._metrics import duration_histogram

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider

    from middleware.routing.context import FailoverAttempt, Price
    from pipeline.types import UsageDetails

__all__ = [
    "ATTEMPTS_METRIC",
    "BACKUP_CALLS_METRIC",
    "COMMITTED_FAILURES_METRIC",
    "COST_METRIC",
    "TIME_TO_FIRST_UPDATE_METRIC",
    "ROUTE_ATTEMPT",
    "ROUTE_DURATION",
    "ROUTE_NAME",
    "ROUTE_OUTCOME",
    "ROUTE_OUTPUT_COMMITTED",
    "ROUTE_TERMINAL",
    "ROUTE_TIME_TO_FIRST_UPDATE",
    "RouteTelemetry",
]

INSTRUMENTATION_NAME = "chat_pipeline.routing"

ROUTE_NAME = "ai.route.name"
ROUTE_ATTEMPT = "ai.route.attempt"
ROUTE_OUTCOME = "ai.route.outcome"
ROUTE_OUTPUT_COMMITTED = "ai.route.output_committed"
ROUTE_TIME_TO_FIRST_UPDATE = "ai.route.time_to_first_update"
ROUTE_DURATION = "ai.route.duration"
ROUTE_TERMINAL = "ai.route.terminal"

ATTEMPTS_METRIC = "ai.route.attempts"
BACKUP_CALLS_METRIC = "ai.route.backup_calls"
COMMITTED_FAILURES_METRIC = "ai.route.output_committed_failures"
COST_METRIC = "ai.route.cost"
TIME_TO_FIRST_UPDATE_METRIC = "ai.route.time_to_first_update"

_FAILED = frozenset({"failed_before_output", "failed_after_output"})


class RouteTelemetry:
    """The tracer and instruments of one router (global providers unless given)."""

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        from pipeline import __version__

        self.tracer = trace.get_tracer(INSTRUMENTATION_NAME, __version__, tracer_provider)
        meter = metrics.get_meter(INSTRUMENTATION_NAME, __version__, meter_provider)
        self.attempts = meter.create_counter(
            ATTEMPTS_METRIC, unit="{attempt}", description="Route attempts by route and outcome"
        )
        self.backup_calls = meter.create_counter(
            BACKUP_CALLS_METRIC, unit="{call}", description="Attempts after the first of a request"
        )
        self.committed_failures = meter.create_counter(
            COMMITTED_FAILURES_METRIC,
            unit="{failure}",
            description="Failures after output reached the caller (no failover possible)",
        )
        self.time_to_first_update = duration_histogram(
            meter,
            TIME_TO_FIRST_UPDATE_METRIC,
            "Time from an attempt's start to its first update reaching the caller",
        )
        self.cost = meter.create_counter(
            COST_METRIC, unit="{currency}", description="Cost of completed attempts by route"
        )

    def start(self, route_name: str, number: int) -> Span:
        return self.tracer.start_span(
            f"route_attempt {route_name}",
            kind=SpanKind.INTERNAL,
            attributes={ROUTE_NAME: route_name, ROUTE_ATTEMPT: number},
        )

    def finish(
        self,
        span: Span,
        attempt: FailoverAttempt,
        terminal: bool,
        price: Price | None,
        usage: UsageDetails | None,
    ) -> None:
        error_type = type(attempt.exception).__name__ if attempt.exception is not None else None
        if span.is_recording():
            attributes: dict[str, AttributeValue] = {
                ROUTE_OUTCOME: attempt.outcome,
                ROUTE_OUTPUT_COMMITTED: attempt.output_committed,
                ROUTE_DURATION: attempt.duration,
                ROUTE_TERMINAL: terminal,
            }
            if attempt.time_to_first_update is not None:
                attributes[ROUTE_TIME_TO_FIRST_UPDATE] = attempt.time_to_first_update
            if error_type is not None:
                attributes[ERROR_TYPE] = error_type
            span.set_attributes(attributes)
            if attempt.outcome in _FAILED:
                # No description: exception messages may quote provider bodies or prompts.
                span.set_status(Status(StatusCode.ERROR))
        span.end()
        labels = {ROUTE_NAME: attempt.route_name, ROUTE_OUTCOME: attempt.outcome}
        self.attempts.add(1, labels)
        if attempt.time_to_first_update is not None:
            self.time_to_first_update.record(
                attempt.time_to_first_update, {ROUTE_NAME: attempt.route_name}
            )
        if attempt.number > 1:
            self.backup_calls.add(1, {ROUTE_NAME: attempt.route_name})
        if attempt.outcome == "failed_after_output":
            self.committed_failures.add(1, {ROUTE_NAME: attempt.route_name})
        if price is not None and usage is not None and attempt.response_completed:
            cost = price.cost(usage.input_tokens, usage.output_tokens)
            self.cost.add(cost, {ROUTE_NAME: attempt.route_name})
