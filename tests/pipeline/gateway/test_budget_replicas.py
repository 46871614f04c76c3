"""Budgets and rate limits held by four gateway replicas together: one real redis-server, one
real PostgreSQL (the keys and the spend ledger), priced fake upstreams.

* 500 requests (streamed and not, some failing over, some cancelled) against a key with a
  $1.00 budget, in waves across the replicas: the ledger's total for the key ends at most
  $1.00 plus one request's cost; every refusal is the 402; every admitted request is served.
* Redis restarted mid-run: while it is down a fail-closed gateway refuses (503), then the
  counters are rebuilt from the ledger and the budget still holds.
* A 600 requests a minute and 100,000 tokens a minute key under a 30 s burst at three
  times the rate (on the replicas' rate-limit clock, which the test moves): what is admitted
  is the limit for the time the burst took, to the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import httpx
import pytest
import redis.asyncio as redis_asyncio

from pipeline._reservations import Reservations
from pipeline.config import PipelineConfig, parse_config
from pipeline.keys import Budget, PostgresKeyStore
from pipeline.spend import PostgresSpendStore
from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.pipeline.gateway.conftest import Running, running
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.gateway, pytest.mark.timeout(300)]

REPLICAS = 4
# $1,000 a million tokens: the fake's usage (5 in, 7 out) costs $0.012 a request.
PRICE = {"input_per_million": 1000.0, "output_per_million": 1000.0}
REQUEST_COST = Decimal("0.012")


def config(primary: FakeOpenAIServer, backup: FakeOpenAIServer, **budgets: Any) -> PipelineConfig:
    return parse_config(
        {
            "routes": {
                name: {
                    "provider": "openai",
                    "model": f"model-{name}",
                    "base_url": server.base_url,
                    "price": PRICE,
                }
                for name, server in (("primary", primary), ("backup", backup))
            },
            "router": {"kind": "ordered", "order": ["primary", "backup"]},
            "spend": {
                "store": "postgres",
                "dsn_env": "REPLICAS_TEST_DSN",
                "auto_upgrade": True,
                "flush_interval": 0.1,
            },
            "keys": {"refresh_interval": 0.1},
            "budgets": {
                "redis_url_env": "REPLICAS_TEST_REDIS",
                "rebuild_delay": 0.5,
                "timeout": 0.5,
                **budgets,
            },
        }
    )


@contextlib.asynccontextmanager
async def replicas(cfg: PipelineConfig) -> AsyncIterator[list[Running]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(running(cfg)) for _ in range(REPLICAS)]


async def one(
    client: httpx.AsyncClient, run: Running, secret: str, n: int, *, stream: bool, cancel: bool
) -> tuple[int, str]:
    """One request: its status and what it answered (a cancelled stream leaves after its
    first event)."""
    body = {
        "model": "pipeline",
        "messages": [{"role": "user", "content": f"question {n}"}],
        "max_tokens": 16,
        "stream": stream,
    }
    headers = {"authorization": f"Bearer {secret}"}
    url = f"{run.base_url}/chat/completions"
    if not stream:
        response = await client.post(url, json=body, headers=headers)
        return response.status_code, response.text
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            return response.status_code, (await response.aread()).decode()
        text = ""
        async for line in response.aiter_lines():
            text += line + "\n"
            if cancel and line.startswith("data: "):
                return 200, "cancelled"
        return 200, text


async def wave(runs: list[Running], secret: str, start: int, count: int) -> list[tuple[int, str]]:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        return await asyncio.gather(
            *(
                one(
                    client,
                    runs[n % REPLICAS],
                    secret,
                    n,
                    stream=n % 2 == 1,
                    cancel=n % 10 == 3,
                )
                for n in range(start, start + count)
            )
        )


def check(answers: list[tuple[int, str]]) -> tuple[int, int]:
    """(served, refused): every answer one or the other, each complete or the 402."""
    served = refused = 0
    for status, text in answers:
        if status == 402:
            assert "budget_exceeded" in text
            refused += 1
        else:
            assert status == 200, text
            assert (
                text == "cancelled"
                or "Hello from the fake server" in text
                or ("data: [DONE]" in text)
            ), text
            served += 1
    return served, refused


async def spent(dsn: str, key_id: str) -> tuple[Decimal, Decimal]:
    """The key's total in the ledger, and the dearest request's cost."""
    store = PostgresSpendStore(dsn)
    try:
        (total,) = await store.summary([], where={"key": key_id})
        per_request = await store.summary(["request_id"], where={"key": key_id})
    finally:
        await store.aclose()
    return total.cost, max((s.cost for s in per_request), default=Decimal(0))


def reservations(run: Running) -> Reservations:
    """A replica's reservations (its budgets' and rate limits' Redis)."""
    governor = run.gateway.governance.governor
    assert governor is not None
    return governor.reservations


