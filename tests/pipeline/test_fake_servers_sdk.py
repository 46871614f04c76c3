"""The official SDKs, validating their response types strictly, as clients of the fake
servers: every success is accepted and every error shape maps to the SDK's own exception.
boto3's ``bedrock-runtime`` client judges the Bedrock fake: its signer must pass the fake's
signature check, and its own event-stream parser must read the fake's streams."""

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import boto3
import botocore.config
import botocore.exceptions
import openai
import pytest

from pipeline.testing import (
    RESPONSES_PATH,
    FakeAnthropicServer,
    FakeBedrockServer,
    FakeOpenAIServer,
    FakeResponse,
)

ARGUMENTS = '{"city": "Oslo", "days": 3}'


@pytest.fixture
async def oai() -> AsyncIterator[tuple[FakeOpenAIServer, openai.AsyncOpenAI]]:
    async with FakeOpenAIServer(models=("fake-model", "fake-small")) as server:
        sdk = openai.AsyncOpenAI(
            api_key="sk-test",
            base_url=server.base_url,
            max_retries=0,
            _strict_response_validation=True,
        )
        yield server, sdk
        await sdk.close()


@pytest.fixture
async def ant() -> AsyncIterator[tuple[FakeAnthropicServer, anthropic.AsyncAnthropic]]:
    async with FakeAnthropicServer() as server:
        sdk = anthropic.AsyncAnthropic(
            api_key="sk-ant-test",
            base_url=server.base_url,
            max_retries=0,
            _strict_response_validation=True,
        )
        yield server, sdk
        await sdk.close()


HI = [{"role": "user", "content": "hi"}]

# -- OpenAI -----------------------------------------------------------------------------------


async def test_openai_completion_is_strictly_valid(
    oai: tuple[FakeOpenAIServer, openai.AsyncOpenAI],
) -> None:
    server, sdk = oai
    server.script(FakeResponse(text="one two", usage=(3, 2)))
    completion = await sdk.chat.completions.create(model="fake-model", messages=HI)
    assert completion.choices[0].message.content == "one two"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.created > 0 and completion.object == "chat.completion"
    assert completion.usage is not None and completion.usage.total_tokens == 5


async def test_openai_tool_calls_and_n_choices(
    oai: tuple[FakeOpenAIServer, openai.AsyncOpenAI],
) -> None:
    server, sdk = oai
    server.script(FakeResponse(text="", tool_calls=[("get_weather", ARGUMENTS)]))
    completion = await sdk.chat.completions.create(model="fake-model", messages=HI, n=2)
    assert [c.index for c in completion.choices] == [0, 1]
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls or []
        assert call.type == "function"
        assert (call.function.name, call.function.arguments) == ("get_weather", ARGUMENTS)


async def test_openai_stream_sends_usage_only_when_asked(
    oai: tuple[FakeOpenAIServer, openai.AsyncOpenAI],
) -> None:
    _server, sdk = oai
    stream = await sdk.chat.completions.create(model="fake-model", messages=HI, stream=True)
    chunks = [chunk async for chunk in stream]
    assert all(chunk.usage is None and chunk.choices for chunk in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        "Hello from the fake server."
    )
    assert chunks[-1].choices[0].finish_reason == "stop"
    stream = await sdk.chat.completions.create(
        model="fake-model",
        messages=HI,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert [c for c in chunks if c.usage is not None] == [chunks[-1]]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7


async def test_openai_stream_of_two_choices_and_tool_calls(
    oai: tuple[FakeOpenAIServer, openai.AsyncOpenAI],
) -> None:
    server, sdk = oai
    server.script(FakeResponse(text="a b", tool_calls=[("f", ARGUMENTS)], tool_call_pieces=4))
    stream = await sdk.chat.completions.create(model="fake-model", messages=HI, stream=True, n=2)
    text: dict[int, str] = {0: "", 1: ""}
    arguments: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str | None] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                arguments[choice.index] += (call.function and call.function.arguments) or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert text == {0: "a b", 1: "a b"}
    assert arguments == {0: ARGUMENTS, 1: ARGUMENTS}
    assert finish == {0: "tool_calls", 1: "tool_calls"}


