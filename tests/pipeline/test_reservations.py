"""Budgets and rate limits in a real redis-server: the bare client, then the one script's
reservations, settlements, leases and rebuilds, on Redis's own clock."""

from __future__ import annotations

import asyncio
import uuid
from decimal import Decimal

import pytest
import redis.asyncio as redis_asyncio

from pipeline._reservations import (
    NANOS,
    REBUILD_POLL,
    BudgetCheck,
    Demand,
    Granted,
    RateCheck,
    Refused,
    Reservations,
    Settlement,
    Unavailable,
    nanos,
)
from pipeline._resp import RespClient, RespError, Script, encode_command
from tests.redis_server import RedisServer

# -- the client ----------------------------------------------------------------------------


def test_commands_are_encoded_as_arrays_of_bulk_strings() -> None:
    assert encode_command(["SET", "k", 12, 1.5]) == (
        b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n12\r\n$3\r\n1.5\r\n"
    )
    with pytest.raises(TypeError):
        encode_command(["SET", "k", True])


@pytest.mark.parametrize("url", ["http://x", "redis://", "not a url"])
def test_a_bad_url_is_refused_without_echoing_it(url: str) -> None:
    with pytest.raises(ValueError, match="must be a redis") as caught:
        RespClient(url.replace("x", "secret-password"), timeout=1.0)
    assert "secret-password" not in str(caught.value)


async def test_replies_match_calls_in_order_and_errors_keep_their_code(redis_url: str) -> None:
    client = RespClient(redis_url, timeout=5.0)
    key = f"resp-{uuid.uuid4().hex}"
    replies = await asyncio.gather(
        *(client.execute("SET", f"{key}:{i}", i) for i in range(200)),
        *(client.execute("GET", f"{key}:{i}") for i in range(200)),
    )
    assert replies[200:] == [str(i).encode() for i in range(200)]
    with pytest.raises(RespError) as caught:
        await client.execute("INCR", f"{key}:nope", "extra")
    assert caught.value.code == "ERR"
    await client.aclose()


async def test_a_cancelled_call_never_hands_its_reply_to_another(redis_url: str) -> None:
    client = RespClient(redis_url, timeout=5.0)
    key = f"resp-{uuid.uuid4().hex}"
    await client.execute("SET", key, "mine")
    slow = asyncio.ensure_future(client.execute("DEBUG", "SLEEP", "0.2"))
    await asyncio.sleep(0)  # written
    slow.cancel()
    assert await client.execute("GET", key) == b"mine"
    await client.aclose()


async def test_scripts_load_on_noscript(redis_url: str) -> None:
    client = RespClient(redis_url, timeout=5.0)
    script = Script(f"return '{uuid.uuid4().hex}' .. ARGV[1]")
    first = await client.evalsha(script, [], ["!"])
    assert first.endswith(b"!")
    assert await client.evalsha(script, [], ["?"]) == first[:-1] + b"?"
    await client.aclose()


async def test_a_redis_that_stops_answering_fails_every_waiting_call_at_once(
    redis_server: RedisServer,
) -> None:
    client = RespClient(redis_server.url, timeout=0.3)
    assert await client.execute("PING") == b"PONG"
    redis_server.pause()
    try:
        results = await asyncio.gather(
            *(client.execute("PING") for _ in range(50)), return_exceptions=True
        )
        assert all(isinstance(r, TimeoutError | ConnectionError) for r in results), results
    finally:
        redis_server.resume()
    assert await client.execute("PING") == b"PONG"  # connected again
    await client.aclose()


# -- reservations --------------------------------------------------------------------------


def budget(reservations: Reservations, name: str, limit: str, **options: object) -> BudgetCheck:
    return BudgetCheck(reservations.key("b", name), nanos(Decimal(limit), up=True), **options)  # type: ignore[arg-type]


async def ready(redis_url: str, **options: object) -> Reservations:
    """Reservations in a namespace of their own, counters built (nothing to rebuild)."""
    reservations = Reservations(
        RespClient(redis_url, timeout=5.0),
        namespace=f"gov-{uuid.uuid4().hex[:8]}",
        rebuild_delay=0.0,
        **options,  # type: ignore[arg-type]
    )
    first = await reservations.reserve(Demand())
    assert first == Unavailable("rebuilding")  # a fresh Redis: counters are made first
    assert await reservations.prepare(10.0), "the counters were never built"
    return reservations


