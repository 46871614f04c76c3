"""BedrockChatClient over real HTTP, against FakeBedrockServer (which verifies every request's
SigV4 signature with its own implementation and writes its own event-stream frames): the
Converse wire, both call shapes, every error type, the failover boundary, malformed frames,
and the credentials botocore finds."""

import json
import logging
import os
import struct
import sys
import textwrap
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from middleware.function_invocation import Tool
from middleware.routing import OrderedFailoverChatClient
from pipeline import (
    ChatMessage,
    ChatOptions,
    CustomTool,
    DataContent,
    FunctionCallContent,
    FunctionResultContent,
    ReasoningContent,
    ReasoningOptions,
    UsageDetails,
)
from pipeline.errors import (
    AuthenticationError,
    ContextLengthExceededError,
    FailureKind,
    ProviderError,
    RateLimitedError,
    RequestInvalidError,
    TransientProviderError,
    UnknownProviderError,
)
from pipeline.providers import BedrockChatClient, OpenAIChatClient
from pipeline.providers.bedrock import sigv4_headers
from pipeline.testing import FakeBedrockServer, FakeOpenAIServer, FakeResponse, collect
from pipeline.testing._fake_bedrock import event_stream_frame
from tests.otel import Otel

# Every test runs over both HTTP transports (the `transport` fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("transport")

CLAUDE = "anthropic.claude-sonnet-4-5-20250929-v1:0"
WEATHER = json.dumps({"city": "Oslo", "units": "metric"})
SECRET_CANARY = "CANARY/secret+key/never/shown"
TOKEN_CANARY = "CANARY-session-token-never-shown"


@pytest.fixture
async def server(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeBedrockServer]:
    async with FakeBedrockServer(
        credentials={"AKIDCANARYKEY": SECRET_CANARY},
        session_tokens={"AKIDCANARYKEY": TOKEN_CANARY},
    ) as fake:
        for name, value in fake.environment().items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        monkeypatch.delenv("AWS_CREDENTIAL_EXPIRATION", raising=False)
        yield fake


@pytest.fixture
async def client(server: FakeBedrockServer) -> AsyncIterator[BedrockChatClient]:
    chat = BedrockChatClient(CLAUDE, base_url=server.base_url)
    yield chat
    await chat.aclose()


def _frame(event: str, body: object, message_type: str = "event") -> bytes:
    headers = {":event-type": event, ":message-type": message_type}
    return event_stream_frame(headers, json.dumps(body).encode())


START = _frame("messageStart", {"role": "assistant"})
STOP = _frame("messageStop", {"stopReason": "end_turn"})
END = _frame("metadata", {"usage": {"inputTokens": 1, "outputTokens": 1}})


def _text(text: str, index: int = 0) -> bytes:
    return _frame("contentBlockDelta", {"delta": {"text": text}, "contentBlockIndex": index})


# -- successes --------------------------------------------------------------------------------


async def test_text_usage_with_cache_tokens_and_the_signature(
    server: FakeBedrockServer, client: BedrockChatClient, streaming: bool
) -> None:
    server.script(FakeResponse(text="one two three", usage=(11, 3), cache_usage=(4, 5)))
    result = await collect(client, "hi", streaming=streaming)
    assert result.error is None and result.response is not None
    assert result.text == "one two three"
    # Input tokens include prompt-cache writes and reads, which Converse counts apart.
    usage = UsageDetails(20, 3, 23, cache_read_tokens=5, cache_write_tokens=4)
    assert result.response.usage == usage
    assert result.response.finish_reason == "stop"
    assert result.response.model_id == CLAUDE  # Converse names none: the one asked for
    if streaming:
        assert [u.text for u in result.updates if u.text] == ["one ", "two ", "three"]
        assert [u.usage for u in result.updates if u.usage] == [usage]
        assert result.updates[-1].finish_reason == "stop"
    request = server.requests[0]
    operation = "converse-stream" if streaming else "converse"
    assert request.path == f"/model/anthropic.claude-sonnet-4-5-20250929-v1%3A0/{operation}"
    assert request.headers["x-amz-security-token"] == TOKEN_CANARY
    assert request.headers["authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIDCANARYKEY/")
    assert server.verified_signatures == 1 and server.models == [CLAUDE]


