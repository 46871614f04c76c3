"""GeminiChatClient over real HTTP, against FakeGeminiServer: the wire both ways, every error
kind, both call shapes, the failover boundary, thought signatures through a tool loop, and
failover between a Gemini route and an OpenAI one."""

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest
from opentelemetry.sdk.trace import TracerProvider

from middleware.function_invocation import Tool
from middleware.routing import OrderedFailoverChatClient, Route
from pipeline import (
    ChatMessage,
    ChatOptions,
    ChatPipeline,
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
    ContentFilteredError,
    ContextLengthExceededError,
    FailureKind,
    ProviderError,
    RateLimitedError,
    RequestInvalidError,
    TransientProviderError,
)
from pipeline.providers import GeminiChatClient, OpenAIChatClient
from pipeline.testing import FakeGeminiServer, FakeOpenAIServer, FakeResponse, collect
from pipeline.types import GEMINI_EXTRAS

# Every test runs over both HTTP transports (the `transport` fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("transport")

KEY = "gm-CANARY-key"
WEATHER = json.dumps({"city": "Oslo", "units": "metric"})
THINKING = ChatOptions(reasoning=ReasoningOptions(budget_tokens=1024, summary="auto"))


@pytest.fixture
async def server() -> AsyncIterator[FakeGeminiServer]:
    async with FakeGeminiServer(api_keys={KEY}) as fake:
        yield fake


@pytest.fixture
async def client(server: FakeGeminiServer) -> AsyncIterator[GeminiChatClient]:
    chat = GeminiChatClient("gemini-test", api_key=KEY, base_url=server.base_url)
    yield chat
    await chat.aclose()


def chunk(parts: list[dict[str, Any]], **candidate: Any) -> str:
    body = {"candidates": [{"content": {"role": "model", "parts": parts}, **candidate}]}
    return f"data: {json.dumps(body)}"


# -- successes --------------------------------------------------------------------------------


async def test_text_usage_cache_and_thought_tokens(
    server: FakeGeminiServer, client: GeminiChatClient, streaming: bool
) -> None:
    server.script(
        FakeResponse(text="one two three", usage=(11, 9), cache_usage=(0, 4), reasoning_tokens=3)
    )
    result = await collect(client, "hi", streaming=streaming)
    assert result.error is None and result.response is not None
    assert result.text == "one two three"
    # Output tokens are the answer's and the thoughts'; cached tokens are part of the input.
    expected = UsageDetails(11, 9, 20, reasoning_tokens=3, cache_read_tokens=4)
    assert result.response.usage == expected
    assert result.response.finish_reason == "stop"
    assert result.response.model_id == "gemini-test"
    assert result.response.response_id == "fake-gemini-1"
    if streaming:
        assert [u.text for u in result.updates if u.text] == ["one ", "two ", "three"]
        # Every chunk repeats the usage so far: it is reported once, at the end.
        assert [u.usage for u in result.updates if u.usage] == [expected]
        assert result.updates[-1].finish_reason == "stop"
    request = server.requests[0]
    assert request.headers["x-goog-api-key"] == KEY and KEY not in request.query
    method = "streamGenerateContent" if streaming else "generateContent"
    assert request.path == f"/v1beta/models/gemini-test:{method}"
    assert request.query == ("alt=sse" if streaming else "")


