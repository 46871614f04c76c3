"""Attempt spans and routing metrics for every failure boundary, both call shapes."""

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, Sampler, SamplingResult
from opentelemetry.trace import StatusCode

from middleware.routing import OrderedFailoverChatClient, Price, Route, RoutingChatClient
from pipeline import ChatPipeline, UsageDetails
from pipeline.errors import TransientProviderError
from pipeline.testing import ScriptedChatClient, collect, fail, fail_after, hang, reply
from pipeline.types import ChatMessage, ChatResponse, ChatResponseUpdate, TextContent
from tests.otel import Otel
from tests.processes import run_python


def router(otel: Otel, *scripts: object, **options: object) -> OrderedFailoverChatClient:
    clients = [ScriptedChatClient(s, name=f"r{i}") for i, s in enumerate(scripts)]  # type: ignore[arg-type]
    return OrderedFailoverChatClient(clients, **otel.providers, **options)  # type: ignore[arg-type]


def summary(otel: Otel) -> list[tuple[str, object, object, object]]:
    return [
        (
            s.name,
            (s.attributes or {}).get("chat_pipeline.route.outcome"),
            (s.attributes or {}).get("chat_pipeline.route.output_committed"),
            (s.attributes or {}).get("chat_pipeline.route.terminal"),
        )
        for s in otel.attempt_spans()
    ]


async def test_success_is_one_completed_attempt(otel: Otel, streaming: bool) -> None:
    result = await collect(router(otel, reply("ok"), reply("b")), "hi", streaming=streaming)
    assert result.text == "ok"
    assert summary(otel) == [("route_attempt r0", "completed", True, True)]
    (span,) = otel.attempt_spans()
    attributes = dict(span.attributes or {})
    assert (
        attributes["chat_pipeline.route.name"] == "r0"
        and attributes["chat_pipeline.route.attempt"] == 1
    )
    assert attributes["chat_pipeline.route.duration"] >= 0
    assert attributes["chat_pipeline.route.time_to_first_update"] >= 0
    assert "error.type" not in attributes
    assert (
        otel.total(
            "chat_pipeline.route.attempt.count", **{"chat_pipeline.route.outcome": "completed"}
        )
        == 1
    )
    assert otel.total("chat_pipeline.route.backup_calls") == 0


async def test_failure_before_output_is_two_attempts(otel: Otel, streaming: bool) -> None:
    chat = router(otel, fail(TransientProviderError()), reply("b"))
    assert (await collect(chat, "hi", streaming=streaming)).text == "b"
    assert summary(otel) == [
        ("route_attempt r0", "failed_before_output", False, False),
        ("route_attempt r1", "completed", True, True),
    ]
    first = otel.attempt_spans()[0]
    assert first.status.status_code is StatusCode.ERROR and not first.status.description
    assert (first.attributes or {})["error.type"] == "TransientProviderError"
    assert otel.total("chat_pipeline.route.attempt.count") == 2
    assert otel.total("chat_pipeline.route.backup_calls", **{"chat_pipeline.route.name": "r1"}) == 1


async def test_failure_after_output_commits_and_calls_no_backup(otel: Otel) -> None:
    chat = router(otel, fail_after(["partial"], TransientProviderError()), reply("b"))
    result = await collect(chat, "hi", streaming=True)
    assert isinstance(result.error, TransientProviderError)
    assert summary(otel) == [("route_attempt r0", "failed_after_output", True, True)]
    assert otel.total("chat_pipeline.route.backup_calls") == 0
    assert (
        otel.total(
            "chat_pipeline.route.output_committed_failures", **{"chat_pipeline.route.name": "r0"}
        )
        == 1
    )