async def test_openai_models_and_embeddings(
    oai: tuple[FakeOpenAIServer, openai.AsyncOpenAI],
) -> None:
    _, sdk = oai
    assert [m.id async for m in sdk.models.list()] == ["fake-model", "fake-small"]
    assert (await sdk.models.retrieve("fake-small")).owned_by == "fake"
    with pytest.raises(openai.NotFoundError) as caught:
        await sdk.models.retrieve("nope")
    assert caught.value.code == "model_not_found"
    embedded = await sdk.embeddings.create(model="e", input=["a", "b"])
    assert [len(item.embedding) for item in embedded.data] == [8, 8]


@pytest.mark.parametrize(
    ("status", "error", "type_"),
    [
        (400, openai.BadRequestError, "invalid_request_error"),
        (401, openai.AuthenticationError, "invalid_request_error"),
        (403, openai.PermissionDeniedError, "invalid_request_error"),
        (404, openai.NotFoundError, "invalid_request_error"),
        (409, openai.ConflictError, "invalid_request_error"),
        (422, openai.UnprocessableEntityError, "invalid_request_error"),
        (429, openai.RateLimitError, "requests"),
        (500, openai.InternalServerError, "server_error"),
        (503, openai.InternalServerError, "server_error"),
    ],
)
async def test_openai_error_statuses_map_to_sdk_exceptions(
    oai: tuple[FakeOpenAIServer, openai.AsyncOpenAI],
    status: int,
    error: type[openai.APIStatusError],
    type_: str,
    streaming: bool,
) -> None:
    server, sdk = oai
    server.script(FakeResponse.error(status, code="some_code", message="m", retry_after="2"))
    with pytest.raises(error) as caught:
        await sdk.chat.completions.create(model="fake-model", messages=HI, stream=streaming)
    assert type(caught.value) is error
    assert caught.value.status_code == status
    assert (caught.value.type, caught.value.code, caught.value.param) == (
        type_,
        "some_code",
        None,
    )
    assert caught.value.body == {"message": "m", "type": type_, "param": None, "code": "some_code"}
    assert caught.value.response.headers["retry-after"] == "2"


async def test_openai_in_band_error_is_an_sdk_api_error(
    oai: tuple[FakeOpenAIServer, openai.AsyncOpenAI],
) -> None:
    server, sdk = oai
    error = {"message": "boom", "type": "server_error", "param": None, "code": "500"}
    server.script(FakeResponse(in_band_error=error, error_after=2))
    stream = await sdk.chat.completions.create(model="fake-model", messages=HI, stream=True)
    received = []
    with pytest.raises(openai.APIError) as caught:
        async for chunk in stream:
            received.append(chunk)
    assert len(received) == 2
    assert caught.value.message == "boom" and caught.value.code == "500"


# -- OpenAI Responses -------------------------------------------------------------------------

FUNCTION = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


async def test_responses_answer_and_stream_are_strictly_valid(
    oai: tuple[FakeOpenAIServer, openai.AsyncOpenAI],
) -> None:
    server, sdk = oai
    server.script(
        FakeResponse(text="one two", tool_calls=[("get_weather", ARGUMENTS)], usage=(3, 2)),
        FakeResponse(text="one two", tool_calls=[("get_weather", ARGUMENTS)], usage=(3, 2)),
        path=RESPONSES_PATH,
    )
    response = await sdk.responses.create(model="fake-model", input="hi", tools=[FUNCTION])
    async with sdk.responses.stream(model="fake-model", input="hi", tools=[FUNCTION]) as stream:
        events = [event.type async for event in stream]
        streamed = await stream.get_final_response()
    for final in (response, streamed):
        assert final.status == "completed" and final.output_text == "one two"
        assert [item.type for item in final.output] == ["message", "function_call"]
        assert final.output[1].arguments == ARGUMENTS  # type: ignore[union-attr]
        assert final.usage is not None and final.usage.total_tokens == 5
    assert events[:2] == ["response.created", "response.in_progress"]
    assert events[-1] == "response.completed"
    assert events.count("response.function_call_arguments.delta") == 3
    assert server.count(RESPONSES_PATH) == 2