async def test_request_wire_format(
    server: FakeGeminiServer, client: GeminiChatClient, streaming: bool
) -> None:
    def get_weather(city: str, units: str = "metric") -> str:
        """The weather in a city."""
        return city

    tool = Tool.from_function(get_weather)
    openai_tool = {
        "type": "function",
        "function": {"name": "f", "description": "F.", "parameters": {"type": "object"}},
    }
    messages_tool = {"name": "g", "input_schema": {"type": "object", "properties": {}}}
    search = {"googleSearch": {}}
    options = ChatOptions(
        temperature=0.2,
        top_p=0.9,
        max_output_tokens=50,
        stop=["X"],
        seed=3,
        tools=[tool, openai_tool, messages_tool, search],
        tool_mode="required",
        additional_properties={
            "top_k": 5,
            "parallel_tool_calls": False,  # OpenAI's: no such field here
            GEMINI_EXTRAS: {"safetySettings": [], "generationConfig": {"candidateCount": 1}},
        },
    )
    messages = [
        ChatMessage.system("be brief"),
        ChatMessage.user(
            [
                "look",
                DataContent(data=b"\x89PNG", media_type="image/png"),
                DataContent(uri="https://example.com/cat.jpg", media_type="image/jpeg"),
                DataContent(uri="data:image/gif;base64,R0lG"),
            ]
        ),
        ChatMessage.assistant(["calling", FunctionCallContent("c1", "get_weather", {"a": 1})]),
        ChatMessage.tool(FunctionResultContent("c1", {"ok": True})),
        ChatMessage.assistant([FunctionCallContent("c2", "f", {})]),
        ChatMessage.tool(FunctionResultContent("c2", exception=RuntimeError("CANARY"))),
        ChatMessage.system("and polite"),
        ChatMessage.user("thanks"),
    ]
    result = await collect(client, messages, options, streaming=streaming)
    assert result.error is None, result.error
    body = server.requests[0].json
    assert body["systemInstruction"] == {"parts": [{"text": "be brief"}, {"text": "and polite"}]}
    assert body["generationConfig"] == {
        "maxOutputTokens": 50,
        "temperature": 0.2,
        "topP": 0.9,
        "stopSequences": ["X"],
        "seed": 3,
        "topK": 5,
        "candidateCount": 1,
    }
    assert "parallel_tool_calls" not in body and body["safetySettings"] == []
    assert body["tools"] == [
        {
            "functionDeclarations": [
                {
                    "name": "get_weather",
                    "description": "The weather in a city.",
                    "parametersJsonSchema": tool.parameters,
                },
                {"name": "f", "description": "F.", "parametersJsonSchema": {"type": "object"}},
                {"name": "g", "parametersJsonSchema": {"type": "object", "properties": {}}},
            ]
        },
        search,
    ]
    assert body["toolConfig"] == {"functionCallingConfig": {"mode": "ANY"}}
    user, call, answer, second_call, second_answer = body["contents"]
    assert user == {
        "role": "user",
        "parts": [
            {"text": "look"},
            {"inlineData": {"mimeType": "image/png", "data": "iVBORw=="}},
            {"fileData": {"fileUri": "https://example.com/cat.jpg", "mimeType": "image/jpeg"}},
            {"inlineData": {"mimeType": "image/gif", "data": "R0lG"}},
        ],
    }
    assert call == {
        "role": "model",
        "parts": [
            {"text": "calling"},
            {"functionCall": {"id": "c1", "name": "get_weather", "args": {"a": 1}}},
        ],
    }
    # A tool result goes back with its call's function name, which the API matches it by.
    assert answer == {
        "role": "user",
        "parts": [
            {
                "functionResponse": {
                    "id": "c1",
                    "name": "get_weather",
                    "response": {"output": {"ok": True}},
                }
            }
        ],
    }
    assert second_call["parts"] == [{"functionCall": {"id": "c2", "name": "f", "args": {}}}]
    # An error names only its type; the user's next text joins the tool results' turn.
    assert second_answer["parts"] == [
        {
            "functionResponse": {
                "id": "c2",
                "name": "f",
                "response": {"error": "Error: RuntimeError"},
            }
        },
        {"text": "thanks"},
    ]


@pytest.mark.parametrize(
    ("mode", "config"),
    [
        ("auto", {"mode": "AUTO"}),
        ("none", {"mode": "NONE"}),
        ("required", {"mode": "ANY"}),
        ("get_weather", {"mode": "ANY", "allowedFunctionNames": ["get_weather"]}),
    ],
)
async def test_tool_mode_maps_to_the_function_calling_config(
    server: FakeGeminiServer, client: GeminiChatClient, mode: str, config: object
) -> None:
    tool = {"name": "get_weather", "parameters": {"type": "object"}}
    await client.get_response("hi", ChatOptions(tools=[tool], tool_mode=mode))
    body = server.requests[0].json
    assert body["toolConfig"] == {"functionCallingConfig": config}
    assert body["tools"] == [{"functionDeclarations": [tool]}]  # this API's own shape


