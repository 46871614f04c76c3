"""Virtual keys: the model, the stores (memory, SQLite, a real PostgreSQL) and a replica's
KeyRing seeing every change within its refresh interval."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from pipeline.keys import (
    SECRET_PREFIX,
    Budget,
    KeyNotFoundError,
    KeyRing,
    KeyStore,
    MemoryKeyStore,
    PostgresKeyStore,
    SQLiteKeyStore,
    hash_secret,
    model_allowed,
    period_bounds,
)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[KeyStore]:
    made: KeyStore
    if request.param == "memory":
        made = MemoryKeyStore()
    elif request.param == "sqlite":
        made = SQLiteKeyStore(tmp_path / "keys.db")
    else:
        made = PostgresKeyStore(request.getfixturevalue("postgres_dsn"), auto_upgrade=True)
    yield made
    await made.aclose()


# -- the model -------------------------------------------------------------------------------


def test_a_budget_checks_its_amounts_and_soft_limit() -> None:
    assert Budget("1.50", "day", soft="1").limit == Decimal("1.50")
    assert Budget(limit=2).period is None
    for bad in (-1, "nan", "x", True, float("inf")):
        with pytest.raises((ValueError, TypeError)):
            Budget(bad)
    with pytest.raises(ValueError, match="soft"):
        Budget("1", soft="2")
    with pytest.raises(ValueError):
        Budget("1", "fortnight")  # type: ignore[arg-type]


def test_periods_are_calendar_aligned_in_utc() -> None:
    at = datetime(2026, 3, 18, 23, 30, tzinfo=UTC)  # a Wednesday
    assert period_bounds("day", at)[1:] == (
        datetime(2026, 3, 18, tzinfo=UTC),
        datetime(2026, 3, 19, tzinfo=UTC),
    )
    assert period_bounds("week", at)[1] == datetime(2026, 3, 16, tzinfo=UTC)  # Monday
    month = period_bounds("month", at)
    assert month[0] == "m202603" and month[2] == datetime(2026, 4, 1, tzinfo=UTC)
    assert period_bounds(None, at) == ("all", None, None)


def test_model_globs_match_the_whole_name() -> None:
    assert model_allowed(["gpt-*"], "gpt-4o")
    assert not model_allowed(["gpt-*"], "my-gpt-4o")
    assert not model_allowed(["gpt-*"], "claude-sonnet")
    assert model_allowed([], "anything")
    assert model_allowed(["claude-?-*", "o[13]"], "o3")


# -- the stores ------------------------------------------------------------------------------


async def test_a_key_is_created_with_its_secret_shown_once(store: KeyStore) -> None:
    issued = await store.create(
        "ci-bot",
        team="research",
        user="alice",
        models=["gpt-*"],
        rpm=600,
        tpm=100_000,
        budget=Budget("1.00", "month", soft="0.80"),
        metadata={"owner": "platform"},
    )
    key, secret = issued.key, issued.secret
    assert secret.startswith(SECRET_PREFIX) and len(secret) > 40
    assert key.prefix == secret[:12] and key.identity == "vk:" + key.id
    record = await store.record("ci-bot")
    assert record.key == key
    assert record.secrets == ((hash_secret(secret), None),)
    assert secret not in repr(record) and secret not in str(key.as_dict())
    assert [k.name for k in await store.list()] == ["ci-bot"]
    with pytest.raises(ValueError, match="name"):
        await store.create("ci-bot")
    with pytest.raises(KeyNotFoundError):
        await store.get("nobody")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("models", ["gpt-*\n"]),
        ("models", "gpt-*"),
        ("rpm", 0),
        ("tpm", 1.5),
        ("team", "a team"),
        ("user", "x\n"),
        ("expires_at", datetime(2030, 1, 1)),  # no zone
        ("metadata", {"x": object()}),
        ("colour", "red"),
    ],
)
async def test_bad_fields_are_refused_by_name(store: KeyStore, field: str, value: object) -> None:
    with pytest.raises((ValueError, TypeError), match=field):
        await store.create("k", **{field: value})
    assert await store.list() == []


async def test_update_rotate_and_revoke(store: KeyStore) -> None:
    first = await store.create("svc")
    changed = await store.update("svc", rpm=60, models=["claude-*"], name="service")
    assert (changed.rpm, changed.models, changed.name) == (60, ("claude-*",), "service")
    rotated = await store.rotate("service", grace=300)
    record = await store.record(first.key.id)
    secrets = dict(record.secrets)
    assert secrets[hash_secret(rotated.secret)] is None
    old_until = secrets[hash_secret(first.secret)]
    assert old_until is not None and timedelta(seconds=290) < old_until - datetime.now(UTC)
    assert rotated.key.prefix == rotated.secret[:12] != first.key.prefix
    revoked = await store.revoke(first.key.id)
    assert revoked.revoked_at is not None
    assert (await store.revoke(first.key.id)).revoked_at == revoked.revoked_at


async def test_changes_are_numbered_in_commit_order(store: KeyStore) -> None:
    version, records = await store.changes(0)
    assert (version, records) == (0, [])
    await store.create("a")
    await store.create("b")
    version, records = await store.changes(0)
    assert [r.key.name for r in records] == ["a", "b"]
    await store.update("a", rpm=5)
    later, changed = await store.changes(version)
    assert [r.key.name for r in changed] == ["a"] and later > version
    assert await store.changes(later) == (later, [])


# -- the ring --------------------------------------------------------------------------------


async def test_the_ring_finds_keys_and_tells_why_one_is_refused(store: KeyStore) -> None:
    issued = await store.create("app", expires_at=datetime.now(UTC) + timedelta(hours=1))
    ring = KeyRing(store, refresh_interval=0.05)
    await ring.start()
    try:
        found = ring.find(issued.secret)
        assert found is not None and found.key.name == "app" and found.refused is None
        assert ring.find(issued.secret.encode()) == found
        assert ring.find(SECRET_PREFIX + "not-a-key") is None
        later = datetime.now(UTC) + timedelta(hours=2)
        assert ring.find(issued.secret, later) == type(found)(found.key, "expired")
        # A rotation with a grace: both secrets work until it ends, then only the new one.
        rotated = await store.rotate("app", grace=60)
        await ring.refresh()
        assert ring.find(issued.secret).refused is None  # type: ignore[union-attr]
        assert ring.find(rotated.secret).refused is None  # type: ignore[union-attr]
        after_grace = datetime.now(UTC) + timedelta(seconds=61)
        assert ring.find(issued.secret, after_grace).refused == "rotated"  # type: ignore[union-attr]
        assert ring.find(rotated.secret, after_grace).refused is None  # type: ignore[union-attr]
        # A rotation without grace: the old secret is refused at once.
        again = await store.rotate("app")
        await ring.refresh()
        assert ring.find(rotated.secret).refused == "rotated"  # type: ignore[union-attr]
        assert ring.find(again.secret).refused is None  # type: ignore[union-attr]
        await store.revoke("app")
        await ring.refresh()
        assert ring.find(again.secret).refused == "revoked"  # type: ignore[union-attr]
    finally:
        await ring.aclose()


async def test_a_change_on_one_replica_reaches_another_within_the_interval(
    tmp_path: Path, postgres_dsn: str
) -> None:
    # Two replicas, each with a store of its own over one PostgreSQL.
    here = PostgresKeyStore(postgres_dsn, auto_upgrade=True)
    there = PostgresKeyStore(postgres_dsn, auto_upgrade=True)
    issued = await here.create("shared")
    ring = KeyRing(there, refresh_interval=0.2)
    await ring.start()
    try:
        assert ring.find(issued.secret).refused is None  # type: ignore[union-attr]
        await here.revoke("shared")
        # The first refresh to end may have begun before the revocation committed; the
        # second began after it: at most two refresh intervals (1 s each by default).
        refreshes = 0
        while ring.find(issued.secret).refused != "revoked" and refreshes < 2:  # type: ignore[union-attr]
            await asyncio.wait_for(ring.refreshed.wait(), 30.0)
            refreshes += 1
        assert ring.find(issued.secret).refused == "revoked"  # type: ignore[union-attr]
    finally:
        await ring.aclose()
        await here.aclose()
        await there.aclose()


# -- the command line ------------------------------------------------------------------------


def test_the_keys_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.cli import main

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "pipeline.toml"
    config.write_text(
        '[routes.a]\nprovider = "scripted"\nreply = "hi"\n\n[spend]\npath = "ledger.db"\n\n[keys]\n'
    )
    assert main(["db", "upgrade", "--config", str(config)]) == 0
    capsys.readouterr()
    args = ["--config", str(config)]
    assert (
        main(
            [
                "keys",
                "create",
                "ci",
                "--models",
                "gpt-*",
                "--rpm",
                "60",
                "--budget",
                "2",
                "--period",
                "day",
                "--expires",
                "30d",
                *args,
            ]
        )
        == 0
    )
    created = capsys.readouterr().out
    secret = created.split()[1]
    assert secret.startswith(SECRET_PREFIX) and "shown once" in created
    assert main(["keys", "list", *args]) == 0
    listed = capsys.readouterr().out
    assert "ci" in listed and "2/day" in listed and secret not in listed
    assert main(["keys", "rotate", "ci", "--grace", "60", "--format", "json", *args]) == 0
    import json

    rotated = json.loads(capsys.readouterr().out)
    assert rotated["secret"] != secret and rotated["name"] == "ci"
    assert main(["keys", "update", "ci", "--rpm", "120", "--format", "json", *args]) == 0
    assert json.loads(capsys.readouterr().out)["rpm"] == 120
    assert main(["keys", "revoke", "ci", *args]) == 0
    assert "revoked_at" in capsys.readouterr().out
    assert main(["keys", "show", "nobody", *args]) == 1
    assert main(["keys", "create", "bad name", *args]) == 2
    assert "name" in capsys.readouterr().err
