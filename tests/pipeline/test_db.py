"""The database layer (`pipeline._db`): opening, bounded calls, transactions and migrations,
the same tests over SQLite and a real PostgreSQL."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pipeline import _db
from pipeline._db import _sqlite
from pipeline.cli import main
from pipeline.errors import SchemaVersionError
from tests.postgres_server import PostgresServer


@pytest.fixture(params=["sqlite", "postgres"])
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[_db.Database]:
    """An empty database of each dialect."""
    if request.param == "sqlite":
        opened = _db.open_database(tmp_path / "ledger.db")
    else:
        opened = _db.open_database(request.getfixturevalue("postgres_dsn"))
    try:
        yield opened
    finally:
        await opened.aclose()


def test_urls_and_paths_open_their_dialect(tmp_path: Path) -> None:
    assert _db.open_database("postgresql://u:pw@db.example:5433/ledger").dialect == "postgres"
    assert _db.open_database("postgres://db.example/ledger").dialect == "postgres"
    relative = _db.open_database("sqlite:///spend.db")
    assert relative.dialect == "sqlite" and str(relative.describe()) == "sqlite spend.db"
    absolute = _db.open_database(f"sqlite:///{tmp_path}/x.db")
    assert absolute.describe() == f"sqlite {tmp_path}/x.db"
    assert _db.open_database(tmp_path / "y.db").describe() == f"sqlite {tmp_path}/y.db"


def test_a_url_or_its_password_is_never_echoed() -> None:
    with pytest.raises(ValueError, match="got a mysql URL") as raised:
        _db.open_database("mysql://root:s3cret@db/x")
    assert "s3cret" not in str(raised.value)
    database = _db.open_database("postgresql://admin:s3cret@db.example:5433/ledger")
    assert database.describe() == "postgres db.example:5433/ledger"
    assert "s3cret" not in repr(database) and "admin" not in repr(database)
    with pytest.raises(ValueError, match="needs a file path"):
        _db.open_database("")


def test_placeholders_are_numbered_for_postgres_outside_quoted_strings() -> None:
    sql = "SELECT ? WHERE a = '?' AND b = ? AND c = 'it''s ?'"
    assert _db.placeholders(sql) == "SELECT $1 WHERE a = '?' AND b = $2 AND c = 'it''s ?'"


def test_each_dialect_has_the_same_numbered_migrations() -> None:
    sqlite, postgres = _db.migrations("sqlite"), _db.migrations("postgres")
    assert [m.version for m in sqlite] == list(range(1, len(sqlite) + 1))
    assert [(m.version, m.name) for m in sqlite] == [(m.version, m.name) for m in postgres]
    assert sqlite[0].name == "spend"
    assert _db.latest_version("sqlite") == _db.latest_version("postgres") == len(sqlite)


async def test_upgrade_applies_each_migration_once(database: _db.Database) -> None:
    assert await _db.schema_version(database) == 0
    with pytest.raises(SchemaVersionError, match="run `chat-pipeline db upgrade`") as behind:
        await _db.require_schema(database)
    assert (behind.value.found, behind.value.expected) == (0, _db.latest_version(database.dialect))
    applied = await _db.upgrade(database)
    assert [m.version for m in applied] == list(range(1, _db.latest_version(database.dialect) + 1))
    assert await _db.upgrade(database) == []
    assert await _db.require_schema(database) == _db.latest_version(database.dialect)
    rows = await database.fetch(f"SELECT version, name FROM {_db.MIGRATIONS_TABLE}")
    assert rows == [(m.version, m.name) for m in applied]


async def test_replicas_upgrading_at_once_apply_each_migration_once(
    database: _db.Database, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Three processes' worth of databases, one file or server: each migration once.
    others = [
        _db.open_database(
            tmp_path / "ledger.db"
            if database.dialect == "sqlite"
            else request.getfixturevalue("postgres_dsn").rsplit("/", 1)[0]
            + "/"
            + database.describe().rsplit("/", 1)[1]
        )
        for _ in range(2)
    ]
    try:
        results = await asyncio.gather(*(_db.upgrade(d) for d in [database, *others]))
    finally:
        for other in others:
            await other.aclose()
    assert sorted(m.version for applied in results for m in applied) == list(
        range(1, _db.latest_version(database.dialect) + 1)
    )


async def test_a_schema_ahead_of_the_code_is_refused(database: _db.Database) -> None:
    await _db.upgrade(database)
    latest = _db.latest_version(database.dialect)
    await database.execute(
        f"INSERT INTO {_db.MIGRATIONS_TABLE} (version, name, applied_at_us) VALUES (?, ?, ?)",
        (latest + 1, "from_the_future", 0),
    )
    with pytest.raises(SchemaVersionError, match="newer than this code's") as ahead:
        await _db.require_schema(database)
    assert ahead.value.found == latest + 1


async def test_statements_round_trip_and_a_failed_transaction_leaves_nothing(
    database: _db.Database,
) -> None:
    await database.execute("CREATE TABLE t (id TEXT PRIMARY KEY, n INTEGER NOT NULL)")
    await database.executemany("INSERT INTO t (id, n) VALUES (?, ?)", [("a", 1), ("b", 2)])

    async def half_then_fail(connection: _db.Connection) -> None:
        await connection.execute("INSERT INTO t (id, n) VALUES (?, ?)", ("c", 3))
        raise RuntimeError("the work failed")

    with pytest.raises(RuntimeError, match="the work failed"):
        await database.transaction(half_then_fail)

    async def both(connection: _db.Connection) -> list[tuple[object, ...]]:
        await connection.executemany("INSERT INTO t (id, n) VALUES (?, ?)", [("d", 4)])
        return await connection.fetch("SELECT COUNT(*) FROM t")

    assert await database.transaction(both, exclusive=True) == [(3,)]
    assert await database.fetch("SELECT id, n FROM t ORDER BY id") == [
        ("a", 1),
        ("b", 2),
        ("d", 4),
    ]
    # A batch with a row that fails writes none of it.
    with pytest.raises(Exception, match=r"(?i)unique|duplicate"):
        await database.executemany("INSERT INTO t (id, n) VALUES (?, ?)", [("e", 5), ("a", 6)])
    assert await database.fetch("SELECT COUNT(*) FROM t") == [(3,)]
    assert await database.ping() == "ok"


async def test_concurrent_calls_never_interleave_a_transaction(database: _db.Database) -> None:
    await database.execute("CREATE TABLE t (id TEXT PRIMARY KEY, n INTEGER NOT NULL)")
    inside = asyncio.Event()
    go_on = asyncio.Event()

    async def slow(connection: _db.Connection) -> None:
        await connection.execute("INSERT INTO t (id, n) VALUES (?, ?)", ("a", 1))
        inside.set()
        await go_on.wait()
        raise RuntimeError("rolled back")

    transaction = asyncio.ensure_future(database.transaction(slow))
    await inside.wait()
    reader = asyncio.ensure_future(database.fetch("SELECT COUNT(*) FROM t"))
    go_on.set()
    with pytest.raises(RuntimeError):
        await transaction
    assert await reader == [(0,)]  # never saw the uncommitted row


async def test_a_stopped_postgres_fails_calls_within_the_bound_and_recovery_needs_no_restart(
    postgres_server: PostgresServer,
) -> None:
    database = _db.open_database(postgres_server.dsn, timeout=2.0)
    try:
        assert await database.ping() == "ok"
        postgres_server.stop()
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(Exception):  # noqa: B017 - whichever the driver raises
            await database.fetch("SELECT 1")
        assert loop.time() - started < 2.0 + 1.0  # the bound, plus scheduling slack
        assert (await database.ping()).startswith("unavailable (")
        postgres_server.start()
        assert await database.fetch("SELECT 1") == [(1,)]
    finally:
        await database.aclose()


def test_db_upgrade_and_status_from_a_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "pipeline.toml"
    config.write_text(
        '[routes.a]\nprovider = "scripted"\nreply = "hi"\n\n[spend]\npath = "spend/ledger.db"\n'
    )
    assert main(["db", "status", "--config", str(config)]) == 1
    assert "schema at version 0 of 2 (run `chat-pipeline db upgrade`)" in capsys.readouterr().out
    assert main(["db", "upgrade", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "applied 0001_spend",
        "applied 0002_keys",
        "sqlite spend/ledger.db: schema at version 2 (the latest)",
    ]
    assert main(["db", "upgrade", "--config", str(config)]) == 0
    assert "nothing to apply" in capsys.readouterr().out
    assert main(["db", "status", "--config", str(config)]) == 0
    assert "schema at version 2 of 2 (up to date)" in capsys.readouterr().out


def test_db_upgrade_of_a_postgres_database_named_by_a_variable(
    postgres_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LEDGER_DSN", postgres_dsn)
    assert main(["db", "upgrade", "--database-env", "LEDGER_DSN"]) == 0
    assert "applied 0001_spend" in capsys.readouterr().out
    assert main(["db", "status", "--database-env", "LEDGER_DSN"]) == 0


def test_db_commands_without_a_database_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    assert main(["db", "upgrade", "--database-env", "NOT_SET_ANYWHERE"]) == 2
    assert "NOT_SET_ANYWHERE is not set" in capsys.readouterr().err
    config = tmp_path / "pipeline.toml"
    config.write_text('[routes.a]\nprovider = "scripted"\nreply = "hi"\n')
    assert main(["db", "upgrade", "--config", str(config)]) == 2
    assert "no [spend] table" in capsys.readouterr().err


def test_a_stopped_database_is_told_by_its_error_type_only(
    postgres_server: PostgresServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    postgres_server.stop()
    monkeypatch.setenv("LEDGER_DSN", postgres_server.dsn.replace("@", ":s3cret@", 1))
    assert main(["db", "status", "--database-env", "LEDGER_DSN"]) == 1
    err = capsys.readouterr().err
    assert "failed (" in err and "s3cret" not in err


class _LockedThenFree:
    """A connection whose switch to WAL finds the file locked `times` times (another
    replica switching it at that moment), then succeeds."""

    def __init__(self, times: int, error: str = "database is locked") -> None:
        self.times = times
        self.error = error
        self.calls = 0

    def execute(self, sql: str) -> None:
        assert sql == "PRAGMA journal_mode=WAL"
        self.calls += 1
        if self.calls <= self.times:
            raise sqlite3.OperationalError(self.error)


def test_switching_to_wal_waits_for_a_replica_switching_the_same_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pauses: list[float] = []
    monkeypatch.setattr(_sqlite.time, "sleep", pauses.append)
    raw = _LockedThenFree(times=3)
    _sqlite._switch_to_wal(raw, timeout=5.0)  # type: ignore[arg-type]
    assert raw.calls == 4 and len(pauses) == 3

    # Another error is raised at once; a lock that outlasts the bound is raised at the bound.
    other = _LockedThenFree(times=1, error="disk I/O error")
    with pytest.raises(sqlite3.OperationalError, match="disk I/O"):
        _sqlite._switch_to_wal(other, timeout=5.0)  # type: ignore[arg-type]
    assert other.calls == 1
    pauses.clear()
    stuck = _LockedThenFree(times=10_000)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        _sqlite._switch_to_wal(stuck, timeout=0.05)  # type: ignore[arg-type]
    assert stuck.calls == 5 and len(pauses) == 4
