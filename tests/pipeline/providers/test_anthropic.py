"""AnthropicChatClient over real HTTP, against FakeAnthropicServer: every event, every error
type, both call shapes, and failover from an OpenAI-format route to an Anthropic one."""

import json
from collections.abc import AsyncIterator

import httpx2
import pytest

from middleware.function_invocation import Tool
from middleware.routing import OrderedFailoverChatClient, Route
from pipeline import (
    ChatMessage,
    ChatOptions,
    DataContent,
    FunctionCallContent,
    FunctionResultContent,
    UsageDetails,
)
from pipeline.errors import (
    AuthenticationError,
    ContextLengthExceededError,
    FailureKind,
    ProviderError,
    QuotaExhaustedError,
    RateLimitedError,
    RequestInvalidError,
    TransientProviderError,
)
from pipeline.providers import AnthropicChatClient, OpenAIChatClient
from pipeline.testing import FakeAnthropicServer, FakeOpenAIServer, FakeResponse, collect

# Every test runs over both HTTP transports (the `transport` fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("transport")

KEY = "sk-ant-CANARY-key"
WEATHER = json.dumps({"city": "Oslo", "units": "metric"})


@pytest.fixture
async def server() -> AsyncIterator[FakeAnthropicServer]:
    async with FakeAnthropicServer() as fake:
        yield fake


@pytest.fixture
async def client(server: FakeAnthropicServer) -> AsyncIterator[AnthropicChatClient]:
    chat = AnthropicChatClient("claude-test", api_key=KEY, base_url=server.base_url)
    yield chat
    await chat.aclose()


def _event(name: str, data: dict[str, object]) -> list[str]:
    return [f"event: {name}", f"data: {json.dumps(data)}", ""]


START = _event(
    "message_start",
    {
        "type": "message_start",
        "message": {"id": "msg_1", "model": "claude-test", "usage": {"input_tokens": 3}},
    },
)
TEXT_BLOCK = _event(
    "content_block_start",
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
)
STOP = _event("message_stop", {"type": "message_stop"})


def _text_delta(text: str, index: int = 0) -> list[str]:
    delta = {"type": "text_delta", "text": text}
    return _event(
        "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    )


# -- successes --------------------------------------------------------------------------------


async def test_text_usage_and_cache_tokens(
    server: FakeAnthropicServer, client: AnthropicChatClient, streaming: bool
) -> None:
    server.script(FakeResponse(text="one two three", usage=(11, 3), cache_usage=(4, 5)))
    result = await collect(client, "hi", streaming=streaming)
    assert result.error is None and result.response is not None
    assert result.text == "one two three"
    # Input tokens include prompt-cache writes and reads.
    assert result.response.usage == UsageDetails(
        20, 3, 23, cache_read_tokens=5, cache_write_tokens=4
    )
    assert result.response.finish_reason == "stop"
    assert result.response.model_id == "claude-test"
    assert result.response.response_id == "msg_fake_1"
    if streaming:
        assert [u.text for u in result.updates if u.text] == ["one ", "two ", "three"]
        assert [u.usage for u in result.updates if u.usage] == [
            UsageDetails(20, 3, 23, cache_read_tokens=5, cache_write_tokens=4)
        ]
        assert result.updates[-1].finish_reason == "stop"
    assert server.count() == 1


async def test_request_wire_format(
    server: FakeAnthropicServer, client: AnthropicChatClient, streaming: bool
) -> None:
    def get_weather(city: str, units: str = "metric") -> str:
        """The weather in a city."""
        return city

    tool = Tool.from_function(get_weather)
    openai_tool = {
        "type": "function",
        "function": {"name": "f", "description": "F.", "parameters": {"type": "object"}},
    }
    options = ChatOptions(
        model_id="claude-override",
        temperature=0.2,
        top_p=0.9,
        max_output_tokens=50,
        stop=["X"],
        seed=3,
        tools=[tool, openai_tool],
        tool_mode="required",
        additional_properties={"top_k": 5},
    )
    messages = [
        ChatMessage.system("be brief"),
        ChatMessage.user(
            [
                "look",
                DataContent(data=b"\x89PNG", media_type="image/png"),
                DataContent(uri="https://example.com/cat.jpg"),
                DataContent(uri="data:image/gif;base64,R0lG"),
                DataContent(data=b"%PDF", media_type="application/pdf"),
            ]
        ),
        ChatMessage.assistant(["calling", FunctionCallContent("toolu_1", "get_weather", {"a": 1})]),
        ChatMessage.tool(FunctionResultContent("toolu_1", {"ok": True})),
        ChatMessage.tool(FunctionResultContent("toolu_2", exception=RuntimeError("CANARY"))),
        ChatMessage.system("and polite"),
        ChatMessage.user("thanks"),
    ]
    await collect(client, messages, options, streaming=streaming)
    request = server.requests[0]
    assert request.headers["x-api-key"] == KEY
    assert request.headers["anthropic-version"] == "2023-06-01"
    body = request.json
    assert body["model"] == "claude-override"
    assert (body["max_tokens"], body["temperature"], body["top_p"]) == (50, 0.2, 0.9)
    assert body["stop_sequences"] == ["X"] and body["top_k"] == 5
    assert "seed" not in body
    assert body["system"] == "be brief\n\nand polite"
    assert body["tools"] == [
        {
            "name": "get_weather",
            "description": "The weather in a city.",
            "input_schema": tool.parameters,
        },
        {"name": "f", "description": "F.", "input_schema": {"type": "object"}},
    ]
    assert body["tool_choice"] == {"type": "any"}
    user, assistant, results = body["messages"]
    assert user["role"] == "user"
    assert user["content"] == [
        {"type": "text", "text": "look"},
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw=="},
        },
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/gif", "data": "R0lG"},
        },
        {
            "type": "document",
            "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERg=="},
        },
    ]
    assert assistant == {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"a": 1}},
        ],
    }
    # Tool results go back as one user turn (with the next user text merged into it).
    assert results == {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"ok": true}'},
            {
                "type": "tool_result",
                "tool_use_id": "toolu_2",
                "content": "Error: RuntimeError",
                "is_error": True,
            },
            {"type": "text", "text": "thanks"},
        ],
    }
    assert ("stream" in body) is streaming