async def test_tool_calls_are_assembled_with_unique_ids(
    server: FakeGeminiServer, client: GeminiChatClient, streaming: bool
) -> None:
    server.script(
        FakeResponse(text="Let me check.", tool_calls=[("get_weather", WEATHER), ("noop", "{}")])
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
    # The API gives no ids: each call gets its own.
    assert len({c.call_id for c in calls}) == 2 and all(c.call_id for c in calls)
    assert result.response.finish_reason == "tool_calls"
    if streaming:  # each call arrives whole, in its chunk
        assert [len(u.contents) for u in result.updates if u.contents and not u.text] == [1, 1]


async def test_a_custom_tool_call_comes_back_custom(
    server: FakeGeminiServer, client: GeminiChatClient, streaming: bool
) -> None:
    server.script(FakeResponse(text="", custom_tool_calls=[("apply_patch", "*** patch")]))
    options = ChatOptions(tools=[CustomTool("apply_patch", "Patch files.")])
    result = await collect(client, "fix it", options, streaming=streaming)
    assert result.response is not None
    [call] = result.response.messages[0].contents
    assert isinstance(call, FunctionCallContent) and call.custom
    assert call.input_text == "*** patch"
    declared = server.requests[0].json["tools"][0]["functionDeclarations"][0]
    assert declared["parametersJsonSchema"]["required"] == ["input"]


@pytest.mark.parametrize(
    ("stop_reason", "finish_reason"),
    [
        ("STOP", "stop"),
        ("MAX_TOKENS", "length"),
        ("SAFETY", "content_filter"),
        ("RECITATION", "content_filter"),
        ("PROHIBITED_CONTENT", "content_filter"),
        ("MALFORMED_FUNCTION_CALL", "MALFORMED_FUNCTION_CALL"),
    ],
)
async def test_finish_reasons_map(
    server: FakeGeminiServer,
    client: GeminiChatClient,
    streaming: bool,
    stop_reason: str,
    finish_reason: str,
) -> None:
    server.script(FakeResponse(text="a b", stop_reason=stop_reason))
    result = await collect(client, "hi", streaming=streaming)
    assert result.error is None and result.response is not None
    assert result.response.finish_reason == finish_reason


async def test_json_schema_output(
    server: FakeGeminiServer, client: GeminiChatClient, streaming: bool
) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    server.script(FakeResponse(text='{"city": "Oslo"}'))
    response_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    options = ChatOptions(response_format=response_format)
    result = await collect(client, "where?", options, streaming=streaming)
    assert result.error is None and json.loads(result.text) == {"city": "Oslo"}
    config = server.requests[0].json["generationConfig"]
    assert config == {"responseMimeType": "application/json", "responseJsonSchema": schema}
    await client.get_response("hi", ChatOptions(response_format="json_object"))
    assert server.requests[1].json["generationConfig"] == {"responseMimeType": "application/json"}
    with pytest.raises(RequestInvalidError, match="response_format"):
        await client.get_response("hi", ChatOptions(response_format={"type": "grammar"}))
    assert server.count() == 2  # nothing sent


# -- reasoning --------------------------------------------------------------------------------


async def test_a_tool_loop_with_thinking_round_trips_its_signature(
    server: FakeGeminiServer, client: GeminiChatClient, streaming: bool
) -> None:
    server.script(
        FakeResponse(text="", thinking="Need the tool.", tool_calls=[("f", '{"x": 1}')]),
        FakeResponse(text="Done.", thinking="Got it."),
        FakeResponse(text="Fine."),
    )
    first = await collect(client, "go", THINKING, streaming=streaming)
    assert first.error is None and first.response is not None
    summary, call = first.response.messages[0].contents
    # The thought summary, then the call's signature: one reasoning, as a stream assembles it.
    assert isinstance(summary, ReasoningContent) and summary.text == "Need the tool."
    assert summary.protected in server.issued_signatures
    assert isinstance(call, FunctionCallContent) and call.name == "f"
    turn = [
        ChatMessage.user("go"),
        *first.response.messages,
        ChatMessage.tool(FunctionResultContent(call.call_id, "1")),
    ]
    second = await collect(client, turn, THINKING, streaming=streaming)
    assert second.error is None and second.text == "Done."
    assert server.returned_signatures == 1 and server.placeholder_signatures == 0
    sent = server.requests[1].json["contents"][1]["parts"]
    assert sent == [
        {"text": "Need the tool.", "thought": True},
        {
            "functionCall": {"id": call.call_id, "name": "f", "args": {"x": 1}},
            "thoughtSignature": summary.protected,
        },
    ]
    # The answer's own signature (on its text, or on an empty last part when streamed) is
    # not kept: the API checks only function calls'; the next turn is accepted without it.
    assert second.response is not None
    answer = second.response.messages[0]
    assert [c.text for c in answer.contents if isinstance(c, ReasoningContent)] == ["Got it."]
    assert not any(c.protected for c in answer.contents if isinstance(c, ReasoningContent))
    third = await collect(client, [*turn, answer, ChatMessage.user("ok?")], THINKING,
                          streaming=streaming)  # fmt: skip
    assert third.error is None and server.returned_signatures == 2


async def test_calls_without_a_signature_get_googles_placeholder(
    server: FakeGeminiServer, client: GeminiChatClient, streaming: bool
) -> None:
    """A tool loop begun on another route (another API) has no signature: the current turn's
    calls get the documented placeholder, so a thinking model accepts the turn."""
    calls = [FunctionCallContent("call_1", "f", {}), FunctionCallContent("call_2", "f", {})]
    history = [
        ChatMessage.user("go"),
        ChatMessage.assistant(calls),
        ChatMessage.tool(FunctionResultContent("call_1", "1")),
        ChatMessage.tool(FunctionResultContent("call_2", "2")),
    ]
    result = await collect(client, history, THINKING, streaming=streaming)
    assert result.error is None, result.error
    parts = server.requests[0].json["contents"][1]["parts"]
    assert [part.get("thoughtSignature") for part in parts] == [
        "skip_thought_signature_validator",
        None,
    ]
    assert server.placeholder_signatures == 1


@pytest.mark.parametrize(
    ("reasoning", "config"),
    [
        (ReasoningOptions(budget_tokens=2048), {"thinkingBudget": 2048}),
        (ReasoningOptions(budget_tokens=0), {"thinkingBudget": 0}),
        (ReasoningOptions(effort="none"), {"thinkingBudget": 0}),
        (ReasoningOptions(effort="low"), {"thinkingLevel": "LOW"}),
        (ReasoningOptions(effort="minimal"), {"thinkingLevel": "MINIMAL"}),
        (ReasoningOptions(effort="xhigh"), {"thinkingLevel": "HIGH"}),
        (ReasoningOptions(effort="high", budget_tokens=512), {"thinkingBudget": 512}),
        (ReasoningOptions(effort="medium", summary="auto"),
         {"thinkingLevel": "MEDIUM", "includeThoughts": True}),
        (ReasoningOptions(summary="detailed"), {"includeThoughts": True}),
        (ReasoningOptions(budget_tokens=0, summary="auto"), {"thinkingBudget": 0}),
    ],
)  # fmt: skip
async def test_reasoning_options_become_the_thinking_config(
    server: FakeGeminiServer, client: GeminiChatClient, reasoning: ReasoningOptions, config: Any
) -> None:
    result = await collect(client, "hi", ChatOptions(reasoning=reasoning), streaming=False)
    assert result.error is None  # the fake checks the config as the API does
    assert server.requests[0].json["generationConfig"]["thinkingConfig"] == config


# -- safety -----------------------------------------------------------------------------------


async def test_safety_blocks_are_content_filter_results_never_failed_over(
    streaming: bool,
) -> None:
    async with FakeGeminiServer() as primary, FakeGeminiServer() as backup:
        primary.script(
            FakeResponse(text="", stop_reason="SAFETY"), FakeGeminiServer.blocked_prompt()
        )
        router = OrderedFailoverChatClient(
            [
                Route("a", GeminiChatClient("g", api_key=KEY, base_url=primary.base_url)),
                Route("b", GeminiChatClient("g", api_key=KEY, base_url=backup.base_url)),
            ]
        )
        stopped = await collect(router, "CANARY", streaming=streaming)
        assert stopped.error is None and stopped.response is not None
        assert stopped.response.finish_reason == "content_filter" and stopped.text == ""
        blocked = await collect(router, "CANARY", streaming=streaming)
        await router.aclose()
    assert isinstance(blocked.error, ContentFilteredError)
    assert blocked.error.kind is FailureKind.CONTENT_FILTERED
    assert blocked.error.code == "SAFETY" and blocked.updates == []
    assert "CANARY" not in str(blocked.error)
    assert (primary.count(), backup.count()) == (2, 0)


# -- HTTP errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "message", "error_type", "kind"),
    [
        (400, "bad", RequestInvalidError, FailureKind.REQUEST_INVALID),
        (
            400,
            "The input token count (2000001) exceeds the maximum number of tokens allowed",
            ContextLengthExceededError,
            FailureKind.CONTEXT_LENGTH_EXCEEDED,
        ),
        (401, "bad token", AuthenticationError, FailureKind.AUTHENTICATION),
        (403, "no", AuthenticationError, FailureKind.AUTHENTICATION),
        (404, "no model", RequestInvalidError, FailureKind.REQUEST_INVALID),
        (429, "quota", RateLimitedError, FailureKind.RATE_LIMITED),
        (500, "oops", TransientProviderError, FailureKind.TRANSIENT),
        (503, "overloaded", TransientProviderError, FailureKind.TRANSIENT),
        (504, "deadline", TransientProviderError, FailureKind.TRANSIENT),
    ],
)
async def test_error_statuses_map_to_kinds(
    server: FakeGeminiServer,
    client: GeminiChatClient,
    streaming: bool,
    status: int,
    message: str,
    error_type: type[ProviderError],
    kind: FailureKind,
) -> None:
    server.script(FakeResponse.error(status, message=f"{message} CANARY-prompt"))
    result = await collect(client, "CANARY-prompt", streaming=streaming)
    assert type(result.error) is error_type
    assert isinstance(result.error, ProviderError)
    assert result.error.kind is kind and result.error.status_code == status
    assert result.error.provider == "gcp.gemini"
    assert result.error.url is not None and "gemini-test:" in result.error.url
    assert "alt=sse" not in result.error.url
    assert "CANARY" not in str(result.error) and "CANARY" not in repr(result.error.args)
    assert result.updates == []


