"""The gateway's spend ledger: every request's attempts recorded with whose request it was
(key, body user and metadata, tags header, path, session), summaries that add up to the
records and to what the upstreams served, and ``GET /admin/spend`` behind the admin key."""

from __future__ import annotations

import csv
import io
import itertools
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.config import parse_config
from pipeline.gateway._auth import key_identity
from pipeline.testing import FakeAnthropicServer, FakeOpenAIServer, FakeResponse
from tests.pipeline.gateway.conftest import running

ADMIN = "admin-secret-1"
KEYS = ["key-a-secret", "key-b-secret"]
# What the ledger keeps of each: its identity's start (never the key, nor its place).
NAMES = [key_identity(key.encode())[:10] for key in KEYS]


def spend_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, routes: dict[str, Any], **gateway: Any
) -> Any:
    monkeypatch.setenv("SPEND_TEST_KEYS", ",".join(KEYS))
    monkeypatch.setenv("SPEND_TEST_ADMIN", ADMIN)
    return parse_config(
        {
            "routes": routes,
            "router": {"kind": "ordered", "order": list(routes)},
            "gateway": {
                "api_keys_env": "SPEND_TEST_KEYS",
                "admin_key_env": "SPEND_TEST_ADMIN",
                **gateway,
            },
            "spend": {"path": str(tmp_path / "spend.db"), "flush_interval": 0.05},
        }
    )


async def test_attribution_totals_equal_the_records_and_the_upstreams(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, streaming: bool
) -> None:
    async with FakeOpenAIServer() as primary, FakeOpenAIServer() as backup:
        # gpt-4o-mini: priced by genai-prices. Every third request fails over to the backup.
        primary.default = FakeResponse(usage=(120, 30))
        backup.default = FakeResponse(usage=(200, 50))
        routes = {
            "primary": {"provider": "openai", "model": "gpt-4o-mini", "base_url": primary.base_url},
            "backup": {"provider": "openai", "model": "gpt-4o-mini", "base_url": backup.base_url},
        }
        config = spend_config(tmp_path, monkeypatch, routes)
        users, teams, tags = ["ana", "bo"], ["red", "blue", None], ["web", "batch"]
        expected: Counter[tuple[str, str]] = Counter()
        async with (
            running(config) as gateway,
            httpx.AsyncClient(base_url=gateway.url, timeout=30) as client,
        ):
            for n in range(12):
                if n % 3 == 2:
                    primary.script(FakeResponse(status=503, error_type="server_error"))
                user, team, tag, key = users[n % 2], teams[n % 3], tags[n % 2], KEYS[n % 2]
                body: dict[str, Any] = {
                    "model": "pipeline",
                    "messages": [{"role": "user", "content": f"question {n}"}],
                    "user": user,
                    "stream": streaming,
                }
                if team is not None:
                    body["metadata"] = {"team": team}
                response = await client.post(
                    "/v1/chat/completions",
                    json=body,
                    headers={
                        "authorization": f"Bearer {key}",
                        "x-chat-pipeline-tags": f"{tag}, all",
                        "x-session-id": f"s{n % 4}",
                    },
                )
                assert response.status_code == 200, response.text
                served = 200 + 50 if n % 3 == 2 else 120 + 30
                for field, value in (
                    ("user", user),
                    ("team", team or "-"),
                    ("tag", tag),
                    ("tag", "all"),
                    ("key_name", NAMES[n % 2]),
                ):
                    expected[(field, value)] += served  # the failed attempt used nothing
            ledger = gateway.gateway.spend
            assert ledger is not None
            records = await ledger.records()
            # One record per request the upstreams received: the failed ones used nothing.
            assert len(records) == primary.count() + backup.count() == 12 + 4
            failed = [r for r in records if r.outcome == "failed_before_output"]
            assert len(failed) == 4 and all(r.route == "primary" for r in failed)
            assert sum(r.input_tokens + r.output_tokens for r in records) == (
                (primary.count() - 4) * 150 + backup.count() * 250
            )
            assert {r.endpoint for r in records} == {"/v1/chat/completions"}
            assert {r.session for r in records} == {"s0", "s1", "s2", "s3"}
            for field in ("user", "team", "tag", "key_name", "route", "endpoint"):
                summaries = await ledger.summary([field])
                by_group = {s.group[field]: s for s in summaries}
                for value, summary in by_group.items():
                    mine = [
                        r
                        for r in records
                        if (value in r.tags if field == "tag" else getattr(r, field) == value)
                    ]
                    assert summary.input_tokens == sum(r.input_tokens for r in mine)
                    assert summary.output_tokens == sum(r.output_tokens for r in mine)
                    assert summary.cost == sum((r.cost or Decimal(0) for r in mine), Decimal(0))
                    assert summary.attempts == len(mine)
                    if field in ("user", "tag", "key_name"):
                        tokens = summary.input_tokens + summary.output_tokens
                        assert tokens == expected[(field, value)]
            (total,) = await ledger.summary()
            # gpt-4o-mini: $0.15 input, $0.60 output per million tokens.
            inputs, outputs = Decimal(8 * 120 + 4 * 200), Decimal(8 * 30 + 4 * 50)
            cost = (inputs * Decimal("0.15") + outputs * Decimal("0.6")) / 1_000_000
            assert total.cost == cost and total.unpriced == 0 and total.requests == 12


