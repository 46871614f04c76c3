"""Every field an inbound format reads, replaced by a value of every JSON shape: the format
answers a 4xx (`WireError`) or serves the request, never a 500.

A rich, valid body per format is walked: each value in it (at any depth) is replaced in turn
by each hostile value, and the body parsed. A new field a format reads is covered as soon as
it is added to the body here."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from pipeline.gateway.wire import ChatRequest, WireError, parse_request
from pipeline.testing import FakeOpenAIServer
from pipeline.wire.messages.inbound import parse_count_tokens_request, parse_messages_request
from pipeline.wire.responses.inbound import parse_responses
from tests.pipeline.gateway.conftest import config, running

HOSTILE: list[Any] = [None, True, 0, -1, 1.5, "", "x", "\r\n\x00é", [], [1], [{}], {}, {"type": 1}]
"""A value of every JSON shape (and strings a header or a log line must never take raw)."""

CHAT_COMPLETIONS: dict[str, Any] = {
    "model": "pipeline",
    "messages": [
        {"role": "system", "content": "be brief", "name": "setup"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            ],
        },
        {
            "role": "assistant",
            "content": "calling",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ],
    "stream": False,
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
    "top_p": 0.5,
    "max_tokens": 10,
    "max_completion_tokens": 10,
    "stop": ["x"],
    "seed": 1,
    "tools": [
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
        }
    ],
    "tool_choice": {"type": "function", "function": {"name": "f"}},
    "response_format": {"type": "json_object"},
    "reasoning_effort": "low",
    "n": 1,
    "logprobs": False,
    "presence_penalty": 0.1,
    "parallel_tool_calls": True,
    "user": "u",
    "metadata": {"k": "v"},
}

RESPONSES: dict[str, Any] = {
    "model": "pipeline",
    "instructions": "be brief",
    "input": [
        {"type": "message", "role": "developer", "content": "rules"},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "look"},
                {"type": "input_image", "image_url": "https://example.com/a.png"},
            ],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "thought"}],
            "encrypted_content": "opaque",
        },
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "patch", "input": "text"},
        {
            "type": "custom_tool_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "ok"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [
                {"type": "output_text", "text": "so"},
                {"type": "refusal", "refusal": "no"},
            ],
        },
        {
            "type": "additional_tools",
            "tools": [{"type": "function", "name": "g", "parameters": {}}],
        },
    ],
    "tools": [
        {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}},
        {
            "type": "custom",
            "name": "patch",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
        },
        {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "h"}]},
        {"type": "web_search"},
    ],
    "tool_choice": {"type": "function", "name": "f"},
    "max_output_tokens": 10,
    "temperature": 0.5,
    "top_p": 0.5,
    "stream": False,
    "text": {
        "format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}},
        "verbosity": "low",
    },
    "reasoning": {"effort": "low", "summary": "auto"},
    "parallel_tool_calls": True,
    "store": False,
    "truncation": "disabled",
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "session-1",
    "metadata": {"k": "v"},
    "user": "u",
}

MESSAGES: dict[str, Any] = {
    "model": "pipeline",
    "max_tokens": 10,
    "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "t", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "text", "text": "done"}],
                    "is_error": False,
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        },
        {"role": "system", "content": "mid-conversation"},
    ],
    "temperature": 0.5,
    "top_p": 0.5,
    "top_k": 5,
    "stop_sequences": ["x"],
    "stream": False,
    "tools": [
        {"name": "f", "description": "d", "input_schema": {"type": "object"}, "strict": True},
        {"type": "web_search_20250305", "name": "web_search"},
    ],
    "tool_choice": {"type": "tool", "name": "f"},
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": {}}},
    "metadata": {"user_id": "u"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
    "cache_control": {"type": "ephemeral"},
}

Parse = Callable[..., ChatRequest]
FORMATS: dict[str, tuple[Parse, dict[str, Any]]] = {
    "chat_completions": (parse_request, CHAT_COMPLETIONS),
    "responses": (parse_responses, RESPONSES),
    "messages": (parse_messages_request, MESSAGES),
    "count_tokens": (parse_count_tokens_request, MESSAGES),
}


def paths(value: Any, where: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every value in `value` (the root's own excluded)."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        yield (*where, key)
        if isinstance(item, dict | list) and item:
            yield from paths(item, (*where, key))


def replaced(body: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(body)
    target: Any = changed
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return changed


def shown(path: tuple[Any, ...]) -> str:
    return "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in path)[1:]


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_rich_body_is_served(name: str) -> None:
    parse, body = FORMATS[name]
    parse(json.dumps(body).encode())


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_field_of_every_shape_is_a_4xx_or_served(name: str) -> None:
    parse, body = FORMATS[name]
    crashed: list[str] = []
    walked = 0
    for path in paths(body):
        for value in HOSTILE:
            walked += 1
            data = json.dumps(replaced(body, path, value)).encode()
            try:
                parse(data)
            except WireError as exc:
                if not 400 <= exc.status < 500:
                    crashed.append(f"{shown(path)} = {value!r}: {exc.status}")
            except Exception as exc:  # the bug: a 500
                crashed.append(f"{shown(path)} = {value!r}: {type(exc).__name__}")
    assert walked > 500
    assert crashed == []


@pytest.mark.parametrize(
    ("path", "body", "status_type"),
    [
        ("/v1/messages", {**MESSAGES, "output_config": {"format": "json"}}, "error"),
        ("/v1/messages", {**MESSAGES, "output_config": {"effort": ["high"]}}, "error"),
        ("/v1/messages", {**MESSAGES, "output_config": {"effort": {"level": 1}}}, "error"),
        ("/v1/responses", {**RESPONSES, "tools": [{"type": ["function"], "name": "f"}]}, None),
        ("/v1/responses", {**RESPONSES, "tools": [{"type": {"a": 1}, "name": "f"}]}, None),
        ("/v1/chat/completions", {**CHAT_COMPLETIONS, "reasoning_effort": ["low"]}, None),
    ],
)
async def test_malformed_new_fields_are_400_in_the_formats_own_shape(
    path: str, body: dict[str, Any], status_type: str | None
) -> None:
    async with (
        FakeOpenAIServer() as upstream,
        running(config({"primary": upstream})) as gateway,
        httpx.AsyncClient() as http,
    ):
        response = await http.post(f"{gateway.url}{path}", json=body)
    assert response.status_code == 400, response.text
    payload = response.json()
    if status_type == "error":  # Anthropic's shape
        assert payload["type"] == "error"
        assert payload["error"]["type"] == "invalid_request_error"
    else:
        assert payload["error"]["type"] == "invalid_request_error"
        assert payload["error"]["param"]
    assert upstream.count() == 0
