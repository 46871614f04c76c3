"""Pipelines and span checks the adapter suites share."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan

from pipeline import ChatPipeline, ChatResponseUpdate
from pipeline.client import ChatClient
from pipeline.types import ChatMessage, ChatOptions, ChatResponse, ChatRole, TextContent
from pipeline.types import FunctionResultContent as Result
from tests.otel import Otel

CANARY = "CANARY-7c41"


def failover(routes: Sequence[ChatClient], otel: Otel, *, telemetry: bool = True) -> ChatPipeline:
    """An ordered failover over `routes`, with a telemetry layer on top unless told not,
    recording into `otel`."""
    builder = ChatPipeline.builder(**otel.providers)
    if telemetry:
        builder.use_telemetry()
    return builder.use_ordered_failover(routes).build(name="agents")


def outcomes(otel: Otel) -> list[tuple[str, str]]:
    """(route, outcome) of every attempt span, in the order they ended."""
    return [
        (
            str(s.attributes["chat_pipeline.route.name"]),
            str(s.attributes["chat_pipeline.route.outcome"]),
        )
        for s in otel.attempt_spans()
        if s.attributes is not None
    ]


def ancestors(span: ReadableSpan, spans: Sequence[ReadableSpan]) -> list[ReadableSpan]:
    """`span`'s parents, nearest first (within `spans`)."""
    by_id = {s.context.span_id: s for s in spans}
    chain: list[ReadableSpan] = []
    parent = span.parent
    while parent is not None and parent.span_id in by_id and len(chain) < 64:
        current = by_id[parent.span_id]
        chain.append(current)
        parent = current.parent
    return chain


def pipeline_exports(otel: Otel) -> list[str]:
    """Every string the pipeline's own spans and metrics would export (its instrumentation
    scopes are ``chat_pipeline.*``)."""
    exported: list[str] = []
    for span in otel.finished():
        scope = span.instrumentation_scope
        if scope is None or not scope.name.startswith("chat_pipeline"):
            continue
        exported.append(span.name)
        exported.append(repr(dict(span.attributes or {})))
        exported.append(span.status.description or "")
        for event in span.events:
            exported.append(event.name)
            exported.append(repr(dict(event.attributes or {})))
    data = otel.reader.get_metrics_data()
    for resource in data.resource_metrics if data else []:
        for scope_metrics in resource.scope_metrics:
            for metric in scope_metrics.metrics:
                exported.append(metric.name)
                for point in metric.data.data_points:
                    exported.append(repr(dict(point.attributes or {})))
    return exported


class ToolRunningClient:
    """A client that answers with a tool result, as a pipeline that runs tools itself
    would (behind a router the adapters cannot look into)."""

    metadata = None

    async def get_response(
        self, messages: object, options: ChatOptions | None = None
    ) -> ChatResponse:
        return ChatResponse(
            messages=[ChatMessage(ChatRole.TOOL, [Result("c1", "ran")]), ChatMessage.assistant("x")]
        )

    async def get_streaming_response(self, messages: object, options: ChatOptions | None = None):  # type: ignore[no-untyped-def]
        yield ChatResponseUpdate(role=ChatRole.TOOL, contents=[Result("c1", "ran")])
        yield ChatResponseUpdate(contents=[TextContent("x")])

    async def aclose(self) -> None:
        return None