async def test_the_anthropic_and_responses_paths_are_their_endpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeAnthropicServer() as upstream:
        routes = {
            "claude": {
                "provider": "anthropic",
                "model": "claude-sonnet-4-5",
                "base_url": upstream.base_url,
                "api_key_env": "SPEND_TEST_ANTHROPIC",
            }
        }
        monkeypatch.setenv("SPEND_TEST_ANTHROPIC", "sk-ant-test")
        config = spend_config(tmp_path, monkeypatch, routes)
        async with (
            running(config) as gateway,
            httpx.AsyncClient(base_url=gateway.url, timeout=30) as client,
        ):
            headers = {"x-api-key": KEYS[1], "anthropic-version": "2023-06-01"}
            messages = await client.post(
                "/v1/messages",
                json={
                    "model": "pipeline",
                    "max_tokens": 50,
                    "messages": [{"role": "user", "content": "hi"}],
                    "metadata": {"user_id": "u-77"},
                },
                headers=headers,
            )
            assert messages.status_code == 200, messages.text
            responses = await client.post(
                "/v1/responses",
                json={"model": "pipeline", "input": "hi", "user": "u-88"},
                headers={"authorization": f"Bearer {KEYS[0]}"},
            )
            assert responses.status_code == 200, responses.text
            ledger = gateway.gateway.spend
            assert ledger is not None
            by_endpoint = {r.endpoint: r for r in await ledger.records()}
            assert set(by_endpoint) == {"/v1/messages", "/v1/responses"}
            assert by_endpoint["/v1/messages"].user == "u-77"
            assert by_endpoint["/v1/messages"].key_name == NAMES[1]
            assert by_endpoint["/v1/responses"].user == "u-88"
            assert all(r.cost is not None and r.cost > 0 for r in by_endpoint.values())


async def test_a_route_served_by_name_is_priced_at_its_price_and_its_retries_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, streaming: bool
) -> None:
    async with FakeOpenAIServer() as cheap, FakeOpenAIServer() as other:
        cheap.default = other.default = FakeResponse(usage=(100, 20))
        cheap.script(FakeResponse(status=503, error_type="server_error"))  # retried
        routes = {
            "cheap": {
                "provider": "openai",
                "model": "gpt-4o-mini",
                "base_url": cheap.base_url,
                "price": {"input_per_million": 1.0, "output_per_million": 2.0},
                "retry": {"max_attempts": 2, "initial_delay": 0, "max_delay": 0},
            },
            "other": {"provider": "openai", "model": "gpt-4o-mini", "base_url": other.base_url},
        }
        models = {"cheap": "cheap", "pipeline": "pipeline"}
        config = spend_config(tmp_path, monkeypatch, routes, models=models)
        async with (
            running(config) as gateway,
            httpx.AsyncClient(base_url=gateway.url, timeout=30) as client,
        ):
            response = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "cheap",
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream": streaming,
                },
                headers={"authorization": f"Bearer {KEYS[0]}"},
            )
            assert response.status_code == 200, response.text
            ledger = gateway.gateway.spend
            assert ledger is not None
            records = sorted(await ledger.records(), key=lambda r: r.outcome)
        assert cheap.count() == 2 and other.count() == 0
        # One record per call: the retried one used nothing; the answer at the route's
        # price (100 x 1 + 20 x 2 per million), not the book's.
        assert [(r.route, r.outcome, r.cost) for r in records] == [
            ("cheap", "completed", Decimal("0.00014")),
            ("cheap", "failed_before_output", Decimal(0)),
        ]


