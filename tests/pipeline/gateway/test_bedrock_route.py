"""A Bedrock route behind the gateway, over real HTTP: the three formats' official clients
(`openai`'s Chat Completions and Responses, `anthropic`'s Messages) run a tool loop against
it; Claude's thinking and prompt-cache breakpoints go through Converse and back; and failing
over between a Bedrock route and an OpenAI route is invisible to the client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from pipeline.config import parse_config
from pipeline.testing import FakeBedrockServer, FakeOpenAIServer, FakeResponse
from tests.pipeline.gateway.conftest import Running, running

pytestmark = pytest.mark.gateway

CLAUDE = "us.anthropic.claude-sonnet-4-5-20250929-v1:0"
WEATHER = '{"city": "Oslo"}'
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.fixture
def bedrock(fake_bedrock_server: FakeBedrockServer) -> FakeBedrockServer:
    """The kit's fake, its credentials in the environment (the gateway's routes read them)."""
    return fake_bedrock_server


@pytest.fixture
async def openai_upstream() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server


def _config(bedrock: FakeBedrockServer, openai_upstream: FakeOpenAIServer | None = None) -> Any:
    routes: dict[str, Any] = {
        "bedrock": {"provider": "bedrock", "model": CLAUDE, "base_url": bedrock.base_url}
    }
    data: dict[str, Any] = {
        "routes": routes,
        "gateway": {"models": {"pipeline": "pipeline", "claude-*": "pipeline"}},
    }
    if openai_upstream is not None:
        routes["openai"] = {
            "provider": "openai",
            "model": "gpt-backup",
            "base_url": openai_upstream.base_url,
        }
        data["router"] = {"kind": "ordered", "order": ["bedrock", "openai"]}
    return parse_config(data)


@pytest.fixture
async def over_bedrock(bedrock: FakeBedrockServer) -> AsyncIterator[Running]:
    async with running(_config(bedrock)) as gateway:
        yield gateway


def _tool_loop_script(bedrock: FakeBedrockServer) -> None:
    bedrock.script(
        FakeResponse(text="", tool_calls=[("get_weather", WEATHER)]),
        FakeResponse(text="Sunny in Oslo."),
    )


def _tool_result_reached_bedrock(bedrock: FakeBedrockServer, call_id: str) -> None:
    turns = bedrock.requests[-1].json["messages"]
    uses = [b["toolUse"] for t in turns for b in t["content"] if "toolUse" in b]
    results = [b["toolResult"] for t in turns for b in t["content"] if "toolResult" in b]
    assert [u["toolUseId"] for u in uses] == [call_id]
    assert results == [{"toolUseId": call_id, "content": [{"text": "Sunny, 21 C"}]}]


async def test_chat_completions_clients_run_a_tool_loop(
    over_bedrock: Running, bedrock: FakeBedrockServer, streaming: bool
) -> None:
    _tool_loop_script(bedrock)
    client = over_bedrock.client(_strict_response_validation=True)
    tools: Any = [
        {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
    ]
    messages: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]

    async def ask() -> tuple[str, list[Any], str | None]:
        if not streaming:
            completion = await client.chat.completions.create(
                model="pipeline", messages=messages, tools=tools
            )
            choice = completion.choices[0]
            calls = [c.model_dump() for c in choice.message.tool_calls or []]
            return choice.message.content or "", calls, choice.finish_reason
        stream = await client.chat.completions.create(
            model="pipeline", messages=messages, tools=tools, stream=True
        )
        text, calls, finish = "", {}, None
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                    call["id"] += delta.id or ""
                    call["name"] += (delta.function and delta.function.name) or ""
                    call["arguments"] += (delta.function and delta.function.arguments) or ""
        shaped = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in calls.values()
        ]
        return text, shaped, finish

    _, calls, finish = await ask()
    assert finish == "tool_calls" and len(calls) == 1
    call = calls[0]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"},
    ]
    text, _, finish = await ask()
    assert (text, finish) == ("Sunny in Oslo.", "stop")
    _tool_result_reached_bedrock(bedrock, call["id"])
    assert bedrock.verified_signatures == 2
    await client.close()


async def test_responses_clients_run_a_tool_loop(
    over_bedrock: Running, bedrock: FakeBedrockServer, streaming: bool
) -> None:
    _tool_loop_script(bedrock)
    client = over_bedrock.client(_strict_response_validation=True)
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}]

    async def ask(items: Any) -> tuple[str, list[Any]]:
        if not streaming:
            response = await client.responses.create(model="pipeline", input=items, tools=tools)
            return response.output_text, list(response.output)
        text, output = "", []
        stream = await client.responses.create(
            model="pipeline", input=items, tools=tools, stream=True
        )
        async with stream:
            async for event in stream:
                if event.type == "response.output_text.delta":
                    text += event.delta
                elif event.type == "response.completed":
                    output = list(event.response.output)
        return text, output

    question = [{"role": "user", "content": "Weather in Oslo?"}]
    _, output = await ask(question)
    [call] = [item for item in output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    follow_up = [
        *question,
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]
    text, _ = await ask(follow_up)
    assert text == "Sunny in Oslo."
    _tool_result_reached_bedrock(bedrock, call.call_id)
    await client.close()


async def _send(sdk: anthropic.AsyncAnthropic, streaming: bool, **params: Any) -> Any:
    if not streaming:
        return await sdk.messages.create(**params)
    async with sdk.messages.stream(**params) as stream:
        async for _ in stream:
            pass
        return await stream.get_final_message()


async def test_messages_clients_run_a_tool_loop_with_thinking_and_cache_points(
    over_bedrock: Running, bedrock: FakeBedrockServer, streaming: bool
) -> None:
    bedrock.script(
        FakeResponse(text="", tool_calls=[("get_weather", WEATHER)], thinking="Check Oslo."),
        FakeResponse(text="Sunny in Oslo."),
    )
    sdk = anthropic.AsyncAnthropic(base_url=over_bedrock.url, api_key="unused", max_retries=0)
    system = [
        {"type": "text", "text": "You forecast. " * 40, "cache_control": {"type": "ephemeral"}}
    ]
    params: dict[str, Any] = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 4096,
        "system": system,
        "tools": [{"name": "get_weather", "input_schema": PARAMETERS}],
        "thinking": {"type": "enabled", "budget_tokens": 2048},
    }
    question = {"role": "user", "content": "Weather in Oslo?"}
    first = await _send(sdk, streaming, messages=[question], **params)
    thinking, call = first.content
    assert thinking.type == "thinking" and thinking.thinking == "Check Oslo."
    assert thinking.signature == bedrock.reasoning_signature("Check Oslo.")
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Oslo"})
    assert first.stop_reason == "tool_use"
    assert first.usage.cache_creation_input_tokens > 0  # the system prompt's cache point
    sent = bedrock.requests[0].json
    assert sent["system"][-1] == {"cachePoint": {"type": "default"}}
    assert sent["additionalModelRequestFields"]["thinking"] == {
        "type": "enabled",
        "budget_tokens": 2048,
    }
    history = [
        question,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}],
        },
    ]
    # The fake refuses a tool-using turn that comes back without its signed reasoning.
    second = await _send(sdk, streaming, messages=history, **params)
    assert second.content[-1].text == "Sunny in Oslo."
    assert second.usage.cache_read_input_tokens > 0
    _tool_result_reached_bedrock(bedrock, call.id)
    await sdk.close()


async def _say_hi(gateway: Running, streaming: bool) -> str:
    """The text a Chat Completions client gets for "hi", streamed or not."""
    client = gateway.client(_strict_response_validation=True)
    messages: Any = [{"role": "user", "content": "hi"}]
    if streaming:
        stream = await client.chat.completions.create(
            model="pipeline", messages=messages, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    else:
        completion = await client.chat.completions.create(model="pipeline", messages=messages)
        text = completion.choices[0].message.content or ""
    await client.close()
    return text


@pytest.mark.parametrize("failure", ["unavailable", "throttled", "failed_before_output"])
async def test_failover_from_bedrock_to_openai_is_invisible_to_the_client(
    bedrock: FakeBedrockServer,
    openai_upstream: FakeOpenAIServer,
    streaming: bool,
    failure: str,
) -> None:
    before_output = (
        # A stream's exception before any content; a whole answer's timeout.
        FakeResponse(
            in_band_error={"type": "modelStreamErrorException", "message": "m"}, error_after=1
        )
        if streaming
        else FakeResponse.error(408, type="ModelTimeoutException")
    )
    bedrock.script(
        {
            "unavailable": FakeResponse.error(503, type="ServiceUnavailableException"),
            "throttled": FakeResponse.error(429, type="ThrottlingException", retry_after="30"),
            "failed_before_output": before_output,
        }[failure]
    )
    openai_upstream.script(FakeResponse(text="from the backup"))
    async with running(_config(bedrock, openai_upstream)) as gateway:
        text = await _say_hi(gateway, streaming)
    assert text == "from the backup"
    assert (bedrock.count(), openai_upstream.count()) == (1, 1)


async def test_failover_from_openai_to_bedrock(
    bedrock: FakeBedrockServer, openai_upstream: FakeOpenAIServer, streaming: bool
) -> None:
    routes = {
        "openai": {"provider": "openai", "model": "gpt", "base_url": openai_upstream.base_url},
        "bedrock": {"provider": "bedrock", "model": CLAUDE, "base_url": bedrock.base_url},
    }
    cfg = parse_config(
        {
            "routes": routes,
            "router": {"kind": "ordered", "order": ["openai", "bedrock"]},
            "gateway": {"models": {"pipeline": "pipeline"}},
        }
    )
    openai_upstream.script(FakeResponse.error(500))
    bedrock.script(FakeResponse(text="from bedrock"))
    async with running(cfg) as gateway:
        text = await _say_hi(gateway, streaming)
    assert text == "from bedrock"
    assert (openai_upstream.count(), bedrock.count()) == (1, 1)