async def test_request_wire_format(
    server: FakeBedrockServer, client: BedrockChatClient, streaming: bool
) -> None:
    def get_weather(city: str, units: str = "metric") -> str:
        """The weather in a city."""
        return city

    tool = Tool.from_function(get_weather)
    openai_tool = {
        "type": "function",
        "function": {"name": "f", "description": "F.", "parameters": {"type": "object"}},
    }
    messages_tool = {"name": "g", "input_schema": {"type": "object"}}
    options = ChatOptions(
        model_id="us.amazon.nova-pro-v1:0",
        temperature=0.2,
        top_p=0.9,
        max_output_tokens=50,
        stop=["X"],
        seed=3,
        tools=[tool, openai_tool, messages_tool],
        tool_mode="get_weather",
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": {"type": "object"}},
        },
        additional_properties={
            "presence_penalty": 1,  # another API's: Converse has no such field
            "bedrock": {"performanceConfig": {"latency": "optimized"}, "messages": "ignored"},
        },
    )
    messages = [
        ChatMessage.system("be brief"),
        ChatMessage.user(
            [
                "look",
                DataContent(data=b"\x89PNG", media_type="image/png"),
                DataContent(uri="data:image/gif;base64,R0lG"),
                DataContent(data=b"%PDF", media_type="application/pdf"),
                DataContent(uri="s3://bucket/report.pdf", media_type="application/pdf"),
            ]
        ),
        ChatMessage.assistant(["calling", FunctionCallContent("t1", "get_weather", {"a": 1})]),
        ChatMessage.tool(FunctionResultContent("t1", {"ok": True})),
        ChatMessage.system("and polite"),
        ChatMessage.user("thanks"),
    ]
    result = await collect(client, messages, options, streaming=streaming)
    assert result.error is None
    request = server.requests[0]
    assert server.models == ["us.amazon.nova-pro-v1:0"]  # the request's model, in the path
    body = request.json
    assert body["system"] == [{"text": "be brief"}, {"text": "and polite"}]
    assert body["inferenceConfig"] == {
        "maxTokens": 50,
        "temperature": 0.2,
        "topP": 0.9,
        "stopSequences": ["X"],
    }
    assert "seed" not in json.dumps(body) and "presence_penalty" not in body
    assert body["performanceConfig"] == {"latency": "optimized"}
    user, assistant, results = body["messages"]
    assert user["content"] == [
        {"text": "look"},
        {"image": {"format": "png", "source": {"bytes": "iVBORw=="}}},
        {"image": {"format": "gif", "source": {"bytes": "R0lG"}}},
        {"document": {"format": "pdf", "name": "document-1", "source": {"bytes": "JVBERg=="}}},
        {
            "document": {
                "format": "pdf",
                "name": "document-2",
                "source": {"s3Location": {"uri": "s3://bucket/report.pdf"}},
            }
        },
    ]
    assert assistant == {
        "role": "assistant",
        "content": [
            {"text": "calling"},
            {"toolUse": {"toolUseId": "t1", "name": "get_weather", "input": {"a": 1}}},
        ],
    }
    # The tool result and the next user text are one user turn: the roles alternate.
    assert results == {
        "role": "user",
        "content": [
            {"toolResult": {"toolUseId": "t1", "content": [{"text": '{"ok": true}'}]}},
            {"text": "thanks"},
        ],
    }
    tools = body["toolConfig"]["tools"]
    assert [t["toolSpec"]["name"] for t in tools] == ["get_weather", "f", "g"]
    assert tools[0]["toolSpec"]["description"] == "The weather in a city."
    assert tools[0]["toolSpec"]["inputSchema"]["json"]["properties"]["city"]["type"] == "string"
    assert tools[2]["toolSpec"]["inputSchema"] == {"json": {"type": "object"}}
    assert body["toolConfig"]["toolChoice"] == {"tool": {"name": "get_weather"}}
    text_format = body["outputConfig"]["textFormat"]
    assert text_format["type"] == "json_schema"
    assert json.loads(text_format["structure"]["jsonSchema"]["schema"]) == {"type": "object"}
    assert text_format["structure"]["jsonSchema"]["name"] == "w"


@pytest.mark.parametrize(
    ("mode", "choice"),
    [("auto", {"auto": {}}), ("required", {"any": {}}), (None, None)],
)
async def test_tool_mode_maps_to_tool_choice(
    server: FakeBedrockServer, client: BedrockChatClient, mode: str | None, choice: object
) -> None:
    options = ChatOptions(tools=[{"name": "g", "input_schema": {"type": "object"}}], tool_mode=mode)
    await collect(client, "hi", options, streaming=False)
    assert server.requests[0].json["toolConfig"].get("toolChoice") == choice


async def test_tool_mode_none_sends_tools_only_when_the_conversation_used_them(
    server: FakeBedrockServer, client: BedrockChatClient
) -> None:
    options = ChatOptions(
        tools=[{"name": "g", "input_schema": {"type": "object"}}], tool_mode="none"
    )
    await collect(client, "hi", options, streaming=False)
    assert "toolConfig" not in server.requests[0].json
    history = [
        ChatMessage.user("hi"),
        ChatMessage.assistant([FunctionCallContent("t1", "g", {})]),
        ChatMessage.tool(FunctionResultContent("t1", "done")),
    ]
    result = await collect(client, history, options, streaming=False)
    assert result.error is None  # the service refuses tool blocks without a toolConfig
    assert server.requests[1].json["toolConfig"] == {
        "tools": [{"toolSpec": {"name": "g", "inputSchema": {"json": {"type": "object"}}}}]
    }


async def test_tool_calls_round_trip_with_unique_ids(
    server: FakeBedrockServer, client: BedrockChatClient, streaming: bool
) -> None:
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    server.script(
        FakeResponse(text="", tool_calls=[("get_weather", WEATHER), ("get_weather", "{}")]),
        FakeResponse(text="", tool_calls=[("get_weather", WEATHER)]),
        FakeResponse(text="Sunny."),
    )
    conversation = [ChatMessage.user("weather?")]
    options = ChatOptions(tools=tools)
    seen: list[str] = []
    for _ in range(3):
        result = await collect(client, conversation, options, streaming=streaming)
        assert result.error is None and result.response is not None
        message = result.response.messages[-1]
        calls = [c for c in message.contents if isinstance(c, FunctionCallContent)]
        if not calls:
            break
        assert result.response.finish_reason == "tool_calls"
        assert calls[0].arguments == {"city": "Oslo", "units": "metric"}
        seen += [c.call_id for c in calls]
        conversation += [
            message,
            ChatMessage.tool([FunctionResultContent(c.call_id, "ok") for c in calls]),
        ]
    assert result.text == "Sunny."
    assert len(seen) == 3 and len(set(seen)) == 3  # unique per call, as the service's
    # The fake checked that each turn's tool results answer the previous turn's tool uses.
    assert server.count() == 3


