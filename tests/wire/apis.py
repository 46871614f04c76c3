"""The wire APIs the conformance suite drives: for each, a fake upstream from the kit (an
independent implementation: it judges the codecs and shares none of their code), the
provider client on it, its route in a configuration, and what the suite expects of the API
on the wire. A new API is one more `WireApi` in `APIS` (and its inbound format, when the
gateway serves one, in its `inbound`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.client import ChatClient
from pipeline.providers import (
    AnthropicChatClient,
    BedrockChatClient,
    GeminiChatClient,
    OpenAIChatClient,
    OpenAIResponsesChatClient,
)
from pipeline.testing import (
    CHAT_PATH,
    CONVERSE_PATH,
    GENERATE_CONTENT,
    MESSAGES_PATH,
    RESPONSES_PATH,
    FakeAnthropicServer,
    FakeBedrockServer,
    FakeGeminiServer,
    FakeOpenAIServer,
    FakeResponse,
)
from pipeline.testing._fake_server import FakeServer
from pipeline.types import ChatMessage, ReasoningOptions, UsageDetails
from pipeline.wire.bedrock import outbound as _bedrock
from pipeline.wire.chat_completions import outbound as _chat_completions
from pipeline.wire.gemini import outbound as _gemini
from pipeline.wire.messages import outbound as _messages
from pipeline.wire.responses import outbound as _responses

KEY = "sk-CANARY-wire-key"
KEY_VARIABLE = "WIRE_TEST_UPSTREAM_KEY"  # the routes' api_key_env (tests set it)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ARGUMENTS = json.dumps({"city": "Paris"})  # as the codecs write arguments


@dataclass(frozen=True)
class Inbound:
    """The gateway's inbound format of an API: its path, and requests in its shape."""

    path: str
    request: Callable[..., dict[str, Any]]
    """``request(messages=..., tools=..., tool_choice=..., stream=...)``: a body, from
    messages, tools and a choice already in this API's shape (see `tool`, `named`)."""
    tool: Callable[[str, str, Mapping[str, Any]], dict[str, Any]]
    """A function tool (name, description, schema) in this API's shape."""
    headers: Mapping[str, str]
    read: Callable[[str, bool], Answer]
    """What an answer in this API's shape says (a body, or a stream when the flag says so)."""
    conversation: tuple[str, ...]
    """The fields of a request that hold the conversation, its tools and its tool choice."""
    sample: Mapping[str, Any]
    """A conversation in this API's shape: a system prompt, a tool call and its result."""
    stream_fields: Mapping[str, Any] = field(default_factory=dict)
    """What a streamed request adds (Chat Completions asks for the usage chunk)."""


@dataclass
class Answer:
    """What an answer says, in any API: its text, its tool calls (id, name, decoded
    arguments), why it stopped (the API's own word) and its usage (the API's object)."""

    text: str = ""
    calls: list[tuple[str, str, Any]] = field(default_factory=list)
    finish: Any = None
    usage: Any = None

    def without_ids(self) -> Answer:
        """The same answer, its calls numbered instead of identified."""
        calls = [(str(n), name, args) for n, (_, name, args) in enumerate(self.calls)]
        return Answer(self.text, calls, self.finish, self.usage)


