"""The Gemini wire (`pipeline.wire.gemini`) as pure functions: one answer read whole and as
a stream gives the same contents, usage, reasoning and signatures each way, the vocabulary's
inverses; and a Gemini route as a route like the others (hedged, behind a breaker and the
cache, with telemetry naming its provider and model)."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from pipeline import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    DataContent,
    FunctionCallContent,
    FunctionResultContent,
    ReasoningContent,
    TextContent,
    UsageDetails,
)
from pipeline.config import parse_config
from pipeline.providers import OpenAIChatClient
from pipeline.testing import FakeGeminiServer, FakeOpenAIServer, FakeResponse, collect
from pipeline.types import GEMINI_EXTRAS, ChatRole
from pipeline.wire.gemini import vocab
from pipeline.wire.gemini.outbound import (
    GeminiStreamReader,
    build_request,
    parse_response,
    parse_usage,
)
from tests.otel import Otel

PIXEL = base64.b64encode(b"\x89PNG").decode()
PARTS: list[dict[str, Any]] = [
    {"text": "Thinking it over.", "thought": True},
    {"text": "Here is "},
    {"text": "a picture."},
    {"inlineData": {"mimeType": "image/png", "data": PIXEL}, "thoughtSignature": "c2lnLWE="},
    {"functionCall": {"name": "f", "args": {"x": 1}}, "thoughtSignature": "c2lnLWI="},
    {"executableCode": {"language": "PYTHON", "code": "print(1)"}},  # skipped: no meaning here
    {"text": "", "thoughtSignature": "c2lnLWM="},  # on text: not kept
]
USAGE = {
    "promptTokenCount": 10,
    "toolUsePromptTokenCount": 2,
    "candidatesTokenCount": 5,
    "thoughtsTokenCount": 3,
    "cachedContentTokenCount": 4,
    "totalTokenCount": 20,
}


def answer(parts: list[dict[str, Any]], reason: str = "STOP") -> dict[str, Any]:
    candidate = {"content": {"role": "model", "parts": parts}, "finishReason": reason}
    return {"candidates": [candidate], "usageMetadata": USAGE, "modelVersion": "g",
            "responseId": "r"}  # fmt: skip


def streamed(parts: list[dict[str, Any]]) -> ChatResponse:
    reader = GeminiStreamReader("gcp.gemini")
    chunks = [{"candidates": [{"content": {"role": "model", "parts": [p]}}]} for p in parts]
    chunks.append(answer([{"text": ""}]))
    updates = [u for u in map(reader.feed, chunks) if u is not None]
    tail = reader.finish()
    return ChatResponse.from_updates([*updates, *([tail] if tail else [])])


def contents(response: ChatResponse) -> list[Any]:
    return [
        FunctionCallContent("id", c.name, c.arguments) if isinstance(c, FunctionCallContent) else c
        for c in response.messages[0].contents
    ]


def test_an_answer_read_whole_and_streamed_gives_the_same_contents() -> None:
    whole = parse_response(answer(PARTS), "gcp.gemini")
    stream = streamed(PARTS)
    expected = [
        ReasoningContent("Thinking it over."),
        TextContent("Here is a picture."),
        ReasoningContent(protected="c2lnLWE="),
        DataContent(data=b"\x89PNG", media_type="image/png"),
        ReasoningContent(protected="c2lnLWI="),
        FunctionCallContent("id", "f", {"x": 1}),
    ]
    assert contents(whole) == contents(stream) == expected
    usage = UsageDetails(12, 8, 20, reasoning_tokens=3, cache_read_tokens=4)
    assert whole.usage == stream.usage == usage
    assert whole.finish_reason == stream.finish_reason == "tool_calls"
    assert (
        (whole.response_id, whole.model_id) == (stream.response_id, stream.model_id) == ("r", "g")
    )


def test_signatures_go_back_on_the_next_part_of_their_turn() -> None:
    response = parse_response(answer(PARTS), "gcp.gemini")
    call = next(c for c in response.messages[0].contents if isinstance(c, FunctionCallContent))
    turn = [
        ChatMessage.user("go"),
        *response.messages,
        ChatMessage.tool(FunctionResultContent(call.call_id, "1")),
    ]
    body = build_request(turn, None)
    sent = body["contents"][1]["parts"]
    assert sent == [
        {"text": "Thinking it over.", "thought": True},
        {"text": "Here is a picture."},
        {"inlineData": {"mimeType": "image/png", "data": PIXEL}, "thoughtSignature": "c2lnLWE="},
        {"functionCall": {"id": call.call_id, "name": "f", "args": {"x": 1}},
         "thoughtSignature": "c2lnLWI="},
    ]  # fmt: skip
    # A signature with nothing after it in its turn goes on an empty text part; another
    # API's redacted reasoning is left out.
    redacted = ReasoningContent("x", protected="d", redacted=True)
    alone = ChatMessage.assistant([TextContent("hi"), ReasoningContent(protected="c2ln"), redacted])
    parts = build_request([ChatMessage.user("q"), alone], None)["contents"][1]["parts"]
    assert parts == [{"text": "hi"}, {"text": "", "thoughtSignature": "c2ln"}]


def test_a_blocked_prompt_and_a_filtered_answer() -> None:
    from pipeline.errors import ContentFilteredError

    with pytest.raises(ContentFilteredError) as blocked:
        parse_response({"promptFeedback": {"blockReason": "PROHIBITED_CONTENT"}}, "gcp.gemini")
    assert blocked.value.code == "PROHIBITED_CONTENT"
    filtered = parse_response({"candidates": [{"finishReason": "SAFETY"}]}, "gcp.gemini")
    assert filtered.finish_reason == "content_filter" and filtered.text == ""
    assert filtered.messages == [ChatMessage(ChatRole.ASSISTANT, [])]


def test_usage_without_some_counts() -> None:
    assert parse_usage({"promptTokenCount": 3}) == UsageDetails(3, None, None)
    assert parse_usage({"promptTokenCount": 3, "candidatesTokenCount": 2}) == UsageDetails(3, 2, 5)
    assert parse_usage("x") is None


def test_the_vocabulary_is_written_once_with_its_inverses() -> None:
    assert {vocab.ROLE_OF[w]: w for w in vocab.ROLE_OF} == vocab.ROLES
    assert {vocab.TOOL_CHOICE_VALUES[c]: c for c in vocab.TOOL_CHOICE_VALUES} == vocab.TOOL_CHOICES
    assert {vocab.EFFORT_OF[w]: w for w in vocab.EFFORT_OF} == vocab.THINKING_LEVELS
    assert all(vocab.FINISH_REASONS[r] == "content_filter" for r in vocab.FILTERED_REASONS)


async def test_gemini_extras_never_reach_another_route(streaming: bool) -> None:
    async with FakeOpenAIServer() as server:
        client = OpenAIChatClient("gpt", api_key="k", base_url=server.base_url)
        options = ChatOptions(additional_properties={GEMINI_EXTRAS: {"safetySettings": []}})
        result = await collect(client, "hi", options, streaming=streaming)
        assert result.error is None
        assert GEMINI_EXTRAS not in server.requests[0].json
        await client.aclose()


async def test_a_gemini_route_is_a_route_like_the_others(
    otel: Otel, monkeypatch: pytest.MonkeyPatch, streaming: bool
) -> None:
    """Hedged between two Gemini deployments, each behind a breaker, the cache in front,
    telemetry on: the slow first one is hedged, the answer is cached, and every attempt's
    span names the provider (``gcp.gemini``) and the model."""
    monkeypatch.setenv("GEMINI_TEST_KEY", "k")
    async with FakeGeminiServer() as slow, FakeGeminiServer() as fast:
        slow.script(FakeResponse(text="late", hang=True))
        fast.script(FakeResponse(text="from the hedge", usage=(3, 2)))

        def route(server: FakeGeminiServer) -> dict[str, Any]:
            return {
                "provider": "gemini",
                "model": "gemini-test",
                "base_url": server.base_url,
                "api_key_env": "GEMINI_TEST_KEY",
                "breaker": {"fail_max": 3},
            }

        config = parse_config(
            {
                "routes": {"slow": route(slow), "fast": route(fast)},
                "router": {
                    "kind": "hedged",
                    "routes": ["slow", "fast"],
                    "strategy": "round_robin",  # the slow one first
                    "delay": 0.05,
                },
                "cache": {},
                "layers": {"telemetry": True},
            }
        )
        pipeline = config.build(**otel.providers)
        first = await collect(pipeline, "hi", streaming=streaming)
        again = await collect(pipeline, "hi", streaming=streaming)
        await pipeline.aclose()
    assert first.error is None and first.text == "from the hedge"
    assert again.error is None and again.text == "from the hedge"
    assert (slow.count(), fast.count()) == (1, 1)  # the second answer came from the cache
    attempts = otel.attempt_spans()
    # The provider's name under the key the telemetry layer writes it (`gen_ai.system` by
    # default, `gen_ai.provider.name` when asked).
    assert {a.attributes["gen_ai.system"] for a in attempts} == {"gcp.gemini"}  # type: ignore[index]
    assert {a.attributes["gen_ai.request.model"] for a in attempts} == {"gemini-test"}  # type: ignore[index]
