import asyncio
import json
from typing import Literal

import pytest

from middleware.function_invocation import (
    FunctionInvokingChatClient,
    MemoryIdempotencyStore,
    RedisIdempotencyStore,
    Tool,
    idempotency_key,
    operation_scope,
    tool,
)
from middleware.routing import OrderedFailoverChatClient, Route
from pipeline import ChatOptions, ChatPipeline, FunctionCallContent, FunctionResultContent
from pipeline.errors import TransientProviderError
from pipeline.testing import ScriptedChatClient, call_tools, collect, fail, reply
from tests.otel import Otel


@tool
def get_weather(city: str, unit: Literal["c", "f"] = "c") -> str:
    """Current weather for a city."""
    return f"12{unit} in {city}"


def test_tool_from_function() -> None:
    assert get_weather.name == "get_weather"
    assert get_weather.description == "Current weather for a city."
    assert get_weather.parameters["required"] == ["city"]
    assert get_weather.parameters["properties"]["unit"]["enum"] == ["c", "f"]

    @tool(name="renamed", description="custom")
    async def anything(count: int) -> int:
        return count

    assert (anything.name, anything.description) == ("renamed", "custom")
    with pytest.raises(TypeError, match="needs a type annotation"):
        Tool.from_function(lambda x: x)
    with pytest.raises(TypeError, match=r"\*args"):

        def variadic(*args: int) -> None: ...

        Tool.from_function(variadic)


async def test_arguments_are_validated_before_the_call() -> None:
    assert await get_weather.invoke({"city": "Oslo"}) == "12c in Oslo"
    with pytest.raises(ValueError, match="unit: literal_error"):
        await get_weather.invoke({"city": "Oslo", "unit": "kelvin"})


def weather_call(call_id: str = "c1", city: str = "Oslo") -> FunctionCallContent:
    return FunctionCallContent(call_id, "get_weather", {"city": city})


async def test_tool_loop(streaming: bool) -> None:
    inner = ScriptedChatClient([call_tools(weather_call()), reply("It is 12c in Oslo.")])
    chat = ChatPipeline.builder().use_function_invocation([get_weather]).build(inner)
    caller_options = ChatOptions(temperature=0.1)
    result = await collect(chat, "weather?", caller_options, streaming=streaming)
    assert result.text.endswith("It is 12c in Oslo.")
    assert result.response is not None
    roles = [m.role.value for m in result.response.messages]
    assert roles == ["assistant", "tool", "assistant"]
    tool_result = result.response.messages[1].contents[0]
    assert isinstance(tool_result, FunctionResultContent) and tool_result.result == "12c in Oslo"
    assert inner.call_count == 2
    offered = inner.calls[0].options
    assert offered is not None and offered.tools == [get_weather]
    assert caller_options.tools is None
    assert [m.role.value for m in inner.calls[1].messages] == ["user", "assistant", "tool"]


async def test_tool_failures_become_results(streaming: bool) -> None:
    @tool
    def explode(reason: str) -> str:
        raise RuntimeError(f"secret {reason}")

    calls = call_tools(
        FunctionCallContent("a", "explode", {"reason": "x"}),
        FunctionCallContent("b", "missing_tool", {}),
        FunctionCallContent("c", "get_weather", {"city": 5}),
    )
    inner = ScriptedChatClient([calls, reply("done")])
    chat = ChatPipeline.builder().use_function_invocation([explode, get_weather]).build(inner)
    result = await collect(chat, "go", streaming=streaming)
    assert result.error is None
    tool_message = inner.calls[1].messages[-1]
    texts = [c.result for c in tool_message.contents]  # type: ignore[union-attr]
    assert texts == [
        "Error: 'explode' failed with RuntimeError.",
        "Error: there is no tool named 'missing_tool'.",
        "Error: invalid arguments for 'get_weather'.",
    ]
    model = ScriptedChatClient(
        [call_tools(FunctionCallContent("a", "explode", {"reason": "x"})), reply("ok")]
    )
    detailed = (
        ChatPipeline.builder()
        .use_function_invocation([explode], include_detailed_errors=True)
        .build(model)
    )
    await collect(detailed, "go", streaming=streaming)
    detail = model.calls[1].messages[-1].contents[0]
    assert isinstance(detail, FunctionResultContent)
    assert detail.result == "Error: 'explode' failed with RuntimeError: secret x."
    assert isinstance(detail.exception, RuntimeError)


async def test_max_iterations(streaming: bool) -> None:
    inner = ScriptedChatClient(lambda m, o: call_tools(weather_call(f"c{len(m)}")))
    chat = (
        ChatPipeline.builder().use_function_invocation([get_weather], max_iterations=3).build(inner)
    )
    result = await collect(chat, "loop", streaming=streaming)
    assert result.error is None
    assert inner.call_count == 4  # three rounds of tools, then the last response as it is
    with pytest.raises(ValueError, match="max_iterations must be at least 1"):
        ChatPipeline.builder().use_function_invocation([get_weather], max_iterations=0)


async def test_calls_of_one_turn_run_concurrently(streaming: bool) -> None:
    first_started = asyncio.Event()

    @tool
    async def waits(tag: str) -> str:
        first_started.set()
        await second_started.wait()
        return tag

    second_started = asyncio.Event()

    @tool
    async def signals(tag: str) -> str:
        await first_started.wait()
        second_started.set()
        return tag

    inner = ScriptedChatClient(
        [
            call_tools(
                FunctionCallContent("a", "waits", {"tag": "a"}),
                FunctionCallContent("b", "signals", {"tag": "b"}),
            ),
            reply("both"),
        ]
    )
    chat = ChatPipeline.builder().use_function_invocation([waits, signals]).build(inner)
    async with asyncio.timeout(10):  # only a broken implementation would wait this long
        result = await collect(chat, "go", streaming=streaming)
    assert result.text.endswith("both")


