"""What both adapters rely on: the served route reaches a report held open above the
pipeline (through telemetry layers too), and agent tools go on every provider's wire."""

from __future__ import annotations

import contextlib

import pytest

from pipeline import ChatPipeline, _scope
from pipeline.errors import TransientProviderError
from pipeline.integrations._common import AgentTool, route_report, served_route
from pipeline.providers import AnthropicChatClient, OpenAIChatClient
from pipeline.testing import (
    FakeAnthropicServer,
    FakeOpenAIServer,
    ScriptedChatClient,
    fail,
    reply,
)
from pipeline.types import ChatOptions
from tests.otel import Otel


def routed(otel: Otel, telemetry_layers: int) -> ChatPipeline:
    primary = ScriptedChatClient(fail(TransientProviderError()), name="primary")
    backup = ScriptedChatClient(reply("ok", chunks=["o", "k"]), name="backup", model_id="b-1")
    builder = ChatPipeline.builder(**otel.providers)
    for _ in range(telemetry_layers):
        builder.use_telemetry()
    return builder.use_ordered_failover([primary, backup]).build()


@pytest.mark.parametrize("telemetry_layers", [0, 1, 2])
async def test_the_served_route_reaches_the_report_above_the_pipeline(
    otel: Otel, streaming: bool, telemetry_layers: int
) -> None:
    chat = routed(otel, telemetry_layers)
    report, token = route_report()
    try:
        if streaming:
            async with contextlib.aclosing(chat.get_streaming_response("hi")) as stream:
                texts = [update.text async for update in stream]
        else:
            texts = [(await chat.get_response("hi")).text]
    finally:
        _scope.exit_report(token)
    assert "".join(texts) == "ok"
    served = served_route(report)
    assert (served.name, served.model_id, served.provider_name) == ("backup", "b-1", "scripted")
    assert (served.attempts, served.fallback) == (2, True)
    assert served.as_metadata() == {"route": "backup", "route_attempts": 2, "route_fallback": True}


async def test_without_a_router_no_route_is_reported(otel: Otel) -> None:
    chat = ChatPipeline.builder(**otel.providers).use_telemetry().build(ScriptedChatClient("x"))
    report, token = route_report()
    try:
        await chat.get_response("hi")
    finally:
        _scope.exit_report(token)
    assert served_route(report).as_metadata() == {}


async def test_an_agent_tool_goes_on_both_wire_formats() -> None:
    parameters = {"type": "object", "properties": {"q": {"type": "string"}}}
    tool = AgentTool("lookup", "Look things up.", parameters)
    options = ChatOptions(tools=[tool], tool_mode="lookup")
    async with FakeOpenAIServer() as openai, FakeAnthropicServer() as anthropic:
        clients = [
            OpenAIChatClient("m", api_key="k", base_url=openai.base_url),
            AnthropicChatClient("m", api_key="k", base_url=anthropic.base_url),
        ]
        for client in clients:
            await client.get_response("hi", options)
            await client.aclose()
    completions = openai.requests[0].json
    assert completions["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look things up.",
                "parameters": parameters,
            },
        }
    ]
    assert completions["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    messages = anthropic.requests[0].json
    assert messages["tools"] == [
        {"name": "lookup", "description": "Look things up.", "input_schema": parameters}
    ]
    assert messages["tool_choice"] == {"type": "tool", "name": "lookup"}
    with pytest.raises(ValueError, match="non-empty name"):
        AgentTool("")