@pytest.mark.parametrize(
    ("mode", "choice"),
    [
        ("auto", {"type": "auto"}),
        ("none", {"type": "none"}),
        ("required", {"type": "any"}),
        ("get_weather", {"type": "tool", "name": "get_weather"}),
    ],
)
async def test_tool_mode_maps_to_tool_choice(
    server: FakeAnthropicServer, client: AnthropicChatClient, mode: str, choice: object
) -> None:
    tool = {"name": "get_weather", "input_schema": {"type": "object"}}
    await client.get_response("hi", ChatOptions(tools=[tool], tool_mode=mode))
    body = server.requests[0].json
    assert body["tool_choice"] == choice and body["tools"] == [tool]


async def test_default_max_tokens_is_sent(server: FakeAnthropicServer) -> None:
    client = AnthropicChatClient("c", api_key=KEY, base_url=server.base_url, max_tokens=77)
    await client.get_response("hi")
    assert server.requests[0].json["max_tokens"] == 77
    assert "system" not in server.requests[0].json
    await client.aclose()


async def test_tool_use_is_assembled(
    server: FakeAnthropicServer, client: AnthropicChatClient, streaming: bool
) -> None:
    server.script(
        FakeResponse(
            text="Let me check.",
            tool_calls=[("get_weather", WEATHER), ("noop", "{}")],
            tool_call_pieces=5,
        )
    )
    result = await collect(client, "weather?", streaming=streaming)
    assert result.error is None and result.response is not None
    [message] = result.response.messages
    assert message.text == "Let me check."
    calls = [c for c in message.contents if isinstance(c, FunctionCallContent)]
    assert [(c.name, dict(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "units": "metric"}),
        ("noop", {}),
    ]
    # The server's ids, each its own.
    assert all(c.call_id.startswith("toolu_") for c in calls)
    assert len({c.call_id for c in calls}) == 2
    assert result.response.finish_reason == "tool_calls"
    if streaming:  # each call arrives whole, when its block stops
        assert [len(u.contents) for u in result.updates if u.contents and not u.text] == [1, 1]