def _events(stream: str) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE text (``[DONE]`` left out)."""
    return [
        json.loads(line[len("data: ") :])
        for line in stream.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def _read_chat(text: str, streamed: bool) -> Answer:
    if not streamed:
        body = json.loads(text)
        choice = body["choices"][0]
        message = choice["message"]
        calls = [
            (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []
        ]
        return Answer(message["content"] or "", calls, choice["finish_reason"], body["usage"])
    answer = Answer()
    pending: dict[int, list[str]] = {}
    for chunk in _events(text):
        for choice in chunk["choices"]:
            delta = choice["delta"]
            answer.text += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                parts = pending.setdefault(call["index"], ["", "", ""])
                function = call.get("function") or {}
                parts[0] = call.get("id") or parts[0]
                parts[1] += function.get("name") or ""
                parts[2] += function.get("arguments") or ""
            answer.finish = choice.get("finish_reason") or answer.finish
        answer.usage = chunk.get("usage") or answer.usage
    answer.calls = [(i, n, json.loads(a)) for i, n, a in pending.values()]
    return answer


def _read_responses(text: str, streamed: bool) -> Answer:
    if streamed:  # the event that ends the stream carries the whole response
        (body,) = [e["response"] for e in _events(text) if e["type"] == "response.completed"]
    else:
        body = json.loads(text)
    answer = Answer(finish=body["status"], usage=body["usage"])
    for item in body["output"]:
        if item["type"] == "message":
            answer.text += "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            arguments = json.loads(item["arguments"])
            answer.calls.append((item["call_id"], item["name"], arguments))
    return answer


def _read_messages(text: str, streamed: bool) -> Answer:
    if not streamed:
        body = json.loads(text)
        answer = Answer(finish=body["stop_reason"], usage=body["usage"])
        for block in body["content"]:
            if block["type"] == "text":
                answer.text += block["text"]
            elif block["type"] == "tool_use":
                answer.calls.append((block["id"], block["name"], block["input"]))
        return answer
    answer = Answer(usage={})
    blocks: dict[int, list[Any]] = {}
    for event in _events(text):
        kind = event["type"]
        if kind == "message_start":
            answer.usage.update(event["message"]["usage"])
        elif kind == "content_block_start" and event["content_block"]["type"] == "tool_use":
            block = event["content_block"]
            blocks[event["index"]] = [block["id"], block["name"], ""]
        elif kind == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "text_delta":
                answer.text += delta["text"]
            elif delta["type"] == "input_json_delta":
                blocks[event["index"]][2] += delta["partial_json"]
        elif kind == "message_delta":
            answer.finish = event["delta"]["stop_reason"]
            answer.usage.update(event["usage"])
    answer.calls = [(i, n, json.loads(a or "{}")) for i, n, a in blocks.values()]
    return answer


@dataclass(frozen=True)
class WireApi:
    """One wire API as the suite drives it."""

    name: str
    fake: Callable[[], FakeServer]
    path: str
    client: Callable[[Any, str], ChatClient]
    """The provider client of this API on a fake (and a route name)."""
    route: Callable[[Any], dict[str, Any]]
    """The route table of a configuration, on a fake."""
    build: Callable[[list[ChatMessage]], dict[str, Any]]
    """The outbound codec alone: the request body of a conversation."""
    quiet_events: int
    """How many events a stream sends before its first text (role chunks, starts, pings)."""
    named: Callable[[str], Any]
    """The tool choice naming a tool (what `choice` reads of a request)."""
    none: Any
    """The tool choice asking for no tool call (None: no choice is sent)."""
    usage: Callable[[FakeResponse], UsageDetails]
    """The usage a client reads from the fake's answer to a script."""
    reasoning: ReasoningOptions
    """Options that make the fake reason."""
    reasoning_returns: bool
    """Whether the API takes its reasoning back, unchanged (a signature, encrypted
    content), on the next turn; else the reasoning is not sent back at all."""
    inbound: Inbound | None
    choice: Callable[[Mapping[str, Any]], Any] = lambda body: body.get("tool_choice")
    """Where a request says its tool choice."""
    environment: Callable[[Any], Mapping[str, str]] = lambda server: {}
    """What a client's environment needs to reach the fake (credentials)."""


def _openai_usage(response: FakeResponse, *, writes: bool) -> UsageDetails:
    (prompt, completion), (written, read) = response.usage, response.cache_usage
    return UsageDetails(
        input_tokens=prompt,
        output_tokens=completion,
        total_tokens=prompt + completion,
        reasoning_tokens=response.reasoning_tokens,
        cache_read_tokens=read,
        cache_write_tokens=written if writes else None,
    )