async def test_responses_stop_reasons_and_in_band_errors(
    oai: tuple[FakeOpenAIServer, openai.AsyncOpenAI],
) -> None:
    server, sdk = oai
    server.script(
        FakeResponse(text="cut", stop_reason="max_output_tokens"),
        FakeResponse(in_band_error={"code": "server_error", "message": "boom"}, error_after=4),
        path=RESPONSES_PATH,
    )
    response = await sdk.responses.create(model="fake-model", input="hi")
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    stream = await sdk.responses.create(model="fake-model", input="hi", stream=True)
    events = [event async for event in stream]
    assert [event.type for event in events][-1] == "error"
    assert (events[-1].code, events[-1].message) == ("server_error", "boom")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": HI}, "messages"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"max_output_tokens": 5}, "max_output_tokens"),
    ],
)
async def test_responses_refuses_what_the_api_refuses(
    oai: tuple[FakeOpenAIServer, openai.AsyncOpenAI], body: dict[str, object], param: str
) -> None:
    server, sdk = oai
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.responses.create(model="fake-model", input="hi", extra_body=body)
    assert caught.value.param == param
    assert server.count(RESPONSES_PATH) == 1


# -- Anthropic --------------------------------------------------------------------------------


async def test_anthropic_message_is_strictly_valid(
    ant: tuple[FakeAnthropicServer, anthropic.AsyncAnthropic],
) -> None:
    server, sdk = ant
    server.script(
        FakeResponse(
            text="one two",
            tool_calls=[("get_weather", ARGUMENTS)],
            usage=(11, 4),
            cache_usage=(2, 3),
        )
    )
    message = await sdk.messages.create(model="claude-fake", max_tokens=64, messages=HI)
    assert message.stop_reason == "tool_use" and message.model == "claude-fake"
    text, tool = message.content
    assert text.type == "text" and text.text == "one two"
    assert tool.type == "tool_use" and tool.name == "get_weather"
    assert tool.input == {"city": "Oslo", "days": 3}
    assert (message.usage.input_tokens, message.usage.output_tokens) == (11, 4)
    assert message.usage.cache_creation_input_tokens == 2
    assert message.usage.cache_read_input_tokens == 3
    headers = server.requests[0].headers
    assert "sk-ant-test" in (headers.get("x-api-key"), headers.get("authorization", "")[7:])


@pytest.mark.parametrize("stop_reason", ["end_turn", "max_tokens", "stop_sequence", "refusal"])
async def test_anthropic_stream_accumulates_to_the_final_message(
    ant: tuple[FakeAnthropicServer, anthropic.AsyncAnthropic], stop_reason: str
) -> None:
    server, sdk = ant
    server.script(
        FakeResponse(
            text="a b c", tool_calls=[("f", ARGUMENTS)], stop_reason=stop_reason, usage=(5, 9)
        )
    )
    async with sdk.messages.stream(model="claude-fake", max_tokens=64, messages=HI) as stream:
        texts = [text async for text in stream.text_stream]
        message = await stream.get_final_message()
    assert texts == ["a ", "b ", "c"]
    assert message.stop_reason == stop_reason
    assert [block.type for block in message.content] == ["text", "tool_use"]
    assert message.content[1].input == {"city": "Oslo", "days": 3}  # type: ignore[union-attr]
    assert message.usage.output_tokens == 9


async def test_anthropic_raw_stream_events_in_order(
    ant: tuple[FakeAnthropicServer, anthropic.AsyncAnthropic],
) -> None:
    server, sdk = ant
    server.script(FakeResponse(text="x y"))
    stream = await sdk.messages.create(model="claude-fake", max_tokens=64, messages=HI, stream=True)
    kinds = [event.type async for event in stream]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]  # the SDK drops pings


