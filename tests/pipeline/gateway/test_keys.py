"""Virtual keys, budgets and rate limits through the gateway: every refusal in each inbound
format's own error shape, for both call shapes, over a real uvicorn, a real redis-server
and the key store in SQLite; the official SDKs reading the headers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from pipeline._reservations import NANOS
from pipeline.config import PipelineConfig, parse_config
from pipeline.keys import Budget, SQLiteKeyStore
from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.otel import Otel
from tests.pipeline.gateway.conftest import Running, running
from tests.redis_server import RedisServer

pytestmark = pytest.mark.gateway

FORMATS = ["chat_completions", "responses", "messages"]
CANARY = "CANARY-prompt-7f3a"


@dataclass
class Setup:
    upstream: FakeOpenAIServer
    path: Path
    redis_url: str
    store: SQLiteKeyStore
    # The test's own keys in the shared Redis: an `id` is used again once its object is
    # freed, and a test reading its counters found the previous test's there too.
    namespace: str = field(default_factory=lambda: uuid.uuid4().hex)

    def config(self, **budgets: Any) -> PipelineConfig:
        return parse_config(
            {
                "routes": {
                    "primary": {
                        "provider": "openai",
                        "model": "gpt-upstream",
                        "base_url": self.upstream.base_url,
                        # A dollar a token: a request of the fake's usage (5 + 7) costs $12.
                        "price": {"input_per_million": 1e6, "output_per_million": 1e6},
                    }
                },
                "gateway": {"models": {"gpt-*": "pipeline", "claude-*": "pipeline"}},
                "spend": {"path": str(self.path)},
                "keys": {"refresh_interval": 0.05},
                "budgets": {
                    "redis_url_env": "KEYS_TEST_REDIS",
                    "namespace": self.namespace,
                    "rebuild_delay": 0.0,
                    **budgets,
                },
            }
        )


@pytest.fixture
async def setup(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Setup]:
    monkeypatch.setenv("KEYS_TEST_REDIS", redis_url)
    path = tmp_path / "ledger.db"
    store = SQLiteKeyStore(path)
    async with FakeOpenAIServer() as upstream:
        yield Setup(upstream, path, redis_url, store)
    await store.aclose()


async def call(
    run: Running,
    format: str,
    secret: str,
    *,
    model: str = "gpt-4o",
    stream: bool = False,
    max_tokens: int = 16,
) -> httpx.Response:
    """One request of `format`, as its clients send it (the whole stream read)."""
    if format == "chat_completions":
        path, body = (
            "/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": CANARY}]},
        )
        headers = {"authorization": f"Bearer {secret}"}
        body["max_tokens"] = max_tokens
    elif format == "responses":
        path, body = (
            "/responses",
            {"model": model, "input": CANARY, "max_output_tokens": max_tokens},
        )
        headers = {"authorization": f"Bearer {secret}"}
    else:
        path = "/messages"
        body = {
            "model": model,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": CANARY}],
        }
        headers = {"x-api-key": secret, "anthropic-version": "2023-06-01"}
    body["stream"] = stream
    async with httpx.AsyncClient(base_url=run.base_url, timeout=30) as client:
        return await client.post(path, json=body, headers=headers)


def error_of(response: httpx.Response, format: str) -> tuple[str, str]:
    """(type, code) of an error body in the format's own shape (Anthropic has no code)."""
    body = response.json()
    if format == "messages":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]["type"], ""
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]["type"], body["error"]["code"]


@contextlib.asynccontextmanager
async def gateway(setup: Setup, **budgets: Any) -> AsyncIterator[Running]:
    async with running(setup.config(**budgets)) as run:
        yield run


def frozen(run: Running) -> None:
    """Stop the clock of the gateway's rate limits (now, on this machine's clock)."""
    governor = run.gateway.governance.governor
    assert governor is not None
    now = time.time()
    governor.reservations.clock = lambda: now


