"""A Gemini route behind the gateway: ``/v1/chat/completions``, ``/v1/messages`` and
``/v1/responses`` clients (the official SDKs, strict) in a tool loop, the model's thought
signatures carried through each API's own reasoning field and verified by the fake on the
next turn; and failover between a Gemini route and an OpenAI route that the client never
sees."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from pipeline.config import PipelineConfig, parse_config
from pipeline.testing import FakeGeminiServer, FakeOpenAIServer, FakeResponse
from tests.pipeline.gateway.conftest import Running, running

pytestmark = pytest.mark.gateway

WEATHER = json.dumps({"city": "Oslo"})
FUNCTION = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture
async def gemini() -> AsyncIterator[FakeGeminiServer]:
    async with FakeGeminiServer(api_keys={"gm-key"}) as server:
        yield server


@pytest.fixture
async def openai_upstream() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server


def gemini_route(server: FakeGeminiServer) -> dict[str, Any]:
    return {
        "provider": "gemini",
        "model": "gemini-test",
        "base_url": server.base_url,
        "api_key_env": "GATEWAY_TEST_GEMINI_KEY",
    }


def gateway_config(routes: dict[str, dict[str, Any]]) -> PipelineConfig:
    data: dict[str, Any] = {
        "routes": routes,
        "gateway": {"models": {"pipeline": "pipeline", "claude-*": "pipeline"}},
    }
    if len(routes) > 1:
        data["router"] = {"kind": "ordered", "order": list(routes)}
    return parse_config(data)


@pytest.fixture
async def over_gemini(
    gemini: FakeGeminiServer, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Running]:
    monkeypatch.setenv("GATEWAY_TEST_GEMINI_KEY", "gm-key")
    async with running(gateway_config({"gemini": gemini_route(gemini)})) as gateway:
        yield gateway


async def test_a_chat_completions_tool_loop(
    over_gemini: Running, gemini: FakeGeminiServer, streaming: bool
) -> None:
    gemini.script(
        FakeResponse(text="", tool_calls=[("get_weather", WEATHER)], usage=(7, 3)),
        FakeResponse(text="Sunny in Oslo."),
    )
    client = over_gemini.client(_strict_response_validation=True)
    messages: list[Any] = [{"role": "user", "content": "weather in Oslo?"}]
    if streaming:
        stream = await client.chat.completions.create(
            model="pipeline",
            messages=messages,
            tools=[FUNCTION],
            stream=True,  # type: ignore[list-item]
        )
        chunks = [chunk async for chunk in stream]
        [call] = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
        call_id, name, arguments = call.id, call.function.name, call.function.arguments  # type: ignore[union-attr]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    else:
        completion = await client.chat.completions.create(
            model="pipeline",
            messages=messages,
            tools=[FUNCTION],  # type: ignore[list-item]
        )
        [call] = completion.choices[0].message.tool_calls or []
        call_id, name, arguments = call.id, call.function.name, call.function.arguments  # type: ignore[union-attr]
        assert completion.choices[0].finish_reason == "tool_calls"
        assert completion.usage is not None and completion.usage.prompt_tokens == 7
    assert (name, json.loads(arguments or "{}")) == ("get_weather", {"city": "Oslo"})
    messages += [
        {"role": "assistant", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
    ]  # fmt: skip
    answer = await client.chat.completions.create(model="pipeline", messages=messages)
    assert answer.choices[0].message.content == "Sunny in Oslo."
    sent = gemini.requests[1].json
    assert sent["contents"][2]["parts"] == [
        {"functionResponse": {"id": call_id, "name": "get_weather",
                              "response": {"output": "sunny"}}}
    ]  # fmt: skip
    assert gemini.count() == 2


async def test_a_messages_tool_loop_carries_thought_signatures(
    over_gemini: Running, gemini: FakeGeminiServer, streaming: bool
) -> None:
    gemini.script(
        FakeResponse(text="", thinking="Need the tool.", tool_calls=[("Read", '{"p": "a"}')]),
        FakeResponse(text="It says hi."),
    )
    sdk = anthropic.AsyncAnthropic(
        base_url=over_gemini.url, api_key="unused", max_retries=0, _strict_response_validation=True
    )
    tool: Any = {"name": "Read", "input_schema": {"type": "object", "properties": {}}}
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    messages: list[Any] = [{"role": "user", "content": "read a"}]

    async def ask() -> Any:
        params = {"model": "claude-test", "max_tokens": 2048, "messages": messages,
                  "tools": [tool], "thinking": thinking}  # fmt: skip
        if not streaming:
            return await sdk.messages.create(**params)
        async with sdk.messages.stream(**params) as stream:
            return await stream.get_final_message()

    first = await ask()
    kinds = [block.type for block in first.content]
    assert kinds == ["thinking", "tool_use"]
    assert first.content[0].signature in gemini.issued_signatures
    assert gemini.requests[0].json["generationConfig"]["thinkingConfig"]["thinkingBudget"] == 1024
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": first.content[1].id, "content": "hi"}]},
    ]  # fmt: skip
    second = await ask()
    assert [block.text for block in second.content if block.type == "text"] == ["It says hi."]
    assert gemini.returned_signatures == 1 and gemini.placeholder_signatures == 0
    await sdk.close()


async def test_a_responses_tool_loop_carries_thought_signatures(
    over_gemini: Running, gemini: FakeGeminiServer, streaming: bool
) -> None:
    gemini.script(
        FakeResponse(text="", thinking="Look it up.", tool_calls=[("get_weather", WEATHER)]),
        FakeResponse(text="Sunny."),
    )
    client = over_gemini.client(_strict_response_validation=True)
    tool: Any = {"type": "function", **FUNCTION["function"]}
    reasoning: Any = {"effort": "low", "summary": "auto"}
    include: Any = ["reasoning.encrypted_content"]

    async def respond(items: list[Any]) -> Any:
        params = {"model": "pipeline", "input": items, "tools": [tool], "reasoning": reasoning,
                  "include": include, "store": False}  # fmt: skip
        if not streaming:
            return await client.responses.create(**params)
        final = None
        async with client.responses.stream(**params) as stream:
            final = await stream.get_final_response()
        return final

    items: list[Any] = [{"role": "user", "content": "weather?"}]
    first = await respond(items)
    kinds = [item.type for item in first.output]
    assert kinds == ["reasoning", "function_call"]
    thought, call = first.output
    assert [part.text for part in thought.summary] == ["Look it up."]
    assert thought.encrypted_content in gemini.issued_signatures
    assert gemini.requests[0].json["generationConfig"]["thinkingConfig"] == {
        "thinkingLevel": "LOW",
        "includeThoughts": True,
    }
    items += [
        thought.model_dump(exclude_none=True),
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    second = await respond(items)
    assert second.output_text == "Sunny."
    assert gemini.returned_signatures == 1


@pytest.mark.parametrize("first", ["gemini", "openai"])
async def test_failover_between_gemini_and_openai_is_invisible(
    gemini: FakeGeminiServer,
    openai_upstream: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
    streaming: bool,
    first: str,
) -> None:
    monkeypatch.setenv("GATEWAY_TEST_GEMINI_KEY", "gm-key")
    routes = {
        "gemini": gemini_route(gemini),
        "openai": {"provider": "openai", "model": "gpt-test", "base_url": openai_upstream.base_url},
    }
    if first == "openai":
        routes = {"openai": routes["openai"], "gemini": routes["gemini"]}
        openai_upstream.script(FakeResponse.error(503))
        gemini.script(FakeResponse(text="served by the second route"))
    else:
        gemini.script(FakeResponse.error(429, retry_after="0"))
        openai_upstream.script(FakeResponse(text="served by the second route"))
    async with running(gateway_config(routes)) as gateway:
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
    assert text == "served by the second route"
    assert (gemini.count(), openai_upstream.count()) == (1, 1)