async def test_a_budget_admits_while_anything_is_left_and_settles_actual_cost(
    redis_url: str,
) -> None:
    reservations = await ready(redis_url)
    key = budget(reservations, "k1", "1.00")
    amount = nanos(Decimal("0.30"), up=True)
    answers = [await reservations.reserve(Demand([key], amount)) for _ in range(5)]
    # 0, 0.30, 0.60, 0.90 used before each: admitted; 1.20 is over the limit.
    assert [type(a) for a in answers] == [Granted] * 4 + [Refused]
    refused = answers[4]
    assert isinstance(refused, Refused) and refused.budget == key
    # Settled at a tenth of the estimate: room again.
    for answer in answers[:4]:
        assert isinstance(answer, Granted)
        reservations.settle(
            Settlement(Demand([key], amount, token=answer.token), nanos(Decimal("0.03")))
        )
    await reservations.flush()
    raw = redis_asyncio.Redis.from_url(redis_url)
    assert await raw.hmget(key.key, ["s", "r"]) == [str(nanos(Decimal("0.12"))).encode(), b"0"]
    assert isinstance(await reservations.reserve(Demand([key], amount)), Granted)
    await raw.aclose()
    await reservations.aclose()


async def test_every_budget_is_checked_and_taken_at_once(redis_url: str) -> None:
    reservations = await ready(redis_url)
    key = budget(reservations, "k2", "10")
    team = budget(reservations, "t2", "0.50", scope="team")
    amount = nanos(Decimal("0.40"), up=True)
    assert isinstance(await reservations.reserve(Demand([key, team], amount)), Granted)
    assert isinstance(await reservations.reserve(Demand([key, team], amount)), Granted)
    refused = await reservations.reserve(Demand([key, team], amount))
    assert isinstance(refused, Refused) and refused.budget == team
    raw = redis_asyncio.Redis.from_url(redis_url)
    # The refused request took nothing from the key's budget either.
    assert await raw.hget(key.key, "r") == str(2 * amount).encode()
    await raw.aclose()
    await reservations.aclose()


async def test_a_soft_limit_passed_says_what_remains(redis_url: str) -> None:
    reservations = await ready(redis_url)
    soft = budget(reservations, "k3", "1.00", soft=nanos(Decimal("0.50")))
    amount = nanos(Decimal("0.30"))
    # Spent and reserved before a request are what passes a soft limit.
    first = await reservations.reserve(Demand([soft], amount))
    assert isinstance(first, Granted) and first.soft_remaining is None
    second = await reservations.reserve(Demand([soft], amount))
    assert isinstance(second, Granted) and second.soft_remaining is None
    third = await reservations.reserve(Demand([soft], amount))
    assert isinstance(third, Granted) and third.soft_remaining == Decimal("0.40")
    await reservations.aclose()


async def test_reservations_made_meanwhile_share_a_call_and_settlements_ride_along(
    redis_url: str,
) -> None:
    reservations = await ready(redis_url)
    key = budget(reservations, "k4", "1000")
    calls = reservations.calls
    answers = await asyncio.gather(*(reservations.reserve(Demand([key], 10)) for _ in range(100)))
    # The first goes out at once; the 99 made while it was on the way go out together.
    assert reservations.calls == calls + 2
    for answer in answers:
        assert isinstance(answer, Granted)
        reservations.settle(Settlement(Demand([key], 10, token=answer.token), 5))
    # The settlements wait for the next reservation and go with it.
    assert isinstance(await reservations.reserve(Demand([key], 10)), Granted)
    assert reservations.calls == calls + 3
    raw = redis_asyncio.Redis.from_url(redis_url)
    assert await raw.hmget(key.key, ["s", "r"]) == [b"500", b"10"]
    await raw.aclose()
    await reservations.aclose()


async def test_a_settlement_sent_twice_counts_once_and_a_lost_lease_adds_actual(
    redis_url: str,
) -> None:
    reservations = await ready(redis_url)
    key = budget(reservations, "k5", "1000")
    granted = await reservations.reserve(Demand([key], 100))
    assert isinstance(granted, Granted)
    settlement = Settlement(Demand([key], 100, token=granted.token), 40)
    reservations.settle(settlement)
    reservations.settle(settlement)
    await reservations.flush()
    raw = redis_asyncio.Redis.from_url(redis_url)
    assert await raw.hmget(key.key, ["s", "r"]) == [b"40", b"0"]
    # A request whose reservation Redis no longer holds: its cost still counts.
    reservations.settle(Settlement(Demand([key], 100, token="never-reserved"), 7))
    await reservations.flush()
    assert await raw.hmget(key.key, ["s", "r"]) == [b"47", b"0"]
    await raw.aclose()
    await reservations.aclose()


