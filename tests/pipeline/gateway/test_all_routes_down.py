"""When every route failed, the answer is read from every attempt, whatever mix of statuses
the routes gave (rate limits, 5xx, open breakers, cooldowns), in all three formats and both
call shapes: 503 with ``retry-after`` the earliest time any route said it may serve again
(Anthropic: ``overloaded_error``, which Claude Code retries a few times as told), or, only
when no route said when, ``x-should-retry: false`` (Anthropic: ``api_error``, which it does
not retry). The case of docs/gateway/claude-code.md."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from pipeline.config import parse_config
from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.pipeline.gateway.conftest import config, running

pytestmark = pytest.mark.gateway

PATHS = ["/v1/chat/completions", "/v1/responses", "/v1/messages"]
RETRY_AFTER = 3  # the gateway's own wait, for a rate limit that said no time


def body(path: str, streaming: bool) -> dict[str, Any]:
    messages = [{"role": "user", "content": "hi"}]
    if path == "/v1/messages":
        return {"model": "pipeline", "max_tokens": 16, "messages": messages, "stream": streaming}
    if path == "/v1/responses":
        return {"model": "pipeline", "input": "hi", "stream": streaming}
    return {"model": "pipeline", "messages": messages, "stream": streaming}


def limited(seconds: str | None = None) -> FakeResponse:
    return FakeResponse.error(429, retry_after=seconds)


def unavailable(seconds: str | None = None) -> FakeResponse:
    return FakeResponse.error(503, retry_after=seconds)


FAILED = FakeResponse.error(500)

CASES = {
    # A route said when (30 s), the last one failed without a word: wait 30 s, never "don't".
    "429-then-500": (limited("30"), FAILED, 30),
    "503-then-500": (unavailable("30"), FAILED, 30),
    # The earliest wins: 60 s and 5 s give 5.
    "60s-then-5s": (unavailable("60"), limited("5"), 5),
    # Every route rate limited (issue 39's Claude Code case): retry after 1 s, as they said.
    "every-route-429": (limited("1"), limited("1"), 1),
    # A rate limit that said no time: the gateway's own wait.
    "429-no-time-then-500": (limited(), FAILED, RETRY_AFTER),
    # Nobody said when: a retry cannot help soon.
    "500-then-500": (FAILED, FAILED, None),
    "503-no-time-then-500": (unavailable(), FAILED, None),
}


async def answer(gateway: Any, path: str, streaming: bool) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(f"{gateway.url}{path}", json=body(path, streaming))


def check(response: httpx.Response, path: str, wait: int | None, *, within: int = 0) -> None:
    """The all-routes-down answer: 503 in the format's shape, telling `wait` (give or take
    `within` seconds, for a time that runs while the test does)."""
    assert response.status_code == 503, response.text
    payload = response.json()
    headers = response.headers
    if wait is None:
        assert "retry-after" not in headers
        assert headers["x-should-retry"] == "false"
    else:
        assert wait - within <= int(headers["retry-after"]) <= wait
        assert "x-should-retry" not in headers
    if path == "/v1/messages":
        assert payload["type"] == "error"
        assert payload["error"]["type"] == ("api_error" if wait is None else "overloaded_error")
    else:
        assert payload["error"]["type"] == "server_error"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(CASES))
async def test_the_answer_comes_from_every_attempt(
    primary: FakeOpenAIServer, backup: FakeOpenAIServer, streaming: bool, path: str, case: str
) -> None:
    first, second, wait = CASES[case]
    primary.script(first)
    backup.script(second)
    cfg = config({"primary": primary, "backup": backup}, gateway={"retry_after": RETRY_AFTER})
    async with running(cfg) as gateway:
        response = await answer(gateway, path, streaming)
    check(response, path, wait, within=1)
    assert (primary.count(), backup.count()) == (1, 1)


@pytest.mark.parametrize("path", PATHS)
async def test_an_open_breaker_says_when_it_probes_again(
    primary: FakeOpenAIServer, backup: FakeOpenAIServer, streaming: bool, path: str
) -> None:
    cfg = config(
        {"primary": primary, "backup": backup},
        route_options={"primary": {"breaker": {"fail_max": 1, "reset_timeout": 600}}},
    )
    primary.script(FAILED)
    async with running(cfg) as gateway:
        # Opens the primary's breaker (the backup answers).
        assert (await answer(gateway, path, streaming)).status_code == 200
        backup.script(FAILED)
        response = await answer(gateway, path, streaming)
    check(response, path, 600, within=60)
    assert (primary.count(), backup.count()) == (1, 2)  # the open breaker called nobody


@pytest.mark.parametrize("path", PATHS)
async def test_a_route_cooling_down_says_when_it_may_serve_again(
    primary: FakeOpenAIServer, backup: FakeOpenAIServer, streaming: bool, path: str
) -> None:
    routes = {
        name: {"provider": "openai", "model": f"model-{name}", "base_url": server.base_url}
        for name, server in (("primary", primary), ("backup", backup))
    }
    cfg = parse_config({"routes": routes, "router": {"kind": "balanced"}})
    primary.default = backup.default = FAILED
    primary.script(limited("30"))
    backup.script(limited("30"))
    async with running(cfg) as gateway:
        first = await answer(gateway, path, streaming)
        assert first.status_code == 503
        # Both said 30 s: both cool down. Now each answers a bare 500: still, they said
        # when they may serve again, and the answer says so.
        response = await answer(gateway, path, streaming)
    check(response, path, 30, within=5)
    assert (primary.count(), backup.count()) == (2, 2)
