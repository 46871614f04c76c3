"""`OpenAIResponsesChatClient` against FakeOpenAIServer's ``/v1/responses`` over real HTTP
(the boundaries every HTTP client shares are in test_base.py)."""

import json
import logging
from collections.abc import AsyncIterator

import pytest

from middleware.routing import Route
from pipeline import (
    ChatMessage,
    ChatOptions,
    ChatPipeline,
    DataContent,
    FunctionCallContent,
    FunctionResultContent,
)
from pipeline.errors import (
    ContextLengthExceededError,
    ProviderError,
    RateLimitedError,
    RequestRefusedError,
    TransientProviderError,
)
from pipeline.providers import OpenAIResponsesChatClient
from pipeline.testing import RESPONSES_PATH, FakeOpenAIServer, FakeResponse, collect
from pipeline.types import ANTHROPIC_EXTRAS, OPENAI_RESPONSES_EXTRAS
from tests.otel import Otel

# Every test runs over both HTTP transports (the `transport` fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("transport")

KEY = "sk-CANARY-key"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


class ResponsesServer(FakeOpenAIServer):
    default_path = RESPONSES_PATH


@pytest.fixture
async def server(transport: str) -> AsyncIterator[FakeOpenAIServer]:
    async with ResponsesServer() as fake:
        yield fake


@pytest.fixture
async def client(server: FakeOpenAIServer) -> AsyncIterator[OpenAIResponsesChatClient]:
    chat = OpenAIResponsesChatClient("gpt-test", api_key=KEY, base_url=server.base_url)
    yield chat
    await chat.aclose()


async def test_text_usage_and_the_request_sent(
    server: FakeOpenAIServer, client: OpenAIResponsesChatClient, streaming: bool
) -> None:
    server.script(FakeResponse(text="one two three", usage=(11, 3)))
    result = await collect(client, "hi", streaming=streaming)
    assert result.error is None
    assert result.text == "one two three"
    assert result.response is not None and result.response.usage is not None
    usage = result.response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (11, 3, 14)
    assert result.response.finish_reason == "stop"
    assert result.response.model_id == "gpt-test"
    assert result.response.response_id == "resp_fake_1"
    if streaming:
        assert [u.text for u in result.updates if u.text] == ["one ", "two ", "three"]
        assert result.updates[-1].usage is not None  # from response.completed, the last event
    request = server.requests[-1]
    assert request.path == "/v1/responses"
    assert request.headers["authorization"] == f"Bearer {KEY}"
    expected = {"model": "gpt-test", "input": [{"role": "user", "content": "hi"}], "store": False}
    if streaming:
        expected["stream"] = True
    assert request.json == expected


async def test_options_reach_their_fields(
    server: FakeOpenAIServer, client: OpenAIResponsesChatClient, streaming: bool
) -> None:
    options = ChatOptions(
        model_id="gpt-override",
        temperature=0.2,
        top_p=0.9,
        max_output_tokens=64,
        seed=7,  # the API has no seed: not sent
        tools=[TOOL],
        tool_mode="get_weather",
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": {}}},
        reasoning_effort="low",
        additional_properties={"parallel_tool_calls": False, "verbosity": "low"},
    )
    messages = [
        ChatMessage("system", "Be brief."),
        ChatMessage("user", ["Look:", DataContent(uri="https://example.test/a.png")]),
    ]
    assert (await collect(client, messages, options, streaming=streaming)).error is None
    body = server.requests[-1].json
    assert body["model"] == "gpt-override"
    assert body["input"] == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Look:"},
                {"type": "input_image", "image_url": "https://example.test/a.png"},
            ],
        },
    ]
    assert (body["temperature"], body["top_p"], body["max_output_tokens"]) == (0.2, 0.9, 64)
    assert "seed" not in body
    assert body["tools"] == [{"type": "function", **TOOL["function"]}]  # flat, as the API asks
    assert body["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert body["text"] == {
        "format": {"type": "json_schema", "name": "r", "schema": {}},
        "verbosity": "low",  # where this API takes it
    }
    assert body["reasoning"] == {"effort": "low"}
    assert body["parallel_tool_calls"] is False


async def test_only_the_responses_scope_of_provider_fields_is_sent(
    server: FakeOpenAIServer, client: OpenAIResponsesChatClient, streaming: bool
) -> None:
    scoped = {"prompt_cache_key": "session-1", "prompt_cache_retention": "24h"}
    options = ChatOptions(
        additional_properties={
            OPENAI_RESPONSES_EXTRAS: scoped,
            ANTHROPIC_EXTRAS: {"metadata": {"user_id": "u"}},
            "parallel_tool_calls": True,
        }
    )
    assert (await collect(client, "hi", options, streaming=streaming)).error is None
    body = server.requests[-1].json
    assert body["prompt_cache_key"] == "session-1"
    assert body["prompt_cache_retention"] == "24h"
    assert body["parallel_tool_calls"] is True
    assert OPENAI_RESPONSES_EXTRAS not in body and ANTHROPIC_EXTRAS not in body
    assert "metadata" not in body
    assert options.additional_properties[OPENAI_RESPONSES_EXTRAS] == scoped  # untouched