async def test_retry_after_comes_from_retry_info_or_the_header(
    server: FakeGeminiServer, client: GeminiChatClient, streaming: bool
) -> None:
    server.script(FakeResponse.error(429, retry_after="7"))
    result = await collect(client, "hi", streaming=streaming)
    assert isinstance(result.error, RateLimitedError)
    assert result.error.retry_after == 7.0 and result.error.code == "RESOURCE_EXHAUSTED"
    body = {
        "error": {
            "code": 429,
            "status": "RESOURCE_EXHAUSTED",
            "message": "CANARY",
            "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "9s"}],
        }
    }
    server.script(FakeResponse(status=429, body=body, headers={"Retry-After": "3"}))
    result = await collect(client, "hi", streaming=streaming)
    assert isinstance(result.error, RateLimitedError) and result.error.retry_after == 3.0


async def test_an_invalid_api_key_is_an_authentication_error(
    server: FakeGeminiServer, streaming: bool
) -> None:
    wrong = GeminiChatClient("gemini-test", api_key="gm-CANARY-wrong", base_url=server.base_url)
    result = await collect(wrong, "hi", streaming=streaming)
    assert isinstance(result.error, AuthenticationError)
    assert result.error.status_code == 400 and result.error.code == "INVALID_ARGUMENT"
    assert "CANARY" not in str(result.error)
    await wrong.aclose()


