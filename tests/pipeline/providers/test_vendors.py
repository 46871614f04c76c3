"""The OpenAI-compatible vendor presets over real HTTP, against FakeOpenAIServer at each
preset's base URL: what each vendor refuses is left out and what it names otherwise is
renamed on the wire, in both call shapes; their keys, names and reasoning fields."""

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pipeline import (
    ChatMessage,
    ChatOptions,
    FunctionCallContent,
    FunctionResultContent,
    ReasoningContent,
    ReasoningOptions,
)
from pipeline.providers import (
    DeepSeekChatClient,
    FireworksChatClient,
    GroqChatClient,
    MistralChatClient,
    OpenRouterChatClient,
    TogetherChatClient,
    VLLMChatClient,
    XAIChatClient,
)
from pipeline.providers.vendors import VENDOR_CLIENTS, mistral_call_id
from pipeline.testing import FakeOpenAIServer, FakeResponse, collect

pytestmark = pytest.mark.usefixtures("transport")

# What callers send: a seed, an output limit, and other APIs' sampling fields (the gateway
# passes the penalties, logit_bias, parallel_tool_calls and verbosity on; libraries may add
# logprobs or n).
OPTIONS = ChatOptions(
    max_output_tokens=10,
    seed=3,
    additional_properties={
        "logprobs": True,
        "top_logprobs": 2,
        "logit_bias": {"1": 1},
        "n": 1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "verbosity": "low",
        "parallel_tool_calls": False,
    },
)
SAMPLING = {
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "verbosity",
    "parallel_tool_calls",
}
MESSAGES = [ChatMessage("user", "hi", author_name="ada")]

# vendor -> (the output-limit field, fields left out, {field: its name there}, names kept)
WIRE: dict[str, tuple[str, set[str], dict[str, str], bool]] = {
    "groq": ("max_completion_tokens", {"logprobs", "top_logprobs", "logit_bias", "n"}, {}, False),
    "mistral": (
        "max_tokens",
        {"logit_bias", "logprobs", "top_logprobs", "verbosity", "stream_options"},
        {"seed": "random_seed"},
        True,
    ),
    "deepseek": ("max_tokens", {"logprobs", "top_logprobs"}, {}, True),
    "together": ("max_tokens", set(), {}, True),
    "fireworks": ("max_tokens", {"presence_penalty", "frequency_penalty"}, {}, True),
    "openrouter": ("max_tokens", set(), {}, True),
    "xai": ("max_completion_tokens", {"presence_penalty", "frequency_penalty"}, {}, True),
    "vllm": ("max_tokens", set(), {}, True),
}


@pytest.fixture
async def server() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as fake:
        yield fake


@pytest.mark.parametrize("vendor", sorted(VENDOR_CLIENTS))
async def test_each_preset_leaves_out_and_renames_on_the_wire(
    server: FakeOpenAIServer, vendor: str, streaming: bool
) -> None:
    limit, refused, renamed, names = WIRE[vendor]
    async with VENDOR_CLIENTS[vendor]("m", api_key="k", base_url=server.base_url) as client:
        result = await collect(client, MESSAGES, OPTIONS, streaming=streaming)
    assert result.error is None and result.text == "Hello from the fake server."
    body = server.requests[0].json
    assert body[limit] == 10
    assert {"max_tokens", "max_completion_tokens"} - {limit} - set(body) == {
        "max_tokens",
        "max_completion_tokens",
    } - {limit}
    assert set(body) & refused == set()
    assert SAMPLING - refused <= set(body)  # the rest reaches the vendor as it was
    for field, name in renamed.items():
        assert field not in body and body[name] == 3
    if "seed" not in renamed:
        assert body["seed"] == 3
    assert ("name" in body["messages"][0]) is names
    if streaming:
        assert ("stream_options" in body) is ("stream_options" not in refused)
    assert server.requests[0].headers["authorization"] == "Bearer k"
    assert client.metadata.provider_name == client.vendor.provider_name


