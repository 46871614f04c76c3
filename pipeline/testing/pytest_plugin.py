"""Pytest fixtures for testing pipelines with the fakes, opt-in (no entry point loads it
into every pytest run): name it in your top-level ``conftest.py``::

    pytest_plugins = ["pipeline.testing.pytest_plugin"]

* `streaming`: runs a test twice, once per call shape (``get_response``, then
  ``get_streaming_response``), so a behaviour is asserted for both;
* `fake_openai_server`, `fake_anthropic_server`, `fake_gemini_server`: a started
  `FakeOpenAIServer` / `FakeAnthropicServer` / `FakeGeminiServer` on 127.0.0.1 (a free
  port) for the test, closed after it. The async fixtures need pytest-asyncio;
* `fake_bedrock_server`: a started `FakeBedrockServer`, with the environment botocore reads
  pointed at it (its key, secret and region) for the test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from pipeline.testing import (
    FakeAnthropicServer,
    FakeBedrockServer,
    FakeGeminiServer,
    FakeOpenAIServer,
)

__all__ = [
    "fake_anthropic_server",
    "fake_bedrock_server",
    "fake_gemini_server",
    "fake_openai_server",
    "streaming",
]


@pytest.fixture(params=[False, True], ids=["get_response", "get_streaming_response"])
def streaming(request: pytest.FixtureRequest) -> bool:
    """Runs a test once per call shape: every streaming behaviour is tested for both."""
    return bool(request.param)


@pytest_asyncio.fixture
async def fake_openai_server() -> AsyncIterator[FakeOpenAIServer]:
    """A started `FakeOpenAIServer` (its `base_url` is the OpenAI ``base_url``)."""
    async with FakeOpenAIServer() as server:
        yield server


@pytest_asyncio.fixture
async def fake_anthropic_server() -> AsyncIterator[FakeAnthropicServer]:
    """A started `FakeAnthropicServer`."""
    async with FakeAnthropicServer() as server:
        yield server


@pytest_asyncio.fixture
async def fake_bedrock_server(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[FakeBedrockServer]:
    """A started `FakeBedrockServer`, its credentials and region in the environment (so a
    `BedrockChatClient` with ``base_url=server.base_url`` reaches it as it is)."""
    async with FakeBedrockServer() as server:
        for name, value in server.environment().items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        yield server


@pytest_asyncio.fixture
async def fake_gemini_server() -> AsyncIterator[FakeGeminiServer]:
    """A started `FakeGeminiServer` (its `base_url` is `GeminiChatClient`'s ``base_url``)."""
    async with FakeGeminiServer() as server:
        yield server
