"""Overhead of telemetry: no SDK (the API is a no-op) and an SDK recording every span.

Baseline: the same pipeline without a telemetry layer, measured in the same run. The
recording SDK uses a BatchSpanProcessor with an exporter that drops spans (the work of
recording without the noise of a network) and a metric reader that is never collected.

The issue's measure, "telemetry cost per call as a ratio to the SDK's own floor": what a
telemetry layer (and a router's attempt spans) add per call with the SDK recording, divided
by the cost of making exactly the same spans (names, kinds, attributes at start and at end,
status, nesting made current) and the same metric records directly through the SDK. The
floor is derived from a captured call, so it follows the layers when their spans change.

    python benchmarks/bench_telemetry.py [--calls 10000] [--updates 200000]
    python benchmarks/bench_telemetry.py --instructions 300   # the floor ratios, in
                                                             # instructions (valgrind)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import SpanKind, Status, StatusCode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import best_per_op, report

from middleware.routing import Route
from pipeline import ChatClient, ChatMessage, ChatPipeline
from pipeline.errors import TransientProviderError
from pipeline.testing import ScriptedChatClient, fail, reply


class DropExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


# Under callgrind the batch processor's timer thread would export at moments set by wall
# time, so counts would move from run to run: instruction counts use a synchronous processor.
SYNCHRONOUS = False


def recording_providers() -> dict[str, object]:
    tracer_provider = TracerProvider()
    processor = SimpleSpanProcessor if SYNCHRONOUS else BatchSpanProcessor
    tracer_provider.add_span_processor(processor(DropExporter()))
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


@dataclass
class SpanStep:
    """One span as the layers made it: start attributes, attributes added at the end, the
    spans made under it and the metric records made while it was the current span (which
    matters: a record under a sampled span offers an exemplar)."""

    name: str
    kind: SpanKind
    start: dict[str, Any]
    end: dict[str, Any]
    error: bool
    children: list[SpanStep] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)


@dataclass
class Record:
    """One metric record: instrument kind, name, unit, bucket advice, value, attributes."""

    kind: str
    name: str
    unit: str
    bounds: tuple[float, ...] | None
    value: float
    attributes: dict[str, Any]


class _Capture(SpanProcessor):
    """Keeps each span's attributes as they were at start, and every ended span."""

    def __init__(self) -> None:
        self.at_start: dict[int, dict[str, Any]] = {}
        self.ended: list[ReadableSpan] = []

    def on_start(self, span: Span, parent_context: object = None) -> None:
        self.at_start[span.context.span_id] = dict(span.attributes or {})

    def on_end(self, span: ReadableSpan) -> None:
        self.ended.append(span)


async def capture(
    client_factory: Callable[[dict[str, Any]], ChatClient],
) -> tuple[list[SpanStep], list[Record]]:
    """The spans and metric records of one `get_response` through the pipeline the factory
    builds on capturing providers: what the floor replays."""
    spans = _Capture()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(spans)
    reader = InMemoryMetricReader()
    client = client_factory(
        {
            "tracer_provider": tracer_provider,
            "meter_provider": MeterProvider(metric_readers=[reader]),
        }
    )
    await client.get_response([ChatMessage.user("hello")])
    steps: dict[int, SpanStep] = {}
    roots: list[SpanStep] = []
    for span in sorted(spans.ended, key=lambda s: s.start_time or 0):
        assert span.context is not None
        start = spans.at_start[span.context.span_id]
        everything = dict(span.attributes or {})
        step = SpanStep(
            span.name,
            span.kind,
            start,
            {k: v for k, v in everything.items() if k not in start or start[k] != v},
            span.status.status_code is StatusCode.ERROR,
        )
        steps[span.context.span_id] = step
        parent = steps.get(span.parent.span_id) if span.parent is not None else None
        (parent.children if parent is not None else roots).append(step)
    records: list[Record] = []
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    if isinstance(point, HistogramDataPoint):
                        assert point.count == 1, "one call records each series once"
                        kind, value, bounds = "histogram", point.sum, tuple(point.explicit_bounds)
                    else:
                        kind, value, bounds = "counter", float(point.value), None  # type: ignore[union-attr]
                    attributes = dict(point.attributes or {})
                    record = Record(kind, metric.name, metric.unit or "", bounds, value, attributes)
                    # The default exemplar filter keeps the span current at record time.
                    under = [e.span_id for e in point.exemplars or () if e.span_id in steps]
                    (steps[under[0]].records if under else records).append(record)
    return roots, records


