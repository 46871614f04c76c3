import contextlib

import pytest

from middleware.configure_options import ConfigureOptionsChatClient
from pipeline import ChatClient, ChatOptions, ChatPipeline, DelegatingChatClient
from pipeline.testing import ScriptedChatClient, collect, reply


class Tag(DelegatingChatClient):
    """Appends its tag to the options' stop list, so tests can see layer order."""

    def __init__(self, inner: ChatClient, tag: str) -> None:
        super().__init__(inner)
        self.tag = tag

    def _options(self, options: ChatOptions | None) -> ChatOptions:
        options = options.clone() if options else ChatOptions()
        options.stop = [*(options.stop or []), self.tag]
        return options

    async def get_response(self, messages, options=None):  # type: ignore[no-untyped-def]
        return await self.inner.get_response(messages, self._options(options))

    def get_streaming_response(self, messages, options=None):  # type: ignore[no-untyped-def]
        return self.inner.get_streaming_response(messages, self._options(options))

    def describe_layer(self) -> str:
        return f"Tag({self.tag})"


async def test_first_use_is_outermost(streaming: bool) -> None:
    inner = ScriptedChatClient()
    chat = (
        ChatPipeline.builder()
        .use(lambda c: Tag(c, "outer"))
        .use(lambda c: Tag(c, "inner"))
        .build(inner)
    )
    await collect(chat, "hi", streaming=streaming)
    assert inner.calls[0].options is not None
    assert inner.calls[0].options.stop == ["outer", "inner"]
    assert chat.describe() == ["Tag(outer)", "Tag(inner)", "ScriptedChatClient(scripted)"]


def test_disabled_layers_are_absent() -> None:
    chat = (
        ChatPipeline.builder()
        .use(lambda c: Tag(c, "a"), enabled=False)
        .configure_options(lambda o: None, enabled=False)
        .use_logging(enabled=False)
        .configure_options(lambda o: None)
        .build(ScriptedChatClient())
    )
    assert chat.describe() == ["ConfigureOptionsChatClient", "ScriptedChatClient(scripted)"]


def test_build_validates_its_inputs() -> None:
    with pytest.raises(ValueError, match="needs an inner client"):
        ChatPipeline.builder().build()
    with pytest.raises(TypeError, match="inner must be a ChatClient"):
        ChatPipeline.builder().build(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        ChatPipeline.builder().use("nope")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="result of a layer factory"):
        ChatPipeline.builder().use(lambda c: 42).build(ScriptedChatClient())  # type: ignore[arg-type,return-value]


def test_router_ends_the_chain() -> None:
    route = ScriptedChatClient(name="only")
    builder = ChatPipeline.builder().use_logging().use_ordered_failover([route])
    with pytest.raises(ValueError, match="add layers before the router"):
        builder.use_logging()
    with pytest.raises(ValueError, match="already ends in a router"):
        builder.use_ordered_failover([route])
    with pytest.raises(ValueError, match="takes no inner client"):
        builder.build(ScriptedChatClient())
    chat = builder.build(name="named")
    assert chat.describe() == ["LoggingChatClient", "OrderedFailoverChatClient(only)"]
    assert chat.metadata.name == "named"


def test_disabled_router_needs_an_inner_client() -> None:
    builder = ChatPipeline.builder().use_ordered_failover([ScriptedChatClient()], enabled=False)
    with pytest.raises(ValueError, match="needs an inner client"):
        builder.build()


@pytest.mark.parametrize(
    ("messages", "error"),
    [(None, TypeError), (42, TypeError), ([], ValueError), ([object()], TypeError)],
)
async def test_pipeline_rejects_bad_messages_before_any_layer(
    streaming: bool, messages: object, error: type[Exception]
) -> None:
    inner = ScriptedChatClient()
    chat = ChatPipeline.builder().build(inner)
    with pytest.raises(error):
        if streaming:
            chat.get_streaming_response(messages)  # type: ignore[arg-type]
        else:
            await chat.get_response(messages)  # type: ignore[arg-type]
    assert inner.call_count == 0


async def test_pipeline_rejects_bad_options(streaming: bool) -> None:
    chat = ChatPipeline.builder().build(ScriptedChatClient())
    with pytest.raises(TypeError, match="ChatOptions or None, not dict"):
        if streaming:
            chat.get_streaming_response("x", {})  # type: ignore[arg-type]
        else:
            await chat.get_response("x", {})  # type: ignore[arg-type]


async def test_closing_pipeline_closes_every_layer_once() -> None:
    inner = ScriptedChatClient()
    async with (
        ChatPipeline.builder().use_logging().configure_options(lambda o: None).build(inner) as chat
    ):
        await chat.get_response("x")
    await chat.aclose()
    assert inner.close_count == 1


async def test_closing_the_pipeline_stream_closes_the_innermost_stream() -> None:
    inner = ScriptedChatClient(reply("abc", chunks=["a", "b", "c"]))
    chat = ChatPipeline.builder().use_logging().configure_options(lambda o: None).build(inner)
    async with contextlib.aclosing(chat.get_streaming_response("x")) as stream:
        assert (await anext(stream)).text == "a"
    assert inner.streams_abandoned == 1


def test_builder_methods_for_layers_exist() -> None:
    builder = ChatPipeline.builder()
    for name in (
        "use",
        "configure_options",
        "use_logging",
        "use_router",
        "use_failover",
        "use_ordered_failover",
    ):
        assert callable(getattr(builder, name))
    assert isinstance(ConfigureOptionsChatClient(ScriptedChatClient(), lambda o: o), ChatClient)
