import pytest

from pipeline import ChatOptions
from pipeline.errors import ContentFilteredError
from pipeline.providers import AzureOpenAIChatClient
from pipeline.testing import FakeOpenAIServer, FakeResponse, collect

# Every test runs over both HTTP transports (the `transport` fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("transport")


def _endpoint(server: FakeOpenAIServer) -> str:
    return server.base_url.removesuffix("/v1")


async def test_api_key_header_deployment_url_and_version(streaming: bool) -> None:
    async with FakeOpenAIServer() as server:
        client = AzureOpenAIChatClient(
            endpoint=_endpoint(server),
            deployment="gpt4o",
            api_key="CANARY-azure-key",
            api_version="2024-10-21",
        )
        result = await collect(client, "hi", ChatOptions(max_output_tokens=5), streaming=streaming)
        request = server.requests[0]
        assert request.path == "/openai/deployments/gpt4o/chat/completions"
        assert request.headers["api-key"] == "CANARY-azure-key"
        assert "model" not in request.json and request.json["max_tokens"] == 5
        assert "CANARY" not in repr(client)
        assert client.metadata.provider_name == "azure.ai.openai"
        assert result.text == "Hello from the fake server."
        await client.aclose()


async def test_token_provider(streaming: bool) -> None:
    tokens = iter(["t1", "t2"])

    async def token() -> str:
        return next(tokens)

    async with FakeOpenAIServer() as server:
        client = AzureOpenAIChatClient(
            endpoint=_endpoint(server), deployment="d", token_provider=token
        )
        await collect(client, "hi", streaming=streaming)
        await collect(client, "hi", streaming=streaming)
        assert [r.headers["authorization"] for r in server.requests] == ["Bearer t1", "Bearer t2"]
        await client.aclose()


async def test_content_filter_status(streaming: bool) -> None:
    async with FakeOpenAIServer() as server:
        server.script(
            FakeResponse.error(400, code="content_filter"),
            path="/openai/deployments/d/chat/completions",
        )
        client = AzureOpenAIChatClient(endpoint=_endpoint(server), deployment="d", api_key="k")
        result = await collect(client, "hi", streaming=streaming)
        assert isinstance(result.error, ContentFilteredError)
        assert result.error.url is not None and "api-version" not in result.error.url
        await client.aclose()


def test_configuration_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AZURE_OPENAI_API_KEY", raising=False)
    with pytest.raises(ValueError, match="api_key=, AZURE_OPENAI_API_KEY or token_provider="):
        AzureOpenAIChatClient(endpoint="https://x.openai.azure.com", deployment="d")
    with pytest.raises(ValueError, match="not both"):
        AzureOpenAIChatClient(
            endpoint="https://x.openai.azure.com",
            deployment="d",
            api_key="k",
            token_provider=lambda: "t",
        )
    with pytest.raises(ValueError, match="http"):
        AzureOpenAIChatClient(endpoint="x.openai.azure.com", deployment="d", api_key="k")
    with pytest.raises(ValueError, match="deployment"):
        AzureOpenAIChatClient(endpoint="https://x", deployment="", api_key="k")
