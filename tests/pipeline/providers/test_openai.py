import asyncio
import json

import httpx2
import pytest

from middleware.routing import OrderedFailoverChatClient, Route
from pipeline import (
    ChatMessage,
    ChatOptions,
    ChatPipeline,
    DataContent,
    FunctionCallContent,
    FunctionResultContent,
)
from pipeline.errors import (
    AuthenticationError,
    ContentFilteredError,
    ContextLengthExceededError,
    FailureKind,
    ProviderError,
    QuotaExhaustedError,
    RateLimitedError,
    RequestInvalidError,
    TransientProviderError,
)
from pipeline.providers import AzureOpenAIChatClient, OllamaChatClient, OpenAIChatClient
from pipeline.testing import FakeOpenAIServer, FakeResponse, collect

# Every test runs over both HTTP transports (the `transport` fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("transport")

KEY = "sk-CANARY-key"


async def test_text_and_usage(
    server: FakeOpenAIServer, client: OpenAIChatClient, streaming: bool
) -> None:
    server.script(FakeResponse(text="one two three", usage=(11, 3)))
    result = await collect(client, "hi", streaming=streaming)
    assert result.error is None
    assert result.text == "one two three"
    assert result.response is not None
    assert result.response.usage is not None
    assert (result.response.usage.input_tokens, result.response.usage.output_tokens) == (11, 3)
    assert result.response.finish_reason == "stop"
    assert result.response.model_id == "gpt-test"
    if streaming:
        assert [u.text for u in result.updates if u.text] == ["one ", "two ", "three"]
        assert result.updates[-1].usage is not None  # usage arrives in the last chunk
    assert server.count() == 1


async def test_request_wire_format(
    server: FakeOpenAIServer, client: OpenAIChatClient, streaming: bool
) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    options = ChatOptions(
        model_id="gpt-override",
        temperature=0.2,
        top_p=0.9,
        max_output_tokens=50,
        stop=["X"],
        seed=3,
        tools=[tool],
        tool_mode="auto",
        response_format="json",
        reasoning_effort="low",
        additional_properties={"user": "u1"},
    )
    messages = [
        ChatMessage.system("sys"),
        ChatMessage.user(["look", DataContent(data=b"\x89PNG", media_type="image/png")]),
        ChatMessage.assistant(FunctionCallContent("c1", "f", {"a": 1})),
        ChatMessage.tool(FunctionResultContent("c1", {"ok": True})),
    ]
    await collect(client, messages, options, streaming=streaming)
    body = server.requests[0].json
    assert server.requests[0].headers["authorization"] == f"Bearer {KEY}"
    assert body["model"] == "gpt-override"
    assert (body["temperature"], body["top_p"], body["max_completion_tokens"]) == (0.2, 0.9, 50)
    assert (body["stop"], body["seed"], body["tool_choice"]) == (["X"], 3, "auto")
    assert body["tools"] == [tool]
    assert body["response_format"] == {"type": "json_object"}
    assert (body["reasoning_effort"], body["user"]) == ("low", "u1")
    assert body["messages"][0] == {"role": "system", "content": "sys"}
    assert body["messages"][1]["content"][1]["image_url"]["url"].startswith(
        "data:image/png;base64,"
    )
    assert body["messages"][2]["tool_calls"][0]["function"] == {
        "name": "f",
        "arguments": '{"a": 1}',
    }
    assert body["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'}
    if streaming:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    else:
        assert "stream" not in body


async def test_streamed_tool_call_arguments_are_assembled(
    server: FakeOpenAIServer, client: OpenAIChatClient, streaming: bool
) -> None:
    arguments = json.dumps({"city": "Oslo", "units": "metric", "days": 3})
    server.script(
        FakeResponse(
            text="", tool_calls=[("get_weather", arguments), ("noop", "{}")], tool_call_pieces=5
        )
    )
    result = await collect(client, "weather?", streaming=streaming)
    assert result.response is not None
    calls = [c for c in result.response.messages[-1].contents if isinstance(c, FunctionCallContent)]
    assert [(c.name, dict(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "units": "metric", "days": 3}),
        ("noop", {}),
    ]
    assert all(c.call_id.startswith("call_") for c in calls)  # the server's, each its own
    assert len({c.call_id for c in calls}) == 2
    assert result.response.finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("status", "code", "error_type", "kind"),
    [
        (429, None, RateLimitedError, FailureKind.RATE_LIMITED),
        (500, None, TransientProviderError, FailureKind.TRANSIENT),
        (503, None, TransientProviderError, FailureKind.TRANSIENT),
        (400, None, RequestInvalidError, FailureKind.REQUEST_INVALID),
        (404, None, RequestInvalidError, FailureKind.REQUEST_INVALID),
        (422, None, RequestInvalidError, FailureKind.REQUEST_INVALID),
        (401, None, AuthenticationError, FailureKind.AUTHENTICATION),
        (403, None, AuthenticationError, FailureKind.AUTHENTICATION),
        (
            400,
            "context_length_exceeded",
            ContextLengthExceededError,
            FailureKind.CONTEXT_LENGTH_EXCEEDED,
        ),
        (400, "content_filter", ContentFilteredError, FailureKind.CONTENT_FILTERED),
        # OpenAI's account out of quota (a 429 no wait cures), a vendor's 402.
        (429, "insufficient_quota", QuotaExhaustedError, FailureKind.QUOTA_EXHAUSTED),
        (402, None, QuotaExhaustedError, FailureKind.QUOTA_EXHAUSTED),
    ],
)
async def test_error_statuses_map_to_kinds(
    server: FakeOpenAIServer,
    client: OpenAIChatClient,
    streaming: bool,
    status: int,
    code: str | None,
    error_type: type[ProviderError],
    kind: FailureKind,
) -> None:
    server.script(FakeResponse.error(status, code=code, message="CANARY-prompt echoed back"))
    result = await collect(client, "CANARY-prompt", streaming=streaming)
    assert type(result.error) is error_type
    assert isinstance(result.error, ProviderError)
    assert result.error.kind is kind and result.error.status_code == status
    assert result.error.url is not None and result.error.url.endswith("/v1/chat/completions")
    assert "CANARY" not in str(result.error) and "CANARY" not in repr(result.error.args)
    assert result.updates == []


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("3", 3.0), ("0.5", 0.5), ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0), ("soon", None)],
)
async def test_retry_after_is_parsed(
    server: FakeOpenAIServer,
    client: OpenAIChatClient,
    streaming: bool,
    header: str,
    seconds: float | None,
) -> None:
    server.script(FakeResponse.error(429, retry_after=header))
    result = await collect(client, "hi", streaming=streaming)
    assert isinstance(result.error, RateLimitedError)
    assert result.error.retry_after == seconds