async def test_a_tool_call_and_its_result_round_trip(
    server: FakeOpenAIServer, client: OpenAIResponsesChatClient, streaming: bool
) -> None:
    server.script(
        FakeResponse(text="", tool_calls=[("get_weather", '{"city": "Paris"}')]),
        FakeResponse(text="Sunny in Paris."),
    )
    options = ChatOptions(tools=[TOOL], tool_mode="required")
    result = await collect(client, "Weather in Paris?", options, streaming=streaming)
    assert result.response is not None
    calls = [c for c in result.response.messages[0].contents if isinstance(c, FunctionCallContent)]
    assert [(c.name, dict(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    call_id = calls[0].call_id
    assert call_id.startswith("call_")  # the server's
    assert result.response.finish_reason == "tool_calls"
    assert server.requests[-1].json["tool_choice"] == "required"
    follow_up = [
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", calls),
        ChatMessage("tool", FunctionResultContent(call_id, result="Sunny, 21 C")),
    ]
    result = await collect(client, follow_up, options, streaming=streaming)
    assert result.text == "Sunny in Paris."
    assert server.requests[-1].json["input"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": call_id,
            "name": "get_weather",
            "arguments": json.dumps({"city": "Paris"}),
        },
        {"type": "function_call_output", "call_id": call_id, "output": "Sunny, 21 C"},
    ]


@pytest.mark.parametrize(
    ("reason", "finish"),
    [("max_output_tokens", "length"), ("content_filter", "content_filter")],
)
async def test_an_incomplete_response_is_its_finish_reason(
    server: FakeOpenAIServer,
    client: OpenAIResponsesChatClient,
    streaming: bool,
    reason: str,
    finish: str,
) -> None:
    server.script(FakeResponse(text="cut", stop_reason=reason))
    result = await collect(client, "hi", streaming=streaming)
    assert result.error is None and result.text == "cut"
    assert result.response is not None and result.response.finish_reason == finish


async def test_http_errors_keep_their_kind_and_retry_after(
    server: FakeOpenAIServer, client: OpenAIResponsesChatClient, streaming: bool
) -> None:
    server.script(
        FakeResponse.error(429, code="rate_limit_exceeded", retry_after="7"),
        FakeResponse.error(400, code="context_length_exceeded", message="too long"),
    )
    limited = await collect(client, "hi", streaming=streaming)
    assert isinstance(limited.error, RateLimitedError)
    assert (limited.error.status_code, limited.error.retry_after) == (429, 7.0)
    overflow = await collect(client, "hi", streaming=streaming)
    assert isinstance(overflow.error, ContextLengthExceededError)
    assert KEY not in str(limited.error) + str(overflow.error) + repr(client)


async def test_an_error_event_before_output_is_its_kind(
    server: FakeOpenAIServer, client: OpenAIResponsesChatClient
) -> None:
    server.script(
        FakeResponse(
            in_band_error={"code": "rate_limit_exceeded", "message": "slow"}, error_after=2
        )
    )
    result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, RateLimitedError)
    assert result.error.code == "rate_limit_exceeded"
    assert result.updates == []  # a pre-output failure: a router may fail over


async def test_an_error_event_after_output_ends_the_stream(
    server: FakeOpenAIServer, client: OpenAIResponsesChatClient
) -> None:
    server.script(
        FakeResponse(
            chunks=["a", "b", "c"],
            in_band_error={"code": "server_error", "message": "boom"},
            error_after=6,
        )
    )
    result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, TransientProviderError)
    assert [u.text for u in result.updates] == ["a", "b"]


def _event(kind: str, **fields: object) -> list[str]:
    return [f"event: {kind}", "data: " + json.dumps({"type": kind, **fields}), ""]


async def test_response_failed_is_a_provider_error_of_its_code(
    server: FakeOpenAIServer, client: OpenAIResponsesChatClient
) -> None:
    head = {"id": "resp_1", "model": "gpt-test", "status": "in_progress", "output": []}
    failed = {**head, "status": "failed", "error": {"code": "server_error", "message": "x"}}
    delta = {"item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "par"}
    server.script(
        FakeResponse(
            raw_lines=[
                *_event("response.created", response=head, sequence_number=0),
                *_event("response.output_text.delta", **delta, sequence_number=1),
                *_event("response.failed", response=failed, sequence_number=2),
            ]
        )
    )
    result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, TransientProviderError)
    assert result.error.code == "server_error"
    assert [u.text for u in result.updates] == ["par"]
    assert result.updates[0].response_id == "resp_1" and result.updates[0].model_id == "gpt-test"


