"""``POST /v1/responses`` over real HTTP, with the official `openai` SDK's
``client.responses`` as its client and Chat Completions fakes as upstreams."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.otel import Otel
from tests.pipeline.gateway.conftest import Running, config, running

pytestmark = pytest.mark.gateway

TEXT = "Hello from the fake server."
QUESTION = "What is the weather in Paris?"
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@dataclass
class Answer:
    """What the client got, from either call shape."""

    text: str = ""
    status: str | None = None
    model: str | None = None
    response_id: str | None = None
    usage: Any = None
    output: list[Any] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)


async def ask(client: openai.AsyncOpenAI, streaming: bool, **options: Any) -> Answer:
    options.setdefault("model", "pipeline")
    options.setdefault("input", QUESTION)
    if not streaming:
        response = await client.responses.create(**options)
        return Answer(
            text=response.output_text,
            status=response.status,
            model=response.model,
            response_id=response.id,
            usage=response.usage,
            output=list(response.output),
        )
    answer = Answer()
    stream = await client.responses.create(stream=True, **options)
    async with stream:
        async for event in stream:
            answer.events.append(event)
            if event.type == "response.output_text.delta":
                answer.text += event.delta
            elif event.type in ("response.completed", "response.incomplete"):
                answer.status = event.response.status
                answer.model = event.response.model
                answer.response_id = event.response.id
                answer.usage = event.response.usage
                answer.output = list(event.response.output)
    return answer


def strict(gateway: Running) -> openai.AsyncOpenAI:
    """The official SDK as client, validating every answer and event against its types."""
    return gateway.client(_strict_response_validation=True)


@pytest.fixture
async def two_routes(primary: FakeOpenAIServer, backup: FakeOpenAIServer) -> AsyncIterator[Running]:
    async with running(config({"primary": primary, "backup": backup})) as gateway:
        yield gateway


@pytest.fixture
async def one_route(primary: FakeOpenAIServer) -> AsyncIterator[Running]:
    async with running(config({"primary": primary})) as gateway:
        yield gateway


# -- answers ----------------------------------------------------------------------------------


async def test_answers_in_the_responses_format(
    two_routes: Running, primary: FakeOpenAIServer, streaming: bool
) -> None:
    client = strict(two_routes)
    answer = await ask(client, streaming, instructions="Be brief.", max_output_tokens=50)
    assert answer.text == TEXT
    assert answer.status == "completed"
    assert answer.model == "model-primary"  # the model that served it
    assert answer.response_id is not None and answer.response_id.startswith("resp_")
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (5, 7)
    assert answer.usage.total_tokens == 12
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output[0].content[0].text == TEXT
    if streaming:
        types = [event.type for event in answer.events]
        assert types[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        # Forwarded as it arrived: one delta per upstream chunk, never buffered into one.
        assert types.count("response.output_text.delta") == len(FakeResponse().pieces())
        assert types[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert [event.sequence_number for event in answer.events] == list(range(len(types)))
        assert answer.events[0].response.id == answer.response_id
    request = primary.requests[-1].json
    assert request["model"] == "model-primary"  # the route's model, not the client's name
    assert request["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": QUESTION},
    ]
    assert request["max_completion_tokens"] == 50
    await client.close()


async def test_options_and_items_reach_the_model(
    two_routes: Running, primary: FakeOpenAIServer
) -> None:
    client = strict(two_routes)
    response = await client.responses.create(
        model="pipeline",
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            {"type": "message", "role": "user", "content": "Again"},
        ],
        temperature=0.5,
        top_p=0.9,
        text={"format": {"type": "json_object"}},
        metadata={"team": "search"},
        store=False,
        user="someone",
    )
    assert response.metadata == {"team": "search"}  # echoed, never passed on
    assert (response.temperature, response.top_p) == (0.5, 0.9)
    request = primary.requests[-1].json
    assert request["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again"},
    ]
    assert (request["temperature"], request["top_p"]) == (0.5, 0.9)
    assert request["response_format"] == {"type": "json_object"}
    assert "metadata" not in request and "user" not in request
    await client.close()


async def test_a_tool_round_trip_with_function_call_output(
    two_routes: Running, primary: FakeOpenAIServer, streaming: bool
) -> None:
    primary.script(FakeResponse(text="", tool_calls=[("get_weather", '{"city": "Paris"}')]))
    client = strict(two_routes)
    answer = await ask(client, streaming, tools=[WEATHER_TOOL], tool_choice="required")
    assert answer.status == "completed"
    calls = [item for item in answer.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert calls[0].call_id.startswith("call_")  # the upstream's id, carried
    if streaming:
        types = [event.type for event in answer.events]
        assert types[2:-1] == [
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]
    request = primary.requests[-1].json
    # The client's definition, as a Chat Completions tool for the upstream.
    function = {k: v for k, v in WEATHER_TOOL.items() if k != "type"}
    assert request["tools"] == [{"type": "function", "function": function}]
    assert request["tool_choice"] == "required"
    # The next turn carries the call and its output back to the model.
    call = calls[0]
    follow_up = [
        {"role": "user", "content": QUESTION},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]
    answer = await ask(client, streaming, input=follow_up, tools=[WEATHER_TOOL])
    assert answer.text == TEXT
    sent = primary.requests[-1].json["messages"]
    assert sent[1]["tool_calls"] == [
        {
            "id": call.call_id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    assert sent[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}
    await client.close()


async def test_a_length_stop_is_an_incomplete_response(
    one_route: Running, primary: FakeOpenAIServer, streaming: bool
) -> None:
    primary.script(FakeResponse(text="cut short", stop_reason="length"))
    client = strict(one_route)
    answer = await ask(client, streaming)
    assert answer.status == "incomplete"
    assert answer.text == "cut short"
    if streaming:
        final = answer.events[-1]
        assert final.type == "response.incomplete"
        assert final.response.incomplete_details.reason == "max_output_tokens"
    await client.close()


# -- failover and failures --------------------------------------------------------------------


async def test_an_upstream_error_is_its_http_status(
    one_route: Running, primary: FakeOpenAIServer, streaming: bool
) -> None:
    primary.script(FakeResponse.error(429, code="rate_limit_exceeded", retry_after="7"))
    client = strict(one_route)
    # Every route (the one) rate limited: 503, waiting as long as the route said.
    with pytest.raises(openai.InternalServerError) as raised:
        await ask(client, streaming)
    assert raised.value.status_code == 503
    assert raised.value.code == "rate_limit_exceeded"
    assert raised.value.response.headers["retry-after"] == "7"
    assert raised.value.request_id == raised.value.response.headers["x-request-id"]
    assert primary.count() == 1
    await client.close()


async def test_failover_before_output_is_invisible(
    two_routes: Running, primary: FakeOpenAIServer, backup: FakeOpenAIServer, streaming: bool
) -> None:
    primary.script(FakeResponse.error(503))
    backup.script(FakeResponse(text="The backup answered this."))
    client = strict(two_routes)
    answer = await ask(client, streaming)
    assert answer.text == "The backup answered this."
    assert answer.model == "model-backup"
    assert (primary.count(), backup.count()) == (1, 1)
    if streaming:  # one stream, started once
        types = [event.type for event in answer.events]
        assert types.count("response.created") == 1
        assert "error" not in types and "response.failed" not in types
    await client.close()


@pytest.mark.parametrize(
    "failure",
    [
        FakeResponse(
            chunks=["Hello ", "wor", "ld"],
            in_band_error={"type": "server_error", "code": "server_error"},
            error_after=3,
        ),
        FakeResponse(chunks=["Hello ", "wor", "ld"], disconnect_after=3),
    ],
    ids=["in-band-error", "cut-connection"],
)
async def test_failure_after_output_is_an_error_event_then_response_failed(
    two_routes: Running,
    primary: FakeOpenAIServer,
    backup: FakeOpenAIServer,
    failure: FakeResponse,
) -> None:
    primary.script(failure)
    client = strict(two_routes)
    answer = await ask(client, True)
    assert answer.text == "Hello wor"  # what was streamed stays streamed, nothing repeated
    types = [event.type for event in answer.events]
    assert types[-2:] == ["error", "response.failed"]
    assert "response.completed" not in types
    error, failed = answer.events[-2:]
    assert error.code == "upstream_unavailable"
    assert failed.response.status == "failed"
    assert failed.response.error.code == "server_error"  # one of the API's codes
    assert [item.status for item in failed.response.output] == ["incomplete"]
    assert failed.response.output[0].content[0].text == "Hello wor"
    assert [event.sequence_number for event in answer.events] == list(range(len(types)))
    assert (primary.count(), backup.count()) == (1, 0)
    await client.close()


# -- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
        ({"background": True}, "background", "unsupported_parameter"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]", "unsupported_parameter"),
        ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
        ({"tools": [{"type": "frobnicator"}]}, "tools[0].type", "unsupported_parameter"),
        ({"tools": [{"type": {"name": "x"}}]}, "tools[0].type", "invalid_value"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice", "unsupported_parameter"),
        ({"reasoning": {"frobnicate": "x"}}, "reasoning.frobnicate", "unsupported_parameter"),
        ({"reasoning": {"summary": 1}}, "reasoning.summary", "invalid_value"),
        ({"metadata": {"k": 1}}, "metadata", "invalid_value"),
        (
            {"tools": [{"type": "namespace", "name": "n", "description": "", "tools": []}]},
            "tools[0].tools",
            "invalid_value",
        ),
        ({"frobnicate": 1}, "frobnicate", "unsupported_parameter"),
        ({"input": [{"role": "wizard", "content": "secret words"}]}, "input[0].role", None),
        ({"temperature": 5}, "temperature", "invalid_value"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id", None),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
async def test_what_would_change_meaning_is_a_400_naming_the_parameter(
    one_route: Running,
    primary: FakeOpenAIServer,
    extra: dict[str, Any],
    param: str,
    code: str | None,
) -> None:
    client = strict(one_route)
    # Through extra_body: the SDK's own checks must not stop a request before the gateway.
    with pytest.raises(openai.BadRequestError) as raised:
        await client.responses.create(model="pipeline", input=QUESTION, extra_body=extra)
    assert raised.value.param == param
    if code is not None:
        assert raised.value.code == code
    assert param.split("[")[0].split(".")[0] in raised.value.message
    assert "secret words" not in str(raised.value.body)
    assert primary.count() == 0
    await client.close()


async def test_a_body_that_is_not_json_and_an_unknown_model(one_route: Running) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{one_route.base_url}/responses", content=b"{nope")
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_json"
        response = await http.post(
            f"{one_route.base_url}/responses", json={"model": "nope", "input": "hi"}
        )
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"


# -- telemetry --------------------------------------------------------------------------------


async def test_no_prompt_response_or_tool_argument_in_logs_or_spans(
    primary: FakeOpenAIServer,
    otel: Otel,
    caplog: pytest.LogCaptureFixture,
    streaming: bool,
) -> None:
    canary = "CANARY-5e1b"
    cfg = config({"primary": primary}, layers={"telemetry": True, "logging": True})
    caplog.set_level(logging.DEBUG)
    tool = {**WEATHER_TOOL, "description": f"tool {canary}"}
    turn = [
        {"role": "user", "content": f"my secret is {canary}"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": json.dumps({"city": canary}),
        },
        {"type": "function_call_output", "call_id": "call_1", "output": f"result {canary}"},
    ]
    primary.script(
        FakeResponse(
            text=f"answer {canary}", tool_calls=[("get_weather", f'{{"city": "{canary}"}}')]
        ),
        FakeResponse.error(503, message=f"echo {canary}"),
        FakeResponse(chunks=[canary], in_band_error={"type": "server_error"}, error_after=2),
    )
    async with running(cfg, **otel.providers) as gateway:
        client = strict(gateway)
        answer = await ask(client, streaming, input=turn, tools=[tool], instructions=canary)
        assert canary in answer.output[-1].arguments
        with pytest.raises(openai.APIError):
            await ask(client, streaming, input=turn)
        answer = await ask(client, True, input=turn)  # fails after output: in-band
        assert answer.events[-1].type == "response.failed"
        with pytest.raises(openai.BadRequestError):
            await ask(client, streaming, input=[{"role": canary, "content": canary}])
        await gateway.gateway.wait_idle()
        await client.close()
    logged = [r.getMessage() for r in caplog.records] + [str(r.args) for r in caplog.records]
    assert any("POST /v1/responses 503" in line for line in logged)
    assert not [line for line in logged if canary in line]
    assert not [text for text in otel.everything_exported() if canary in text]