def _messages_usage(response: FakeResponse) -> UsageDetails:
    # Anthropic counts the prompt cache apart from the input: the client adds them up.
    (prompt, completion), (written, read) = response.usage, response.cache_usage
    return UsageDetails(
        input_tokens=prompt + written + read,
        output_tokens=completion,
        total_tokens=prompt + written + read + completion,
        cache_read_tokens=read,
        cache_write_tokens=written,
    )


def _chat_request(**fields: Any) -> dict[str, Any]:
    return {"model": "pipeline", **{k: v for k, v in fields.items() if v is not None}}


def _messages_request(**fields: Any) -> dict[str, Any]:
    return {"model": "pipeline", "max_tokens": 256, **_chat_request(**fields)}


def _responses_request(messages: list[Any] | None = None, **fields: Any) -> dict[str, Any]:
    return {**_chat_request(**fields), "input": messages}


def _openai_route(server: FakeOpenAIServer) -> dict[str, Any]:
    return {"provider": "openai", "model": "upstream-model", "base_url": server.base_url}


CHAT_COMPLETIONS = WireApi(
    name="chat_completions",
    fake=FakeOpenAIServer,
    path=CHAT_PATH,
    client=lambda server, name: OpenAIChatClient(
        "upstream-model", api_key=KEY, base_url=server.base_url, name=name
    ),
    route=_openai_route,
    build=lambda messages: _chat_completions.build_request(messages, None, model="m", stream=False),
    quiet_events=1,  # the role chunk
    named=lambda name: {"type": "function", "function": {"name": name}},
    none="none",
    usage=lambda response: _openai_usage(response, writes=False),
    reasoning=ReasoningOptions(effort="low"),
    reasoning_returns=False,  # these servers take no reasoning back
    inbound=Inbound(
        path=CHAT_PATH,
        request=_chat_request,
        tool=lambda name, description, schema: {
            "type": "function",
            "function": {"name": name, "description": description, "parameters": schema},
        },
        headers={},
        read=_read_chat,
        conversation=("messages", "tools", "tool_choice"),
        sample={
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": ARGUMENTS},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "user", "content": "And tomorrow?"},
            ]
        },
        stream_fields={"stream_options": {"include_usage": True}},
    ),
)

RESPONSES = WireApi(
    name="responses",
    fake=FakeOpenAIServer,
    path=RESPONSES_PATH,
    client=lambda server, name: OpenAIResponsesChatClient(
        "upstream-model", api_key=KEY, base_url=server.base_url, name=name
    ),
    route=lambda server: {**_openai_route(server), "provider": "openai_responses"},
    build=lambda messages: _responses.build_request(messages, None, model="m", stream=False),
    quiet_events=4,  # created, in_progress, output_item.added, content_part.added
    named=lambda name: {"type": "function", "name": name},
    none="none",
    usage=lambda response: _openai_usage(response, writes=True),
    reasoning=ReasoningOptions(effort="low", summary="auto"),
    reasoning_returns=True,  # encrypted content
    inbound=Inbound(
        path=RESPONSES_PATH,
        request=_responses_request,
        tool=lambda name, description, schema: {
            "type": "function",
            "name": name,
            "description": description,
            "parameters": schema,
        },
        headers={},
        read=_read_responses,
        conversation=("input", "tools", "tool_choice"),
        sample={
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": ARGUMENTS,
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {"role": "user", "content": "And tomorrow?"},
            ]
        },
    ),
)