@pytest.mark.parametrize(
    ("status", "error", "type_"),
    [
        (400, anthropic.BadRequestError, "invalid_request_error"),
        (401, anthropic.AuthenticationError, "authentication_error"),
        (403, anthropic.PermissionDeniedError, "permission_error"),
        (404, anthropic.NotFoundError, "not_found_error"),
        (413, anthropic.ContentTooLargeError, "request_too_large"),
        (429, anthropic.RateLimitError, "rate_limit_error"),
        (500, anthropic.InternalServerError, "api_error"),
        (529, anthropic.OverloadedError, "overloaded_error"),
    ],
)
async def test_anthropic_error_statuses_map_to_sdk_exceptions(
    ant: tuple[FakeAnthropicServer, anthropic.AsyncAnthropic],
    status: int,
    error: type[anthropic.APIStatusError],
    type_: str,
    streaming: bool,
) -> None:
    server, sdk = ant
    server.script(FakeResponse.error(status, message="m", retry_after="4"))
    with pytest.raises(error) as caught:
        await sdk.messages.create(model="claude-fake", max_tokens=64, messages=HI, stream=streaming)
    assert type(caught.value) is error
    assert caught.value.status_code == status
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["error"] == {"type": type_, "message": "m"}
    assert caught.value.response.headers["retry-after"] == "4"
    assert caught.value.request_id == "req_fake_1"


async def test_anthropic_in_band_error_event_is_an_sdk_status_error(
    ant: tuple[FakeAnthropicServer, anthropic.AsyncAnthropic],
) -> None:
    server, sdk = ant
    error = {"type": "overloaded_error", "message": "Overloaded"}
    server.script(FakeResponse(text="a b c", in_band_error=error, error_after=4))
    stream = await sdk.messages.create(model="claude-fake", max_tokens=64, messages=HI, stream=True)
    kinds = []
    with pytest.raises(anthropic.APIStatusError) as caught:
        async for event in stream:
            kinds.append(event.type)
    assert kinds == ["message_start", "content_block_start", "content_block_delta"]
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["error"] == error


async def test_anthropic_requires_its_headers(
    ant: tuple[FakeAnthropicServer, anthropic.AsyncAnthropic],
) -> None:
    server, sdk = ant
    with pytest.raises(anthropic.BadRequestError):
        await sdk.messages.create(
            model="claude-fake",
            max_tokens=64,
            messages=HI,
            extra_headers={"anthropic-version": anthropic.Omit()},
        )
    assert server.count() == 1


# -- Bedrock (boto3) --------------------------------------------------------------------------

MODEL = "anthropic.claude-sonnet-4-5-20250929-v1:0"
USER = [{"role": "user", "content": [{"text": "hi"}]}]


@pytest.fixture
async def brk(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[FakeBedrockServer, Any]]:
    async with FakeBedrockServer(session_tokens={"AKIDFAKEBEDROCK0001": "token-1"}) as server:
        for name, value in server.environment().items():
            monkeypatch.setenv(name, value)  # no shared config files, no instance metadata
        sdk = boto3.session.Session().client(
            "bedrock-runtime",
            endpoint_url=server.base_url,
            config=botocore.config.Config(retries={"total_max_attempts": 1}),
        )
        yield server, sdk
        sdk.close()


async def _call(sdk: Any, operation: str, **request: Any) -> Any:
    return await asyncio.to_thread(getattr(sdk, operation), modelId=MODEL, **request)


async def _events(sdk: Any, **request: Any) -> list[dict[str, Any]]:
    response = await _call(sdk, "converse_stream", **request)
    return await asyncio.to_thread(list, response["stream"])


async def test_bedrock_converse_is_read_by_boto3(brk: tuple[FakeBedrockServer, Any]) -> None:
    server, sdk = brk
    server.script(
        FakeResponse(
            text="one two",
            tool_calls=[("get_weather", ARGUMENTS)],
            usage=(11, 4),
            cache_usage=(2, 3),
        )
    )
    tools = {"tools": [{"toolSpec": {"name": "get_weather", "inputSchema": {"json": {}}}}]}
    answer = await _call(sdk, "converse", messages=USER, toolConfig=tools)
    assert answer["stopReason"] == "tool_use"
    text, tool = answer["output"]["message"]["content"]
    assert text == {"text": "one two"}
    assert tool["toolUse"]["name"] == "get_weather"
    assert tool["toolUse"]["input"] == {"city": "Oslo", "days": 3}
    assert answer["usage"] == {
        "inputTokens": 11,
        "outputTokens": 4,
        "totalTokens": 20,
        "cacheReadInputTokens": 3,
        "cacheWriteInputTokens": 2,
    }
    assert server.verified_signatures == 1 and server.models == [MODEL]


