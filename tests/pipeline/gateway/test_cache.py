"""The gateway over a response cache: ``cache-control`` request headers, ``x-cache`` and
``age`` response headers, entries kept apart per caller key, replicas sharing Redis."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from pipeline.config import PipelineConfig, parse_config
from pipeline.testing import FakeOpenAIServer
from tests.pipeline.gateway.conftest import Running, running

pytestmark = pytest.mark.gateway


def cached_config(
    upstream: FakeOpenAIServer, cache: dict[str, Any], gateway: dict[str, Any] | None = None
) -> PipelineConfig:
    return parse_config(
        {
            "routes": {
                "primary": {"provider": "openai", "model": "m", "base_url": upstream.base_url}
            },
            "cache": cache,
            "gateway": gateway or {},
        }
    )


async def chat(
    run: Running,
    text: str = "hello",
    *,
    stream: bool = False,
    headers: dict[str, str] | None = None,
    key: str = "unused",
) -> tuple[httpx.Response, str]:
    body = {
        "model": "primary",
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
    }
    async with httpx.AsyncClient(base_url=run.base_url, timeout=10) as client:
        response = await client.post(
            "/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}", **(headers or {})},
        )
    assert response.status_code == 200, response.text
    if not stream:
        return response, response.json()["choices"][0]["message"]["content"]
    pieces = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                pieces.append(choice.get("delta", {}).get("content") or "")
    return response, "".join(pieces)


@pytest.fixture
async def upstream() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server


@pytest.mark.parametrize("stream", [False, True], ids=["get_response", "get_streaming_response"])
async def test_headers_map_to_modes_and_tell_what_happened(
    upstream: FakeOpenAIServer, stream: bool
) -> None:
    async with running(cached_config(upstream, {})) as run:
        first, text = await chat(run, stream=stream)
        assert first.headers["x-cache"] == "miss" and "age" not in first.headers
        second, again = await chat(run, stream=stream)
        assert second.headers["x-cache"] == "hit" and second.headers["age"] == "0"
        assert again == text
        assert len(upstream.requests) == 1
        refreshed, _ = await chat(run, stream=stream, headers={"cache-control": "no-cache"})
        assert refreshed.headers["x-cache"] == "miss"
        assert len(upstream.requests) == 2
        bypassed, _ = await chat(run, stream=stream, headers={"cache-control": "no-store"})
        assert bypassed.headers["x-cache"] == "bypass"
        assert len(upstream.requests) == 3
        hit, _ = await chat(run, stream=stream)
        assert hit.headers["x-cache"] == "hit"
        assert len(upstream.requests) == 3


async def test_entries_never_cross_caller_keys(
    upstream: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_TEST_KEYS", "key-a,key-b")
    cfg = cached_config(upstream, {}, {"api_keys_env": "GATEWAY_TEST_KEYS"})
    async with running(cfg) as run:
        assert (await chat(run, key="key-a"))[0].headers["x-cache"] == "miss"
        assert (await chat(run, key="key-b"))[0].headers["x-cache"] == "miss"
        assert (await chat(run, key="key-a"))[0].headers["x-cache"] == "hit"
        assert len(upstream.requests) == 2


async def test_sessions_are_kept_apart_when_configured(upstream: FakeOpenAIServer) -> None:
    async with running(cached_config(upstream, {"per_session": True})) as run:
        one = {"x-session-id": "one"}
        assert (await chat(run, headers=one))[0].headers["x-cache"] == "miss"
        assert (await chat(run, headers={"x-session-id": "two"}))[0].headers["x-cache"] == "miss"
        assert (await chat(run, headers=one))[0].headers["x-cache"] == "hit"


async def test_two_replicas_share_entries_through_redis(
    upstream: FakeOpenAIServer, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CACHE_TEST_REDIS", redis_url)
    cache = {"store": "redis", "redis_url_env": "CACHE_TEST_REDIS", "namespace": "replicas-test"}
    async with contextlib.AsyncExitStack() as stack:
        one = await stack.enter_async_context(running(cached_config(upstream, cache)))
        two = await stack.enter_async_context(running(cached_config(upstream, cache)))
        first, text = await chat(one, "shared question")
        assert first.headers["x-cache"] == "miss"
        # The write lands beside the answer: the other replica finds it once it has.
        for _ in range(200):
            second, again = await chat(two, "shared question")
            if second.headers["x-cache"] == "hit":
                break
        assert second.headers["x-cache"] == "hit"
        assert again == text
        streamed, streamed_text = await chat(two, "shared question", stream=True)
        assert streamed.headers["x-cache"] == "hit" and streamed_text == text
        assert len(upstream.requests) == 1


async def test_replicas_with_other_key_lists_keep_each_keys_entries_apart(
    upstream: FakeOpenAIServer, redis_url: str, monkeypatch: pytest.MonkeyPatch, streaming: bool
) -> None:
    # A rolling update: replica one lists key A first, replica two key B first. Partitions
    # follow the key itself, so B never gets what A paid for, and A finds its own entry on
    # either replica.
    monkeypatch.setenv("CACHE_TEST_REDIS", redis_url)
    monkeypatch.setenv("KEYS_ONE", "key-a,key-b")
    monkeypatch.setenv("KEYS_TWO", "key-b,key-c,key-a")
    namespace = f"tenants-{streaming}"
    cache = {"store": "redis", "redis_url_env": "CACHE_TEST_REDIS", "namespace": namespace}
    async with contextlib.AsyncExitStack() as stack:
        one = await stack.enter_async_context(
            running(cached_config(upstream, cache, {"api_keys_env": "KEYS_ONE"}))
        )
        two = await stack.enter_async_context(
            running(cached_config(upstream, cache, {"api_keys_env": "KEYS_TWO"}))
        )
        first, text = await chat(one, "tenant question", stream=streaming, key="key-a")
        assert first.headers["x-cache"] == "miss"
        # Key A's entry is written beside its answer: once replica two finds it for A...
        for _ in range(200):
            again, same = await chat(two, "tenant question", stream=streaming, key="key-a")
            if again.headers["x-cache"] == "hit":
                break
        assert again.headers["x-cache"] == "hit" and same == text
        # ... key B (first in replica two's list, as A is in replica one's) misses there.
        other, _ = await chat(two, "tenant question", stream=streaming, key="key-b")
        assert other.headers["x-cache"] == "miss"
        assert len(upstream.requests) == 2


async def post(
    run: Running, path: str, body: dict[str, Any], key: str = "unused"
) -> httpx.Response:
    async with httpx.AsyncClient(base_url=run.url, timeout=10) as client:
        response = await client.post(
            path,
            json=body,
            headers={"x-api-key": key}
            if path == "/v1/messages"
            else {"authorization": f"Bearer {key}"},
        )
    assert response.status_code == 200, response.text
    return response


def agent_body(path: str, run_id: str, stream: bool) -> dict[str, Any]:
    """What an agent sends on two identical runs: only a per-run id differs (Claude Code's
    ``metadata.user_id``, Codex's ``prompt_cache_key``, a Chat Completions ``user``)."""
    if path == "/v1/messages":
        return {
            "model": "primary",
            "max_tokens": 64,
            "stream": stream,
            "messages": [{"role": "user", "content": "list the files"}],
            "metadata": {"user_id": f"user_1_account__session_{run_id}"},
        }
    if path == "/v1/responses":
        return {
            "model": "primary",
            "input": "list the files",
            "stream": stream,
            "prompt_cache_key": run_id,
            "store": False,
            "client_metadata": {"x-codex-turn": run_id},
            "service_tier": "auto",
            "metadata": {"run": run_id},
        }
    return {
        "model": "primary",
        "messages": [{"role": "user", "content": "list the files"}],
        "stream": stream,
        "user": run_id,
        "safety_identifier": run_id,
        "metadata": {"run": run_id},
        "stream_options": {"include_usage": True} if stream else None,
    }


PATHS = ["/v1/chat/completions", "/v1/responses", "/v1/messages"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stream", [False, True], ids=["get_response", "get_streaming_response"])
async def test_two_identical_agent_runs_share_entries(
    upstream: FakeOpenAIServer, path: str, stream: bool
) -> None:
    async with running(cached_config(upstream, {})) as run:
        first = await post(run, path, agent_body(path, "run-1", stream))
        second = await post(run, path, agent_body(path, "run-2", stream))
    assert first.headers["x-cache"] == "miss"
    assert second.headers["x-cache"] == "hit"
    assert len(upstream.requests) == 1


@pytest.mark.parametrize("path", PATHS)
async def test_entries_are_kept_apart_by_caller_identity_not_by_those_fields(
    upstream: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    monkeypatch.setenv("GATEWAY_TEST_KEYS", "key-a,key-b")
    cfg = cached_config(upstream, {}, {"api_keys_env": "GATEWAY_TEST_KEYS"})
    async with running(cfg) as run:
        same = agent_body(path, "run-1", False)  # the very same body, fields and all
        assert (await post(run, path, same, "key-a")).headers["x-cache"] == "miss"
        assert (await post(run, path, same, "key-b")).headers["x-cache"] == "miss"
        assert (await post(run, path, same, "key-a")).headers["x-cache"] == "hit"
    assert len(upstream.requests) == 2


@pytest.mark.parametrize("path", PATHS)
async def test_a_cache_partitioned_by_user_keeps_users_apart(
    upstream: FakeOpenAIServer, path: str
) -> None:
    def by(user: str) -> dict[str, Any]:
        body = agent_body(path, user, False)
        if path == "/v1/responses":
            body["user"] = user  # Codex names none: its prompt_cache_key is a session's
        return body

    async with running(cached_config(upstream, {"partition_by": ["user"]})) as run:
        assert (await post(run, path, by("u1"))).headers["x-cache"] == "miss"
        assert (await post(run, path, by("u2"))).headers["x-cache"] == "miss"
        assert (await post(run, path, by("u1"))).headers["x-cache"] == "hit"
    assert len(upstream.requests) == 2
