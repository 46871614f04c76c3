"""Overhead of telemetry: no SDK (the API is a no-op) and an SDK recording every span.

Baseline: the same pipeline without a telemetry layer, measured in the same run. The
recording SDK uses a BatchSpanProcessor with an exporter that drops spans (the work of
recording without the noise of a network) and a metric reader that is never collected.

    python benchmarks/bench_telemetry.py [--calls 20000] [--updates 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import best_per_op, report

from pipeline import ChatClient, ChatMessage, ChatPipeline
from pipeline.testing import ScriptedChatClient, reply


class DropExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def recording_providers() -> dict[str, object]:
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(DropExporter()))
    return {
        "tracer_provider": tracer_provider,
        "meter_provider": MeterProvider(metric_readers=[InMemoryMetricReader()]),
    }


def pipelines(chunks: list[str]) -> list[tuple[str, ChatClient]]:
    def client() -> ScriptedChatClient:
        return ScriptedChatClient(reply("".join(chunks), chunks=chunks))

    sdk = recording_providers()
    return [
        ("no telemetry layer (baseline)", ChatPipeline.builder().build(client())),
        ("telemetry, no SDK (API no-op)", ChatPipeline.builder().use_telemetry().build(client())),
        ("telemetry, SDK recording", ChatPipeline.builder().use_telemetry(**sdk).build(client())),
        (
            "telemetry + failover, SDK recording",
            ChatPipeline.builder()
            .use_telemetry(**sdk)
            .use_ordered_failover([client()], **sdk)
            .build(),
        ),
    ]


async def drain(client: ChatClient, messages: list[ChatMessage]) -> None:
    async for _ in client.get_streaming_response(messages):
        pass


async def sdk_floor(ops: int) -> float:
    """The SDK's own cost for what the layer records: one CLIENT span with the same
    attributes, made current and ended, and one histogram record."""
    sdk = recording_providers()
    tracer = sdk["tracer_provider"].get_tracer("floor")  # type: ignore[attr-defined]
    histogram = sdk["meter_provider"].get_meter("floor").create_histogram("h", unit="s")  # type: ignore[attr-defined]
    start = {
        "gen_ai.operation.name": "chat",
        "gen_ai.system": "scripted",
        "gen_ai.request.model": "scripted-model",
    }
    end = {
        "gen_ai.response.id": "r",
        "gen_ai.response.model": "scripted-model",
        "gen_ai.response.finish_reasons": ("stop",),
    }

    async def one() -> None:
        span = tracer.start_span("chat scripted-model", kind=SpanKind.CLIENT, attributes=start)
        token = otel_context.attach(trace.set_span_in_context(span))
        otel_context.detach(token)
        span.set_attributes(end)
        span.end()
        histogram.record(0.001, start)

    return await best_per_op(one, ops=ops)


async def main(calls: int, updates: int) -> None:
    messages = [ChatMessage.user("hello")]
    print(f"get_response, {calls} calls, best of 5")
    rows = pipelines(["ok"])
    base = await best_per_op(lambda: rows[0][1].get_response(messages), ops=calls)
    for label, client in rows:
        t = await best_per_op(lambda c=client: c.get_response(messages), ops=calls)
        print(report(label, base, t))
    floor = await sdk_floor(calls)
    print(f"{'(SDK alone: one span + one histogram record)':<46} {floor * 1e6:8.2f} us")

    chunks = ["x"] * 1000
    streams = max(1, updates // len(chunks))
    rows = pipelines(chunks)
    print(f"\nget_streaming_response, {streams} streams x {len(chunks)} updates, best of 5")
    base = await best_per_op(lambda: drain(rows[0][1], messages), ops=streams) / len(chunks)
    for label, client in rows:
        t = await best_per_op(lambda c=client: drain(c, messages), ops=streams) / len(chunks)
        print(report(label, base, t, "update"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--updates", type=int, default=200_000)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.updates))
