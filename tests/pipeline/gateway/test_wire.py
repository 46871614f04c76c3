"""The gateway's wire format alone: requests in, answers, chunks and errors out."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline._json import MAX_JSON_DEPTH, json_body, too_deep
from pipeline.errors import (
    AttemptTimeoutError,
    AuthenticationError,
    CircuitOpenError,
    ContentFilteredError,
    ContextLengthExceededError,
    QuotaExhaustedError,
    RateLimitedError,
    RequestBudgetExceededError,
    RequestInvalidError,
    RequestTimeoutError,
    ResponseValidationError,
    TransientProviderError,
    UnknownProviderError,
)
from pipeline.gateway.wire import (
    ChunkEncoder,
    WireError,
    completion,
    error_for,
    finish_reason,
    parse_request,
)
from pipeline.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    DataContent,
    FunctionCallContent,
    FunctionResultContent,
    FunctionTool,
    TextContent,
    ToolChoice,
    UsageDetails,
)

CANARY = "CANARY-secret-91b2"


def body(**fields: Any) -> bytes:
    fields.setdefault("model", "pipeline")
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return json.dumps(fields).encode()


def test_a_full_request_becomes_messages_and_options() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    request = parse_request(
        body(
            messages=[
                {"role": "system", "content": "S"},
                {"role": "developer", "content": [{"type": "text", "text": "D"}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                    ],
                    "name": "ann",
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"a": 1}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ],
            stream=True,
            stream_options={"include_usage": True},
            temperature=0.3,
            top_p=1,
            max_tokens=9,
            stop=["x", "y"],
            seed=3,
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "f"}},
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {}}},
            reasoning_effort="low",
            parallel_tool_calls=False,
            store=True,
        ),
        session_id="s-1",
    )
    assert request.model == "pipeline" and request.stream and request.include_usage
    roles = [m.role for m in request.messages]
    assert roles == [
        ChatRole.SYSTEM,
        ChatRole.SYSTEM,
        ChatRole.USER,
        ChatRole.ASSISTANT,
        ChatRole.TOOL,
    ]
    assert request.messages[2].contents == [
        TextContent("look"),
        DataContent(uri="data:image/png;base64,AA=="),
    ]
    assert request.messages[2].author_name == "ann"
    assert request.messages[3].contents == [FunctionCallContent("c1", "f", {"a": 1})]
    assert request.messages[4].contents == [FunctionResultContent("c1", result="42")]
    options = request.options
    assert (options.temperature, options.top_p, options.max_output_tokens) == (0.3, 1.0, 9)
    assert options.stop == ["x", "y"] and options.seed == 3
    assert options.tools == [FunctionTool("f", parameters={"type": "object"})]
    assert options.tool_mode == ToolChoice.named("f")
    assert options.response_format["type"] == "json_schema"
    assert options.reasoning_effort == "low"
    assert options.session_id == "s-1"
    assert options.additional_properties == {"parallel_tool_calls": False}  # store is dropped
    assert options.model_id is None  # the route's model is the route's business


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    request = parse_request(body(max_tokens=5, max_completion_tokens=7))
    assert request.options.max_output_tokens == 7


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"model": ""}, "model", "missing_required"),
        ({"messages": []}, "messages", "missing_required"),
        ({"messages": [CANARY]}, "messages[0]", "invalid_value"),
        ({"messages": [{"role": CANARY, "content": "x"}]}, "messages[0].role", "invalid_value"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_value"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0].type",
            "invalid_value",
        ),
        (
            {"messages": [{"role": "system", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
            "invalid_value",
        ),
        (
            {"messages": [{"role": "tool", "content": CANARY}]},
            "messages[0].tool_call_id",
            "invalid_value",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": CANARY}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
            "invalid_value",
        ),
        ({"temperature": 2.5}, "temperature", "invalid_value"),
        ({"temperature": True}, "temperature", "invalid_value"),
        ({"top_p": CANARY}, "top_p", "invalid_value"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"seed": 1.5}, "seed", "invalid_value"),
        ({"stop": [CANARY] * 5}, "stop", "invalid_value"),
        ({"stream": "yes"}, "stream", "invalid_value"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage", "invalid_value"),
        ({"n": 2}, "n", "unsupported_value"),
        ({"logprobs": True}, "logprobs", "unsupported_value"),
        (
            {"tools": [{"type": "function", "function": {"name": CANARY + " x"}}]},
            "tools[0].function.name",
            "invalid_value",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "invalid_value"),
        ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
            "invalid_value",
        ),
        ({"response_format": {"type": CANARY}}, "response_format.type", "invalid_value"),
        ({"reasoning_effort": 3}, "reasoning_effort", "invalid_value"),
        ({"service_tier": ["auto"]}, "service_tier", "invalid_value"),
        ({"verbosity": {"level": "low"}}, "verbosity", "invalid_value"),
        ({CANARY: 1}, CANARY, "unsupported_parameter"),
    ],
)
def test_bad_requests_name_the_parameter_and_never_echo_values(
    fields: dict[str, Any], param: str, code: str
) -> None:
    with pytest.raises(WireError) as raised:
        parse_request(body(**fields))
    error = raised.value
    assert (error.status, error.param, error.code) == (400, param, code)
    assert error.type == "invalid_request_error"
    if param != CANARY:  # an unknown parameter is named: its name is what is wrong
        assert CANARY not in error.message
        assert CANARY.encode() not in error.body()


@pytest.mark.parametrize("raw", [b"{", b"[1]", b"\xff", b"", b"[" * 100_000 + b"]" * 100_000])
def test_a_body_that_is_not_a_json_object_is_400(raw: bytes) -> None:
    with pytest.raises(WireError) as raised:
        parse_request(raw)
    assert (raised.value.status, raised.value.code) == (400, "invalid_json")


def test_a_completion_body() -> None:
    response = ChatResponse(
        messages=[ChatMessage(ChatRole.ASSISTANT, ["Hi ", "there"])],
        model_id="served-model",
        finish_reason="end_turn",
        usage=UsageDetails(3, 4),
    )
    payload = json.loads(completion(response, model="alias", response_id="chatcmpl-1", created=9))
    assert payload == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 9,
        "model": "served-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi there", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }


def test_a_completion_with_tool_calls() -> None:
    response = ChatResponse(
        messages=[
            ChatMessage(
                ChatRole.ASSISTANT,
                [FunctionCallContent("c1", "f", {"a": 1}), FunctionCallContent("", "g")],
            )
        ]
    )
    payload = json.loads(completion(response, model="alias", response_id="x", created=1))
    choice = payload["choices"][0]
    assert payload["model"] == "alias" and payload["usage"] is None
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert calls[0] == {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a":1}'},
    }
    assert calls[1]["id"].startswith("call_") and calls[1]["function"]["arguments"] == "{}"


def events(text: str) -> list[Any]:
    assert text.endswith("\n\n")
    out = []
    for event in text.split("\n\n")[:-1]:
        assert event.startswith("data: ")
        data = event.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize("include_usage", [False, True])
def test_chunks_of_a_streamed_answer(include_usage: bool) -> None:
    encoder = ChunkEncoder(model="m", response_id="id-1", created=5, include_usage=include_usage)
    text = encoder.update(ChatResponseUpdate(contents=[TextContent("He")]))
    text += encoder.update(ChatResponseUpdate(contents=[]))
    text += encoder.update(
        ChatResponseUpdate(
            contents=[TextContent("llo"), FunctionCallContent("c", "f", {"x": "y"})],
            finish_reason="tool_calls",
        )
    )
    text += encoder.update(ChatResponseUpdate(usage=UsageDetails(1, 2, 3)))
    text += encoder.end()
    chunks = events(text)
    assert chunks[-1] == "[DONE]"
    frames = chunks[:-1]
    assert {(c["id"], c["object"], c["created"], c["model"]) for c in frames} == {
        ("id-1", "chat.completion.chunk", 5, "m")
    }
    deltas = [c["choices"][0]["delta"] for c in frames if c["choices"]]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": "He"},
        {"content": "llo"},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "c",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"x":"y"}'},
                }
            ]
        },
        {},
    ]
    finishes = [c["choices"][0]["finish_reason"] for c in frames if c["choices"]]
    assert finishes == [None, None, None, None, "tool_calls"]
    if include_usage:
        assert frames[-1]["choices"] == []
        assert frames[-1]["usage"] == {
            "prompt_tokens": 1,
            "completion_tokens": 2,
            "total_tokens": 3,
        }
    else:
        assert all(c["choices"] for c in frames)


def test_an_empty_stream_still_starts_and_finishes() -> None:
    encoder = ChunkEncoder(model="m", response_id="i", created=1, include_usage=True)
    chunks = events(encoder.end())
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[2]["usage"] is None
    assert chunks[3] == "[DONE]"


def test_the_in_band_error_event() -> None:
    error = WireError(503, "down", type="server_error", code="upstream_unavailable")
    assert events(ChunkEncoder.error(error)) == [
        {
            "error": {
                "message": "down",
                "type": "server_error",
                "param": None,
                "code": "upstream_unavailable",
            }
        }
    ]


@pytest.mark.parametrize(
    ("reason", "called", "expected"),
    [
        (None, False, "stop"),
        (None, True, "tool_calls"),
        ("length", False, "length"),
        ("max_tokens", False, "length"),
        ("tool_use", True, "tool_calls"),
        ("refusal", False, "content_filter"),
        ("something-new", False, "stop"),
    ],
)
def test_finish_reasons(reason: str | None, called: bool, expected: str) -> None:
    assert finish_reason(reason, called) == expected


@pytest.mark.parametrize(
    ("error", "status", "type_", "code"),
    [
        # Every route rate limited: 503, asking to wait (as long as none said: retry_after).
        (RateLimitedError(status_code=429), 503, "server_error", "rate_limit_exceeded"),
        (RequestInvalidError(code="invalid_value"), 400, "invalid_request_error", "invalid_value"),
        (RequestInvalidError(code=f"{CANARY} with spaces"), 400, "invalid_request_error", None),
        (ContextLengthExceededError(), 400, "invalid_request_error", "context_length_exceeded"),
        (ContentFilteredError(), 400, "invalid_request_error", "content_filter"),
        (
            # The gateway's own credentials, refused upstream: never the caller's 401.
            AuthenticationError(status_code=403),
            502,
            "server_error",
            "upstream_authentication_failed",
        ),
        (TransientProviderError(status_code=502), 503, "server_error", "upstream_unavailable"),
        (
            # The gateway's own account out of credit: the operator's to fix, never the
            # caller's 402 (their budget).
            QuotaExhaustedError(status_code=429, code="insufficient_quota"),
            503,
            "server_error",
            "upstream_quota_exhausted",
        ),
        (CircuitOpenError(), 503, "server_error", "circuit_open"),
        (UnknownProviderError(), 503, "server_error", "upstream_error"),
        # Every route's answer failed its validation (before, a KeyError: a 500).
        (ResponseValidationError(), 503, "server_error", "upstream_invalid_response"),
        (ValueError(CANARY), 503, "server_error", "upstream_error"),
        (RequestTimeoutError(CANARY), 504, "timeout_error", "timeout"),
        (AttemptTimeoutError(CANARY), 504, "timeout_error", "timeout"),
        (RequestBudgetExceededError(CANARY), 503, "server_error", "no_route"),
    ],
)
def test_failures_map_to_statuses(
    error: BaseException, status: int, type_: str, code: str | None
) -> None:
    mapped = error_for(error, retry_after=2.0)
    assert (mapped.status, mapped.type, mapped.code) == (status, type_, code)
    assert CANARY not in mapped.message
    rate_limited = isinstance(error, RateLimitedError)
    if rate_limited:
        assert mapped.headers() == [(b"retry-after", b"2")]
        assert mapped.should_retry is None
    else:
        # Every route failed and none said when it may serve: no retry will help soon.
        assert mapped.headers() == []
        assert mapped.should_retry is (False if status == 503 else None)
    if status == 503 and not rate_limited:
        assert "retry later" not in mapped.message
        # Mid-stream, one route's failure: a retry may help.
        later = error_for(error, retry_after=2.0, after_output=True)
        assert later.headers() == [(b"retry-after", b"2")] and later.should_retry is None
    if rate_limited:
        # Mid-stream, one route's rate limit: its own status in the in-band error.
        later = error_for(error, retry_after=2.0, after_output=True)
        assert (later.status, later.type, later.retry_after) == (429, "rate_limit_error", 2.0)


@pytest.mark.parametrize(
    "error",
    [
        TransientProviderError(status_code=503, retry_after=4.5),
        CircuitOpenError(retry_after=4.5),
        UnknownProviderError(retry_after=4.5),
    ],
)
def test_a_failure_that_says_when_asks_to_retry_then(error: BaseException) -> None:
    mapped = error_for(error, retry_after=2.0)
    assert mapped.status == 503
    assert mapped.headers() == [(b"retry-after", b"5")]
    assert mapped.should_retry is None


def test_the_providers_retry_after_wins_and_is_whole_seconds() -> None:
    mapped = error_for(RateLimitedError(retry_after=2.2, provider="openai"), retry_after=1.0)
    assert mapped.headers() == [(b"retry-after", b"3")]
    assert mapped.message.endswith("(provider openai)")


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "model",
                    "messages",
                    "role",
                    "content",
                    "type",
                    "text",
                    "tools",
                    "function",
                    "name",
                    "arguments",
                    "tool_calls",
                    "tool_call_id",
                    "stream",
                    "stop",
                    "n",
                    "temperature",
                    "tool_choice",
                    "image_url",
                    "url",
                    "parameters",
                    "stream_options",
                    "include_usage",
                    "response_format",
                    "max_tokens",
                ]
            ),
            children,
            max_size=5,
        )
    ),
    max_leaves=20,
)


@given(payload=_json)
def test_any_json_is_a_request_or_a_400(payload: Any) -> None:
    raw = json.dumps(payload).encode()
    refused: WireError | None = None
    try:
        request = parse_request(raw)
    except WireError as exc:  # the one exception bad input may raise
        refused = exc
    if refused is not None:
        assert refused.status == 400 and refused.code is not None
    else:
        assert request.messages and request.model


# -- JSON bodies ---------------------------------------------------------------------------


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    ("body", "deep"),
    [
        (_nested(128), False),
        (_nested(129), True),
        (b'{"a": "' + b"[" * 1000 + b'"}', False),  # brackets in a string nest nothing
        (b'{"a": "\\"[[[[", "b": ' + _nested(129) + b"}", True),  # escaped quotes
        (b"[" + b"[]," * 5000 + b"[]]", False),  # many siblings, two levels
        (b'{"a": ' * 130 + b"1" + b"}" * 130, True),
    ],
)
def test_nesting_is_bounded_outside_strings(body: bytes, deep: bool) -> None:
    assert too_deep(body, MAX_JSON_DEPTH) is deep


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"model": "m"}'.encode("utf-16"), "not valid JSON in UTF-8"),
        ('{"model": "m"}'.encode("utf-32-le"), "not valid JSON"),  # valid UTF-8: NULs
        ("\ufeff{}".encode(), "not valid JSON"),  # a byte order mark
        (_nested(600), f"more than {MAX_JSON_DEPTH} levels deep"),
        (b"{nope", "not valid JSON"),
    ],
)
def test_json_bodies_are_utf8_and_bounded(body: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        json_body(body)
    with pytest.raises(WireError) as raised:
        parse_request(body)
    assert (raised.value.status, raised.value.code) == (400, "invalid_json")


def test_tool_call_arguments_are_bounded_like_the_body() -> None:
    arguments = json.dumps(json.loads(_nested(200)))
    body = {
        "model": "m",
        "messages": [
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": arguments}}],
            }
        ],
    }
    with pytest.raises(WireError) as raised:
        parse_request(json.dumps(body).encode())
    assert raised.value.param == "messages[0].tool_calls[0].function.arguments"


def test_a_context_overflow_speaks_openais_words() -> None:
    from pipeline.errors import ContextLengthExceededError

    mapped = error_for(ContextLengthExceededError(provider="openai", status_code=400), 1.0)
    assert mapped.message.startswith("This model's maximum context length is ")
    assert (mapped.status, mapped.code, mapped.param) == (
        400,
        "context_length_exceeded",
        "messages",
    )
