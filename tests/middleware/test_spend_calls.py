"""One spend record per provider call, however the calls are made: routers nested in routes
(ordered in ordered, balanced groups as tiers from TOML, hedging in ordered), retries inside
a route (each retried call is a record), an open breaker (a refused call is none) and a call
without a router. The fake upstreams' own request counts are the truth; both call shapes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from middleware.routing import Price, Route
from pipeline import ChatPipeline
from pipeline.config import parse_config
from pipeline.providers import OpenAIChatClient
from pipeline.spend import SpendLedger, SpendRecord, SQLiteSpendStore
from pipeline.testing import FakeOpenAIServer, FakeResponse, collect

ANSWER = FakeResponse(text="ok", usage=(100, 20))
REFUSED = FakeResponse.error(503)
# Per million tokens: 100 x 1 + 20 x 2 = 140 -> 0.00014 for an answer at PRICE.
PRICE = Price(1.0, 2.0)
COST = Decimal("0.00014")
DEAR = Price(50.0, 50.0)  # a router's route: never what its routes' calls cost
NO_WAIT = {"initial_delay": 0.0, "max_delay": 0.0}


@pytest.fixture
async def ledger(tmp_path: Path) -> AsyncIterator[SpendLedger]:
    made = SpendLedger(SQLiteSpendStore(tmp_path / "spend.db"), flush_interval=3600)
    try:
        yield made
    finally:
        await made.aclose()


@asynccontextmanager
async def upstreams(*names: str) -> AsyncIterator[dict[str, FakeOpenAIServer]]:
    """One fake OpenAI upstream per name, answering `ANSWER` unless scripted otherwise."""
    async with AsyncExitStack() as stack:
        servers = {}
        for name in names:
            servers[name] = await stack.enter_async_context(FakeOpenAIServer(default=ANSWER))
        yield servers


def openai(server: FakeOpenAIServer, name: str) -> OpenAIChatClient:
    return OpenAIChatClient("gpt-4o", api_key="k", base_url=server.base_url, name=name)


def requests(servers: dict[str, FakeOpenAIServer]) -> dict[str, int]:
    return {name: len(server.requests) for name, server in servers.items()}


def calls(records: list[SpendRecord]) -> dict[str, int]:
    counted: dict[str, int] = {}
    for record in records:
        counted[record.route or ""] = counted.get(record.route or "", 0) + 1
    return counted


async def test_ordered_in_ordered_records_each_call_once(
    ledger: SpendLedger, streaming: bool
) -> None:
    async with upstreams("a", "b", "c") as servers:
        servers["a"].default = REFUSED
        inner = (
            ChatPipeline.builder()
            .use_ordered_failover(
                [
                    Route("a", openai(servers["a"], "a"), price=PRICE),
                    Route("b", openai(servers["b"], "b"), price=PRICE),
                ]
            )
            .build()
        )
        chat = (
            ChatPipeline.builder()
            .use_spend(ledger)
            .use_ordered_failover(
                [Route("tier", inner, price=DEAR), Route("c", openai(servers["c"], "c"))]
            )
            .build()
        )
        # The first tier serves (its first route refused), then neither of its routes can.
        assert (await collect(chat, "one", streaming=streaming)).error is None
        servers["b"].default = REFUSED
        assert (await collect(chat, "two", streaming=streaming)).error is None
        await chat.aclose()
        spent = await ledger.records()
        assert calls(spent) == requests(servers) == {"a": 2, "b": 2, "c": 1}
        served = [r for r in spent if r.outcome == "completed"]
        assert sorted(r.route or "" for r in served) == ["b", "c"]
        refused = [r for r in spent if r.outcome != "completed"]
        assert all(r.cost == 0 and r.input_tokens == 0 for r in refused)
        # b at its route's price, c at the book's (gpt-4o: $2.50 and $10 per million).
        book = (Decimal(100) * Decimal("2.5") + Decimal(20) * 10) / 1_000_000
        assert sum(r.cost or 0 for r in spent) == COST + book
        (total,) = await ledger.summary()
        assert (total.attempts, total.cost) == (5, COST + book)


async def test_a_retry_around_a_router_records_each_call_of_each_try(
    ledger: SpendLedger, streaming: bool
) -> None:
    async with upstreams("a", "b", "c") as servers:
        servers["a"].default = REFUSED
        servers["b"].script(REFUSED, REFUSED)  # then it answers
        retried_router = (
            ChatPipeline.builder()
            .use_retry(max_attempts=3, **NO_WAIT)
            .use_ordered_failover(
                [
                    Route("a", openai(servers["a"], "a"), price=PRICE),
                    Route("b", openai(servers["b"], "b"), price=PRICE),
                ]
            )
            .build()
        )
        chat = (
            ChatPipeline.builder()
            .use_spend(ledger)
            .use_ordered_failover(
                [Route("tier", retried_router, price=DEAR), Route("c", openai(servers["c"], "c"))]
            )
            .build()
        )
        assert (await collect(chat, "hi", streaming=streaming)).error is None
        spent = await ledger.records()
        # Three tries of the router beneath, each a call to a and one to b.
        assert calls(spent) == {"a": 3, "b": 3}
        assert requests(servers) == {"a": 3, "b": 3, "c": 0}
        assert sum(r.cost or 0 for r in spent) == COST
        await chat.aclose()


async def test_hedging_inside_ordered_records_both_hedged_calls_once(
    ledger: SpendLedger, streaming: bool
) -> None:
    async with upstreams("slow", "backup") as servers:
        slow = servers["slow"]
        slow.default = FakeResponse(hang=True)
        # The fast route answers only once the slow one holds its request: both reached.
        fast = servers["fast"] = GatedServer(slow)
        await fast.start()
        hedged = (
            ChatPipeline.builder()
            .use_hedging(
                [
                    Route("slow", openai(slow, "slow"), price=PRICE),
                    Route("fast", openai(fast, "fast"), price=PRICE),
                ],
                strategy="round_robin",
                delay=0.001,
                budget=1.0,
            )
            .build()
        )
        chat = (
            ChatPipeline.builder()
            .use_spend(ledger)
            .use_ordered_failover(
                [
                    Route("hedged", hedged, price=DEAR),
                    Route("backup", openai(servers["backup"], "backup")),
                ]
            )
            .build()
        )
        assert (await collect(chat, "hello", streaming=streaming)).error is None
        await chat.aclose()
        await fast.stop()
        spent = {r.route: r for r in await ledger.records()}
        assert calls(list(spent.values())) == {"slow": 1, "fast": 1}
        assert requests(servers) == {"slow": 1, "fast": 1, "backup": 0}
        assert (spent["fast"].outcome, spent["fast"].cost) == ("completed", COST)
        loser = spent["slow"]
        assert loser.outcome == "abandoned" and loser.output_tokens == 0 and loser.estimated
        assert loser.cost == Decimal(loser.input_tokens) / 1_000_000  # PRICE's input rate


class GatedServer(FakeOpenAIServer):
    """An upstream that answers only once `other` has received a request."""

    def __init__(self, other: FakeOpenAIServer) -> None:
        super().__init__(default=ANSWER)
        self.other = other

    async def _handle(
        self,
        writer: asyncio.StreamWriter,
        method: str,
        path: str,
        payload: Any,
        response: FakeResponse,
    ) -> bool:
        await self.other.wait_for_requests(1)
        return await super()._handle(writer, method, path, payload, response)


def route_table(server: FakeOpenAIServer, **extra: Any) -> dict[str, Any]:
    return {
        "provider": "openai",
        "model": "gpt-4o",
        "base_url": server.base_url,
        "price": {"input_per_million": 1.0, "output_per_million": 2.0},
        **extra,
    }


async def test_balanced_groups_as_tiers_from_toml_record_each_call_once(
    ledger: SpendLedger, tmp_path: Path, streaming: bool
) -> None:
    async with upstreams("east", "west", "large") as servers:
        servers["east"].script(REFUSED, REFUSED)  # both tries of the first request
        servers["west"].script(REFUSED)
        config = parse_config(
            {
                "routes": {
                    "east": route_table(servers["east"], retry={"max_attempts": 2, **NO_WAIT}),
                    "west": route_table(servers["west"]),
                    "large": route_table(servers["large"]),
                },
                "groups": {"standard": {"routes": ["east", "west"]}},
                "router": {
                    "kind": "tiered",
                    "default": "standard",
                    "fallback": {"standard": ["large"]},
                },
                "spend": {"path": str(tmp_path / "unused.db")},
            }
        )
        chat = config.build(spend_ledger=ledger)
        for prompt in ("one", "two", "three"):
            assert (await collect(chat, prompt, streaming=streaming)).error is None
        await chat.aclose()
        spent = await ledger.records()
        sent = requests(servers)
        assert {k: v for k, v in sent.items() if v} == calls(spent)
        assert sent["east"] >= 2 and sent["west"] >= 1 and sent["large"] >= 1
        assert len(spent) == sum(sent.values())
        answered = [r for r in spent if r.outcome == "completed"]
        assert len(answered) == 3
        assert sum(r.cost or 0 for r in spent) == 3 * COST  # every refusal cost nothing


async def test_one_route_from_toml_is_priced_at_its_price_and_each_retried_call_recorded(
    ledger: SpendLedger, tmp_path: Path, streaming: bool
) -> None:
    async with upstreams("only") as servers:
        servers["only"].script(REFUSED)
        config = parse_config(
            {
                "routes": {
                    "only": route_table(servers["only"], retry={"max_attempts": 2, **NO_WAIT})
                },
                "spend": {"path": str(tmp_path / "unused.db")},
            }
        )
        chat = config.build(spend_ledger=ledger)
        assert (await collect(chat, "hi", streaming=streaming)).error is None
        await chat.aclose()
        answered, refused = sorted(await ledger.records(), key=lambda r: r.outcome)
        assert requests(servers) == {"only": 2}
        assert (refused.route, refused.outcome, refused.input_tokens, refused.cost) == (
            "only",
            "failed_before_output",
            0,
            Decimal(0),
        )
        # The route's price wins over the book's ($2.50 and $10 per million for gpt-4o).
        assert (answered.route, answered.outcome, answered.cost) == ("only", "completed", COST)


async def test_retried_calls_in_a_route_are_records_and_calls_an_open_breaker_refused_none(
    ledger: SpendLedger, streaming: bool
) -> None:
    async with upstreams("a", "b") as servers:
        servers["a"].default = REFUSED
        guarded = (
            ChatPipeline.builder()
            .use_circuit_breaker(fail_max=1, reset_timeout=3600)
            .use_retry(max_attempts=2, **NO_WAIT)
            .build(openai(servers["a"], "a"), name="a")
        )
        chat = (
            ChatPipeline.builder()
            .use_spend(ledger)
            .use_ordered_failover(
                [
                    Route("a", guarded, price=PRICE),
                    Route("b", openai(servers["b"], "b"), price=PRICE),
                ]
            )
            .build()
        )
        # Two calls to a (retried), which open its breaker; then a is refused without a call.
        assert (await collect(chat, "one", streaming=streaming)).error is None
        assert (await collect(chat, "two", streaming=streaming)).error is None
        await chat.aclose()
        spent = await ledger.records()
        assert calls(spent) == requests(servers) == {"a": 2, "b": 2}
        refused = sorted((r.attempt, r.outcome, r.cost) for r in spent if r.route == "a")
        assert refused == [(1, "failed_before_output", Decimal(0))] * 2
        assert sum(r.cost or 0 for r in spent) == 2 * COST


async def test_a_cache_hit_inside_a_route_is_the_one_record_of_its_attempt(
    ledger: SpendLedger, streaming: bool
) -> None:
    async with upstreams("a") as servers:
        cached = ChatPipeline.builder().use_cache().build(openai(servers["a"], "a"), name="a")
        chat = (
            ChatPipeline.builder()
            .use_spend(ledger)
            .use_ordered_failover([Route("a", cached, price=PRICE)])
            .build()
        )
        for _ in range(2):
            assert (await collect(chat, "same", streaming=streaming)).error is None
        await chat.aclose()
        spent = sorted(await ledger.records(), key=lambda r: r.time)
        assert requests(servers) == {"a": 1}
        # (What a hit saved is known to a cache above a router: this one is beneath it.)
        assert [(r.cache, r.cost) for r in spent] == [(None, COST), ("hit", Decimal(0))]
