"""In-memory OpenTelemetry SDK providers for tests, and helpers to read what they hold."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@dataclass
class Otel:
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    spans: InMemorySpanExporter
    reader: InMemoryMetricReader

    @property
    def providers(self) -> dict[str, Any]:
        return {"tracer_provider": self.tracer_provider, "meter_provider": self.meter_provider}

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

    def attempt_spans(self) -> list[ReadableSpan]:
        return [s for s in self.finished() if s.name.startswith("route_attempt ")]

    def points(self, metric: str) -> list[tuple[dict[str, Any], Any]]:
        """(attributes, value) of every data point of `metric` (sum, or histogram count)."""
        data = self.reader.get_metrics_data()
        found: list[tuple[dict[str, Any], Any]] = []
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for m in scope.metrics:
                    if m.name != metric:
                        continue
                    for point in m.data.data_points:
                        value = getattr(point, "value", None)
                        if value is None:
                            value = point.count  # type: ignore[attr-defined]
                        found.append((dict(point.attributes or {}), value))
        return found

    def total(self, metric: str, **attributes: Any) -> Any:
        return sum(
            value
            for attrs, value in self.points(metric)
            if all(attrs.get(k) == v for k, v in attributes.items())
        )

    def everything_exported(self) -> Iterator[str]:
        """Every string an exporter would see: names, attributes, events, statuses, metrics."""
        for span in self.finished():
            yield span.name
            yield repr(dict(span.attributes or {}))
            yield span.status.description or ""
            for event in span.events:
                yield event.name
                yield repr(dict(event.attributes or {}))
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for m in scope.metrics:
                    yield m.name
                    for point in m.data.data_points:
                        yield repr(dict(point.attributes or {}))


def make_otel() -> Otel:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    return Otel(tracer_provider, MeterProvider(metric_readers=[reader]), spans, reader)


class Receiver:
    """An OTLP/HTTP receiver on 127.0.0.1 keeping every decoded trace and metric export.

    With `reject_metrics` it answers 405 on /v1/metrics, as a traces-only backend does."""

    def __init__(self, *, reject_metrics: bool = False) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.metric_requests: list[ExportMetricsServiceRequest] = []
        self.paths: list[str] = []
        self.received = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.paths.append(self.path)
                status = 200
                if self.path == "/v1/traces":
                    request = ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    receiver.requests.append(request)
                    receiver.received.set()
                elif self.path == "/v1/metrics" and reject_metrics:
                    status = 405
                elif self.path == "/v1/metrics":
                    metric_request = ExportMetricsServiceRequest()
                    metric_request.ParseFromString(body)
                    receiver.metric_requests.append(metric_request)
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def spans(self) -> list[object]:
        return [
            span
            for request in self.requests
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]

    def metrics(self) -> dict[str, list[Any]]:
        """Every exported metric by name: its data points (number or histogram points)."""
        found: dict[str, list[Any]] = {}
        for request in self.metric_requests:
            for resource in request.resource_metrics:
                for scope in resource.scope_metrics:
                    for metric in scope.metrics:
                        data = getattr(metric, metric.WhichOneof("data"))
                        found.setdefault(metric.name, []).extend(data.data_points)
        return found
