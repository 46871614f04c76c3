import asyncio
import json
from typing import Literal

import pytest

from middleware.function_invocation import (
    Claim,
    FunctionInvokingChatClient,
    MemoryIdempotencyStore,
    RedisIdempotencyStore,
    Tool,
    idempotency_key,
    operation_scope,
    tool,
)
from middleware.routing import OrderedFailoverChatClient, Route
from pipeline import (
    ChatOptions,
    ChatPipeline,
    FunctionCallContent,
    FunctionResultContent,
    UsageDetails,
)
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
    span, agent = otel.finished()
    assert span.name == "execute_tool lookup" and agent.name == "invoke_agent"
    assert span.parent is not None and span.parent.span_id == agent.context.span_id
    assert dict(span.attributes or {})["gen_ai.tool.type"] == "function"
    assert canary not in json.dumps(dict(span.attributes or {}))
    assert all(canary not in s for s in otel.everything_exported())


def test_tool_names_must_be_unique() -> None:
    with pytest.raises(ValueError, match="two tools are named"):
        FunctionInvokingChatClient(ScriptedChatClient(), [get_weather, get_weather])
    with pytest.raises(TypeError, match="sequence"):
        ChatPipeline.builder().use_function_invocation(get_weather)  # type: ignore[arg-type]


# -- structured concurrency ----------------------------------------------------------------


class Abort(BaseException):
    """Not an Exception: a tool raising it fails the request (like KeyboardInterrupt)."""


async def test_a_base_exception_cancels_and_awaits_every_sibling(streaming: bool) -> None:
    sibling_started = asyncio.Event()
    proceed = asyncio.Event()
    effects: list[str] = []
    sibling_runs: list[asyncio.Task[object]] = []

    @tool
    async def slow_effect(tag: str) -> str:
        task = asyncio.current_task()
        assert task is not None
        sibling_runs.append(task)
        sibling_started.set()
        try:
            await proceed.wait()
        except asyncio.CancelledError:
            effects.append("cancelled")
            raise
        effects.append("side effect")
        return tag

    @tool
    async def aborts(tag: str) -> str:
        await sibling_started.wait()
        raise Abort

    inner = ScriptedChatClient(
        [
            call_tools(
                FunctionCallContent("a", "slow_effect", {"tag": "x"}),
                FunctionCallContent("b", "aborts", {"tag": "y"}),
            ),
            reply("never"),
        ]
    )
    chat = ChatPipeline.builder().use_function_invocation([slow_effect, aborts]).build(inner)
    with pytest.raises(Abort):  # itself, not wrapped in a group
        await collect(chat, "go", streaming=streaming)
    # When the request failed, its sibling had been cancelled and had ended.
    assert effects == ["cancelled"] and sibling_runs[0].done()
    proceed.set()
    await asyncio.sleep(0)  # one turn of the loop: nothing is left to run
    assert effects == ["cancelled"]
    assert inner.call_count == 1


async def test_cancelling_the_request_cancels_and_awaits_its_tools(streaming: bool) -> None:
    started: list[str] = []
    both_started = asyncio.Event()
    proceed = asyncio.Event()
    effects: list[str] = []
    runs: list[asyncio.Task[object]] = []

    @tool
    async def effect(tag: str) -> str:
        task = asyncio.current_task()
        assert task is not None
        runs.append(task)
        started.append(tag)
        if len(started) == 2:
            both_started.set()
        try:
            await proceed.wait()
        except asyncio.CancelledError:
            effects.append(f"{tag} cancelled")
            raise
        effects.append(f"{tag} done")
        return tag

    calls = call_tools(*(FunctionCallContent(t, "effect", {"tag": t}) for t in "ab"))
    inner = ScriptedChatClient([calls, reply("never")])
    chat = ChatPipeline.builder().use_function_invocation([effect]).build(inner)
    request = asyncio.create_task(collect(chat, "go", streaming=streaming))
    await both_started.wait()
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    assert sorted(effects) == ["a cancelled", "b cancelled"]
    assert all(run.done() for run in runs)
    proceed.set()
    await asyncio.sleep(0)
    assert sorted(effects) == ["a cancelled", "b cancelled"]


