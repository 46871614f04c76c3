import pytest

from pipeline.sync import SyncChatClient
from pipeline.testing import ScriptedChatClient, reply


def test_sync_facade_answers_and_streams() -> None:
    inner = ScriptedChatClient(reply("abc", chunks=["a", "b", "c"]))
    with SyncChatClient(inner) as chat:
        assert chat.get_response("hi").text == "abc"
        assert [u.text for u in chat.stream("hi")] == ["a", "b", "c"]
        stream = chat.stream("hi")
        assert next(stream).text == "a"
        stream.close()
    assert inner.streams_abandoned == 1
    assert inner.close_count == 1


async def test_sync_facade_refuses_a_running_loop() -> None:
    chat = SyncChatClient(ScriptedChatClient())
    with pytest.raises(RuntimeError, match="running event loop"):
        chat.get_response("hi")