@pytest.fixture
async def upstreams() -> AsyncIterator[tuple[FakeOpenAIServer, FakeOpenAIServer]]:
    async with FakeOpenAIServer() as primary, FakeOpenAIServer() as backup:
        yield primary, backup


@pytest.fixture
def env(
    postgres_dsn: str, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, RedisServer]:
    monkeypatch.setenv("REPLICAS_TEST_DSN", postgres_dsn)
    monkeypatch.setenv("REPLICAS_TEST_REDIS", redis_server.url)
    return postgres_dsn, redis_server


async def budgeted_key(dsn: str, **fields: Any) -> tuple[str, str]:
    store = PostgresKeyStore(dsn, auto_upgrade=True)
    try:
        issued = await store.create("budgeted", budget=Budget("1.00"), **fields)
    finally:
        await store.aclose()
    return issued.key.id, issued.secret


async def test_a_dollar_budget_holds_across_four_replicas(
    env: tuple[str, RedisServer], upstreams: tuple[FakeOpenAIServer, FakeOpenAIServer]
) -> None:
    dsn, _ = env
    primary, backup = upstreams
    # Every fifth request the primary fails before any output: the backup serves it.
    primary.script(
        *(
            [
                FakeResponse(),
                FakeResponse(),
                FakeResponse(),
                FakeResponse(),
                FakeResponse.error(503),
            ]
            * 40
        )
    )
    key_id, secret = await budgeted_key(dsn)
    answers: list[tuple[int, str]] = []
    async with replicas(config(primary, backup)) as runs:
        for start in range(0, 500, 100):  # five waves of 100 at once
            answers += await wave(runs, secret, start, 100)
    served, refused = check(answers)
    assert served + refused == 500 and refused > 0 and served > 0
    total, dearest = await spent(dsn, key_id)
    assert dearest <= 2 * REQUEST_COST  # a cancelled stream may count its input twice
    assert Decimal("0.50") < total <= Decimal("1.00") + dearest
    # Every served request reached an upstream (a failover twice), each a ledger record.
    assert backup.count() > 0


async def test_redis_restarted_mid_run_rebuilds_from_the_ledger_and_fail_closed_refuses(
    env: tuple[str, RedisServer], upstreams: tuple[FakeOpenAIServer, FakeOpenAIServer]
) -> None:
    dsn, redis_server = env
    primary, backup = upstreams
    key_id, secret = await budgeted_key(dsn)
    # The ledger is written before Redis goes (below): the rebuild need not wait for it.
    closed = config(primary, backup, fail_closed=True, rebuild_delay=0.0)
    async with replicas(closed) as runs:
        # The replicas' budget clock stands still until the test moves it: an outage is
        # skipped until then, however long anything takes.
        now = [time.time()]
        stores = [reservations(run) for run in runs]
        for store in stores:
            store.clock = lambda: now[0]
        first = await wave(runs, secret, 0, 40)  # about half the budget
        assert check(first)[1] == 0
        for run, store in zip(runs, stores, strict=True):
            await run.gateway.wait_idle()
            await store.flush()  # every settlement in Redis
            assert run.gateway.spend is not None and await run.gateway.spend.flush()
        redis_server.stop()
        down = await wave(runs, secret, 40, 8)
        assert [status for status, _ in down] == [503] * 8
        assert all("budget_unavailable" in text for _, text in down)
        assert all(store.outage.skipping() for store in stores)
        redis_server.start()  # empty: the counters are gone
        now[0] += max(store.outage.retry_interval for store in stores)  # the outage's wait
        # Each replica tries Redis again: one is elected and rebuilds, the others wait for it.
        for store in stores:
            assert await store.prepare(10.0)
        answers = await wave(runs, secret, 1000, REPLICAS)  # one to each replica
        assert [status for status, _ in answers] == [200] * REPLICAS, answers
        raw = redis_asyncio.Redis.from_url(redis_server.url)
        keys = [k async for k in raw.scan_iter(match="chat_pipeline:budgets:b:k:*")]
        assert keys, "the key's counter was rebuilt"
        rebuilt = int((await raw.hget(keys[0], "s")) or 0)
        await raw.aclose()
        assert rebuilt >= 40 * REQUEST_COST * 10**9 * Decimal("0.9")  # the first wave's spend
        rest: list[tuple[int, str]] = []
        for start in range(2000, 2300, 100):
            rest += await wave(runs, secret, start, 100)
    _, refused = check(rest)
    assert refused > 0
    total, dearest = await spent(dsn, key_id)
    assert total <= Decimal("1.00") + dearest


