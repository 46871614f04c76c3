"""What coding agents send to ``POST /v1/responses`` (Codex's fields, namespaces,
``additional_tools``, custom tools, built-in tools, reasoning and ``include``) and what
reasoning models give back, through the gateway, with the official `openai` SDK as a
strict client in both call shapes; and the usage details and reasoning of
``/v1/chat/completions``."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from pipeline.testing import RESPONSES_PATH, FakeOpenAIServer, FakeResponse
from tests.pipeline.gateway.conftest import Running, config, running

pytestmark = pytest.mark.gateway

THINKING = "CANARY-thinking about the files"
SCRIPT = 'const r = await tools.exec_command({cmd: "CANARY-ls"});'
FUNCTION = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a command.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
}
AGENT_REQUEST: dict[str, Any] = {
    "client_metadata": {"x-codex-installation-id": "abc"},
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "session-1",
    "reasoning": {"effort": "low", "summary": "auto", "context": "all_turns"},
    "parallel_tool_calls": False,
    "text": {"verbosity": "low"},
}
CODE_MODE_TOOLS = {
    "type": "additional_tools",
    "role": "developer",
    "tools": [
        {
            "type": "namespace",
            "name": "functions",
            "description": "",
            "tools": [
                {
                    "type": "custom",
                    "name": "exec",
                    "description": "Run JavaScript.",
                    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
                },
                {**FUNCTION, "name": "wait"},
            ],
        },
        {
            "type": "namespace",
            "name": "collaboration",
            "description": "",
            "tools": [{**FUNCTION, "name": "wait"}],
        },
    ],
}


@pytest.fixture
async def upstream() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server


def strict(gateway: Running) -> openai.AsyncOpenAI:
    return gateway.client(_strict_response_validation=True)


async def respond(
    gateway: Running, streaming: bool, body: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]], httpx.Headers]:
    """The final response object (and the stream's events) of one raw request, after the
    official SDK checked it."""
    body = {"model": "pipeline", **body}
    client = strict(gateway)
    extra = {k: v for k, v in body.items() if k not in ("model", "input")}
    if not streaming:
        raw = await client.responses.with_raw_response.create(
            model=body["model"], input=body["input"], extra_body=extra
        )
        raw.parse()  # the SDK's strict check
        return raw.http_response.json(), [], raw.headers
    events: list[dict[str, Any]] = []
    final: dict[str, Any] = {}
    async with client.responses.with_streaming_response.create(
        model=body["model"], input=body["input"], stream=True, extra_body=extra
    ) as raw:
        headers = raw.headers
        async for event in await raw.parse():
            payload = event.model_dump(mode="json", exclude_unset=True)
            events.append(payload)
            if event.type in ("response.completed", "response.incomplete"):
                final = payload["response"]
    return final, events, headers


async def test_a_codex_request_in_code_mode_is_served(
    upstream: FakeOpenAIServer, streaming: bool, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.script(
        FakeResponse(text="", custom_tool_calls=[("exec", SCRIPT)], usage=(12, 3)),
    )
    caplog.set_level(logging.INFO, logger="chat_pipeline.gateway")
    tools = [{"type": "web_search", "external_web_access": False}]
    async with running(config({"primary": upstream})) as gateway:
        final, events, headers = await respond(
            gateway,
            streaming,
            {
                **AGENT_REQUEST,
                "tools": tools,
                "input": [
                    CODE_MODE_TOOLS,
                    {"type": "message", "id": "msg_1", "role": "user", "content": "list"},
                ],
            },
        )
    assert headers["x-chat-pipeline-builtin-tools"] == "dropped=web_search"
    sent = upstream.requests[0].json
    names = [t["function"]["name"] for t in sent["tools"]]
    # Flattened: a name two namespaces share is prefixed with its namespace.
    assert names == ["exec", "functions__wait", "collaboration__wait"]
    assert sent["tools"][0]["function"]["parameters"]["required"] == ["input"]
    assert sent["reasoning_effort"] == "low"
    assert "client_metadata" not in sent and "include" not in sent
    assert "prompt_cache_key" not in sent  # OpenAI's prompt cache: Responses routes only
    (item,) = final["output"]
    assert item["type"] == "custom_tool_call"
    assert (item["name"], item["namespace"], item["input"]) == ("exec", "functions", SCRIPT)
    assert final["reasoning"] == {"effort": "low", "summary": "auto"}
    if streaming:
        kinds = [e["type"] for e in events]
        assert "response.custom_tool_call_input.delta" in kinds
    lines = [r.getMessage() for r in caplog.records if r.name == "chat_pipeline.gateway"]
    assert any("builtin_tools=dropped=web_search" in line for line in lines)
    assert not any("CANARY" in line for line in lines)


async def test_history_of_namespaced_and_custom_calls_reaches_the_route(
    upstream: FakeOpenAIServer, streaming: bool
) -> None:
    upstream.script(FakeResponse(text="Done."))
    history = [
        CODE_MODE_TOOLS,
        {"type": "message", "role": "user", "content": "list"},
        {
            "type": "reasoning",
            "id": "rs_gw_1",
            "summary": [{"type": "summary_text", "text": "t"}],
        },
        {"type": "custom_tool_call", "call_id": "c1", "name": "exec", "input": SCRIPT},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "a.txt"},
        {
            "type": "function_call",
            "call_id": "c2",
            "name": "wait",
            "namespace": "collaboration",
            "arguments": "{}",
        },
        {"type": "function_call_output", "call_id": "c2", "output": "ok"},
    ]
    async with running(config({"primary": upstream})) as gateway:
        final, _, _ = await respond(gateway, streaming, {**AGENT_REQUEST, "input": history})
    assert final["status"] == "completed"
    messages = upstream.requests[0].json["messages"]
    calls = [m["tool_calls"][0]["function"] for m in messages if m.get("tool_calls")]
    assert calls[0] == {"name": "exec", "arguments": json.dumps({"input": SCRIPT})}
    assert calls[1]["name"] == "collaboration__wait"
    assert [m["role"] for m in messages][-4:] == ["assistant", "tool", "assistant", "tool"]


async def test_built_in_tools_refused_when_configured(upstream: FakeOpenAIServer) -> None:
    cfg = config({"primary": upstream}, gateway={"builtin_tools": "refuse"})
    async with running(cfg) as gateway:
        client = strict(gateway)
        with pytest.raises(openai.BadRequestError) as raised:
            await client.responses.create(
                model="pipeline", input="hi", extra_body={"tools": [{"type": "web_search"}]}
            )
    assert raised.value.param == "tools"
    assert raised.value.code == "unsupported_tool"
    assert raised.value.response.headers["x-chat-pipeline-builtin-tools"] == "refused=web_search"
    assert upstream.count() == 0


async def test_the_prompt_cache_key_reaches_a_responses_route(
    upstream: FakeOpenAIServer, streaming: bool
) -> None:
    upstream.script(FakeResponse(text="Cached prefix.", cache_usage=(0, 5)), path=RESPONSES_PATH)
    cfg = config({"primary": upstream}, route_options={"primary": {"provider": "openai_responses"}})
    async with running(cfg) as gateway:
        final, _, _ = await respond(gateway, streaming, {**AGENT_REQUEST, "input": "hi"})
    assert final["status"] == "completed"
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 5
    sent = upstream.requests[0].json
    assert sent["prompt_cache_key"] == "session-1"
    assert "client_metadata" not in sent and "openai_responses" not in sent


@pytest.mark.parametrize("include", [True, False], ids=["include", "no_include"])
async def test_reasoning_items_from_a_responses_route(
    upstream: FakeOpenAIServer, streaming: bool, include: bool
) -> None:
    upstream.script(
        FakeResponse(
            text="Here.", reasoning=THINKING, reasoning_tokens=4, cache_usage=(0, 5), usage=(9, 6)
        ),
        FakeResponse(text="Again."),
        path=RESPONSES_PATH,
    )
    cfg = config({"primary": upstream}, route_options={"primary": {"provider": "openai_responses"}})
    request: dict[str, Any] = {"reasoning": {"effort": "high", "summary": "auto"}, "input": "hi"}
    if include:
        request["include"] = ["reasoning.encrypted_content"]
    async with running(cfg) as gateway:
        final, events, _ = await respond(gateway, streaming, request)
        reasoning, message = final["output"]
        assert reasoning["type"] == "reasoning"
        assert reasoning["summary"] == [{"type": "summary_text", "text": THINKING}]
        assert reasoning["id"] == "rs_fake_1"
        assert ("encrypted_content" in reasoning) is include
        assert message["content"][0]["text"] == "Here."
        usage = final["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] == 5
        assert usage["output_tokens_details"]["reasoning_tokens"] == 4
        if streaming:
            kinds = [e["type"] for e in events]
            assert kinds.index("response.reasoning_summary_text.delta") < kinds.index(
                "response.output_text.delta"
            )
            done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
            assert done[0]["type"] == "reasoning"
            assert ("encrypted_content" in done[0]) is include
        if include:
            # The next turn sends the item back; the upstream verifies what it issued.
            turn = [
                {"type": "message", "role": "user", "content": "hi"},
                reasoning,
                {"type": "message", "role": "assistant", "content": "Here."},
                {"type": "message", "role": "user", "content": "again"},
            ]
            again, _, _ = await respond(gateway, streaming, {**request, "input": turn})
            assert again["status"] == "completed"
            assert upstream.returned_reasoning == 1


async def test_chat_completions_usage_details_and_reasoning(
    upstream: FakeOpenAIServer, streaming: bool
) -> None:
    upstream.script(
        FakeResponse(text="Hi.", reasoning=THINKING, reasoning_tokens=2, cache_usage=(0, 7))
    )
    async with running(config({"primary": upstream})) as gateway:
        client = strict(gateway)
        if not streaming:
            raw = await client.chat.completions.with_raw_response.create(
                model="pipeline", messages=[{"role": "user", "content": "hi"}]
            )
            completion = raw.parse()
            usage = completion.usage
            body = raw.http_response.json()
            reasoning = body["choices"][0]["message"]["reasoning_content"]
        else:
            stream = await client.chat.completions.create(
                model="pipeline",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            pieces: list[str] = []
            usage = None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    extra = choice.delta.model_extra or {}
                    pieces.append(extra.get("reasoning_content") or "")
            reasoning = "".join(pieces)
    assert reasoning == THINKING
    assert usage is not None
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 7
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == 2


USER_TURN = {"type": "message", "role": "user", "content": "hi"}


def _function(name: str) -> dict[str, Any]:
    return {**FUNCTION, "name": name}


@pytest.mark.parametrize(
    ("tools", "sent"),
    [
        # A namespaced tool flattened to `ns__x` met a tool really named `ns__x`.
        (
            [
                _function("x"),
                _function("ns__x"),
                {"type": "namespace", "name": "ns", "tools": [_function("x")]},
            ],
            [(None, "x"), (None, "ns__x"), ("ns", "x")],
        ),
        # Two namespaces flattening to one name (`a__b__c`).
        (
            [
                {"type": "namespace", "name": "a", "tools": [_function("b__c")]},
                {"type": "namespace", "name": "q", "tools": [_function("b__c")]},
                {"type": "namespace", "name": "a__b", "tools": [_function("c")]},
                {"type": "namespace", "name": "r", "tools": [_function("c")]},
            ],
            [("a", "b__c"), ("q", "b__c"), ("a__b", "c"), ("r", "c")],
        ),
    ],
    ids=["real-tool-named-like-a-flattened-one", "two-namespaces-flatten-alike"],
)
async def test_every_tool_keeps_a_name_of_its_own_and_calls_map_back_to_it(
    upstream: FakeOpenAIServer,
    streaming: bool,
    tools: list[dict[str, Any]],
    sent: list[tuple[str | None, str]],
) -> None:
    # As Codex sends them: an input item (the SDK's strict check knows no namespace tools
    # in the echoed ``tools``).
    request = {"input": [{"type": "additional_tools", "tools": tools}, USER_TURN]}
    async with running(config({"primary": upstream})) as gateway:
        await respond(gateway, False, request)
        offered = [t["function"]["name"] for t in upstream.requests[0].json["tools"]]
        # One function per tool, none dropped, every name unique.
        assert len(offered) == len(sent) == len(set(offered))
        # The model calls each tool by the name it was offered: each call comes back to the
        # client as exactly that tool (its name and namespace).
        upstream.script(
            FakeResponse(text="", tool_calls=[(name, '{"cmd": "ls"}') for name in offered])
        )
        final, _, _ = await respond(gateway, streaming, request)
    calls = [item for item in final["output"] if item["type"] == "function_call"]
    assert [(c.get("namespace"), c["name"]) for c in calls] == sent
    # The same tools are offered under the same names on every turn (history maps back).
    assert [t["function"]["name"] for t in upstream.requests[1].json["tools"]] == offered
    assert all(len(name) <= 64 for name in offered)


async def test_a_flattened_name_past_64_characters_is_shortened_uniquely(
    upstream: FakeOpenAIServer,
) -> None:
    long = "n" * 60
    tools = [
        _function("wait"),
        {"type": "namespace", "name": long, "tools": [_function("wait")]},
        {"type": "namespace", "name": long + "x", "tools": [_function("wait")]},
    ]
    request = {"input": [{"type": "additional_tools", "tools": tools}, USER_TURN]}
    async with running(config({"primary": upstream})) as gateway:
        await respond(gateway, False, request)
    offered = [t["function"]["name"] for t in upstream.requests[0].json["tools"]]
    assert offered[0] == "wait"
    assert len(set(offered)) == 3 and all(len(name) <= 64 for name in offered)
