"""VertexChatClient over real HTTP: Gemini and Anthropic's models on the fake's Vertex AI
paths, authenticated by google-auth with a service account the test makes (a fresh RSA key)
against a fake token endpoint; tokens refreshed ahead of expiry; credentials checked when
the configuration is read and when the route is built."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pipeline import ChatMessage, ChatOptions, FunctionResultContent, ReasoningOptions, UsageDetails
from pipeline.config import parse_config
from pipeline.errors import (
    AuthenticationError,
    ConfigError,
    RateLimitedError,
    TransientProviderError,
)
from pipeline.providers import VertexChatClient
from pipeline.providers.vertex import VertexAnthropicChatClient, VertexGeminiChatClient
from pipeline.testing import (
    RAW_PREDICT,
    FakeGeminiServer,
    FakeGoogleTokenServer,
    FakeResponse,
    collect,
)

pytestmark = pytest.mark.usefixtures("transport")

PREFIX = "/v1/projects/fake-project/locations/us-central1/publishers"


@pytest.fixture
async def tokens() -> AsyncIterator[FakeGoogleTokenServer]:
    async with FakeGoogleTokenServer() as server:
        yield server


@pytest.fixture
def key_file(tokens: FakeGoogleTokenServer, tmp_path: Path) -> str:
    path = tmp_path / "service-account.json"
    path.write_text(json.dumps(tokens.service_account_info()))
    return str(path)


@pytest.fixture
async def server(tokens: FakeGoogleTokenServer) -> AsyncIterator[FakeGeminiServer]:
    async with FakeGeminiServer(tokens=tokens) as fake:
        yield fake


def vertex(server: FakeGeminiServer, key_file: str, model: str, **options: Any) -> Any:
    return VertexChatClient(
        model,
        project="fake-project",
        location="us-central1",
        credentials=key_file,
        base_url=server.vertex_base_url,
        **options,
    )


def bearers(server: FakeGeminiServer) -> list[str]:
    return [r.headers["authorization"].removeprefix("Bearer ") for r in server.requests]


async def test_gemini_on_vertex(
    server: FakeGeminiServer, tokens: FakeGoogleTokenServer, key_file: str, streaming: bool
) -> None:
    client = vertex(server, key_file, "gemini-test", name="primary")
    assert isinstance(client, VertexGeminiChatClient)
    server.script(FakeResponse(text="one two", usage=(4, 3)), FakeResponse(text="again"))
    first = await collect(client, "hi", streaming=streaming)
    second = await collect(client, "hi", streaming=streaming)
    assert first.error is None and first.text == "one two"
    assert first.response is not None and first.response.usage == UsageDetails(4, 3, 7)
    assert second.error is None and second.text == "again"
    method = "streamGenerateContent" if streaming else "generateContent"
    assert server.requests[0].path == f"{PREFIX}/google/models/gemini-test:{method}"
    # One token, fetched for the first request and kept.
    assert tokens.requests == 1 and bearers(server) == [tokens.issued[0]] * 2
    assert "x-goog-api-key" not in server.requests[0].headers
    assert client.metadata.provider_name == "gcp.vertex_ai"
    assert client.metadata.model_id == "gemini-test" and client.metadata.name == "primary"
    assert tokens.issued[0] not in repr(client)
    await client.aclose()


async def test_anthropic_on_vertex(
    server: FakeGeminiServer, tokens: FakeGoogleTokenServer, key_file: str, streaming: bool
) -> None:
    client = vertex(server, key_file, "claude-test@20250929", max_tokens=99)
    assert isinstance(client, VertexAnthropicChatClient)
    server.script(
        FakeResponse(text="", thinking="Need the tool.", tool_calls=[("f", '{"x": 1}')]),
        FakeResponse(text="Done."),
        path=RAW_PREDICT,
    )
    options = ChatOptions(reasoning=ReasoningOptions(budget_tokens=1024))
    first = await collect(client, "go", options, streaming=streaming)
    assert first.error is None and first.response is not None
    request = server.requests[0]
    method = "streamRawPredict" if streaming else "rawPredict"
    assert request.path == f"{PREFIX}/anthropic/models/claude-test@20250929:{method}"
    assert request.json["anthropic_version"] == "vertex-2023-10-16"
    assert "model" not in request.json and request.json["max_tokens"] == 99
    assert "anthropic-version" not in request.headers and "x-api-key" not in request.headers
    assert request.headers["authorization"] == f"Bearer {tokens.issued[0]}"
    # The Messages wire as AnthropicChatClient's: thinking signatures go back as they came
    # (the fake refuses a tool turn without them).
    call = first.response.messages[0].contents[-1]
    turn = [
        ChatMessage.user("go"),
        *first.response.messages,
        ChatMessage.tool(FunctionResultContent(getattr(call, "call_id", ""), "1")),
    ]
    second = await collect(client, turn, options, streaming=streaming)
    assert second.error is None and second.text == "Done."
    assert server.count(RAW_PREDICT) == 2 and server.count() == 0
    assert client.metadata.provider_name == "gcp.vertex_ai"
    await client.aclose()


async def test_vertex_errors_in_googles_and_anthropics_shapes(
    server: FakeGeminiServer, key_file: str, streaming: bool
) -> None:
    """Vertex AI's own errors (quota) are Google's shape whatever the publisher; a model's
    own are its API's: both map to their kinds, with the wait asked for."""
    client = vertex(server, key_file, "claude-test")
    server.script(
        FakeResponse.error(429, message="CANARY quota", retry_after="11"),
        FakeResponse.error(529, type="overloaded_error", message="CANARY"),
        path=RAW_PREDICT,
    )
    quota = await collect(client, "hi", streaming=streaming)
    assert isinstance(quota.error, RateLimitedError) and quota.error.retry_after == 11.0
    assert quota.error.code == "RESOURCE_EXHAUSTED" and "CANARY" not in str(quota.error)
    overloaded = await collect(client, "hi", streaming=streaming)
    assert isinstance(overloaded.error, TransientProviderError)
    assert overloaded.error.code == "overloaded_error"
    assert overloaded.error.provider == "gcp.vertex_ai"
    await client.aclose()