async def test_custom_tools_come_back_as_custom_calls(
    server: FakeBedrockServer, client: BedrockChatClient, streaming: bool
) -> None:
    server.script(FakeResponse(text="", custom_tool_calls=[("patch", "*** Begin Patch")]))
    options = ChatOptions(tools=[CustomTool("patch", "Apply a patch.")])
    result = await collect(client, "fix it", options, streaming=streaming)
    assert result.response is not None
    [call] = [
        c for c in result.response.messages[-1].contents if isinstance(c, FunctionCallContent)
    ]
    assert call.custom and call.input_text == "*** Begin Patch"
    spec = server.requests[0].json["toolConfig"]["tools"][0]["toolSpec"]
    assert spec["inputSchema"]["json"]["required"] == ["input"]


# -- reasoning --------------------------------------------------------------------------------


async def test_reasoning_round_trips_with_its_signature(
    server: FakeBedrockServer, client: BedrockChatClient, streaming: bool
) -> None:
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    server.script(
        FakeResponse(text="", tool_calls=[("get_weather", WEATHER)], thinking="CANARY-thought"),
        FakeResponse(text="Sunny."),
    )
    options = ChatOptions(tools=tools, reasoning=ReasoningOptions(budget_tokens=2048))
    first = await collect(client, "weather?", options, streaming=streaming)
    assert first.error is None and first.response is not None
    message = first.response.messages[-1]
    [reasoning] = [c for c in message.contents if isinstance(c, ReasoningContent)]
    assert reasoning.text == "CANARY-thought"
    assert reasoning.protected == server.reasoning_signature("CANARY-thought")
    assert "CANARY" not in repr(reasoning)
    assert server.requests[0].json["additionalModelRequestFields"] == {
        "thinking": {"type": "enabled", "budget_tokens": 2048}
    }
    [call] = [c for c in message.contents if isinstance(c, FunctionCallContent)]
    conversation = [
        ChatMessage.user("weather?"),
        message,
        ChatMessage.tool(FunctionResultContent(call.call_id, "rain")),
    ]
    second = await collect(client, conversation, options, streaming=streaming)
    # The fake refuses a tool-using turn without its reasoning, or a signature it did not make.
    assert second.error is None and second.text == "Sunny."
    sent = server.requests[1].json["messages"][1]["content"][0]
    assert sent == {
        "reasoningContent": {
            "reasoningText": {"text": "CANARY-thought", "signature": reasoning.protected}
        }
    }
    forged = ChatMessage.assistant(
        [ReasoningContent("CANARY-thought", protected="sig-forged"), *message.contents[1:]]
    )
    refused = await collect(
        client, [conversation[0], forged, conversation[2]], options, streaming=streaming
    )
    assert isinstance(refused.error, RequestInvalidError)
    assert refused.error.code == "ValidationException" and "CANARY" not in str(refused.error)


@pytest.mark.parametrize(
    ("model", "reasoning", "fields", "effort"),
    [
        (CLAUDE, ReasoningOptions(effort="high"), {"thinking": {"type": "adaptive"}}, "high"),
        (CLAUDE, ReasoningOptions(effort="minimal"), {"thinking": {"type": "adaptive"}}, "low"),
        (CLAUDE, ReasoningOptions(effort="none"), {"thinking": {"type": "disabled"}}, None),
        (CLAUDE, ReasoningOptions(budget_tokens=0), {"thinking": {"type": "disabled"}}, None),
        (
            "us.amazon.nova-2-lite-v1:0",
            ReasoningOptions(effort="xhigh"),
            {"reasoningConfig": {"type": "enabled", "maxReasoningEffort": "high"}},
            None,
        ),
        (
            "amazon.nova-2-lite-v1:0",
            ReasoningOptions(effort="none"),
            {"reasoningConfig": {"type": "disabled"}},
            None,
        ),
        (
            "openai.gpt-oss-120b-1:0",
            ReasoningOptions(effort="medium"),
            {"reasoning_effort": "medium"},
            None,
        ),
        ("meta.llama3-70b-instruct-v1:0", ReasoningOptions(effort="high"), None, None),
    ],
)
async def test_reasoning_goes_where_the_model_family_takes_it(
    server: FakeBedrockServer,
    client: BedrockChatClient,
    model: str,
    reasoning: ReasoningOptions,
    fields: object,
    effort: str | None,
) -> None:
    await collect(client, "hi", ChatOptions(model_id=model, reasoning=reasoning), streaming=False)
    body = server.requests[0].json
    assert body.get("additionalModelRequestFields") == fields
    assert body.get("outputConfig", {}).get("effort") == effort


async def test_redacted_reasoning_is_kept_and_sent_back(
    server: FakeBedrockServer, client: BedrockChatClient, streaming: bool
) -> None:
    redacted = _frame(
        "contentBlockDelta",
        {
            "delta": {"reasoningContent": {"redactedContent": "ZW5jcnlwdGVk"}},
            "contentBlockIndex": 0,
        },
    )
    stop_block = _frame("contentBlockStop", {"contentBlockIndex": 0})
    body = {
        "output": {
            "message": {
                "role": "assistant",
                "content": [
                    {"reasoningContent": {"redactedContent": "ZW5jcnlwdGVk"}},
                    {"text": "ok"},
                ],
            }
        },
        "stopReason": "end_turn",
        "usage": {"inputTokens": 1, "outputTokens": 1, "totalTokens": 2},
    }
    if streaming:
        server.script(
            FakeResponse(raw_body=START + redacted + stop_block + _text("ok", 1) + STOP + END)
        )
    else:
        server.script(FakeResponse(body=body))
    result = await collect(client, "hi", streaming=streaming)
    assert result.error is None and result.response is not None and result.text == "ok"
    [reasoning] = [
        c for c in result.response.messages[0].contents if isinstance(c, ReasoningContent)
    ]
    assert reasoning.redacted and reasoning.protected == "ZW5jcnlwdGVk" and reasoning.text == ""
    conversation = [ChatMessage.user("hi"), result.response.messages[0], ChatMessage.user("more")]
    await collect(client, conversation, streaming=streaming)
    assert server.requests[1].json["messages"][1]["content"][0] == {
        "reasoningContent": {"redactedContent": "ZW5jcnlwdGVk"}
    }


