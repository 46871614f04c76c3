"""Chaos through two real gateway replicas (`chat-pipeline serve` processes, started by
examples/gateway/replicas.py) sharing breakers and the response cache through one real
redis-server, 1,000 requests at once in each phase, split across both replicas, every
format, both call shapes:

1. every route failed, one said when (a 429 ``Retry-After: 30``, then a 500): every answer
   is 503 with ``retry-after`` 30, never "don't retry";
2. every route failed, each said another time (60 s and 5 s): every answer asks for 5;
3. every route failed, none said when: every answer is ``x-should-retry: false``;
4. single flight with clients that leave: 1,000 identical requests (streamed ones first,
   then non-streamed ones joining their flights) all leave while the upstream holds its
   answer: every upstream call is closed (nobody keeps an orphaned call), and an identical
   request afterwards is answered by a fresh call;
5. a breaker open in Redis (tripped by a third party, probing again in 600 s) and a route
   that fails: every answer asks for the breaker's time, on both replicas, and the route
   behind the open breaker is never called.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.chaos.breakers import trip
from tests.gateway_replicas import started

pytestmark = pytest.mark.chaos

N = 1000
PATHS = ("/v1/chat/completions", "/v1/responses", "/v1/messages")
BREAKER = "gateway-chaos-a"


def body(path: str, text: str, stream: bool) -> dict[str, Any]:
    messages = [{"role": "user", "content": text}]
    if path == "/v1/messages":
        return {"model": "pipeline", "max_tokens": 16, "messages": messages, "stream": stream}
    if path == "/v1/responses":
        return {"model": "pipeline", "input": text, "stream": stream}
    return {"model": "pipeline", "messages": messages, "stream": stream}


def shape(i: int) -> tuple[int, str, bool]:
    """Request `i`'s replica, format and call shape: every combination, evenly."""
    return i % 2, PATHS[i % 3], (i // 6) % 2 == 0


@pytest.fixture
async def upstreams() -> AsyncIterator[tuple[FakeOpenAIServer, FakeOpenAIServer]]:
    async with FakeOpenAIServer() as a, FakeOpenAIServer() as b:
        yield a, b


@pytest.fixture
def stack(upstreams: tuple[FakeOpenAIServer, FakeOpenAIServer], tmp_path: Path) -> Iterator[Any]:
    a, b = upstreams
    configuration = f"""
[routes.a]
provider = "openai"
model = "model-a"
base_url = "{a.base_url}"
# Longer than the test: only the cache closing its call can end one nobody listens to.
timeout = 3600

[routes.a.breaker]
fail_max = 1000000
reset_timeout = 600
name = "{BREAKER}"
redis_url_env = "GATEWAY_REDIS_URL"

[routes.b]
provider = "openai"
model = "model-b"
base_url = "{b.base_url}"

[router]
kind = "ordered"
order = ["a", "b"]

[cache]
store = "redis"
redis_url_env = "GATEWAY_REDIS_URL"

[gateway]
retry_after = 3
max_concurrent_per_key = 100000
max_connections = 4096
# A thousand connections open at once on a small shared machine: the test's client may send
# a connection's head more than the default 10 s after the gateway accepted it.
header_timeout = 120
body_timeout = 120
# Idle connections outlive the test's client's own keep-alive (500 s), which outlives the test.
keep_alive_timeout = 600
"""
    with started(configuration, tmp_path) as running:
        yield running


Answer = tuple[int, Mapping[str, str], Any]
"""An answer's status, headers and JSON body."""


def client() -> aiohttp.ClientSession:
    """The one client of the bursts: each burst reuses the idle keep-alive connections the
    last one left (every connection is kept, longer than the test lasts and shorter than the
    gateway's keep-alive). aiohttp's pool takes a connection out as it hands it to a
    request; httpx's pool (httpcore 1.0.9) can close a connection it has handed to a request
    after the request went out, as surplus to its keep-alive bound or expired
    (encode/httpcore#1110, tests/pipeline/gateway/test_keep_alive.py): the answer the
    gateway sent is lost (a ReadError), which a burst reusing 1,000 connections met."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=500)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120))


async def burst(
    http: aiohttp.ClientSession, urls: list[str], phase: str, figures: dict[str, Any]
) -> list[Answer]:
    """N different requests at once, spread over replicas, formats and call shapes (each
    phase bounded: a request the gateway never answers fails the test)."""

    async def one(i: int) -> Answer:
        replica, path, stream = shape(i)
        request = body(path, f"{phase} {i}", stream)
        async with http.post(f"{urls[replica]}{path}", json=request) as response:
            return response.status, response.headers, await response.json()

    started = time.perf_counter()
    async with asyncio.timeout(300):
        answers = await asyncio.gather(*(one(i) for i in range(N)))
    figures[f"{phase} seconds"] = round(time.perf_counter() - started, 1)
    return answers


def told(answers: list[Answer]) -> dict[tuple[Any, ...], int]:
    """How many answers said what: (status, error type, retry-after, x-should-retry)."""
    said: dict[tuple[Any, ...], int] = {}
    for i, (status, headers, payload) in enumerate(answers):
        _, path, _ = shape(i)
        kind = payload["error"]["type"]
        key = (path, status, kind, headers.get("retry-after"), headers.get("x-should-retry"))
        said[key] = said.get(key, 0) + 1
    return said


def check_all(answers: list[Answer], low: int | None, high: int | None) -> str:
    """Every answer 503 in its format's shape, asking to wait between `low` and `high`
    seconds (None: saying not to retry); what they said, for the figures."""
    said = told(answers)
    for (path, status, kind, retry, should), count in said.items():
        assert status == 503, (path, status, kind, count)
        if low is None:
            assert retry is None and should == "false", (path, kind, retry, should)
            assert kind == ("api_error" if path == "/v1/messages" else "server_error")
        else:
            assert retry is not None and low <= int(retry) <= (high or low), (path, retry)
            assert should is None
            assert kind == ("overloaded_error" if path == "/v1/messages" else "server_error")
    waits = sorted({int(retry) for (_, _, _, retry, _) in said if retry is not None})
    return f"retry-after {waits[0]}-{waits[-1]}" if waits else "x-should-retry: false"


@pytest.mark.timeout(900)
async def test_two_replicas_under_1000_requests_answer_from_every_attempt_and_leave_no_flight(
    stack: Any, upstreams: tuple[FakeOpenAIServer, FakeOpenAIServer]
) -> None:
    a, b = upstreams
    urls = list(stack.replica_urls)
    figures: dict[str, Any] = {}
    async with client() as http:
        # 1. One route said when; the last one failed without a word.
        a.default = FakeResponse.error(429, retry_after="30")
        b.default = FakeResponse.error(500)
        figures["p1"] = check_all(await burst(http, urls, "p1", figures), 20, 30)
        assert (a.count(), b.count()) == (N, N)  # every request tried both routes

        # 2. Each said another time: the earliest wins.
        a.default = FakeResponse.error(503, retry_after="60")
        b.default = FakeResponse.error(429, retry_after="5")
        figures["p2"] = check_all(await burst(http, urls, "p2", figures), 1, 5)

        # 3. Nobody said when.
        a.default = b.default = FakeResponse.error(500)
        figures["p3"] = check_all(await burst(http, urls, "p3", figures), None, None)

        # 4. Single flight, clients that leave (both replicas, identical requests).
        await single_flight(a, urls, figures)

        # 5. A breaker opened in Redis by a third party; the other route fails.
        await trip(BREAKER, stack.redis_url)
        a.default = FakeResponse()  # it would answer: but nothing goes through its breaker
        calls_to_a = a.count()
        figures["p5"] = check_all(await burst(http, urls, "p5", figures), 500, 600)
        assert a.count() == calls_to_a

    print(f"\ngateway chaos: 2 replicas, {N} requests a phase: {figures}")


async def single_flight(a: FakeOpenAIServer, urls: list[str], figures: dict[str, Any]) -> None:
    """Phase 4, on clients of its own: 1,000 identical requests, streamed ones first, all
    leave while the upstream holds its answer."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    a.default = FakeResponse(chunks=["held ", "answer"], hang_after=2)  # then holds on
    calls_before = a.count()
    disconnects_before = a.disconnects
    started = asyncio.Event()
    everyone = asyncio.Event()
    streaming = N // 2 + len(PATHS) * 2
    first_bytes = 0
    async with httpx.AsyncClient(limits=limits, timeout=120) as http:

        async def streamed(i: int) -> None:
            nonlocal first_bytes
            replica, path, _ = shape(i)
            request = body(path, "the same question", True)
            async with http.stream("POST", f"{urls[replica]}{path}", json=request) as response:
                async for _ in response.aiter_bytes():
                    first_bytes += 1
                    started.set()
                    if first_bytes == streaming:
                        everyone.set()
                    await asyncio.Event().wait()  # holds the stream until cancelled

        async def whole(i: int) -> None:
            replica, path, _ = shape(i)
            await http.post(f"{urls[replica]}{path}", json=body(path, "the same question", False))

        streams = [asyncio.ensure_future(streamed(i)) for i in range(N // 2)]
        # The streamed requests lead (one upstream call per replica and request key), then
        # the non-streamed ones join the flights they lead.
        async with asyncio.timeout(120):
            await started.wait()
        wholes = [asyncio.ensure_future(whole(i)) for i in range(N // 2, N)]
        # One more stream behind them in each replica: once it has its first bytes, the
        # requests sent before it were taken by the replicas too.
        probes = [asyncio.ensure_future(streamed(i)) for i in (0, 1, 2, 3, 4, 5)]
        async with asyncio.timeout(120):
            await everyone.wait()
        calls = a.count() - calls_before
        # Every client leaves: the streamed ones (the leaders) first, the others last.
        for task in streams + probes:
            task.cancel()
        await asyncio.gather(*streams, *probes, return_exceptions=True)
        for task in wholes:
            task.cancel()
        await asyncio.gather(*wholes, return_exceptions=True)
    # Every upstream call was closed: nobody keeps a call nobody listens to.
    async with asyncio.timeout(60):
        await a.wait_for_disconnects(disconnects_before + a.count() - calls_before)
    # An identical request afterwards makes a fresh call (it joins no orphan).
    a.default = FakeResponse(text="fresh")
    async with httpx.AsyncClient(timeout=60) as http:
        for url in urls:
            response = await http.post(
                f"{url}/v1/chat/completions", json=body(PATHS[0], "the same question", False)
            )
            assert response.status_code == 200
            assert response.json()["choices"][0]["message"]["content"] == "fresh"
    figures["single flight: upstream calls for 1,000 identical requests"] = calls
    assert 2 <= calls <= 2 * len(PATHS) * 4, calls  # a few per replica and format
