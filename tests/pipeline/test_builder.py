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


class Closable(ScriptedChatClient):
    """A scripted client that, like an HTTP client, refuses calls once closed."""

    def _record(self, messages, options, streaming):  # type: ignore[no-untyped-def]
        if self.close_count:
            raise RuntimeError("client is closed")
        return super()._record(messages, options, streaming)


async def test_two_builds_share_no_router_and_close_shared_routes_last(streaming: bool) -> None:
    from middleware.routing import Route

    primary, backup = Closable(name="primary"), Closable(name="backup")
    builder = ChatPipeline.builder().use_ordered_failover(
        [Route("primary", primary), Route("backup", backup)]
    )
    first, second = builder.build(), builder.build()
    assert first.client is not second.client
    await first.aclose()
    assert (primary.close_count, backup.close_count) == (0, 0)
    assert (await collect(second, "hi", streaming=streaming)).text == "ok"
    await second.aclose()
    assert (primary.close_count, backup.close_count) == (1, 1)


async def test_each_build_has_its_own_breaker_and_tool_store() -> None:
    from middleware.breaker import CircuitBreakerChatClient
    from middleware.function_invocation import FunctionInvokingChatClient

    builder = ChatPipeline.builder().use_function_invocation().use_circuit_breaker(fail_max=1)
    first, second = builder.build(ScriptedChatClient()), builder.build(ScriptedChatClient())
    layers = [p.client for p in (first, second)]
    assert all(isinstance(layer, FunctionInvokingChatClient) for layer in layers)
    tools_first, tools_second = layers  # type: ignore[misc]
    assert tools_first.store is not tools_second.store  # type: ignore[attr-defined]
    breakers = [layer.inner for layer in layers]  # type: ignore[attr-defined]
    assert all(isinstance(b, CircuitBreakerChatClient) for b in breakers)
    assert breakers[0].breaker is not breakers[1].breaker


def test_a_router_instance_builds_once() -> None:
    from middleware.routing import OrderedFailoverChatClient

    router = OrderedFailoverChatClient([ScriptedChatClient()])
    builder = ChatPipeline.builder().use_failover(router)
    assert builder.build().client is router
    with pytest.raises(ValueError, match="give it a factory"):
        builder.build()
    factory = ChatPipeline.builder().use_failover(
        lambda: OrderedFailoverChatClient([ScriptedChatClient()])
    )
    assert factory.build().client is not factory.build().client


def test_layer_options_are_checked_where_written() -> None:
    with pytest.raises(ValueError, match="unknown setting; did you mean 'max_attempts'"):
        ChatPipeline.builder().use_retry(max_attempt=2)
    with pytest.raises(TypeError, match="fail_max must be an integer"):
        ChatPipeline.builder().use_circuit_breaker(fail_max="5")
    with pytest.raises(ValueError, match="max_iterations must be at least 1"):
        ChatPipeline.builder().use_function_invocation(max_iterations=0)
    with pytest.raises(TypeError, match=r"routes\[0\] must be a ChatClient"):
        ChatPipeline.builder().use_ordered_failover([object()])  # type: ignore[list-item]


class NoMetadata:
    """A client written without `metadata`: it must still work, named after its type."""

    def __init__(self) -> None:
        self.inner = ScriptedChatClient(reply("plain"))

    async def get_response(self, messages, options=None):  # type: ignore[no-untyped-def]
        return await self.inner.get_response(messages, options)

    def get_streaming_response(self, messages, options=None):  # type: ignore[no-untyped-def]
        return self.inner.get_streaming_response(messages, options)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_client_without_metadata_works_everywhere(streaming: bool) -> None:
    chat = (
        ChatPipeline.builder()
        .use_telemetry()
        .use_logging()
        .use_circuit_breaker()
        .use_retry()
        .build(NoMetadata())  # type: ignore[arg-type]
    )
    assert chat.metadata.name == "NoMetadata"
    assert chat.describe()[-1] == "NoMetadata"
    assert (await collect(chat, "hi", streaming=streaming)).text == "plain"
    routed = ChatPipeline.builder().use_ordered_failover([NoMetadata()]).build()  # type: ignore[list-item]
    assert routed.describe() == ["OrderedFailoverChatClient(NoMetadata)"]
    assert (await collect(routed, "hi", streaming=streaming)).text == "plain"


async def test_a_bad_argument_fails_where_the_call_is_awaited_not_where_it_is_made() -> None:
    # `ChatPipeline` and configure-options hand over the inner call's coroutine instead of
    # awaiting it in one of their own: the failure still comes at the await, as from an
    # `async def`, and a good call after it is served.
    def configure(options: ChatOptions) -> ChatOptions:
        return "not options" if options.model_id == "bad" else options  # type: ignore[return-value]

    inner = ScriptedChatClient("hello")
    pipeline = ChatPipeline.builder().configure_options(configure).build(inner)
    not_messages = pipeline.get_response(42)  # type: ignore[arg-type]
    badly_configured = pipeline.get_response("hi", ChatOptions(model_id="bad"))
    with pytest.raises(TypeError, match="messages"):
        await not_messages
    with pytest.raises(TypeError, match="configure must return ChatOptions"):
        await badly_configured
    assert inner.calls == []
    assert (await pipeline.get_response("hi")).text == "hello"
    assert len(inner.calls) == 1