def waiters(chat: ChatPipeline) -> int:
    """How many requests wait for the (only) shared tool run of `chat`'s tool layer."""
    layer = chat.client
    assert isinstance(layer, FunctionInvokingChatClient)
    return sum(run.waiters for run in layer._in_flight.values())


async def test_cancelling_one_request_never_cancels_a_shared_tool_call(streaming: bool) -> None:
    runs: list[str] = []
    started = asyncio.Event()
    proceed = asyncio.Event()

    @tool
    async def book(slot: str) -> str:
        runs.append(slot)
        started.set()
        await proceed.wait()
        return "booked"

    inner = ScriptedChatClient(
        lambda m, o: (
            call_tools(FunctionCallContent("c", "book", {"slot": "9am"}))
            if m[-1].role.value == "user"
            else reply("ok")
        )
    )
    chat = ChatPipeline.builder().use_function_invocation([book]).build(inner)
    with operation_scope("order-7"):
        first = asyncio.create_task(collect(chat, "book 9am", streaming=streaming))
        await started.wait()
        second = asyncio.create_task(collect(chat, "book 9am", streaming=streaming))
        for _ in range(1000):  # bounded: the second request reaches the shared run
            if waiters(chat) == 2:
                break
            await asyncio.sleep(0)
        assert waiters(chat) == 2
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert not second.done() and waiters(chat) == 1
    proceed.set()
    result = await second
    assert result.error is None and result.text.endswith("ok")
    assert result.response is not None
    tool_result = result.response.messages[1].contents[0]
    assert isinstance(tool_result, FunctionResultContent) and tool_result.result == "booked"
    assert runs == ["9am"]  # the tool ran once


async def test_a_tools_own_cancelled_error_is_a_tool_failure(streaming: bool) -> None:
    @tool
    async def confused(tag: str) -> str:
        raise asyncio.CancelledError

    inner = ScriptedChatClient(
        [call_tools(FunctionCallContent("a", "confused", {"tag": "x"})), reply("ok")]
    )
    chat = ChatPipeline.builder().use_function_invocation([confused]).build(inner)
    result = await collect(chat, "go", streaming=streaming)
    assert result.error is None and result.text.endswith("ok")
    (failure,) = inner.calls[1].messages[-1].contents
    assert isinstance(failure, FunctionResultContent)
    assert failure.result == "Error: 'confused' failed with CancelledError."


# -- atomic idempotency ----------------------------------------------------------------------


class LaggyStore:
    """A claiming store with latency (like Redis): every operation lets the event loop
    run `lag` times before and after it reaches the memory store."""

    def __init__(self, lag: int = 5) -> None:
        self.lag = lag
        self.memory = MemoryIdempotencyStore()

    async def _lag(self) -> None:
        for _ in range(self.lag):
            await asyncio.sleep(0)

    async def claim(self, key: str, ttl: float) -> Claim:
        await self._lag()
        claim = await self.memory.claim(key, ttl)
        await self._lag()
        return claim

    async def complete(self, claim: Claim, result: object) -> None:
        await self._lag()
        await self.memory.complete(claim, result)
        await self._lag()

    async def release(self, claim: Claim) -> None:
        await self._lag()
        await self.memory.release(claim)
        await self._lag()


class LaggyGetPutStore:
    """A store of the earlier protocol (get/put only), with latency."""

    def __init__(self, lag: int = 5) -> None:
        self.lag = lag
        self.results: dict[str, object] = {}

    async def get(self, key: str) -> tuple[bool, object]:
        for _ in range(self.lag):
            await asyncio.sleep(0)
        return (True, self.results[key]) if key in self.results else (False, None)

    async def put(self, key: str, result: object) -> None:
        for _ in range(self.lag):
            await asyncio.sleep(0)
        self.results[key] = result


def charging_pipelines(count: int, store: object, charges: list[int]) -> list[ChatPipeline]:
    """`count` tool layers (as on `count` routes or replicas) sharing `store`."""

    @tool
    async def charge(amount: int) -> str:
        charges.append(amount)
        await asyncio.sleep(0)  # the charge takes a moment
        return "charged"

    asks = call_tools(FunctionCallContent("c1", "charge", {"amount": 5}))
    return [
        ChatPipeline.builder()
        .use_function_invocation([charge], idempotency_store=store)
        .build(ScriptedChatClient([asks, reply("Done.")]))
        for _ in range(count)
    ]