async def known(run: Running) -> None:
    """Wait for the gateway's key ring to read the latest changes (two refreshes)."""
    ring = run.gateway.governance.ring
    assert ring is not None
    for _ in range(2):
        await asyncio.wait_for(ring.refreshed.wait(), 10)


# -- keys ------------------------------------------------------------------------------------


@pytest.mark.parametrize("format", FORMATS)
async def test_a_model_outside_the_keys_globs_is_403_in_the_formats_shape(
    setup: Setup, format: str, streaming: bool
) -> None:
    issued = await setup.store.create("gpt-only", models=["gpt-*"])
    async with gateway(setup) as run:
        allowed = await call(run, format, issued.secret, model="gpt-4o", stream=streaming)
        assert allowed.status_code == 200, allowed.text
        refused = await call(run, format, issued.secret, model="claude-sonnet", stream=streaming)
        assert refused.status_code == 403
        kind, code = error_of(refused, format)
        if format == "messages":
            assert kind == "permission_error"
        else:
            assert (kind, code) == ("invalid_request_error", "model_not_allowed")
        assert "model_not_allowed" in refused.text
    assert len(setup.upstream.requests) == 1


@pytest.mark.parametrize("format", FORMATS)
async def test_expired_revoked_and_rotated_out_keys_get_401(
    setup: Setup, format: str, streaming: bool
) -> None:
    expired = await setup.store.create(
        "expired", expires_at=datetime.now(UTC) - timedelta(seconds=1)
    )
    revoked = await setup.store.create("revoked")
    await setup.store.revoke("revoked")
    rotating = await setup.store.create("rotating")
    async with gateway(setup) as run:
        # Rotated with a grace: the old secret and the new one both work meanwhile.
        during = await setup.store.rotate("rotating", grace=3600)
        await known(run)
        for secret in (rotating.secret, during.secret):
            answered = await call(run, format, secret, stream=streaming)
            assert answered.status_code == 200, answered.text
        # Rotated again without one: every earlier secret stops at once.
        after = await setup.store.rotate("rotating")
        await known(run)
        assert (await call(run, format, after.secret, stream=streaming)).status_code == 200
        refused = [
            await call(run, format, secret, stream=streaming)
            for secret in (expired.secret, revoked.secret, rotating.secret, during.secret)
        ]
        refused.append(await call(run, format, "sk-cp-nobody", stream=streaming))
        for response in refused:
            assert response.status_code == 401, response.text
            kind, code = error_of(response, format)
            assert kind == (
                "authentication_error" if format == "messages" else "invalid_request_error"
            )
            assert code in ("", "invalid_api_key")
    assert len(setup.upstream.requests) == 3


async def test_a_revocation_on_one_replica_is_refused_on_the_other_within_two_refreshes(
    setup: Setup,
) -> None:
    issued = await setup.store.create("shared")
    async with gateway(setup) as one, gateway(setup) as two:
        for run in (one, two):
            assert (await call(run, "chat_completions", issued.secret)).status_code == 200
        # Revoked through the first replica's store; the second finds out by itself.
        first_store = one.gateway.governance.store
        assert first_store is not None
        await first_store.revoke("shared")
        await known(two)  # two refreshes: 0.1 s here, about 2 s with the default interval
        assert (await call(two, "chat_completions", issued.secret)).status_code == 401


