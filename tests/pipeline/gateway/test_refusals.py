"""Requests the pipeline refuses before any provider is called are 400s naming the field,
never 5xx, in every format and both call shapes; vendors' enums are open: an unknown value
goes to a route of its own API as given, and a route of another API refuses it with a 400
naming the value and the route (DESIGN 17, "Wire packages")."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from pipeline import ChatPipeline
from pipeline.config import parse_config
from pipeline.errors import FailureKind, RequestRefusedError, classify, is_failover_eligible
from pipeline.testing import FakeAnthropicServer, FakeOpenAIServer, ScriptedChatClient, reply
from tests.pipeline.gateway.conftest import Running, running

pytestmark = pytest.mark.gateway

TOOLS_ONLY = {
    "type": "additional_tools",
    "role": "developer",
    "tools": [{"type": "function", "name": "wait", "parameters": {"type": "object"}}],
}


class Routes:
    """One gateway with a Chat Completions, a Responses and an Anthropic route, each a model
    name of its own, in front of fake upstreams that count their calls."""

    def __init__(self, gateway: Running, openai: FakeOpenAIServer, claude: FakeAnthropicServer):
        self.gateway = gateway
        self.openai = openai
        self.claude = claude

    def calls(self) -> int:
        return self.openai.count() + self.claude.count()

    async def post(self, path: str, body: dict[str, Any], streaming: bool) -> httpx.Response:
        async with httpx.AsyncClient(base_url=self.gateway.url, timeout=30) as client:
            return await client.post(path, json={**body, "stream": streaming})


@pytest.fixture
async def routes(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Routes]:
    monkeypatch.setenv("REFUSALS_UPSTREAM_KEY", "upstream-key")
    async with FakeOpenAIServer() as openai, FakeAnthropicServer() as claude:
        cfg = parse_config(
            {
                "routes": {
                    "gpt": {"provider": "openai", "model": "m", "base_url": openai.base_url},
                    "responses": {
                        "provider": "openai_responses",
                        "model": "m",
                        "base_url": openai.base_url,
                    },
                    "claude": {
                        "provider": "anthropic",
                        "model": "m",
                        "base_url": claude.base_url,
                        "api_key_env": "REFUSALS_UPSTREAM_KEY",
                    },
                },
                "router": {"kind": "ordered", "order": ["gpt", "responses", "claude"]},
            }
        )
        async with running(cfg) as gateway:
            yield Routes(gateway, openai, claude)


# -- refused before any provider is called ------------------------------------------------------


@pytest.mark.parametrize("model", ["gpt", "responses", "claude", "pipeline"])
async def test_a_responses_input_of_tools_only_is_a_400_naming_input(
    routes: Routes, model: str, streaming: bool
) -> None:
    response = await routes.post(
        "/v1/responses", {"model": model, "input": [TOOLS_ONLY, TOOLS_ONLY]}, streaming
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "input")
    assert routes.calls() == 0


@pytest.mark.parametrize("model", ["gpt", "claude", "pipeline"])
async def test_a_conversation_the_core_finds_empty_is_a_400_in_the_callers_format(
    routes: Routes, model: str, streaming: bool
) -> None:
    # A Messages request whose only turn is an empty system turn: the format keeps it (a
    # system turn may stand anywhere), the core finds no message at all.
    body = {"model": model, "max_tokens": 16, "messages": [{"role": "system", "content": ""}]}
    response = await routes.post("/v1/messages", body, streaming)
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("messages: ")
    assert "x-should-retry" not in response.headers
    assert routes.calls() == 0


async def test_the_pipeline_refuses_an_empty_conversation_with_a_typed_error(
    streaming: bool,
) -> None:
    first, second = ScriptedChatClient(reply("a")), ScriptedChatClient(reply("b"))
    pipeline = ChatPipeline.builder().use_ordered_failover([first, second]).build()
    with pytest.raises(RequestRefusedError) as raised:
        if streaming:
            async for _ in pipeline.get_streaming_response([]):
                pass
        else:
            await pipeline.get_response([])
    error = raised.value
    assert isinstance(error, ValueError)  # what `as_messages` always raised
    assert error.param == "messages"
    assert classify(error) is FailureKind.REQUEST_INVALID
    assert not is_failover_eligible(error)
    assert first.call_count == second.call_count == 0


# -- vendors' enums are open ----------------------------------------------------------------------


@pytest.mark.parametrize("effort", ["max", "ultra"])
async def test_an_openai_effort_goes_to_openai_routes_as_given(
    routes: Routes, effort: str, streaming: bool
) -> None:
    chat = {"model": "gpt", "messages": [{"role": "user", "content": "hi"}]}
    response = await routes.post(
        "/v1/chat/completions", {**chat, "reasoning_effort": effort}, streaming
    )
    assert response.status_code == 200, response.text
    assert routes.openai.requests[-1].json["reasoning_effort"] == effort
    responses = {"model": "responses", "input": "hi", "reasoning": {"effort": effort}}
    response = await routes.post("/v1/responses", responses, streaming)
    assert response.status_code == 200, response.text
    assert routes.openai.requests[-1].json["reasoning"]["effort"] == effort


async def test_an_effort_anthropic_has_is_translated(routes: Routes, streaming: bool) -> None:
    body = {"model": "claude", "messages": [{"role": "user", "content": "hi"}]}
    response = await routes.post(
        "/v1/chat/completions", {**body, "reasoning_effort": "max"}, streaming
    )
    assert response.status_code == 200, response.text
    assert routes.claude.requests[-1].json["output_config"] == {"effort": "max"}


async def test_an_effort_no_anthropic_word_exists_for_is_a_400_naming_it_and_the_route(
    routes: Routes, streaming: bool
) -> None:
    body = {"model": "claude", "messages": [{"role": "user", "content": "hi"}]}
    response = await routes.post(
        "/v1/chat/completions", {**body, "reasoning_effort": "ultra"}, streaming
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("reasoning.effort", "invalid_value")
    assert "'ultra'" in error["message"] and "route claude" in error["message"]
    assert "Anthropic Messages" in error["message"]
    assert routes.calls() == 0


@pytest.mark.parametrize(
    ("field", "value", "sent"),
    [
        ("output_config", {"effort": "ultra"}, "output_config.effort"),
        ("thinking", {"type": "auto"}, "thinking.type"),
    ],
)
async def test_an_anthropic_value_goes_to_anthropic_routes_and_is_refused_elsewhere(
    routes: Routes, field: str, value: dict[str, Any], sent: str, streaming: bool
) -> None:
    body = {
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
        field: value,
    }
    response = await routes.post("/v1/messages", {**body, "model": "claude"}, streaming)
    assert response.status_code == 200, response.text
    assert routes.claude.requests[-1].json[field] == value
    assert "untranslated" not in routes.claude.requests[-1].json
    for model in ("gpt", "responses"):
        response = await routes.post("/v1/messages", {**body, "model": model}, streaming)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith(f"{sent}: ") and f"route {model}" in error["message"]
    assert routes.openai.count() == 0


async def test_unknown_values_of_open_enums_are_taken_everywhere(
    routes: Routes, streaming: bool
) -> None:
    body = {
        "model": "responses",
        "input": "hi",
        "service_tier": "flex-2",
        "reasoning": {"summary": "verbose"},
        "text": {"verbosity": "terse"},
    }
    response = await routes.post("/v1/responses", body, streaming)
    assert response.status_code == 200, response.text
    sent = routes.openai.requests[-1].json
    assert (sent["reasoning"]["summary"], sent["text"]["verbosity"]) == ("verbose", "terse")
    chat = {
        "model": "gpt",
        "messages": [{"role": "user", "content": "hi"}],
        "service_tier": "flex-2",
        "verbosity": "terse",
    }
    response = await routes.post("/v1/chat/completions", chat, streaming)
    assert response.status_code == 200, response.text
    assert routes.openai.requests[-1].json["verbosity"] == "terse"
    messages = {
        "model": "claude",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
        "service_tier": "priority_plus",
        "speed": "warp",
    }
    response = await routes.post("/v1/messages", messages, streaming)
    assert response.status_code == 200, response.text
    sent = routes.claude.requests[-1].json
    assert (sent["service_tier"], sent["speed"]) == ("priority_plus", "warp")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"reasoning_effort": 1}, "reasoning_effort"),
        ("/v1/responses", {"reasoning": {"effort": ["high"]}}, "reasoning.effort"),
        ("/v1/responses", {"service_tier": 2}, "service_tier"),
        ("/v1/messages", {"output_config": {"effort": True}}, "output_config.effort"),
        ("/v1/messages", {"service_tier": {}}, "service_tier"),
    ],
)
async def test_the_types_of_open_enums_are_still_checked(
    routes: Routes, path: str, body: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
        "/v1/responses": {"input": "hi"},
        "/v1/messages": {"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
    }[path]
    response = await routes.post(path, {"model": "gpt", **base, **body}, False)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error.get("param", param) == param
    assert error["message"].startswith(f"{param}: ")
    assert routes.calls() == 0