def sdk_floor(roots: list[SpanStep], records: list[Record]) -> Callable[[], None]:
    """One call's worth of the same spans and records, made directly through the SDK: each
    span started with its start attributes, made current and detached (as the layers do
    while the layers beneath run), given its end attributes and status, ended; each metric
    record made on an instrument of the same kind, unit and bucket advice, under the span
    that was current when the layers made it."""
    sdk = recording_providers()
    tracer = sdk["tracer_provider"].get_tracer("floor")  # type: ignore[attr-defined]
    meter = sdk["meter_provider"].get_meter("floor")  # type: ignore[attr-defined]
    instruments: dict[str, Any] = {}

    def every(steps: list[SpanStep]) -> list[Record]:
        return [r for step in steps for r in step.records + every(step.children)]

    for r in records + every(roots):
        if r.name not in instruments:
            instruments[r.name] = (
                meter.create_counter(r.name, unit=r.unit)
                if r.kind == "counter"
                else meter.create_histogram(
                    r.name, unit=r.unit, explicit_bucket_boundaries_advisory=r.bounds
                )
            )

    def calls(records: list[Record]) -> list[tuple[Callable[..., None], float, dict[str, Any]]]:
        return [
            (
                getattr(instruments[r.name], "add" if r.kind == "counter" else "record"),
                r.value,
                r.attributes,
            )
            for r in records
        ]

    outside = calls(records)
    inside = {id(step): calls(step.records) for step in _walk(roots)}
    error = Status(StatusCode.ERROR)

    def run(step: SpanStep) -> None:
        span = tracer.start_span(step.name, kind=step.kind, attributes=step.start)
        token = otel_context.attach(trace.set_span_in_context(span))
        for child in step.children:
            run(child)
        for call, value, attributes in inside[id(step)]:
            call(value, attributes)
        otel_context.detach(token)
        if step.end:
            span.set_attributes(step.end)
        if step.error:
            span.set_status(error)
        span.end()

    def one() -> None:
        for root in roots:
            run(root)
        for call, value, attributes in outside:
            call(value, attributes)

    return one


def _client(name: str = "scripted") -> ScriptedChatClient:
    return ScriptedChatClient(reply("ok"), name=name)


def _failing(name: str) -> ScriptedChatClient:
    return ScriptedChatClient(fail(TransientProviderError()), name=name)


# (label, the pipeline on given providers, the same pipeline with no telemetry layer and
# no SDK: the router's attempt spans then go to the no-op API, as without telemetry).
FLOOR_CASES: list[tuple[str, Callable[[dict[str, Any]], ChatClient], Callable[[], ChatClient]]] = [
    (
        "telemetry layer",
        lambda p: ChatPipeline.builder().use_telemetry(**p).build(_client()),
        lambda: ChatPipeline.builder().build(_client()),
    ),
    (
        "telemetry + failover, one route",
        lambda p: (
            ChatPipeline.builder()
            .use_telemetry(**p)
            .use_ordered_failover([Route("a", _client())], **p)
            .build()
        ),
        lambda: ChatPipeline.builder().use_ordered_failover([Route("a", _client())]).build(),
    ),
    (
        "telemetry + failover, a fallback",
        lambda p: (
            ChatPipeline.builder()
            .use_telemetry(**p)
            .use_ordered_failover([Route("a", _failing("a")), Route("b", _client("b"))], **p)
            .build()
        ),
        lambda: (
            ChatPipeline.builder()
            .use_ordered_failover([Route("a", _failing("a")), Route("b", _client("b"))])
            .build()
        ),
    ),
]


async def floor_ratios(calls: int) -> None:
    """Telemetry cost per call with the SDK recording, against the SDK's own floor."""
    print(
        f"\nTelemetry cost per get_response with the SDK recording ({calls} calls, best of 3x3,"
        " process CPU time):"
        "\n  added = the pipeline with telemetry and a recording SDK - the same pipeline without;"
        "\n  floor = the same spans, attributes and metric records made directly through the"
        "\n  SDK, after each call of the pipeline without telemetry (so the SDK's code runs in"
        "\n  the same company as in the layers) - that pipeline alone; alone: the replay by"
        "\n  itself in a tight loop. Target: added / floor <= 1.10"
    )
    for label, factory, plain_factory in FLOOR_CASES:
        await _floor_case(label, factory, plain_factory, calls)


