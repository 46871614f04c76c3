"""The gateway over real HTTP, with the official `openai` SDK as its client."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from opentelemetry import propagate
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, StatusCode
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from middleware.routing._telemetry import ROUTE_OUTCOME
from pipeline._semconv import CLIENT_DISCONNECTED
from pipeline.gateway._exchange import Exchange
from pipeline.gateway._handler import _Disconnect
from pipeline.gateway.app import SESSION_HEADER
from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.otel import Otel
from tests.pipeline.gateway.conftest import Running, config, keyed, running

pytestmark = pytest.mark.gateway

MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
TEXT = "Hello from the fake server."
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@dataclass
class Answer:
    """What the client got, from either call shape."""

    text: str = ""
    finish_reason: str | None = None
    model: str | None = None
    usage: Any = None
    tool_calls: list[Any] = field(default_factory=list)
    chunks: list[Any] = field(default_factory=list)


async def ask(client: openai.AsyncOpenAI, streaming: bool, **options: Any) -> Answer:
    options.setdefault("model", "pipeline")
    options.setdefault("messages", MESSAGES)
    if not streaming:
        response = await client.chat.completions.create(**options)
        choice = response.choices[0]
        return Answer(
            text=choice.message.content or "",
            finish_reason=choice.finish_reason,
            model=response.model,
            usage=response.usage,
            tool_calls=list(choice.message.tool_calls or []),
        )
    answer = Answer()
    stream = await client.chat.completions.create(stream=True, **options)
    async with stream:
        async for chunk in stream:
            answer.chunks.append(chunk)
            answer.model = chunk.model
            if chunk.usage is not None:
                answer.usage = chunk.usage
            for choice in chunk.choices:
                answer.text += choice.delta.content or ""
                answer.tool_calls += choice.delta.tool_calls or []
                answer.finish_reason = choice.finish_reason or answer.finish_reason
    return answer


@pytest.fixture
async def two_routes(primary: FakeOpenAIServer, backup: FakeOpenAIServer) -> AsyncIterator[Running]:
    async with running(config({"primary": primary, "backup": backup})) as gateway:
        yield gateway


@pytest.fixture
async def one_route(primary: FakeOpenAIServer) -> AsyncIterator[Running]:
    async with running(config({"primary": primary})) as gateway:
        yield gateway


async def test_the_young_collection_threshold_is_raised_while_workers_serve_and_put_back(
    primary: FakeOpenAIServer,
) -> None:
    before = gc.get_threshold()
    gc.set_threshold(700, *before[1:])
    try:
        async with running(config({"primary": primary})):
            raised = gc.get_threshold()
            assert raised[0] > 700 and raised[1:] == before[1:]
            async with running(config({"primary": primary})):
                assert gc.get_threshold() == raised
            assert gc.get_threshold() == raised  # another worker still serves
        assert gc.get_threshold() == (700, *before[1:])
        gc.set_threshold(0)  # the collector off: the gateway leaves it so
        async with running(config({"primary": primary})):
            assert gc.get_threshold()[0] == 0
        assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)


@pytest.mark.parametrize("connections", ["the gateway's", "uvicorn's"])
async def test_a_served_request_leaves_nothing_for_the_cyclic_collector(
    primary: FakeOpenAIServer, streaming: bool, connections: str
) -> None:
    # What a request made is freed by reference counting as it ends (no cycle through its
    # exchange, nor through the cancelled task that watched another server's `receive` for
    # a disconnect), so it is never left for a young collection to find.
    def uvicorns(limits: Any) -> Any:
        return HttpToolsProtocol  # no disconnect callback: the gateway watches `receive`

    protocol = uvicorns if connections == "uvicorn's" else None
    async with running(config({"primary": primary}), http_protocol=protocol) as gateway:
        client = gateway.client()
        await ask(client, streaming)  # the first request builds what later ones reuse
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                assert (await ask(client, streaming)).text == TEXT
            await gateway.gateway.wait_idle()
            watches = [
                task
                for task in asyncio.all_tasks()
                if getattr(task.get_coro(), "__qualname__", "") == "_Disconnect._run"
            ]
            if watches:  # cancelled as their requests ended: let them finish
                await asyncio.wait(watches)
            del watches
            # What only the collector would free (a connection keeps its last request's
            # scope until the next one: that is reachable, not garbage).
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            left = [o for o in gc.garbage if isinstance(o, Exchange | _Disconnect)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        await client.close()
    assert left == []


# -- answers ----------------------------------------------------------------------------------


async def test_answers_in_the_chat_completions_format(
    two_routes: Running, primary: FakeOpenAIServer, streaming: bool
) -> None:
    client = two_routes.client()
    answer = await ask(
        client, streaming, stream_options={"include_usage": True} if streaming else None
    )
    assert answer.text == TEXT
    assert answer.finish_reason == "stop"
    assert answer.model == "model-primary"  # the model that served it
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (5, 7)
    assert answer.usage.total_tokens == 12
    if streaming:
        assert len({chunk.id for chunk in answer.chunks}) == 1
        assert answer.chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].delta.role for c in answer.chunks[1:] if c.choices] == [None] * (
            len(answer.chunks) - 2
        )
        assert answer.chunks[-1].choices == []  # the usage chunk comes last
    request = primary.requests[-1].json
    assert request["model"] == "model-primary"  # the route's model, not the client's name
    assert request["messages"] == MESSAGES
    await client.close()


async def test_usage_chunk_only_when_asked(two_routes: Running) -> None:
    client = two_routes.client()
    answer = await ask(client, True)
    assert answer.text == TEXT
    assert answer.usage is None
    assert all(chunk.choices for chunk in answer.chunks)
    await client.close()


async def test_options_reach_the_model(two_routes: Running, primary: FakeOpenAIServer) -> None:
    client = two_routes.client()
    await client.chat.completions.create(
        model="pipeline",
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ],
        temperature=0.5,
        top_p=0.9,
        max_completion_tokens=50,
        stop="END",
        seed=7,
        response_format={"type": "json_object"},
        presence_penalty=0.5,
        user="someone",
    )
    request = primary.requests[-1].json
    assert request["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert request["temperature"] == 0.5 and request["top_p"] == 0.9
    assert request["max_completion_tokens"] == 50
    assert request["stop"] == ["END"] and request["seed"] == 7
    assert request["response_format"] == {"type": "json_object"}
    assert request["presence_penalty"] == 0.5
    assert "user" not in request  # it describes the caller: accepted, not passed on
    await client.close()


async def test_client_tools_reach_the_model_and_its_calls_come_back(
    two_routes: Running, primary: FakeOpenAIServer, streaming: bool
) -> None:
    primary.script(FakeResponse(text="", tool_calls=[("get_weather", '{"city": "Paris"}')]))
    client = two_routes.client()
    answer = await ask(client, streaming, tools=[WEATHER_TOOL], tool_choice="required")
    assert answer.finish_reason == "tool_calls"
    assert answer.text == ""
    assert [call.function.name for call in answer.tool_calls] == ["get_weather"]
    assert json.loads(answer.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert answer.tool_calls[0].id.startswith("call_")  # the upstream's id, carried
    request = primary.requests[-1].json
    assert request["tools"] == [WEATHER_TOOL]  # the client's definition, as it was
    assert request["tool_choice"] == "required"
    # The next turn carries the call and its result back to the model.
    follow_up = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "Sunny, 21 C"},
    ]
    answer = await ask(client, streaming, messages=follow_up, tools=[WEATHER_TOOL])
    assert answer.text == TEXT
    sent = primary.requests[-1].json["messages"]
    assert sent[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert sent[2] == {"role": "tool", "tool_call_id": "call_0", "content": "Sunny, 21 C"}
    await client.close()


# -- failover and failures --------------------------------------------------------------------


async def test_failover_before_output_is_one_uninterrupted_answer(
    two_routes: Running, primary: FakeOpenAIServer, backup: FakeOpenAIServer, streaming: bool
) -> None:
    primary.script(FakeResponse.error(503))
    backup.script(FakeResponse(text="The backup answered this."))
    client = two_routes.client()
    answer = await ask(client, streaming)
    assert answer.text == "The backup answered this."
    assert answer.model == "model-backup"
    assert (primary.count(), backup.count()) == (1, 1)
    if streaming:  # one stream, started once
        roles = [c.choices[0].delta.role for c in answer.chunks if c.choices]
        assert roles.count("assistant") == 1
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
async def test_failure_after_output_is_an_in_band_error_and_never_fails_over(
    two_routes: Running,
    primary: FakeOpenAIServer,
    backup: FakeOpenAIServer,
    failure: FakeResponse,
) -> None:
    primary.script(failure)
    client = two_routes.client()
    received = ""
    stream = await client.chat.completions.create(model="pipeline", messages=MESSAGES, stream=True)
    with pytest.raises(openai.APIError) as raised:
        async for chunk in stream:
            received += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert received == "Hello wor"  # what was streamed stays streamed, nothing repeated
    assert raised.value.code == "upstream_unavailable"
    assert (primary.count(), backup.count()) == (1, 0)
    await client.close()


async def test_in_band_error_ends_the_stream_without_done(
    one_route: Running, primary: FakeOpenAIServer
) -> None:
    primary.script(
        FakeResponse(
            chunks=["a", "b"],
            in_band_error={"type": "server_error", "code": "server_error"},
            error_after=2,
        )
    )
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{one_route.base_url}/chat/completions",
            json={"model": "pipeline", "messages": MESSAGES, "stream": True},
        )
    assert response.status_code == 200
    events = [line for line in response.text.split("\n\n") if line]
    assert "[DONE]" not in response.text
    last = json.loads(events[-1].removeprefix("data: "))
    assert last == {
        "error": {
            "message": "the model provider is unavailable; retry later (provider openai)",
            "type": "server_error",
            "param": None,
            "code": "upstream_unavailable",
        }
    }
    assert json.loads(events[1].removeprefix("data: "))["choices"][0]["delta"] == {"content": "a"}


# -- client disconnects -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("streaming", "moment"),
    # A non-streaming answer has no output before it is complete.
    [(False, "before-output"), (True, "before-output"), (True, "after-output")],
    ids=[
        "get_response",
        "get_streaming_response-before-output",
        "get_streaming_response-after-output",
    ],
)
async def test_client_disconnect_cancels_the_request_and_upstream(
    primary: FakeOpenAIServer,
    backup: FakeOpenAIServer,
    otel: Otel,
    streaming: bool,
    moment: str,
) -> None:
    cfg = config({"primary": primary, "backup": backup})
    async with running(cfg, **otel.providers) as gateway:
        client = gateway.client()
        if moment == "after-output":
            primary.script(FakeResponse(chunks=["Hello ", "world"], hang_after=2))
            stream = await client.chat.completions.create(
                model="pipeline", messages=MESSAGES, stream=True
            )
            received = ""
            async for chunk in stream:
                received += chunk.choices[0].delta.content or ""
                if received:
                    break
            assert received == "Hello "
            await stream.close()  # the client goes away mid-stream
        else:
            primary.script(FakeResponse(hang=True))
            call = asyncio.create_task(ask(client, streaming))
            await primary.wait_for_requests(1)
            call.cancel()  # the client goes away while waiting
            with pytest.raises(asyncio.CancelledError):
                await call
        await primary.wait_for_disconnects(1)  # the upstream saw its call closed
        await gateway.gateway.wait_idle()
        assert backup.count() == 0  # cancellation never fails over
        attempts = otel.attempt_spans()
        assert [a.attributes[ROUTE_OUTCOME] for a in attempts] == ["canceled"]
        server = next(s for s in otel.finished() if s.kind is SpanKind.SERVER)
        assert server.attributes[CLIENT_DISCONNECTED] is True
        assert server.status.status_code is StatusCode.UNSET  # cancellation is no error
        await client.close()


# -- error statuses ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("upstream", "status", "error", "code"),
    [
        (
            # Every route rate limited: 503, waiting as long as the route said.
            FakeResponse.error(429, retry_after="7"),
            503,
            openai.InternalServerError,
            "rate_limit_exceeded",
        ),
        (
            FakeResponse.error(400, code="invalid_value"),
            400,
            openai.BadRequestError,
            "invalid_value",  # the provider's code, when it is a plain token
        ),
        (
            FakeResponse.error(400, code="context_length_exceeded"),
            400,
            openai.BadRequestError,
            "context_length_exceeded",
        ),
        (
            FakeResponse.error(400, code="content_filter"),
            400,
            openai.BadRequestError,
            "content_filter",
        ),
        (
            # The provider refusing the gateway's credentials is no fault of the caller's
            # key: a 502 the SDK does not retry, never the 401 of a wrong key.
            FakeResponse.error(401),
            502,
            openai.InternalServerError,
            "upstream_authentication_failed",
        ),
        (FakeResponse.error(503), 503, openai.InternalServerError, "upstream_unavailable"),
    ],
    ids=["rate-limited", "invalid", "context-length", "content-filter", "auth", "unavailable"],
)
async def test_provider_failures_become_their_http_status(
    one_route: Running,
    primary: FakeOpenAIServer,
    streaming: bool,
    upstream: FakeResponse,
    status: int,
    error: type[openai.APIStatusError],
    code: str | None,
) -> None:
    primary.script(upstream)
    client = one_route.client()
    with pytest.raises(error) as raised:
        await ask(client, streaming)
    assert raised.value.status_code == status
    assert raised.value.code == code
    assert raised.value.type in (
        "rate_limit_error",
        "invalid_request_error",
        "authentication_error",
        "server_error",
    )
    if code == "rate_limit_exceeded":
        assert raised.value.response.headers["retry-after"] == "7"
        assert "x-should-retry" not in raised.value.response.headers
    elif status == 503:
        # The route failed and says nothing of when it may serve again: a retry will not
        # help soon, and the SDKs are told so.
        assert "retry-after" not in raised.value.response.headers
        assert raised.value.response.headers["x-should-retry"] == "false"
    if status == 502:
        assert raised.value.response.headers["x-should-retry"] == "false"
        assert "your key for this gateway was accepted" in raised.value.message
    if code == "context_length_exceeded":
        # OpenAI's wording, the phrase LiteLLM (and others) recognise a context overflow by.
        assert raised.value.body["message"].startswith("This model's maximum context length is")
        assert raised.value.param == "messages"
    assert raised.value.request_id == raised.value.response.headers["x-request-id"]
    assert primary.count() == 1
    await client.close()


async def test_open_circuit_is_503_without_calling_the_route(
    primary: FakeOpenAIServer, streaming: bool
) -> None:
    cfg = config(
        {"primary": primary},
        route_options={"primary": {"breaker": {"fail_max": 1, "reset_timeout": 600}}},
    )
    primary.script(FakeResponse.error(503))
    async with running(cfg) as gateway:
        client = gateway.client()
        with pytest.raises(openai.InternalServerError):
            await ask(client, streaming)
        with pytest.raises(openai.InternalServerError) as raised:
            await ask(client, streaming)
        assert raised.value.code == "circuit_open"
        assert primary.count() == 1
        await client.close()


@pytest.mark.parametrize("limit", ["request_timeout", "attempt_timeout"])
async def test_timeouts_are_504(primary: FakeOpenAIServer, streaming: bool, limit: str) -> None:
    cfg = config({"primary": primary}, router={limit: 0.2})
    primary.script(FakeResponse(hang=True))
    async with running(cfg) as gateway:
        client = gateway.client()
        with pytest.raises(openai.APIStatusError) as raised:
            await ask(client, streaming)
        assert raised.value.status_code == 504
        assert raised.value.code == "timeout"
        await primary.wait_for_disconnects(1)  # the cut attempt closed its upstream call
        await client.close()


async def test_invalid_requests_are_400_naming_the_parameter(one_route: Running) -> None:
    client = one_route.client()
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(model="pipeline", messages=MESSAGES, temperature=5)
    assert raised.value.param == "temperature"
    assert raised.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(
            model="pipeline", messages=MESSAGES, extra_body={"frobnicate": True}
        )
    assert raised.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(
            model="pipeline", messages=[{"role": "wizard", "content": "secret words"}]
        )
    assert raised.value.param == "messages[0].role"
    assert "secret words" not in str(raised.value.body)
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{one_route.base_url}/chat/completions", content=b"{nope")
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_json"
        response = await http.get(f"{one_route.base_url}/chat/completions")
        assert response.status_code == 405
        assert response.json()["error"]["type"] == "invalid_request_error"
        response = await http.get(f"{one_route.url}/v2/nothing")
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"
    await client.close()


async def test_unknown_model_is_404(one_route: Running, primary: FakeOpenAIServer) -> None:
    client = one_route.client()
    with pytest.raises(openai.NotFoundError) as raised:
        await client.chat.completions.create(model="gpt-5", messages=MESSAGES)
    assert raised.value.code == "model_not_found"
    assert primary.count() == 0
    await client.close()


async def test_api_keys_are_required_and_compared(
    primary: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_TEST_KEYS", "key-one, key-two")
    cfg = config({"primary": primary}, gateway={"api_keys_env": "GATEWAY_TEST_KEYS"})
    async with running(cfg) as gateway:
        for key in ("key-one", "key-two"):
            client = gateway.client(key)
            assert (await ask(client, False)).text == TEXT
            await client.close()
        for key in ("key-three", "key-one2", "key-", "KEY-ONE"):
            client = gateway.client(key)
            with pytest.raises(openai.AuthenticationError) as raised:
                await ask(client, False)
            assert raised.value.body == {
                "message": "missing or invalid API key",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
            with pytest.raises(openai.AuthenticationError):
                await client.models.list()
            await client.close()
        async with httpx.AsyncClient() as http:
            response = await http.post(
                f"{gateway.base_url}/chat/completions",
                json={"model": "pipeline", "messages": MESSAGES},
            )
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"
            # Health and readiness are for the load balancer: no key needed.
            assert (await http.get(f"{gateway.url}/healthz")).status_code == 200
    assert primary.count() == 2


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_request_body_limit_is_413(primary: FakeOpenAIServer, chunked: bool) -> None:
    cfg = config({"primary": primary}, gateway={"max_body_bytes": 2048})
    body = json.dumps(
        {"model": "pipeline", "messages": [{"role": "user", "content": "x" * 4000}]}
    ).encode()

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    async with running(cfg) as gateway, httpx.AsyncClient() as http:
        response = await http.post(
            f"{gateway.base_url}/chat/completions", content=pieces() if chunked else body
        )
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
        small = await http.post(
            f"{gateway.base_url}/chat/completions",
            json={"model": "pipeline", "messages": MESSAGES},
        )
        assert small.status_code == 200
    assert primary.count() == 1


async def test_concurrency_limit_per_key_is_429_with_retry_after(
    primary: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_TEST_KEYS", "key-a,key-b")
    cfg = config(
        {"primary": primary},
        gateway={
            "api_keys_env": "GATEWAY_TEST_KEYS",
            "max_concurrent_per_key": 1,
            "retry_after": 2,
        },
    )
    async with running(cfg) as gateway:
        a, b = gateway.client("key-a"), gateway.client("key-b")
        primary.script(FakeResponse(hang=True))
        busy = asyncio.create_task(ask(a, False))
        await primary.wait_for_requests(1)
        with pytest.raises(openai.RateLimitError) as raised:
            await ask(a, True)
        assert raised.value.code == "concurrency_limit_exceeded"
        assert raised.value.response.headers["retry-after"] == "2"
        assert (await ask(b, False)).text == TEXT  # another key is not limited
        busy.cancel()
        with pytest.raises(asyncio.CancelledError):
            await busy
        await primary.wait_for_disconnects(1)
        await gateway.gateway.wait_idle()
        assert (await ask(a, False)).text == TEXT  # the slot was given back
        assert primary.count() == 3
        await a.close()
        await b.close()


# -- models, health, readiness ----------------------------------------------------------------


async def test_models_lists_and_serves_the_configured_names(
    primary: FakeOpenAIServer, backup: FakeOpenAIServer
) -> None:
    cfg = config(
        {"primary": primary, "backup": backup},
        gateway={"models": {"smart": "pipeline", "gpt-4o-mini": "primary"}},
    )
    async with running(cfg) as gateway:
        client = gateway.client()
        models = await client.models.list()
        assert [m.id for m in models.data] == ["smart", "gpt-4o-mini"]
        primary.script(FakeResponse.error(503), FakeResponse.error(503))
        # The pipeline fails over; a route asked for by name is that route alone.
        assert (await ask(client, False, model="smart")).model == "model-backup"
        with pytest.raises(openai.InternalServerError):
            await ask(client, False, model="gpt-4o-mini")
        assert (primary.count(), backup.count()) == (2, 1)
        with pytest.raises(openai.NotFoundError):
            await ask(client, False, model="pipeline")  # not exposed by this file
        await client.close()


async def test_default_models_are_the_pipeline_and_every_route(two_routes: Running) -> None:
    client = two_routes.client()
    assert [m.id for m in (await client.models.list()).data] == ["pipeline", "primary", "backup"]
    assert (await ask(client, True, model="backup")).model == "model-backup"
    await client.close()


async def test_health_and_readiness(
    primary: FakeOpenAIServer, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_TEST_REDIS", redis_url)
    cfg = config({"primary": primary}, gateway={"redis_url_env": "GATEWAY_TEST_REDIS"})
    async with running(cfg) as gateway, httpx.AsyncClient() as http:
        assert (await http.get(f"{gateway.url}/healthz")).json() == {"status": "ok"}
        response = await http.get(f"{gateway.url}/readyz")
        assert response.status_code == 200
        assert response.json() == {
            "status": "ready",
            "checks": {"pipeline": "ok", "redis:gateway": "ok"},
        }


async def test_readiness_fails_fast_when_redis_does_not_answer(
    primary: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with contextlib.closing(__import__("socket").socket()) as unused:
        unused.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        port = unused.getsockname()[1]
        monkeypatch.setenv("GATEWAY_TEST_REDIS", f"redis://127.0.0.1:{port}/0")
        cfg = config(
            {"primary": primary},
            gateway={"redis_url_env": "GATEWAY_TEST_REDIS", "readiness_timeout": 0.5},
        )
        async with running(cfg) as gateway, httpx.AsyncClient() as http:
            response = await http.get(f"{gateway.url}/readyz")
            assert response.status_code == 503
            body = response.json()
            assert body["status"] == "not ready"
            assert body["checks"]["pipeline"] == "ok"
            assert body["checks"]["redis:gateway"].startswith("unavailable (")
            assert str(port) not in response.text  # the URL is never shown


# -- telemetry and logs -----------------------------------------------------------------------


async def test_the_callers_trace_continues_through_the_gateway(
    primary: FakeOpenAIServer, backup: FakeOpenAIServer, otel: Otel, streaming: bool
) -> None:
    cfg = config({"primary": primary, "backup": backup}, layers={"telemetry": True})
    primary.script(FakeResponse.error(503))
    caller = TracerProvider().get_tracer("caller")
    async with running(cfg, **otel.providers) as gateway:
        client = gateway.client()
        with caller.start_as_current_span("caller") as span:
            headers: dict[str, str] = {}
            propagate.inject(headers)
            answer = await ask(client, streaming, extra_headers=headers)
        assert answer.text == TEXT
        await gateway.gateway.wait_idle()
        await client.close()
    caller_context = span.get_span_context()
    spans = otel.finished()
    assert {s.context.trace_id for s in spans} == {caller_context.trace_id}
    server = next(s for s in spans if s.kind is SpanKind.SERVER)
    assert server.name == "POST /v1/chat/completions"
    assert server.parent is not None and server.parent.span_id == caller_context.span_id
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["http.route"] == "/v1/chat/completions"
    chat = next(s for s in spans if s.name.startswith("chat "))
    assert chat.parent is not None and chat.parent.span_id == server.context.span_id
    attempts = otel.attempt_spans()
    assert [a.attributes[ROUTE_OUTCOME] for a in attempts] == ["failed_before_output", "completed"]
    assert otel.total("http.server.request.duration", **{"http.response.status_code": 200}) == 1


async def test_no_prompt_response_tool_argument_or_key_in_logs_or_spans(
    primary: FakeOpenAIServer,
    otel: Otel,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    streaming: bool,
) -> None:
    canary = "CANARY-7f3a"
    monkeypatch.setenv("GATEWAY_TEST_KEYS", f"key-{canary}")
    cfg = config(
        {"primary": primary},
        gateway={"api_keys_env": "GATEWAY_TEST_KEYS"},
        layers={"telemetry": True, "logging": True},
    )
    caplog.set_level(logging.DEBUG)
    messages = [{"role": "user", "content": f"my secret is {canary}"}]
    primary.script(
        FakeResponse(
            text=f"answer {canary}", tool_calls=[("get_weather", f'{{"city": "{canary}"}}')]
        ),
        FakeResponse.error(503, message=f"echo {canary}"),
        FakeResponse(chunks=[canary], in_band_error={"type": "server_error"}, error_after=2),
    )
    async with running(cfg, **otel.providers) as gateway:
        client = gateway.client(f"key-{canary}")
        await ask(client, streaming, messages=messages, tools=[WEATHER_TOOL])
        with pytest.raises(openai.APIError):
            await ask(client, streaming, messages=messages)
        with pytest.raises(openai.APIError):
            await ask(client, True, messages=messages)
        bad = gateway.client(f"wrong-{canary}")
        with pytest.raises(openai.AuthenticationError) as raised:
            await ask(bad, streaming, messages=messages)
        assert canary not in raised.value.response.text
        await gateway.gateway.wait_idle()
        await client.close()
        await bad.close()
    logged = [r.getMessage() for r in caplog.records] + [str(r.args) for r in caplog.records]
    assert any("POST /v1/chat/completions 503" in line for line in logged)
    assert not [line for line in logged if canary in line]
    assert not [text for text in otel.everything_exported() if canary in text]


# -- shutdown ---------------------------------------------------------------------------------


async def test_shutdown_lets_streams_in_flight_finish(primary: FakeOpenAIServer) -> None:
    cfg = config({"primary": primary}, gateway={"drain_timeout": 30})
    primary.script(FakeResponse(chunks=["one ", "two ", "three"], chunk_delay=0.05))
    async with running(cfg) as gateway:
        client = gateway.client()
        stream = await client.chat.completions.create(
            model="pipeline", messages=MESSAGES, stream=True
        )
        received = ""
        async for chunk in stream:
            if chunk.choices:
                received += chunk.choices[0].delta.content or ""
            if received and not gateway.server.should_exit:
                gateway.server.should_exit = True  # shutdown starts mid-stream
        assert received == "one two three"
        await gateway.task  # the server stopped after the stream ended
        await client.close()


async def test_shutdown_past_the_drain_timeout_ends_streams_with_an_error(
    primary: FakeOpenAIServer, backup: FakeOpenAIServer
) -> None:
    cfg = config({"primary": primary, "backup": backup}, gateway={"drain_timeout": 0})
    primary.script(FakeResponse(chunks=["Hello ", "world"], hang_after=2))
    async with running(cfg) as gateway:
        client = gateway.client()
        stream = await client.chat.completions.create(
            model="pipeline", messages=MESSAGES, stream=True
        )
        received = ""
        with pytest.raises(openai.APIError) as raised:
            async for chunk in stream:
                received += chunk.choices[0].delta.content or "" if chunk.choices else ""
                gateway.server.should_exit = True
        assert received == "Hello "
        assert raised.value.code == "shutting_down"
        await primary.wait_for_disconnects(1)  # the upstream call was closed
        await gateway.task
        assert backup.count() == 0
        await client.close()


async def test_a_session_keeps_its_route(
    primary: FakeOpenAIServer, backup: FakeOpenAIServer
) -> None:
    cfg = config({"primary": primary, "backup": backup}, router={"affinity": {"store": "memory"}})
    primary.script(FakeResponse.error(503))
    async with running(cfg) as gateway:
        client = gateway.client()
        session = {SESSION_HEADER: "conversation-1"}
        assert (await ask(client, False, extra_headers=session)).model == "model-backup"
        assert (await ask(client, True, extra_headers=session)).model == "model-backup"
        assert (await ask(client, False)).model == "model-primary"  # no session: in order
        assert (primary.count(), backup.count()) == (2, 2)
        await client.close()


async def test_a_fault_of_the_gateway_itself_is_500_and_logged(
    one_route: Running,
    primary: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import pipeline.gateway._chat_completions as chat_completions
    from pipeline.gateway._forwarding import CHAT_FORWARDER

    def broken(*args: object, **kwargs: object) -> bytes:
        raise RuntimeError("a bug")

    # The answer's encoder on either path: the parsed one, and the forwarded one.
    monkeypatch.setattr(chat_completions, "completion", broken)
    monkeypatch.setattr(CHAT_FORWARDER, "completion", broken)
    client = one_route.client()
    with pytest.raises(openai.InternalServerError) as raised:
        await ask(client, False)
    assert raised.value.status_code == 500
    assert raised.value.body == {
        "message": "internal error",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert any("failed: RuntimeError" in r.getMessage() for r in caplog.records)
    assert (await ask(client, True)).text == TEXT  # the next request is served
    await client.close()


async def test_a_clients_stray_cancelled_error_is_a_failure_not_a_cancellation(
    one_route: Running, streaming: bool
) -> None:
    from pipeline.gateway.app import Target
    from pipeline.testing import ScriptedChatClient, fail, reply

    scripted = ScriptedChatClient([fail(asyncio.CancelledError()), reply("fine")])
    one_route.gateway.targets["pipeline"] = Target(scripted)
    client = one_route.client()
    with pytest.raises(openai.InternalServerError) as raised:
        await ask(client, streaming)
    assert (raised.value.status_code, raised.value.code) == (503, "upstream_error")
    assert (await ask(client, streaming)).text == "fine"  # the server serves on
    await client.close()


async def test_a_model_is_found_by_its_id_slashes_included(
    primary: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(
        {"primary": primary},
        gateway={
            **keyed(monkeypatch, "key-1"),
            "models": {"openai/gpt-4o-mini": "primary", "smart": "pipeline"},
        },
    )
    async with running(cfg) as gateway:
        client = gateway.client("key-1")
        model = await client.models.retrieve("openai/gpt-4o-mini")
        assert (model.id, model.object, model.owned_by) == (
            "openai/gpt-4o-mini",
            "model",
            "chat-pipeline",
        )
        assert (await client.models.retrieve("smart")).id == "smart"
        with pytest.raises(openai.NotFoundError) as raised:
            await client.models.retrieve("openai/gpt-5")
        assert raised.value.code == "model_not_found"
        await client.close()
        async with gateway.client("wrong") as wrong:
            with pytest.raises(openai.AuthenticationError):
                await wrong.models.retrieve("smart")


def test_every_route_kind_a_price_book_knows_is_priced_for_budget_reservations() -> None:
    """A budget reserves at a route's price, else the book's, by the provider name the
    route's client reports: every ``provider =`` kind but the local and scripted ones has
    one the book prices by, and it is the client's own."""
    from pydantic import TypeAdapter

    from pipeline.config import RouteConfig, VertexRouteConfig
    from pipeline.pricing import PROVIDERS

    routes = {
        "openai": {"provider": "openai", "model": "gpt-4o"},
        "responses": {"provider": "openai_responses", "model": "gpt-4o"},
        "azure": {
            "provider": "azure_openai",
            "endpoint": "https://example.openai.azure.com",
            "deployment": "gpt-4o",
        },
        "anthropic": {"provider": "anthropic", "model": "claude-sonnet-4-5"},
        "gemini": {"provider": "gemini", "model": "gemini-2.5-flash"},
        "bedrock": {"provider": "bedrock", "model": "amazon.nova-pro-v1:0", "region": "us-east-1"},
        "groq": {"provider": "groq", "model": "llama-3.3-70b-versatile"},
        "openrouter": {"provider": "openrouter", "model": "openai/gpt-4o"},
        "ollama": {"provider": "ollama", "model": "llama3"},
        "vllm": {"provider": "vllm", "model": "m", "base_url": "http://127.0.0.1:1/v1"},
        "scripted": {"provider": "scripted", "model": "m"},
    }
    tables: TypeAdapter[Any] = TypeAdapter(RouteConfig)
    built = {name: tables.validate_python(table) for name, table in routes.items()}
    # Vertex AI's table checks Google credentials when it is read: made without them.
    built["vertex"] = VertexRouteConfig.model_construct(model="gemini-2.5-flash")
    for name, route in built.items():
        provider = route.gen_ai_provider_name()
        if name in {"ollama", "vllm", "scripted"}:
            assert provider is None or PROVIDERS.get(provider) is None, name
        else:
            assert provider is not None and PROVIDERS.get(provider), name