async def test_a_lease_that_ends_unsettled_gives_its_reservation_back(redis_url: str) -> None:
    now = [1_000_000.0]  # the leases' clock: it moves only when told
    reservations = await ready(redis_url, clock=lambda: now[0])
    key = budget(reservations, "k6", "0.000001")
    granted = await reservations.reserve(Demand([key], 10**9, lease=0.05))
    assert isinstance(granted, Granted)
    assert isinstance(await reservations.reserve(Demand([key], 1)), Refused)
    now[0] += 0.04  # the lease still runs: its reservation still counts
    assert isinstance(await reservations.reserve(Demand([key], 1)), Refused)
    now[0] += 0.02  # it ended: the next call sweeps it
    assert isinstance(await reservations.reserve(Demand([key], 0, lease=0.05)), Granted)
    raw = redis_asyncio.Redis.from_url(redis_url)
    assert await raw.hget(key.key, "r") == b"0"
    await raw.aclose()
    await reservations.aclose()


async def test_rate_limits_admit_the_rate_plus_the_burst_and_say_when(redis_url: str) -> None:
    now = [1_000_000.0]  # the limits' clock: it moves only when told
    reservations = await ready(redis_url, clock=lambda: now[0])
    rpm = RateCheck(reservations.key("rl", "k7", "rpm"), limit=600, cost=1, burst=1.0)
    answers = await asyncio.gather(*(reservations.reserve(Demand(rates=[rpm])) for _ in range(30)))
    granted = [a for a in answers if isinstance(a, Granted)]
    refused = [a for a in answers if isinstance(a, Refused)]
    # 600 a minute is one per 100 ms; a burst of one second: 11 at once (the first, then ten).
    assert len(granted) == 11 and len(refused) == 19
    assert [g.rates[0].remaining for g in granted] == list(range(10, -1, -1))
    assert all(r.rate == rpm and r.retry_after_ms == 100 for r in refused)
    assert all(r.rates[0].remaining == 0 for r in refused)
    assert granted[-1].rates[0].reset_ms == 1100
    # A cell's time later, one more (and only one) is admitted.
    now[0] += 0.1
    again = await asyncio.gather(*(reservations.reserve(Demand(rates=[rpm])) for _ in range(3)))
    assert [type(a) for a in again] == [Granted, Refused, Refused]
    await reservations.aclose()


async def test_a_token_limit_takes_the_estimate_and_is_corrected_by_usage(
    redis_url: str,
) -> None:
    reservations = await ready(redis_url)
    tpm = RateCheck(reservations.key("rl", "k8", "tpm"), limit=60_000, cost=1000, unit="tokens")
    demand = Demand(rates=[tpm])
    granted = await reservations.reserve(demand)
    assert isinstance(granted, Granted) and granted.rates[0].remaining == 1  # the burst used
    # It used 100 tokens, not 1,000: 900 tokens' time is given back.
    reservations.settle(Settlement(demand, 0, -900))
    await reservations.flush()
    after = await reservations.reserve(Demand(rates=[RateCheck(tpm.key, 60_000, 1, "tokens")]))
    assert isinstance(after, Granted) and after.rates[0].remaining > 800
    await reservations.aclose()


