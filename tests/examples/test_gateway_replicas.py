"""Two gateway processes behind a real nginx, sharing state through a real redis-server, all
on 127.0.0.1 (examples/gateway/replicas.py starts them): what one replica learns, the other
knows."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from pipeline.gateway.app import SESSION_HEADER
from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.gateway_replicas import EXAMPLE, started

pytestmark = pytest.mark.gateway

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def upstreams() -> AsyncIterator[tuple[FakeOpenAIServer, FakeOpenAIServer]]:
    async with FakeOpenAIServer() as primary, FakeOpenAIServer() as backup:
        yield primary, backup


@pytest.fixture
def stack(upstreams: tuple[FakeOpenAIServer, FakeOpenAIServer], tmp_path: Path) -> Iterator[Any]:
    """Redis, two replicas and nginx for a configuration whose primary has a shared
    breaker and whose router keeps sessions in Redis."""
    primary, backup = upstreams
    configuration = f"""
[routes.primary]
provider = "openai"
model = "model-primary"
base_url = "{primary.base_url}"
breaker = {{ fail_max = 2, reset_timeout = 600, redis_url_env = "GATEWAY_REDIS_URL" }}

[routes.backup]
provider = "openai"
model = "model-backup"
base_url = "{backup.base_url}"

[router]
kind = "ordered"
order = ["primary", "backup"]
affinity = {{ store = "redis", redis_url_env = "GATEWAY_REDIS_URL" }}

[gateway]
redis_url_env = "GATEWAY_REDIS_URL"
"""
    with started(configuration, tmp_path) as running:
        yield running


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def served_by(url: str, streaming: bool = False, session: str | None = None) -> str:
    """The model that answered one request sent to `url`."""
    headers = {SESSION_HEADER: session} if session else None
    async with client(url) as api:
        if not streaming:
            response = await api.chat.completions.create(
                model="pipeline", messages=MESSAGES, extra_headers=headers
            )
            return response.model
        stream = await api.chat.completions.create(
            model="pipeline", messages=MESSAGES, stream=True, extra_headers=headers
        )
        models = {chunk.model async for chunk in stream}
        assert len(models) == 1
        return models.pop()


async def test_a_breaker_opened_through_one_replica_is_open_in_the_other(
    stack: Any, upstreams: tuple[FakeOpenAIServer, FakeOpenAIServer], streaming: bool
) -> None:
    primary, backup = upstreams
    first, second = stack.replica_urls
    primary.script(FakeResponse.error(503), FakeResponse.error(503))
    # Two failures through the first replica open the primary's breaker (fail_max = 2).
    assert await served_by(first, streaming) == "model-backup"
    assert await served_by(first, streaming) == "model-backup"
    assert primary.count() == 2
    # The second replica never made a call to the primary, and finds its circuit open.
    assert await served_by(second, streaming) == "model-backup"
    # Through nginx, whichever replica answers, the primary is not called either.
    for _ in range(4):
        assert await served_by(stack.url, streaming) == "model-backup"
    assert (primary.count(), backup.count()) == (2, 7)


async def test_a_session_routed_by_one_replica_is_kept_by_the_other(
    stack: Any, upstreams: tuple[FakeOpenAIServer, FakeOpenAIServer], streaming: bool
) -> None:
    primary, backup = upstreams
    first, second = stack.replica_urls
    primary.script(FakeResponse.error(503))  # once: the breaker stays closed
    assert await served_by(first, streaming, session="conversation-1") == "model-backup"
    # The other replica keeps the session on the route that answered it.
    assert await served_by(second, streaming, session="conversation-1") == "model-backup"
    for _ in range(2):
        assert await served_by(stack.url, streaming, session="conversation-1") == "model-backup"
    # Other sessions, and requests without one, start on the primary, on either replica.
    assert await served_by(second, streaming, session="conversation-2") == "model-primary"
    assert await served_by(stack.url, streaming) == "model-primary"
    assert (primary.count(), backup.count()) == (3, 4)


async def test_streams_pass_through_nginx_event_by_event(
    stack: Any, upstreams: tuple[FakeOpenAIServer, FakeOpenAIServer]
) -> None:
    primary, _ = upstreams
    primary.script(FakeResponse(chunks=["one ", "two ", "three"], hang_after=3))
    async with client(stack.url) as api:
        stream = await api.chat.completions.create(model="pipeline", messages=MESSAGES, stream=True)
        received = ""
        async for chunk in stream:
            received += chunk.choices[0].delta.content or "" if chunk.choices else ""
            if received == "one two ":
                break  # it arrived while the upstream still holds the rest: not buffered
        await stream.close()
    assert received == "one two "
    await primary.wait_for_disconnects(1)  # the client left: nginx, gateway, upstream closed


def test_the_example_script_runs_and_stops() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--port", "0", "--ask", "Hello?"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    assert "Hello from the fake server." in done.stdout


def test_the_example_configuration_loads_for_loopback_and_containers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import yaml

    from pipeline.config import load_config

    folder = EXAMPLE.parent
    monkeypatch.setenv("GATEWAY_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("GATEWAY_API_KEYS", "key-1")
    local = load_config(folder / "gateway.toml")
    assert local.routes["primary"].base_url == "http://127.0.0.1:8765/v1"
    assert local.gateway is not None and local.gateway.api_keys_env is None
    compose = yaml.safe_load((folder / "docker-compose.yaml").read_text())
    command = compose["services"]["gateway-1"]["command"]
    environment = command[command.index("--env") + 1]
    containers = load_config(folder / "gateway.toml", environment)
    assert containers.routes["primary"].base_url == "https://api.openai.com/v1"
    assert containers.gateway is not None and containers.gateway.api_keys_env == "GATEWAY_API_KEYS"
    assert set(compose["services"]) == {"redis", "gateway-1", "gateway-2", "nginx"}
    assert "gateway-1:8080" in (folder / "nginx.conf").read_text()