async def test_disconnect_before_first_chunk_is_transient(
    server: FakeOpenAIServer, client: OpenAIChatClient
) -> None:
    server.script(FakeResponse(disconnect_after=1))  # only the role event, then the cut
    result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, TransientProviderError)
    assert [u for u in result.updates if u.text] == []


async def test_mid_stream_disconnect_after_output(
    server: FakeOpenAIServer, client: OpenAIChatClient
) -> None:
    server.script(FakeResponse(text="a b c d", disconnect_after=3))
    result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, TransientProviderError)
    assert [u.text for u in result.updates] == ["a ", "b "]


async def test_failover_on_mid_stream_disconnect_is_terminal_but_before_output_is_not() -> None:
    async with FakeOpenAIServer() as primary, FakeOpenAIServer() as backup:
        routes = [
            Route("primary", OpenAIChatClient("m", api_key=KEY, base_url=primary.base_url)),
            Route("backup", OpenAIChatClient("m", api_key=KEY, base_url=backup.base_url)),
        ]
        async with OrderedFailoverChatClient(routes) as router:
            primary.script(FakeResponse(disconnect_after=1))
            assert (
                await collect(router, "hi", streaming=True)
            ).text == "Hello from the fake server."
            primary.script(FakeResponse(text="x y z", disconnect_after=3))
            after = await collect(router, "hi", streaming=True)
            assert isinstance(after.error, TransientProviderError)
            assert (primary.count(), backup.count()) == (2, 1)


@pytest.mark.parametrize(
    "lines",
    [
        ["data: {not json", ""],
        ["garbage line without a field", ""],
        ["data: [1, 2]", ""],
        ['data: {"choices": "nope"}', ""],
        ['data: {"choices": [{"delta": {"content": 5}}]}', ""],
        [
            'data: {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": '
            '{"arguments": "{"}}]}, "finish_reason": "tool_calls"}]}',
            "",
        ],
    ],
)
async def test_malformed_streams_raise_provider_error(
    server: FakeOpenAIServer, client: OpenAIChatClient, lines: list[str]
) -> None:
    server.script(FakeResponse(raw_lines=lines))
    result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, ProviderError)
    assert result.error.code == "malformed"