async def test_a_token_is_refreshed_ahead_of_its_expiry_in_the_background(
    server: FakeGeminiServer, tokens: FakeGoogleTokenServer, key_file: str
) -> None:
    # Valid for 100 s: below the refresh-ahead margin (300 s), above the wait margin (30 s).
    tokens.expires_in = 100
    client = vertex(server, key_file, "gemini-test")
    await client.get_response("one")  # no token yet: this request waits for one
    tokens.expires_in = 3600  # the next token lasts: one refresh ahead, no more
    await client.get_response("two")  # the token is good: sent, and a refresh starts
    refresh = client._tokens._task
    assert refresh is not None
    await refresh
    await client.get_response("three")
    assert tokens.requests == 2
    assert bearers(server) == [tokens.issued[0], tokens.issued[0], tokens.issued[1]]
    await client.aclose()


async def test_a_token_about_to_expire_is_waited_for(
    server: FakeGeminiServer, tokens: FakeGoogleTokenServer, key_file: str, streaming: bool
) -> None:
    tokens.expires_in = 10  # below the wait margin: each request needs a new token
    client = vertex(server, key_file, "gemini-test")
    for _ in range(2):
        result = await collect(client, "hi", streaming=streaming)
        assert result.error is None
    assert bearers(server) == tokens.issued and len(tokens.issued) == 2
    await client.aclose()


async def test_refused_credentials_are_an_authentication_error_before_any_call(
    server: FakeGeminiServer,
    tokens: FakeGoogleTokenServer,
    key_file: str,
    streaming: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tokens.refusing = "invalid_grant"
    client = vertex(server, key_file, "gemini-test")
    result = await collect(client, "CANARY-prompt", streaming=streaming)
    assert isinstance(result.error, AuthenticationError)
    assert result.error.code == "invalid_grant" and result.updates == []
    assert server.count() == 0 and "CANARY" not in str(result.error)
    # A refresh that fails in the background is logged, naming no secret.
    tokens.refusing = None
    tokens.expires_in = 100
    await client.get_response("hi")
    tokens.refusing = "invalid_grant"
    caplog.set_level(logging.WARNING, logger="chat_pipeline.providers")
    await client.get_response("hi")  # sent with the good token; the refresh fails
    refresh = client._tokens._task
    assert refresh is not None
    with pytest.raises(Exception, match="refused"):
        await refresh
    assert "invalid_grant" in caplog.text
    assert tokens.issued[0] not in caplog.text and "PRIVATE KEY" not in caplog.text
    await client.aclose()


async def test_an_unreachable_token_endpoint_is_transient(
    server: FakeGeminiServer, tokens: FakeGoogleTokenServer, tmp_path: Path, streaming: bool
) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}/token"
    info = {**tokens.service_account_info(), "token_uri": closed}
    path = tmp_path / "key.json"
    path.write_text(json.dumps(info))
    client = vertex(server, str(path), "gemini-test")
    result = await collect(client, "hi", streaming=streaming)
    assert isinstance(result.error, TransientProviderError)
    assert result.error.code == "token_unavailable" and server.count() == 0
    await client.aclose()