async def test_admin_spend_answers_the_admin_key_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeOpenAIServer() as primary:
        routes = {
            "primary": {"provider": "openai", "model": "gpt-4o-mini", "base_url": primary.base_url}
        }
        config = spend_config(tmp_path, monkeypatch, routes)
        async with (
            running(config) as gateway,
            httpx.AsyncClient(base_url=gateway.url, timeout=30) as client,
        ):
            for n, key in zip(range(4), itertools.cycle(KEYS), strict=False):
                response = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "pipeline",
                        "messages": [{"role": "user", "content": "hi"}],
                        "metadata": {"team": "red" if n % 2 else "blue"},
                    },
                    headers={"authorization": f"Bearer {key}"},
                )
                assert response.status_code == 200
            for headers in ({}, {"authorization": f"Bearer {KEYS[0]}"}, {"x-api-key": "nope"}):
                refused = await client.get("/admin/spend", headers=headers)
                assert refused.status_code == 401
                assert ADMIN not in refused.text and KEYS[0] not in refused.text
            admin = {"authorization": f"Bearer {ADMIN}"}
            found = await client.get(
                "/admin/spend", params={"group_by": "team,key_name"}, headers=admin
            )
            assert found.status_code == 200
            data = found.json()
            assert data["group_by"] == ["team", "key_name", "currency"]
            rows = {(row["team"], row["key_name"]): row for row in data["data"]}
            assert set(rows) == {("blue", NAMES[0]), ("red", NAMES[1])}
            assert all(row["attempts"] == 2 and row["input_tokens"] == 10 for row in rows.values())
            assert Decimal(rows[("red", NAMES[1])]["cost"]) > 0
            red = await client.get(
                "/admin/spend",
                params={"team": "red", "format": "csv", "since": "1h"},
                headers={"x-api-key": ADMIN},
            )
            assert red.status_code == 200 and red.headers["content-type"].startswith("text/csv")
            (row,) = list(csv.DictReader(io.StringIO(red.text)))
            assert row["attempts"] == "2" and row["currency"] == "USD"
            bad = await client.get("/admin/spend", params={"group_by": "colour"}, headers=admin)
            assert bad.status_code == 400 and "cannot group by" in bad.json()["error"]["message"]
            later = await client.get("/admin/spend", params={"since": "2999-01-01"}, headers=admin)
            assert later.json()["data"] == []


async def test_without_an_admin_key_there_is_no_admin_endpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeOpenAIServer() as primary:
        config = parse_config(
            {
                "routes": {
                    "primary": {"provider": "openai", "model": "m", "base_url": primary.base_url}
                },
                "spend": {"path": str(tmp_path / "spend.db")},
            }
        )
        async with (
            running(config) as gateway,
            httpx.AsyncClient(base_url=gateway.url, timeout=30) as client,
        ):
            assert (await client.get("/admin/spend")).status_code == 404


def test_an_unset_admin_key_variable_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pipeline.errors import ConfigError

    monkeypatch.delenv("NOT_SET_ADMIN", raising=False)
    with pytest.raises(ConfigError, match=r"gateway\.admin_key_env.*NOT_SET_ADMIN is not set"):
        parse_config(
            {
                "routes": {"a": {"provider": "scripted", "reply": "hi"}},
                "gateway": {"admin_key_env": "NOT_SET_ADMIN"},
            }
        )
