"""Our OpenAI client and a full pipeline against llama-cpp-python's OpenAI-compatible server.

The model is a tiny random-weight llama written by the session (`tests.compat.tiny_gguf`):
greedy decoding answers its one designed word at every step and never stops on its own,
so an answer is exactly as long as the token limit the server honoured.

What llama-cpp-python does differently, as these tests pin down: it reads ``max_tokens``
and ignores ``max_completion_tokens`` (hence ``max_tokens_field="max_tokens"``); its
streams carry no usage; a forced tool call (``tool_choice`` naming a function, with the
``chatml-function-calling`` chat format) repeats the function name and call id in every
streamed delta.
"""

from __future__ import annotations

from typing import Any

import pytest

from middleware.routing import Route
from pipeline import ChatPipeline
from pipeline.providers import OpenAIChatClient
from pipeline.testing import collect
from pipeline.types import ChatOptions
from tests import transports
from tests.compat.helpers import CountingClient, Sleeps, function_calls, outcomes, resilient
from tests.compat.servers import MOCK_TEXT, LlamaServer, Proxy
from tests.compat.tiny_gguf import ANSWER_WORD
from tests.otel import Otel

transport = transports.transport  # the fixture
# Every test runs over both HTTP transports of the clients.
pytestmark = [pytest.mark.compat, pytest.mark.timeout(300), pytest.mark.usefixtures("transport")]

CITY_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris"]}},
            "required": ["city"],
        },
    },
}


def llama_client(server: LlamaServer, **options: Any) -> CountingClient:
    return CountingClient(
        OpenAIChatClient(
            server.model, api_key="sk-unused", base_url=server.base_url, name="llama", **options
        )
    )


async def test_max_tokens_field_limits_the_answer(
    llama_server: LlamaServer, streaming: bool
) -> None:
    chat = llama_client(llama_server, max_tokens_field="max_tokens")
    async with chat:
        result = await collect(
            chat, "Hi", ChatOptions(max_output_tokens=4, temperature=0.0), streaming=streaming
        )
    assert result.error is None, repr(result.error)
    assert result.text.split() == [ANSWER_WORD] * 4
    assert result.response is not None and result.response.finish_reason == "length"
    usage = result.response.usage
    if streaming:
        assert usage is None  # llama-cpp-python sends no usage in a stream
    else:
        assert usage is not None and usage.output_tokens == 4
        assert usage.input_tokens is not None and usage.input_tokens > 0
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert chat.calls == 1


async def test_max_completion_tokens_is_ignored_by_the_server(
    llama_server: LlamaServer, streaming: bool
) -> None:
    """Why `max_tokens_field` exists: with the default field the limit of 4 is not applied
    and the model talks until its context is full."""
    chat = llama_client(llama_server)
    async with chat:
        result = await collect(
            chat, "Hi", ChatOptions(max_output_tokens=4, temperature=0.0), streaming=streaming
        )
    assert result.error is None, repr(result.error)
    words = result.text.split()
    assert len(words) > 100 and set(words) == {ANSWER_WORD}
    assert result.response is not None and result.response.finish_reason == "length"


async def test_forced_tool_call(llama_server: LlamaServer, streaming: bool) -> None:
    """The grammar of the tool's schema forces ``{"city": "Paris"}``; streamed, each delta
    repeats the function name, which must not be concatenated."""
    chat = llama_client(llama_server, max_tokens_field="max_tokens")
    options = ChatOptions(
        tools=[CITY_TOOL],
        temperature=0.0,
        max_output_tokens=64,
        tool_mode="get_weather",  # sent as a tool_choice naming the function
    )
    async with chat:
        result = await collect(chat, "Weather in Paris?", options, streaming=streaming)
    assert result.error is None, repr(result.error)
    (call,) = function_calls(result)
    assert (call.name, dict(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.call_id.startswith("call_")
    assert result.text == ""
    assert result.response is not None and result.response.finish_reason == "tool_calls"
    assert chat.calls == 1


async def test_pipeline_fails_over_from_litellm_to_llama(
    litellm_proxy: Proxy, llama_server: LlamaServer, otel: Otel, streaming: bool
) -> None:
    """Two vendors in one pipeline: route a (LiteLLM, always 500) is retried once, then the
    request fails over to route b (llama-cpp-python), whose answer honours the token limit."""
    a = CountingClient(
        OpenAIChatClient(
            "mock-500", api_key=litellm_proxy.api_key, base_url=litellm_proxy.base_url, name="a"
        )
    )
    b = llama_client(llama_server, max_tokens_field="max_tokens")
    sleeps = Sleeps()
    chat = (
        ChatPipeline.builder()
        .use_telemetry(**otel.providers)
        .use_ordered_failover(
            [Route("a", resilient(a, "a", sleeps)), Route("b", resilient(b, "b", sleeps))],
            **otel.providers,
        )
        .build()
    )
    async with chat:
        result = await collect(
            chat, "Hi", ChatOptions(max_output_tokens=3, temperature=0.0), streaming=streaming
        )
    assert result.error is None, repr(result.error)
    assert result.text.split() == [ANSWER_WORD] * 3
    assert result.text != MOCK_TEXT
    assert (a.calls, b.calls) == (2, 1)
    assert sleeps.delays == [0.5]
    assert outcomes(otel) == [("a", "failed_before_output"), ("b", "completed")]
