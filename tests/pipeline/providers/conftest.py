from collections.abc import AsyncIterator

import pytest

from pipeline.providers import OpenAIChatClient
from pipeline.testing import FakeOpenAIServer
from tests import transports

transport = transports.transport  # the fixture, for this folder's tests


@pytest.fixture
async def server(transport: str) -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as fake:
        yield fake


@pytest.fixture
async def client(server: FakeOpenAIServer) -> AsyncIterator[OpenAIChatClient]:
    chat = OpenAIChatClient("gpt-test", api_key="sk-CANARY-key", base_url=server.base_url)
    yield chat
    await chat.aclose()
