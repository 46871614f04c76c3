"""The OpenAI Agents SDK (``openai-agents``) against the gateway: ``Runner.run`` and
``Runner.run_streamed`` of an agent with a function tool, over ``/v1/responses``
(`OpenAIResponsesModel`) and ``/v1/chat/completions`` (`OpenAIChatCompletionsModel`), and
its stateful mode (``previous_response_id``) on the gateway's stored responses.

The SDK runs the tool itself and sends its output back; the upstream's reasoning and
prompt-cache counts reach the run's usage.

Client (the Agents SDK, in this test's event loop) -> gateway -> fake Chat Completions
upstream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.pipeline.gateway.conftest import config, keyed, running

pytestmark = pytest.mark.compat

set_tracing_disabled(True)  # the SDK's own traces would go to OpenAI


def weather_tool(cities: list[str]) -> Any:
    """A function tool the SDK runs, noting each city it is asked about."""

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    return get_weather


@pytest.fixture
async def upstream() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_an_agent_with_a_function_tool(
    upstream: FakeOpenAIServer, api: str, streamed: bool
) -> None:
    cities: list[str] = []
    get_weather = weather_tool(cities)

    upstream.script(
        FakeResponse(
            text="",
            tool_calls=[("get_weather", json.dumps({"city": "Paris"}))],
            usage=(20, 5),
            cache_usage=(0, 8),
            reasoning_tokens=2,
        ),
        FakeResponse(text="It is sunny in Paris.", usage=(30, 6), reasoning_tokens=1),
    )
    async with running(config({"primary": upstream})) as gateway:
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="test-key", max_retries=0)
        model: Any = (
            OpenAIResponsesModel(model="pipeline", openai_client=client)
            if api == "responses"
            else OpenAIChatCompletionsModel(model="pipeline", openai_client=client)
        )
        agent = Agent(
            name="weather",
            instructions="Answer with the tool.",
            tools=[get_weather],
            model=model,
            model_settings=ModelSettings(include_usage=True),
        )
        if streamed:
            run = Runner.run_streamed(agent, "What is the weather in Paris?")
            kinds = [event.type async for event in run.stream_events()]
            assert "run_item_stream_event" in kinds
            result: Any = run
        else:
            result = await Runner.run(agent, "What is the weather in Paris?")
        await client.close()
    assert result.final_output == "It is sunny in Paris."
    assert cities == ["Paris"]
    assert upstream.count() == 2
    second = upstream.requests[1].json["messages"]
    assert second[-1]["role"] == "tool"
    assert second[-1]["content"] == "It is sunny in Paris."
    usage = result.context_wrapper.usage
    assert (usage.input_tokens, usage.output_tokens) == (50, 11)
    assert usage.input_tokens_details.cached_tokens == 8
    assert usage.output_tokens_details.reasoning_tokens == 3


async def test_a_conversation_chained_by_previous_response_id(
    upstream: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK's stateful mode: each turn of a run sends only its new items with the
    previous response's id (``auto_previous_response_id``), and a second run continues the
    first by its last response's id. The gateway keeps the responses (its default store),
    so the model always sees the whole conversation; a stored response is its key's alone."""
    cities: list[str] = []
    get_weather = weather_tool(cities)

    upstream.script(
        FakeResponse(text="", tool_calls=[("get_weather", json.dumps({"city": "Paris"}))]),
        FakeResponse(text="It is sunny in Paris."),
        FakeResponse(text="You asked about Paris."),
    )
    cfg = config({"primary": upstream}, gateway=keyed(monkeypatch, "key-a,key-b"))
    posted: list[dict[str, Any]] = []  # what the SDK sent to the gateway

    async def record(request: httpx.Request) -> None:
        if request.method == "POST":
            posted.append(json.loads(request.content))

    async with running(cfg) as gateway:
        client = openai.AsyncOpenAI(
            base_url=gateway.base_url,
            api_key="key-a",
            max_retries=0,
            http_client=httpx.AsyncClient(event_hooks={"request": [record]}),
        )
        agent = Agent(
            name="weather",
            instructions="Answer with the tool.",
            tools=[get_weather],
            model=OpenAIResponsesModel(model="pipeline", openai_client=client),
        )
        first = await Runner.run(
            agent, "What is the weather in Paris?", auto_previous_response_id=True
        )
        second = await Runner.run(
            agent, "Which city did I ask about?", previous_response_id=first.last_response_id
        )
        assert (first.final_output, second.final_output) == (
            "It is sunny in Paris.",
            "You asked about Paris.",
        )
        assert cities == ["Paris"]
        # After the first request, only the new items and the previous response's id.
        chained = [(p.get("previous_response_id") is not None, len(p["input"])) for p in posted]
        assert chained == [(False, 1), (True, 1), (True, 1)]
        last = upstream.requests[2].json["messages"]
        assert [m["role"] for m in last] == [
            "system",
            "user",
            "assistant",
            "tool",
            "assistant",
            "user",
        ]
        assert last[3]["content"] == "It is sunny in Paris."
        # The stored response, for the key that made it only.
        assert first.last_response_id is not None
        stored = await client.responses.retrieve(first.last_response_id)
        assert stored.output_text == "It is sunny in Paris."
        other = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="key-b", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(first.last_response_id)
        with pytest.raises(openai.NotFoundError):
            await Runner.run(
                agent.clone(model=OpenAIResponsesModel(model="pipeline", openai_client=other)),
                "Which city?",
                previous_response_id=first.last_response_id,
            )
        await client.close()
        await other.close()
    assert upstream.count() == 3
