"""Export setup: `configure()` installs OpenTelemetry SDK providers that export over OTLP.

Without it every span and metric of the library goes to the OpenTelemetry API, which is a
no-op until some SDK is configured, so the library never exports anything on its own.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Literal

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.environment_variables import OTEL_METRICS_EXPORTER, OTEL_TRACES_EXPORTER
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

__all__ = ["TelemetryHandle", "configure"]

Protocol = Literal["http/protobuf", "grpc"]
_EXPORTERS = ("otlp", "console", "none")


@dataclass(frozen=True, slots=True)
class TelemetryHandle:
    """The providers `configure` installed (None for a signal turned off);
    `shutdown()` flushes and stops them."""

    tracer_provider: TracerProvider | None
    meter_provider: MeterProvider | None

    def shutdown(self) -> None:
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()


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
    the global provider of that signal is left as it was.

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
    attributes = {SERVICE_NAME: service_name} if service_name else {}
    resource = Resource.create(attributes)
    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None
    if span_exporters:
        tracer_provider = TracerProvider(resource=resource)
        for name in span_exporters:
            span_exporter = (
                ConsoleSpanExporter(out=sys.stdout)
                if name == "console"
                else _otlp_span_exporter(endpoint, protocol)
            )
            tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    if metric_exporters:
        readers = [
            PeriodicExportingMetricReader(
                ConsoleMetricExporter(out=sys.stdout)
                if name == "console"
                else _otlp_metric_exporter(endpoint, protocol)
            )
            for name in metric_exporters
        ]
        meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    if set_global:
        if tracer_provider is not None:
            trace.set_tracer_provider(tracer_provider)
        if meter_provider is not None:
            otel_metrics.set_meter_provider(meter_provider)
    return TelemetryHandle(tracer_provider, meter_provider)