@pytest.mark.parametrize(
    ("stop_reason", "finish_reason"),
    [
        ("end_turn", "stop"),
        ("max_tokens", "length"),
        ("tool_use", "tool_calls"),
        ("stop_sequence", "stop"),
        ("refusal", "content_filter"),
        ("something_new", "something_new"),
    ],
)
async def test_stop_reasons_map_to_finish_reasons(
    server: FakeAnthropicServer,
    client: AnthropicChatClient,
    streaming: bool,
    stop_reason: str,
    finish_reason: str,
) -> None:
    server.script(FakeResponse(text="a b", stop_reason=stop_reason))
    result = await collect(client, "hi", streaming=streaming)
    assert result.response is not None
    assert result.response.finish_reason == finish_reason


async def test_pings_and_unknown_events_and_blocks_are_skipped(
    server: FakeAnthropicServer, client: AnthropicChatClient
) -> None:
    thinking = _event(
        "content_block_start",
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": ""},
        },
    )
    thinking_delta = _event(
        "content_block_delta",
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "CANARY thoughts"},
        },
    )
    lines = [
        *START,
        *_event("ping", {"type": "ping"}),
        *thinking,
        *thinking_delta,
        *_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        *_event("brand_new_event", {"type": "brand_new_event"}),
        *_event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 1,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        *_text_delta("answer", index=1),
        *_event("content_block_stop", {"type": "content_block_stop", "index": 1}),
        *_event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn"},
                "usage": {"output_tokens": 2},
            },
        ),
        *STOP,
    ]
    server.script(FakeResponse(raw_lines=lines))
    result = await collect(client, "hi", streaming=True)
    assert result.error is None and result.response is not None
    assert [u.text for u in result.updates if u.text] == ["answer"]
    assert result.response.usage == UsageDetails(3, 2, 5)
    assert result.response.response_id == "msg_1"


# -- HTTP errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "type_", "message", "error_type", "kind"),
    [
        (400, None, "bad", RequestInvalidError, FailureKind.REQUEST_INVALID),
        (
            400,
            "invalid_request_error",
            "prompt is too long: 208310 tokens > 200000 maximum",
            ContextLengthExceededError,
            FailureKind.CONTEXT_LENGTH_EXCEEDED,
        ),
        (401, None, "bad key", AuthenticationError, FailureKind.AUTHENTICATION),
        (403, None, "no", AuthenticationError, FailureKind.AUTHENTICATION),
        (404, None, "no model", RequestInvalidError, FailureKind.REQUEST_INVALID),
        (413, None, "big", RequestInvalidError, FailureKind.REQUEST_INVALID),
        (429, None, "slow down", RateLimitedError, FailureKind.RATE_LIMITED),
        (500, None, "oops", TransientProviderError, FailureKind.TRANSIENT),
        (529, None, "Overloaded", TransientProviderError, FailureKind.TRANSIENT),
        # An account out of credit: Anthropic's 400, told by its words alone; its 402.
        (
            400,
            "invalid_request_error",
            "Your credit balance is too low to access the Anthropic API.",
            QuotaExhaustedError,
            FailureKind.QUOTA_EXHAUSTED,
        ),
        (402, "billing_error", "pay up", QuotaExhaustedError, FailureKind.QUOTA_EXHAUSTED),
    ],
)
async def test_error_types_map_to_kinds(
    server: FakeAnthropicServer,
    client: AnthropicChatClient,
    streaming: bool,
    status: int,
    type_: str | None,
    message: str,
    error_type: type[ProviderError],
    kind: FailureKind,
) -> None:
    server.script(FakeResponse.error(status, type=type_, message=f"{message} CANARY-prompt"))
    result = await collect(client, "CANARY-prompt", streaming=streaming)
    assert type(result.error) is error_type
    assert isinstance(result.error, ProviderError)
    assert result.error.kind is kind and result.error.status_code == status
    assert result.error.provider == "anthropic"
    assert result.error.url is not None and result.error.url.endswith("/v1/messages")
    assert "CANARY" not in str(result.error) and "CANARY" not in repr(result.error.args)
    assert result.updates == []


