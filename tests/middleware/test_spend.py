"""The spend layer (`use_spend`), for both call shapes: one record per provider attempt with
what it used and cost, estimated where the provider said nothing, failovers, hedges, cut,
cancelled and abandoned streams, cache hits with what they saved, attribution, and no
prompt or answer text anywhere."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from middleware.routing import Price, Route
from pipeline import ChatOptions, ChatPipeline, UsageDetails
from pipeline.errors import TransientProviderError
from pipeline.pricing import estimate_input_tokens, estimated_output_tokens
from pipeline.spend import Attribution, SpendLedger, SpendRecord, SQLiteSpendStore
from pipeline.testing import ScriptedChatClient, collect, fail, fail_after, hang, reply
from pipeline.types import ChatMessage
from tests.otel import Otel

# gpt-4o: $2.50 input, $1.25 cached input, $10 output per million tokens.
USAGE = UsageDetails(
    input_tokens=1_000, output_tokens=200, total_tokens=1_200, cache_read_tokens=400
)
# 600 x 2.50 + 400 x 1.25 + 200 x 10 = 1,500 + 500 + 2,000 -> $0.004
COST = Decimal("0.004")


@pytest.fixture
async def ledger(tmp_path: Path) -> AsyncIterator[SpendLedger]:
    made = SpendLedger(SQLiteSpendStore(tmp_path / "spend.db"), flush_interval=3600)
    try:
        yield made
    finally:
        await made.aclose()


def openai(script: Any, *, name: str, model: str = "gpt-4o") -> ScriptedChatClient:
    return ScriptedChatClient(script, name=name, model_id=model, provider_name="openai")


async def records(ledger: SpendLedger) -> list[SpendRecord]:
    return sorted(await ledger.records(), key=lambda r: (r.request_id or "", r.attempt))


async def test_an_attempt_is_priced_once_for_its_record_span_and_metric(
    ledger: SpendLedger, otel: Otel, streaming: bool
) -> None:
    chat = (
        ChatPipeline.builder(**otel.providers)
        .use_spend(ledger)
        .use_ordered_failover([Route("primary", openai(reply("hi", usage=USAGE), name="p"))])
        .build()
    )
    result = await collect(chat, "hello", streaming=streaming)
    assert result.error is None
    (spent,) = await records(ledger)
    assert (spent.route, spent.attempt, spent.outcome) == ("primary", 1, "completed")
    assert (spent.provider, spent.model_requested, spent.model_served) == (
        "openai",
        "gpt-4o",
        "gpt-4o",
    )
    assert (spent.input_tokens, spent.output_tokens, spent.cache_read_tokens) == (1000, 200, 400)
    assert spent.cost == COST and not spent.estimated and spent.currency == "USD"
    assert spent.duration_ms is not None and spent.time_to_first_update_ms is not None
    (span,) = otel.attempt_spans()
    assert span.attributes is not None
    assert span.attributes["chat_pipeline.cost"] == float(COST)
    assert span.attributes["chat_pipeline.cost.estimated"] is False
    assert otel.total("chat_pipeline.route.cost", **{"chat_pipeline.route.name": "primary"}) == (
        pytest.approx(float(COST))
    )
    await chat.aclose()


async def test_a_route_price_wins_over_the_book(ledger: SpendLedger, streaming: bool) -> None:
    route = Route(
        "primary",
        openai(reply("hi", usage=USAGE), name="p"),
        price=Price(1.0, 2.0, cache_read_per_million=0.5),
    )
    chat = ChatPipeline.builder().use_spend(ledger).use_ordered_failover([route]).build()
    await collect(chat, "hello", streaming=streaming)
    (spent,) = await records(ledger)
    # 600 x 1 + 400 x 0.5 + 200 x 2 = 600 + 200 + 400 -> 0.0012
    assert spent.cost == Decimal("0.0012")


async def test_an_answer_without_usage_is_charged_from_counted_tokens_and_marked_estimated(
    ledger: SpendLedger, streaming: bool
) -> None:
    answer = "x" * 403  # 403 characters -> 101 tokens
    client = openai(reply(answer, chunks=["x" * 200, "x" * 203]), name="p")
    chat = ChatPipeline.builder().use_spend(ledger).use_ordered_failover([client]).build()
    prompt = "y" * 80
    await collect(chat, prompt, streaming=streaming)
    (spent,) = await records(ledger)
    assert spent.estimated and spent.outcome == "completed"
    input_tokens = estimate_input_tokens([ChatMessage.user(prompt)])
    assert (spent.input_tokens, spent.output_tokens) == (input_tokens, 101)
    expected = (Decimal(input_tokens) * Decimal("2.5") + Decimal(101) * 10) / 1_000_000
    assert spent.cost == expected


async def test_a_cut_stream_is_charged_for_what_it_used(ledger: SpendLedger) -> None:
    client = openai(fail_after(["a" * 40, "b" * 40], TransientProviderError("cut")), name="p")
    chat = ChatPipeline.builder().use_spend(ledger).use_ordered_failover([client]).build()
    result = await collect(chat, "hello", streaming=True)
    assert isinstance(result.error, TransientProviderError)
    (spent,) = await records(ledger)
    assert spent.outcome == "failed_after_output" and spent.estimated
    assert spent.output_tokens == estimated_output_tokens(80) == 20
    assert spent.cost is not None and spent.cost > 0


async def test_a_cancelled_request_is_charged_for_what_it_used(
    ledger: SpendLedger, streaming: bool
) -> None:
    client = openai(hang(after=["z" * 40]), name="p")
    chat = ChatPipeline.builder().use_spend(ledger).use_ordered_failover([client]).build()
    got_output = asyncio.Event()

    async def run() -> None:
        if not streaming:
            await chat.get_response("hello")
            return
        async with contextlib.aclosing(chat.get_streaming_response("hello")) as stream:
            async for _ in stream:
                got_output.set()

    task = asyncio.ensure_future(run())
    if streaming:
        await got_output.wait()
    else:
        await client.wait_for_calls(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (spent,) = await records(ledger)
    assert spent.outcome == "canceled" and spent.estimated
    assert spent.output_tokens == (10 if streaming else 0)  # what it had generated
    assert spent.input_tokens == estimate_input_tokens([ChatMessage.user("hello")])


async def test_an_abandoned_stream_is_charged_for_what_it_used(ledger: SpendLedger) -> None:
    client = openai(reply("a" * 80, chunks=["a" * 40, "a" * 40]), name="p")
    chat = ChatPipeline.builder().use_spend(ledger).use_ordered_failover([client]).build()
    async with contextlib.aclosing(chat.get_streaming_response("hello")) as stream:
        async for _ in stream:
            break
    (spent,) = await records(ledger)
    assert spent.outcome == "abandoned" and spent.output_tokens == 10 and spent.estimated


async def test_a_failover_is_two_records_the_failed_one_with_what_it_consumed(
    ledger: SpendLedger, streaming: bool
) -> None:
    refused = UsageDetails(input_tokens=500, output_tokens=50, total_tokens=550)
    first = (
        ChatPipeline.builder()
        .use_response_validation(lambda response: 1 / 0, buffer_streams=True)
        .build(openai(reply("not json", usage=refused), name="first"), name="first")
    )
    second = openai(reply("ok", usage=USAGE), name="second")
    chat = (
        ChatPipeline.builder()
        .use_spend(ledger)
        .use_ordered_failover([Route("first", first), Route("second", second)])
        .build()
    )
    assert (await collect(chat, "hello", streaming=streaming)).error is None
    failed, served = await records(ledger)
    assert (failed.route, failed.attempt, failed.outcome) == ("first", 1, "failed_before_output")
    assert (failed.input_tokens, failed.output_tokens, failed.estimated) == (500, 50, False)
    # 500 x 2.50 + 50 x 10 = 1,250 + 500 -> 0.00175
    assert failed.cost == Decimal("0.00175")
    assert (served.route, served.attempt, served.outcome, served.cost) == (
        "second",
        2,
        "completed",
        COST,
    )
    assert failed.request_id == served.request_id


async def test_a_provider_error_is_a_record_that_used_nothing_and_an_open_breaker_none(
    ledger: SpendLedger, streaming: bool
) -> None:
    refused = openai(fail(TransientProviderError(status_code=503)), name="refused")
    broken = (
        ChatPipeline.builder()
        .use_circuit_breaker(fail_max=1, reset_timeout=3600)
        .build(openai(fail(TransientProviderError(status_code=500)), name="b"), name="broken")
    )
    served = openai(reply("ok", usage=USAGE), name="served")
    chat = (
        ChatPipeline.builder()
        .use_spend(ledger)
        .use_ordered_failover(
            [Route("refused", refused), Route("broken", broken), Route("served", served)]
        )
        .build()
    )
    await collect(chat, "one", streaming=streaming)
    await collect(chat, "two", streaming=streaming)  # the breaker is open now: no call
    routes = [(r.route, r.outcome, r.input_tokens, r.cost) for r in await ledger.records()]
    assert routes.count(("refused", "failed_before_output", 0, Decimal(0))) == 2
    assert routes.count(("broken", "failed_before_output", 0, Decimal(0))) == 1
    assert routes.count(("served", "completed", 1000, COST)) == 2
    assert len(routes) == 5


async def test_a_hedge_records_both_attempts(ledger: SpendLedger, streaming: bool) -> None:
    slow = openai(hang(), name="slow")
    fast = openai(reply("ok", usage=USAGE), name="fast")
    chat = (
        ChatPipeline.builder()
        .use_spend(ledger)
        .use_hedging(
            [Route("slow", slow), Route("fast", fast)],
            strategy="round_robin",
            delay=0.001,
            budget=1.0,
        )
        .build()
    )
    assert (await collect(chat, "hello", streaming=streaming)).error is None
    spent = {r.route: r for r in await ledger.records()}
    assert set(spent) == {"slow", "fast"}
    assert (spent["fast"].outcome, spent["fast"].cost) == ("completed", COST)
    loser = spent["slow"]
    assert loser.outcome == "abandoned" and loser.estimated and loser.output_tokens == 0
    assert loser.input_tokens == estimate_input_tokens([ChatMessage.user("hello")])
    assert {r.attempt for r in spent.values()} == {1, 2}


async def test_a_cache_hit_records_what_it_saved(ledger: SpendLedger, streaming: bool) -> None:
    client = openai(reply("ok", usage=USAGE), name="p")
    chat = (
        ChatPipeline.builder()
        .use_spend(ledger)
        .use_cache()
        .use_ordered_failover([Route("primary", client)])
        .build()
    )
    await collect(chat, "hello", streaming=streaming)
    await collect(chat, "hello", streaming=streaming)
    assert client.call_count == 1
    call, hit = sorted(await ledger.records(), key=lambda r: r.time)
    assert (call.cache, call.cost) == (None, COST)
    assert (hit.cache, hit.attempt, hit.route, hit.cost, hit.saved_cost) == (
        "hit",
        0,
        "primary",
        Decimal(0),
        COST,
    )
    assert hit.input_tokens == hit.output_tokens == 0
    (total,) = await ledger.summary()
    assert (total.attempts, total.cache_hits, total.cost, total.saved_cost) == (1, 1, COST, COST)
    await chat.aclose()


async def test_concurrent_identical_requests_record_one_call_and_the_hits_it_saved(
    ledger: SpendLedger, streaming: bool
) -> None:
    client = openai(reply("ok", usage=USAGE, delay=0.05), name="p")
    chat = (
        ChatPipeline.builder()
        .use_spend(ledger)
        .use_cache()
        .use_ordered_failover([Route("primary", client)])
        .build()
    )
    await asyncio.gather(*(collect(chat, "same", streaming=streaming) for _ in range(3)))
    assert client.call_count == 1
    spent = await ledger.records()
    assert sorted((r.cache or "call", r.cost, r.saved_cost) for r in spent) == [
        ("call", COST, None),
        ("hit", Decimal(0), COST),
        ("hit", Decimal(0), COST),
    ]


async def test_attribution_fixed_or_from_the_request(ledger: SpendLedger, streaming: bool) -> None:
    client = openai(reply("ok", usage=USAGE), name="p")

    def whose(messages: list[ChatMessage], options: ChatOptions) -> Attribution:
        return Attribution(user=str(options.additional_properties.get("user")), tags=("web",))

    chat = (
        ChatPipeline.builder()
        .use_spend(ledger, attribution=whose)
        .use_ordered_failover([client])
        .build()
    )
    fixed = (
        ChatPipeline.builder()
        .use_spend(ledger, attribution={"team": "ml", "endpoint": "batch-job", "key": "k-7"})
        .use_ordered_failover([client])
        .build()
    )
    options = ChatOptions(session_id="conv-1", additional_properties={"user": "ana"})
    await collect(chat, "hi", options, streaming=streaming)
    await collect(fixed, "hi", streaming=streaming)
    by_user = {r.user: r for r in await ledger.records()}
    assert by_user["ana"].tags == ("web",) and by_user["ana"].session == "conv-1"
    batch = by_user[None]
    assert (batch.team, batch.endpoint, batch.key) == ("ml", "batch-job", "k-7")


async def test_a_failing_attribution_function_costs_the_record_nothing_but_it(
    ledger: SpendLedger, caplog: pytest.LogCaptureFixture, streaming: bool
) -> None:
    def broken(messages: list[ChatMessage], options: ChatOptions) -> Attribution:
        raise KeyError("secret-detail")

    chat = (
        ChatPipeline.builder()
        .use_spend(ledger, attribution=broken)
        .use_ordered_failover([openai(reply("ok", usage=USAGE), name="p")])
        .build()
    )
    with caplog.at_level(logging.WARNING, logger="chat_pipeline.spend"):
        assert (await collect(chat, "hi", streaming=streaming)).error is None
    (spent,) = await ledger.records()
    assert spent.cost == COST and spent.user is None
    assert "attribution function failed (KeyError)" in caplog.text
    assert "secret-detail" not in caplog.text


async def test_without_a_router_the_call_is_the_attempt(
    ledger: SpendLedger, streaming: bool
) -> None:
    client = openai(reply("ok", usage=USAGE), name="direct")
    chat = ChatPipeline.builder().use_spend(ledger).build(client)
    await collect(chat, "hi", streaming=streaming)
    (spent,) = await ledger.records()
    assert (spent.route, spent.attempt, spent.outcome, spent.cost) == (
        "direct",
        1,
        "completed",
        COST,
    )


async def test_without_a_router_the_layer_price_wins_over_the_book(
    ledger: SpendLedger, streaming: bool
) -> None:
    client = openai(reply("ok", usage=USAGE), name="direct")
    price = Price(1.0, 2.0, cache_read_per_million=0.5)
    chat = ChatPipeline.builder().use_spend(ledger, price=price).build(client)
    await collect(chat, "hi", streaming=streaming)
    (spent,) = await ledger.records()
    assert spent.cost == Decimal("0.0012")  # as in test_a_route_price_wins_over_the_book


def test_use_spend_checks_what_it_is_given(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="ledger must be a SpendLedger"):
        ChatPipeline.builder().use_spend(object())
    ledger = SpendLedger(SQLiteSpendStore(tmp_path / "spend.db"))
    with pytest.raises(ValueError, match="unknown attribution field"):
        ChatPipeline.builder().use_spend(ledger, attribution={"colour": "red"})
    with pytest.raises(TypeError, match="price must be a Price"):
        ChatPipeline.builder().use_spend(ledger, price=(1.0, 2.0))
    built = ChatPipeline.builder().use_spend(ledger).build(openai("ok", name="p"))
    assert built.describe()[0].startswith("SpendChatClient(SQLiteSpendStore(")


CANARY = "CANARY-9f3a"


async def test_no_prompt_or_answer_text_reaches_spans_logs_or_records(
    ledger: SpendLedger, otel: Otel, caplog: pytest.LogCaptureFixture, streaming: bool
) -> None:
    client = openai(reply(f"answer {CANARY}", usage=USAGE), name="p")
    failing = openai(fail(TransientProviderError(f"{CANARY} echoed", status_code=503)), name="f")
    chat = (
        ChatPipeline.builder(**otel.providers)
        .use_telemetry()
        .use_spend(ledger, attribution={"team": "ml"})
        .use_ordered_failover([Route("f", failing), Route("p", client)])
        .build()
    )
    with caplog.at_level(logging.DEBUG):
        await collect(chat, f"question {CANARY}", streaming=streaming)
        spent = await ledger.records()
    assert len(spent) == 2
    assert all(CANARY not in repr(r) for r in spent)
    assert CANARY not in "\n".join(otel.everything_exported())
    assert CANARY not in caplog.text