async def test_api_keys_env_keys_keep_working_beside_virtual_keys(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEYS_TEST_ENV_KEYS", "plain-key")
    issued = await setup.store.create("virtual")
    cfg = setup.config()
    config = parse_config(
        {
            "routes": {
                "primary": {"provider": "openai", "model": "m", "base_url": setup.upstream.base_url}
            },
            "gateway": {"api_keys_env": "KEYS_TEST_ENV_KEYS"},
            "spend": {"path": str(setup.path)},
            "keys": {},
        }
    )
    assert cfg.keys is not None
    async with running(config) as run:
        for secret in ("plain-key", issued.secret):
            response = await call(run, "chat_completions", secret, model="primary")
            assert response.status_code == 200, response.text
        assert (await call(run, "chat_completions", "other", model="primary")).status_code == 401


# -- budgets ---------------------------------------------------------------------------------


@pytest.mark.parametrize("format", FORMATS)
async def test_a_spent_budget_is_402_budget_exceeded_and_not_retried(
    setup: Setup, format: str, streaming: bool
) -> None:
    # $30: the first request reserves at most $21+ (its input and 16 output tokens at $1)
    # and costs $12; the second is admitted (12 < 30) and costs $12; the third (24 < 30)
    # too; the fourth finds $36 spent.
    issued = await setup.store.create("budgeted", budget=Budget("30"))
    async with gateway(setup) as run:
        answered = [await call(run, format, issued.secret, stream=streaming) for _ in range(3)]
        assert [r.status_code for r in answered] == [200, 200, 200]
        refused = await call(run, format, issued.secret, stream=streaming)
        assert refused.status_code == 402, refused.text
        assert refused.headers["x-should-retry"] == "false"
        kind, code = error_of(refused, format)
        if format == "messages":
            assert (
                kind == "billing_error" and "budget_exceeded" in refused.json()["error"]["message"]
            )
        else:
            assert (kind, code) == ("budget_exceeded", "budget_exceeded")
    assert len(setup.upstream.requests) == 3


async def test_the_sdks_do_not_retry_a_402(setup: Setup) -> None:
    issued = await setup.store.create("broke", budget=Budget("0"))
    async with gateway(setup) as run:
        client = openai.AsyncOpenAI(base_url=run.base_url, api_key=issued.secret, max_retries=3)
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
            )
        assert caught.value.status_code == 402
        claude = anthropic.AsyncAnthropic(base_url=run.url, api_key=issued.secret, max_retries=3)
        with pytest.raises(anthropic.APIStatusError) as refused:
            await claude.messages.create(
                model="claude-x", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            )
        assert refused.value.status_code == 402
        await client.close()
        await claude.close()
    # Refused before any provider call, once each (no SDK retry reached the gateway twice).
    assert len(setup.upstream.requests) == 0


async def test_codex_gets_the_429_usage_limit_reached_it_stops_on(
    setup: Setup, streaming: bool
) -> None:
    issued = await setup.store.create("agent", budget=Budget("0"))
    body = {"model": "gpt-4o", "input": CANARY, "stream": streaming}
    async with gateway(setup) as run, httpx.AsyncClient(base_url=run.base_url) as client:
        answers = {
            originator: await client.post(
                "/responses",
                json=body,
                headers={"authorization": f"Bearer {issued.secret}", "originator": originator},
            )
            for originator in ("codex_exec", "codex_cli_rs", "other")
        }
    # Codex retries anything else five times; what it stops on still says budget_exceeded.
    for originator in ("codex_exec", "codex_cli_rs"):
        refused = answers[originator]
        assert refused.status_code == 429, refused.text
        assert "retry-after" not in refused.headers
        assert refused.headers["x-should-retry"] == "false"
        assert error_of(refused, "responses") == ("usage_limit_reached", "budget_exceeded")
    assert answers["other"].status_code == 402
    assert len(setup.upstream.requests) == 0