@pytest.mark.parametrize("store_kind", ["claiming", "get/put"])
@pytest.mark.parametrize("layers", [1, 2])
async def test_overlapping_identical_calls_run_once_with_a_slow_store(
    streaming: bool, store_kind: str, layers: int
) -> None:
    charges: list[int] = []
    store = LaggyStore() if store_kind == "claiming" else LaggyGetPutStore()
    pipelines = charging_pipelines(layers, store, charges)
    with operation_scope("order-42"):
        results = await asyncio.gather(
            *(collect(pipelines[i % layers], "charge me 5", streaming=streaming) for i in range(2))
        )
    assert [r.text.endswith("Done.") for r in results] == [True, True]
    assert charges == [5]


async def test_a_failed_call_gives_its_claim_back(streaming: bool) -> None:
    attempts: list[int] = []

    @tool
    def flaky(amount: int) -> str:
        attempts.append(amount)
        if len(attempts) == 1:
            raise RuntimeError("first try fails")
        return "ok"

    store = LaggyStore()
    inner = ScriptedChatClient(
        lambda m, o: (
            call_tools(FunctionCallContent("c", "flaky", {"amount": 1}))
            if m[-1].role.value == "user"
            else reply("answered")
        )
    )
    builder = ChatPipeline.builder().use_function_invocation([flaky], idempotency_store=store)
    chat = builder.build(inner)
    with operation_scope("retry-op"):
        await collect(chat, "go", streaming=streaming)
        await collect(chat, "go", streaming=streaming)  # the caller retries: it runs again
        await collect(chat, "go", streaming=streaming)  # now recorded: it does not
    assert attempts == [1, 1]
    assert not store.memory._claims  # no claim left behind


async def test_a_result_that_cannot_be_recorded_still_stands(
    streaming: bool, caplog: pytest.LogCaptureFixture
) -> None:
    canary = "CANARY-tool-result-71"

    class Unrecordable(LaggyStore):
        async def complete(self, claim: Claim, result: object) -> None:
            raise ConnectionError("store went away")

    @tool
    def lookup(query: str) -> str:
        return canary

    inner = ScriptedChatClient(
        [call_tools(FunctionCallContent("c", "lookup", {"query": canary})), reply("ok")]
    )
    chat = (
        ChatPipeline.builder()
        .use_function_invocation([lookup], idempotency_store=Unrecordable())
        .build(inner)
    )
    result = await collect(chat, "go", streaming=streaming)
    assert result.error is None
    (tool_result,) = inner.calls[1].messages[-1].contents
    assert isinstance(tool_result, FunctionResultContent) and tool_result.result == canary
    (warning,) = [r for r in caplog.records if r.name == "chat_pipeline.tools"]
    assert "ConnectionError" in warning.getMessage()
    assert canary not in warning.getMessage()


def test_a_store_without_the_protocol_is_refused() -> None:
    with pytest.raises(TypeError, match="claim/complete/release"):
        FunctionInvokingChatClient(ScriptedChatClient(), [get_weather], idempotency_store=3)


async def test_telemetry_inside_the_loop_traces_each_model_call(
    otel: Otel, streaming: bool
) -> None:
    """The recommended order: the tool loop outside the telemetry layer gives one chat span
    per model call, and the tool spans, under one invoke_agent span for the request."""

    @tool
    def lookup(query: str) -> str:
        return "found"

    inner = ScriptedChatClient(
        [
            call_tools(FunctionCallContent("c1", "lookup", {"query": "x"})),
            reply("ok", usage=UsageDetails(3, 4, 7)),
        ],
        model_id="m",
    )
    chat = (
        ChatPipeline.builder(**otel.providers)
        .use_function_invocation([lookup])
        .use_telemetry()
        .build(inner)
    )
    result = await collect(chat, "find it", streaming=streaming)
    assert result.error is None
    spans = otel.finished()
    (agent,) = [s for s in spans if s.name == "invoke_agent"]
    children = sorted(
        (s for s in spans if s.parent is not None and s.parent.span_id == agent.context.span_id),
        key=lambda s: s.start_time or 0,
    )
    assert [s.name for s in children] == ["chat m", "execute_tool lookup", "chat m"]
    assert dict(agent.attributes or {})["gen_ai.usage.output_tokens"] == 4