async def test_sequential_when_concurrency_is_off(streaming: bool) -> None:
    order: list[str] = []

    @tool
    async def step(tag: str) -> str:
        order.append(f"start {tag}")
        await asyncio.sleep(0)
        order.append(f"end {tag}")
        return tag

    calls = call_tools(*(FunctionCallContent(t, "step", {"tag": t}) for t in "ab"))
    inner = ScriptedChatClient([calls, reply("ok")])
    chat = (
        ChatPipeline.builder().use_function_invocation([step], allow_concurrent=False).build(inner)
    )
    await collect(chat, "go", streaming=streaming)
    assert order == ["start a", "end a", "start b", "end b"]


async def test_side_effect_is_not_repeated_after_failover() -> None:
    charges: list[int] = []

    @tool
    def charge(amount: int) -> str:
        charges.append(amount)
        return "charged"

    store = MemoryIdempotencyStore()
    asks = call_tools(FunctionCallContent("c1", "charge", {"amount": 5}))

    def route(name: str, after_tool: object) -> Route:
        model = ScriptedChatClient([asks, after_tool], name=f"{name}-model")  # type: ignore[list-item]
        pipeline = (
            ChatPipeline.builder()
            .use_function_invocation([charge], idempotency_store=store)
            .build(model)
        )
        return Route(name, pipeline)

    # The primary charges, then its second model turn fails before output: failover.
    router = OrderedFailoverChatClient(
        [route("primary", fail(TransientProviderError())), route("backup", reply("Done."))]
    )
    response = await router.get_response("charge me 5")
    assert response.text == "Done."
    assert charges == [5]  # the backup's identical call reused the recorded result


async def test_streamed_tool_call_commits_output_so_no_failover() -> None:
    charges: list[int] = []

    @tool
    def charge(amount: int) -> str:
        charges.append(amount)
        return "charged"

    asks = call_tools(FunctionCallContent("c1", "charge", {"amount": 5}))
    primary = (
        ChatPipeline.builder()
        .use_function_invocation([charge])
        .build(ScriptedChatClient([asks, fail(TransientProviderError())]))
    )
    backup = ScriptedChatClient(reply("backup"))
    router = OrderedFailoverChatClient([Route("primary", primary), Route("backup", backup)])
    result = await collect(router, "charge me", streaming=True)
    assert isinstance(result.error, TransientProviderError)
    assert backup.call_count == 0 and charges == [5]


async def test_operation_scope_spans_requests(streaming: bool) -> None:
    runs: list[str] = []

    @tool
    def book(slot: str) -> str:
        runs.append(slot)
        return "booked"

    inner = ScriptedChatClient(
        lambda m, o: (
            call_tools(FunctionCallContent("c", "book", {"slot": "9am"}))
            if m[-1].role.value == "user"
            else reply("ok")
        )
    )
    chat = ChatPipeline.builder().use_function_invocation([book]).build(inner)
    with operation_scope("order-1"):
        await collect(chat, "book 9am", streaming=streaming)
        await collect(chat, "book 9am", streaming=streaming)  # a retried request
    assert runs == ["9am"]
    await collect(chat, "book 9am", streaming=streaming)  # a new operation
    assert runs == ["9am", "9am"]


def test_idempotency_key_is_canonical() -> None:
    assert idempotency_key("op", "t", {"a": 1, "b": 2}) == idempotency_key(
        "op", "t", {"b": 2, "a": 1}
    )
    assert idempotency_key("op", "t", {"a": 1}) != idempotency_key("op2", "t", {"a": 1})


async def test_redis_store_is_shared(redis_url: str) -> None:
    first = RedisIdempotencyStore(redis_url, namespace="test-tools")
    second = RedisIdempotencyStore(redis_url, namespace="test-tools")
    key = idempotency_key("op-redis", "t", {"x": 1})
    assert await first.get(key) == (False, None)
    await first.put(key, {"ok": True})
    assert await second.get(key) == (True, {"ok": True})
    await first.aclose()
    await second.aclose()


async def test_tool_spans_carry_no_arguments_or_results(otel: Otel, streaming: bool) -> None:
    canary = "CANARY-tool-9c"

    @tool
    def lookup(query: str) -> str:
        return f"found {canary}"

    inner = ScriptedChatClient(
        [call_tools(FunctionCallContent("c1", "lookup", {"query": canary})), reply("ok")]
    )
    chat = FunctionInvokingChatClient(inner, [lookup], tracer_provider=otel.tracer_provider)
    await collect(chat, "find it", streaming=streaming)
    (span,) = otel.finished()
    assert span.name == "execute_tool lookup"
    assert canary not in json.dumps(dict(span.attributes or {}))
    assert all(canary not in s for s in otel.everything_exported())


def test_tool_names_must_be_unique() -> None:
    with pytest.raises(ValueError, match="two tools are named"):
        FunctionInvokingChatClient(ScriptedChatClient(), [get_weather, get_weather])
    with pytest.raises(TypeError, match="sequence"):
        ChatPipeline.builder().use_function_invocation(get_weather)  # type: ignore[arg-type]