def test_publishers_locations_and_credentials(tmp_path: Path, key_file: str) -> None:
    def make(model: str, **options: Any) -> Any:
        options.setdefault("location", "us-central1")
        return VertexChatClient(model, project="p", credentials=key_file, **options)

    assert isinstance(make("claude-sonnet-4-5@20250929"), VertexAnthropicChatClient)
    assert isinstance(make("gemini-2.5-flash"), VertexGeminiChatClient)
    assert isinstance(make("my-claude", publisher="anthropic"), VertexAnthropicChatClient)
    on_global = make("gemini-2.5-flash", location="global")
    assert on_global.metadata.server_address == "aiplatform.googleapis.com"
    assert str(on_global._url) == (
        "https://aiplatform.googleapis.com/v1/projects/p/locations/global/publishers/google/"
        "models/gemini-2.5-flash:generateContent"
    )
    regional = make("gemini-2.5-flash", location="europe-west4")
    assert regional.metadata.server_address == "europe-west4-aiplatform.googleapis.com"
    with pytest.raises(ValueError, match="publisher"):
        make("m", publisher="meta")
    with pytest.raises(ValueError, match="location"):
        make("m", location="Europe West")
    with pytest.raises(ValueError, match="does not exist"):
        VertexChatClient("m", project="p", location="l", credentials=str(tmp_path / "none.json"))
    garbage = tmp_path / "garbage.json"
    garbage.write_text('{"type": "service_account", "private_key": "CANARY"}')
    with pytest.raises(ValueError, match="no credentials google-auth can use") as caught:
        VertexChatClient("m", project="p", location="l", credentials=str(garbage))
    assert "CANARY" not in str(caught.value)


# -- configuration ----------------------------------------------------------------------------


def route(server: FakeGeminiServer, **table: Any) -> dict[str, Any]:
    return {
        "routes": {
            "v": {
                "provider": "vertex",
                "model": "gemini-test",
                "project": "fake-project",
                "location": "us-central1",
                "base_url": server.vertex_base_url,
                **table,
            }
        }
    }


async def test_a_vertex_route_checks_its_credentials_at_startup(
    server: FakeGeminiServer, tokens: FakeGoogleTokenServer, key_file: str, streaming: bool
) -> None:
    config = parse_config(route(server, credentials_file=key_file, retry={"max_attempts": 1}))
    pipeline = config.build()  # gets the first token (the token server has its own thread)
    assert tokens.requests == 1
    result = await collect(pipeline, "hi", streaming=streaming)
    assert result.error is None and tokens.requests == 1
    assert bearers(server) == tokens.issued
    await pipeline.aclose()
    tokens.refusing = "invalid_grant"
    with pytest.raises(ConfigError) as refused:
        config.build()
    assert refused.value.key_path == "routes.v.credentials_file"
    assert "invalid_grant" in str(refused.value)


def test_missing_credentials_are_a_configuration_error(
    server: FakeGeminiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError) as caught:
        parse_config(route(server, credentials_file=missing))
    assert caught.value.key_path == "routes.v.credentials_file"
    assert "does not exist" in str(caught.value)
    # No file named and no Application Default Credentials either.
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", missing)
    with pytest.raises(ConfigError) as adc:
        parse_config(route(server))
    assert adc.value.key_path == "routes.v.credentials_file"
    assert "Application Default Credentials" in str(adc.value)


def test_application_default_credentials_are_used(
    server: FakeGeminiServer, key_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", key_file)
    config = parse_config(route(server, model="claude-test", max_tokens=64))
    assert config.routes["v"].credentials_file is None  # type: ignore[union-attr]
