"""Stored responses over real HTTP: ``store``, ``previous_response_id``, ``item_reference``
items, ``GET``/``DELETE /v1/responses/{id}`` and ``.../input_items``, with the official
`openai` SDK as client (validating every answer strictly), in memory and in a real Redis."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from pipeline.config import PipelineConfig, parse_config
from pipeline.gateway.response_store import MemoryResponseStore
from pipeline.testing import RESPONSES_PATH, FakeAnthropicServer, FakeOpenAIServer, FakeResponse
from tests.otel import Otel
from tests.pipeline.gateway.conftest import Running, config, keyed, running
from tests.redis_server import RedisServer

pytestmark = pytest.mark.gateway

CANARY = "CANARY-3d9a"
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


async def create(client: openai.AsyncOpenAI, streaming: bool, **options: Any) -> Any:
    """A response, by either call shape (a stream's completed response)."""
    options.setdefault("model", "pipeline")
    if not streaming:
        return await client.responses.create(**options)
    async with client.responses.stream(**options) as stream:
        return await stream.get_final_response()


def strict(gateway: Running, key: str = "unused") -> openai.AsyncOpenAI:
    return gateway.client(api_key=key, _strict_response_validation=True)


@pytest.fixture
async def one_route(primary: FakeOpenAIServer) -> AsyncIterator[Running]:
    async with running(config({"primary": primary})) as gateway:
        yield gateway


def upstream_messages(server: FakeOpenAIServer) -> list[Any]:
    messages: list[Any] = server.requests[-1].json["messages"]
    return messages


# -- continuing a stored response ---------------------------------------------------------------


async def test_previous_response_id_continues_the_conversation(
    one_route: Running, primary: FakeOpenAIServer, streaming: bool
) -> None:
    primary.script(FakeResponse(text="Hello Ada."), FakeResponse(text="Your name is Ada."))
    client = strict(one_route)
    first = await create(client, streaming, input="My name is Ada.", instructions="Be kind.")
    assert first.store is True and first.previous_response_id is None
    second = await create(
        client, streaming, input="What is my name?", previous_response_id=first.id
    )
    assert second.output_text == "Your name is Ada."
    assert second.previous_response_id == first.id
    # The whole conversation reached the model; the first request's instructions were not
    # carried over (the API's own rule), the second's were not given.
    assert upstream_messages(primary) == [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello Ada."},
        {"role": "user", "content": "What is my name?"},
    ]
    # A third turn on the second carries the whole chain.
    primary.script(FakeResponse(text="Still Ada."))
    await create(client, streaming, input="And now?", previous_response_id=second.id)
    assert [m["content"] for m in upstream_messages(primary)] == [
        "My name is Ada.",
        "Hello Ada.",
        "What is my name?",
        "Your name is Ada.",
        "And now?",
    ]
    await client.close()


async def test_item_references_are_the_stored_items(
    one_route: Running, primary: FakeOpenAIServer, streaming: bool
) -> None:
    """What the Vercel AI SDK sends by default in a tool loop's second step: the model's
    own output by reference, then the tool's result."""
    primary.script(
        FakeResponse(text="Let me check.", tool_calls=[("get_weather", '{"city": "Paris"}')]),
        FakeResponse(text="Sunny in Paris."),
    )
    client = strict(one_route)
    first = await create(client, streaming, input="Weather in Paris?", tools=[WEATHER_TOOL])
    message, call = first.output
    assert (message.type, call.type) == ("message", "function_call")
    second = await create(
        client,
        streaming,
        tools=[WEATHER_TOOL],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "item_reference", "id": message.id},
            {"type": "item_reference", "id": call.id},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
        ],
    )
    assert second.output_text == "Sunny in Paris."
    sent = upstream_messages(primary)
    assert sent[1]["content"] == "Let me check."
    assert sent[1]["tool_calls"][0]["id"] == call.call_id
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert sent[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"}
    await client.close()


async def test_what_is_not_stored_is_not_found(
    one_route: Running, primary: FakeOpenAIServer, streaming: bool
) -> None:
    client = strict(one_route)
    kept = await create(client, streaming, input="hi", store=False)
    assert kept.store is False
    store = one_route.gateway.stored_responses
    assert store is not None and isinstance(store.store, MemoryResponseStore)
    assert len(store.store) == 0  # store: false keeps nothing
    with pytest.raises(openai.NotFoundError) as raised:
        await create(client, streaming, input="again", previous_response_id=kept.id)
    assert raised.value.param == "previous_response_id"
    assert "never stored" in raised.value.message
    with pytest.raises(openai.NotFoundError) as raised:
        reference = {"type": "item_reference", "id": kept.output[0].id}
        await create(client, streaming, input=[reference])
    assert raised.value.param == "input[0]"
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(kept.id)
    assert primary.count() == 1  # what was not found never reached a route
    await client.close()


# -- reading and deleting ---------------------------------------------------------------------


async def test_a_stored_response_is_its_keys_alone(
    primary: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config({"primary": primary}, gateway=keyed(monkeypatch, "key-a,key-b"))
    async with running(cfg) as gateway:
        owner, other = strict(gateway, "key-a"), strict(gateway, "key-b")
        stored = await owner.responses.create(model="pipeline", input="hi", instructions="x")
        found = await owner.responses.retrieve(stored.id)
        assert found.id == stored.id and found.output_text == stored.output_text
        assert found.instructions == "x" and found.store is True
        for call in (
            other.responses.retrieve(stored.id),
            other.responses.input_items.list(stored.id),
            other.responses.delete(stored.id),
            other.responses.create(model="pipeline", input="hi", previous_response_id=stored.id),
        ):
            with pytest.raises(openai.NotFoundError):
                await call
        await owner.responses.delete(stored.id)  # still there: the other key's delete missed
        with pytest.raises(openai.NotFoundError):
            await owner.responses.retrieve(stored.id)
        with pytest.raises(openai.NotFoundError):
            await owner.responses.delete(stored.id)
        await owner.close()
        await other.close()


async def test_input_items_list_the_whole_conversation_in_pages(
    one_route: Running, primary: FakeOpenAIServer
) -> None:
    client = strict(one_route)
    first = await client.responses.create(model="pipeline", input="one")
    second = await client.responses.create(
        model="pipeline",
        previous_response_id=first.id,
        input=[
            {"role": "user", "content": "two"},
            {"role": "user", "content": [{"type": "input_text", "text": "three"}]},
        ],
    )
    listed = await client.responses.input_items.list(second.id, order="asc")
    texts = [item.content[0].text for item in listed.data]  # type: ignore[union-attr]
    assert texts == ["one", first.output_text, "two", "three"]
    assert all(item.id for item in listed.data)
    newest_first = await client.responses.input_items.list(second.id, limit=3)
    assert [item.id for item in newest_first.data] == [item.id for item in listed.data][::-1][:3]
    assert newest_first.has_more is True
    paged = [item.id async for item in client.responses.input_items.list(second.id, limit=1)]
    assert paged == [item.id for item in listed.data][::-1]
    await client.close()


async def test_a_bounded_store_forgets_the_oldest(primary: FakeOpenAIServer) -> None:
    cfg = config({"primary": primary}, gateway={"responses_max_count": 2})
    async with running(cfg) as gateway:
        client = strict(gateway)
        ids = [(await client.responses.create(model="pipeline", input="hi")).id for _ in range(3)]
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(ids[0])
        assert [(await client.responses.retrieve(i)).id for i in ids[1:]] == ids[1:]
        await client.close()


async def test_a_gateway_that_stores_nothing_says_so(primary: FakeOpenAIServer) -> None:
    cfg = config({"primary": primary}, gateway={"responses_store": "none"})
    async with running(cfg) as gateway:
        client = strict(gateway)
        answered = await client.responses.create(model="pipeline", input="hi")
        assert answered.store is False
        for extra, param in (
            ({"store": True}, "store"),
            ({"previous_response_id": answered.id}, "previous_response_id"),
            ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ):
            with pytest.raises(openai.BadRequestError) as raised:
                await client.responses.create(model="pipeline", input="hi", extra_body=extra)
            assert raised.value.param == param
            assert "responses_store" in raised.value.message
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(answered.id)
        await client.close()
    assert primary.count() == 1


# -- reasoning kept as the route gave it --------------------------------------------------------

THINKING = {"reasoning": {"effort": "low"}, "tools": [WEATHER_TOOL]}


async def tool_loop(client: openai.AsyncOpenAI, streaming: bool) -> tuple[Any, Any]:
    """A reasoning model's tool call, then the tool's output continuing it by
    `previous_response_id`: both responses."""
    first = await create(client, streaming, input="hi", **THINKING)
    call = first.output[-1]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "ok"}
    second = await create(
        client, streaming, previous_response_id=first.id, input=[output], **THINKING
    )
    return first, second


async def test_encrypted_reasoning_is_stored_as_received(
    primary: FakeOpenAIServer, streaming: bool
) -> None:
    """The client does not ask to see the encrypted reasoning; the stored response keeps
    it, and the continuation passes it back to the route, which verifies it."""
    primary.script(
        FakeResponse(text="", reasoning="thinking", tool_calls=[("get_weather", "{}")]),
        FakeResponse(text="Done."),
        path=RESPONSES_PATH,
    )
    cfg = config({"primary": primary}, route_options={"primary": {"provider": "openai_responses"}})
    async with running(cfg) as gateway:
        client = strict(gateway)
        first, second = await tool_loop(client, streaming)
        reasoning = first.output[0]
        assert reasoning.type == "reasoning" and reasoning.encrypted_content is None
        assert second.output_text == "Done."
        assert primary.returned_reasoning == 1  # came back, and the upstream verified it
        shown = await client.responses.retrieve(first.id)
        assert shown.output[0].encrypted_content is None  # as the request asked
        with_it = await client.responses.retrieve(first.id, include=["reasoning.encrypted_content"])
        assert with_it.output[0].encrypted_content in primary.issued_reasoning  # type: ignore[union-attr]
        await client.close()


async def test_signed_thinking_is_stored_as_received(
    streaming: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An Anthropic route's thinking comes back, by previous_response_id, with the
    signature it was given (the fake refuses anything else)."""
    monkeypatch.setenv("STORED_RESPONSES_TEST_ANTHROPIC_KEY", "upstream-key")
    async with FakeAnthropicServer() as claude:
        claude.script(
            FakeResponse(text="", thinking="think", tool_calls=[("get_weather", "{}")]),
            FakeResponse(text="Done."),
        )
        cfg = parse_config(
            {
                "routes": {
                    "claude": {
                        "provider": "anthropic",
                        "model": "claude-test",
                        "base_url": claude.base_url,
                        "api_key_env": "STORED_RESPONSES_TEST_ANTHROPIC_KEY",
                    }
                }
            }
        )
        async with running(cfg) as gateway:
            client = strict(gateway)
            await tool_loop(client, streaming)
            await client.close()
        assert claude.count() == 2
        assistant = claude.requests[1].json["messages"][1]
        thinking = assistant["content"][0]
        assert thinking["type"] == "thinking"
        assert thinking["signature"] == claude.signature(thinking["thinking"])


# -- telemetry ----------------------------------------------------------------------------------


async def test_nothing_stored_reaches_logs_or_spans(
    primary: FakeOpenAIServer, otel: Otel, caplog: pytest.LogCaptureFixture, streaming: bool
) -> None:
    caplog.set_level(logging.DEBUG)
    primary.script(FakeResponse(text=f"answer {CANARY}"), FakeResponse(text=f"again {CANARY}"))
    cfg = config({"primary": primary}, layers={"telemetry": True, "logging": True})
    async with running(cfg, **otel.providers) as gateway:
        client = strict(gateway)
        first = await create(client, streaming, input=f"question {CANARY}")
        await create(client, streaming, input=f"more {CANARY}", previous_response_id=first.id)
        await client.responses.retrieve(first.id)
        await client.responses.input_items.list(first.id)
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        await gateway.gateway.wait_idle()
        await client.close()
    logged = [r.getMessage() for r in caplog.records] + [str(r.args) for r in caplog.records]
    assert any("GET /v1/responses/{response_id} 200" in line for line in logged)
    assert any("DELETE /v1/responses/{response_id} 200" in line for line in logged)
    assert not [line for line in logged if CANARY in line]
    assert not [text for text in otel.everything_exported() if CANARY in text]


# -- Redis ------------------------------------------------------------------------------------


def redis_config(upstream: FakeOpenAIServer, url: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("STORED_RESPONSES_TEST_REDIS", url)
    gateway = {"responses_store": "redis", "redis_url_env": "STORED_RESPONSES_TEST_REDIS"}
    return config({"primary": upstream}, gateway=gateway)


async def test_replicas_share_stored_responses_through_redis(
    primary: FakeOpenAIServer, redis_url: str, monkeypatch: pytest.MonkeyPatch, streaming: bool
) -> None:
    cfg = redis_config(primary, redis_url, monkeypatch)
    primary.script(FakeResponse(text="Hello Ada."), FakeResponse(text="Ada."))
    async with running(cfg) as one, running(cfg) as two:
        first = await create(strict(one), streaming, input="My name is Ada.")
        # The response was stored before its end was sent: the other replica finds it.
        second = await create(
            strict(two), streaming, input="My name?", previous_response_id=first.id
        )
        assert second.output_text == "Ada."
        assert [m["content"] for m in upstream_messages(primary)] == [
            "My name is Ada.",
            "Hello Ada.",
            "My name?",
        ]
        assert (await strict(two).responses.retrieve(first.id)).output_text == "Hello Ada."


async def test_a_redis_outage_is_not_found_never_a_5xx(
    primary: FakeOpenAIServer,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    streaming: bool,
) -> None:
    cfg = redis_config(primary, redis_server.url, monkeypatch)
    async with running(cfg) as gateway:
        client = strict(gateway)
        stored = await create(client, streaming, input="hi")
        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="chat_pipeline.gateway"):
            # The answer stands; it is not stored.
            answered = await create(client, streaming, input="hi")
            assert answered.output_text == FakeResponse().text
            reference = {"type": "item_reference", "id": stored.output[0].id}
            continued = create(client, streaming, input="x", previous_response_id=stored.id)
            for call, param in (
                (continued, "previous_response_id"),
                (create(client, streaming, input=[reference]), "input[0]"),
                (client.responses.retrieve(stored.id), None),
                (client.responses.delete(stored.id), None),
            ):
                with pytest.raises(openai.NotFoundError) as raised:
                    await call
                assert raised.value.param == param
                assert "response store is unavailable" in raised.value.message
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len([w for w in warnings if "response store" in w]) == 1  # once per outage
        await client.close()


# -- configuration ------------------------------------------------------------------------------


def test_a_redis_store_needs_its_url() -> None:
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError) as raised:
        parse_config(
            {
                "routes": {"r": {"provider": "scripted"}},
                "gateway": {"responses_store": "redis"},
            }
        )
    assert "gateway.responses_store" in str(raised.value)


async def test_a_store_of_your_own(primary: FakeOpenAIServer) -> None:
    store = MemoryResponseStore(max_count=5)
    cfg: PipelineConfig = config({"primary": primary})
    async with running(cfg, response_store=store) as gateway:
        client = strict(gateway)
        stored = await client.responses.create(model="pipeline", input="hi")
        assert len(store) == 1
        async with httpx.AsyncClient() as http:
            raw = await http.get(f"{gateway.base_url}/responses/{stored.id}")
            assert raw.status_code == 200 and raw.json()["id"] == stored.id
            assert (await http.post(f"{gateway.base_url}/responses/{stored.id}")).status_code == 405
            missing = await http.get(f"{gateway.base_url}/responses/{stored.id}/nope")
            assert missing.status_code == 404
            assert json.loads(missing.text)["error"]["code"] == "not_found"
        await client.close()