async def test_cancellation_is_canceled_with_no_backup(otel: Otel, streaming: bool) -> None:
    primary = ScriptedChatClient(hang(), name="r0")
    chat = OrderedFailoverChatClient([primary, ScriptedChatClient(name="r1")], **otel.providers)
    task = asyncio.create_task(collect(chat, "hi", streaming=streaming))
    await primary.wait_for_calls(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert summary(otel) == [("route_attempt r0", "canceled", False, True)]
    assert otel.attempt_spans()[0].status.status_code is not StatusCode.ERROR
    assert otel.total("chat_pipeline.route.backup_calls") == 0


async def test_abandoned_stream(otel: Otel) -> None:
    chat = router(otel, reply("abc", chunks=["a", "b", "c"]))
    async with contextlib.aclosing(chat.get_streaming_response("hi")) as stream:
        await anext(stream)
    assert summary(otel) == [("route_attempt r0", "abandoned", True, True)]


async def test_attempt_spans_nest_under_the_chat_span(otel: Otel, streaming: bool) -> None:
    primary = ScriptedChatClient(fail(TransientProviderError()), name="p")
    backup = ScriptedChatClient(reply("b"), name="b")
    chat = (
        ChatPipeline.builder()
        .use_telemetry(**otel.providers)
        .use_ordered_failover([primary, backup], **otel.providers)
        .build()
    )
    await collect(chat, "hi", streaming=streaming)
    spans = otel.finished()
    (chat_span,) = [s for s in spans if s.name.startswith("chat")]
    attempts = otel.attempt_spans()
    assert len(attempts) == 2
    assert all(
        a.parent is not None and a.parent.span_id == chat_span.context.span_id for a in attempts
    )
    assert all(a.context.trace_id == chat_span.context.trace_id for a in attempts)


async def test_retry_events_land_on_the_attempt_span(otel: Otel, streaming: bool) -> None:
    async def no_sleep(_: float) -> None:
        return None

    inner = ScriptedChatClient([fail(TransientProviderError()), reply("ok")], name="inner")
    route = ChatPipeline.builder().use_retry(sleep=no_sleep).build(inner)
    chat = OrderedFailoverChatClient([Route("retried", route)], **otel.providers)
    await collect(chat, "hi", streaming=streaming)
    (span,) = otel.attempt_spans()
    assert [e.name for e in span.events] == ["chat_pipeline.retry"]


async def test_one_shot_router_reports_attempt_one_terminal(otel: Otel, streaming: bool) -> None:
    client = ScriptedChatClient(name="only")
    chat = RoutingChatClient.create(lambda c: client, **otel.providers)
    await collect(chat, "hi", streaming=streaming)
    assert summary(otel) == [("route_attempt only", "completed", True, True)]


async def test_cost_when_a_route_has_prices(otel: Otel, streaming: bool) -> None:
    client = ScriptedChatClient(reply("ok", usage=UsageDetails(1000, 500, 1500)))
    route = Route("priced", client, price=Price(input_per_million=2.0, output_per_million=8.0))
    chat = OrderedFailoverChatClient([route], **otel.providers)
    await collect(chat, "hi", streaming=streaming)
    assert otel.total(
        "chat_pipeline.route.cost", **{"chat_pipeline.route.name": "priced"}
    ) == pytest.approx(0.006)


class _DropChatRoots(Sampler):
    """Samples every root span except a `chat` one: shows whether children inherit."""

    def should_sample(
        self,
        parent_context,
        trace_id,
        name,
        kind=None,
        attributes=None,
        links=None,
        trace_state=None,
    ):  # type: ignore[no-untyped-def]
        decision = Decision.DROP if name.startswith("chat") else Decision.RECORD_AND_SAMPLE
        return SamplingResult(decision)

    def get_description(self) -> str:
        return "DropChatRoots"


async def test_a_sampled_out_request_keeps_its_attempts_out_too(streaming: bool) -> None:
    spans = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(root=_DropChatRoots()))
    provider.add_span_processor(SimpleSpanProcessor(spans))
    chat = (
        ChatPipeline.builder()
        .use_telemetry(tracer_provider=provider)
        .use_ordered_failover(
            [ScriptedChatClient(fail(TransientProviderError()), name="a"), ScriptedChatClient()],
            tracer_provider=provider,
        )
        .build()
    )
    assert (await collect(chat, "hi", streaming=streaming)).error is None
    # The attempts inherit the chat span's "not sampled": none starts a trace of its own.
    assert spans.get_finished_spans() == ()


def routed(otel: Otel, *clients: ScriptedChatClient, **options: object) -> ChatPipeline:
    """The README's setup: telemetry above an ordered failover router."""
    return (
        ChatPipeline.builder(**otel.providers)
        .use_telemetry()
        .use_ordered_failover(list(clients), **options)  # type: ignore[arg-type]
        .build()
    )


async def test_the_root_span_tells_which_route_served(otel: Otel, streaming: bool) -> None:
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai

    primary = ScriptedChatClient(
        fail(TransientProviderError()), name="primary", model_id="big", provider_name="openai"
    )
    backup = ScriptedChatClient(
        reply("ok", usage=UsageDetails(2, 3, 5)),
        name="backup",
        model_id="small",
        provider_name="anthropic",
    )
    chat = routed(otel, primary, backup)
    assert (await collect(chat, "hi", streaming=streaming)).text == "ok"
    (root,) = [s for s in otel.finished() if s.parent is None]
    attributes = dict(root.attributes or {})
    assert root.name == "chat small"
    assert attributes[gen_ai.GEN_AI_SYSTEM] == "anthropic"
    assert attributes[gen_ai.GEN_AI_REQUEST_MODEL] == "small"
    assert attributes["chat_pipeline.route.name"] == "backup"
    assert attributes["chat_pipeline.route.attempts"] == 2
    assert attributes["chat_pipeline.route.fallback"] is True
    first, second = otel.attempt_spans()
    assert dict(first.attributes or {})[gen_ai.GEN_AI_SYSTEM] == "openai"
    assert dict(first.attributes or {})[gen_ai.GEN_AI_REQUEST_MODEL] == "big"
    assert gen_ai.GEN_AI_RESPONSE_MODEL not in dict(first.attributes or {})
    assert dict(second.attributes or {})[gen_ai.GEN_AI_RESPONSE_MODEL] == "small"
    # Metrics carry the served route's provider, never "router".
    ((labels, count),) = otel.points("gen_ai.client.operation.duration")
    assert labels[gen_ai.GEN_AI_SYSTEM] == "anthropic" and count == 1