# -- prompt caching ---------------------------------------------------------------------------


async def test_cache_control_becomes_cache_points_and_the_cache_is_read(
    server: FakeBedrockServer, client: BedrockChatClient, streaming: bool
) -> None:
    breakpoint_ = {"cache_control": {"type": "ephemeral"}}
    tool = {
        "name": "g",
        "input_schema": {"type": "object"},
        "cache_control": {"type": "ephemeral", "ttl": "1h"},
    }
    messages = [
        ChatMessage("system", "a long system prompt " * 50, additional_properties=breakpoint_),
        ChatMessage("user", "a long document " * 50, additional_properties=breakpoint_),
    ]
    options = ChatOptions(tools=[tool])
    first = await collect(client, messages, options, streaming=streaming)
    second = await collect(client, messages, options, streaming=streaming)
    body = server.requests[0].json
    assert body["system"][-1] == {"cachePoint": {"type": "default"}}
    assert body["messages"][0]["content"][-1] == {"cachePoint": {"type": "default"}}
    assert body["toolConfig"]["tools"][-1] == {"cachePoint": {"type": "default", "ttl": "1h"}}
    assert first.response is not None and second.response is not None
    written = first.response.usage
    read = second.response.usage
    assert written is not None and read is not None
    assert (written.cache_write_tokens or 0) > 0 and written.cache_read_tokens == 0
    assert (read.cache_read_tokens or 0) > 0 and read.cache_write_tokens == 0


async def test_beyond_four_cache_points_the_earliest_are_left_out(
    server: FakeBedrockServer, client: BedrockChatClient
) -> None:
    breakpoint_ = {"cache_control": {"type": "ephemeral"}}
    messages = [
        ChatMessage("system", f"part {i}", additional_properties=breakpoint_) for i in range(3)
    ]
    messages += [
        ChatMessage("user", "one", additional_properties=breakpoint_),
        ChatMessage("assistant", "two", additional_properties=breakpoint_),
        ChatMessage("user", "three", additional_properties=breakpoint_),
    ]
    result = await collect(client, messages, streaming=False)
    assert result.error is None  # the fake refuses more than four
    body = server.requests[0].json
    assert body["system"] == [
        {"text": "part 0"},
        {"text": "part 1"},
        {"text": "part 2"},
        {"cachePoint": {"type": "default"}},
    ]
    points = [b for m in body["messages"] for b in m["content"] if "cachePoint" in b]
    assert len(points) == 3


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error_type", "message", "error_class", "kind"),
    [
        (
            429,
            "ThrottlingException",
            "Too many requests",
            RateLimitedError,
            FailureKind.RATE_LIMITED,
        ),
        (400, "ServiceQuotaExceededException", "quota", RateLimitedError, FailureKind.RATE_LIMITED),
        (429, "ModelNotReadyException", "not ready", TransientProviderError, FailureKind.TRANSIENT),
        (503, "ServiceUnavailableException", "down", TransientProviderError, FailureKind.TRANSIENT),
        (500, "InternalServerException", "oops", TransientProviderError, FailureKind.TRANSIENT),
        (408, "ModelTimeoutException", "slow", TransientProviderError, FailureKind.TRANSIENT),
        (424, "ModelErrorException", "model failed", UnknownProviderError, FailureKind.UNKNOWN),
        (400, "ValidationException", "bad", RequestInvalidError, FailureKind.REQUEST_INVALID),
        (
            400,
            "ValidationException",
            "Input is too long for requested model.",
            ContextLengthExceededError,
            FailureKind.CONTEXT_LENGTH_EXCEEDED,
        ),
        (
            404,
            "ResourceNotFoundException",
            "no model",
            RequestInvalidError,
            FailureKind.REQUEST_INVALID,
        ),
        (403, "AccessDeniedException", "denied", AuthenticationError, FailureKind.AUTHENTICATION),
        (502, "SomethingNewException", "new", TransientProviderError, FailureKind.TRANSIENT),
    ],
)
async def test_error_types_map_to_kinds(
    server: FakeBedrockServer,
    client: BedrockChatClient,
    streaming: bool,
    status: int,
    error_type: str,
    message: str,
    error_class: type[ProviderError],
    kind: FailureKind,
) -> None:
    server.script(FakeResponse.error(status, type=error_type, message=f"{message} CANARY-prompt"))
    result = await collect(client, "CANARY-prompt", streaming=streaming)
    assert type(result.error) is error_class
    assert isinstance(result.error, ProviderError)
    assert result.error.kind is kind and result.error.status_code == status
    assert result.error.code == error_type and result.error.provider == "aws.bedrock"
    assert result.error.url is not None and result.error.url.startswith(server.base_url)
    assert "CANARY" not in str(result.error) and result.updates == []


