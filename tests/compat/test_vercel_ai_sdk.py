"""The Vercel AI SDK's default OpenAI provider through Node against the gateway.

``createOpenAI({baseURL})(model)`` calls ``POST /v1/responses`` (the Responses API), not
Chat Completions: `generateText`, `streamText`, tool loops (the SDK runs the tool and
sends its ``function_call_output`` back) with ``store: false`` and with the SDK's defaults
(stored responses: the second step refers to the first one's output by ``item_reference``),
for a plain and a reasoning model, and a stream that fails after output.

Client (the ``ai`` and ``@ai-sdk/openai`` npm packages, in Node) -> gateway (in this test's
event loop) -> fake upstream.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.compat.node import ai_sdk, node
from tests.pipeline.gateway.conftest import config, running

pytestmark = pytest.mark.compat

SCRIPT_TIMEOUT = 120.0
REASONING_MODEL = "gpt-5-mini"  # an id the SDK takes for a reasoning model


@pytest.fixture(scope="module")
def sdk_dir() -> Path:
    return ai_sdk()


@pytest.fixture
async def upstream() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server


async def run_script(directory: Path, script: str, env: dict[str, str]) -> dict[str, Any]:
    """Run a Node script of `directory`; what it printed, as JSON."""
    process = await asyncio.create_subprocess_exec(
        node(),
        script,
        cwd=directory,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(SCRIPT_TIMEOUT):
            out, err = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        pytest.fail(f"{script} did not finish in {SCRIPT_TIMEOUT:.0f} s")
    if process.returncode != 0:
        pytest.fail(f"{script} failed (exit {process.returncode}):\n{err.decode()[-4000:]}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def test_generate_stream_tools_and_a_failure_after_output(
    sdk_dir: Path, upstream: FakeOpenAIServer
) -> None:
    upstream.script(
        FakeResponse(text="Hello from the gateway.", usage=(9, 4)),
        FakeResponse(chunks=["Hello ", "from ", "the ", "stream."], usage=(9, 4)),
        FakeResponse(
            text="Let me check.", tool_calls=[("get_weather", '{"city": "Paris"}')], usage=(20, 5)
        ),
        FakeResponse(text="It is sunny in Paris.", usage=(30, 6)),
        FakeResponse(text="Let me check.", tool_calls=[("get_weather", '{"city": "Paris"}')]),
        FakeResponse(text="Sunny, by reference."),
        FakeResponse(
            text="Let me check.",
            reasoning="CANARY-reasoning the user wants the weather",
            tool_calls=[("get_weather", '{"city": "Paris"}')],
        ),
        FakeResponse(text="Sunny, after thinking.", reasoning="CANARY-reasoning done"),
        FakeResponse(
            chunks=["Hello ", "wor", "ld"],
            in_band_error={"type": "server_error", "code": "server_error"},
            error_after=3,
        ),
    )
    models = {"pipeline": "pipeline", REASONING_MODEL: "pipeline"}
    async with running(config({"primary": upstream}, gateway={"models": models})) as gateway:
        result = await run_script(
            sdk_dir,
            "ai_sdk.mjs",
            {
                "GATEWAY_BASE_URL": gateway.base_url,
                "GATEWAY_API_KEY": "unused",
                "GATEWAY_MODEL": "pipeline",
                "GATEWAY_REASONING_MODEL": REASONING_MODEL,
            },
        )
    generated = result["generated"]
    assert generated["text"] == "Hello from the gateway."
    assert generated["finishReason"] == "stop"
    assert generated["usage"] == {"inputTokens": 9, "outputTokens": 4, "totalTokens": 13}

    streamed = result["streamed"]
    assert streamed["chunks"] == ["Hello ", "from ", "the ", "stream."]  # as they arrived
    assert streamed["text"] == "Hello from the stream."
    assert streamed["finishReason"] == "stop"
    assert streamed["usage"] == {"inputTokens": 9, "outputTokens": 4, "totalTokens": 13}

    tools = result["tools"]
    # The SDK ran the tool the model called, once in each of the three loops.
    assert tools["calls"] == ["Paris", "Paris", "Paris"]
    assert tools["steps"] == 2
    assert tools["text"] == "It is sunny in Paris."  # the last step's
    assert tools["usage"] == {"inputTokens": 50, "outputTokens": 11, "totalTokens": 61}
    # The second step carried the call and the tool's output back to the model.
    sent = upstream.requests[3].json["messages"]
    assert sent[1]["content"] == "Let me check."
    assert sent[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    call_id = sent[1]["tool_calls"][0]["id"]
    assert sent[2] == {"role": "tool", "tool_call_id": call_id, "content": "Sunny in Paris"}

    # The SDK's defaults: the second step names the model's text by id; the gateway
    # found it among the responses it stored and the model got the whole conversation.
    defaults = result["defaults"]
    assert (defaults["steps"], defaults["text"]) == (2, "Sunny, by reference.")
    assert [s["input"] for s in defaults["sent"]] == [
        ["message"],
        ["message", "item_reference", "function_call", "function_call_output"],
    ]
    sent = upstream.requests[5].json["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    assert sent[1]["content"] == "Let me check."

    # A reasoning model with the SDK's defaults: its reasoning and text by reference.
    reasoning = result["reasoning"]
    assert (reasoning["steps"], reasoning["text"]) == (2, "Sunny, after thinking.")
    assert reasoning["reasoning"] == "CANARY-reasoning the user wants the weather"
    assert reasoning["sent"][1]["input"] == [
        "message",
        "item_reference",
        "item_reference",
        "function_call",
        "function_call_output",
    ]
    sent = upstream.requests[7].json["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    assert sent[1]["content"] == "Let me check."
    assert sent[1]["tool_calls"][0]["function"]["name"] == "get_weather"

    broken = result["broken"]
    assert "".join(broken["chunks"]) == "Hello wor"  # nothing repeated, nothing lost
    assert len(broken["errors"]) == 1  # the error event, not twice with response.failed
    assert upstream.count() == 9
