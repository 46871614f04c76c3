"""The official SDKs as clients of `FakeGeminiServer` and `FakeGoogleTokenServer`: Google's
`google-genai` (Gemini API and Vertex AI paths), the `anthropic` SDK's Vertex client, and
google-auth's service-account credentials. Every success is accepted, streamed or not,
and every error maps to the SDK's own exception."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import google.auth.transport.requests
import google.oauth2.credentials
import pytest
from google import genai
from google.auth.exceptions import RefreshError
from google.genai import errors, types
from google.oauth2 import service_account

from pipeline.testing import (
    RAW_PREDICT,
    FakeGeminiServer,
    FakeGoogleTokenServer,
    FakeResponse,
)

# The SDK's own aiohttp session class, which aiohttp discourages: not ours to fix.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Inheritance class AiohttpClientSession:DeprecationWarning"
)

NO_RETRIES = types.HttpRetryOptions(attempts=1)
WEATHER = json.dumps({"city": "Oslo"})
THINKING = types.GenerateContentConfig(
    thinking_config=types.ThinkingConfig(thinking_budget=64, include_thoughts=True)
)


@pytest.fixture
async def server() -> AsyncIterator[FakeGeminiServer]:
    async with FakeGeminiServer() as fake:
        yield fake


def gemini(server: FakeGeminiServer) -> genai.Client:
    options = types.HttpOptions(base_url=server.origin, retry_options=NO_RETRIES)
    return genai.Client(api_key="fake-key", http_options=options)


def vertex(server: FakeGeminiServer) -> genai.Client:
    options = types.HttpOptions(
        base_url=server.vertex_base_url, api_version="v1", retry_options=NO_RETRIES
    )
    credentials = google.oauth2.credentials.Credentials("fake-token")
    return genai.Client(
        vertexai=True,
        project="fake-project",
        location="us-central1",
        credentials=credentials,
        http_options=options,
    )


async def generate(
    client: genai.Client, contents: Any, config: Any = None, *, streaming: bool
) -> tuple[list[types.GenerateContentResponse], str]:
    """The responses (one, or every chunk) and the text they carry."""
    if not streaming:
        answer = await client.aio.models.generate_content(
            model="gemini-test", contents=contents, config=config
        )
        return [answer], answer.text or ""
    chunks = [
        chunk
        async for chunk in await client.aio.models.generate_content_stream(
            model="gemini-test", contents=contents, config=config
        )
    ]
    return chunks, "".join(chunk.text or "" for chunk in chunks)


@pytest.mark.parametrize("api", ["gemini", "vertex"])
async def test_text_usage_and_ids_are_accepted(
    server: FakeGeminiServer, streaming: bool, api: str
) -> None:
    client = gemini(server) if api == "gemini" else vertex(server)
    server.script(
        FakeResponse(text="one two three", usage=(11, 7), cache_usage=(0, 4)),
        FakeResponse(text="again"),
    )
    responses, text = await generate(client, "hi", streaming=streaming)
    assert text == "one two three"
    last = responses[-1]
    assert last.candidates and last.candidates[0].finish_reason == types.FinishReason.STOP
    assert last.usage_metadata is not None
    assert (last.usage_metadata.prompt_token_count, last.usage_metadata.candidates_token_count) == (
        11,
        7,
    )
    assert last.usage_metadata.cached_content_token_count == 4
    assert last.model_version == "gemini-test"
    second, _ = await generate(client, "hi", streaming=streaming)
    assert second[-1].response_id != last.response_id  # unique per call
    assert server.count() == 2
    path = server.requests[0].path
    assert path.startswith("/v1/projects/fake-project/" if api == "vertex" else "/v1/models/")


async def test_thoughts_calls_and_signatures_round_trip(
    server: FakeGeminiServer, streaming: bool
) -> None:
    client = gemini(server)
    server.script(
        FakeResponse(
            text="", tool_calls=[("get_weather", WEATHER)], thinking="CANARY hmm", usage=(5, 9),
            reasoning_tokens=4,
        ),
        FakeResponse(text="Sunny."),
    )  # fmt: skip
    tool = types.Tool(
        function_declarations=[
            types.FunctionDeclaration(
                name="get_weather",
                parameters_json_schema={"type": "object", "properties": {"city": {}}},
            )
        ]
    )
    config = THINKING.model_copy(update={"tools": [tool]})
    responses, _ = await generate(client, "weather?", config, streaming=streaming)
    parts = [part for r in responses for c in r.candidates or [] for part in c.content.parts or []]  # type: ignore[union-attr]
    assert [part.text for part in parts if part.thought] == ["CANARY hmm"]
    [call] = [part for part in parts if part.function_call]
    assert call.function_call is not None and call.function_call.args == {"city": "Oslo"}
    assert call.thought_signature  # bytes, as the SDK decodes it
    usage = responses[-1].usage_metadata
    assert usage is not None and usage.thoughts_token_count == 4
    # The model's turn goes back as the SDK keeps it: the fake verifies its signature.
    history = [
        types.Content(role="user", parts=[types.Part(text="weather?")]),
        types.Content(role="model", parts=[part for part in parts if not part.thought]),
        types.Content(
            role="user",
            parts=[types.Part.from_function_response(name="get_weather", response={"t": 20})],
        ),
    ]
    _, text = await generate(client, history, config, streaming=streaming)
    assert text == "Sunny."
    assert server.returned_signatures == 1


async def test_a_missing_or_forged_signature_is_refused(server: FakeGeminiServer) -> None:
    client = gemini(server)
    call = types.Part(function_call=types.FunctionCall(name="f", args={}))
    answer = types.Part.from_function_response(name="f", response={})
    contents = [
        types.Content(role="user", parts=[types.Part(text="go")]),
        types.Content(role="model", parts=[call]),
        types.Content(role="user", parts=[answer]),
    ]
    with pytest.raises(errors.ClientError) as missing:
        await client.aio.models.generate_content(model="m", contents=contents, config=THINKING)
    assert missing.value.code == 400 and "thought_signature" in str(missing.value.message)
    contents[1] = types.Content(
        role="model", parts=[call.model_copy(update={"thought_signature": b"forged"})]
    )
    with pytest.raises(errors.ClientError) as forged:
        await client.aio.models.generate_content(model="m", contents=contents, config=THINKING)
    assert forged.value.code == 400
    # Google's placeholder for a call the model made elsewhere is accepted.
    placeholder = base64.urlsafe_b64decode("skip_thought_signature_validator")
    contents[1] = types.Content(
        role="model", parts=[call.model_copy(update={"thought_signature": placeholder})]
    )
    await client.aio.models.generate_content(model="m", contents=contents, config=THINKING)
    assert server.placeholder_signatures == 1


async def test_filtered_answers_and_blocked_prompts(
    server: FakeGeminiServer, streaming: bool
) -> None:
    client = gemini(server)
    server.script(FakeResponse(text="", stop_reason="SAFETY"), server.blocked_prompt("OTHER"))
    responses, text = await generate(client, "hi", streaming=streaming)
    assert text == ""
    last = responses[-1]
    assert last.candidates and last.candidates[0].finish_reason == types.FinishReason.SAFETY
    responses, _ = await generate(client, "hi", streaming=streaming)
    feedback = responses[-1].prompt_feedback
    assert feedback is not None and feedback.block_reason == types.BlockedReason.OTHER
    assert not responses[-1].candidates


@pytest.mark.parametrize(
    ("status", "error_type"), [(400, errors.ClientError), (429, errors.ClientError),
                               (500, errors.ServerError), (503, errors.ServerError)],
)  # fmt: skip
async def test_errors_map_to_sdk_exceptions(
    server: FakeGeminiServer, streaming: bool, status: int, error_type: type[Exception]
) -> None:
    client = gemini(server)
    server.script(FakeResponse.error(status, message="CANARY", retry_after="7"))
    with pytest.raises(error_type) as caught:
        await generate(client, "hi", streaming=streaming)
    assert isinstance(caught.value, errors.APIError) and caught.value.code == status
    details = caught.value.details["error"]
    names = {400: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL"}
    names[503] = "UNAVAILABLE"
    assert details["status"] == names[status]
    assert details["details"] == [
        {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "7s"}
    ]


async def test_an_in_band_error_ends_the_sdk_stream(server: FakeGeminiServer) -> None:
    client = gemini(server)
    error = {"code": 503, "message": "overloaded", "status": "UNAVAILABLE"}
    server.script(FakeResponse(text="a b c", in_band_error=error, error_after=2))
    seen = []
    with pytest.raises(errors.ServerError):
        async for chunk in await client.aio.models.generate_content_stream(
            model="m", contents="hi"
        ):
            seen.append(chunk.text)
    assert seen == ["a ", "b "]


async def test_keys_and_unknown_fields_are_checked() -> None:
    async with FakeGeminiServer(api_keys={"good"}) as server:
        options = types.HttpOptions(base_url=server.origin, retry_options=NO_RETRIES)
        bad = genai.Client(api_key="bad", http_options=options)
        with pytest.raises(errors.ClientError) as refused:
            await bad.aio.models.generate_content(model="m", contents="hi")
        assert refused.value.code == 400
        assert refused.value.details["error"]["details"][0]["reason"] == "API_KEY_INVALID"
        good = genai.Client(api_key="good", http_options=options)
        with pytest.raises(errors.ClientError) as unknown:
            await good.aio.models.generate_content(
                model="m",
                contents="hi",
                config=types.GenerateContentConfig(http_options={"extra_body": {"nope": 1}}),
            )
        assert unknown.value.code == 400 and "nope" in str(unknown.value.message)


# -- Anthropic's models on Vertex AI ----------------------------------------------------------


async def test_anthropic_vertex_sdk_is_answered(server: FakeGeminiServer, streaming: bool) -> None:
    sdk = anthropic.AsyncAnthropicVertex(
        project_id="fake-project",
        region="us-east5",
        access_token="fake-token",
        base_url=f"{server.vertex_base_url}/v1",
        max_retries=0,
        _strict_response_validation=True,
    )
    server.script(FakeResponse(text="from claude", usage=(3, 2)), path=RAW_PREDICT)
    messages: Any = [{"role": "user", "content": "hi"}]
    if streaming:
        async with sdk.messages.stream(
            model="claude-test@1", max_tokens=16, messages=messages
        ) as stream:
            message = await stream.get_final_message()
    else:
        message = await sdk.messages.create(model="claude-test@1", max_tokens=16, messages=messages)
    assert [block.text for block in message.content if block.type == "text"] == ["from claude"]
    assert message.model == "claude-test@1"
    assert server.count(RAW_PREDICT) == 1 and server.count() == 0
    method = "streamRawPredict" if streaming else "rawPredict"
    assert server.requests[0].path.endswith(f"/publishers/anthropic/models/claude-test@1:{method}")
    await sdk.close()


# -- the token endpoint -----------------------------------------------------------------------


async def test_google_auth_gets_tokens_and_sees_refusals() -> None:
    async with FakeGoogleTokenServer(expires_in=1200) as tokens:
        info = tokens.service_account_info()
        credentials = service_account.Credentials.from_service_account_info(
            info, scopes=["https://www.googleapis.com/auth/cloud-platform"]
        )
        request = google.auth.transport.requests.Request()
        credentials.refresh(request)
        assert credentials.token in tokens and tokens.issued == [credentials.token]
        assert credentials.expiry is not None
        tokens.refusing = "invalid_grant"
        with pytest.raises(RefreshError) as refused:
            credentials.refresh(request)
        assert refused.value.args[1]["error"] == "invalid_grant"
        tokens.refusing = None
        # A key this server did not make is refused too.
        stranger = {**info, "private_key_id": "unknown"}
        other = service_account.Credentials.from_service_account_info(
            stranger, scopes=["https://www.googleapis.com/auth/cloud-platform"]
        )
        with pytest.raises(RefreshError):
            other.refresh(request)
        assert tokens.requests == 3 and len(tokens.issued) == 1