async def test_throttling_carries_retry_after_and_is_retried(
    server: FakeBedrockServer, client: BedrockChatClient, streaming: bool
) -> None:
    from middleware.retry import RetryChatClient, RetrySettings

    server.script(FakeResponse.error(429, type="ThrottlingException", retry_after="0"))
    direct = await collect(client, "hi", streaming=streaming)
    assert isinstance(direct.error, RateLimitedError) and direct.error.retry_after == 0.0
    server.script(
        FakeResponse.error(429, type="ThrottlingException", retry_after="0"),
        FakeResponse(text="ok"),
    )
    retrying = RetryChatClient(
        client, RetrySettings(max_attempts=2, initial_delay=0, max_delay=0), leave_open=True
    )
    result = await collect(retrying, "hi", streaming=streaming)
    assert result.error is None and result.text == "ok"
    assert server.count() == 3


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        ({"type": "throttlingException", "message": "CANARY"}, FailureKind.RATE_LIMITED),
        ({"type": "modelStreamErrorException", "message": "CANARY"}, FailureKind.TRANSIENT),
        ({"type": "serviceUnavailableException", "message": "CANARY"}, FailureKind.TRANSIENT),
        ({"type": "internalServerException", "message": "CANARY"}, FailureKind.TRANSIENT),
        ({"type": "validationException", "message": "CANARY"}, FailureKind.REQUEST_INVALID),
    ],
)
async def test_in_band_exception_before_output_fails_over(
    error: dict[str, str], kind: FailureKind, server: FakeBedrockServer
) -> None:
    async with FakeOpenAIServer() as backup:
        # After messageStart: no content yet.
        server.script(FakeResponse(in_band_error=error, error_after=1))
        first = BedrockChatClient(CLAUDE, base_url=server.base_url, name="bedrock")
        direct = await collect(first, "hi", streaming=True)
        assert isinstance(direct.error, ProviderError) and direct.error.kind is kind
        assert direct.updates == [] and "CANARY" not in str(direct.error)
        server.script(FakeResponse(in_band_error=error, error_after=1))
        second = OpenAIChatClient("gpt", api_key="sk-test", base_url=backup.base_url, name="openai")
        async with OrderedFailoverChatClient([first, second]) as router:
            result = await collect(router, "hi", streaming=True)
    eligible = kind in (FailureKind.RATE_LIMITED, FailureKind.TRANSIENT)
    assert (result.error is None) is eligible
    assert (server.count(), backup.count()) == (2, 1 if eligible else 0)


async def test_in_band_exception_after_output_is_terminal(server: FakeBedrockServer) -> None:
    async with FakeOpenAIServer() as backup:
        error = {"type": "modelStreamErrorException", "message": "cut"}
        # messageStart, two text deltas: then the exception.
        server.script(FakeResponse(text="a b c", in_band_error=error, error_after=3))
        router = OrderedFailoverChatClient(
            [
                BedrockChatClient(CLAUDE, base_url=server.base_url, name="bedrock"),
                OpenAIChatClient("gpt", api_key="sk-test", base_url=backup.base_url, name="openai"),
            ]
        )
        result = await collect(router, "hi", streaming=True)
        await router.aclose()
    assert isinstance(result.error, TransientProviderError)
    assert result.error.code == "ModelStreamErrorException"
    assert [u.text for u in result.updates] == ["a ", "b "]
    assert backup.count() == 0


async def test_failures_before_output_fail_over_and_after_output_do_not(
    server: FakeBedrockServer, streaming: bool
) -> None:
    async with FakeOpenAIServer() as backup:
        router = OrderedFailoverChatClient(
            [
                BedrockChatClient(CLAUDE, base_url=server.base_url, name="bedrock"),
                OpenAIChatClient("gpt", api_key="sk-test", base_url=backup.base_url, name="openai"),
            ]
        )
        server.script(FakeResponse.error(503, type="ServiceUnavailableException"))
        backup.script(FakeResponse(text="from openai"))
        before = await collect(router, "hi", streaming=streaming)
        assert before.error is None and before.text == "from openai"
        assert (server.count(), backup.count()) == (1, 1)
        if streaming:
            server.script(FakeResponse(text="a b c d", disconnect_after=3))  # two deltas out
            after = await collect(router, "hi", streaming=True)
            assert isinstance(after.error, TransientProviderError)
            assert [u.text for u in after.updates] == ["a ", "b "]
            assert backup.count() == 1
        await router.aclose()


async def test_disconnects_before_and_after_output(
    server: FakeBedrockServer, client: BedrockChatClient
) -> None:
    server.script(FakeResponse(text="a b c d", disconnect_after=1))  # messageStart only
    before = await collect(client, "hi", streaming=True)
    assert isinstance(before.error, TransientProviderError) and before.updates == []
    server.script(FakeResponse(text="a b c d", disconnect_after=3))
    after = await collect(client, "hi", streaming=True)
    assert isinstance(after.error, TransientProviderError)
    assert [u.text for u in after.updates] == ["a ", "b "]


async def test_a_stream_without_its_metadata_is_incomplete(
    server: FakeBedrockServer, client: BedrockChatClient
) -> None:
    server.script(FakeResponse(text="a b", omit_done=True))
    result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, TransientProviderError)
    assert result.error.code == "incomplete_stream"
    assert [u.text for u in result.updates] == ["a ", "b"]


def _bad_crc(frame: bytes) -> bytes:
    return frame[:-4] + struct.pack("!I", (zlib.crc32(frame[:-4]) + 1) & 0xFFFFFFFF)


_TOOL_START = _frame(
    "contentBlockStart",
    {"start": {"toolUse": {"toolUseId": "t", "name": "f"}}, "contentBlockIndex": 0},
)


def _delta(delta: object, index: int = 0) -> bytes:
    return _frame("contentBlockDelta", {"delta": delta, "contentBlockIndex": index})


