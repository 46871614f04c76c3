"""PipelineModel: a real Pydantic AI agent over a pipeline, for `run` and `run_stream` alike."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, InstrumentationSettings
from pydantic_ai.capabilities import Instrumentation
from pydantic_ai.exceptions import (
    ModelAPIError,
    ModelAuthenticationError,
    ModelConnectionError,
    ModelContextWindowExceededError,
    ModelHTTPError,
    ModelNotFoundError,
    ModelRateLimitError,
    ModelRequestRejectedError,
    ModelServerError,
    ModelTimeoutError,
    ModelUnavailableError,
)
from pydantic_ai.messages import BinaryContent, ImageUrl, ModelResponse
from pydantic_ai.models.fallback import FallbackModel
from pydantic_ai.models.function import AgentInfo, FunctionModel

from pipeline import ChatPipeline, FunctionCallContent, ToolChoice, UsageDetails
from pipeline.errors import (
    AuthenticationError,
    CircuitOpenError,
    ContextLengthExceededError,
    RateLimitedError,
    RequestInvalidError,
    RequestTimeoutError,
    ResponseValidationError,
    TransientProviderError,
    UnknownProviderError,
)
from pipeline.integrations.pydantic_ai import PipelineModel, _model_error
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
from pipeline.types import ChatRole, DataContent, FunctionResultContent, TextContent
from tests.otel import Otel
from tests.pipeline.integrations.helpers import (
    CANARY,
    ToolRunningClient,
    ancestors,
    failover,
    outcomes,
    pipeline_exports,
)


async def run_agent(agent: Agent[Any, Any], prompt: Any, *, streaming: bool) -> Any:
    """The agent's output through `run` or `run_stream`."""
    if not streaming:
        return (await agent.run(prompt)).output
    async with agent.run_stream(prompt) as run:
        return await run.get_output()


async def test_text_answer_with_usage_model_and_route(otel: Otel, streaming: bool) -> None:
    route = ScriptedChatClient(
        reply("Hello there", chunks=["Hello ", "there"], usage=UsageDetails(11, 2, 13)),
        name="small",
        model_id="small-model",
    )
    agent = Agent(PipelineModel(failover([route], otel)), instructions="Be brief.")
    if streaming:
        async with agent.run_stream("hi") as run:
            pieces = [text async for text in run.stream_text(delta=True, debounce_by=None)]
            output = await run.get_output()
        assert pieces == ["Hello ", "there"]  # streamed as the route sent it
        messages, usage = run.all_messages(), run.usage
    else:
        result = await agent.run("hi")
        output, messages, usage = result.output, result.all_messages(), result.usage
    assert output == "Hello there"
    assert (usage.input_tokens, usage.output_tokens, usage.requests) == (11, 2, 1)
    response = messages[-1]
    assert isinstance(response, ModelResponse)
    assert response.model_name == "small-model"
    assert response.provider_name == "scripted"
    assert response.provider_details == {
        "route": "small",
        "route_attempts": 1,
        "route_fallback": False,
    }
    assert response.finish_reason == "stop"
    sent = route.calls[0]
    assert sent.streaming is streaming  # the pipeline's own call of the same shape
    assert [(m.role, m.text) for m in sent.messages] == [
        (ChatRole.SYSTEM, "Be brief."),
        (ChatRole.USER, "hi"),
    ]


