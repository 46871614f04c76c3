"""The boundary every wire API keeps, written once and run over each (`tests.wire.apis`),
in both call shapes, over real HTTP against the kit's fakes: a failure before any output
fails over, one after output does not (the caller has the partial output, then the error);
a tool call goes out and its result comes back; reasoning comes back to the API that made
it unchanged; usage is read with its cache and reasoning parts."""

from __future__ import annotations

import pytest

from middleware.routing import OrderedFailoverChatClient, Route
from pipeline.errors import TransientProviderError
from pipeline.testing import FakeResponse, collect
from pipeline.testing._fake_server import FakeServer
from pipeline.types import (
    ChatMessage,
    ChatOptions,
    FunctionCallContent,
    FunctionResultContent,
    FunctionTool,
    ReasoningContent,
    ToolChoice,
)
from tests.wire.apis import SCHEMA, WireApi, carries, sent

QUESTION = "What is the weather in Paris?"
WEATHER = FunctionTool("get_weather", "The weather in a city.", SCHEMA)
CALL = FakeResponse(text="", tool_calls=[("get_weather", '{"city": "Paris"}')])


def router(api: WireApi, upstream: FakeServer, backup: FakeServer) -> OrderedFailoverChatClient:
    return OrderedFailoverChatClient(
        [
            Route("primary", api.client(upstream, "primary")),
            Route("backup", api.client(backup, "backup")),
        ]
    )


async def test_an_error_before_output_fails_over(
    api: WireApi, upstream: FakeServer, backup: FakeServer, streaming: bool
) -> None:
    upstream.script(FakeResponse.error(503, message="CANARY-overloaded"), path=api.path)
    backup.script(FakeResponse(text="from the backup"), path=api.path)
    async with router(api, upstream, backup) as chat:
        result = await collect(chat, "hi", streaming=streaming)
    assert result.error is None and result.text == "from the backup"
    assert (len(upstream.requests), len(backup.requests)) == (1, 1)


async def test_a_stream_cut_before_its_first_text_fails_over(
    api: WireApi, upstream: FakeServer, backup: FakeServer
) -> None:
    upstream.script(FakeResponse(text="a b c", disconnect_after=api.quiet_events), path=api.path)
    backup.script(FakeResponse(text="from the backup"), path=api.path)
    async with router(api, upstream, backup) as chat:
        result = await collect(chat, "hi", streaming=True)
    assert result.error is None and result.text == "from the backup"
    assert (len(upstream.requests), len(backup.requests)) == (1, 1)


async def test_a_failure_after_output_is_the_callers(
    api: WireApi, upstream: FakeServer, backup: FakeServer
) -> None:
    # Only a stream has output before its end: a whole answer arrives complete or not at all
    # (the test above holds the not-at-all case for both shapes).
    upstream.script(
        FakeResponse(text="a b c d", disconnect_after=api.quiet_events + 2), path=api.path
    )
    async with router(api, upstream, backup) as chat:
        result = await collect(chat, "hi", streaming=True)
    assert isinstance(result.error, TransientProviderError)
    assert [update.text for update in result.updates if update.text] == ["a ", "b "]
    assert (len(upstream.requests), len(backup.requests)) == (1, 0)


async def test_a_tool_call_goes_out_and_its_result_comes_back(
    api: WireApi, upstream: FakeServer, streaming: bool
) -> None:
    upstream.script(CALL, FakeResponse(text="Sunny."), path=api.path)
    options = ChatOptions(tools=[WEATHER], tool_mode=ToolChoice.named("get_weather"))
    async with api.client(upstream, "route") as chat:
        first = await collect(chat, QUESTION, options, streaming=streaming)
        assert first.response is not None and first.error is None
        assert first.response.finish_reason == "tool_calls"
        (message,) = first.response.messages
        (call,) = [c for c in message.contents if isinstance(c, FunctionCallContent)]
        assert (call.name, dict(call.arguments)) == ("get_weather", {"city": "Paris"})
        assert api.choice(sent(upstream)) == api.named("get_weather")
        assert carries(sent(upstream), '"get_weather"', '"The weather in a city."')
        result = ChatMessage.tool(FunctionResultContent(call.call_id, "CANARY-sunny"))
        turn = [ChatMessage.user(QUESTION), message, result]
        second = await collect(chat, turn, options, streaming=streaming)
    assert second.error is None and second.text == "Sunny."
    assert carries(sent(upstream), call.call_id, "Paris", "CANARY-sunny")


async def test_reasoning_comes_back_unchanged(
    api: WireApi, upstream: FakeServer, streaming: bool
) -> None:
    thinking = "CANARY-thinking about Paris"
    upstream.script(
        FakeResponse(text="", tool_calls=CALL.tool_calls, reasoning=thinking, thinking=thinking),
        FakeResponse(text="Sunny."),
        path=api.path,
    )
    options = ChatOptions(tools=[WEATHER], reasoning=api.reasoning)
    async with api.client(upstream, "route") as chat:
        first = await collect(chat, QUESTION, options, streaming=streaming)
        assert first.response is not None and first.error is None
        (message,) = first.response.messages
        reasoning = [c for c in message.contents if isinstance(c, ReasoningContent)]
        (call,) = [c for c in message.contents if isinstance(c, FunctionCallContent)]
        assert thinking in "".join(r.text for r in reasoning)
        proofs = [r.protected for r in reasoning if r.protected is not None]
        assert bool(proofs) is api.reasoning_returns
        result = ChatMessage.tool(FunctionResultContent(call.call_id, "sunny"))
        second = await collect(
            chat, [ChatMessage.user(QUESTION), message, result], options, streaming=streaming
        )
    # The fake refuses reasoning it did not issue, or a tool turn that lost its thinking.
    assert second.error is None and second.text == "Sunny."
    if api.reasoning_returns:
        assert carries(sent(upstream), *proofs)
    else:
        assert not carries(sent(upstream), thinking)


@pytest.mark.parametrize(
    "script",
    [
        FakeResponse(usage=(11, 7)),
        FakeResponse(usage=(40, 9), cache_usage=(12, 20), reasoning_tokens=3),
    ],
    ids=["plain", "cache-and-reasoning"],
)
async def test_usage_is_read_with_its_parts(
    api: WireApi, upstream: FakeServer, streaming: bool, script: FakeResponse
) -> None:
    upstream.script(script, path=api.path)
    async with api.client(upstream, "route") as chat:
        result = await collect(chat, "hi", streaming=streaming)
    assert result.response is not None and result.error is None
    assert result.response.usage == api.usage(script)