_NOT_JSON = event_stream_frame(
    {":event-type": "contentBlockDelta", ":message-type": "event"}, b"{not json"
)
_SHORT_PRELUDE = struct.pack("!II", 8, 0)
_SHORT = _SHORT_PRELUDE + struct.pack("!I", zlib.crc32(_SHORT_PRELUDE)) + b"\0" * 8


@pytest.mark.parametrize(
    ("body", "before_failure"),
    [
        (b"this is not an event stream at all", []),
        (START + _bad_crc(_text("a")) + STOP + END, []),
        (START + _NOT_JSON + END, []),
        (START + _frame("x", {}, message_type="surprise") + END, []),
        (START + _text("a") + _delta("x"), ["a"]),  # a delta that is no object
        (START + _delta({"toolUse": {"input": "{"}}) + END, []),  # no toolUse block open
        (START + _text("a") + _SHORT, ["a"]),  # a frame shorter than its prelude
        (  # a tool's input that is not JSON
            START
            + _TOOL_START
            + _delta({"toolUse": {"input": '{"a": '}})
            + _frame("contentBlockStop", {"contentBlockIndex": 0})
            + STOP
            + END,
            [],
        ),
    ],
)
async def test_malformed_event_streams_raise_provider_error(
    server: FakeBedrockServer, client: BedrockChatClient, body: bytes, before_failure: list[str]
) -> None:
    server.script(FakeResponse(raw_body=body))
    result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, ProviderError)
    assert result.error.kind is FailureKind.UNKNOWN and result.error.code == "malformed"
    assert [u.text for u in result.updates] == before_failure


async def test_an_error_frame_is_its_provider_error(
    server: FakeBedrockServer, client: BedrockChatClient
) -> None:
    error = event_stream_frame(
        {
            ":message-type": "error",
            ":error-code": "ThrottlingException",
            ":error-message": "CANARY",
        },
        b"",
    )
    server.script(FakeResponse(raw_body=START + error))
    result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, RateLimitedError) and "CANARY" not in str(result.error)


async def test_malformed_answers_raise_provider_error(
    server: FakeBedrockServer, client: BedrockChatClient
) -> None:
    from pipeline.wire.bedrock.outbound import parse_response

    for payload in (
        [1],
        {"output": {}},
        {"output": {"message": {"content": [1]}}},
        {"output": {"message": {"content": [{"text": 3}]}}},
        {"output": {"message": {"content": [{"toolUse": {"name": ""}}]}}},
        {"output": {"message": {"content": [{"toolUse": {"name": "f", "input": "{"}}]}}},
        {
            "output": {
                "message": {"content": [{"reasoningContent": {"reasoningText": {"text": 1}}}]}
            }
        },
    ):
        with pytest.raises(ProviderError) as caught:
            parse_response(payload, "aws.bedrock", CLAUDE)
        assert caught.value.code == "malformed"


# -- signatures and credentials ---------------------------------------------------------------


# Vectors of AWS's SigV4 test suite (aws-sig-v4-test-suite: get-vanilla, post-vanilla,
# post-x-www-form-urlencoded, post-sts-header-after), signed through the code path the
# client signs with.
_AKID = "AKIDEXAMPLE"
_SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"
_STS_TOKEN = (
    "AQoDYXdzEPT//////////wEXAMPLEtc764bNrC9SAPBSM22wDOk4x4HIZ8j4FZTwdQWLWsKWHGBuFqwAeMicRXmxfpSPf"
    "IeoIYRqTflfKD8YUuwthAx7mSEI/qkPpKPi/kMcGdQrmGdeehM4IC1NtBmUpp2wUE8phUZampKsburEDy0KPkyQDYwT7"
    "WZ0wq5VSXDvp75YU9HFvlRd8Tx6q6fE8YQcHNVXAkiY9q6d+xo0rKwT38xVqr7ZD0u0iPPkUL64lIZbqBAz+scqKmlzm8"
    "FDrypNC9Yjc8fPOLn9FX9KSYvKTr4rvx3iSIlTJabIQwj2ICCR/oLxBA=="
)
_VECTORS = [
    (
        "GET",
        b"",
        {},
        None,
        "host;x-amz-date",
        "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31",
    ),
    (
        "POST",
        b"",
        {},
        None,
        "host;x-amz-date",
        "5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b",
    ),
    (
        "POST",
        b"Param1=value1",
        {"Content-Type": "application/x-www-form-urlencoded"},
        None,
        "content-type;host;x-amz-date",
        "ff11897932ad3f4e8b18135d722051e5ac45fc38421b1da7b9d196a0fe09473a",
    ),
    (
        "POST",
        b"",
        {},
        _STS_TOKEN,
        "host;x-amz-date;x-amz-security-token",
        "85d96828115b5dc0cfc3bd16ad9e210dd772bbebba041836c64533a82be05ead",
    ),
]


@pytest.mark.parametrize(("method", "body", "headers", "token", "signed", "signature"), _VECTORS)
def test_sigv4_matches_the_aws_test_suite(
    method: str,
    body: bytes,
    headers: dict[str, str],
    token: str | None,
    signed: str,
    signature: str,
) -> None:
    from botocore.credentials import ReadOnlyCredentials

    credentials = ReadOnlyCredentials(_AKID, _SECRET, token)
    when = 1440938160.0  # 20150830T123600Z
    result = sigv4_headers(
        method,
        "https://example.amazonaws.com/",
        body,
        {"Host": "example.amazonaws.com", **headers},
        credentials,
        "us-east-1",
        "service",
        when,
    )
    assert result["X-Amz-Date"] == "20150830T123600Z"
    assert result["Authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, "
        f"SignedHeaders={signed}, Signature={signature}"
    )
    assert result.get("X-Amz-Security-Token") == token