# -- in-band errors and stream boundaries -----------------------------------------------------


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        ({"code": 503, "status": "UNAVAILABLE", "message": "CANARY"}, FailureKind.TRANSIENT),
        ({"code": 500, "status": "INTERNAL", "message": "CANARY"}, FailureKind.TRANSIENT),
        ({"code": 429, "status": "RESOURCE_EXHAUSTED", "message": "CANARY"},
         FailureKind.RATE_LIMITED),
        ({"code": 400, "status": "INVALID_ARGUMENT", "message": "CANARY"},
         FailureKind.REQUEST_INVALID),
    ],
)  # fmt: skip
async def test_an_in_band_error_before_output_fails_over(
    error: dict[str, Any], kind: FailureKind
) -> None:
    async with FakeGeminiServer() as primary, FakeGeminiServer() as backup:
        primary.script(FakeResponse(in_band_error=error, error_after=0))
        first = GeminiChatClient("g", api_key=KEY, base_url=primary.base_url, name="a")
        direct = await collect(first, "hi", streaming=True)
        assert isinstance(direct.error, ProviderError) and direct.error.kind is kind
        assert direct.updates == [] and "CANARY" not in str(direct.error)
        primary.script(FakeResponse(in_band_error=error, error_after=0))
        second = GeminiChatClient("g", api_key=KEY, base_url=backup.base_url, name="b")
        async with OrderedFailoverChatClient([first, second]) as router:
            result = await collect(router, "hi", streaming=True)
        eligible = kind in (FailureKind.RATE_LIMITED, FailureKind.TRANSIENT)
        assert (result.error is None) is eligible
        assert (primary.count(), backup.count()) == (2, 1 if eligible else 0)