async def _floor_case(
    label: str,
    factory: Callable[[dict[str, Any]], ChatClient],
    plain_factory: Callable[[], ChatClient],
    calls: int,
) -> None:
    messages = [ChatMessage.user("hello")]
    roots, records = await capture(factory)
    spans = len(_walk(roots))
    n_records = len(records) + sum(len(s.records) for s in _walk(roots))
    recorded = factory(recording_providers())
    plain = plain_factory()
    replay = sdk_floor(roots, records)

    async def with_sdk() -> None:
        await recorded.get_response(messages)

    async def without() -> None:
        await plain.get_response(messages)

    async def without_and_floor() -> None:
        await plain.get_response(messages)
        replay()

    async def floor_alone() -> None:
        replay()

    ops = {
        "with": with_sdk,
        "without": without,
        "without+floor": without_and_floor,
        "alone": floor_alone,
    }
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(3):  # interleaved rounds: drift hits all of them alike
        for key, op in ops.items():
            measured = await best_per_op(op, ops=calls, repeats=3, clock=time.process_time)
            best[key] = min(best[key], measured)
    added = best["with"] - best["without"]
    floor = best["without+floor"] - best["without"]
    print(
        f"  {label:<34} added {added * 1e6:7.2f} us  floor {floor * 1e6:7.2f} us"
        f"  ratio {added / floor:5.2f}   (floor alone {best['alone'] * 1e6:6.2f} us,"
        f" ratio {added / best['alone']:4.2f}; {spans} spans, {n_records} records)"
    )


def _walk(steps: list[SpanStep]) -> list[SpanStep]:
    return [s for step in steps for s in [step, *_walk(step.children)]]


async def main(calls: int, updates: int) -> None:
    messages = [ChatMessage.user("hello")]
    print(f"get_response, {calls} calls, best of 5")
    rows = pipelines(["ok"])
    base = await best_per_op(lambda: rows[0][1].get_response(messages), ops=calls)
    for label, client in rows:
        t = await best_per_op(lambda c=client: c.get_response(messages), ops=calls)
        print(report(label, base, t))
    await floor_ratios(calls)

    chunks = ["x"] * 1000
    streams = max(1, updates // len(chunks))
    rows = pipelines(chunks)
    print(f"\nget_streaming_response, {streams} streams x {len(chunks)} updates, best of 5")
    base = await best_per_op(lambda: drain(rows[0][1], messages), ops=streams) / len(chunks)
    for label, client in rows:
        t = await best_per_op(lambda c=client: drain(c, messages), ops=streams) / len(chunks)
        print(report(label, base, t, "update"))


async def run_variant(case: int, variant: str, calls: int) -> None:
    """`calls` get_response calls of one variant, untimed (for instruction counting)."""
    global SYNCHRONOUS
    SYNCHRONOUS = True
    _, factory, plain_factory = FLOOR_CASES[case]
    roots, records = await capture(factory)  # in every variant: the same start-up work
    if variant == "floor":
        replay = sdk_floor(roots, records)
        for _ in range(calls):
            replay()
        return
    client = factory(recording_providers()) if variant == "with" else plain_factory()
    messages = [ChatMessage.user("hello")]
    for _ in range(calls):
        await client.get_response(messages)


def instruction_ratios(calls: int) -> None:
    """The floor ratio in instructions (valgrind's callgrind): independent of other load on
    the machine. Each variant runs twice, with `calls` and 4x `calls` calls; the difference
    cancels the interpreter's start-up. Spans go through a synchronous processor here (and
    hash seeds are fixed), so nothing in a run depends on wall time."""
    import os
    import re
    import shutil
    import subprocess

    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")

    def count(case: int, variant: str, n: int) -> int:
        done = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
             __file__, "--run-variant", str(case), variant, str(n)],
            capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )  # fmt: skip
        found = re.search(r"Collected : (\d+)", done.stderr)
        assert found, done.stderr[-2000:]
        return int(found.group(1))

    print(
        f"Telemetry cost per get_response with the SDK recording, in instructions"
        f" ({calls} vs {4 * calls} calls under callgrind); target: added / floor <= 1.10"
    )
    for case, (label, _, _) in enumerate(FLOOR_CASES):
        per_call = {
            variant: (count(case, variant, 4 * calls) - count(case, variant, calls)) / (3 * calls)
            for variant in ("with", "without", "floor")
        }
        added = per_call["with"] - per_call["without"]
        print(
            f"  {label:<34} added {added:9.0f}  floor {per_call['floor']:9.0f}"
            f"  ratio {added / per_call['floor']:5.2f}  (instructions per call)"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--updates", type=int, default=200_000)
    parser.add_argument(
        "--instructions",
        type=int,
        metavar="CALLS",
        help="only the floor ratios, counted in instructions under valgrind (e.g. 300)",
    )
    parser.add_argument("--run-variant", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_variant:
        case, variant, n = args.run_variant
        asyncio.run(run_variant(int(case), variant, int(n)))
    elif args.instructions:
        instruction_ratios(args.instructions)
    else:
        asyncio.run(main(args.calls, args.updates))