async def test_a_hedged_request_settles_once_with_both_attempts_costs(
    setup: Setup, streaming: bool
) -> None:
    issued = await setup.store.create("hedger", budget=Budget("1000"))
    namespace = setup.namespace
    price = {"input_per_million": 1e6, "output_per_million": 1e6}
    # Whichever route goes first, the other starts 1 ms later: the slow one never answers,
    # the other answers after 0.2 s and wins; the slow one is abandoned.
    setup.upstream.script(FakeResponse(latency=0.2))
    async with FakeOpenAIServer() as slow:
        slow.script(FakeResponse(hang=True))
        config = parse_config(
            {
                "routes": {
                    name: {"provider": "openai", "model": "m", "base_url": url, "price": price}
                    for name, url in (("slow", slow.base_url), ("fast", setup.upstream.base_url))
                },
                "router": {
                    "kind": "hedged",
                    "strategy": "round_robin",
                    "delay": 0.001,
                    "budget": 1.0,
                },
                "gateway": {"models": {"gpt-*": "pipeline"}},
                "spend": {"path": str(setup.path)},
                "keys": {"refresh_interval": 0.05},
                "budgets": {
                    "redis_url_env": "KEYS_TEST_REDIS",
                    "namespace": namespace,
                    "rebuild_delay": 0.0,
                },
            }
        )
        async with running(config) as run:
            response = await call(run, "chat_completions", issued.secret, stream=streaming)
            assert response.status_code == 200, response.text
            ledger, governor = run.gateway.spend, run.gateway.governance.governor
            assert ledger is not None and governor is not None
            records = await ledger.records()
            await governor.reservations.flush()
            redis = governor.reservations.redis
            (counter,) = await redis.execute("KEYS", f"{namespace}:b:k:*")
            spent, reserved = await redis.execute("HMGET", counter, "s", "r")
        assert slow.count() == 1
    assert sorted((r.route, r.outcome) for r in records) == [
        ("fast", "completed"),
        ("slow", "abandoned"),
    ]
    assert all(r.cost and r.cost > 0 for r in records)  # the abandoned one: its input
    # Settled once, with what both attempts cost (the winner's and the abandoned one's).
    assert (int(spent), int(reserved)) == (sum(r.cost for r in records) * NANOS, 0)


async def test_a_route_served_by_name_settles_at_its_price_without_a_spend_layer(
    setup: Setup, streaming: bool
) -> None:
    issued = await setup.store.create("direct", budget=Budget("1000"))
    namespace = setup.namespace
    config = parse_config(
        {
            "routes": {
                "primary": {
                    "provider": "openai",
                    "model": "gpt-upstream",
                    "base_url": setup.upstream.base_url,
                    "price": {"input_per_million": 1e6, "output_per_million": 1e6},
                }
            },
            "gateway": {"models": {"gpt-*": "primary"}},
            # The keys' database only: no spend layer logs the call, the gateway does.
            "spend": {"enabled": False, "path": str(setup.path)},
            "keys": {"refresh_interval": 0.05},
            "budgets": {"redis_url_env": "KEYS_TEST_REDIS", "namespace": namespace},
        }
    )
    async with running(config) as run:
        for _ in range(2):
            response = await call(run, "chat_completions", issued.secret, stream=streaming)
            assert response.status_code == 200, response.text
        governor = run.gateway.governance.governor
        assert governor is not None and run.gateway.spend is None
        await governor.reservations.flush()
        redis = governor.reservations.redis
        (counter,) = await redis.execute("KEYS", f"{namespace}:b:k:*")
        spent, reserved = await redis.execute("HMGET", counter, "s", "r")
    # Each call the fake's usage (5 in, 7 out) at the route's dollar a token.
    assert (int(spent), int(reserved)) == (2 * 12 * NANOS, 0)


async def test_a_soft_limit_passed_is_told_in_a_header(setup: Setup) -> None:
    issued = await setup.store.create("soft", budget=Budget("100", soft="20"))
    async with gateway(setup) as run:
        first = await call(run, "chat_completions", issued.secret)
        assert "x-chat-pipeline-budget-remaining" not in first.headers
        second = await call(run, "chat_completions", issued.secret)  # $12 spent: past $20?
        third = await call(run, "chat_completions", issued.secret)
        assert second.status_code == third.status_code == 200
        remaining = third.headers.get("x-chat-pipeline-budget-remaining") or second.headers.get(
            "x-chat-pipeline-budget-remaining"
        )
        assert remaining is not None and 0 < float(remaining) < 100


# -- rate limits -----------------------------------------------------------------------------