async def test_a_caller_named_model_names_the_root_span(otel: Otel, streaming: bool) -> None:
    from pipeline import ChatOptions

    only = ScriptedChatClient(reply("ok"), name="only", model_id="default-model")
    chat = routed(otel, only)
    await collect(chat, "hi", ChatOptions(model_id="asked"), streaming=streaming)
    (root,) = [s for s in otel.finished() if s.parent is None]
    assert root.name == "chat asked"
    assert dict(root.attributes or {})["chat_pipeline.route.fallback"] is False


async def test_cancellation_is_recorded_one_way(otel: Otel, streaming: bool) -> None:
    primary = ScriptedChatClient(hang(), name="primary")
    chat = routed(otel, primary, ScriptedChatClient(reply("never"), name="backup"))
    task = asyncio.create_task(collect(chat, "hi", streaming=streaming))
    await primary.wait_for_calls(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    root, attempt = sorted(otel.finished(), key=lambda s: s.parent is not None)
    for span in (root, attempt):
        assert span.status.status_code is StatusCode.UNSET
        assert "error.type" not in dict(span.attributes or {})
    assert dict(root.attributes or {})["chat_pipeline.request.end"] == "canceled"
    assert dict(attempt.attributes or {})["chat_pipeline.route.outcome"] == "canceled"
    # An unfinished request does not count in the duration histogram.
    assert otel.points("gen_ai.client.operation.duration") == []


async def test_an_abandoned_stream_is_not_an_error(otel: Otel) -> None:
    chat = routed(otel, ScriptedChatClient(reply("abc", chunks=["a", "b", "c"]), name="r"))
    async with contextlib.aclosing(chat.get_streaming_response("hi")) as stream:
        await anext(stream)
    root, attempt = sorted(otel.finished(), key=lambda s: s.parent is not None)
    assert dict(root.attributes or {})["chat_pipeline.request.end"] == "abandoned"
    assert dict(attempt.attributes or {})["chat_pipeline.route.outcome"] == "abandoned"
    assert all(s.status.status_code is StatusCode.UNSET for s in (root, attempt))


async def test_attempts_are_counted_without_a_tracer_provider(otel: Otel, streaming: bool) -> None:
    # The global tracer with no provider set: no span is made, the metrics still count.
    clients = [
        ScriptedChatClient(fail(TransientProviderError()), name="r0"),
        ScriptedChatClient(reply("b"), name="r1"),
    ]
    chat = OrderedFailoverChatClient(clients, meter_provider=otel.meter_provider)
    result = await collect(chat, "hi", streaming=streaming)
    assert result.text == "b"
    assert otel.attempt_spans() == []
    assert otel.total("chat_pipeline.route.attempt.count") == 2
    assert otel.total("chat_pipeline.route.backup_calls") == 1


_GLOBAL_PROVIDERS_SET_LATER = """
import asyncio
from opentelemetry import metrics, trace
from middleware.routing import OrderedFailoverChatClient
from pipeline.testing import ScriptedChatClient, reply
from tests.otel import make_otel

async def main() -> None:
    chat = OrderedFailoverChatClient([ScriptedChatClient([reply("a"), reply("b")], name="r0")])
    await chat.get_response("hi")  # no providers yet: nothing to record
    otel = make_otel()
    trace.set_tracer_provider(otel.tracer_provider)
    metrics.set_meter_provider(otel.meter_provider)
    with trace.get_tracer("test").start_as_current_span("caller") as caller:
        await chat.get_response("hi")
    spans = {s.name: s for s in otel.finished()}
    attempt = spans["route_attempt r0"]
    assert len(spans) == 2, sorted(spans)
    assert attempt.parent is not None
    assert attempt.parent.span_id == caller.get_span_context().span_id
    assert otel.total("chat_pipeline.route.attempt.count") == 1
    print("traced and counted")

asyncio.run(main())
"""


def test_global_providers_set_later_trace_and_count_the_attempts_after_them() -> None:
    # A global provider can be set once per process: its own process.
    assert run_python(_GLOBAL_PROVIDERS_SET_LATER) == "traced and counted"


class _NamingModels:
    """A route whose stream names a model on each update, as Chat Completions streams do,
    and another one partway through."""

    async def get_response(self, messages: object, options: object = None) -> ChatResponse:
        return ChatResponse(messages=[ChatMessage.assistant("ab")], model_id="m-2")

    async def get_streaming_response(
        self, messages: object, options: object = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        for model in ("m-1", "m-1", "m-2", None):
            yield ChatResponseUpdate(contents=[TextContent("a")], model_id=model)

    async def aclose(self) -> None:
        return None


async def test_the_attempt_span_names_the_last_model_the_answer_named(
    otel: Otel, streaming: bool
) -> None:
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai

    chat = OrderedFailoverChatClient([_NamingModels()], **otel.providers)  # type: ignore[list-item]
    await collect(chat, "hi", streaming=streaming)
    (span,) = otel.attempt_spans()
    assert dict(span.attributes or {})[gen_ai.GEN_AI_RESPONSE_MODEL] == "m-2"