async def test_the_fake_refuses_a_bad_signature(
    server: FakeBedrockServer, monkeypatch: pytest.MonkeyPatch, streaming: bool
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    async with BedrockChatClient(CLAUDE, base_url=server.base_url) as client:
        result = await collect(client, "hi", streaming=streaming)
    assert isinstance(result.error, AuthenticationError)
    assert result.error.code == "InvalidSignatureException" and result.error.status_code == 403
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDUNKNOWN")
    async with BedrockChatClient(CLAUDE, base_url=server.base_url) as client:
        result = await collect(client, "hi", streaming=streaming)
    assert isinstance(result.error, AuthenticationError)
    assert result.error.code == "UnrecognizedClientException"
    assert server.verified_signatures == 0


async def test_no_credential_reaches_reprs_errors_or_logs(
    server: FakeBedrockServer, caplog: pytest.LogCaptureFixture, streaming: bool
) -> None:
    caplog.set_level(logging.DEBUG)
    server.script(FakeResponse(text="ok"), FakeResponse.error(500, type="InternalServerException"))
    async with BedrockChatClient(CLAUDE, base_url=server.base_url) as client:
        ok = await collect(client, "hi", streaming=streaming)
        failed = await collect(client, "hi", streaming=streaming)
        shown = repr(client) + str(client.metadata)
    assert ok.error is None and isinstance(failed.error, TransientProviderError)
    everything = shown + str(failed.error) + repr(failed.error.args) + caplog.text
    assert "CANARY" not in everything
    assert client.metadata.provider_name == "aws.bedrock"


def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials anywhere botocore looks."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_REGION", "us-east-1")


def test_missing_expired_or_unknown_credentials_are_errors_at_startup(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _isolated(monkeypatch, tmp_path)
    with pytest.raises(ValueError, match="no AWS credentials found"):
        BedrockChatClient(CLAUDE)
    with pytest.raises(ValueError, match="profile 'nope' is not configured"):
        BedrockChatClient(CLAUDE, profile="nope")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXPIRED")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_CANARY)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN_CANARY)
    monkeypatch.setenv("AWS_CREDENTIAL_EXPIRATION", "2020-01-01T00:00:00Z")
    with pytest.raises(ValueError, match="expired") as caught:
        BedrockChatClient(CLAUDE)
    assert "CANARY" not in str(caught.value)
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.delenv("AWS_CREDENTIAL_EXPIRATION")
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    with pytest.raises(ValueError, match="no AWS region"):
        BedrockChatClient(CLAUDE)


def test_a_route_without_credentials_is_a_configuration_error_naming_its_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from pipeline.config import parse_config
    from pipeline.errors import ConfigError

    _isolated(monkeypatch, tmp_path)
    config = parse_config({"routes": {"claude": {"provider": "bedrock", "model": CLAUDE}}})
    with pytest.raises(ConfigError) as caught:
        config.build()
    assert caught.value.key_path == "routes.claude"
    assert "no AWS credentials found" in str(caught.value)


async def test_a_profile_and_refreshed_credentials(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, streaming: bool
) -> None:
    """A profile whose ``credential_process`` hands out keys that expire within botocore's
    refresh window: each request refreshes them (in a thread) and signs with the new key."""
    _isolated(monkeypatch, tmp_path)
    counter = tmp_path / "issued"
    process = tmp_path / "credentials.py"
    process.write_text(
        textwrap.dedent(
            f"""
            import datetime, json, pathlib
            counter = pathlib.Path({str(counter)!r})
            issued = int(counter.read_text()) + 1 if counter.exists() else 1
            counter.write_text(str(issued))
            expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=5)
            print(json.dumps({{
                "Version": 1,
                "AccessKeyId": f"AKIDROTATED{{issued}}",
                "SecretAccessKey": f"secret-{{issued}}",
                "SessionToken": f"token-{{issued}}",
                "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
            }}))
            """
        )
    )
    (tmp_path / "config").write_text(
        f"[profile rotating]\nregion = us-east-1\ncredential_process = {sys.executable} {process}\n"
    )
    keys = {f"AKIDROTATED{i}": f"secret-{i}" for i in range(1, 6)}
    tokens = {f"AKIDROTATED{i}": f"token-{i}" for i in range(1, 6)}
    async with FakeBedrockServer(credentials=keys, session_tokens=tokens) as server:
        monkeypatch.delenv("AWS_REGION")
        async with BedrockChatClient(
            CLAUDE, profile="rotating", base_url=server.base_url
        ) as client:
            assert client.region == "us-east-1"  # the profile's
            first = await collect(client, "hi", streaming=streaming)
            second = await collect(client, "hi", streaming=streaming)
    assert first.error is None and second.error is None
    used = [
        r.headers["authorization"].split("Credential=")[1].split("/")[0] for r in server.requests
    ]
    # Each request refreshed the keys (they expire inside botocore's refresh window) and
    # signed with the new ones.
    assert len(set(used)) == 2 and "AKIDROTATED1" not in used
    assert server.verified_signatures == 2


def test_without_botocore_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "botocore.session", None)
    with pytest.raises(ImportError, match=r"chat-pipeline\[bedrock\]"):
        BedrockChatClient(CLAUDE, region="us-east-1")


def test_arguments_are_checked(server: FakeBedrockServer) -> None:
    with pytest.raises(ValueError, match="model"):
        BedrockChatClient("")
    with pytest.raises(ValueError, match="max_tokens"):
        BedrockChatClient(CLAUDE, max_tokens=0)