@pytest.mark.parametrize("format", FORMATS)
async def test_a_rate_limit_is_429_with_retry_after_and_the_formats_headers(
    setup: Setup, format: str, streaming: bool
) -> None:
    # 60 a minute, a burst of 1 s: two at once, then one a second. The limits' clock stands
    # still, so the third is refused however long the first two took.
    issued = await setup.store.create("limited", rpm=60, tpm=1_000_000)
    async with gateway(setup) as run:
        frozen(run)
        answers = [await call(run, format, issued.secret, stream=streaming) for _ in range(3)]
        assert [r.status_code for r in answers] == [200, 200, 429]
        first, refused = answers[0], answers[2]
        kind, code = error_of(refused, format)
        if format == "messages":
            assert kind == "rate_limit_error"
            prefix = "anthropic-ratelimit-requests-"
            assert first.headers[prefix + "limit"] == "60"
            assert datetime.fromisoformat(first.headers[prefix + "reset"].replace("Z", "+00:00"))
            assert first.headers["anthropic-ratelimit-tokens-limit"] == "1000000"
            assert not any(h.startswith("x-ratelimit-") for h in first.headers)
        else:
            assert (kind, code) == ("rate_limit_error", "rate_limit_exceeded")
            assert first.headers["x-ratelimit-limit-requests"] == "60"
            assert first.headers["x-ratelimit-remaining-requests"] == "1"
            assert first.headers["x-ratelimit-reset-requests"].endswith("s")
            assert first.headers["x-ratelimit-limit-tokens"] == "1000000"
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["retry-after-ms"] == "1000"
    assert len(setup.upstream.requests) == 2