async def test_bedrock_streams_are_read_by_boto3s_event_stream_parser(
    brk: tuple[FakeBedrockServer, Any],
) -> None:
    server, sdk = brk
    server.script(FakeResponse(text="a b", tool_calls=[("f", ARGUMENTS)], thinking="hmm"))
    thinking = {"thinking": {"type": "enabled", "budget_tokens": 1024}}
    events = await _events(sdk, messages=USER, additionalModelRequestFields=thinking)
    kinds = [next(iter(event)) for event in events]
    assert kinds == [
        "messageStart",
        *["contentBlockDelta"] * 2,  # reasoning text, then its signature
        "contentBlockStop",
        *["contentBlockDelta"] * 2,  # "a ", "b"
        "contentBlockStop",
        "contentBlockStart",
        *["contentBlockDelta"] * 3,  # the tool's input in three pieces
        "contentBlockStop",
        "messageStop",
        "metadata",
    ]
    deltas = [e["contentBlockDelta"]["delta"] for e in events if "contentBlockDelta" in e]
    assert deltas[0] == {"reasoningContent": {"text": "hmm"}}
    assert deltas[1] == {"reasoningContent": {"signature": server.reasoning_signature("hmm")}}
    assert "".join(d["toolUse"]["input"] for d in deltas if "toolUse" in d) == ARGUMENTS
    assert events[-2]["messageStop"]["stopReason"] == "tool_use"
    assert events[-1]["metadata"]["usage"]["totalTokens"] == 12


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        (429, "ThrottlingException"),
        (429, "ModelNotReadyException"),
        (503, "ServiceUnavailableException"),
        (500, "InternalServerException"),
        (408, "ModelTimeoutException"),
        (424, "ModelErrorException"),
        (400, "ValidationException"),
        (403, "AccessDeniedException"),
        (404, "ResourceNotFoundException"),
    ],
)
async def test_bedrock_errors_are_boto3s_modeled_exceptions(
    brk: tuple[FakeBedrockServer, Any], status: int, error_type: str, streaming: bool
) -> None:
    server, sdk = brk
    server.script(FakeResponse.error(status, type=error_type, message="m", retry_after="4"))
    error = getattr(sdk.exceptions, error_type)
    with pytest.raises(error) as caught:
        if streaming:
            await _events(sdk, messages=USER)
        else:
            await _call(sdk, "converse", messages=USER)
    assert caught.value.response["Error"]["Code"] == error_type
    assert caught.value.response["Error"]["Message"] == "m"
    metadata = caught.value.response["ResponseMetadata"]
    assert metadata["HTTPStatusCode"] == status
    assert metadata["HTTPHeaders"]["retry-after"] == "4"


@pytest.mark.parametrize(
    "member",
    [
        "throttlingException",
        "modelStreamErrorException",
        "serviceUnavailableException",
        "internalServerException",
        "validationException",
    ],
)
async def test_bedrock_stream_exceptions_are_boto3_event_stream_errors(
    brk: tuple[FakeBedrockServer, Any], member: str
) -> None:
    server, sdk = brk
    server.script(
        FakeResponse(text="a b c", in_band_error={"type": member, "message": "m"}, error_after=2)
    )
    response = await _call(sdk, "converse_stream", messages=USER)
    seen: list[str] = []

    def read() -> None:
        for event in response["stream"]:
            seen.append(next(iter(event)))

    with pytest.raises(botocore.exceptions.EventStreamError) as caught:
        await asyncio.to_thread(read)
    assert seen == ["messageStart", "contentBlockDelta"]
    assert caught.value.response["Error"] == {"Code": member, "Message": "m"}


async def test_bedrock_refuses_what_the_service_refuses(brk: tuple[FakeBedrockServer, Any]) -> None:
    server, sdk = brk
    refused = [
        [{"role": "assistant", "content": [{"text": "first"}]}],
        [{"role": "user", "content": [{"text": " "}]}],
        [
            {"role": "user", "content": [{"text": "hi"}]},
            {
                "role": "assistant",
                "content": [{"toolUse": {"toolUseId": "t", "name": "f", "input": {}}}],
            },
            {
                "role": "user",
                "content": [{"toolResult": {"toolUseId": "t", "content": [{"text": "x"}]}}],
            },
        ],  # tool blocks without a toolConfig
        [
            {"role": "user", "content": [{"text": "hi"}]},
            {
                "role": "assistant",
                "content": [
                    {"reasoningContent": {"reasoningText": {"text": "x", "signature": "forged"}}}
                ],
            },
            {"role": "user", "content": [{"text": "more"}]},
        ],
    ]
    for messages in refused:
        with pytest.raises(sdk.exceptions.ValidationException):
            await _call(sdk, "converse", messages=messages)
    assert server.count() == len(refused)