@pytest.mark.parametrize(
    "lines",
    [
        ["data: {not json", ""],
        [*_event("response.output_item.done", item={"type": "function_call"})],
        [*_event("response.function_call_arguments.delta", output_index=0, delta="{")],
        [*_event("response.completed")],
    ],
    ids=["not-json", "item-without-index", "arguments-for-no-call", "completed-without-response"],
)
async def test_malformed_streams_are_provider_errors(
    server: FakeOpenAIServer, client: OpenAIResponsesChatClient, lines: list[str]
) -> None:
    server.script(FakeResponse(raw_lines=lines))
    result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, ProviderError)
    assert result.error.code == "malformed"


@pytest.mark.parametrize(
    "body",
    [
        [1],
        {"output": "text"},
        {"output": [3]},
        {"output": [{"type": "message", "content": [{"type": "output_text"}]}]},
        {"output": [{"type": "function_call", "arguments": "{}"}]},
        {"output": [{"type": "function_call", "name": "f", "arguments": "[1]"}]},
    ],
    ids=[
        "not-an-object",
        "output-not-a-list",
        "item-not-an-object",
        "text-without-text",
        "call-without-name",
        "arguments-not-an-object",
    ],
)
def test_malformed_bodies_are_provider_errors(body: object) -> None:
    from pipeline.wire.responses.outbound import parse_response

    with pytest.raises(ProviderError) as caught:
        parse_response(body, "openai")
    assert caught.value.code == "malformed"


def test_a_failed_body_is_the_error_it_carries() -> None:
    from pipeline.wire.responses.outbound import parse_response

    failed = {"status": "failed", "error": {"code": "rate_limit_exceeded", "message": "x"}}
    with pytest.raises(RateLimitedError):
        parse_response(failed, "openai")


async def test_stop_sequences_are_refused_before_anything_is_sent(
    server: FakeOpenAIServer, client: OpenAIResponsesChatClient, streaming: bool
) -> None:
    result = await collect(client, "hi", ChatOptions(stop=["END"]), streaming=streaming)
    assert isinstance(result.error, RequestRefusedError)
    assert result.error.param == "stop"
    assert "stop sequences" in str(result.error)
    assert server.count() == 0


async def test_no_prompt_answer_tool_argument_or_key_in_spans_or_logs(
    server: FakeOpenAIServer,
    otel: Otel,
    caplog: pytest.LogCaptureFixture,
    streaming: bool,
) -> None:
    canary = "CANARY-9d2c"
    caplog.set_level(logging.DEBUG)
    server.script(
        FakeResponse(text=f"answer {canary}", tool_calls=[("get_weather", f'{{"c": "{canary}"}}')]),
        FakeResponse.error(400, code="invalid_request_error", message=f"echo {canary}"),
        FakeResponse(chunks=[canary], in_band_error={"code": "server_error", "message": canary}),
        FakeResponse(chunks=[canary, "x"], in_band_error={"message": canary}, error_after=5),
    )
    responses = OpenAIResponsesChatClient("m", api_key=f"sk-{canary}", base_url=server.base_url)
    chat = (
        ChatPipeline.builder(**otel.providers)
        .use_telemetry()
        .use_logging()
        .use_ordered_failover([Route("responses", responses)])
        .build()
    )
    turn = [
        ChatMessage("user", f"my secret is {canary}"),
        ChatMessage("assistant", [FunctionCallContent("c1", "get_weather", {"city": canary})]),
        ChatMessage("tool", FunctionResultContent("c1", result=f"result {canary}")),
    ]
    options = ChatOptions(tools=[TOOL])
    outcomes = [await collect(chat, turn, options, streaming=streaming) for _ in range(2)]
    # In-band errors come only in streams.
    outcomes += [await collect(chat, turn, options, streaming=True) for _ in range(2)]
    assert outcomes[0].error is None
    for outcome in outcomes[1:]:  # refused, failed in-band before and after output
        assert outcome.error is not None and canary not in str(outcome.error)
    assert canary in "".join(u.text for u in outcomes[3].updates)  # it did stream
    await chat.aclose()
    logged = [r.getMessage() for r in caplog.records] + [str(r.args) for r in caplog.records]
    assert logged and not [line for line in logged if canary in line]
    assert not [text for text in otel.everything_exported() if canary in text]