@pytest.mark.parametrize(
    ("vendor", "name"),
    [
        ("groq", "groq"),
        ("mistral", "mistral_ai"),
        ("deepseek", "deepseek"),
        ("together", "together"),
        ("fireworks", "fireworks"),
        ("openrouter", "openrouter"),
        ("xai", "x_ai"),
        ("vllm", "vllm"),
    ],
)
def test_provider_names_and_keys(vendor: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.semconv._incubating.attributes.gen_ai_attributes import (
        GenAiProviderNameValues,
    )

    cls = VENDOR_CLIENTS[vendor]
    defined = {value.value for value in GenAiProviderNameValues}
    assert cls.provider_name == name
    # The conventions' value wherever they define the vendor.
    assert name in defined or vendor in ("together", "fireworks", "openrouter", "vllm")
    monkeypatch.delenv(cls.vendor.key_variable, raising=False)
    if cls.vendor.key_required:
        with pytest.raises(ValueError, match=cls.vendor.key_variable):
            cls("m")
        monkeypatch.setenv(cls.vendor.key_variable, "sk-from-env")
        client = cls("m")
        assert client._headers["Authorization"] == "Bearer sk-from-env"  # type: ignore[attr-defined]
        assert client.metadata.server_address == cls.vendor.base_url.split("/")[2]
    else:
        client = cls("m")  # a vLLM server of your own: no key needed
        assert "Authorization" not in client._headers  # type: ignore[attr-defined]
    # Another endpoint of the vendor's API takes no key unless given one.
    monkeypatch.delenv(cls.vendor.key_variable, raising=False)
    cls("m", base_url="http://127.0.0.1:9/v1")


async def test_openai_key_never_reaches_a_vendor(
    server: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-CANARY")
    monkeypatch.delenv("TOGETHER_API_KEY", raising=False)
    async with TogetherChatClient("m", base_url=server.base_url) as client:
        await collect(client, "hi", streaming=False)
    assert "authorization" not in server.requests[0].headers


async def test_openrouter_headers_and_reasoning(server: FakeOpenAIServer, streaming: bool) -> None:
    async with OpenRouterChatClient(
        "anthropic/claude-sonnet-4.5",
        api_key="k",
        base_url=server.base_url,
        app_url="https://example.com",
        app_name="Example",
    ) as client:
        for reasoning in (
            ReasoningOptions(effort="high"),
            ReasoningOptions(budget_tokens=2000),
            ReasoningOptions(effort="none"),
        ):
            await collect(client, "hi", ChatOptions(reasoning=reasoning), streaming=streaming)
    sent = [r.json for r in server.requests]
    assert [body.get("reasoning") for body in sent] == [
        {"effort": "high"},
        {"max_tokens": 2000},
        {"enabled": False},
    ]
    assert all("reasoning_effort" not in body for body in sent)
    headers = server.requests[0].headers
    assert (headers["http-referer"], headers["x-title"]) == ("https://example.com", "Example")


@pytest.mark.parametrize(
    ("reasoning", "thinking", "effort"),
    [
        (ReasoningOptions(effort="low"), {"type": "enabled"}, "high"),
        (ReasoningOptions(effort="xhigh"), {"type": "enabled"}, "max"),
        (ReasoningOptions(budget_tokens=500), {"type": "enabled"}, "high"),
        (ReasoningOptions(effort="none"), {"type": "disabled"}, None),
        (None, None, None),
    ],
)
async def test_deepseek_thinking_switch(
    server: FakeOpenAIServer,
    reasoning: ReasoningOptions | None,
    thinking: object,
    effort: str | None,
) -> None:
    async with DeepSeekChatClient("deepseek-chat", api_key="k", base_url=server.base_url) as client:
        await collect(client, "hi", ChatOptions(reasoning=reasoning), streaming=False)
    body = server.requests[0].json
    assert body.get("thinking") == thinking and body.get("reasoning_effort") == effort


async def test_deepseek_passes_reasoning_back_in_a_tool_loop(
    server: FakeOpenAIServer, streaming: bool
) -> None:
    server.script(
        FakeResponse(text="", reasoning="CANARY thought", tool_calls=[("f", "{}")]),
        FakeResponse(text="done"),
    )
    options = ChatOptions(tools=[{"type": "function", "function": {"name": "f"}}])
    async with DeepSeekChatClient("deepseek-chat", api_key="k", base_url=server.base_url) as client:
        first = await collect(client, "go", options, streaming=streaming)
        assert first.response is not None
        message = first.response.messages[-1]
        assert [c.text for c in message.contents if isinstance(c, ReasoningContent)] == [
            "CANARY thought"
        ]
        [call] = [c for c in message.contents if isinstance(c, FunctionCallContent)]
        history = [
            ChatMessage.user("earlier"),
            ChatMessage.assistant([ReasoningContent("old thought"), "plain answer"]),
            ChatMessage.user("go"),
            message,
            ChatMessage.tool(FunctionResultContent(call.call_id, "ok")),
        ]
        second = await collect(client, history, options, streaming=streaming)
    assert second.error is None
    sent = [m for m in server.requests[1].json["messages"] if m["role"] == "assistant"]
    # Only the turn with tool calls carries its reasoning back (DeepSeek requires it there).
    assert "reasoning_content" not in sent[0]
    assert sent[1]["reasoning_content"] == "CANARY thought"


async def test_mistral_tool_call_ids_and_reasoning_effort(
    server: FakeOpenAIServer, streaming: bool
) -> None:
    history = [
        ChatMessage.user("go"),
        ChatMessage.assistant([FunctionCallContent("call_abc_0123456789", "f", {})]),
        ChatMessage.tool(FunctionResultContent("call_abc_0123456789", "ok")),
        ChatMessage.assistant([FunctionCallContent("Ab3dE6gH9", "f", {})]),
        ChatMessage.tool(FunctionResultContent("Ab3dE6gH9", "ok")),
    ]
    options = ChatOptions(
        tools=[{"type": "function", "function": {"name": "f"}}],
        reasoning=ReasoningOptions(effort="medium"),
    )
    async with MistralChatClient(
        "mistral-small-latest", api_key="k", base_url=server.base_url
    ) as client:
        await collect(client, history, options, streaming=streaming)
    sent = server.requests[0].json
    mapped = mistral_call_id("call_abc_0123456789")
    assert (
        len(mapped) == 9 and mapped.isalnum() and mapped == mistral_call_id("call_abc_0123456789")
    )
    calls = [m["tool_calls"][0]["id"] for m in sent["messages"] if m.get("tool_calls")]
    results = [m["tool_call_id"] for m in sent["messages"] if m["role"] == "tool"]
    assert calls == results == [mapped, "Ab3dE6gH9"]  # Mistral's own ids as they are
    assert sent["reasoning_effort"] == "high"


async def test_mistral_content_chunks_are_text_and_reasoning(
    server: FakeOpenAIServer, streaming: bool
) -> None:
    content = [
        {"type": "thinking", "thinking": [{"type": "text", "text": "Let me see."}]},
        {"type": "text", "text": "Four."},
    ]
    if streaming:
        deltas = [
            ({"role": "assistant", "content": content[:1]}, None),
            ({"content": "Fo"}, None),
            ({"content": [{"type": "text", "text": "ur."}]}, "stop"),
        ]
        chunks = [
            {"id": "c", "model": "m", "choices": [{"index": 0, "delta": d, "finish_reason": f}]}
            for d, f in deltas
        ]
        lines = [line for chunk in chunks for line in (f"data: {json.dumps(chunk)}", "")]
        server.script(FakeResponse(raw_lines=[*lines, "data: [DONE]", ""]))
    else:
        message = {"role": "assistant", "content": content}
        body = {
            "id": "c",
            "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        }
        server.script(FakeResponse(body=body))
    async with MistralChatClient(
        "magistral-small-latest", api_key="k", base_url=server.base_url
    ) as client:
        result = await collect(client, "2+2?", streaming=streaming)
    assert result.error is None and result.response is not None
    assert result.text == "Four."
    reasoning = [c for c in result.response.messages[0].contents if isinstance(c, ReasoningContent)]
    assert [r.text for r in reasoning] == ["Let me see."]


def test_the_two_line_route(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.config import parse_config

    monkeypatch.setenv("GROQ_API_KEY", "sk-groq")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    config = parse_config(
        {
            "routes": {
                "fast": {"provider": "groq", "model": "llama-3.3-70b-versatile"},
                "local": {"provider": "vllm", "model": "Qwen/Qwen3-8B"},
            },
            "router": {"kind": "ordered", "order": ["fast", "local"]},
        }
    )
    fast = config.build_route("fast")
    local = config.build_route("local")
    assert isinstance(fast.client, GroqChatClient) and isinstance(local.client, VLLMChatClient)
    assert fast.client.metadata.server_address == "api.groq.com"
    monkeypatch.delenv("GROQ_API_KEY")
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        parse_config({"routes": {"fast": {"provider": "groq", "model": "m"}}})
    assert caught.value.key_path == "routes.fast.api_key_env"
    assert "GROQ_API_KEY" in str(caught.value)


def _all_clients() -> list[Any]:
    return [
        GroqChatClient,
        MistralChatClient,
        DeepSeekChatClient,
        TogetherChatClient,
        FireworksChatClient,
        OpenRouterChatClient,
        XAIChatClient,
        VLLMChatClient,
    ]


def test_every_preset_is_exported_and_named() -> None:
    assert sorted(VENDOR_CLIENTS.values(), key=str) == sorted(_all_clients(), key=str)