async def test_fail_open_serves_while_redis_is_down(
    env: tuple[str, RedisServer], upstreams: tuple[FakeOpenAIServer, FakeOpenAIServer]
) -> None:
    dsn, redis_server = env
    primary, backup = upstreams
    _, secret = await budgeted_key(dsn)
    async with replicas(config(primary, backup)) as runs:
        redis_server.stop()
        answers = await wave(runs, secret, 0, 20)
    assert [status for status, _ in answers] == [200] * 20


async def test_rate_limits_hold_across_four_replicas_under_a_burst_at_three_times_the_rate(
    env: tuple[str, RedisServer], upstreams: tuple[FakeOpenAIServer, FakeOpenAIServer]
) -> None:
    dsn, _ = env
    primary, backup = upstreams
    store = PostgresKeyStore(dsn, auto_upgrade=True)
    issued = await store.create("limited", rpm=600, tpm=100_000)
    await store.aclose()
    seconds, rate = 30.0, 30.0  # 3x 600 a minute
    # Small requests: the requests limit binds first (the token limit's turn is below).
    admitted = await burst(config(primary, backup), issued.secret, seconds, rate, tokens=None)
    elapsed, count, _ = admitted
    limit = 600 * elapsed / 60 + 10  # what the limit allows in that time, its burst included
    assert abs(count - limit) <= 1, (count, limit)  # to the request: the clock is the test's


async def test_token_limits_hold_across_four_replicas(
    env: tuple[str, RedisServer], upstreams: tuple[FakeOpenAIServer, FakeOpenAIServer]
) -> None:
    dsn, _ = env
    primary, backup = upstreams
    store = PostgresKeyStore(dsn, auto_upgrade=True)
    issued = await store.create("tokens", rpm=100_000, tpm=100_000)
    await store.aclose()
    # Each request 400 tokens (estimated and used alike): 30 a second is 7x the limit.
    elapsed, _, tokens = await burst(
        config(primary, backup), issued.secret, 20.0, 30.0, tokens=400, upstreams=upstreams
    )
    allowed = 100_000 * elapsed / 60 + 100_000 / 60  # the rate, and one second's burst
    assert abs(tokens - allowed) <= 400, (tokens, allowed)  # to the request


async def burst(
    cfg: PipelineConfig,
    secret: str,
    seconds: float,
    rate: float,
    *,
    tokens: int | None,
    upstreams: tuple[FakeOpenAIServer, FakeOpenAIServer] | None = None,
) -> tuple[float, int, int]:
    """Offer `rate` requests a second for `seconds` across the replicas, one every 1/`rate`
    seconds of the replicas' rate-limit clock, which stands still while each is answered
    and settled and then moves on (so the outcome does not depend on how fast anything
    runs); (the seconds from the first offer to the last, requests admitted, tokens
    admitted)."""
    body: dict[str, Any] = {"model": "pipeline", "messages": [{"role": "user", "content": "hi"}]}
    if tokens is not None:
        # An input estimated at 4 per message plus a character in four: 96 + 4 tokens; the
        # rest is max_tokens. The fakes report exactly that usage.
        body["messages"] = [{"role": "user", "content": "x" * 384}]
        body["max_tokens"] = tokens - 100
        assert upstreams is not None
        for server in upstreams:
            server.script(*[FakeResponse(usage=(100, tokens - 100))] * int(seconds * rate + 10))
    admitted = 0
    statuses: list[int] = []
    async with replicas(cfg) as runs:
        now = [time.time()]
        for run in runs:
            reservations(run).clock = lambda: now[0]
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:

            async def send(n: int) -> None:
                url = f"{runs[n % REPLICAS].base_url}/chat/completions"
                response = await client.post(
                    url, json=body, headers={"authorization": f"Bearer {secret}"}
                )
                statuses.append(response.status_code)
                if response.status_code == 429:
                    assert "retry-after" in response.headers

            total = int(seconds * rate)
            for n in range(total):
                await send(n)
                # Its settlement (its tokens' estimate corrected) in Redis before the next.
                run = runs[n % REPLICAS]
                await run.gateway.wait_idle()
                await reservations(run).flush()
                now[0] += 1 / rate
            elapsed = (total - 1) / rate
    admitted = statuses.count(200)
    assert set(statuses) <= {200, 429}
    return elapsed, admitted, admitted * (tokens or 0)