async def test_agent_runs_its_own_tools_and_call_ids_survive(otel: Otel, streaming: bool) -> None:
    route = ScriptedChatClient(
        [
            call_tools(
                FunctionCallContent("call-a", "get_weather", {"city": "Paris"}),
                FunctionCallContent("call-b", "get_weather", {"city": "Oslo"}),
            ),
            reply("Sunny and cold", usage=UsageDetails(20, 4, 24)),
        ],
        name="small",
    )
    agent = Agent(PipelineModel(failover([route], otel)))
    ran: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather of a city."""
        ran.append(city)
        return f"weather of {city}"

    assert await run_agent(agent, "weather?", streaming=streaming) == "Sunny and cold"
    assert sorted(ran) == ["Oslo", "Paris"]  # run by the agent, once each
    offered = route.calls[0].options
    assert offered is not None and offered.tools is not None
    assert [(t.name, t.description) for t in offered.tools] == [
        ("get_weather", "The weather of a city.")
    ]
    assert offered.tools[0].parameters["required"] == ["city"]
    assert offered.tool_mode is None  # the model may answer in text
    second = route.calls[1].messages
    calls = [c for m in second for c in m.contents if isinstance(c, FunctionCallContent)]
    results = [c for m in second for c in m.contents if isinstance(c, FunctionResultContent)]
    assert [(c.call_id, c.name, dict(c.arguments)) for c in calls] == [
        ("call-a", "get_weather", {"city": "Paris"}),
        ("call-b", "get_weather", {"city": "Oslo"}),
    ]
    assert sorted((r.call_id, r.result) for r in results) == [
        ("call-a", "weather of Paris"),
        ("call-b", "weather of Oslo"),
    ]
    assert [m.role for m in second] == [ChatRole.USER, ChatRole.ASSISTANT, ChatRole.TOOL]


class City(BaseModel):
    name: str
    population: int


async def test_structured_output_through_the_output_tool(otel: Otel, streaming: bool) -> None:
    route = ScriptedChatClient(
        call_tools(FunctionCallContent("c1", "final_result", {"name": "Oslo", "population": 7})),
        name="small",
    )
    agent = Agent(PipelineModel(failover([route], otel)), output_type=City)
    assert await run_agent(agent, "a city", streaming=streaming) == City(name="Oslo", population=7)
    options = route.calls[0].options
    assert options is not None and options.tools is not None
    assert [t.name for t in options.tools] == ["final_result"]
    assert options.tool_mode == ToolChoice.REQUIRED  # no text answer allowed: one tool, named


async def test_native_output_sends_a_json_schema_response_format(otel: Otel) -> None:
    from pydantic_ai import NativeOutput
    from pydantic_ai.profiles import ModelProfile

    route = ScriptedChatClient(reply('{"name": "Oslo", "population": 7}'), name="small")
    model = PipelineModel(
        failover([route], otel), profile=ModelProfile(supports_json_schema_output=True)
    )
    agent = Agent(model, output_type=NativeOutput(City))
    assert (await agent.run("a city")).output == City(name="Oslo", population=7)
    options = route.calls[0].options
    assert options is not None
    assert options.response_format["type"] == "json_schema"
    assert options.response_format["json_schema"]["schema"]["required"] == ["name", "population"]


async def test_user_prompt_files_and_settings_reach_the_pipeline(otel: Otel) -> None:
    route = ScriptedChatClient(reply("ok"), name="small")
    agent = Agent(PipelineModel(failover([route], otel)), system_prompt="You see images.")
    prompt = [
        "look",
        ImageUrl(url="https://example.test/cat.png"),
        BinaryContent(data=b"\x89PNG", media_type="image/png"),
    ]
    settings: Any = {"temperature": 0.2, "max_tokens": 50, "seed": 3, "stop_sequences": ["END"]}
    await agent.run(prompt, model_settings=settings)
    sent = route.calls[0]
    assert sent.messages[0].role is ChatRole.SYSTEM
    user = sent.messages[1].contents
    assert user[0] == TextContent("look")
    assert user[1] == DataContent(uri="https://example.test/cat.png", media_type="image/png")
    assert user[2] == DataContent(data=b"\x89PNG", media_type="image/png")
    options = sent.options
    assert options is not None
    assert (options.temperature, options.max_output_tokens, options.seed, options.stop) == (
        0.2,
        50,
        3,
        ["END"],
    )


async def test_failover_before_output_is_invisible_to_the_agent(
    otel: Otel, streaming: bool
) -> None:
    primary = ScriptedChatClient(fail(TransientProviderError("down")), name="primary")
    backup = ScriptedChatClient(reply("from backup", chunks=["from ", "backup"]), name="backup")
    agent = Agent(PipelineModel(failover([primary, backup], otel)))
    if streaming:
        async with agent.run_stream("hi") as run:
            output = await run.get_output()
        response = run.all_messages()[-1]
    else:
        result = await agent.run("hi")
        output, response = result.output, result.all_messages()[-1]
    assert output == "from backup"
    assert (primary.call_count, backup.call_count) == (1, 1)
    assert outcomes(otel) == [("primary", "failed_before_output"), ("backup", "completed")]
    assert isinstance(response, ModelResponse)
    assert response.provider_details == {
        "route": "backup",
        "route_attempts": 2,
        "route_fallback": True,
    }


async def test_failure_after_output_reaches_the_agent_with_no_backup_call(otel: Otel) -> None:
    error = TransientProviderError("cut")
    primary = ScriptedChatClient(fail_after(["partial "], error), name="primary")
    backup = ScriptedChatClient(reply("never"), name="backup")
    agent = Agent(PipelineModel(failover([primary, backup], otel)))
    received: list[str] = []
    with pytest.raises(ModelAPIError) as raised:
        async with agent.run_stream("hi") as run:
            async for text in run.stream_text(delta=True, debounce_by=None):
                received.append(text)
    assert received == ["partial "]  # the agent had the output before the error
    assert raised.value.__cause__ is error  # the route's own error, unchanged beneath
    assert raised.value.in_stream is True
    assert isinstance(raised.value, ModelConnectionError)
    assert backup.call_count == 0
    assert outcomes(otel) == [("primary", "failed_after_output")]


async def test_cancelling_the_agent_cancels_the_attempt(otel: Otel, streaming: bool) -> None:
    primary = ScriptedChatClient(hang(), name="primary")
    backup = ScriptedChatClient(reply("never"), name="backup")
    agent = Agent(PipelineModel(failover([primary, backup], otel)))
    task = asyncio.create_task(run_agent(agent, "hi", streaming=streaming))
    await primary.wait_for_calls(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backup.call_count == 0
    assert outcomes(otel) == [("primary", "canceled")]
    if streaming:
        assert primary.streams_closed == 1  # the route's stream was released


async def test_pipeline_failure_is_a_typed_error_fallback_model_falls_back_on(
    otel: Otel, streaming: bool
) -> None:
    limited = RateLimitedError(status_code=429, retry_after=2.0, code="rate_limit_exceeded")
    only = ScriptedChatClient(fail(limited), name="only")
    pipeline_model = PipelineModel(failover([only], otel))
    with pytest.raises(ModelRateLimitError) as raised:
        await run_agent(Agent(pipeline_model), "hi", streaming=streaming)
    assert isinstance(raised.value, ModelHTTPError)
    assert (raised.value.status_code, raised.value.retry_after) == (429, 2.0)
    assert raised.value.provider_error_code == "rate_limit_exceeded"
    assert raised.value.__cause__ is limited

    async def other(_messages: list[Any], _info: AgentInfo) -> ModelResponse:
        from pydantic_ai.messages import TextPart

        return ModelResponse(parts=[TextPart("from the other model")])

    async def other_stream(_messages: list[Any], _info: AgentInfo) -> Any:
        yield "from the other model"

    fallback = FallbackModel(
        pipeline_model, FunctionModel(other, stream_function=other_stream, model_name="other")
    )
    output = await run_agent(Agent(fallback), "hi", streaming=streaming)
    assert output == "from the other model"
    assert only.call_count == 2


@pytest.mark.parametrize(
    ("error", "expected", "status"),
    [
        (RateLimitedError(status_code=429), ModelRateLimitError, 429),
        (TransientProviderError(status_code=503), ModelUnavailableError, 503),
        (TransientProviderError(status_code=502), ModelServerError, 502),
        (TransientProviderError(), ModelConnectionError, None),
        (TimeoutError(), ModelTimeoutError, None),
        (RequestTimeoutError("deadline"), ModelTimeoutError, None),
        (CircuitOpenError(), ModelUnavailableError, None),
        (RequestInvalidError(status_code=400), ModelRequestRejectedError, 400),
        (RequestInvalidError(status_code=404), ModelNotFoundError, 404),
        (ContextLengthExceededError(status_code=400), ModelContextWindowExceededError, 400),
        (AuthenticationError(status_code=401), ModelAuthenticationError, 401),
        (ResponseValidationError(), ModelAPIError, None),
        (UnknownProviderError(status_code=418), ModelHTTPError, 418),
    ],
)
def test_pipeline_errors_map_to_pydantic_ai_categories(
    error: Exception, expected: type[Exception], status: int | None
) -> None:
    mapped = _model_error(error, "m", in_stream=False)
    assert isinstance(mapped, expected)
    assert getattr(mapped, "status_code", None) == status
    assert mapped is not None and mapped.model_name == "m"


def test_other_exceptions_are_not_disguised() -> None:
    assert _model_error(ValueError("a bug"), "m", in_stream=False) is None
    assert _model_error(KeyError("x"), "m", in_stream=False) is None


async def test_a_bug_in_the_pipeline_propagates_as_itself(otel: Otel, streaming: bool) -> None:
    bug = ValueError("a bug")
    only = ScriptedChatClient(fail(bug), name="only")
    chat = ChatPipeline.builder(**otel.providers).use_ordered_failover(
        [only], should_failover=lambda _e: False
    )
    with pytest.raises(ValueError, match="a bug") as raised:
        await run_agent(Agent(PipelineModel(chat.build())), "hi", streaming=streaming)
    assert raised.value is bug


def test_a_pipeline_that_runs_tools_is_refused() -> None:
    route = ScriptedChatClient(reply("x"), name="r")

    def lookup(q: str) -> str:
        return q

    runs_tools = ChatPipeline.builder().use_function_invocation([lookup]).build(route)
    with pytest.raises(ValueError, match=r"runs tools itself \(FunctionInvokingChatClient"):
        PipelineModel(runs_tools)
    in_a_route = ChatPipeline.builder().use_ordered_failover([runs_tools]).build()
    with pytest.raises(ValueError, match="use_function_invocation"):
        PipelineModel(in_a_route)
    with pytest.raises(TypeError, match="must be a ChatClient"):
        PipelineModel("not a pipeline")


async def test_tool_results_from_a_hidden_tool_runner_are_refused(streaming: bool) -> None:
    agent = Agent(PipelineModel(ToolRunningClient()))
    with pytest.raises(RuntimeError, match="answered with tool results"):
        await run_agent(agent, "hi", streaming=streaming)


async def test_attempt_spans_nest_under_the_agents_spans(otel: Otel, streaming: bool) -> None:
    primary = ScriptedChatClient(fail(TransientProviderError()), name="primary")
    backup = ScriptedChatClient(reply("ok"), name="backup")
    instrument = Instrumentation(InstrumentationSettings(tracer_provider=otel.tracer_provider))
    agent = Agent(PipelineModel(failover([primary, backup], otel)), capabilities=[instrument])
    assert await run_agent(agent, "hi", streaming=streaming) == "ok"
    spans = otel.finished()
    attempts = otel.attempt_spans()
    assert len(attempts) == 2
    for attempt in attempts:
        above = ancestors(attempt, spans)
        scopes = [s.instrumentation_scope.name for s in above if s.instrumentation_scope]
        assert "pydantic-ai" in scopes, [s.name for s in above]
        # the agent's model-request span is the nearest of Pydantic AI's spans above
        framework = next(s for s in above if s.instrumentation_scope.name == "pydantic-ai")  # type: ignore[union-attr]
        assert framework.name.startswith("chat ")


async def test_no_prompt_or_tool_argument_reaches_the_pipelines_telemetry(
    otel: Otel, streaming: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Over real HTTP: the primary answers 503 echoing the prompt (twice), the backup asks
    for a tool with the canary in its arguments, the tool returns it, the answer repeats it."""
    async with FakeOpenAIServer() as primary, FakeOpenAIServer() as backup:
        echoed = FakeResponse.error(503, message=f"{CANARY} echoed", code=None)
        primary.script(echoed, echoed)  # both model turns fail over
        backup.script(
            FakeResponse(text="", tool_calls=[("lookup", json.dumps({"q": CANARY}))]),
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
        instrument = Instrumentation(
            InstrumentationSettings(tracer_provider=otel.tracer_provider, include_content=False)
        )
        agent = Agent(
            PipelineModel(chat), instructions=f"system {CANARY}", capabilities=[instrument]
        )

        @agent.tool_plain
        def lookup(q: str) -> str:
            return f"result {q}"

        with caplog.at_level(logging.DEBUG):
            output = await run_agent(agent, f"user {CANARY}", streaming=streaming)
        await chat.aclose()
        # The tool call id the backup made came back to it with the result.
        second = backup.requests[1].json["messages"]
        call_id = second[-2]["tool_calls"][0]["id"]
        assert call_id.startswith("call_")
        assert second[-1] == {
            "role": "tool",
            "tool_call_id": call_id,
            "content": f"result {CANARY}",
        }
    assert CANARY in output
    exported = pipeline_exports(otel)
    assert len(otel.attempt_spans()) == 4  # per model turn: primary failed, backup served
    assert [s for s in exported if CANARY in s] == []
    assert [r.getMessage() for r in caplog.records if CANARY in r.getMessage()] == []