async def test_an_in_band_error_after_output_is_terminal() -> None:
    async with FakeGeminiServer() as primary, FakeGeminiServer() as backup:
        error = {"code": 503, "status": "UNAVAILABLE", "message": "overloaded"}
        primary.script(FakeResponse(text="a b c", in_band_error=error, error_after=2))
        router = OrderedFailoverChatClient(
            [
                GeminiChatClient("g", api_key=KEY, base_url=primary.base_url, name="a"),
                GeminiChatClient("g", api_key=KEY, base_url=backup.base_url, name="b"),
            ]
        )
        result = await collect(router, "hi", streaming=True)
        await router.aclose()
    assert isinstance(result.error, TransientProviderError)
    assert result.error.code == "UNAVAILABLE"
    assert [u.text for u in result.updates] == ["a ", "b "]
    assert backup.count() == 0


async def test_cuts_before_and_after_output_and_a_stream_without_its_end(
    server: FakeGeminiServer, client: GeminiChatClient
) -> None:
    server.script(FakeResponse(text="a b c d", disconnect_after=0))
    before = await collect(client, "hi", streaming=True)
    assert isinstance(before.error, TransientProviderError) and before.updates == []
    server.script(FakeResponse(text="a b c d", disconnect_after=2))
    after = await collect(client, "hi", streaming=True)
    assert isinstance(after.error, TransientProviderError)
    assert [u.text for u in after.updates] == ["a ", "b "]
    # Every chunk arrived but the one with a finishReason: the stream is incomplete.
    server.script(FakeResponse(text="a b", omit_done=True))
    cut = await collect(client, "hi", streaming=True)
    assert isinstance(cut.error, TransientProviderError)
    assert cut.error.code == "incomplete_stream"
    assert [u.text for u in cut.updates] == ["a ", "b"]


async def test_failover_before_output_after_a_cut_and_none_after(streaming: bool) -> None:
    async with FakeGeminiServer() as primary, FakeGeminiServer() as backup:
        primary.script(FakeResponse(status=503), FakeResponse(text="a b c", disconnect_after=1))
        backup.script(FakeResponse(text="from backup"), FakeResponse(text="never"))
        router = OrderedFailoverChatClient(
            [
                Route("a", GeminiChatClient("g", api_key=KEY, base_url=primary.base_url)),
                Route("b", GeminiChatClient("g", api_key=KEY, base_url=backup.base_url)),
            ]
        )
        served = await collect(router, "hi", streaming=streaming)
        assert served.error is None and served.text == "from backup"
        if streaming:
            cut = await collect(router, "hi", streaming=True)
            assert isinstance(cut.error, TransientProviderError)
            assert [u.text for u in cut.updates] == ["a "]
            assert backup.count() == 1  # output reached the caller: no failover
        await router.aclose()


@pytest.mark.parametrize(
    "lines",
    [
        ["data: {not json", ""],
        ["garbage line without a field", ""],
        ["data: [1, 2]", ""],
        [chunk([{"text": 3}]), ""],
        [chunk([{"functionCall": {"args": {}}}]), ""],
        [chunk([{"functionCall": {"name": "f", "args": "x"}}]), ""],
        [chunk([{"text": "a", "thoughtSignature": 5}]), ""],
        [chunk([{"inlineData": {"data": "%%%", "mimeType": "image/png"}}]), ""],
        [chunk([{"text": "a"}], finishReason=7), ""],
        ['data: {"candidates": "x"}', ""],
    ],
)
async def test_malformed_streams_raise_provider_error(
    server: FakeGeminiServer, client: GeminiChatClient, lines: list[str]
) -> None:
    server.script(FakeResponse(raw_lines=lines))
    result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, ProviderError)
    assert result.error.code == "malformed"