async def test_rate_limit_retry_after(
    server: FakeAnthropicServer, client: AnthropicChatClient, streaming: bool
) -> None:
    server.script(FakeResponse.error(429, retry_after="7"))
    result = await collect(client, "hi", streaming=streaming)
    assert isinstance(result.error, RateLimitedError)
    assert result.error.retry_after == 7.0 and result.error.code == "rate_limit_error"


# -- in-band errors and stream boundaries -----------------------------------------------------


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        ({"type": "overloaded_error", "message": "CANARY"}, FailureKind.TRANSIENT),
        ({"type": "api_error", "message": "CANARY"}, FailureKind.TRANSIENT),
        ({"type": "rate_limit_error", "message": "CANARY"}, FailureKind.RATE_LIMITED),
        (
            {"type": "invalid_request_error", "message": "prompt is too long: CANARY"},
            FailureKind.CONTEXT_LENGTH_EXCEEDED,
        ),
        ({"type": "permission_error", "message": "CANARY"}, FailureKind.AUTHENTICATION),
        ({"type": "who_knows", "message": "CANARY"}, FailureKind.UNKNOWN),
    ],
)
async def test_in_band_error_before_output_fails_over(
    error: dict[str, str], kind: FailureKind
) -> None:
    async with FakeAnthropicServer() as primary, FakeAnthropicServer() as backup:
        # After message_start and the first block start: no content yet.
        primary.script(FakeResponse(in_band_error=error, error_after=2))
        first = AnthropicChatClient("c", api_key=KEY, base_url=primary.base_url, name="a")
        direct = await collect(first, "hi", streaming=True)
        assert isinstance(direct.error, ProviderError) and direct.error.kind is kind
        assert direct.updates == []
        assert "CANARY" not in str(direct.error)
        primary.script(FakeResponse(in_band_error=error, error_after=2))
        second = AnthropicChatClient("c", api_key=KEY, base_url=backup.base_url, name="b")
        async with OrderedFailoverChatClient([first, second]) as router:
            result = await collect(router, "hi", streaming=True)
        eligible = kind in (FailureKind.RATE_LIMITED, FailureKind.TRANSIENT, FailureKind.UNKNOWN)
        assert (result.error is None) is eligible
        assert (primary.count(), backup.count()) == (2, 1 if eligible else 0)


async def test_in_band_error_after_output_is_terminal() -> None:
    async with FakeAnthropicServer() as primary, FakeAnthropicServer() as backup:
        error = {"type": "overloaded_error", "message": "Overloaded"}
        # message_start, block start, ping, two deltas: then the error.
        primary.script(FakeResponse(text="a b c", in_band_error=error, error_after=5))
        router = OrderedFailoverChatClient(
            [
                AnthropicChatClient("c", api_key=KEY, base_url=primary.base_url, name="a"),
                AnthropicChatClient("c", api_key=KEY, base_url=backup.base_url, name="b"),
            ]
        )
        result = await collect(router, "hi", streaming=True)
        await router.aclose()
    assert isinstance(result.error, TransientProviderError)
    assert result.error.code == "overloaded_error"
    assert [u.text for u in result.updates] == ["a ", "b "]
    assert backup.count() == 0


async def test_disconnects_before_and_after_output(
    server: FakeAnthropicServer, client: AnthropicChatClient
) -> None:
    server.script(FakeResponse(text="a b c d", disconnect_after=3))  # start, block, ping
    before = await collect(client, "hi", streaming=True)
    assert isinstance(before.error, TransientProviderError) and before.updates == []
    server.script(FakeResponse(text="a b c d", disconnect_after=5))
    after = await collect(client, "hi", streaming=True)
    assert isinstance(after.error, TransientProviderError)
    assert [u.text for u in after.updates] == ["a ", "b "]