async def test_max_tokens_is_sent_when_a_request_sets_none(server: FakeBedrockServer) -> None:
    async with BedrockChatClient(CLAUDE, base_url=server.base_url, max_tokens=99) as client:
        await collect(client, "hi", streaming=False)
        await collect(client, "hi", ChatOptions(max_output_tokens=5), streaming=False)
    assert [r.json["inferenceConfig"]["maxTokens"] for r in server.requests] == [99, 5]


async def test_bad_content_gets_a_clear_error(client: BedrockChatClient) -> None:
    from pipeline.errors import UnsendableRequestError

    for content in (
        DataContent(uri="https://example.com/cat.png"),
        DataContent(data=b"x", media_type="video/mp4"),
    ):
        result = await collect(client, [ChatMessage.user(["see", content])], streaming=False)
        assert isinstance(result.error, UnsendableRequestError)
    result = await collect(client, [ChatMessage.system("only a system prompt")], streaming=True)
    assert isinstance(result.error, UnsendableRequestError)


@pytest.fixture(autouse=True)
def _no_real_aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Nothing in this file may reach AWS's instance metadata service.
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    yield
    assert os.environ.get("AWS_EC2_METADATA_DISABLED") == "true"


async def test_attempts_name_the_provider_and_model_and_never_a_credential(
    server: FakeBedrockServer, streaming: bool, otel: Otel
) -> None:
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai

    from pipeline import ChatPipeline

    async with FakeOpenAIServer() as backup:
        server.script(FakeResponse.error(503, type="ServiceUnavailableException"))
        chat = (
            ChatPipeline.builder(**otel.providers)
            .use_telemetry()
            .use_ordered_failover(
                [
                    BedrockChatClient(CLAUDE, base_url=server.base_url, name="bedrock"),
                    OpenAIChatClient("gpt", api_key="sk-test", base_url=backup.base_url),
                ]
            )
            .build()
        )
        async with chat:
            result = await collect(chat, "CANARY-prompt", streaming=streaming)
    assert result.error is None
    first, second = otel.attempt_spans()
    attributes = dict(first.attributes or {})
    assert attributes[gen_ai.GEN_AI_SYSTEM] == "aws.bedrock"
    assert attributes[gen_ai.GEN_AI_REQUEST_MODEL] == CLAUDE
    assert attributes["chat_pipeline.route.name"] == "bedrock"
    assert dict(second.attributes or {})[gen_ai.GEN_AI_SYSTEM] == "openai"
    for text in otel.everything_exported():
        assert "CANARY" not in text


async def test_a_bedrock_route_with_a_breaker_and_retry_under_a_hedged_router_and_the_cache(
    server: FakeBedrockServer, streaming: bool
) -> None:
    """A route like any other, from TOML: its own retry and breaker, a hedged router beside
    an OpenAI route, and the response cache in front (the second ask is the cache's)."""
    from pipeline.config import parse_config

    async with FakeOpenAIServer() as backup:
        config = parse_config(
            {
                "routes": {
                    "bedrock": {
                        "provider": "bedrock",
                        "model": CLAUDE,
                        "base_url": server.base_url,
                        "retry": {"max_attempts": 2, "initial_delay": 0, "max_delay": 0},
                        "breaker": {"fail_max": 5},
                    },
                    "openai": {"provider": "openai", "model": "gpt", "base_url": backup.base_url},
                },
                "router": {"kind": "hedged", "routes": ["bedrock", "openai"], "delay": 30},
                "cache": {"store": "memory"},
            }
        )
        server.script(
            FakeResponse.error(503, type="ServiceUnavailableException"),
            FakeResponse(text="from bedrock"),
        )
        backup.script(FakeResponse(text="from openai"))
        chat = config.build()
        async with chat:
            first = await collect(chat, "CANARY-prompt", streaming=streaming)
            asked = (server.count(), backup.count())
            second = await collect(chat, "CANARY-prompt", streaming=streaming)
            assert (server.count(), backup.count()) == asked  # the cache's answer
    assert first.error is None and second.error is None
    assert first.text == second.text
    # Whichever route the balancer tried first: Bedrock answers on its own retry (unavailable,
    # then the answer), or OpenAI at once.
    assert (first.text, asked) in (("from bedrock", (2, 0)), ("from openai", (0, 1)))


class _RefreshFailsLater:
    """Credentials that load at startup and cannot be refreshed afterwards."""

    def __init__(self) -> None:
        from botocore.credentials import ReadOnlyCredentials

        self.frozen = ReadOnlyCredentials("AKIDCANARYKEY", SECRET_CANARY, TOKEN_CANARY)
        self.calls = 0

    def refresh_needed(self, refresh_in: float | None = None) -> bool:
        # Not expired (refresh_in=0), but due for the refresh that will fail.
        return refresh_in != 0 and self.calls > 0

    def get_frozen_credentials(self) -> object:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError(f"STS is down {SECRET_CANARY}")
        return self.frozen


async def test_a_refresh_that_fails_later_is_an_authentication_error_before_sending(
    server: FakeBedrockServer, streaming: bool
) -> None:
    credentials = _RefreshFailsLater()
    async with BedrockChatClient(
        CLAUDE, base_url=server.base_url, credentials=credentials
    ) as client:
        result = await collect(client, "hi", streaming=streaming)
    assert isinstance(result.error, AuthenticationError)
    assert result.error.code == "credentials_refresh_failed"
    assert "CANARY" not in str(result.error) and server.count() == 0
