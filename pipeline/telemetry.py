"""Export setup: `configure()` installs OpenTelemetry SDK providers that export over OTLP.

Without it every span and metric of the library goes to the OpenTelemetry API, which is a
no-op until some SDK is configured, so the library never exports anything on its own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.environment_variables import OTEL_METRICS_EXPORTER, OTEL_TRACES_EXPORTER
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    MetricExportResult,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)

__all__ = ["ExportTally", "TelemetryHandle", "configure"]

Protocol = Literal["http/protobuf", "grpc"]
_EXPORTERS = ("otlp", "console", "none")


@dataclass(slots=True)
class ExportTally:
    """How the exports of one signal went: batches the backends accepted, and batches
    refused or lost (a backend answering 405 to metrics, an unreachable collector)."""

    accepted: int = 0
    failed: int = 0


@dataclass(frozen=True, slots=True)
class TelemetryHandle:
    """The providers `configure` installed (None for a signal turned off);
    `shutdown()` flushes and stops them. `spans` and `metrics` tally the exports of the
    exporters `configure` made (readers given to it are not counted)."""

    tracer_provider: TracerProvider | None
    meter_provider: MeterProvider | None
    spans: ExportTally = field(default_factory=ExportTally)
    metrics: ExportTally = field(default_factory=ExportTally)

    def shutdown(self) -> None:
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()


class _TalliedSpans(SpanExporter):
    """A span exporter that counts its exports' results."""

    def __init__(self, inner: SpanExporter, tally: ExportTally) -> None:
        self._inner = inner
        self._tally = tally

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self._inner.export(spans)
        if result is SpanExportResult.SUCCESS:
            self._tally.accepted += 1
        else:
            self._tally.failed += 1
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class _TalliedMetrics(MetricExporter):
    """A metric exporter that counts its exports' results (with its inner exporter's
    temporality and aggregation)."""

    def __init__(self, inner: MetricExporter, tally: ExportTally) -> None:
        super().__init__(
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        self._inner = inner
        self._tally = tally

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        result = self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        if result is MetricExportResult.SUCCESS:
            self._tally.accepted += 1
        else:
            self._tally.failed += 1
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)


def _sdk_disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def _exporters(variable: str) -> list[str]:
    """The exporters ``variable`` names (comma-separated; unset or empty means ``otlp``);
    an empty list for ``none``."""
    names = [n.strip().lower() for n in os.environ.get(variable, "").split(",") if n.strip()]
    if not names:
        return ["otlp"]
    unknown = [n for n in names if n not in _EXPORTERS]
    if unknown:
        raise ValueError(
            f"{variable}={os.environ[variable]!r}: unsupported exporter {unknown[0]!r}"
            f" (supported: {', '.join(_EXPORTERS)})"
        )
    if "none" in names:
        if len(names) > 1:
            raise ValueError(f"{variable}: 'none' cannot be combined with other exporters")
        return []
    return list(dict.fromkeys(names))


def _otlp_span_exporter(endpoint: str | None, protocol: Protocol) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HTTPSpanExporter,
    )

    return (
        HTTPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces")
        if endpoint
        else HTTPSpanExporter()
    )


def _otlp_metric_exporter(endpoint: str | None, protocol: Protocol) -> MetricExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(endpoint=endpoint) if endpoint else OTLPMetricExporter()
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HTTPMetricExporter,
    )

    return (
        HTTPMetricExporter(endpoint=f"{endpoint.rstrip('/')}/v1/metrics")
        if endpoint
        else HTTPMetricExporter()
    )


def configure(
    service_name: str | None = None,
    endpoint: str | None = None,
    protocol: Protocol = "http/protobuf",
    *,
    set_global: bool = True,
    traces: bool = True,
    metrics: bool = True,
    metric_readers: Sequence[MetricReader] = (),
    resource_attributes: Mapping[str, str] | None = None,
) -> TelemetryHandle:
    """Set up export of traces (batched) and metrics (periodic), over OTLP by default.

    The standard variables apply: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (and the per-signal ones)
    when `endpoint` is None, ``OTEL_SERVICE_NAME`` when `service_name` is None,
    ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_EXPORTER_OTLP_HEADERS``,
    ``OTEL_METRIC_EXPORT_INTERVAL``; ``OTEL_TRACES_EXPORTER`` and ``OTEL_METRICS_EXPORTER``
    choose ``otlp`` (the default), ``console`` (both, comma-separated) or ``none``, which
    turns that signal off; with ``OTEL_SDK_DISABLED=true`` nothing is installed.
    `traces=False` or `metrics=False` turns a signal off whatever the variables say: use
    ``metrics=False`` for a traces-only backend (Arize Phoenix answers 405 on
    ``/v1/metrics``), which would otherwise log an export error every interval. A signal
    turned off has no provider: its field of the handle is None and, with `set_global`,
    the global provider of that signal is left as it was. `metric_readers` are added to
    the meter provider (a Prometheus reader, say: a provider is made for them even with
    metrics export off); `resource_attributes` join the resource (``service.instance.id``).

    `endpoint` is the collector's base URL (``http://localhost:4318`` for HTTP,
    ``http://localhost:4317`` for gRPC). Raises ValueError for an unknown `protocol` or an
    unsupported exporter name in the variables.
    """
    if protocol not in ("http/protobuf", "grpc"):
        raise ValueError(f"protocol must be 'http/protobuf' or 'grpc', not {protocol!r}")
    if _sdk_disabled():
        return TelemetryHandle(None, None)
    span_exporters = _exporters(OTEL_TRACES_EXPORTER) if traces else []
    metric_exporters = _exporters(OTEL_METRICS_EXPORTER) if metrics else []
    attributes = dict(resource_attributes or {})
    if service_name:
        attributes[SERVICE_NAME] = service_name
    resource = Resource.create(attributes)
    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None
    span_tally, metric_tally = ExportTally(), ExportTally()
    if span_exporters:
        tracer_provider = TracerProvider(resource=resource)
        for name in span_exporters:
            span_exporter = (
                ConsoleSpanExporter(out=sys.stdout)
                if name == "console"
                else _otlp_span_exporter(endpoint, protocol)
            )
            tracer_provider.add_span_processor(
                BatchSpanProcessor(_TalliedSpans(span_exporter, span_tally))
            )
    readers: list[MetricReader] = [
        PeriodicExportingMetricReader(
            _TalliedMetrics(
                ConsoleMetricExporter(out=sys.stdout)
                if name == "console"
                else _otlp_metric_exporter(endpoint, protocol),
                metric_tally,
            )
        )
        for name in metric_exporters
    ]
    readers.extend(metric_readers)
    if readers:
        meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    if set_global:
        if tracer_provider is not None:
            trace.set_tracer_provider(tracer_provider)
        if meter_provider is not None:
            otel_metrics.set_meter_provider(meter_provider)
    return TelemetryHandle(tracer_provider, meter_provider, span_tally, metric_tally)