@pytest.mark.parametrize(
    "lines",
    [
        ["data: {not json", ""],
        ["garbage line without a field", ""],
        ["event: message_start", "data: [1, 2]", ""],
        [*START, *_text_delta("orphan"), *STOP],  # a delta for no open block
        [*START, *TEXT_BLOCK, *_event("content_block_delta", {
            "type": "content_block_delta", "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": "{"},
        }), *STOP],  # a JSON delta into a text block
        [*START, *_event("content_block_start", {
            "type": "content_block_start", "index": 0,
            "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}},
        }), *_event("content_block_delta", {
            "type": "content_block_delta", "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": "{\"a\": "},
        }), *_event("content_block_stop", {"type": "content_block_stop", "index": 0}), *STOP],
        [*START, *_event("content_block_start", {"type": "content_block_start"}), *STOP],
        [*_event("message_start", {"type": "message_start", "message": "x"}), *STOP],
    ],
)  # fmt: skip
async def test_malformed_streams_raise_provider_error(
    server: FakeAnthropicServer, client: AnthropicChatClient, lines: list[str]
) -> None:
    server.script(FakeResponse(raw_lines=lines))
    result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, ProviderError)
    assert result.error.code == "malformed"


async def test_malformed_non_streaming_bodies() -> None:
    for body in (
        b"not json",
        b"[1]",
        b'{"content": "x"}',
        b'{"content": [1]}',
        b'{"content": [{"type": "text", "text": 3}]}',
        b'{"content": [{"type": "tool_use", "id": "t", "input": {}}]}',
        b'{"content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{"}]}',
    ):
        transport = httpx2.MockTransport(lambda request, b=body: httpx2.Response(200, content=b))
        async with httpx2.AsyncClient(transport=transport) as http:
            raw = AnthropicChatClient(
                "c", api_key=KEY, base_url="http://127.0.0.1:1", http_client=http
            )
            with pytest.raises(ProviderError) as caught:
                await raw.get_response("hi")
            assert caught.value.code == "malformed", body


# -- construction -----------------------------------------------------------------------------


def test_key_and_settings_handling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(ValueError, match="ANTHROPIC_API_KEY"):
        AnthropicChatClient("claude")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-CANARY-env")
    client = AnthropicChatClient("claude", name="primary")
    assert "CANARY" not in repr(client)
    assert client.metadata.provider_name == "anthropic"
    assert (client.metadata.server_address, client.metadata.server_port) == (
        "api.anthropic.com",
        443,
    )
    assert client.metadata.model_id == "claude" and client.metadata.name == "primary"
    with pytest.raises(ValueError, match="max_tokens"):
        AnthropicChatClient("claude", max_tokens=0)
    with pytest.raises(ValueError, match="model"):
        AnthropicChatClient("")
    with pytest.raises(ValueError, match="stream_idle_timeout"):
        AnthropicChatClient("claude", stream_idle_timeout=-1)
    with pytest.raises(TypeError, match=r"httpx2\.AsyncClient"):
        AnthropicChatClient("claude", http_client=object())  # type: ignore[arg-type]


async def test_bad_content_gets_a_clear_error(client: AnthropicChatClient) -> None:
    with pytest.raises(ValueError, match="media_type"):
        await client.get_response(ChatMessage.user(DataContent(data=b"x")))
    with pytest.raises(ValueError, match="audio/wav"):
        await client.get_response(ChatMessage.user(DataContent(data=b"x", media_type="audio/wav")))
    with pytest.raises(ValueError, match="needs a user or assistant turn"):
        await client.get_response([ChatMessage.system("only a system prompt")])


# -- across vendors ---------------------------------------------------------------------------


@pytest.mark.parametrize("status", [429, 503])
async def test_failover_from_an_openai_route_to_an_anthropic_route(
    streaming: bool, status: int
) -> None:
    async with FakeOpenAIServer() as openai_server, FakeAnthropicServer() as anthropic_server:
        openai_server.script(FakeResponse.error(status, retry_after="0"))
        anthropic_server.script(FakeResponse(text="from claude", usage=(2, 2)))
        router = OrderedFailoverChatClient(
            [
                Route(
                    "openai",
                    OpenAIChatClient("gpt", api_key="sk-x", base_url=openai_server.base_url),
                ),
                Route(
                    "anthropic",
                    AnthropicChatClient("claude", api_key=KEY, base_url=anthropic_server.base_url),
                ),
            ]
        )
        result = await collect(router, "hi", streaming=streaming)
        await router.aclose()
    assert result.error is None and result.text == "from claude"
    assert result.response is not None and result.response.model_id == "claude"
    assert (openai_server.count(), anthropic_server.count()) == (1, 1)
