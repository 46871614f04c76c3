"""``POST /v1/messages`` over real HTTP, with the official `anthropic` SDK as its client."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import pytest
from opentelemetry.trace import SpanKind

from pipeline.gateway.wire import WireError
from pipeline.testing import FakeAnthropicServer, FakeOpenAIServer, FakeResponse
from pipeline.types import (
    ChatResponseUpdate,
    ChatRole,
    FunctionCallContent,
    TextContent,
    ToolChoice,
)
from pipeline.wire.messages.inbound import (
    MessageEventEncoder,
    parse_messages_request,
    stop_reason,
)
from tests.otel import Otel
from tests.pipeline.gateway.conftest import Running, config, keyed, running

pytestmark = pytest.mark.gateway

MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
TEXT = "Hello from the fake server."
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
OPENAI_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": WEATHER_TOOL["input_schema"],
    },
}


def client(
    gateway: Running, api_key: str | None = "unused", **options: Any
) -> anthropic.AsyncAnthropic:
    """The SDK, without retries (every call counted), sending its key as ``x-api-key``."""
    return anthropic.AsyncAnthropic(base_url=gateway.url, api_key=api_key, max_retries=0, **options)


@dataclass
class Answer:
    """What the client got, from either call shape."""

    message: Any
    text: str = ""
    request_id: str | None = None  # as the SDK read it (Anthropic's ``request-id``)


async def ask(sdk: anthropic.AsyncAnthropic, streaming: bool, **options: Any) -> Answer:
    options.setdefault("model", "pipeline")
    options.setdefault("messages", MESSAGES)
    options.setdefault("max_tokens", 100)
    if not streaming:
        message = await sdk.messages.create(**options)
        text = "".join(block.text for block in message.content if block.type == "text")
        return Answer(message, text, message._request_id)
    async with sdk.messages.stream(**options) as stream:
        text = ""
        async for piece in stream.text_stream:
            text += piece
        message = await stream.get_final_message()
        return Answer(message, text, stream.request_id)


@pytest.fixture
async def two_routes(primary: FakeOpenAIServer, backup: FakeOpenAIServer) -> AsyncIterator[Running]:
    async with running(config({"primary": primary, "backup": backup})) as gateway:
        yield gateway


@pytest.fixture
async def one_route(primary: FakeOpenAIServer) -> AsyncIterator[Running]:
    async with running(config({"primary": primary})) as gateway:
        yield gateway


def events(body: str) -> list[tuple[str, dict[str, Any]]]:
    """The SSE events of a Messages stream, as (event, data) pairs."""
    parsed = []
    for frame in body.split("\n\n"):
        if not frame:
            continue
        name, data = frame.split("\n")
        parsed.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return parsed


# -- answers ----------------------------------------------------------------------------------


async def test_answers_in_the_messages_format(
    two_routes: Running, primary: FakeOpenAIServer, streaming: bool
) -> None:
    sdk = client(two_routes)
    answer = await ask(sdk, streaming)
    message = answer.message
    assert answer.text == TEXT
    assert (message.type, message.role) == ("message", "assistant")
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason == "end_turn"
    assert message.model == "model-primary"  # the model that served it
    assert (message.usage.input_tokens, message.usage.output_tokens) == (5, 7)
    assert message.id.startswith("msg_")
    request = primary.requests[-1].json
    assert request["model"] == "model-primary"  # the route's model, not the client's name
    assert request["messages"] == MESSAGES
    assert request["max_completion_tokens"] == 100
    await sdk.close()


async def test_stream_events_are_in_the_messages_order(
    one_route: Running, primary: FakeOpenAIServer
) -> None:
    primary.script(
        FakeResponse(chunks=["Let me ", "look."], tool_calls=[("get_weather", '{"city": "Paris"}')])
    )
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{one_route.url}/v1/messages",
            json={
                "model": "pipeline",
                "max_tokens": 50,
                "messages": MESSAGES,
                "tools": [WEATHER_TOOL],
                "stream": True,
            },
        )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    stream = events(response.text)
    names = [name for name, _ in stream]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in stream)
    start = stream[0][1]["message"]
    assert (start["model"], start["content"], start["stop_reason"]) == ("model-primary", [], None)
    assert [data["index"] for name, data in stream if name.startswith("content_block")] == [
        0,
        0,
        0,
        0,
        1,
        1,
        1,
    ]
    assert stream[2][1]["content_block"] == {"type": "text", "text": ""}
    assert [stream[i][1]["delta"] for i in (3, 4)] == [
        {"type": "text_delta", "text": "Let me "},
        {"type": "text_delta", "text": "look."},
    ]
    block = stream[6][1]["content_block"]
    assert block["id"].startswith("call_")  # the upstream's id, carried
    assert block == {"type": "tool_use", "id": block["id"], "name": "get_weather", "input": {}}
    assert stream[7][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city":"Paris"}'}
    assert stream[9][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {  # the final counts, exactly
            "input_tokens": 5,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 7,
        },
    }


async def test_options_and_system_reach_the_model(
    one_route: Running, primary: FakeOpenAIServer
) -> None:
    sdk = client(one_route)
    await sdk.messages.create(
        model="pipeline",
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        max_tokens=50,
        stop_sequences=["END"],
        metadata={"user_id": "someone"},
        service_tier="auto",
        cache_control={"type": "ephemeral"},
        # Sampling fields older SDKs have as parameters (this one sends them as extras).
        extra_body={"temperature": 0.5, "top_p": 0.9},
    )
    request = primary.requests[-1].json
    assert request["messages"] == [
        {"role": "system", "content": "Be brief.\n\nBe kind."},
        {"role": "user", "content": "Hi"},
    ]
    assert request["temperature"] == 0.5 and request["top_p"] == 0.9
    assert request["max_completion_tokens"] == 50
    assert request["stop"] == ["END"]
    # They describe the caller or the billing: accepted, not passed on.
    assert not {"metadata", "user", "service_tier", "cache_control"} & set(request)
    await sdk.close()


async def test_stop_reasons_map_from_the_finish_reason(
    one_route: Running, primary: FakeOpenAIServer, streaming: bool
) -> None:
    primary.script(FakeResponse(stop_reason="length"))
    sdk = client(one_route)
    assert (await ask(sdk, streaming)).message.stop_reason == "max_tokens"
    await sdk.close()


def test_stop_reason_table() -> None:
    assert [stop_reason(r, False) for r in ("stop", "length", "tool_calls", "content_filter")] == [
        "end_turn",
        "max_tokens",
        "tool_use",
        "refusal",
    ]
    assert stop_reason(None, True) == "tool_use" and stop_reason(None, False) == "end_turn"
    assert stop_reason("stop_sequence", False) == "stop_sequence"  # kept when it came so
    assert stop_reason("something-new", False) == "end_turn"


# -- tools ------------------------------------------------------------------------------------


async def test_a_tool_round_trip(
    two_routes: Running, primary: FakeOpenAIServer, streaming: bool
) -> None:
    primary.script(FakeResponse(text="", tool_calls=[("get_weather", '{"city": "Paris"}')]))
    sdk = client(two_routes)
    answer = await ask(sdk, streaming, tools=[WEATHER_TOOL], tool_choice={"type": "any"})
    message = answer.message
    assert message.stop_reason == "tool_use"
    assert answer.text == ""
    [call] = message.content
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert call.id.startswith("call_")  # the upstream's id, carried
    request = primary.requests[-1].json
    assert request["tools"] == [OPENAI_WEATHER_TOOL]  # the route's own format
    assert request["tool_choice"] == "required"
    # The next turn carries the call and its result back to the model.
    follow_up = [
        *MESSAGES,
        {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    answer = await ask(sdk, streaming, messages=follow_up, tools=[WEATHER_TOOL])
    assert answer.text == TEXT
    assert answer.message.stop_reason == "end_turn"
    sent = primary.requests[-1].json["messages"]
    assert sent[1]["tool_calls"] == [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    assert sent[2] == {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}
    assert sent[3] == {"role": "user", "content": "And tomorrow?"}
    assert "tool_choice" not in primary.requests[-1].json
    await sdk.close()


async def test_a_tool_round_trip_to_an_anthropic_route(
    streaming: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_TEST_UPSTREAM_KEY", "upstream-key")
    async with FakeAnthropicServer() as upstream:
        cfg = config(
            {"claude": upstream},  # type: ignore[dict-item]
            route_options={
                "claude": {"provider": "anthropic", "api_key_env": "GATEWAY_TEST_UPSTREAM_KEY"}
            },
        )
        upstream.script(FakeResponse(text="", tool_calls=[("get_weather", '{"city": "Paris"}')]))
        async with running(cfg) as gateway:
            sdk = client(gateway)
            answer = await ask(
                sdk,
                streaming,
                system="Be brief.",
                tools=[WEATHER_TOOL],
                tool_choice={"type": "tool", "name": "get_weather"},
            )
            [call] = answer.message.content
            assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
            request = upstream.requests[-1].json
            assert request["tools"] == [WEATHER_TOOL]
            assert request["tool_choice"] == {"type": "tool", "name": "get_weather"}
            assert request["system"] == "Be brief."
            assert request["max_tokens"] == 100
            follow_up = [
                *MESSAGES,
                {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": call.id,
                            "content": [{"type": "text", "text": "Sunny, 21 C"}],
                        }
                    ],
                },
            ]
            assert (await ask(sdk, streaming, messages=follow_up, tools=[WEATHER_TOOL])).text
            sent = upstream.requests[-1].json["messages"]
            assert sent[1] == {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": call.id,
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    }
                ],
            }
            assert sent[2] == {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}
                ],
            }
            await sdk.close()


# -- failover and failures --------------------------------------------------------------------


async def test_failover_before_output_is_invisible(
    two_routes: Running, primary: FakeOpenAIServer, backup: FakeOpenAIServer, streaming: bool
) -> None:
    primary.script(FakeResponse.error(503))
    backup.script(FakeResponse(text="The backup answered this."))
    sdk = client(two_routes)
    answer = await ask(sdk, streaming)
    assert answer.text == "The backup answered this."
    assert answer.message.model == "model-backup"  # the model that served it
    assert (primary.count(), backup.count()) == (1, 1)
    await sdk.close()


@pytest.mark.parametrize(
    "failure",
    [
        FakeResponse(
            chunks=["Hello ", "wor", "ld"],
            in_band_error={"type": "server_error", "code": "server_error"},
            error_after=3,
        ),
        FakeResponse(chunks=["Hello ", "wor", "ld"], disconnect_after=3),
    ],
    ids=["in-band-error", "cut-connection"],
)
async def test_failure_after_output_is_an_error_event_and_never_fails_over(
    two_routes: Running,
    primary: FakeOpenAIServer,
    backup: FakeOpenAIServer,
    failure: FakeResponse,
) -> None:
    primary.script(failure)
    sdk = client(two_routes)
    received = ""
    with pytest.raises(anthropic.APIStatusError) as raised:
        async with sdk.messages.stream(model="pipeline", messages=MESSAGES, max_tokens=50) as s:
            async for piece in s.text_stream:
                received += piece
    assert received == "Hello wor"  # what was streamed stays streamed, nothing repeated
    assert raised.value.body == {
        "type": "error",
        "error": {
            "type": "overloaded_error",
            "message": "the model provider is unavailable; retry later (provider openai)",
        },
    }
    assert (primary.count(), backup.count()) == (1, 0)
    await sdk.close()


async def test_error_event_ends_the_stream_without_message_stop(
    one_route: Running, primary: FakeOpenAIServer
) -> None:
    primary.script(FakeResponse(chunks=["a", "b"], in_band_error={"type": "x"}, error_after=2))
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{one_route.url}/v1/messages",
            json={"model": "pipeline", "max_tokens": 5, "messages": MESSAGES, "stream": True},
        )
    assert response.status_code == 200
    stream = events(response.text)
    assert [name for name, _ in stream] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    assert stream[-1][1]["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize(
    ("upstream", "status", "error", "kind"),
    [
        # Every route rate limited: what Claude Code stops retrying soon (it retries a 429
        # rate_limit_error for minutes), waiting as the route said.
        (
            FakeResponse.error(429, retry_after="7"),
            503,
            anthropic.InternalServerError,
            "overloaded_error",
        ),
        (
            FakeResponse.error(400, code="invalid_value"),
            400,
            anthropic.BadRequestError,
            "invalid_request_error",
        ),
        (
            FakeResponse.error(400, code="context_length_exceeded"),
            400,
            anthropic.BadRequestError,
            "invalid_request_error",
        ),
        # The provider refusing the gateway's credentials is no fault of the caller's key.
        (FakeResponse.error(401), 502, anthropic.InternalServerError, "api_error"),
        # Every route failed, none says when it may serve: an error Claude Code does not
        # retry (it retries overloaded_error for minutes, whatever x-should-retry says).
        (FakeResponse.error(503), 503, anthropic.InternalServerError, "api_error"),
        (
            FakeResponse.error(503, retry_after="6"),
            503,
            anthropic.InternalServerError,
            "overloaded_error",
        ),
    ],
    ids=["rate-limited", "invalid", "context-length", "auth", "unavailable", "until"],
)
async def test_provider_failures_become_anthropic_errors(
    one_route: Running,
    primary: FakeOpenAIServer,
    streaming: bool,
    upstream: FakeResponse,
    status: int,
    error: type[anthropic.APIStatusError],
    kind: str,
) -> None:
    primary.script(upstream)
    sdk = client(one_route)
    with pytest.raises(error) as raised:
        await ask(sdk, streaming)
    assert raised.value.status_code == status
    body = raised.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == kind
    assert set(body["error"]) == {"type", "message"}
    headers = raised.value.response.headers
    if status == 502 or kind == "api_error":
        assert headers["x-should-retry"] == "false"  # the SDK does not retry it
        assert "retry-after" not in headers
    if kind == "overloaded_error":
        assert headers["retry-after"] == upstream.headers["Retry-After"]
        assert "x-should-retry" not in headers
    assert raised.value.request_id == headers["x-request-id"]
    assert primary.count() == 1
    await sdk.close()


async def test_max_tokens_is_required(one_route: Running, primary: FakeOpenAIServer) -> None:
    sdk = client(one_route)
    # `messages.create` refuses to send it; the SDK's own request method sends anything.
    with pytest.raises(anthropic.BadRequestError) as raised:
        await sdk.post(
            "/v1/messages",
            body={"model": "pipeline", "messages": MESSAGES},
            cast_to=httpx.Response,
        )
    assert raised.value.status_code == 400
    assert raised.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    assert primary.count() == 0
    await sdk.close()


async def test_unknown_model_is_404(one_route: Running, primary: FakeOpenAIServer) -> None:
    sdk = client(one_route)
    with pytest.raises(anthropic.NotFoundError) as raised:
        await ask(sdk, False, model="claude-sonnet-4-5")
    assert raised.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert primary.count() == 0
    await sdk.close()


async def test_the_shared_layers_refuse_in_anthropic_shape(primary: FakeOpenAIServer) -> None:
    cfg = config({"primary": primary}, gateway={"max_body_bytes": 1024})
    url = "/v1/messages"
    async with running(cfg) as gateway, httpx.AsyncClient(base_url=gateway.url) as http:
        refusals = [
            (await http.get(url), 405, "invalid_request_error"),
            (
                await http.post(url, content=b"{}", headers={"content-type": "text/plain"}),
                415,
                "invalid_request_error",
            ),
            (await http.post(url, content=b"{" + b" " * 2000 + b"}"), 413, "request_too_large"),
            (await http.post(url, content=b"{nope"), 400, "invalid_request_error"),
        ]
        for response, status, kind in refusals:
            assert response.status_code == status
            assert response.json()["type"] == "error"
            assert response.json()["error"]["type"] == kind
            assert response.headers["request-id"] == response.headers["x-request-id"]
    assert primary.count() == 0


SECRET = "secret words"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": SECRET,
                                },
                            }
                        ],
                    }
                ]
            },
            "messages[0].content[0].type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "document",
                                "source": {
                                    "type": "text",
                                    "media_type": "text/plain",
                                    "data": SECRET,
                                },
                            }
                        ],
                    }
                ]
            },
            "messages[0].content[0].type",
        ),
        ({"thinking": {"type": 1}}, "thinking.type"),
        ({"thinking": {"type": "enabled", "budget_tokens": "lots"}}, "thinking.budget_tokens"),
        ({"output_config": {"effort": [SECRET]}}, "output_config.effort"),
        ({"output_config": {"format": {"type": "text"}}}, "output_config.format"),
        ({"context_management": {"edits": SECRET}}, "context_management.edits"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        (
            {"mcp_servers": [{"type": "url", "url": "http://127.0.0.1/", "name": SECRET}]},
            "mcp_servers",
        ),
        ({"container": SECRET}, "container"),
        ({"frobnicate": SECRET}, "frobnicate"),
        ({"temperature": 1.5}, "temperature"),
        ({"messages": [{"role": "narrator", "content": SECRET}]}, "messages[0].role"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "other"}},
            "tool_choice.name",
        ),
        ({"tool_choice": {"type": "auto"}}, "tool_choice"),
    ],
    ids=[
        "image",
        "document",
        "thinking",
        "thinking-budget",
        "effort",
        "output-format",
        "context-management",
        "anthropic-defined-tool",
        "mcp",
        "container",
        "unknown",
        "temperature",
        "role",
        "tool-choice",
        "tool-choice-without-tools",
    ],
)
async def test_what_is_not_served_is_400_naming_the_field(
    one_route: Running, primary: FakeOpenAIServer, extra: dict[str, Any], param: str
) -> None:
    sdk = client(one_route)
    body = {"model": "pipeline", "max_tokens": 10, "messages": MESSAGES, **extra}
    with pytest.raises(anthropic.BadRequestError) as raised:
        await sdk.post("/v1/messages", body=body, cast_to=httpx.Response)
    error = raised.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ")
    assert SECRET not in raised.value.response.text
    assert primary.count() == 0
    await sdk.close()


WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 8}


@pytest.mark.parametrize(
    ("tools", "choice", "sent_tools", "sent_choice"),
    [
        ([WEB_SEARCH], {"type": "tool", "name": "web_search"}, None, None),
        ([WEATHER_TOOL, WEB_SEARCH], {"type": "auto"}, [OPENAI_WEATHER_TOOL], "auto"),
    ],
    ids=["server-tool-only", "beside-a-tool"],
)
async def test_server_tools_are_left_out_and_said(
    one_route: Running,
    primary: FakeOpenAIServer,
    streaming: bool,
    caplog: pytest.LogCaptureFixture,
    tools: list[Any],
    choice: dict[str, Any],
    sent_tools: list[Any] | None,
    sent_choice: str | None,
) -> None:
    """Claude Code's web search asks for Anthropic's server tool; no route runs it, so by
    default the request is served without it and the response header says so."""
    caplog.set_level(logging.INFO, logger="chat_pipeline.gateway")
    body = {
        "model": "pipeline",
        "max_tokens": 10,
        "messages": MESSAGES,
        "tools": tools,
        "tool_choice": choice,
        "stream": streaming,
    }
    async with httpx.AsyncClient(base_url=one_route.url) as http:
        response = await http.post("/v1/messages", json=body, headers={"x-api-key": "unused"})
    assert response.status_code == 200
    assert response.headers["x-chat-pipeline-builtin-tools"] == "dropped=web_search_20250305"
    if streaming:
        kinds = [name for name, _ in events(response.text)]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    else:
        assert response.json()["content"] == [{"type": "text", "text": TEXT}]
    (request,) = primary.requests
    assert request.json.get("tools") == sent_tools
    assert request.json.get("tool_choice") == sent_choice
    lines = [r.getMessage() for r in caplog.records if r.name == "chat_pipeline.gateway"]
    assert sum("builtin_tools=dropped=web_search_20250305" in line for line in lines) == 1


async def test_server_tools_refused_when_configured(primary: FakeOpenAIServer) -> None:
    cfg = config({"primary": primary}, gateway={"builtin_tools": "refuse"})
    async with running(cfg) as gateway:
        sdk = client(gateway)
        with pytest.raises(anthropic.BadRequestError) as raised:
            await ask(sdk, False, tools=[WEATHER_TOOL, WEB_SEARCH])
        await sdk.close()
    error = raised.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("tools: the built-in tool 'web_search_20250305'")
    headers = raised.value.response.headers
    assert headers["x-chat-pipeline-builtin-tools"] == "refused=web_search_20250305"
    assert primary.count() == 0


def test_parsing_keeps_the_turns_in_order() -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "system": "S",
        "metadata": {"user_id": "u"},
        "messages": [
            {"role": "user", "content": "Q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                    {"type": "tool_use", "id": "t2", "name": "f", "input": {"a": 2}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                    {"type": "tool_result", "tool_use_id": "t2", "is_error": True, "content": "no"},
                ],
            },
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": {}}],
        "tool_choice": {"type": "auto"},
        "top_k": 3,
    }
    request = parse_messages_request(json.dumps(body).encode(), session_id="s")
    assert [m.role for m in request.messages] == [
        ChatRole.SYSTEM,
        ChatRole.USER,
        ChatRole.ASSISTANT,
        ChatRole.TOOL,
        ChatRole.TOOL,
    ]
    assert [type(c).__name__ for c in request.messages[2].contents] == [
        "TextContent",
        "FunctionCallContent",
        "FunctionCallContent",
    ]
    assert [m.contents[0].result for m in request.messages[3:]] == ["one", "no"]  # type: ignore[union-attr]
    assert request.options.tool_mode == ToolChoice.AUTO
    assert request.options.max_output_tokens == 5
    assert request.options.session_id == "s"
    # metadata goes to Anthropic routes only, as given.
    assert request.options.additional_properties == {
        "top_k": 3,
        "anthropic": {"metadata": {"user_id": "u"}},
    }
    [tool] = request.options.tools or []
    assert (tool.name, tool.description, tool.parameters) == ("f", None, {"type": "object"})  # type: ignore[union-attr]
    assert request.tool_names == frozenset({"f"})
    with pytest.raises(WireError) as raised:
        parse_messages_request(b'{"model": "m", "max_tokens": 0, "messages": []}')
    assert raised.value.param == "max_tokens"


def test_an_empty_stream_is_still_a_whole_message() -> None:
    encoder = MessageEventEncoder(model="m", response_id="msg_1")
    names = [name for name, _ in events(encoder.end())]
    assert names == ["message_start", "ping", "message_delta", "message_stop"]
    encoder = MessageEventEncoder(model="m", response_id="msg_2")
    out = encoder.update(
        ChatResponseUpdate(contents=[FunctionCallContent("", "f", {}), TextContent("after")])
    )
    stream = events(out + encoder.end())
    assert stream[2][1]["content_block"]["id"].startswith("toolu_")  # an id, always
    assert [name for name, _ in stream][-5:] == [
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


# -- keys and request ids ---------------------------------------------------------------------


async def test_keys_come_in_x_api_key_or_authorization(
    primary: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config({"primary": primary}, gateway=keyed(monkeypatch, "key-one,key-two"))
    async with running(cfg) as gateway:
        by_header = client(gateway, "key-one")  # x-api-key
        assert (await ask(by_header, False)).text == TEXT
        bearer = client(gateway, None, auth_token="key-two")  # Authorization: Bearer
        assert (await ask(bearer, True)).text == TEXT
        wrong = client(gateway, "key-three")
        with pytest.raises(anthropic.AuthenticationError) as raised:
            await ask(wrong, False)
        assert raised.value.body == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "missing or invalid API key"},
        }
        for sdk in (by_header, bearer, wrong):
            await sdk.close()
    assert primary.count() == 2


async def test_the_request_id_comes_back(
    one_route: Running, primary: FakeOpenAIServer, streaming: bool
) -> None:
    sdk = client(one_route)
    answer = await ask(sdk, streaming)
    request_id = answer.request_id
    assert request_id is not None and request_id.startswith("req_")
    raw = await sdk.messages.with_raw_response.create(
        model="pipeline",
        messages=MESSAGES,
        max_tokens=10,
        extra_headers={"x-request-id": "my-request-42"},
    )
    assert raw.headers["x-request-id"] == raw.headers["request-id"] == "my-request-42"
    assert raw.request_id == "my-request-42"
    primary.script(FakeResponse.error(400))
    with pytest.raises(anthropic.BadRequestError) as raised:
        await ask(sdk, streaming, extra_headers={"x-request-id": "my-request-43"})
    assert raised.value.request_id == "my-request-43"
    await sdk.close()


# -- telemetry and logs -----------------------------------------------------------------------


async def test_no_prompt_tool_argument_or_key_in_logs_or_spans(
    primary: FakeOpenAIServer,
    otel: Otel,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    streaming: bool,
) -> None:
    canary = "CANARY-2b9d"
    cfg = config(
        {"primary": primary},
        gateway=keyed(monkeypatch, f"key-{canary}"),
        layers={"telemetry": True, "logging": True},
    )
    caplog.set_level(logging.DEBUG)
    messages = [
        {"role": "user", "content": f"my secret is {canary}"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": canary}}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": f"{canary} sun"}],
        },
    ]
    primary.script(
        FakeResponse(
            text=f"answer {canary}", tool_calls=[("get_weather", f'{{"city": "{canary}"}}')]
        ),
        FakeResponse.error(503, message=f"echo {canary}"),
        FakeResponse(chunks=[canary], in_band_error={"type": "server_error"}, error_after=2),
    )
    async with running(cfg, **otel.providers) as gateway:
        sdk = client(gateway, f"key-{canary}")
        await ask(sdk, streaming, messages=messages, tools=[WEATHER_TOOL], system=canary)
        with pytest.raises(anthropic.APIStatusError):
            await ask(sdk, streaming, messages=messages)
        with pytest.raises(anthropic.APIStatusError):
            await ask(sdk, True, messages=messages)
        with pytest.raises(anthropic.BadRequestError) as refused:
            await ask(
                sdk,
                streaming,
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": canary}}],
                    }
                ],
            )
        assert canary not in refused.value.response.text
        bad = client(gateway, f"wrong-{canary}")
        with pytest.raises(anthropic.AuthenticationError) as raised:
            await ask(bad, streaming, messages=messages)
        assert canary not in raised.value.response.text
        await gateway.gateway.wait_idle()
        await sdk.close()
        await bad.close()
    # The client SDK's own debug lines (its request options) are the client's business.
    records = [r for r in caplog.records if not r.name.startswith("anthropic")]
    logged = [r.getMessage() for r in records] + [str(r.args) for r in records]
    assert any("POST /v1/messages 503" in line for line in logged)
    assert not [line for line in logged if canary in line]
    assert not [text for text in otel.everything_exported() if canary in text]
    servers = [s for s in otel.finished() if s.kind is SpanKind.SERVER]
    assert {s.name for s in servers} == {"POST /v1/messages"}
    assert len(servers) == 5
