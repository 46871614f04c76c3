"""Export setup: `configure()` installs OpenTelemetry SDK providers that export over OTLP.

Without it every span and metric of the library goes to the OpenTelemetry API, which is a
no-op until some SDK is configured, so the library never exports anything on its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

__all__ = ["TelemetryHandle", "configure"]

Protocol = Literal["http/protobuf", "grpc"]


@dataclass(frozen=True, slots=True)
class TelemetryHandle:
    """The providers `configure` installed; `shutdown()` flushes and stops them."""

    tracer_provider: TracerProvider | None
    meter_provider: MeterProvider | None

    def shutdown(self) -> None:
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()


def _sdk_disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def configure(
    service_name: str | None = None,
    endpoint: str | None = None,
    protocol: Protocol = "http/protobuf",
    *,
    set_global: bool = True,
) -> TelemetryHandle:
    """Set up OTLP export of traces (batched) and metrics (periodic).

    The standard variables apply: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (and the per-signal ones)
    when `endpoint` is None, ``OTEL_SERVICE_NAME`` when `service_name` is None,
    ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_EXPORTER_OTLP_HEADERS``; with
    ``OTEL_SDK_DISABLED=true`` nothing is installed. `endpoint` is the collector's base
    URL (``http://localhost:4318`` for HTTP, ``http://localhost:4317`` for gRPC).
    """
    if protocol not in ("http/protobuf", "grpc"):
        raise ValueError(f"protocol must be 'http/protobuf' or 'grpc', not {protocol!r}")
    if _sdk_disabled():
        return TelemetryHandle(None, None)
    attributes = {SERVICE_NAME: service_name} if service_name else {}
    resource = Resource.create(attributes)
    span_exporter: SpanExporter
    metric_exporter: MetricExporter
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        span_exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
        metric_exporter = (
            OTLPMetricExporter(endpoint=endpoint) if endpoint else OTLPMetricExporter()
        )
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
            OTLPMetricExporter as HTTPMetricExporter,
        )
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPSpanExporter,
        )

        base = endpoint.rstrip("/") if endpoint else None
        span_exporter = (
            HTTPSpanExporter(endpoint=f"{base}/v1/traces") if base else HTTPSpanExporter()
        )
        metric_exporter = (
            HTTPMetricExporter(endpoint=f"{base}/v1/metrics") if base else HTTPMetricExporter()
        )
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    meter_provider = MeterProvider(
        resource=resource, metric_readers=[PeriodicExportingMetricReader(metric_exporter)]
    )
    if set_global:
        trace.set_tracer_provider(tracer_provider)
        metrics.set_meter_provider(meter_provider)
    return TelemetryHandle(tracer_provider, meter_provider)
