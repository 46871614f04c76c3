"""The spend ledger and its stores: the same suite over SQLite and a real PostgreSQL. Writes
are idempotent by record id; summaries add up what the records say; a database outage spools
records and writes each once on recovery; the queue and the spool are bounded and what
overflows is counted and logged."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from pipeline import _db
from pipeline.errors import SchemaVersionError
from pipeline.spend import (
    GROUPS,
    Attribution,
    PostgresSpendStore,
    SpendLedger,
    SpendRecord,
    SQLiteSpendStore,
)
from pipeline.spend._record import new_record_id
from pipeline.spend._store import SqlSpendStore
from tests.otel import Otel
from tests.postgres_server import PostgresServer

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def record(
    number: int,
    *,
    cost: str | None = "0.001",
    who: Attribution | None = None,
    at: datetime = T0,
    **fields: Any,
) -> SpendRecord:
    values: dict[str, Any] = {
        "id": new_record_id(),
        "time": at + timedelta(seconds=number),
        "request_id": f"req-{number}",
        "attempt": 1,
        "route": "primary",
        "provider": "openai",
        "model_requested": "gpt-4o",
        "model_served": "gpt-4o-2024-08-06",
        "input_tokens": 100,
        "output_tokens": 10,
        "cost": None if cost is None else Decimal(cost),
        "duration_ms": 12.5,
        "time_to_first_update_ms": 3.25,
    }
    if who is not None:
        values.update(
            key=who.key,
            key_name=who.key_name,
            user=who.user,
            team=who.team,
            tags=who.tags,
            endpoint=who.endpoint,
            session=who.session,
        )
    values.update(fields)
    return SpendRecord(**values)


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SqlSpendStore]:
    """An empty store of each kind (PostgreSQL's schema applied as `db upgrade` would)."""
    made: SqlSpendStore
    if request.param == "sqlite":
        made = SQLiteSpendStore(tmp_path / "spend.db")
    else:
        made = PostgresSpendStore(request.getfixturevalue("postgres_dsn"))
        await _db.upgrade(made.database)
    try:
        yield made
    finally:
        await made.aclose()


async def test_writes_are_idempotent_and_records_round_trip(store: SqlSpendStore) -> None:
    who = Attribution(
        key="key-1",
        key_name="ci",
        user="u1",
        team="ml",
        tags=("a", "b"),
        endpoint="/v1/x",
        session="s-1",
    )
    first = record(
        1,
        who=who,
        cache_read_tokens=40,
        cache_write_tokens=5,
        reasoning_tokens=3,
        estimated=True,
        outcome="failed_after_output",
        cost="0.000123456",
    )
    hit = record(2, cost="0", cache="hit", saved_cost=Decimal("0.25"), attempt=0)
    unpriced = record(3, cost=None, time_to_first_update_ms=None)
    await store.write([first, hit, unpriced])
    await store.write([first, hit])  # again: the same rows
    await store.write([])
    found = await store.records()
    assert found == [first, hit, unpriced]
    assert first.attributed(who) == first
    assert found[0].session == "s-1" and found[0].tags == ("a", "b")


async def test_summaries_add_up_by_any_attribution_field(store: SqlSpendStore) -> None:
    alice = Attribution(key="k1", key_name="alice-key", user="alice", team="red", tags=("x",))
    bob = Attribution(key="k2", key_name="bob-key", user="bob", team="red", tags=("x", "y"))
    carol = Attribution(key="k3", key_name="carol-key", user="carol", team="blue")
    records = [
        record(1, who=alice, cost="0.5", endpoint="/v1/chat/completions"),
        record(2, who=alice, cost="0.25", route="backup", request_id="req-1", attempt=2),
        record(3, who=bob, cost="1", input_tokens=1000, output_tokens=7),
        record(4, who=carol, cost=None),  # unpriced
        record(5, who=carol, cost="0", cache="hit", saved_cost=Decimal("0.75"), attempt=0),
    ]
    await store.write(records)
    by_team = {s.group["team"]: s for s in await store.summary(["team"])}
    assert set(by_team) == {"red", "blue"}
    red = by_team["red"]
    assert (red.requests, red.attempts, red.cache_hits) == (2, 3, 0)
    assert red.cost == Decimal("1.75")
    assert (red.input_tokens, red.output_tokens) == (1200, 27)
    blue = by_team["blue"]
    assert (blue.attempts, blue.cache_hits, blue.unpriced) == (1, 1, 1)
    assert (blue.cost, blue.saved_cost) == (Decimal(0), Decimal("0.75"))
    assert blue.group == {"team": "blue", "currency": "USD"}  # amounts never mix currencies
    by_user_route = {
        (s.group["user"], s.group["route"]): s.cost for s in await store.summary(["user", "route"])
    }
    assert by_user_route == {
        ("alice", "backup"): Decimal("0.25"),
        ("alice", "primary"): Decimal("0.5"),
        ("bob", "primary"): Decimal("1"),
        ("carol", "primary"): Decimal("0"),
    }
    by_tag = {s.group["tag"]: (s.attempts, s.cost) for s in await store.summary(["tag"])}
    # A record counts in each of its tags' groups; records without tags in the None group.
    assert by_tag == {
        "x": (3, Decimal("1.75")),
        "y": (1, Decimal("1")),
        None: (1, Decimal("0")),
    }
    by_key = {s.group["key_name"]: s.cost for s in await store.summary(["key_name"])}
    assert by_key == {"alice-key": Decimal("0.75"), "bob-key": Decimal("1"), "carol-key": 0}
    endpoints = {s.group["endpoint"]: s.attempts for s in await store.summary(["endpoint"])}
    assert endpoints == {"/v1/chat/completions": 1, None: 3}
    (everything,) = await store.summary()
    assert everything.cost == Decimal("1.75") and everything.attempts == 4
    days = await store.summary(["day", "hour"])
    assert [(s.group["day"], s.group["hour"]) for s in days] == [
        ("2026-03-01", "2026-03-01T12:00Z")
    ]


async def test_summaries_filter_by_time_and_fields(store: SqlSpendStore) -> None:
    red = Attribution(team="red", tags=("x",))
    await store.write(
        [record(n, who=red if n % 2 else None, cost="1", route=f"r{n % 3}") for n in range(10)]
    )

    async def total(**options: Any) -> Decimal:
        found = await store.summary(**options)
        return sum((s.cost for s in found), Decimal(0))

    assert await total() == 10
    assert await total(since=T0 + timedelta(seconds=3)) == 7
    assert await total(until=T0 + timedelta(seconds=3)) == 3  # the end is excluded
    assert await total(since=T0 + timedelta(seconds=2), until=T0 + timedelta(seconds=4)) == 2
    assert await total(where={"team": "red"}) == 5
    assert await total(where={"team": None}) == 5
    assert await total(where={"team": ["red", None]}) == 10
    assert await total(where={"route": ["r0", "r1"]}) == 7
    assert await total(where={"tag": "x"}) == 5
    assert await total(where={"tag": ["nope"]}) == 0
    assert await total(where={"route": []}) == 0
    naive = datetime(2026, 3, 1, 12, 0, 5)  # a naive time is UTC
    assert await total(since=naive) == 5


async def test_unknown_groups_and_filters_are_refused(store: SqlSpendStore) -> None:
    with pytest.raises(ValueError, match="cannot group by 'colour'; expected some of"):
        await store.summary(["colour"])
    with pytest.raises(ValueError, match="cannot filter on 'day'"):
        await store.summary(where={"day": "2026-01-01"})
    assert {"key", "team", "user", "tag", "endpoint", "route", "day"} <= set(GROUPS)


async def test_a_postgres_store_without_its_schema_says_to_upgrade(postgres_dsn: str) -> None:
    store = PostgresSpendStore(postgres_dsn)
    try:
        with pytest.raises(SchemaVersionError, match="run `chat-pipeline db upgrade`"):
            await store.write([record(1)])
    finally:
        await store.aclose()
    upgrading = PostgresSpendStore(postgres_dsn, auto_upgrade=True)
    try:
        await upgrading.write([record(1)])
        assert len(await upgrading.records()) == 1
    finally:
        await upgrading.aclose()


# -- the ledger ---------------------------------------------------------------------------------


class Down:
    """A store whose database never answers."""

    def describe(self) -> str:
        return "down"

    async def write(self, records: Sequence[SpendRecord]) -> None:
        raise ConnectionRefusedError

    async def summary(self, *args: Any, **kwargs: Any) -> Any:
        raise ConnectionRefusedError

    async def records(self, **kwargs: Any) -> Any:
        raise ConnectionRefusedError

    async def aclose(self) -> None:
        pass


class Watched:
    """A store that tells each write (its size) and can fail on command, around a real one."""

    def __init__(self, store: SqlSpendStore) -> None:
        self.store = store
        self.batches: list[int] = []
        self.fail_after_commit = False
        self.written = asyncio.Condition()

    def describe(self) -> str:
        return self.store.describe()

    async def write(self, records: Sequence[SpendRecord]) -> None:
        await self.store.write(records)
        self.batches.append(len(records))
        async with self.written:
            self.written.notify_all()
        if self.fail_after_commit:
            raise ConnectionResetError("the acknowledgment was lost")

    async def wait_for(self, total: int) -> None:
        async with self.written:
            await self.written.wait_for(lambda: sum(self.batches) >= total)

    async def summary(self, *args: Any, **kwargs: Any) -> Any:
        return await self.store.summary(*args, **kwargs)

    async def records(self, **kwargs: Any) -> Any:
        return await self.store.records(**kwargs)

    async def aclose(self) -> None:
        await self.store.aclose()


async def test_records_are_written_in_batches_by_the_ledgers_own_task(
    store: SqlSpendStore,
) -> None:
    watched = Watched(store)
    ledger = SpendLedger(watched, max_batch=10, flush_interval=3600)  # type: ignore[arg-type]
    ledger.record(record(n) for n in range(25))  # a full batch wakes the writer at once
    await watched.wait_for(20)
    assert watched.batches[:2] == [10, 10]
    assert await ledger.flush()
    assert watched.batches == [10, 10, 5]
    assert ledger.written == 25 and ledger.queued == 0
    assert len(await store.records()) == 25
    await ledger.aclose()


async def test_the_interval_writes_what_waits(store: SqlSpendStore) -> None:
    watched = Watched(store)
    ledger = SpendLedger(watched, flush_interval=0.01)  # type: ignore[arg-type]
    ledger.record([record(1), record(2)])
    await watched.wait_for(2)  # no flush asked: the interval wrote them
    assert watched.batches == [2]
    await ledger.aclose()


async def test_a_write_whose_acknowledgment_was_lost_is_still_one_row(
    store: SqlSpendStore, tmp_path: Path
) -> None:
    watched = Watched(store)
    ledger = SpendLedger(  # type: ignore[arg-type]
        watched, flush_interval=3600, spool=str(tmp_path / "spool"), retry_interval=0.01
    )
    watched.fail_after_commit = True
    ledger.record(record(n) for n in range(5))
    assert not await ledger.flush()  # committed, but the ledger cannot know: spooled
    assert ledger.spooled == 5
    watched.fail_after_commit = False
    assert await ledger.flush()  # the spool is written again
    assert len(await store.records()) == 5
    assert ledger.written == 5
    await ledger.aclose()
    assert list((tmp_path / "spool").iterdir()) == []  # nothing left behind


async def test_a_postgres_outage_spools_and_recovery_writes_each_record_once(
    postgres_server: PostgresServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = PostgresSpendStore(postgres_server.dsn, auto_upgrade=True, timeout=2.0)
    ledger = SpendLedger(
        store, flush_interval=3600, spool=str(tmp_path / "spool"), retry_interval=0.01
    )
    ledger.record(record(n) for n in range(10))
    assert await ledger.flush()
    postgres_server.stop()
    ledger.record(record(n) for n in range(10, 30))
    with caplog.at_level(logging.WARNING, logger="chat_pipeline.spend"):
        assert not await ledger.flush()
        assert not await ledger.flush()
    assert ledger.queued == 0 and ledger.spooled == 20  # in the spool, not in memory
    warnings = [r for r in caplog.records if "spend database" in r.getMessage()]
    assert len(warnings) == 1  # an outage is told once, not per write
    assert postgres_server.dsn not in caplog.text
    ledger.record(record(n) for n in range(30, 35))
    postgres_server.start()
    assert await ledger.flush()
    rows = await store.records(limit=100)
    assert len(rows) == 35 and len({r.id for r in rows}) == 35
    assert ledger.written == 35
    await ledger.aclose()


async def test_a_spool_left_by_a_process_that_ended_is_written_by_the_next(
    store: SqlSpendStore, tmp_path: Path
) -> None:
    spool = str(tmp_path / "spool")

    first = SpendLedger(Down(), spool=spool, flush_interval=3600)
    first.record(record(n) for n in range(7))
    await first.aclose()  # the database never answered: the records stay spooled
    assert first.spooled == 7
    (left,) = (tmp_path / "spool").iterdir()
    second = SpendLedger(store, spool=spool, flush_interval=3600, close_store=False)
    assert await second.flush()
    assert not left.exists()
    assert len(await store.records()) == 7
    await second.aclose()


async def test_the_spool_of_a_living_process_is_left_alone(
    store: SqlSpendStore, tmp_path: Path
) -> None:
    from pipeline.spend._spool import Spool

    folder = tmp_path / "spool"
    alive = Spool(folder, max_bytes=1 << 20)
    alive.append([record(1)])  # held under its lock while its process lives
    ledger = SpendLedger(store, spool=str(folder), flush_interval=3600, close_store=False)
    assert await ledger.flush()
    assert await store.records() == []
    alive.close()  # its process ended: now the next flush takes it
    assert await ledger.flush()
    assert len(await store.records()) == 1
    await ledger.aclose()


async def test_the_queue_is_bounded_and_overflow_is_counted_and_logged_once(
    tmp_path: Path, otel: Otel, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = SpendLedger(
        SQLiteSpendStore(tmp_path / "spend.db"),
        max_queue=5,
        max_batch=100,
        flush_interval=3600,
        meter_provider=otel.meter_provider,
    )
    with caplog.at_level(logging.WARNING, logger="chat_pipeline.spend"):
        ledger.record(record(n) for n in range(8))
        ledger.record(record(n) for n in range(8, 10))
    assert (ledger.queued, ledger.dropped) == (5, 5)
    assert (
        otel.total("chat_pipeline.spend.dropped", **{"chat_pipeline.spend.reason": "queue_full"})
        == 5
    )
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1
    assert await ledger.flush()
    assert otel.total("chat_pipeline.spend.written") == 5
    await ledger.aclose()


async def test_the_spool_is_bounded_too(tmp_path: Path, otel: Otel) -> None:
    ledger = SpendLedger(
        Down(),
        spool=str(tmp_path / "spool"),
        max_spool_bytes=2048,
        flush_interval=3600,
        meter_provider=otel.meter_provider,
    )
    ledger.record(record(n) for n in range(20))
    assert not await ledger.flush()
    assert 0 < ledger.spooled < 20 and ledger.spooled + ledger.dropped == 20
    assert (
        otel.total("chat_pipeline.spend.dropped", **{"chat_pipeline.spend.reason": "spool_full"})
        == ledger.dropped
    )
    await ledger.aclose()


async def test_closing_writes_what_is_queued_and_later_records_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "spend.db"
    ledger = SpendLedger(SQLiteSpendStore(path), flush_interval=3600)
    ledger.record(record(n) for n in range(3))
    await ledger.aclose()
    await ledger.aclose()  # once
    ledger.record([record(9)])
    assert ledger.dropped == 1
    reopened = SQLiteSpendStore(path)
    assert len(await reopened.records()) == 3
    await reopened.aclose()


def test_recording_outside_an_event_loop_never_raises(tmp_path: Path) -> None:
    ledger = SpendLedger(SQLiteSpendStore(tmp_path / "spend.db"))
    ledger.record([record(1)])
    assert ledger.queued == 1


async def test_the_cost_metrics_by_route_model_key_and_team(tmp_path: Path, otel: Otel) -> None:
    ledger = SpendLedger(
        SQLiteSpendStore(tmp_path / "spend.db"),
        flush_interval=3600,
        meter_provider=otel.meter_provider,
    )
    who = Attribution(key="k1", key_name="ci", team="ml")
    ledger.record(
        [
            record(1, who=who, cost="0.5"),
            record(2, who=who, cost="0.25"),
            record(3, cost=None, model_served="mystery"),
            record(4, cost="0", cache="hit", saved_cost=Decimal(1)),
        ]
    )
    assert otel.total("chat_pipeline.spend.cost") == 0  # counted as the writer takes them
    await ledger.flush()
    labels = {
        "chat_pipeline.route.name": "primary",
        "chat_pipeline.spend.model": "gpt-4o-2024-08-06",
        "chat_pipeline.spend.key": "ci",
        "chat_pipeline.spend.team": "ml",
    }
    assert otel.total("chat_pipeline.spend.cost", **labels) == pytest.approx(0.75)
    assert (
        otel.total("chat_pipeline.spend.unpriced", **{"chat_pipeline.spend.model": "mystery"}) == 1
    )
    await ledger.aclose()


def test_attribution_values_are_bounded_and_checked() -> None:
    who = Attribution(user="u" * 1000, tags=[f"t{n}" for n in range(100)] + ["t1"])  # type: ignore[arg-type]
    assert len(who.user or "") == 256 and len(who.tags) == 32
    assert Attribution(tags="a, b,,a").tags == ("a", "b")  # type: ignore[arg-type]
    assert Attribution.of({"team": "red"}) == Attribution(team="red")
    with pytest.raises(ValueError, match="unknown attribution field"):
        Attribution.of({"colour": "red"})
    merged = Attribution(team="server", tags=("s",)).over(
        Attribution(team="mine", user="me", tags=("m",))
    )
    assert merged == Attribution(team="server", user="me", tags=("m", "s"))