async def test_malformed_non_streaming_bodies(
    server: FakeOpenAIServer, client: OpenAIChatClient
) -> None:
    transport = httpx2.MockTransport(lambda request: httpx2.Response(200, content=b"not json"))
    async with httpx2.AsyncClient(transport=transport) as http:
        raw = OpenAIChatClient("m", api_key=KEY, base_url="http://127.0.0.1:1/v1", http_client=http)
        with pytest.raises(ProviderError, match="not JSON"):
            await raw.get_response("hi")
    for body in (
        {"choices": []},
        {"choices": [{"message": "x"}]},
        [1],
        {"choices": [{"message": {"content": 3}}]},
    ):
        transport = httpx2.MockTransport(lambda request, b=body: httpx2.Response(200, json=b))
        async with httpx2.AsyncClient(transport=transport) as http:
            raw = OpenAIChatClient(
                "m", api_key=KEY, base_url="http://127.0.0.1:1/v1", http_client=http
            )
            with pytest.raises(ProviderError) as caught:
                await raw.get_response("hi")
            assert caught.value.code == "malformed"


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        ({"code": "rate_limit_exceeded", "message": "CANARY"}, FailureKind.RATE_LIMITED),
        ({"type": "server_error", "message": "CANARY"}, FailureKind.TRANSIENT),
        ({"code": "content_filter"}, FailureKind.CONTENT_FILTERED),
        ({"message": "CANARY"}, FailureKind.UNKNOWN),
    ],
)
async def test_in_band_error_before_content_fails_over(
    error: dict[str, str], kind: FailureKind
) -> None:
    async with FakeOpenAIServer() as primary, FakeOpenAIServer() as backup:
        primary.script(FakeResponse(in_band_error=error, error_after=1))
        first = OpenAIChatClient("m", api_key=KEY, base_url=primary.base_url)
        direct = await collect(first, "hi", streaming=True)
        assert isinstance(direct.error, ProviderError) and direct.error.kind is kind
        assert "CANARY" not in str(direct.error)
        primary.script(FakeResponse(in_band_error=error, error_after=1))
        router = OrderedFailoverChatClient(
            [first, OpenAIChatClient("m", api_key=KEY, base_url=backup.base_url, name="backup")]
        )
        result = await collect(router, "hi", streaming=True)
        eligible = kind in (FailureKind.RATE_LIMITED, FailureKind.TRANSIENT, FailureKind.UNKNOWN)
        assert (result.error is None) is eligible
        assert backup.count() == (1 if eligible else 0)
        await router.aclose()


async def test_in_band_error_after_content_is_terminal(
    server: FakeOpenAIServer, client: OpenAIChatClient
) -> None:
    server.script(FakeResponse(text="a b c", in_band_error={"type": "server_error"}, error_after=3))
    result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, TransientProviderError)
    assert [u.text for u in result.updates] == ["a ", "b "]


def test_key_handling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ValueError, match="OPENAI_API_KEY"):
        OpenAIChatClient("gpt")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-CANARY-env")
    client = OpenAIChatClient("gpt")
    assert "CANARY" not in repr(client)
    assert client.metadata.server_address == "api.openai.com" and client.metadata.server_port == 443
    assert client.metadata.provider_name == "openai"
    with pytest.raises(ValueError, match="first_chunk_timeout"):
        OpenAIChatClient("gpt", first_chunk_timeout=0)


async def test_model_is_required(server: FakeOpenAIServer) -> None:
    client = OpenAIChatClient(base_url=server.base_url, api_key=KEY)
    with pytest.raises(ValueError, match="no model"):
        await client.get_response("hi")
    assert (await client.get_response("hi", ChatOptions(model_id="m"))).model_id == "m"
    await client.aclose()


async def test_ollama_uses_the_openai_wire_without_a_key(
    server: FakeOpenAIServer, streaming: bool
) -> None:
    client = OllamaChatClient("llama3", base_url=server.base_url)
    await collect(client, "hi", ChatOptions(max_output_tokens=9), streaming=streaming)
    request = server.requests[0]
    assert "authorization" not in request.headers
    assert request.json["max_tokens"] == 9
    assert client.metadata.provider_name == "ollama"
    await client.aclose()


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens"])
async def test_max_tokens_field_is_per_client(
    server: FakeOpenAIServer, streaming: bool, field: str
) -> None:
    client = OpenAIChatClient("m", api_key=KEY, base_url=server.base_url, max_tokens_field=field)
    await collect(client, "hi", ChatOptions(max_output_tokens=4), streaming=streaming)
    body = server.requests[0].json
    assert body[field] == 4
    assert ({"max_completion_tokens", "max_tokens"} - {field}).isdisjoint(body)
    await client.aclose()


