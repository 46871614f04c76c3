"""Exactly once, through replicas and an outage: 10,000 requests (half streamed) through two
``chat-pipeline serve`` replicas sharing one real PostgreSQL, which is stopped for 30 s in the
middle of the run and started again. The primary route retries a failed call once
(``retry = { max_attempts = 2 }``): its upstream refuses both calls of every eighth
request (which then fails over: three calls) and the first call of every eighth request
between those (which its retry serves: two calls).

What must hold: no request failed, and none took longer than the bound below; the ledger
holds exactly one record per request the upstreams received (their own counts are the
truth), retried calls included, with the tokens they answered; the outage was spooled, not
lost. Then ``kill -9`` of a replica: what it had written stays, and what it loses is at
most what it had not flushed yet (the requests after its last write). Loopback only;
bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from pipeline import _db
from tests.chaos.spend_upstream import FAIL_EVERY, RETRIED, USAGE
from tests.pipeline.gateway.test_server import listening_port
from tests.postgres_server import PostgresServer
from tests.processes import ChildProcess, StartError, serve_argv

pytestmark = [pytest.mark.chaos, pytest.mark.gateway, pytest.mark.postgres]

REQUESTS = 10_000
CONCURRENCY = 32
OUTAGE = 30.0  # seconds PostgreSQL is down, starting once OUTAGE_AFTER requests answered
OUTAGE_AFTER = 2_000
FLUSH_INTERVAL = 0.25
READY = re.compile(r"^READY (\d+)$")  # the upstreams' line once they listen
LATENCY_BOUND = 10.0
"""Seconds any request may take, outage included. The fake upstreams answer in
milliseconds: a request that waited on the database would take the database's timeout
(5 s), fail, or never end; none may."""


@pytest.fixture
def upstream() -> Iterator[str]:
    argv = [sys.executable, "-m", "tests.chaos.spend_upstream"]
    with ChildProcess("the spend test's upstreams", argv) as server:
        yield f"http://127.0.0.1:{server.wait_for_port(READY, timeout=60)}"


def write_config(path: Path, upstream: str, spool: Path) -> Path:
    path.write_text(
        f"""
[routes.primary]
provider = "openai"
model = "gpt-4o-mini"
base_url = "{upstream}/primary/v1"
retry = {{ max_attempts = 2, initial_delay = 0.05 }}

[routes.backup]
provider = "openai"
model = "gpt-4o-mini"
base_url = "{upstream}/backup/v1"

[router]
kind = "ordered"
order = ["primary", "backup"]

[spend]
store = "postgres"
dsn_env = "SPEND_TEST_DSN"
flush_interval = {FLUSH_INTERVAL}
spool = "{spool}"
retry_interval = 0.5
"""
    )
    return path


@contextlib.contextmanager
def replica(config: Path, dsn: str, name: str) -> Iterator[tuple[ChildProcess, str]]:
    """One ``chat-pipeline serve`` process of `config`, and its URL."""
    env = {**os.environ, "SPEND_TEST_DSN": dsn}
    argv = serve_argv(config, "--log-level", "warning")
    with ChildProcess(name, argv, env=env, own_group=True) as server:
        try:
            server.wait_for_line("no API keys configured", timeout=90)
        except StartError as exc:
            pytest.fail(str(exc), pytrace=False)
        yield server, f"http://127.0.0.1:{listening_port(server.pid)}"


async def ask(client: httpx.AsyncClient, url: str, number: int, streaming: bool) -> None:
    """One request; raises unless it was answered whole."""
    body = {
        "model": "pipeline",
        "messages": [{"role": "user", "content": f"question {number}"}],
        "stream": streaming,
    }
    headers = {"x-request-id": f"r{number}", "x-chat-pipeline-tags": f"run,{number % 7}"}
    if not streaming:
        response = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "ok"
        return
    async with client.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers
    ) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]


async def rows(dsn: str) -> list[Any]:
    connection = await asyncpg.connect(dsn)
    try:
        return list(
            await connection.fetch(
                "SELECT request_id, attempt, route, outcome, input_tokens, output_tokens,"
                " cost_nanos, tags FROM chat_pipeline_spend"
            )
        )
    finally:
        await connection.close()


INSERTED = "chat_pipeline_spend_inserted"
"""The channel a statement inserting into the ledger's table notifies (`notify_inserts`)."""