async def test_counters_lost_with_redis_are_rebuilt_and_reservations_wait(
    redis_server: RedisServer,
) -> None:
    namespace = f"gov-{uuid.uuid4().hex[:8]}"
    rebuilt: list[int] = []

    async def rebuild() -> list[tuple[str, int, int]]:
        rebuilt.append(1)
        return [(f"{namespace}:b:k9", 9 * NANOS // 10, 0)]  # the ledger: $0.90 spent

    now = [1_000_000.0]  # the outage's clock: it moves only when told
    reservations = Reservations(
        RespClient(redis_server.url, timeout=2.0),
        namespace=namespace,
        rebuild=rebuild,
        rebuild_delay=0.0,
        clock=lambda: now[0],
    )
    key = BudgetCheck(f"{namespace}:b:k9", NANOS)
    assert await reservations.reserve(Demand([key], 1)) == Unavailable("rebuilding")
    rebuilding = reservations._rebuilding  # the rebuild that refusal started
    assert rebuilding is not None
    await rebuilding  # its end, not a poll
    answer = await reservations.reserve(Demand([key], NANOS // 20))
    assert isinstance(answer, Granted) and rebuilt == [1]
    assert isinstance(await reservations.reserve(Demand([key], NANOS // 20)), Granted)
    assert isinstance(await reservations.reserve(Demand([key], 1)), Refused)  # 0.90 + 0.10
    # Redis restarted (nothing kept): the counters are rebuilt again, once.
    redis_server.stop()
    redis_server.start()
    answers = await asyncio.gather(*(reservations.reserve(Demand([key], 1)) for _ in range(10)))
    assert all(isinstance(a, Unavailable) for a in answers)
    # The restart was seen as a closed connection (an outage, over once its retry interval
    # is) or as lost counters (a rebuild under way): either way `prepare` ends when the
    # counters are back.
    now[0] += reservations.outage.retry_interval
    assert await reservations.prepare(10.0), "the counters were never rebuilt"
    answer = await reservations.reserve(Demand([key], 1))
    assert isinstance(answer, Granted) and rebuilt == [1, 1]
    await reservations.aclose()


async def test_a_replica_waits_for_the_rebuild_another_runs_without_hammering_redis(
    redis_url: str,
) -> None:
    other = await ready(redis_url)  # its own rebuild ran and is over
    release = asyncio.Event()

    async def rebuild() -> list[tuple[str, int, int]]:
        await release.wait()
        return []

    elected = Reservations(
        RespClient(redis_url, timeout=5.0),
        namespace=other.namespace,
        rebuild=rebuild,
        rebuild_delay=0.0,
    )
    raw = redis_asyncio.Redis.from_url(redis_url)
    await raw.delete(f"{other.namespace}:epoch")  # the counters are lost
    await raw.aclose()
    assert await elected.reserve(Demand()) == Unavailable("rebuilding")  # elected
    calls = other.calls
    bound = 5 * REBUILD_POLL
    # The other replica's rebuild is not one of its own: it asks again every REBUILD_POLL
    # (at most once per interval whatever the machine's speed), not round trip after round
    # trip.
    assert not await other.prepare(bound)
    assert 1 <= other.calls - calls <= bound / REBUILD_POLL + 1
    release.set()
    assert await elected.prepare(10.0)  # awaits its own rebuild
    assert await other.prepare(10.0)
    assert isinstance(await other.reserve(Demand()), Granted)
    await elected.aclose()
    await other.aclose()


async def test_an_outage_answers_unavailable_at_once_and_keeps_settlements(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1_000_000.0]  # the outage's clock: it moves only when told
    reservations = await ready(redis_server.url, clock=lambda: now[0])
    key = budget(reservations, "k10", "1000")
    granted = await reservations.reserve(Demand([key], 100))
    assert isinstance(granted, Granted)
    redis_server.pause()
    try:
        reservations.redis.timeout = 0.2
        demands = [Demand([key], 1) for _ in range(20)]
        answers = await asyncio.gather(*(reservations.reserve(d) for d in demands))
        assert all(isinstance(a, Unavailable) for a in answers)
        # Redis may still run them: every answer but a refusal is settled (here, served
        # nothing).
        for demand in demands:
            reservations.settle(Settlement(demand, 0))
        # Skipped while the outage lasts: no wait for Redis.
        assert await reservations.reserve(Demand([key], 1)) == Unavailable("outage")
        reservations.settle(Settlement(Demand([key], 100, token=granted.token), 60))
        await reservations.flush()
    finally:
        redis_server.resume()
    reservations.redis.timeout = 5.0
    assert await reservations.reserve(Demand([key], 0)) == Unavailable("outage")  # still
    now[0] += reservations.outage.retry_interval  # the retry interval is over
    # Redis answers again: the first call takes the settlements that waited with it.
    assert isinstance(await reservations.reserve(Demand([key], 0)), Granted)
    await reservations.flush()
    raw = redis_asyncio.Redis.from_url(redis_server.url)
    assert await raw.hmget(key.key, ["s", "r"]) == [b"60", b"0"]
    await raw.aclose()
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1
    await reservations.aclose()