def test_max_tokens_field_is_validated_and_subclasses_keep_their_defaults() -> None:
    with pytest.raises(ValueError, match="max_tokens_field must be one of"):
        OpenAIChatClient("m", api_key=KEY, max_tokens_field="max_output_tokens")
    assert OpenAIChatClient("m", api_key=KEY).max_tokens_field == "max_completion_tokens"
    assert OllamaChatClient("m").max_tokens_field == "max_tokens"
    assert (
        OllamaChatClient("m", max_tokens_field="max_completion_tokens").max_tokens_field
        == "max_completion_tokens"
    )
    azure = AzureOpenAIChatClient(endpoint="https://x.example", deployment="d", api_key="k")
    assert azure.max_tokens_field == "max_tokens"
    azure = AzureOpenAIChatClient(
        endpoint="https://x.example",
        deployment="d",
        api_key="k",
        max_tokens_field="max_completion_tokens",
    )
    assert azure.max_tokens_field == "max_completion_tokens"


def _chunk(delta: dict[str, object], finish: str | None = None) -> str:
    return "data: " + json.dumps(
        {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    )


async def test_a_tool_name_repeated_in_every_delta_is_not_concatenated(
    server: FakeOpenAIServer, client: OpenAIChatClient
) -> None:
    # llama-cpp-python sends the whole name with every argument delta.
    def call(arguments: str, call_id: str | None = None) -> dict[str, object]:
        delta: dict[str, object] = {
            "index": 0,
            "function": {"name": "get_weather", "arguments": arguments},
        }
        if call_id:
            delta["id"] = call_id
        return {"tool_calls": [delta]}

    lines = [
        _chunk(call('{"city": ', "call_7")),
        "",
        _chunk(call('"Oslo"}')),
        "",
        _chunk({}, "tool_calls"),
        "",
        "data: [DONE]",
        "",
    ]
    server.script(FakeResponse(raw_lines=lines))
    result = await collect(client, "weather?", streaming=True)
    assert result.error is None and result.response is not None
    [content] = result.response.messages[-1].contents
    assert content == FunctionCallContent("call_7", "get_weather", {"city": "Oslo"})


async def test_a_tool_name_streamed_in_pieces_is_joined(
    server: FakeOpenAIServer, client: OpenAIChatClient
) -> None:
    pieces = [{"tool_calls": [{"index": 0, "id": "c", "function": {"name": "get_"}}]}]
    pieces.append({"tool_calls": [{"index": 0, "function": {"name": "weather"}}]})
    lines = [line for p in pieces for line in (_chunk(p), "")]
    lines += [_chunk({}, "tool_calls"), "", "data: [DONE]", ""]
    server.script(FakeResponse(raw_lines=lines))
    result = await collect(client, "weather?", streaming=True)
    assert result.response is not None
    assert result.response.messages[-1].contents == [FunctionCallContent("c", "get_weather", {})]


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        ({"code": "500", "message": "CANARY", "type": None}, FailureKind.TRANSIENT),
        ({"code": 503, "message": "CANARY"}, FailureKind.TRANSIENT),
        ({"code": "429", "message": "CANARY"}, FailureKind.RATE_LIMITED),
        ({"code": "400", "message": "CANARY"}, FailureKind.REQUEST_INVALID),
        ({"code": "401", "message": "CANARY"}, FailureKind.AUTHENTICATION),
        (
            {"code": "400", "type": "context_length_exceeded", "message": "CANARY"},
            FailureKind.CONTEXT_LENGTH_EXCEEDED,
        ),
        (
            {"message": "This model's maximum context length is 8 tokens. CANARY"},
            FailureKind.CONTEXT_LENGTH_EXCEEDED,
        ),
    ],
)
async def test_in_band_numeric_codes_map_through_the_status_table(
    server: FakeOpenAIServer, client: OpenAIChatClient, error: dict[str, object], kind: FailureKind
) -> None:
    server.script(FakeResponse(in_band_error=error, error_after=1))
    result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, ProviderError)
    assert result.error.kind is kind
    assert "CANARY" not in str(result.error)
    assert result.updates == []


