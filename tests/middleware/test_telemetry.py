import contextlib
import json
import logging
import subprocess
import sys

import pytest
from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.trace import SpanKind, StatusCode

from middleware.telemetry import TelemetryChatClient
from pipeline import (
    ChatMessage,
    ChatOptions,
    ChatPipeline,
    FunctionCallContent,
    FunctionResultContent,
    UsageDetails,
)
from pipeline.errors import TransientProviderError
from pipeline.providers import OpenAIChatClient
from pipeline.testing import (
    FakeOpenAIServer,
    FakeResponse,
    ScriptedChatClient,
    collect,
    fail,
    fail_after,
    reply,
)
from tests.otel import Otel


def chat(otel: Otel, script: object, **client: object) -> ChatPipeline:
    inner = ScriptedChatClient(script, model_id="m-1", **client)  # type: ignore[arg-type]
    return ChatPipeline.builder().use_telemetry(**otel.providers).build(inner)


async def test_chat_span_with_genai_attributes(otel: Otel, streaming: bool) -> None:
    pipeline = chat(otel, reply("ab", chunks=["a", "b"], usage=UsageDetails(3, 4, 7)))
    options = ChatOptions(model_id="m-2", temperature=0.5, max_output_tokens=10, seed=1)
    await collect(pipeline, "hi", options, streaming=streaming)
    (span,) = otel.finished()
    assert span.name == "chat m-2" and span.kind is SpanKind.CLIENT
    attributes = dict(span.attributes or {})
    assert attributes[gen_ai.GEN_AI_OPERATION_NAME] == "chat"
    assert attributes[gen_ai.GEN_AI_SYSTEM] == "scripted"
    assert attributes[gen_ai.GEN_AI_REQUEST_MODEL] == "m-2"
    assert attributes[gen_ai.GEN_AI_REQUEST_TEMPERATURE] == 0.5
    assert attributes[gen_ai.GEN_AI_REQUEST_MAX_TOKENS] == 10
    assert attributes[gen_ai.GEN_AI_RESPONSE_MODEL] == "m-2"
    assert attributes[gen_ai.GEN_AI_RESPONSE_ID] == "scripted-1"
    assert attributes[gen_ai.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert attributes[gen_ai.GEN_AI_USAGE_INPUT_TOKENS] == 3
    assert attributes[gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS] == 4
    assert otel.total("gen_ai.client.operation.duration") == 1
    assert otel.total("gen_ai.client.token.usage", **{gen_ai.GEN_AI_TOKEN_TYPE: "input"}) == 1
    assert otel.total("gen_ai.client.operation.time_to_first_chunk") == (1 if streaming else 0)


async def test_failure_records_type_only(otel: Otel, streaming: bool) -> None:
    pipeline = chat(otel, fail_after(["a"], TransientProviderError("CANARY-detail")))
    result = await collect(pipeline, "hi", streaming=streaming)
    assert isinstance(result.error, TransientProviderError)
    (span,) = otel.finished()
    assert span.status.status_code is StatusCode.ERROR and span.status.description is None
    assert (span.attributes or {})["error.type"] == "TransientProviderError"
    assert span.events == ()
    ((labels, count),) = otel.points("gen_ai.client.operation.duration")
    assert labels["error.type"] == "TransientProviderError" and count == 1


async def test_abandoned_stream_ends_the_span_without_error(otel: Otel) -> None:
    inner = ScriptedChatClient(reply("abc", chunks=["a", "b", "c"]))
    pipeline = ChatPipeline.builder().use_telemetry(**otel.providers).build(inner)
    async with contextlib.aclosing(pipeline.get_streaming_response("hi")) as stream:
        await anext(stream)
    (span,) = otel.finished()
    assert span.status.status_code is not StatusCode.ERROR
    assert inner.streams_abandoned == 1


@pytest.mark.parametrize(
    "script",
    [reply("ab", chunks=["a", "b"]), fail_after(["a"], TransientProviderError("x"))],
    ids=["completed", "failed"],
)
async def test_no_span_stays_current_after_a_request(
    otel: Otel, streaming: bool, script: object
) -> None:
    # A leaked span would make the caller's next request a child of this one.
    pipeline = chat(otel, [script, reply("c")])
    await collect(pipeline, "hi", streaming=streaming)
    assert not trace.get_current_span().get_span_context().is_valid
    await collect(pipeline, "again", streaming=streaming)
    first, second = otel.finished()
    assert first.parent is None and second.parent is None
    assert first.context.trace_id != second.context.trace_id


async def test_request_attributes_never_leak_between_requests(otel: Otel, streaming: bool) -> None:
    # Requests without numbers share one start-attribute dict: a request with numbers,
    # and what the end of a request adds, must not reach the next one.
    pipeline = chat(otel, reply("ab", chunks=["a", "b"], usage=UsageDetails(3, 4, 7)))
    await collect(pipeline, "hi", ChatOptions(temperature=0.5), streaming=streaming)
    await collect(pipeline, "hi", streaming=streaming)
    await collect(pipeline, "hi", ChatOptions(session_id="s"), streaming=streaming)
    first, second, third = (dict(span.attributes or {}) for span in otel.finished())
    assert first[gen_ai.GEN_AI_REQUEST_TEMPERATURE] == 0.5
    for later in (second, third):
        assert gen_ai.GEN_AI_REQUEST_TEMPERATURE not in later
        assert later[gen_ai.GEN_AI_REQUEST_MODEL] == "m-1"
    assert second.pop(gen_ai.GEN_AI_RESPONSE_ID) != third.pop(gen_ai.GEN_AI_RESPONSE_ID)
    assert second == third


async def test_no_span_stays_current_after_an_abandoned_stream(otel: Otel) -> None:
    pipeline = chat(otel, reply("abc", chunks=["a", "b", "c"]))
    async with contextlib.aclosing(pipeline.get_streaming_response("hi")) as stream:
        await anext(stream)
        assert not trace.get_current_span().get_span_context().is_valid
    assert not trace.get_current_span().get_span_context().is_valid


async def test_latest_experimental_names(otel: Otel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "http, gen_ai_latest_experimental")
    await collect(chat(otel, reply("a")), "hi", streaming=True)
    attributes = dict(otel.finished()[0].attributes or {})
    assert attributes[gen_ai.GEN_AI_PROVIDER_NAME] == "scripted"
    assert gen_ai.GEN_AI_SYSTEM not in attributes
    assert gen_ai.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK in attributes


def test_never_wraps_twice() -> None:
    inner = ScriptedChatClient()
    once = TelemetryChatClient(inner)
    assert TelemetryChatClient(once) is once
    pipeline = ChatPipeline.builder().use_telemetry().use_telemetry().build(inner)
    assert pipeline.describe() == ["TelemetryChatClient", "ScriptedChatClient(scripted)"]


async def test_without_an_sdk_everything_still_works(streaming: bool) -> None:
    pipeline = (
        ChatPipeline.builder()
        .use_telemetry()
        .use_ordered_failover(
            [
                ScriptedChatClient(fail(TransientProviderError()), name="a"),
                ScriptedChatClient(reply("b")),
            ]
        )
        .build()
    )
    assert (await collect(pipeline, "hi", streaming=streaming)).text == "b"


CANARY = "CANARY-5e1d"


async def test_no_content_reaches_spans_metrics_or_logs(
    otel: Otel, streaming: bool, caplog: pytest.LogCaptureFixture
) -> None:
    async with FakeOpenAIServer() as primary, FakeOpenAIServer() as backup:
        primary.script(FakeResponse.error(503, message=f"{CANARY} echoed prompt", code=None))
        backup.script(
            FakeResponse(
                text=f"answer {CANARY}", tool_calls=[("lookup", json.dumps({"q": CANARY}))]
            )
        )
        routes = [
            OpenAIChatClient(
                "m", api_key=f"sk-{CANARY}", base_url=primary.base_url, name="primary"
            ),
            OpenAIChatClient("m", api_key=f"sk-{CANARY}", base_url=backup.base_url, name="backup"),
        ]
        pipeline = (
            ChatPipeline.builder()
            .use_telemetry(**otel.providers)
            .use_logging(logging.getLogger("canary"))
            .use_ordered_failover(routes, **otel.providers)
            .build()
        )
        messages = [
            ChatMessage.system(f"system {CANARY}"),
            ChatMessage.user(f"user {CANARY}"),
            ChatMessage.assistant(FunctionCallContent("c1", "lookup", {"q": CANARY})),
            ChatMessage.tool(FunctionResultContent("c1", f"result {CANARY}")),
        ]
        options = ChatOptions(
            stop=[CANARY],
            additional_properties={"user": CANARY},
            response_format={"name": "x", "schema": {"description": CANARY}},
            session_id=CANARY,
        )
        with caplog.at_level(logging.DEBUG):
            result = await collect(pipeline, messages, options, streaming=streaming)
        await pipeline.aclose()
    assert CANARY in result.text  # the answer itself did contain the canary
    exported = list(otel.everything_exported())
    assert len(otel.attempt_spans()) == 2
    assert [s for s in exported if CANARY in s] == []
    assert [r.getMessage() for r in caplog.records if CANARY in r.getMessage()] == []


def test_importing_the_telemetry_layer_loads_no_router() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, middleware.telemetry;"
            "print(sorted(m for m in sys.modules if m.startswith('middleware.routing')))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "[]"


async def test_scopes_carry_the_version_and_the_semconv_schema(otel: Otel) -> None:
    from pipeline import __version__
    from pipeline._semconv import SCHEMA_URL

    await chat(otel, reply("ok")).get_response("hi")
    (span,) = otel.finished()
    scope = span.instrumentation_scope
    assert scope is not None
    expected = ("chat_pipeline", __version__, SCHEMA_URL)
    assert (scope.name, scope.version, scope.schema_url) == expected
    data = otel.reader.get_metrics_data()
    assert data is not None
    scopes = {
        (s.scope.name, s.scope.version, s.scope.schema_url)
        for resource in data.resource_metrics
        for s in resource.scope_metrics
    }
    assert scopes == {expected}
