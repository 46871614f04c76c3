import asyncio
import contextlib

import pytest

from pipeline import ChatMessage, ChatOptions, FunctionCallContent, UsageDetails
from pipeline.testing import (
    ScriptedChatClient,
    call_tools,
    collect,
    fail,
    fail_after,
    hang,
    reply,
)


async def test_reply_streams_chunks_and_reports_usage(streaming: bool) -> None:
    client = ScriptedChatClient(
        reply("hello", chunks=["he", "llo"], usage=UsageDetails(1, 2, 3)), model_id="m1"
    )
    result = await collect(client, "hi", streaming=streaming)
    assert result.error is None
    assert result.text == "hello"
    assert result.response is not None
    assert result.response.usage == UsageDetails(1, 2, 3)
    assert result.response.finish_reason == "stop"
    assert result.response.model_id == "m1"
    if streaming:
        assert [u.text for u in result.updates] == ["he", "llo"]


async def test_script_plays_in_order_then_repeats_last(streaming: bool) -> None:
    client = ScriptedChatClient([reply("one"), reply("two")])
    texts = [(await collect(client, "x", streaming=streaming)).text for _ in range(3)]
    assert texts == ["one", "two", "two"]
    assert client.call_count == 3


async def test_exhausted_script_raises_when_not_repeating() -> None:
    client = ScriptedChatClient([reply("one")], repeat_last=False)
    await client.get_response("x")
    with pytest.raises(RuntimeError, match="script exhausted"):
        await client.get_response("x")


async def test_fail_before_output(streaming: bool) -> None:
    error = ValueError("boom")
    client = ScriptedChatClient(fail(error))
    result = await collect(client, "x", streaming=streaming)
    assert result.error is error
    assert result.updates == []


async def test_fail_after_chunks(streaming: bool) -> None:
    error = ValueError("boom")
    client = ScriptedChatClient(fail_after(["a", "b"], error))
    result = await collect(client, "x", streaming=streaming)
    assert result.error is error
    assert [u.text for u in result.updates] == (["a", "b"] if streaming else [])


async def test_hang_waits_until_cancelled(streaming: bool) -> None:
    client = ScriptedChatClient(hang())
    task = asyncio.create_task(collect(client, "x", streaming=streaming))
    await client.wait_for_calls(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    if streaming:
        assert client.streams_closed == 1


async def test_failing_on_close_raises_from_aclose() -> None:
    error = OSError("close")
    client = ScriptedChatClient(reply("ab", chunks=["a", "b"]).failing_on_close(error))
    stream = client.get_streaming_response("x")
    await anext(stream)
    with pytest.raises(OSError) as caught:
        await stream.aclose()
    assert caught.value is error
    assert client.streams_abandoned == 1


async def test_tool_calls(streaming: bool) -> None:
    call = FunctionCallContent("c1", "get_weather", {"city": "Oslo"})
    client = ScriptedChatClient(call_tools(call))
    result = await collect(client, "x", streaming=streaming)
    assert result.response is not None
    assert result.response.messages[-1].contents == [call]
    assert result.response.finish_reason == "tool_calls"


async def test_records_messages_and_the_options_object() -> None:
    client = ScriptedChatClient()
    options = ChatOptions(temperature=0.3)
    messages = [ChatMessage.system("s"), ChatMessage.user("u")]
    await client.get_response(messages, options)
    call = client.calls[0]
    assert call.messages == messages and call.messages is not messages
    assert call.options is options
    assert call.options_snapshot == options
    assert call.streaming is False


async def test_callable_step_sees_the_request() -> None:
    client = ScriptedChatClient(lambda messages, options: reply(messages[-1].text.upper()))
    assert (await client.get_response("shout")).text == "SHOUT"


async def test_chunk_delay_uses_injected_sleep(streaming: bool) -> None:
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    client = ScriptedChatClient(
        reply("abc", chunks=["a", "b", "c"], chunk_delay=5.0), sleep=fake_sleep
    )
    await collect(client, "x", streaming=streaming)
    assert slept == [5.0, 5.0]


def test_reply_chunks_must_join_to_text() -> None:
    with pytest.raises(ValueError, match="join"):
        reply("abc", chunks=["a"])
    with pytest.raises(ValueError, match="at least one"):
        ScriptedChatClient([])


async def test_bad_input_is_rejected(streaming: bool) -> None:
    client = ScriptedChatClient()
    with pytest.raises(TypeError):
        if streaming:
            async with contextlib.aclosing(client.get_streaming_response(None)):  # type: ignore[arg-type]
                pass
        else:
            await client.get_response(None)  # type: ignore[arg-type]


def test_the_fake_servers_import_numpy_only_when_embedding() -> None:
    import ast
    import inspect

    import pipeline.testing._fake_anthropic
    import pipeline.testing._fake_server

    for module in (pipeline.testing._fake_server, pipeline.testing._fake_anthropic):
        tree = ast.parse(inspect.getsource(module))
        top_level = [
            alias.name
            for node in tree.body
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        ]
        modules = [
            node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module
        ]
        assert not any(name.startswith("numpy") for name in top_level + modules), module


async def test_fake_server_tells_when_a_client_leaves_a_hanging_response() -> None:
    import json

    import httpx2 as httpx

    from pipeline.testing import FakeOpenAIServer, FakeResponse

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with FakeOpenAIServer() as server, httpx.AsyncClient() as http:
        server.script(FakeResponse(chunks=["a", "b"], hang_after=2), FakeResponse(hang=True))
        async with http.stream("POST", f"{server.base_url}/chat/completions", json=body) as r:
            events: list[str] = []
            async for line in r.aiter_lines():
                if line:
                    events.append(line.removeprefix("data: "))
                if len(events) == 2:
                    break  # the role chunk and "a"; the server now holds the rest
        assert json.loads(events[1])["choices"][0]["delta"] == {"content": "a"}
        await server.wait_for_disconnects(1)
        call = asyncio.create_task(http.post(f"{server.base_url}/chat/completions", json=body))
        await server.wait_for_requests(2)
        assert server.disconnects == 1  # the second client is still there
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        await server.wait_for_disconnects(2)
        assert server.disconnects == 2