async def test_an_unsafe_provider_code_is_dropped(
    server: FakeOpenAIServer, client: OpenAIChatClient, streaming: bool
) -> None:
    server.script(FakeResponse.error(400, code="your prompt CANARY was rejected"))
    result = await collect(client, "hi", streaming=streaming)
    assert isinstance(result.error, RequestInvalidError)
    assert result.error.code is None or "CANARY" not in result.error.code
    assert "CANARY" not in str(result.error)


async def test_named_tool_mode_selects_one_function(
    server: FakeOpenAIServer, client: OpenAIChatClient
) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    await client.get_response("hi", ChatOptions(tools=[tool], tool_mode="f"))
    assert server.requests[0].json["tool_choice"] == {"type": "function", "function": {"name": "f"}}


async def test_credentials_in_the_url_never_leave_it(
    server: FakeOpenAIServer, streaming: bool, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    base = server.base_url.replace("http://", "http://user:CANARY@")
    client = OpenAIChatClient("m", base_url=base)
    server.script(FakeResponse(status=503))
    with caplog.at_level(logging.DEBUG):
        result = await collect(client, "hi", streaming=streaming)
    assert isinstance(result.error, TransientProviderError)
    assert result.error.url is not None and "CANARY" not in result.error.url
    assert "CANARY" not in repr(client) and "CANARY" not in str(result.error)
    assert "CANARY" not in caplog.text  # the HTTP client's own request log lines too
    # The credentials still authorize, as a Basic header.
    assert server.requests[-1].headers["authorization"].startswith("Basic ")
    await client.aclose()


@pytest.mark.parametrize("url", ["http://[::1", "ftp://example.com/v1", "not a url"])
def test_a_malformed_base_url_is_a_value_error(url: str) -> None:
    with pytest.raises(ValueError, match="base_url"):
        OpenAIChatClient("m", base_url=url, api_key="k")


@pytest.mark.parametrize(
    "options",
    [
        ChatOptions(additional_properties={"x": object()}),
        ChatOptions(tools=[object()]),
        ChatOptions(temperature=float("nan")),
        ChatOptions(additional_properties={"x": "\ud800"}),
    ],
    ids=["not-json", "bad-tool", "nan", "lone-surrogate"],
)
async def test_a_request_that_cannot_be_sent_is_the_callers_error(
    server: FakeOpenAIServer, streaming: bool, options: ChatOptions
) -> None:
    from pipeline.errors import FailureKind, UnsendableRequestError, classify

    backup = OpenAIChatClient("m", base_url=server.base_url, name="backup")
    primary = (
        ChatPipeline.builder()
        .use_circuit_breaker(fail_max=1)
        .use_retry()
        .build(OpenAIChatClient("m", base_url=server.base_url), name="primary")
    )
    router = OrderedFailoverChatClient([Route("primary", primary), Route("backup", backup)])
    for _ in range(3):
        result = await collect(router, "hi", options, streaming=streaming)
        assert isinstance(result.error, UnsendableRequestError)
        assert classify(result.error) is FailureKind.REQUEST_INVALID
        assert isinstance(result.error, ValueError)
    # Nothing was sent, nothing failed over, and the breaker counted nothing.
    assert server.requests == []
    assert primary.client.state == "closed"  # type: ignore[attr-defined]
    assert (await collect(router, "hi", streaming=streaming)).error is None
    await router.aclose()


@pytest.mark.parametrize(
    ("tail", "code"),
    [
        (b'event: error\ndata: {"error": {"code": "500", "message": "cut"}}\n\n', None),
        (b"data: {not json\n\n", "malformed"),
        (b"bogus line\n\n", "malformed"),
    ],
    ids=["in-band-error", "bad-json", "not-sse"],
)
async def test_a_failure_in_the_same_network_chunk_keeps_the_words_before_it(
    tail: bytes, code: str | None
) -> None:
    """A proxy that reads the words and the failure together sends them in one chunk: the
    words still reach the caller, once, before the failure."""
    body = b"".join(f"{_chunk({'content': word})}\n\n".encode() for word in ("a ", "b ")) + tail

    async def one_chunk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        )  # fmt: skip
        await reader.readexactly(length)
        writer.write(  # the head and the whole body in one write
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(one_chunk, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with OpenAIChatClient("m", api_key="k", base_url=f"http://127.0.0.1:{port}") as chat:
        result = await collect(chat, "hi", streaming=True)
    server.close()
    await server.wait_closed()
    assert [u.text for u in result.updates] == ["a ", "b "]
    assert isinstance(result.error, ProviderError)
    if code is not None:
        assert result.error.code == code
    else:
        assert isinstance(result.error, TransientProviderError)
