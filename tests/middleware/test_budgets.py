"""The budgets layer in library use, over a real redis-server: both call shapes, over a
router and without one; two processes' worth of layers sharing one scope."""

from __future__ import annotations

import time
import uuid

import pytest

from middleware.budgets import BudgetChatClient
from middleware.routing import OrderedFailoverChatClient, Route
from pipeline import ChatPipeline
from pipeline._reservations import NANOS
from pipeline.errors import BudgetExceededError, RateLimitExceededError
from pipeline.keys import Budget
from pipeline.pricing import Price, estimate_input_tokens
from pipeline.testing import ScriptedChatClient, collect, hang, reply
from pipeline.types import ChatMessage, UsageDetails

# A dollar a token: the scripted answers' usage (3 in, 2 out) costs $5.
PRICE = Price(1_000_000, 1_000_000)


def scripted(count: int) -> ScriptedChatClient:
    return ScriptedChatClient([reply("ok", usage=UsageDetails(3, 2, 5)) for _ in range(count)])


async def test_a_spent_budget_refuses_before_any_call(redis_url: str, streaming: bool) -> None:
    inner = scripted(10)
    scope = f"app-{uuid.uuid4().hex[:6]}"
    chat = (
        ChatPipeline.builder()
        .use_budgets(redis_url, scope=scope, budget=Budget("12"), price=PRICE)
        .build(inner)
    )
    results = [await collect(chat, "hi", streaming=streaming) for _ in range(4)]
    # 0, 5, 10 spent before each of the first three: admitted; 15 is over 12.
    assert [r.error is None for r in results] == [True, True, True, False]
    assert isinstance(results[3].error, BudgetExceededError)
    assert inner.call_count == 3
    await chat.aclose()


async def test_attempts_a_router_logs_are_what_is_spent(redis_url: str, streaming: bool) -> None:
    scope = f"routed-{uuid.uuid4().hex[:6]}"
    router = OrderedFailoverChatClient([Route("only", scripted(10), price=PRICE)])
    chat = (
        ChatPipeline.builder()
        .use_budgets(redis_url, scope=scope, budget=Budget("9"), price=PRICE)
        .use_failover(router)
        .build()
    )
    first = await collect(chat, "hi", streaming=streaming)
    second = await collect(chat, "hi", streaming=streaming)
    third = await collect(chat, "hi", streaming=streaming)
    assert first.error is None and second.error is None
    assert isinstance(third.error, BudgetExceededError)  # 5 + 5 spent: over 9
    await chat.aclose()


async def test_processes_sharing_a_scope_share_its_rate_limit(redis_url: str) -> None:
    scope = f"shared-{uuid.uuid4().hex[:6]}"
    layers = [
        ChatPipeline.builder().use_budgets(redis_url, scope=scope, rpm=60).build(scripted(5))
        for _ in range(2)
    ]
    # The limits' clock stands still (the same for both), so the calls' pace does not matter.
    now = time.time()
    for chat in layers:
        assert isinstance(chat.client, BudgetChatClient)
        chat.client.governor.reservations.clock = lambda: now
    # 60 a minute, a burst of a second: two at once across both, then a refusal.
    outcomes = [await collect(layers[n % 2], "hi", streaming=False) for n in range(3)]
    assert [o.error is None for o in outcomes] == [True, True, False]
    error = outcomes[2].error
    assert isinstance(error, RateLimitExceededError) and error.retry_after == 1.0
    for chat in layers:
        await chat.aclose()


@pytest.mark.parametrize("fail_closed", [False, True])
async def test_an_unreachable_redis_fails_open_or_closed(fail_closed: bool) -> None:
    from pipeline.errors import BudgetUnavailableError

    chat = (
        ChatPipeline.builder()
        .use_budgets("redis://127.0.0.1:1/0", budget=Budget("1"), fail_closed=fail_closed)
        .build(scripted(1))
    )
    result = await collect(chat, "hi", streaming=False)
    if fail_closed:
        assert isinstance(result.error, BudgetUnavailableError)
    else:
        assert result.error is None
    await chat.aclose()


async def test_a_hedged_call_settles_once_with_both_attempts_costs(
    redis_url: str, streaming: bool
) -> None:
    slow = ScriptedChatClient([hang()])
    fast = scripted(1)
    hedged = (
        ChatPipeline.builder()
        .use_hedging(
            [Route("slow", slow, price=PRICE), Route("fast", fast, price=PRICE)],
            strategy="round_robin",
            delay=0.001,
            budget=1.0,
        )
        .build()
    )
    scope = f"hedged-{uuid.uuid4().hex[:6]}"
    chat = BudgetChatClient(hedged, redis_url, scope=scope, budget=Budget("1000"), price=PRICE)
    assert (await collect(chat, "hi", streaming=streaming)).error is None
    assert (slow.call_count, fast.call_count) == (1, 1)
    reservations = chat.governor.reservations
    await reservations.flush()
    (budget,) = chat.governor.limits(chat.subject).budgets
    spent, reserved = await reservations.redis.execute("HMGET", budget.key, "s", "r")
    # The winner's $5 and the abandoned hedge's input (estimated: it answered nothing),
    # spent once; nothing left reserved.
    abandoned = estimate_input_tokens([ChatMessage.user("hi")])
    assert (int(spent), int(reserved)) == ((5 + abandoned) * NANOS, 0)
    await chat.aclose()