async def test_malformed_answers() -> None:
    for body in (
        b"not json",
        b"[1]",
        b"{}",
        b'{"candidates": [1]}',
        b'{"candidates": [{"content": {"parts": [{"text": 3}]}}]}',
        b'{"candidates": [{"content": {"parts": [{"functionCall": {"name": ""}}]}}]}',
    ):
        transport = httpx2.MockTransport(lambda request, b=body: httpx2.Response(200, content=b))
        async with httpx2.AsyncClient(transport=transport) as http:
            raw = GeminiChatClient(
                "g", api_key=KEY, base_url="http://127.0.0.1:1", http_client=http
            )
            with pytest.raises(ProviderError) as caught:
                await raw.get_response("hi")
            assert caught.value.code == "malformed", body


# -- construction and tracing -----------------------------------------------------------------


def test_key_model_paths_and_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GEMINI_API_KEY", raising=False)
    with pytest.raises(ValueError, match="GEMINI_API_KEY"):
        GeminiChatClient("gemini-2.5-flash")
    monkeypatch.setenv("GEMINI_API_KEY", "gm-CANARY-env")
    client = GeminiChatClient("gemini-2.5-flash", name="primary")
    assert "CANARY" not in repr(client)
    assert client.metadata.provider_name == "gcp.gemini"
    assert (client.metadata.server_address, client.metadata.server_port) == (
        "generativelanguage.googleapis.com",
        443,
    )
    assert client.metadata.model_id == "gemini-2.5-flash" and client.metadata.name == "primary"
    tuned = GeminiChatClient("tunedModels/mine", base_url="http://127.0.0.1:9/v1beta")
    assert str(tuned._url).endswith("/v1beta/tunedModels/mine:generateContent")
    with pytest.raises(ValueError, match="model"):
        GeminiChatClient("")


async def test_requests_carry_the_trace_context(
    server: FakeGeminiServer, client: GeminiChatClient, streaming: bool
) -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("attempt") as span:
        await collect(client, "hi", streaming=streaming)
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert server.requests[0].headers["traceparent"].split("-")[1] == trace_id


async def test_bad_content_gets_a_clear_error(client: GeminiChatClient) -> None:
    with pytest.raises(ValueError, match="media_type"):
        await client.get_response(ChatMessage.user(DataContent(data=b"x")))
    with pytest.raises(ValueError, match="at least one user or assistant message"):
        await client.get_response([ChatMessage.system("only a system prompt")])
    with pytest.raises(ValueError, match="call is not in the conversation"):
        await client.get_response([ChatMessage.tool(FunctionResultContent("nowhere", "x"))])


# -- across vendors ---------------------------------------------------------------------------


@pytest.mark.parametrize("status", [429, 503])
async def test_failover_between_openai_and_gemini_routes(streaming: bool, status: int) -> None:
    async with FakeOpenAIServer() as openai_server, FakeGeminiServer() as gemini_server:
        openai_server.script(FakeResponse.error(status, retry_after="0"))
        gemini_server.script(
            FakeResponse(text="from gemini", usage=(2, 2)), FakeResponse.error(status)
        )
        openai_route = Route(
            "openai", OpenAIChatClient("gpt", api_key="sk-x", base_url=openai_server.base_url)
        )
        gemini_route = Route(
            "gemini", GeminiChatClient("gemini-test", api_key=KEY, base_url=gemini_server.base_url)
        )
        router = ChatPipeline.builder().use_ordered_failover([openai_route, gemini_route]).build()
        result = await collect(router, "hi", streaming=streaming)
        assert result.error is None and result.text == "from gemini"
        assert result.response is not None and result.response.model_id == "gemini-test"
        back = ChatPipeline.builder().use_ordered_failover([gemini_route, openai_route]).build()
        openai_server.script(FakeResponse(text="from openai"))
        again = await collect(back, "hi", streaming=streaming)
        assert again.error is None and again.text == "from openai"
        await router.aclose()
    assert (openai_server.count(), gemini_server.count()) == (2, 2)
