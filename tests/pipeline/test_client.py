import contextlib

import pytest

from pipeline import ChatClient, ChatOptions, DelegatingChatClient
from pipeline.client import check_options, client_name, ensure_chat_client
from pipeline.testing import ScriptedChatClient, collect, reply


def test_scripted_client_satisfies_the_protocol() -> None:
    assert isinstance(ScriptedChatClient(), ChatClient)
    with pytest.raises(TypeError, match="inner must be a ChatClient"):
        DelegatingChatClient(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not str"):
        ensure_chat_client("nope")


def test_check_options() -> None:
    options = ChatOptions()
    assert check_options(options) is options
    assert check_options(None) is None
    with pytest.raises(TypeError, match="ChatOptions or None, not dict"):
        check_options({})


def test_client_name_prefers_metadata_name() -> None:
    assert client_name(ScriptedChatClient(name="a")) == "a"
    assert client_name(ScriptedChatClient(name=None, model_id="m")) == "scripted/m"


async def test_delegating_client_forwards(streaming: bool) -> None:
    inner = ScriptedChatClient(reply("ab", chunks=["a", "b"]))
    layer = DelegatingChatClient(inner)
    options = ChatOptions(model_id="x")
    result = await collect(layer, "hi", options, streaming=streaming)
    assert result.text == "ab"
    assert inner.calls[0].options is options
    assert layer.metadata is inner.metadata


async def test_delegating_close_closes_inner_once_unless_left_open() -> None:
    inner = ScriptedChatClient()
    layer = DelegatingChatClient(inner)
    await layer.aclose()
    await layer.aclose()
    assert inner.close_count == 1
    kept = ScriptedChatClient()
    async with DelegatingChatClient(kept, leave_open=True):
        pass
    assert kept.close_count == 0


async def test_closing_outer_stream_closes_inner_stream() -> None:
    inner = ScriptedChatClient(reply("abc", chunks=["a", "b", "c"]))
    layer = DelegatingChatClient(DelegatingChatClient(inner))
    async with contextlib.aclosing(layer.get_streaming_response("hi")) as stream:
        first = await anext(stream)
        assert first.text == "a"
    assert inner.streams_abandoned == 1
    assert inner.streams_closed == 1
