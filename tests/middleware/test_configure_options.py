import pytest

from middleware.configure_options import ConfigureOptionsChatClient
from pipeline import ChatOptions, ChatPipeline
from pipeline.testing import ScriptedChatClient, collect


async def test_applies_values_on_a_clone_never_the_callers_object(streaming: bool) -> None:
    inner = ScriptedChatClient()
    chat = (
        ChatPipeline.builder()
        .configure_options(lambda o: o.with_(reasoning_effort="low"))
        .build(inner)
    )
    caller = ChatOptions(temperature=0.2, additional_properties={"k": [1]})
    await collect(chat, "x", caller, streaming=streaming)
    received = inner.calls[0].options
    assert received is not None and received is not caller
    assert (received.reasoning_effort, received.temperature) == ("low", 0.2)
    assert caller.reasoning_effort is None
    assert caller == ChatOptions(temperature=0.2, additional_properties={"k": [1]})


async def test_in_place_configurer_and_no_options(streaming: bool) -> None:
    inner = ScriptedChatClient()

    def configure(options: ChatOptions) -> None:
        options.additional_properties["seen"] = options.additional_properties.get("seen", 0) + 1

    chat = ChatPipeline.builder().configure_options(configure).build(inner)
    for _ in range(3):
        await collect(chat, "x", streaming=streaming)
    # Nothing carries over between requests: each saw a fresh clone.
    assert [c.options.additional_properties for c in inner.calls] == [{"seen": 1}] * 3  # type: ignore[union-attr]


async def test_returning_a_shared_object_is_cloned(streaming: bool) -> None:
    shared = ChatOptions(model_id="fixed")
    inner = ScriptedChatClient()
    chat = ChatPipeline.builder().configure_options(lambda o: shared).build(inner)
    await collect(chat, "x", streaming=streaming)
    assert inner.calls[0].options == shared and inner.calls[0].options is not shared


async def test_bad_configurer_result(streaming: bool) -> None:
    chat = ChatPipeline.builder().configure_options(lambda o: 3).build(ScriptedChatClient())  # type: ignore[arg-type,return-value]
    result = await collect(chat, "x", streaming=streaming) if not streaming else None
    if streaming:
        with pytest.raises(TypeError, match="return ChatOptions or None, not int"):
            chat.get_streaming_response("x")
    else:
        assert result is not None and isinstance(result.error, TypeError)


def test_configurer_must_be_callable() -> None:
    with pytest.raises(TypeError, match="callable"):
        ConfigureOptionsChatClient(ScriptedChatClient(), 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        ChatPipeline.builder().configure_options(3)  # type: ignore[arg-type]
