"""The kit's opt-in pytest plugin (`pipeline.testing.pytest_plugin`), loaded by this suite's
top-level conftest as a user's would load it."""

import os

import pytest

from pipeline.providers import AnthropicChatClient, BedrockChatClient, OpenAIChatClient
from pipeline.testing import (
    FAKE_SERVERS,
    FakeAnthropicServer,
    FakeBedrockServer,
    FakeOpenAIServer,
    FakeResponse,
    collect,
)


def test_streaming_runs_a_test_once_per_call_shape(
    streaming: bool, request: pytest.FixtureRequest
) -> None:
    shape = request.node.callspec.id
    assert shape == ("get_streaming_response" if streaming else "get_response")


async def test_fake_openai_server_is_started_for_the_test(
    fake_openai_server: FakeOpenAIServer, streaming: bool
) -> None:
    fake_openai_server.script(FakeResponse(text="one two"))
    async with OpenAIChatClient(
        "gpt-test", api_key="sk-test", base_url=fake_openai_server.base_url
    ) as client:
        result = await collect(client, "hi", streaming=streaming)
    assert result.error is None and result.text == "one two"
    assert fake_openai_server.count() == 1


async def test_fake_anthropic_server_is_started_for_the_test(
    fake_anthropic_server: FakeAnthropicServer, streaming: bool
) -> None:
    fake_anthropic_server.script(FakeResponse(text="one two"))
    async with AnthropicChatClient(
        "claude-test", api_key="sk-test", base_url=fake_anthropic_server.base_url
    ) as client:
        result = await collect(client, "hi", streaming=streaming)
    assert result.error is None and result.text == "one two"
    assert fake_anthropic_server.count() == 1


async def test_fake_bedrock_server_is_started_with_its_credentials_in_the_environment(
    fake_bedrock_server: FakeBedrockServer, streaming: bool
) -> None:
    fake_bedrock_server.script(FakeResponse(text="one two"))
    async with BedrockChatClient(
        "amazon.nova-lite-v1:0", base_url=fake_bedrock_server.base_url
    ) as client:
        result = await collect(client, "hi", streaming=streaming)
    assert result.error is None and result.text == "one two"
    assert fake_bedrock_server.count() == 1 and fake_bedrock_server.verified_signatures == 1


@pytest.fixture
def a_profile_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_PROFILE", "someone-elses")


async def test_the_bedrock_fixture_unsets_a_profile_its_empty_configuration_lacks(
    a_profile_set: None, fake_bedrock_server: FakeBedrockServer
) -> None:
    assert "AWS_PROFILE" not in os.environ
    key = fake_bedrock_server.environment()["AWS_ACCESS_KEY_ID"]
    assert os.environ["AWS_ACCESS_KEY_ID"] == key


def test_every_fake_has_its_fixture_named_by_its_format() -> None:
    """Each is made alike, from `FAKE_SERVERS` (the tests above start three of them)."""
    import pipeline.testing.pytest_plugin as plugin

    assert list(FAKE_SERVERS) == ["openai", "anthropic", "gemini", "bedrock"]
    for name, fake in FAKE_SERVERS.items():
        assert fake.wire_format == name and fake.title
        assert f"fake_{name}_server" in plugin.__all__
        assert getattr(plugin, f"fake_{name}_server") is not None


def test_no_entry_point_loads_the_plugin() -> None:
    from importlib.metadata import entry_points

    assert not [e for e in entry_points(group="pytest11") if e.value.startswith("pipeline")]