async def notify_inserts(dsn: str) -> None:
    """Make every statement inserting into the ledger's table NOTIFY `INSERTED` (once its
    transaction commits), so that the test can wait for rows instead of polling."""
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(
            f"""
            CREATE OR REPLACE FUNCTION test_spend_inserted() RETURNS trigger
            LANGUAGE plpgsql AS $$ BEGIN NOTIFY {INSERTED}; RETURN NULL; END $$;
            CREATE OR REPLACE TRIGGER test_spend_inserted
            AFTER INSERT ON chat_pipeline_spend
            FOR EACH STATEMENT EXECUTE FUNCTION test_spend_inserted();
            """
        )
    finally:
        await connection.close()


async def count_reaches(dsn: str, wanted: int, within: float = 120.0) -> int:
    """The table's row count once it reaches `wanted` (or `within` seconds pass): the replicas
    write on their own schedule, in other processes; each insert they commit wakes the count
    (`notify_inserts`)."""
    inserted = asyncio.Event()
    deadline = asyncio.get_running_loop().time() + within
    connection = await asyncpg.connect(dsn)
    try:
        await connection.add_listener(INSERTED, lambda *_: inserted.set())
        while True:  # once per insert statement at most, until the deadline
            # Cleared before counting: a row committed after the count wakes the next one.
            inserted.clear()
            count = int(await connection.fetchval("SELECT COUNT(*) FROM chat_pipeline_spend"))
            if count >= wanted or asyncio.get_running_loop().time() >= deadline:
                return count
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):  # the wait only, never a query
                    await inserted.wait()
    finally:
        await connection.close()