async def test_bedrock_checks_every_signature(brk: tuple[FakeBedrockServer, Any]) -> None:
    server, _ = brk
    forger = boto3.session.Session(
        aws_access_key_id="AKIDFAKEBEDROCK0001",
        aws_secret_access_key="the-wrong-secret",
        aws_session_token="token-1",
    ).client(
        "bedrock-runtime",
        endpoint_url=server.base_url,
        config=botocore.config.Config(retries={"total_max_attempts": 1}),
    )
    with pytest.raises(botocore.exceptions.ClientError) as caught:
        await _call(forger, "converse", messages=USER)
    forger.close()
    assert caught.value.response["Error"]["Code"] == "InvalidSignatureException"
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert server.verified_signatures == 0


# -- ids --------------------------------------------------------------------------------------

TWO_CALLS = FakeResponse(text="", tool_calls=[("f", ARGUMENTS), ("g", ARGUMENTS)])


async def _openai_call_ids(server: FakeOpenAIServer, streaming: bool) -> list[str]:
    """The ids of the calls of two chat completions and two responses, from `server`."""
    server.script(TWO_CALLS, TWO_CALLS)
    server.script(TWO_CALLS, TWO_CALLS, path=RESPONSES_PATH)
    sdk = openai.AsyncOpenAI(api_key="k", base_url=server.base_url, max_retries=0)
    ids: list[str] = []
    for _ in range(2):
        if streaming:
            stream = await sdk.chat.completions.create(model="m", messages=HI, stream=True)
            chunks = [chunk async for chunk in stream]
            deltas = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
            ids += [call.id for call in deltas if call.id]
            async with sdk.responses.stream(model="m", input="hi") as events:
                final = await events.get_final_response()
        else:
            completion = await sdk.chat.completions.create(model="m", messages=HI)
            ids += [call.id for call in completion.choices[0].message.tool_calls or []]
            final = await sdk.responses.create(model="m", input="hi")
        calls = [item for item in final.output if item.type == "function_call"]
        ids += [call.call_id for call in calls] + [call.id or "" for call in calls]
    await sdk.close()
    return ids


async def _anthropic_call_ids(server: FakeAnthropicServer, streaming: bool) -> list[str]:
    server.script(TWO_CALLS, TWO_CALLS)
    sdk = anthropic.AsyncAnthropic(api_key="k", base_url=server.base_url, max_retries=0)
    ids: list[str] = []
    for _ in range(2):
        if streaming:
            async with sdk.messages.stream(model="c", max_tokens=64, messages=HI) as stream:
                message = await stream.get_final_message()
        else:
            message = await sdk.messages.create(model="c", max_tokens=64, messages=HI)
        ids += [block.id for block in message.content if block.type == "tool_use"]
    await sdk.close()
    return ids


async def test_every_tool_call_has_an_id_of_its_own(streaming: bool) -> None:
    """An agent takes a call id it has seen for a call already answered: two answers with
    two calls each, from two servers of each kind, in every format, never share an id."""
    ids: list[str] = []
    async with FakeOpenAIServer() as one, FakeOpenAIServer() as two:
        ids += await _openai_call_ids(one, streaming) + await _openai_call_ids(two, streaming)
    async with FakeAnthropicServer() as one, FakeAnthropicServer() as two:
        ids += await _anthropic_call_ids(one, streaming) + await _anthropic_call_ids(two, streaming)
    # Per OpenAI server: 4 chat calls, 4 Responses calls (a call id and an item id each);
    # per Anthropic server: 4 calls.
    assert len(ids) == 2 * (4 + 4 * 2) + 2 * 4
    assert all(ids) and len(set(ids)) == len(ids)
