"""A budget held by two ``chat-pipeline serve`` processes: each replica its own process (no
state of one Python process to share by accident), one real redis-server for the counters,
one real PostgreSQL for the key and the spend ledger, one fake upstream.

300 requests (streamed and not) against a key with a $0.12 budget (ten requests' worth), in
waves of 50 at once split across the two processes: what the ledger holds for the key ends
at most the budget plus one request's cost; every refusal is the 402; every admitted
request is served whole. `tests/pipeline/gateway/test_budget_replicas.py` holds the same
promise through four replicas in one process, where the test can also move their clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from pipeline.testing import FakeOpenAIServer
from tests.pipeline.gateway.test_budget_replicas import REQUEST_COST, spent
from tests.processes import UVICORN_PORT, ChildProcess, StartError, serve_argv
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.chaos, pytest.mark.gateway, pytest.mark.postgres]

BUDGET = Decimal("0.12")
WAVES, WAVE = 6, 50


def write_config(path: Path, upstream: str) -> Path:
    path.write_text(
        f"""
[routes.primary]
provider = "openai"
model = "model-primary"
base_url = "{upstream}"
price = {{ input_per_million = 1000.0, output_per_million = 1000.0 }}

[router]
kind = "ordered"
order = ["primary"]

[spend]
store = "postgres"
dsn_env = "PROCESSES_TEST_DSN"
auto_upgrade = true
flush_interval = 0.1

[keys]
refresh_interval = 0.1

[budgets]
redis_url_env = "PROCESSES_TEST_REDIS"
timeout = 2.0
"""
    )
    return path


@contextlib.contextmanager
def replica(config: Path, env: dict[str, str], name: str) -> Iterator[str]:
    """One ``chat-pipeline serve`` process of `config` with its key known, and its URL."""
    argv = serve_argv(config, "--log-level", "info")
    with ChildProcess(name, argv, env=env, own_group=True) as server:
        try:
            server.wait_for_line("virtual keys on: 1 key(s) known", timeout=90)
            port = server.wait_for_port(UVICORN_PORT, timeout=90)
        except StartError as exc:
            pytest.fail(str(exc), pytrace=False)
        yield f"http://127.0.0.1:{port}/v1"


async def one(client: httpx.AsyncClient, url: str, secret: str, n: int) -> tuple[int, str]:
    """One request to the replica at `url`: its status and what it answered."""
    body = {
        "model": "pipeline",
        "messages": [{"role": "user", "content": f"question {n}"}],
        "max_tokens": 16,
        "stream": n % 2 == 1,
    }
    headers = {"authorization": f"Bearer {secret}"}
    async with client.stream(
        "POST", f"{url}/chat/completions", json=body, headers=headers
    ) as response:
        return response.status_code, (await response.aread()).decode()


@pytest.fixture
async def upstream() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server


async def test_a_budget_holds_across_two_serve_processes(
    postgres_dsn: str,
    redis_server: RedisServer,
    upstream: FakeOpenAIServer,
    tmp_path: Path,
) -> None:
    from pipeline.keys import Budget, PostgresKeyStore

    store = PostgresKeyStore(postgres_dsn, auto_upgrade=True)
    try:
        issued = await store.create("budgeted", budget=Budget(str(BUDGET)))
    finally:
        await store.aclose()
    config = write_config(tmp_path / "gateway.toml", upstream.base_url)
    env = {
        **os.environ,
        "PROCESSES_TEST_DSN": postgres_dsn,
        "PROCESSES_TEST_REDIS": redis_server.url,
    }
    answers: list[tuple[int, str]] = []
    with replica(config, env, "replica a") as a, replica(config, env, "replica b") as b:
        limits = httpx.Limits(max_connections=WAVE, max_keepalive_connections=WAVE)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            for start in range(0, WAVES * WAVE, WAVE):  # bounded: WAVES waves
                answers += await asyncio.gather(
                    *(
                        one(client, (a, b)[n % 2], issued.secret, n)
                        for n in range(start, start + WAVE)
                    )
                )
    # Both replicas stopped (SIGTERM): each flushed its ledger records on the way out.
    served = refused = 0
    for n, (status, text) in enumerate(answers):
        if status == 402:
            assert "budget_exceeded" in text, text
            refused += 1
        else:
            assert status == 200, text
            whole = "data: [DONE]" in text if n % 2 else "Hello from the fake server" in text
            assert whole, text
            served += 1
    assert served + refused == WAVES * WAVE
    assert served >= BUDGET / REQUEST_COST / 2 and refused > 0
    assert upstream.count() == served  # a refused request never reached the upstream
    total, dearest = await spent(postgres_dsn, issued.key.id)
    assert dearest <= REQUEST_COST
    assert total == served * REQUEST_COST  # one record per served request, at its cost
    assert total <= BUDGET + dearest