@pytest.mark.timeout(900)
async def test_one_record_per_attempt_through_an_outage_and_a_kill(
    postgres_server: PostgresServer, upstream: str, tmp_path: Path
) -> None:
    dsn = postgres_server.dsn
    database = _db.open_database(dsn)
    await _db.upgrade(database)  # what `chat-pipeline db upgrade` does
    await database.aclose()
    await notify_inserts(dsn)
    configs = [
        write_config(tmp_path / f"replica-{n}.toml", upstream, tmp_path / f"spool-{n}")
        for n in (1, 2)
    ]
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(LATENCY_BOUND * 2),
        limits=httpx.Limits(max_connections=CONCURRENCY * 2),
    ) as client:
        with (
            replica(configs[0], dsn, "replica 1") as (one, first),
            replica(configs[1], dsn, "replica 2") as (two, second),
        ):
            urls = [first, second]
            latencies: list[tuple[float, float]] = []  # (started, seconds)
            answered = 0
            halfway = asyncio.Event()
            down: list[float] = []  # when PostgreSQL stopped, then started again

            async def outage() -> None:
                await halfway.wait()
                await asyncio.to_thread(postgres_server.stop)
                down.append(time.monotonic())
                await asyncio.sleep(OUTAGE)  # the outage's length, not a wait for a state
                await asyncio.to_thread(postgres_server.start)
                down.append(time.monotonic())

            gate = asyncio.Semaphore(CONCURRENCY)

            async def send(number: int) -> None:
                nonlocal answered
                async with gate:
                    started = time.monotonic()
                    await ask(client, urls[number % 2], number, streaming=number % 2 == 1)
                    latencies.append((started, time.monotonic() - started))
                    answered += 1
                    if answered == OUTAGE_AFTER:
                        halfway.set()

            controller = asyncio.ensure_future(outage())
            started = time.monotonic()
            results = await asyncio.gather(
                *(send(n) for n in range(REQUESTS)), return_exceptions=True
            )
            elapsed = time.monotonic() - started
            await controller
            failures = [r for r in results if isinstance(r, BaseException)]
            assert failures == [], f"{len(failures)} requests failed: {failures[:3]!r}"

            stats = (await client.get(f"{upstream}/stats")).json()
            sent = stats["primary"] + stats["backup"]
            failing_over = REQUESTS // FAIL_EVERY  # two refused calls each, then the backup
            assert stats["backup"] == failing_over
            assert stats["failed"] == 2 * failing_over + REQUESTS // FAIL_EVERY  # + retried
            assert await count_reaches(dsn, sent) == sent

            # Exactly one record per upstream request, retried calls included, with what it
            # answered.
            found = await rows(dsn)
            assert len(found) == sent
            by_request: dict[str, list[Any]] = {}
            for row in found:
                by_request.setdefault(row["request_id"], []).append(row)
            assert set(by_request) == {f"r{n}" for n in range(REQUESTS)}
            refused = (1, "primary", "failed_before_output")
            shapes = {
                0: [refused, refused, (2, "backup", "completed")],
                RETRIED: [(1, "primary", "completed"), refused],
            }
            for request_id, attempts in by_request.items():
                shape = sorted((r["attempt"], r["route"], r["outcome"]) for r in attempts)
                number = int(request_id[1:])
                expected = shapes.get(number % FAIL_EVERY, [(1, "primary", "completed")])
                assert shape == expected, (request_id, shape)
            served = stats["primary"] - stats["failed"]
            assert sum(r["input_tokens"] for r in found) == (
                served * USAGE["primary"][0] + stats["backup"] * USAGE["backup"][0]
            )
            assert sum(r["output_tokens"] for r in found) == (
                served * USAGE["primary"][1] + stats["backup"] * USAGE["backup"][1]
            )
            assert all(r["cost_nanos"] is not None for r in found)
            assert all("run" in r["tags"] for r in found)
            # The outage went to the spool (and was told), not lost: the replicas said so.
            assert "spend database" in one.output() + two.output()

            # Latency: the bound held, outage or not.
            during = [s for at, s in latencies if down[0] <= at <= down[1]]
            outside = [s for at, s in latencies if not down[0] <= at <= down[1]]
            assert max(s for _, s in latencies) <= LATENCY_BOUND
            p99 = statistics.quantiles(outside, n=100)[98]
            p99_down = statistics.quantiles(during, n=100)[98] if len(during) > 100 else 0.0
            print(
                f"\nspend replicas: {REQUESTS} requests in {elapsed:.1f} s, {sent} upstream "
                f"requests, {len(found)} records; PostgreSQL down {down[1] - down[0]:.1f} s "
                f"for {len(during)} requests; p99 {p99 * 1000:.0f} ms outside the outage, "
                f"{p99_down * 1000:.0f} ms during it; max "
                f"{max(s for _, s in latencies) * 1000:.0f} ms"
            )

            # kill -9: what the replica wrote stays; it loses at most what it had queued.
            before = len(found)
            await asyncio.gather(*(ask(client, second, REQUESTS + n, False) for n in range(300)))
            stats = (await client.get(f"{upstream}/stats")).json()
            flushed = stats["primary"] + stats["backup"]
            assert await count_reaches(dsn, flushed) == flushed  # written by its writer
            burst = 100
            await asyncio.gather(
                *(ask(client, second, REQUESTS + 300 + n, False) for n in range(burst))
            )
            two.send_signal(signal.SIGKILL)
            two.process.wait(timeout=30)
            stats = (await client.get(f"{upstream}/stats")).json()
            attempted = stats["primary"] + stats["backup"]
            await count_reaches(dsn, attempted, within=3 * FLUSH_INTERVAL + 5)
            kept = len(await rows(dsn))
            lost = attempted - kept
            assert kept >= flushed >= before  # nothing it had written went
            assert 0 <= lost <= attempted - flushed  # at most the unflushed burst
            print(f"kill -9 after a burst of {burst} requests: {lost} records lost")