async def test_the_sdks_read_the_headers_and_wait_out_a_429(setup: Setup) -> None:
    issued = await setup.store.create("sdk", rpm=120)
    async with gateway(setup) as run:
        client = openai.AsyncOpenAI(base_url=run.base_url, api_key=issued.secret, max_retries=2)
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
        )
        assert raw.headers["x-ratelimit-limit-requests"] == "120"
        assert int(raw.headers["x-ratelimit-remaining-requests"]) >= 0
        # Three more at once: one is over the burst; the SDK waits retry-after-ms and
        # goes on, so every call succeeds.
        results = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
                )
                for _ in range(3)
            )
        )
        assert len(results) == 3
        claude = anthropic.AsyncAnthropic(base_url=run.url, api_key=issued.secret, max_retries=2)
        message = await claude.messages.with_raw_response.create(
            model="claude-x", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
        assert message.headers["anthropic-ratelimit-requests-limit"] == "120"
        await client.close()
        await claude.close()


# -- Redis unavailable -----------------------------------------------------------------------


@pytest.fixture
def own_redis(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> RedisServer:
    monkeypatch.setenv("KEYS_TEST_REDIS", redis_server.url)
    return redis_server


async def test_fail_open_serves_and_fail_closed_refuses_while_redis_is_down(
    setup: Setup, own_redis: RedisServer, streaming: bool
) -> None:
    issued = await setup.store.create("while-down", budget=Budget("1000"))
    async with (
        gateway(setup, timeout=0.2) as open_,
        gateway(setup, fail_closed=True, timeout=0.2) as closed,
    ):
        for run in (open_, closed):
            assert (
                await call(run, "chat_completions", issued.secret, stream=streaming)
            ).status_code == 200
        own_redis.stop()
        served = await call(open_, "chat_completions", issued.secret, stream=streaming)
        assert served.status_code == 200
        refused = await call(closed, "chat_completions", issued.secret, stream=streaming)
        assert refused.status_code == 503
        assert error_of(refused, "chat_completions") == ("server_error", "budget_unavailable")
        assert "retry-after" in refused.headers


# -- secrets stay secret ---------------------------------------------------------------------


async def test_no_secret_reaches_a_log_line(setup: Setup, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG")
    issued = await setup.store.create("quiet", budget=Budget("0"), models=["gpt-*"])
    async with gateway(setup) as run:
        for model in ("gpt-4o", "claude-x"):
            await call(run, "chat_completions", issued.secret, model=model)
        await call(run, "chat_completions", issued.secret[:-2] + "xx")
    text = "\n".join(record.getMessage() for record in caplog.records)
    assert issued.secret not in text and issued.secret[12:30] not in text
    assert "key=quiet" in text
    assert CANARY not in text
    assert json.dumps(issued.secret) not in text


# -- /admin/keys -----------------------------------------------------------------------------


async def test_admin_keys_manage_keys_for_the_admin_key_only(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEYS_TEST_ADMIN", "admin-secret-1")
    config = setup.config()
    config = parse_config(
        {
            "routes": {
                "primary": {"provider": "openai", "model": "m", "base_url": setup.upstream.base_url}
            },
            "gateway": {"admin_key_env": "KEYS_TEST_ADMIN", "models": {"gpt-*": "pipeline"}},
            "spend": {"path": str(setup.path)},
            "keys": {},
        }
    )
    admin = {"authorization": "Bearer admin-secret-1"}
    async with running(config) as run, httpx.AsyncClient(base_url=run.url, timeout=10) as client:
        for headers in ({}, {"authorization": "Bearer nope"}):
            refused = await client.get("/admin/keys", headers=headers)
            assert refused.status_code == 401 and "admin-secret-1" not in refused.text
        made = await client.post(
            "/admin/keys",
            json={
                "name": "svc",
                "models": ["gpt-*"],
                "rpm": 60,
                "budget": {"limit": "5", "period": "day"},
            },
            headers=admin,
        )
        assert made.status_code == 201, made.text
        secret = made.json()["secret"]
        assert (await call(run, "chat_completions", secret)).status_code == 200  # seen at once
        listed = (await client.get("/admin/keys", headers=admin)).json()["data"]
        assert [k["name"] for k in listed] == ["svc"] and secret not in json.dumps(listed)
        changed = await client.patch("/admin/keys/svc", json={"rpm": 120}, headers=admin)
        assert changed.json()["rpm"] == 120
        rotated = await client.post("/admin/keys/svc/rotate", json={"grace": 0}, headers=admin)
        assert rotated.status_code == 200 and rotated.json()["secret"] != secret
        assert (await call(run, "chat_completions", secret)).status_code == 401
        revoked = await client.post("/admin/keys/svc/revoke", headers=admin)
        assert revoked.json()["revoked_at"] is not None
        assert (await call(run, "chat_completions", rotated.json()["secret"])).status_code == 401
        assert (await client.get("/admin/keys/nobody", headers=admin)).status_code == 404
        taken = await client.post("/admin/keys", json={"name": "svc"}, headers=admin)
        assert taken.status_code == 409
        bad = await client.post("/admin/keys", json={"name": "x", "rpm": 0}, headers=admin)
        assert bad.status_code == 400 and "rpm" in bad.json()["error"]["message"]


async def test_no_secret_reaches_a_span_or_a_metric(setup: Setup, otel: Otel) -> None:
    issued = await setup.store.create("traced", budget=Budget("0.00002"), rpm=60, models=["gpt-*"])
    async with running(setup.config(), **otel.providers) as run:
        await known(run)
        statuses = [
            (await call(run, "chat_completions", issued.secret, model=model)).status_code
            for model in ("gpt-4o", "gpt-4o", "claude-x", "gpt-4o")
        ]
        await call(run, "messages", issued.secret[:-3] + "abc")
    assert 200 in statuses and 403 in statuses and ({402, 429} & set(statuses))
    exported = "\n".join(otel.everything_exported())
    assert issued.secret not in exported and issued.secret[6:24] not in exported
    assert CANARY not in exported
    refusals = otel.total("chat_pipeline.budget.refusals", **{"chat_pipeline.budget.scope": "key"})
    assert refusals >= 1
