"""Reasoning, custom (free-form) tools and the reasoning/prompt-cache usage counts through
the OpenAI providers, against FakeOpenAIServer over real HTTP, in both call shapes: the
Responses provider both ways (encrypted reasoning back on the next turn), the Chat
Completions provider in (``reasoning_content``, ``cached_tokens``) and custom tools as
functions of one ``input``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from middleware.telemetry import TelemetryChatClient
from pipeline import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    CustomTool,
    FunctionCallContent,
    FunctionResultContent,
    ReasoningContent,
    ReasoningOptions,
)
from pipeline.errors import ProviderError
from pipeline.providers import OpenAIChatClient, OpenAIResponsesChatClient
from pipeline.testing import RESPONSES_PATH, FakeOpenAIServer, FakeResponse, collect
from tests.otel import Otel

pytestmark = pytest.mark.usefixtures("transport")

THINKING = "CANARY-thinking: the user wants the weather"
SCRIPT = 'await tools.exec_command({cmd: "ls"})'
REASONING = ChatOptions(reasoning=ReasoningOptions(effort="high", summary="auto"))


@pytest.fixture
async def responses(server: FakeOpenAIServer) -> AsyncIterator[OpenAIResponsesChatClient]:
    chat = OpenAIResponsesChatClient("gpt-test", api_key="sk-test", base_url=server.base_url)
    yield chat
    await chat.aclose()


def reasoning_of(response: ChatResponse) -> list[ReasoningContent]:
    return [c for m in response.messages for c in m.contents if isinstance(c, ReasoningContent)]


def answer(collected: object) -> ChatResponse:
    response = getattr(collected, "response", None)
    assert response is not None, getattr(collected, "error", None)
    return response


async def test_responses_reasoning_round_trips_encrypted(
    server: FakeOpenAIServer, responses: OpenAIResponsesChatClient, streaming: bool
) -> None:
    server.script(
        FakeResponse(
            text="",
            reasoning=THINKING,
            reasoning_tokens=4,
            cache_usage=(0, 6),
            tool_calls=[("get_weather", '{"city": "Paris"}')],
        ),
        FakeResponse(text="Sunny."),
        path=RESPONSES_PATH,
    )
    first = answer(await collect(responses, "weather?", REASONING, streaming=streaming))
    sent = server.requests[0].json
    assert sent["include"] == ["reasoning.encrypted_content"]
    assert sent["reasoning"] == {"effort": "high", "summary": "auto"}
    (reasoning,) = reasoning_of(first)
    assert reasoning.text == THINKING
    assert reasoning.protected in server.issued_reasoning
    assert reasoning.id == "rs_fake_1"
    assert first.usage is not None
    assert (first.usage.reasoning_tokens, first.usage.cache_read_tokens) == (4, 6)
    (call,) = [c for c in first.messages[0].contents if isinstance(c, FunctionCallContent)]
    turn = [
        ChatMessage.user("weather?"),
        first.messages[0],
        ChatMessage.tool(FunctionResultContent(call.call_id, "sunny")),
    ]
    second = answer(await collect(responses, turn, REASONING, streaming=streaming))
    assert second.text == "Sunny."
    assert server.returned_reasoning == 1
    kinds = [item.get("type", "message") for item in server.requests[1].json["input"]]
    assert kinds == ["message", "reasoning", "function_call", "function_call_output"]


async def test_responses_refuses_encrypted_reasoning_it_did_not_issue(
    server: FakeOpenAIServer, responses: OpenAIResponsesChatClient, streaming: bool
) -> None:
    forged = ChatMessage.assistant(
        [ReasoningContent("x", protected="gAAAAB-forged", id="rs_1"), "Hi."]
    )
    result = await collect(
        responses, [ChatMessage.user("a"), forged, ChatMessage.user("b")], streaming=streaming
    )
    assert isinstance(result.error, ProviderError)
    assert result.error.status_code == 400
    assert "gAAAAB-forged" not in str(result.error)


async def test_reasoning_of_another_api_is_not_sent_to_a_responses_route(
    server: FakeOpenAIServer, responses: OpenAIResponsesChatClient, streaming: bool
) -> None:
    """An Anthropic thinking block (a signature, no item id) or Chat Completions reasoning
    text cannot be verified by this API: the turn goes without it."""
    server.script(FakeResponse(text="ok"), path=RESPONSES_PATH)
    turn = ChatMessage.assistant(
        [ReasoningContent("thought", protected="anthropic-signature"), ReasoningContent("t")]
    )
    result = await collect(
        responses, [ChatMessage.user("a"), turn, ChatMessage.user("b")], streaming=streaming
    )
    assert answer(result).text == "ok"
    sent = server.requests[0].json
    assert [item.get("type", "message") for item in sent["input"]] == ["message", "message"]
    assert "include" not in sent


async def test_responses_custom_tools_both_ways(
    server: FakeOpenAIServer, responses: OpenAIResponsesChatClient, streaming: bool
) -> None:
    tool = CustomTool("exec", "Run JavaScript.", {"type": "text"})
    server.script(
        FakeResponse(text="", custom_tool_calls=[("exec", SCRIPT)]),
        FakeResponse(text="done"),
        path=RESPONSES_PATH,
    )
    options = ChatOptions(tools=[tool])
    first = answer(await collect(responses, "list files", options, streaming=streaming))
    assert server.requests[0].json["tools"] == [
        {
            "type": "custom",
            "name": "exec",
            "description": "Run JavaScript.",
            "format": {"type": "text"},
        }
    ]
    (call,) = [c for c in first.messages[0].contents if isinstance(c, FunctionCallContent)]
    assert (call.custom, call.name, call.input_text) == (True, "exec", SCRIPT)
    turn = [
        ChatMessage.user("list files"),
        first.messages[0],
        ChatMessage.tool(FunctionResultContent(call.call_id, "a.txt")),
    ]
    assert answer(await collect(responses, turn, options, streaming=streaming)).text == "done"
    items = server.requests[1].json["input"]
    assert items[1] == {
        "type": "custom_tool_call",
        "call_id": call.call_id,
        "name": "exec",
        "input": SCRIPT,
    }
    assert items[2]["type"] == "custom_tool_call_output"


async def test_chat_completions_reasoning_usage_and_custom_tools(
    server: FakeOpenAIServer, client: OpenAIChatClient, streaming: bool
) -> None:
    server.script(
        FakeResponse(
            text="Listing.",
            reasoning=THINKING,
            reasoning_tokens=5,
            cache_usage=(0, 3),
            custom_tool_calls=[("exec", SCRIPT)],
        ),
        FakeResponse(text="done"),
    )
    options = ChatOptions(tools=[CustomTool("exec")], reasoning=ReasoningOptions(effort="low"))
    first = answer(await collect(client, "list files", options, streaming=streaming))
    sent = server.requests[0].json
    (tool,) = sent["tools"]
    assert tool["function"]["name"] == "exec"
    assert tool["function"]["parameters"]["required"] == ["input"]
    assert sent["reasoning_effort"] == "low"
    contents = first.messages[0].contents
    assert [type(c).__name__ for c in contents] == [
        "ReasoningContent",
        "TextContent",
        "FunctionCallContent",
    ]
    assert contents[0].text == THINKING  # type: ignore[union-attr]
    call = contents[2]
    assert isinstance(call, FunctionCallContent)
    assert (call.custom, call.input_text) == (True, SCRIPT)
    assert first.usage is not None
    assert (first.usage.reasoning_tokens, first.usage.cache_read_tokens) == (5, 3)
    turn = [
        ChatMessage.user("list files"),
        first.messages[0],
        ChatMessage.tool(FunctionResultContent(call.call_id, "a.txt")),
    ]
    assert answer(await collect(client, turn, options, streaming=streaming)).text == "done"
    replay = server.requests[1].json["messages"][1]
    # Reasoning is not sent back (these servers take none); the custom call goes as the
    # function call it was offered as.
    assert "reasoning_content" not in replay
    assert json.loads(replay["tool_calls"][0]["function"]["arguments"]) == {"input": SCRIPT}


async def test_telemetry_records_reasoning_and_cache_counts_never_the_reasoning(
    server: FakeOpenAIServer, client: OpenAIChatClient, otel: Otel, streaming: bool
) -> None:
    server.script(
        FakeResponse(text="Hi.", reasoning=THINKING, reasoning_tokens=5, cache_usage=(0, 3))
    )
    chat = TelemetryChatClient(client, **otel.providers)
    answer(await collect(chat, "CANARY-prompt", streaming=streaming))
    (span,) = [s for s in otel.finished() if s.name.startswith("chat ")]
    attributes = dict(span.attributes or {})
    assert attributes["gen_ai.usage.reasoning.output_tokens"] == 5
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == 3
    assert "CANARY" not in json.dumps(attributes)
    types = {
        attrs.get("gen_ai.token.type"): value
        for attrs, value in otel.points("gen_ai.client.token.usage")
    }
    assert {"input", "output", "reasoning", "cache_read"} <= set(types)
