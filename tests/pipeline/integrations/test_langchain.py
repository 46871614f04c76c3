"""PipelineChatModel: LangChain's chat-model API over a pipeline, sync and async, whole and
streamed, and inside a real LangGraph tool loop."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from collections.abc import Sequence
from typing import Any

import pytest
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from opentelemetry import trace
from pydantic import BaseModel

from pipeline import ChatPipeline, FunctionCallContent, ToolChoice, UsageDetails
from pipeline.errors import TransientProviderError
from pipeline.integrations.langchain import PipelineChatModel, _tool_mode
from pipeline.providers import OpenAIChatClient
from pipeline.testing import (
    FakeOpenAIServer,
    FakeResponse,
    ScriptedChatClient,
    call_tools,
    fail,
    fail_after,
    hang,
    reply,
)
from pipeline.types import ChatOptions, ChatRole, DataContent, FunctionResultContent, TextContent
from tests.otel import Otel
from tests.pipeline.integrations.helpers import (
    CANARY,
    ToolRunningClient,
    ancestors,
    failover,
    outcomes,
    pipeline_exports,
)


@pytest.fixture(params=[False, True], ids=["async", "sync"])
def sync(request: pytest.FixtureRequest) -> bool:
    """Runs a test through the blocking methods (in a worker thread, as sync code runs) and
    through the async ones."""
    return bool(request.param)


async def ask(model: Any, prompt: Any, *, streaming: bool, sync: bool) -> AIMessage:
    """One answer through invoke, ainvoke, stream or astream (streamed chunks added up)."""
    if not streaming:
        if sync:
            return await asyncio.to_thread(model.invoke, prompt)  # type: ignore[no-any-return]
        return await model.ainvoke(prompt)  # type: ignore[no-any-return]
    if sync:
        chunks = await asyncio.to_thread(lambda: list(model.stream(prompt)))
    else:
        chunks = [chunk async for chunk in model.astream(prompt)]
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    return total  # type: ignore[no-any-return]


@tool
def get_weather(city: str) -> str:
    """The weather of a city."""
    return f"weather of {city}"


async def test_answer_with_usage_and_served_model_and_route(
    otel: Otel, streaming: bool, sync: bool
) -> None:
    primary = ScriptedChatClient(fail(TransientProviderError()), name="primary")
    backup = ScriptedChatClient(
        reply("Hello there", chunks=["Hello ", "there"], usage=UsageDetails(9, 2, 11)),
        name="backup",
        model_id="backup-model",
    )
    model = PipelineChatModel(chat=failover([primary, backup], otel))
    answer = await ask(model, "hi", streaming=streaming, sync=sync)
    assert answer.content == "Hello there"
    assert answer.usage_metadata == {"input_tokens": 9, "output_tokens": 2, "total_tokens": 11}
    metadata = answer.response_metadata
    assert metadata["model_name"] == "backup-model"
    assert metadata["finish_reason"] == "stop"
    assert (metadata["route"], metadata["route_attempts"], metadata["route_fallback"]) == (
        "backup",
        2,
        True,
    )
    assert backup.calls[0].streaming is streaming  # the pipeline's call of the same shape
    assert outcomes(otel) == [("primary", "failed_before_output"), ("backup", "completed")]


async def test_stream_chunks_arrive_as_the_route_sent_them(otel: Otel, sync: bool) -> None:
    route = ScriptedChatClient(reply("abc", chunks=["a", "b", "c"]), name="r")
    model = PipelineChatModel(chat=failover([route], otel))
    if sync:
        chunks = await asyncio.to_thread(lambda: list(model.stream("hi")))
    else:
        chunks = [chunk async for chunk in model.astream("hi")]
    assert [c.content for c in chunks] == ["a", "b", "c", ""]
    assert [c.chunk_position for c in chunks] == [None, None, None, "last"]  # type: ignore[attr-defined]
    assert chunks[-1].response_metadata["route"] == "r"


async def test_bind_tools_and_the_tool_message_round_trip(
    otel: Otel, streaming: bool, sync: bool
) -> None:
    route = ScriptedChatClient(
        [
            call_tools(
                FunctionCallContent("call-a", "get_weather", {"city": "Paris"}),
                FunctionCallContent("call-b", "get_weather", {"city": "Oslo"}),
            ),
            reply("Sunny and cold"),
        ],
        name="r",
    )
    model = PipelineChatModel(chat=failover([route], otel)).bind_tools([get_weather])
    question = HumanMessage("weather?")
    first = await ask(model, [question], streaming=streaming, sync=sync)
    assert [(c["id"], c["name"], c["args"]) for c in first.tool_calls] == [
        ("call-a", "get_weather", {"city": "Paris"}),
        ("call-b", "get_weather", {"city": "Oslo"}),
    ]
    results = [
        ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"]) for c in first.tool_calls
    ]
    final = await ask(model, [question, first, *results], streaming=streaming, sync=sync)
    assert final.content == "Sunny and cold"
    offered = route.calls[0].options
    assert offered is not None and offered.tools is not None
    assert [(t.name, t.description) for t in offered.tools] == [
        ("get_weather", "The weather of a city.")
    ]
    sent = route.calls[1].messages
    assert [m.role for m in sent] == [ChatRole.USER, ChatRole.ASSISTANT, ChatRole.TOOL]
    assert [c.call_id for c in sent[1].contents if isinstance(c, FunctionCallContent)] == [
        "call-a",
        "call-b",
    ]
    assert [(c.call_id, c.result) for c in sent[2].contents] == [  # type: ignore[union-attr]
        ("call-a", "weather of Paris"),
        ("call-b", "weather of Oslo"),
    ]


def graph(model: PipelineChatModel, *, sync: bool) -> Any:
    """The LangGraph tool loop: model node, ToolNode, back to the model until no tool call."""
    bound = model.bind_tools([get_weather])

    def call_model(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [bound.invoke(state["messages"])]}

    async def acall_model(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("model", call_model if sync else acall_model)  # type: ignore[arg-type]
    builder.add_node("tools", ToolNode([get_weather]))
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    return builder.compile()


async def test_works_inside_a_langgraph_tool_loop(otel: Otel, sync: bool) -> None:
    route = ScriptedChatClient(
        [
            call_tools(FunctionCallContent("call-7", "get_weather", {"city": "Rome"})),
            reply("Rome is warm"),
        ],
        name="r",
    )
    app = graph(PipelineChatModel(chat=failover([route], otel)), sync=sync)
    request = {"messages": [HumanMessage("weather in Rome?")]}
    if sync:
        state = await asyncio.to_thread(app.invoke, request)
    else:
        state = await app.ainvoke(request)
    messages = state["messages"]
    assert [type(m).__name__ for m in messages] == [
        "HumanMessage",
        "AIMessage",
        "ToolMessage",
        "AIMessage",
    ]
    assert messages[2].tool_call_id == "call-7" and messages[2].content == "weather of Rome"
    assert messages[-1].content == "Rome is warm"
    results = [c for m in route.calls[1].messages for c in m.contents]
    assert FunctionResultContent("call-7", "weather of Rome") in results


class City(BaseModel):
    name: str
    population: int


async def test_with_structured_output(otel: Otel, sync: bool) -> None:
    route = ScriptedChatClient(
        call_tools(FunctionCallContent("c1", "City", {"name": "Oslo", "population": 7})),
        name="r",
    )
    model = PipelineChatModel(chat=failover([route], otel)).with_structured_output(City)
    if sync:
        city = await asyncio.to_thread(model.invoke, "a city")
    else:
        city = await model.ainvoke("a city")
    assert city == City(name="Oslo", population=7)
    options = route.calls[0].options
    assert options is not None and options.tool_mode == ToolChoice.REQUIRED


def test_tool_choice_maps_to_the_pipelines_tool_mode() -> None:
    names = ["a", "b"]
    assert _tool_mode("auto", names) == ToolChoice.AUTO
    assert _tool_mode("none", names) == ToolChoice.NONE
    assert _tool_mode("any", names) == ToolChoice.REQUIRED
    assert _tool_mode(True, names) == ToolChoice.REQUIRED
    assert _tool_mode("b", names) == ToolChoice.named("b")
    assert _tool_mode({"type": "function", "function": {"name": "a"}}, names) == ToolChoice.named(
        "a"
    )
    with pytest.raises(ValueError, match="names no bound tool"):
        _tool_mode("c", names)
    model = PipelineChatModel(chat=ScriptedChatClient("x"))
    with pytest.raises(ValueError, match="names no bound tool"):
        model.bind_tools([get_weather], tool_choice="nope")


async def test_bound_options_reach_the_pipeline(otel: Otel) -> None:
    route = ScriptedChatClient(reply("ok"), name="r")
    base = ChatOptions(temperature=0.9, session_id="s1")
    model = PipelineChatModel(chat=failover([route], otel), options=base)
    bound = model.bind(temperature=0.1, max_tokens=20, parallel_tool_calls=False, stop=["END"])
    await bound.ainvoke("hi")
    options = route.calls[0].options
    assert options is not None
    assert (options.temperature, options.max_output_tokens, options.stop) == (0.1, 20, ["END"])
    assert options.session_id == "s1"  # the base options' own fields stay
    assert options.additional_properties == {"parallel_tool_calls": False}
    assert base.temperature == 0.9  # the base is cloned, never changed


async def test_message_kinds_and_content_blocks(otel: Otel) -> None:
    route = ScriptedChatClient(reply("ok"), name="r")
    model = PipelineChatModel(chat=failover([route], otel))
    await model.ainvoke(
        [
            SystemMessage("rules"),
            HumanMessage(
                [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "https://example.test/a.png"}},
                    {"type": "image", "base64": "iVBORw==", "mime_type": "image/png"},
                ]
            ),
            ChatMessage(role="assistant", content="seen"),
        ]
    )
    sent = route.calls[0].messages
    assert [m.role for m in sent] == [ChatRole.SYSTEM, ChatRole.USER, ChatRole.ASSISTANT]
    assert sent[1].contents == [
        TextContent("look"),
        DataContent(uri="https://example.test/a.png"),
        DataContent(data=b"\x89PNG", media_type="image/png"),
    ]
    with pytest.raises(ValueError, match="'weird'"):
        await model.ainvoke([HumanMessage([{"type": "weird"}])])
    with pytest.raises(ValueError, match="FunctionMessage cannot be sent"):
        await model.ainvoke([FunctionMessage(content="x", name="f")])
    assert route.call_count == 1  # bad input never reached the pipeline


async def test_failure_after_output_is_the_routes_original_error(otel: Otel, sync: bool) -> None:
    error = TransientProviderError("cut")
    primary = ScriptedChatClient(fail_after(["partial "], error), name="primary")
    backup = ScriptedChatClient(reply("never"), name="backup")
    model = PipelineChatModel(chat=failover([primary, backup], otel))
    received: list[Any] = []

    def read_sync() -> None:
        for chunk in model.stream("hi"):
            received.append(chunk.content)

    with pytest.raises(TransientProviderError) as raised:
        if sync:
            await asyncio.to_thread(read_sync)
        else:
            async for chunk in model.astream("hi"):
                received.append(chunk.content)
    assert raised.value is error
    assert received == ["partial "]
    assert backup.call_count == 0
    assert outcomes(otel) == [("primary", "failed_after_output")]


async def test_cancelling_the_caller_cancels_the_attempt(otel: Otel, streaming: bool) -> None:
    primary = ScriptedChatClient(hang(), name="primary")
    backup = ScriptedChatClient(reply("never"), name="backup")
    model = PipelineChatModel(chat=failover([primary, backup], otel))
    task = asyncio.create_task(ask(model, "hi", streaming=streaming, sync=False))
    await primary.wait_for_calls(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backup.call_count == 0
    assert outcomes(otel) == [("primary", "canceled")]


async def test_after_blocking_calls_async_calls_run_on_the_private_loop(
    otel: Otel, streaming: bool
) -> None:
    route = ScriptedChatClient([reply("one"), reply("two"), hang()], name="r")
    model = PipelineChatModel(chat=failover([route], otel))
    assert (await ask(model, "a", streaming=streaming, sync=True)).content == "one"
    assert (await ask(model, "b", streaming=streaming, sync=False)).content == "two"
    # Cancelling a call handed to the private loop cancels it there, and waits for its end.
    task = asyncio.create_task(ask(model, "c", streaming=streaming, sync=False))
    await asyncio.to_thread(
        lambda: asyncio.run_coroutine_threadsafe(
            route.wait_for_calls(3),
            model._home._private,  # type: ignore[arg-type]
        ).result()
    )
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert outcomes(otel)[-1] == ("r", "canceled")
    await asyncio.to_thread(model.close)


async def test_a_blocking_call_after_async_calls_is_refused_clearly(otel: Otel) -> None:
    route = ScriptedChatClient(reply("ok"), name="r")
    model = PipelineChatModel(chat=failover([route], otel))
    await model.ainvoke("a")
    with pytest.raises(RuntimeError, match="use the async methods"):
        await asyncio.to_thread(model.invoke, "b")
    assert route.call_count == 1


def test_a_closed_event_loop_hands_the_pipeline_on() -> None:
    route = ScriptedChatClient(reply("ok"), name="r")
    model = PipelineChatModel(chat=ChatPipeline.builder().use_ordered_failover([route]).build())
    assert asyncio.run(model.ainvoke("a")).content == "ok"
    assert model.invoke("b").content == "ok"  # that loop closed: the private loop takes over
    model.close()
    assert route.call_count == 2


def test_batch_runs_blocking_calls_from_many_threads(otel: Otel) -> None:
    route = ScriptedChatClient(reply("ok"), name="r")
    model = PipelineChatModel(chat=failover([route], otel))
    answers = model.batch([f"q{i}" for i in range(8)], config={"max_concurrency": 4})
    assert [a.content for a in answers] == ["ok"] * 8
    assert route.call_count == 8
    model.close()


def test_close_closes_the_pipeline_and_stops_the_private_loop() -> None:
    route = ScriptedChatClient(reply("ok"), name="r")
    model = PipelineChatModel(chat=ChatPipeline.builder().use_ordered_failover([route]).build())
    model.invoke("hi")
    thread = model._home._thread
    assert thread is not None and thread.name == "PipelineChatModel event loop"
    model.close()
    assert route.close_count == 1
    assert not thread.is_alive()


def test_a_dropped_model_stops_its_private_loop() -> None:
    model = PipelineChatModel(chat=ScriptedChatClient("ok"))
    model.invoke("hi")
    thread = model._home._thread
    assert thread is not None and thread.is_alive()
    del model
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_pipeline_that_runs_tools_is_refused() -> None:
    def lookup(q: str) -> str:
        return q

    runs_tools = (
        ChatPipeline.builder().use_function_invocation([lookup]).build(ScriptedChatClient("x"))
    )
    with pytest.raises(ValueError, match="runs tools itself"):
        PipelineChatModel(chat=runs_tools)
    with pytest.raises(TypeError, match="options must be ChatOptions"):
        PipelineChatModel(chat=ScriptedChatClient("x"), options={"temperature": 1})


async def test_tool_results_from_a_hidden_tool_runner_are_refused(
    streaming: bool, sync: bool
) -> None:
    model = PipelineChatModel(chat=ToolRunningClient())
    with pytest.raises(RuntimeError, match="answered with tool results"):
        await ask(model, "hi", streaming=streaming, sync=sync)


async def test_attempt_spans_nest_under_the_callers_span(
    otel: Otel, streaming: bool, sync: bool
) -> None:
    primary = ScriptedChatClient(fail(TransientProviderError()), name="primary")
    backup = ScriptedChatClient(reply("ok"), name="backup")
    model = PipelineChatModel(chat=failover([primary, backup], otel))
    tracer = otel.tracer_provider.get_tracer("app")
    with tracer.start_as_current_span("app step"):
        await ask(model, "hi", streaming=streaming, sync=sync)
    spans = otel.finished()
    attempts = otel.attempt_spans()
    assert len(attempts) == 2
    for attempt in attempts:
        assert "app step" in [s.name for s in ancestors(attempt, spans)]
    assert trace.get_current_span() is trace.INVALID_SPAN


async def test_no_prompt_or_tool_argument_reaches_the_pipelines_telemetry(
    otel: Otel, streaming: bool, sync: bool, caplog: pytest.LogCaptureFixture
) -> None:
    async with FakeOpenAIServer() as primary, FakeOpenAIServer() as backup:
        echoed = FakeResponse.error(503, message=f"{CANARY} echoed", code=None)
        primary.script(echoed, echoed)
        backup.script(
            FakeResponse(text="", tool_calls=[("get_weather", json.dumps({"city": CANARY}))]),
            FakeResponse(text=f"answer {CANARY}"),
        )
        routes = [
            OpenAIChatClient("m", api_key="k", base_url=primary.base_url, name="primary"),
            OpenAIChatClient("m", api_key="k", base_url=backup.base_url, name="backup"),
        ]
        chat = (
            ChatPipeline.builder(**otel.providers)
            .use_telemetry()
            .use_logging(logging.getLogger("canary"))
            .use_ordered_failover(routes)
            .build()
        )
        model = PipelineChatModel(chat=chat).bind_tools([get_weather])
        conversation: Sequence[BaseMessage] = [
            SystemMessage(f"system {CANARY}"),
            HumanMessage(f"user {CANARY}"),
        ]
        with caplog.at_level(logging.DEBUG):
            first = await ask(model, conversation, streaming=streaming, sync=sync)
            call = first.tool_calls[0]
            result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
            final = await ask(model, [*conversation, first, result], streaming=streaming, sync=sync)
        sent = backup.requests[1].json["messages"]
        assert sent[-1] == {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": f"weather of {CANARY}",
        }
        assert sent[-2]["tool_calls"][0]["id"] == call["id"]
        if sync:
            await asyncio.to_thread(model.bound.close)  # type: ignore[attr-defined]
    assert CANARY in str(final.content)
    assert len(otel.attempt_spans()) == 4
    assert [s for s in pipeline_exports(otel) if CANARY in s] == []
    assert [r.getMessage() for r in caplog.records if CANARY in r.getMessage()] == []
