from collections.abc import AsyncIterator

import pytest

from pipeline.providers import OpenAIChatClient, _http
from pipeline.testing import FakeOpenAIServer

TRANSPORTS = ["aiohttp", "httpx2"]


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test once per HTTP transport: a client built without `transport=` or
    `http_client=` uses this one (the official-SDK-strict fake servers judge both)."""
    monkeypatch.setattr(_http, "DEFAULT_TRANSPORT", request.param)
    return str(request.param)


@pytest.fixture
async def server(transport: str) -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as fake:
        yield fake


@pytest.fixture
async def client(server: FakeOpenAIServer) -> AsyncIterator[OpenAIChatClient]:
    chat = OpenAIChatClient("gpt-test", api_key="sk-CANARY-key", base_url=server.base_url)
    yield chat
    await chat.aclose()
