"""The Anthropic wire's reasoning, prompt caching and scoped extras (pure functions), and a
tool loop with thinking against the fake Anthropic server, both call shapes."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pipeline import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    FunctionCallContent,
    FunctionResultContent,
    ReasoningContent,
    ReasoningOptions,
    UsageDetails,
)
from pipeline.errors import RequestInvalidError
from pipeline.providers import AnthropicChatClient, OpenAIChatClient
from pipeline.testing import FakeAnthropicServer, FakeOpenAIServer, FakeResponse, collect
from pipeline.types import ANTHROPIC_EXTRAS, FunctionTool
from pipeline.wire.messages.outbound import (
    MessagesStreamReader,
    build_request,
    parse_response,
    parse_usage,
)


def body(messages: Any = "hi", options: ChatOptions | None = None) -> dict[str, Any]:
    if isinstance(messages, str):
        messages = [ChatMessage.user(messages)]
    return build_request(messages, options, model="m", max_tokens=4096, stream=False)


@pytest.mark.parametrize(
    ("reasoning", "thinking", "effort"),
    [
        (ReasoningOptions(budget_tokens=2048), {"type": "enabled", "budget_tokens": 2048}, None),
        (ReasoningOptions(budget_tokens=0), {"type": "disabled"}, None),
        (ReasoningOptions(effort="high"), {"type": "adaptive"}, "high"),
        (ReasoningOptions(effort="xhigh"), {"type": "adaptive"}, "max"),
        (ReasoningOptions(effort="minimal"), {"type": "adaptive"}, "low"),
        (ReasoningOptions(effort="none"), {"type": "disabled"}, None),
        (
            ReasoningOptions(effort="low", budget_tokens=1024),
            {"type": "enabled", "budget_tokens": 1024},
            "low",
        ),
        (ReasoningOptions(effort="medium", budget_tokens=0), {"type": "disabled"}, "medium"),
        (ReasoningOptions(summary="auto"), None, None),
    ],
)
def test_reasoning_options_become_thinking_and_effort(
    reasoning: ReasoningOptions, thinking: Any, effort: str | None
) -> None:
    sent = body(options=ChatOptions(reasoning=reasoning))
    assert sent.get("thinking") == thinking
    assert sent.get("output_config", {}).get("effort") == effort


def test_the_legacy_reasoning_effort_is_an_effort_too() -> None:
    sent = body(options=ChatOptions(reasoning_effort="medium"))
    assert (sent["thinking"], sent["output_config"]) == ({"type": "adaptive"}, {"effort": "medium"})


def test_a_json_schema_response_format_is_the_output_format() -> None:
    schema = {"type": "object"}
    for response_format in (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        {"name": "x", "schema": schema},
    ):
        sent = body(options=ChatOptions(response_format=response_format))
        assert sent["output_config"] == {"format": {"type": "json_schema", "schema": schema}}
    assert "output_config" not in body(options=ChatOptions(response_format="json_object"))


def test_scoped_extras_are_sent_as_given_and_merged_into_what_the_options_made() -> None:
    extras = {
        "thinking": {"type": "enabled", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
        "metadata": {"user_id": "u"},
        "model": "never-this",
    }
    options = ChatOptions(
        reasoning=ReasoningOptions(budget_tokens=2048),
        additional_properties={ANTHROPIC_EXTRAS: extras, "top_k": 3},
    )
    sent = body(options=options)
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 2048, "display": "omitted"}
    assert sent["context_management"] == extras["context_management"]
    assert sent["metadata"] == {"user_id": "u"} and sent["top_k"] == 3
    assert sent["model"] == "m" and ANTHROPIC_EXTRAS not in sent
    # The route's own options turned thinking off: the caller's thinking details and the
    # clear-thinking edit (nothing to clear) are left out.
    options.reasoning = ReasoningOptions(budget_tokens=0)
    sent = body(options=options)
    assert sent["thinking"] == {"type": "disabled"}
    assert "context_management" not in sent
    # Another kind of thinking chosen by the options keeps only how it is shown.
    options.reasoning = ReasoningOptions(effort="high")
    assert body(options=options)["thinking"] == {"type": "adaptive", "display": "omitted"}


def test_other_clear_edits_stay_when_there_is_no_thinking() -> None:
    management = {
        "edits": [{"type": "clear_thinking_20251015"}, {"type": "clear_tool_uses_20250919"}]
    }
    options = ChatOptions(
        additional_properties={ANTHROPIC_EXTRAS: {"context_management": management}}
    )
    assert body(options=options)["context_management"] == {
        "edits": [{"type": "clear_tool_uses_20250919"}]
    }


def _marked(message: ChatMessage) -> ChatMessage:
    message.additional_properties = {"cache_control": {"type": "ephemeral"}}
    return message


def test_cache_breakpoints_go_on_the_messages_last_blocks_and_at_most_four() -> None:
    messages = [
        _marked(ChatMessage.system("one")),
        _marked(ChatMessage.system("two")),
        ChatMessage.user("a"),
        _marked(ChatMessage.user("b")),
        _marked(ChatMessage.assistant("c")),
        _marked(ChatMessage.tool(FunctionResultContent("t", "r"))),
    ]
    sent = body(messages)
    # Five breakpoints: the earliest (the first system block) is left out.
    assert sent["system"] == [
        {"type": "text", "text": "one"},
        {"type": "text", "text": "two", "cache_control": {"type": "ephemeral"}},
    ]
    user, assistant, result = sent["messages"]
    assert user["content"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}},
    ]
    assert assistant["content"][-1]["cache_control"] == {"type": "ephemeral"}
    assert result["content"][-1]["cache_control"] == {"type": "ephemeral"}
    # Without breakpoints the system is one string, as before.
    assert body([ChatMessage.system("s"), ChatMessage.user("u")])["system"] == "s"


def _tool(name: str, cached: bool) -> FunctionTool:
    extra = {"messages": {"cache_control": {"type": "ephemeral"}}} if cached else {}
    return FunctionTool(name, None, {"type": "object"}, extra)


def seven() -> tuple[list[ChatMessage], ChatOptions]:
    """Seven breakpoints: three tools, two system blocks, two messages."""
    messages = [
        _marked(ChatMessage.system("one")),
        _marked(ChatMessage.system("two")),
        ChatMessage.user("a"),
        _marked(ChatMessage.user("b")),
        _marked(ChatMessage.assistant("c")),
    ]
    tools: list[Any] = [_tool("f", True), _tool("g", True), _tool("h", True), _tool("i", False)]
    return messages, ChatOptions(tools=tools)


def breakpoints(sent: dict[str, Any]) -> list[str]:
    found = [f"tools[{i}]" for i, t in enumerate(sent.get("tools") or ()) if "cache_control" in t]
    system = sent.get("system")
    if isinstance(system, list):
        found += [f"system[{i}]" for i, b in enumerate(system) if "cache_control" in b]
    for m, turn in enumerate(sent["messages"]):
        found += [
            f"messages[{m}][{i}]" for i, b in enumerate(turn["content"]) if "cache_control" in b
        ]
    return found


def test_the_breakpoint_cap_counts_tools_system_and_messages_together(
    caplog: pytest.LogCaptureFixture,
) -> None:
    messages, options = seven()
    with caplog.at_level(logging.INFO, logger="chat_pipeline.providers.anthropic"):
        sent = body(messages, options)
    # The last four, in the order the API reads them: tools, system, messages.
    assert breakpoints(sent) == ["system[0]", "system[1]", "messages[0][1]", "messages[1][0]"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "7 cache_control breakpoints, the API takes 4" in line
    assert line.endswith("tools[0] tools[1] tools[2]")
    assert "one" not in line and "two" not in line  # where, never what
    # The caller's tools keep their own breakpoints (only the request's copy lost them).
    assert all(
        "cache_control" in t.additional_properties["messages"] for t in (options.tools or [])[:3]
    )


def test_a_top_level_breakpoint_counts_and_is_kept() -> None:
    messages, options = seven()
    options = options.with_(
        additional_properties={ANTHROPIC_EXTRAS: {"cache_control": {"type": "ephemeral"}}}
    )
    sent = body(messages, options)
    assert sent["cache_control"] == {"type": "ephemeral"}
    assert breakpoints(sent) == ["system[1]", "messages[0][1]", "messages[1][0]"]


async def test_seven_breakpoints_reach_an_anthropic_route_as_four(streaming: bool) -> None:
    messages, options = seven()
    async with FakeAnthropicServer() as server:
        client = AnthropicChatClient("claude-x", api_key="k", base_url=server.base_url)
        result = await collect(client, messages, options, streaming=streaming)
        await client.aclose()
    assert result.error is None, result.error  # the fake refuses more than four, as Anthropic
    assert breakpoints(server.requests[0].json) == [
        "system[0]",
        "system[1]",
        "messages[0][1]",
        "messages[1][0]",
    ]


def test_the_fake_refuses_more_than_four_breakpoints_as_anthropic_does() -> None:
    from pipeline.testing._fake_anthropic import _check_breakpoints

    marked = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
    five = {"messages": [{"role": "user", "content": [marked] * 5}]}
    assert _check_breakpoints(five) == (
        "A maximum of 4 blocks with cache_control may be provided. Found 5."
    )
    four = {"messages": [{"role": "user", "content": [marked] * 3}], "cache_control": {}}
    assert _check_breakpoints(four) is None


def test_reasoning_goes_back_as_thinking_blocks_only_when_it_is_anthropics() -> None:
    assistant = ChatMessage.assistant(
        [
            ReasoningContent("thought", protected="sig"),
            ReasoningContent(protected="opaque", redacted=True),
            ReasoningContent("summary only"),  # no signature: cannot be sent
            ReasoningContent("item", protected="enc", id="rs_1"),  # a Responses item
            FunctionCallContent("t1", "f", {}),
        ]
    )
    sent = body([ChatMessage.user("q"), assistant, ChatMessage.tool(FunctionResultContent("t1"))])
    assert sent["messages"][1]["content"] == [
        {"type": "thinking", "thinking": "thought", "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
    ]


def test_thinking_blocks_and_cache_usage_are_read() -> None:
    response = parse_response(
        {
            "id": "msg_1",
            "model": "m",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "answer"},
            ],
            "stop_reason": "end_turn",
            "usage": {
                "input_tokens": 3,
                "cache_creation_input_tokens": 4,
                "cache_read_input_tokens": 5,
                "output_tokens": 6,
                "output_tokens_details": {"thinking_tokens": 2},
            },
        },
        "anthropic",
    )
    assert response.messages[0].contents == [
        ReasoningContent("hmm", protected="sig"),
        ReasoningContent(protected="opaque", redacted=True),
        *response.messages[0].contents[2:],
    ]
    assert response.text == "answer"
    assert response.usage == UsageDetails(12, 6, 18, 2, 5, 4)
    assert parse_usage({"input_tokens": 1, "output_tokens": 1}) == UsageDetails(1, 1, 2)


def test_streamed_thinking_is_joined_until_its_signature() -> None:
    reader = MessagesStreamReader("anthropic")
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"id": "msg_1", "model": "m", "usage": {}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking"}},
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "one "},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "two"},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "signature_delta", "signature": "sig"},
        },
        {"type": "content_block_stop", "index": 0},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "redacted_thinking", "data": "opaque"},
        },
        {"type": "content_block_stop", "index": 1},
    ]
    updates = [u for u in (reader.feed(e) for e in events) if u is not None]
    assert [type(c).__name__ for u in updates for c in u.contents] == ["ReasoningContent"] * 4
    assembled = ChatResponse.from_updates(updates)
    assert assembled.messages[0].contents == [
        ReasoningContent("one two", protected="sig"),
        ReasoningContent(protected="opaque", redacted=True),
    ]


@pytest.fixture
async def claude() -> AsyncIterator[FakeAnthropicServer]:
    async with FakeAnthropicServer() as server:
        yield server


async def test_a_tool_loop_with_thinking_round_trips_its_signature(
    claude: FakeAnthropicServer, streaming: bool
) -> None:
    claude.script(
        FakeResponse(text="", thinking="Need the tool.", tool_calls=[("f", '{"x": 1}')]),
        FakeResponse(text="Done."),
    )
    client = AnthropicChatClient("claude-test", api_key="k", base_url=claude.base_url)
    options = ChatOptions(reasoning=ReasoningOptions(budget_tokens=1024))
    first = await collect(client, "go", options, streaming=streaming)
    assert first.response is not None
    reasoning, call = first.response.messages[0].contents
    assert reasoning == ReasoningContent(
        "Need the tool.", protected=claude.signature("Need the tool.")
    )
    assert isinstance(call, FunctionCallContent)
    turn = [
        ChatMessage.user("go"),
        *first.response.messages,
        ChatMessage.tool(FunctionResultContent(call.call_id, "1")),
    ]
    second = await collect(client, turn, options, streaming=streaming)
    assert second.error is None and second.text == "Done."
    # Without its thinking, the tool_use turn is refused, as the real API refuses it.
    turn[1] = ChatMessage.assistant([call])
    refused = await collect(client, turn, options, streaming=streaming)
    assert isinstance(refused.error, RequestInvalidError)
    await client.aclose()


@pytest.mark.parametrize("signature", ["forged", "\x80", "签名"])
async def test_a_signature_the_fake_never_made_is_a_400_whatever_its_characters(
    claude: FakeAnthropicServer, signature: str, streaming: bool
) -> None:
    # The real API refuses it; a fake that crashed on non-ASCII answered 500 instead.
    client = AnthropicChatClient("claude-test", api_key="k", base_url=claude.base_url)
    turn = [
        ChatMessage.user("go"),
        ChatMessage.assistant([ReasoningContent("", protected=signature)]),
        ChatMessage.user("again"),
    ]
    refused = await collect(client, turn, streaming=streaming)
    assert isinstance(refused.error, RequestInvalidError)
    assert refused.error.status_code == 400
    await client.aclose()


async def test_scoped_extras_never_reach_an_openai_route(streaming: bool) -> None:
    async with FakeOpenAIServer() as server:
        client = OpenAIChatClient("gpt", api_key="k", base_url=server.base_url)
        options = ChatOptions(
            additional_properties={ANTHROPIC_EXTRAS: {"metadata": {"user_id": "u"}}, "x": 1}
        )
        result = await collect(client, "hi", options, streaming=streaming)
        assert result.error is None
        sent = server.requests[0].json
        assert sent["x"] == 1 and ANTHROPIC_EXTRAS not in sent and "metadata" not in sent
        assert options.additional_properties[ANTHROPIC_EXTRAS]  # the caller's, untouched
        await client.aclose()
