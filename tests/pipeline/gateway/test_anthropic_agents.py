"""``/v1/messages`` with what coding agents send (Claude Code 2.1.x), over real HTTP with the
official `anthropic` SDK as client: thinking, effort, output formats, context management,
mid-conversation system turns, prompt-cache breakpoints, deferred tools, model patterns,
``count_tokens`` and the errors under ``/v1/messages``; over an Anthropic route (close to
transparent) and a Chat Completions route (what it can use)."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import pytest

from pipeline.config import parse_config
from pipeline.gateway._anthropic_messages import estimate_tokens
from pipeline.gateway.settings import GatewaySettings
from pipeline.testing import FakeAnthropicServer, FakeOpenAIServer, FakeResponse
from pipeline.wire.messages.inbound import parse_count_tokens_request
from tests.pipeline.gateway.conftest import Running, running

pytestmark = pytest.mark.gateway

READ_TOOL = {
    "name": "Read",
    "description": "Read a file.",
    "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
}
DEFERRED_TOOL = {
    "name": "DeferredToolPlaceholder",
    "description": "never call this tool",
    "input_schema": {"type": "object", "properties": {}},
    "defer_loading": True,
}
EPHEMERAL = {"type": "ephemeral"}


def claude_code_request(**changes: Any) -> dict[str, Any]:
    """A request shaped as Claude Code 2.1.332 sends its first one (smaller)."""
    body: dict[str, Any] = {
        "model": "claude-opus-5-5",
        "max_tokens": 4096,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332;"},
            {"type": "text", "text": "You are a Claude agent.", "cache_control": EPHEMERAL},
            {"type": "text", "text": "Be an agent.", "cache_control": EPHEMERAL},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>attribution</system-reminder>"},
                    {"type": "text", "text": "Say hello"},
                ],
            },
            {
                "role": "system",
                "content": [{"type": "text", "text": "# Environment", "cache_control": EPHEMERAL}],
            },
        ],
        "tools": [READ_TOOL, DEFERRED_TOOL],
        "metadata": {"user_id": '{"device_id":"d"}'},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
    }
    body.update(changes)
    return body


def client(gateway: Running) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gateway.url, api_key="unused", max_retries=0)


async def send(sdk: anthropic.AsyncAnthropic, body: dict[str, Any], streaming: bool) -> Any:
    """The body as the SDK sends it (the fields it has no parameter for in `extra_body`),
    streamed or not; the final message."""
    body = copy.deepcopy(body)
    known = {"model", "max_tokens", "system", "messages", "tools", "metadata", "thinking"}
    params = {k: body.pop(k) for k in list(body) if k in known}
    if not streaming:
        return await sdk.messages.create(**params, extra_body=body)
    async with sdk.messages.stream(**params, extra_body=body) as stream:
        async for _ in stream:
            pass
        return await stream.get_final_message()


@pytest.fixture
async def claude_upstream() -> AsyncIterator[FakeAnthropicServer]:
    async with FakeAnthropicServer() as server:
        yield server


@pytest.fixture
async def openai_upstream() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server


def route(provider: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"provider": provider, "model": "upstream-model", "base_url": url, **extra}


@pytest.fixture
async def over_anthropic(
    claude_upstream: FakeAnthropicServer, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Running]:
    monkeypatch.setenv("FAKE_ANTHROPIC_KEY", "k")
    cfg = parse_config(
        {
            "routes": {
                "claude": route(
                    "anthropic", claude_upstream.base_url, api_key_env="FAKE_ANTHROPIC_KEY"
                )
            },
            "gateway": {"models": {"claude-*": "pipeline"}},
        }
    )
    async with running(cfg) as gateway:
        yield gateway


@pytest.fixture
async def over_chat_completions(openai_upstream: FakeOpenAIServer) -> AsyncIterator[Running]:
    cfg = parse_config(
        {
            "routes": {"gpt": route("openai", openai_upstream.base_url)},
            "gateway": {"models": {"pipeline": "pipeline", "claude-*": "pipeline"}},
        }
    )
    async with running(cfg) as gateway:
        yield gateway


async def test_claude_code_fields_reach_an_anthropic_route_as_sent(
    over_anthropic: Running, claude_upstream: FakeAnthropicServer, streaming: bool
) -> None:
    claude_upstream.script(FakeResponse(text="Hello.", thinking=""))
    sdk = client(over_anthropic)
    message = await send(sdk, claude_code_request(), streaming)
    assert [block.type for block in message.content] == ["thinking", "text"]
    body = claude_upstream.requests[0].json
    assert body["model"] == "upstream-model"
    assert body["thinking"] == {"type": "adaptive", "display": "omitted"}
    assert body["output_config"] == {"effort": "medium"}
    assert body["context_management"] == {
        "edits": [{"type": "clear_thinking_20251015", "keep": "all"}]
    }
    assert body["metadata"] == {"user_id": '{"device_id":"d"}'}
    # System blocks keep their breakpoints; the mid-conversation system turn is folded into
    # the system (the API has no place for it in `messages`), with its breakpoint.
    assert body["system"] == [
        {
            "type": "text",
            "text": "x-anthropic-billing-header: cc_version=2.1.332;\n\nYou are a Claude agent.",
            "cache_control": EPHEMERAL,
        },
        {"type": "text", "text": "Be an agent.", "cache_control": EPHEMERAL},
        {"type": "text", "text": "# Environment", "cache_control": EPHEMERAL},
    ]
    assert [m["role"] for m in body["messages"]] == ["user"]
    assert body["tools"][1] == DEFERRED_TOOL
    await sdk.close()


async def test_claude_code_fields_are_dropped_on_a_chat_completions_route(
    over_chat_completions: Running, openai_upstream: FakeOpenAIServer, streaming: bool
) -> None:
    sdk = client(over_chat_completions)
    message = await send(sdk, claude_code_request(), streaming)
    assert message.content[0].type == "text"
    body = openai_upstream.requests[0].json
    for field in ("thinking", "context_management", "output_config", "metadata", "anthropic"):
        assert field not in body
    # The system turn stays where it was: Chat Completions has a place for it.
    assert [m["role"] for m in body["messages"]] == ["system", "system", "user", "system"]
    assert body["messages"][-1]["content"] == "# Environment"
    assert [tool["function"]["name"] for tool in body["tools"]] == [
        "Read",
        "DeferredToolPlaceholder",
    ]
    assert "defer_loading" not in str(body["tools"])
    await sdk.close()


async def test_thinking_blocks_come_out_and_go_back_unchanged(
    over_anthropic: Running, claude_upstream: FakeAnthropicServer, streaming: bool
) -> None:
    claude_upstream.script(
        FakeResponse(
            text="Let me read it.",
            thinking="The user wants the file.",
            tool_calls=[("Read", '{"file_path": "a.txt"}')],
            cache_usage=(30, 0),
        ),
        FakeResponse(text="It says hi.", cache_usage=(3, 30)),
    )
    sdk = client(over_anthropic)
    question = {"role": "user", "content": "What is in a.txt?"}
    body = claude_code_request(
        messages=[question], thinking={"type": "enabled", "budget_tokens": 2048}
    )
    first = await send(sdk, body, streaming)
    thinking, text, call = first.content
    assert thinking.type == "thinking" and thinking.thinking == "The user wants the file."
    assert thinking.signature == claude_upstream.signature("The user wants the file.")
    assert (text.text, call.name, call.input) == ("Let me read it.", "Read", {"file_path": "a.txt"})
    assert first.stop_reason == "tool_use"
    assert (first.usage.cache_creation_input_tokens, first.usage.cache_read_input_tokens) == (30, 0)
    assert first.usage.input_tokens == 5  # Anthropic's count: without the cache's
    assistant = {"role": "assistant", "content": [b.model_dump() for b in first.content]}
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "hi"}],
    }
    body["messages"] = [question, assistant, result]
    second = await send(sdk, body, streaming)  # the fake refuses a changed signature
    assert second.content[-1].text == "It says hi."
    assert (second.usage.cache_creation_input_tokens, second.usage.cache_read_input_tokens) == (
        3,
        30,
    )
    sent = claude_upstream.requests[1].json["messages"][1]["content"]
    assert sent[0] == {
        "type": "thinking",
        "thinking": "The user wants the file.",
        "signature": thinking.signature,
    }
    # A forged signature is the upstream's 400, passed on as such.
    assistant["content"][0]["signature"] = "forged"
    with pytest.raises(anthropic.BadRequestError):
        await send(sdk, body, streaming)
    await sdk.close()


async def test_clear_thinking_is_dropped_when_there_is_no_thinking_to_clear(
    over_anthropic: Running, claude_upstream: FakeAnthropicServer, streaming: bool
) -> None:
    sdk = client(over_anthropic)
    body = claude_code_request(thinking={"type": "disabled"})
    await send(sdk, body, streaming)
    sent = claude_upstream.requests[0].json
    assert sent["thinking"] == {"type": "disabled"}
    assert "context_management" not in sent
    await sdk.close()


async def test_an_output_format_is_the_routes_response_format(
    over_anthropic: Running,
    claude_upstream: FakeAnthropicServer,
    over_chat_completions: Running,
    openai_upstream: FakeOpenAIServer,
    streaming: bool,
) -> None:
    schema = {"type": "object", "properties": {"title": {"type": "string"}}}
    output_config = {"format": {"type": "json_schema", "schema": schema}}
    body = claude_code_request(output_config=output_config)
    body.pop("thinking")
    body.pop("context_management")
    for gateway in (over_anthropic, over_chat_completions):
        sdk = client(gateway)
        await send(sdk, body, streaming)
        await sdk.close()
    assert claude_upstream.requests[0].json["output_config"] == output_config
    response_format = openai_upstream.requests[0].json["response_format"]
    assert response_format["type"] == "json_schema"
    assert response_format["json_schema"]["schema"] == schema


async def test_model_patterns_count_tokens_and_anthropic_errors_everywhere(
    over_chat_completions: Running, openai_upstream: FakeOpenAIServer
) -> None:
    sdk = client(over_chat_completions)
    counted = await sdk.messages.count_tokens(
        model="claude-haiku-4-5", messages=[{"role": "user", "content": "Say hello " * 40}]
    )
    assert 100 <= counted.input_tokens <= 120  # 400 characters, about 4 a token, + 4
    assert openai_upstream.count() == 0  # an estimate: no model is called
    models = await sdk.models.list()
    assert [m.id for m in models.data] == ["pipeline", "claude-*"]
    with pytest.raises(anthropic.NotFoundError) as raised:
        await sdk.messages.create(
            model="gpt-4o", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    assert raised.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    for path in ("/v1/messages/batches", "/v1/messages/count_tokens/x"):
        with pytest.raises(anthropic.NotFoundError) as raised:
            await sdk.post(path, body={}, cast_to=httpx.Response)
        assert raised.value.body == {  # type: ignore[comparison-overlap]
            "type": "error",
            "error": {"type": "not_found_error", "message": "no such endpoint"},
        }
    with pytest.raises(anthropic.NotFoundError) as raised:
        await sdk.messages.count_tokens(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
        )
    assert raised.value.body["type"] == "error"  # type: ignore[index]
    await sdk.close()


def test_count_tokens_estimate_is_documented_heuristic() -> None:
    request = parse_count_tokens_request(
        b'{"model": "m", "messages": [{"role": "user", "content": "abcdefgh"}]}'
    )
    assert estimate_tokens(request) == 2 + 4  # 8 characters over 4, + 4 for the message


def test_model_patterns_are_settings() -> None:
    settings = GatewaySettings(models={"claude-*": "pipeline", "gpt-[45]*": "pipeline"})
    assert settings.exposed_models(["a"]) == {"claude-*": "pipeline", "gpt-[45]*": "pipeline"}
    with pytest.raises(ValueError, match="glob patterns"):
        GatewaySettings(models={"claude *": "pipeline"})


async def test_beta_requests_and_their_betas_reach_anthropic_routes_only(
    over_anthropic: Running,
    claude_upstream: FakeAnthropicServer,
    over_chat_completions: Running,
    openai_upstream: FakeOpenAIServer,
    streaming: bool,
) -> None:
    betas = ["context-management-2025-06-27", "effort-2025-11-24"]
    for gateway in (over_anthropic, over_chat_completions):
        sdk = client(gateway)
        params: dict[str, Any] = {
            "model": "claude-opus-5-5",
            "max_tokens": 100,
            "messages": [{"role": "user", "content": "hi"}],
            "betas": betas,
        }
        # `beta.messages` posts to /v1/messages?beta=true with an anthropic-beta header.
        if streaming:
            async with sdk.beta.messages.stream(**params) as stream:
                message = await stream.get_final_message()
        else:
            message = await sdk.beta.messages.create(**params)
        assert message.content[0].type == "text"
        await sdk.close()
    assert claude_upstream.requests[0].headers["anthropic-beta"] == ",".join(betas)
    assert "betas" not in claude_upstream.requests[0].json
    assert "anthropic-beta" not in openai_upstream.requests[0].headers
    assert "betas" not in openai_upstream.requests[0].json