MESSAGES = WireApi(
    name="messages",
    fake=FakeAnthropicServer,
    path=MESSAGES_PATH,
    client=lambda server, name: AnthropicChatClient(
        "upstream-model", api_key=KEY, base_url=server.base_url, name=name
    ),
    route=lambda server: {
        "provider": "anthropic",
        "model": "upstream-model",
        "base_url": server.base_url,
        "api_key_env": KEY_VARIABLE,
    },
    build=lambda messages: _messages.build_request(
        messages, None, model="m", max_tokens=16, stream=False
    ),
    quiet_events=3,  # message_start, content_block_start, ping
    named=lambda name: {"type": "tool", "name": name},
    none={"type": "none"},
    usage=_messages_usage,
    reasoning=ReasoningOptions(budget_tokens=1024),
    reasoning_returns=True,  # signed thinking blocks
    inbound=Inbound(
        path=MESSAGES_PATH,
        request=_messages_request,
        tool=lambda name, description, schema: {
            "name": name,
            "description": description,
            "input_schema": schema,
        },
        headers={"anthropic-version": "2023-06-01"},
        read=_read_messages,
        conversation=("system", "messages", "tools", "tool_choice"),
        sample={
            "system": "Be brief.",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
        },
    ),
)

CLAUDE_ON_BEDROCK = "anthropic.claude-sonnet-4-5-20250929-v1:0"


def _gemini_usage(response: FakeResponse) -> UsageDetails:
    (prompt, completion), read = response.usage, response.cache_usage[1]
    return UsageDetails(
        input_tokens=prompt,
        output_tokens=completion,  # thoughts included
        total_tokens=prompt + completion,
        reasoning_tokens=response.reasoning_tokens or None,
        cache_read_tokens=read or None,
    )


GEMINI = WireApi(
    name="gemini",
    fake=FakeGeminiServer,
    path=GENERATE_CONTENT,
    client=lambda server, name: GeminiChatClient(
        "gemini-test", api_key=KEY, base_url=server.base_url, name=name
    ),
    route=lambda server: {
        "provider": "gemini",
        "model": "gemini-test",
        "base_url": server.base_url,
        "api_key_env": KEY_VARIABLE,
    },
    build=lambda messages: _gemini.build_request(messages, None),
    quiet_events=0,  # every chunk carries content
    named=lambda name: {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": [name]}},
    none={"functionCallingConfig": {"mode": "NONE"}},
    choice=lambda body: body.get("toolConfig"),
    usage=_gemini_usage,
    reasoning=ReasoningOptions(effort="low", summary="auto"),
    reasoning_returns=True,  # thought signatures
    inbound=None,
)

BEDROCK = WireApi(
    name="bedrock",
    fake=FakeBedrockServer,
    path=CONVERSE_PATH,
    client=lambda server, name: BedrockChatClient(
        CLAUDE_ON_BEDROCK, base_url=server.base_url, name=name
    ),
    route=lambda server: {
        "provider": "bedrock",
        "model": CLAUDE_ON_BEDROCK,
        "base_url": server.base_url,
    },
    build=lambda messages: _bedrock.build_request(
        messages, None, model=CLAUDE_ON_BEDROCK, max_tokens=16
    ),
    quiet_events=1,  # messageStart
    named=lambda name: {"tool": {"name": name}},
    none=None,  # no toolChoice member says it
    choice=lambda body: (body.get("toolConfig") or {}).get("toolChoice"),
    usage=_messages_usage,  # counted apart from the cache, as Anthropic counts
    reasoning=ReasoningOptions(budget_tokens=1024),
    reasoning_returns=True,  # signed reasoning blocks
    inbound=None,
    environment=lambda server: server.environment(),
)

APIS: tuple[WireApi, ...] = (CHAT_COMPLETIONS, RESPONSES, MESSAGES, GEMINI, BEDROCK)
"""Every wire API a provider client speaks."""

INBOUND: tuple[WireApi, ...] = tuple(api for api in APIS if api.inbound is not None)
"""Those the gateway serves too."""


def sent(server: FakeServer, index: int = -1) -> dict[str, Any]:
    """The JSON body of a request the fake received."""
    body = server.requests[index].json
    assert isinstance(body, dict)
    return body


def carries(body: Any, *texts: str) -> bool:
    """Whether every one of `texts` appears in `body` (as JSON), exactly as given."""
    dumped = json.dumps(body)
    return all(text in dumped for text in texts)
