import pytest

from middleware.routing import Route, RoutingChatClient, RoutingContext, RoutingSelection
from pipeline import ChatOptions, ChatPipeline
from pipeline.errors import RoutingError, TransientProviderError
from pipeline.testing import ScriptedChatClient, collect, fail, reply


async def test_sync_selector_runs_once_and_invokes_once(streaming: bool) -> None:
    calls: list[RoutingContext] = []
    client = ScriptedChatClient(reply("a"))

    def selector(context: RoutingContext) -> ScriptedChatClient:
        calls.append(context)
        return client

    result = await collect(RoutingChatClient.create(selector), "hi", streaming=streaming)
    assert result.text == "a"
    assert len(calls) == 1 and client.call_count == 1


async def test_async_selector_and_route_selection(streaming: bool) -> None:
    client = ScriptedChatClient(reply("a"))

    async def selector(context: RoutingContext) -> RoutingSelection:
        return RoutingSelection(Route("named", client), context.options.with_(seed=7))

    result = await collect(RoutingChatClient.create(selector), "hi", streaming=streaming)
    assert result.text == "a"
    assert client.calls[0].options is not None and client.calls[0].options.seed == 7


async def test_one_shot_router_never_fails_over(streaming: bool) -> None:
    error = TransientProviderError()
    first = ScriptedChatClient(fail(error))
    selections = [first, ScriptedChatClient(reply("b"))]
    router = RoutingChatClient.create(lambda context: selections[len(context.attempts)])
    result = await collect(router, "hi", streaming=streaming)
    assert result.error is error
    assert first.call_count == 1 and selections[1].call_count == 0  # type: ignore[attr-defined]


async def test_none_selection_raises_routing_error(streaming: bool) -> None:
    result = await collect(RoutingChatClient.create(lambda c: None), "hi", streaming=streaming)
    assert isinstance(result.error, RoutingError)
    assert "chose no client" in str(result.error)


async def test_selected_garbage_is_a_type_error(streaming: bool) -> None:
    result = await collect(RoutingChatClient.create(lambda c: 42), "hi", streaming=streaming)
    assert isinstance(result.error, TypeError)
    assert "selected client must be a ChatClient" in str(result.error)


async def test_created_router_never_closes_selected_clients() -> None:
    client = ScriptedChatClient()
    router = RoutingChatClient.create(lambda c: client)
    await router.get_response("hi")
    await router.aclose()
    assert client.close_count == 0


def test_create_needs_a_callable() -> None:
    with pytest.raises(TypeError, match="callable selector"):
        RoutingChatClient.create(3)  # type: ignore[arg-type]


async def test_options_are_validated(streaming: bool) -> None:
    router = RoutingChatClient.create(lambda c: ScriptedChatClient())
    with pytest.raises(TypeError, match="ChatOptions or None"):
        if streaming:
            router.get_streaming_response("hi", {"model_id": "x"})  # type: ignore[arg-type]
        else:
            await router.get_response("hi", {"model_id": "x"})  # type: ignore[arg-type]


async def test_use_router_on_the_builder(streaming: bool) -> None:
    small = ScriptedChatClient(reply("small"), name="small")
    large = ScriptedChatClient(reply("large"), name="large")

    def by_length(context: RoutingContext) -> ScriptedChatClient:
        return large if len(context.messages[-1].text) > 10 else small

    chat = ChatPipeline.builder().use_router(by_length).build()
    assert (await collect(chat, "short", streaming=streaming)).text == "small"
    assert (await collect(chat, "a much longer question", streaming=streaming)).text == "large"
    assert chat.describe() == ["RoutingChatClient(by_length)"]


async def test_context_options_are_a_clone(streaming: bool) -> None:
    seen: list[ChatOptions] = []
    caller = ChatOptions(temperature=1.0)

    def selector(context: RoutingContext) -> ScriptedChatClient:
        seen.append(context.options)
        context.options.temperature = 0.0
        return client

    client = ScriptedChatClient()
    await collect(RoutingChatClient.create(selector), "hi", caller, streaming=streaming)
    assert seen[0] is not caller and caller.temperature == 1.0
