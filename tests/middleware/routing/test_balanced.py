"""BalancedFailoverChatClient: each strategy's choice, what is skipped, cooldowns, probes,
failover order, the retry layer's deference, and the health it feeds (both call shapes)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import random

import pytest

from middleware.routing import (
    BalancedFailoverChatClient,
    BalancedSettings,
    MemoryAffinityStore,
    Route,
    RouteHealth,
    SessionAffinity,
)
from pipeline import ChatOptions, ChatPipeline
from pipeline._semconv import ROUTE_ATTEMPT_COUNT_METRIC, ROUTE_NAME, ROUTE_SELECTION
from pipeline.errors import (
    AttemptTimeoutError,
    CircuitOpenError,
    RateLimitedError,
    RoutingError,
    TransientProviderError,
)
from pipeline.testing import ScriptedChatClient, collect, fail, fail_after, hang, reply


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def fleet(*names: str, **scripts: object) -> dict[str, ScriptedChatClient]:
    return {
        name: ScriptedChatClient(scripts.get(name, reply(f"from {name}")), name=name)  # type: ignore[arg-type]
        for name in names
    }


def routes(clients: dict[str, ScriptedChatClient], **facts: dict[str, object]) -> list[Route]:
    return [Route(name, client, **facts.get(name, {})) for name, client in clients.items()]  # type: ignore[arg-type]


def teach(health: RouteHealth, clock: Clock, route: str, latency: float, times: int = 1) -> None:
    """Feed `times` answered attempts of `latency` seconds into `health`."""
    for _ in range(times):
        ticket = health.attempt_started(route)
        clock.advance(latency)
        ticket.first_update()
        ticket.ended("completed")


def served(clients: dict[str, ScriptedChatClient]) -> dict[str, int]:
    return {name: client.call_count for name, client in clients.items()}


async def test_peak_ewma_sends_requests_to_the_cheaper_of_two(streaming: bool) -> None:
    clock = Clock()
    health = RouteHealth(clock=clock)
    teach(health, clock, "slow", 0.5)
    teach(health, clock, "fast", 0.3)  # faster, but not an outlier (under 2x)
    clients = fleet("slow", "fast")
    router = BalancedFailoverChatClient(
        routes(clients), health=health, exploration=0.0, random_source=random.Random(1)
    )
    for _ in range(10):
        result = await collect(router, "hi", streaming=streaming)
        assert result.error is None and result.text == "from fast"
    assert served(clients) == {"slow": 0, "fast": 10}


async def test_peak_ewma_weighs_attempts_in_flight(streaming: bool) -> None:
    clock = Clock()
    health = RouteHealth(clock=clock)
    teach(health, clock, "a", 0.3)
    teach(health, clock, "b", 0.4)
    held = [health.attempt_started("a") for _ in range(2)]  # a: 0.3 x 3 > b: 0.4 x 1
    clients = fleet("a", "b")
    router = BalancedFailoverChatClient(
        routes(clients), health=health, exploration=0.0, random_source=random.Random(2)
    )
    result = await collect(router, "hi", streaming=streaming)
    assert result.text == "from b"
    for ticket in held:
        ticket.ended("completed")
    result = await collect(router, "hi", streaming=streaming)
    assert result.text == "from a"


async def test_unknown_routes_cost_the_typical_known_one(streaming: bool) -> None:
    clock = Clock()
    health = RouteHealth(clock=clock)
    clients = fleet("a", "b", "c")
    router = BalancedFailoverChatClient(
        routes(clients), health=health, exploration=0.0, random_source=random.Random(3)
    )
    for _ in range(30):
        assert (await collect(router, "hi", streaming=streaming)).error is None
    assert all(count > 0 for count in served(clients).values()), served(clients)


async def test_least_busy_picks_the_route_with_fewest_in_flight(streaming: bool) -> None:
    clock = Clock()
    health = RouteHealth(clock=clock)
    held = [health.attempt_started("a"), health.attempt_started("b")]
    clients = fleet("a", "b", "c")
    router = BalancedFailoverChatClient(
        routes(clients), health=health, strategy="least_busy", random_source=random.Random(4)
    )
    assert (await collect(router, "hi", streaming=streaming)).text == "from c"
    for ticket in held:
        ticket.ended("completed")


async def test_weighted_spreads_by_weight(streaming: bool) -> None:
    clients = fleet("heavy", "light")
    router = BalancedFailoverChatClient(
        routes(clients, heavy={"weight": 3.0}, light={"weight": 1.0}),
        strategy="weighted",
        random_source=random.Random(5),
    )
    for _ in range(400):
        await collect(router, "hi", streaming=streaming)
    counts = served(clients)
    assert counts["heavy"] + counts["light"] == 400
    assert 2.4 < counts["heavy"] / counts["light"] < 3.8, counts


async def test_round_robin_takes_turns(streaming: bool) -> None:
    clients = fleet("a", "b", "c")
    router = BalancedFailoverChatClient(routes(clients), strategy="round_robin")
    texts = [(await collect(router, "hi", streaming=streaming)).text for _ in range(6)]
    assert texts == ["from a", "from b", "from c"] * 2


async def test_failover_after_a_failure_before_output_tries_each_route_once(
    streaming: bool,
) -> None:
    clients = fleet(
        "a", "b", "c", a=fail(TransientProviderError()), b=fail(TransientProviderError())
    )
    router = BalancedFailoverChatClient(routes(clients), strategy="round_robin")
    result = await collect(router, "hi", streaming=streaming)
    assert result.text == "from c"
    assert served(clients)["c"] == 1 and max(served(clients).values()) == 1
    # Every route fails: each is tried once and the last failure is raised.
    clients = fleet("a", "b", **{name: fail(TransientProviderError()) for name in "ab"})
    router = BalancedFailoverChatClient(routes(clients))
    result = await collect(router, "hi", streaming=streaming)
    assert isinstance(result.error, TransientProviderError)
    assert served(clients) == {"a": 1, "b": 1}


async def test_a_failure_after_output_is_terminal_and_counts_against_the_route(
    streaming: bool,
) -> None:
    clock = Clock()
    health = RouteHealth(clock=clock)
    clients = fleet("a", "b", a=fail_after(["partial "], TransientProviderError()))
    router = BalancedFailoverChatClient(routes(clients), health=health, strategy="round_robin")
    result = await collect(router, "hi", streaming=streaming)
    if streaming:
        assert isinstance(result.error, TransientProviderError)
        assert [u.text for u in result.updates] == ["partial "]
        assert served(clients) == {"a": 1, "b": 0}
        assert health.stats("a").failure_ratio == pytest.approx(1 / 2)
    else:
        # Not streamed, nothing reached the caller: a failure before output, failed over.
        assert result.text == "from b" and served(clients) == {"a": 1, "b": 1}


async def test_routes_with_an_open_breaker_are_skipped(streaming: bool) -> None:
    primary = ScriptedChatClient(fail(TransientProviderError()), name="a")
    breaker = ChatPipeline.builder().use_circuit_breaker(fail_max=1).build(primary, name="a")
    backup = ScriptedChatClient(reply("from b"), name="b")
    router = BalancedFailoverChatClient(
        [Route("a", breaker), Route("b", backup)], strategy="round_robin"
    )
    assert (await collect(router, "hi", streaming=streaming)).text == "from b"  # opens a
    for _ in range(4):
        assert (await collect(router, "hi", streaming=streaming)).text == "from b"
    assert primary.call_count == 1 and backup.call_count == 5


async def test_with_no_route_able_to_serve_one_is_tried_anyway(streaming: bool) -> None:
    primary = ScriptedChatClient(fail(TransientProviderError()), name="a")
    breaker = ChatPipeline.builder().use_circuit_breaker(fail_max=1).build(primary, name="a")
    router = BalancedFailoverChatClient([Route("a", breaker)])
    await collect(router, "hi", streaming=streaming)
    result = await collect(router, "hi", streaming=streaming)
    assert isinstance(result.error, CircuitOpenError)


async def test_retry_after_cools_a_route_and_the_request_fails_over_at_once(
    streaming: bool,
) -> None:
    clock = Clock()
    health = RouteHealth(clock=clock)
    limited = RateLimitedError(status_code=429, retry_after=2.0)
    clients = fleet("a", "b", a=[fail(limited), reply("from a")])
    router = BalancedFailoverChatClient(routes(clients), health=health, strategy="round_robin")
    assert (await collect(router, "hi", streaming=streaming)).text == "from b"
    assert health.cooling_down("a")
    for _ in range(3):  # round robin would pick a; it is cooling down
        assert (await collect(router, "hi", streaming=streaming)).text == "from b"
    clock.advance(2.0)
    texts = {(await collect(router, "hi", streaming=streaming)).text for _ in range(2)}
    assert texts == {"from a", "from b"}
    assert served(clients)["a"] == 2


async def test_the_retry_layer_does_not_wait_out_retry_after_while_another_route_can_serve(
    streaming: bool,
) -> None:
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    limited = ScriptedChatClient(
        [fail(RateLimitedError(status_code=429, retry_after=1.0)), reply("late a")], name="a"
    )
    retried = ChatPipeline.builder().use_retry(max_attempts=3, sleep=sleep).build(limited)
    backup = ScriptedChatClient(reply("from b"), name="b")
    router = BalancedFailoverChatClient(
        [Route("a", retried), Route("b", backup)], strategy="round_robin"
    )
    result = await collect(router, "hi", streaming=streaming)
    assert result.text == "from b"
    assert (limited.call_count, backup.call_count, waits) == (1, 1, [])


async def test_the_retry_layer_waits_out_retry_after_when_no_other_route_remains(
    streaming: bool,
) -> None:
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    limited = ScriptedChatClient(
        [fail(RateLimitedError(status_code=429, retry_after=1.0)), reply("late a")], name="a"
    )
    retried = ChatPipeline.builder().use_retry(max_attempts=3, sleep=sleep).build(limited)
    router = BalancedFailoverChatClient([Route("a", retried)])
    result = await collect(router, "hi", streaming=streaming)
    assert result.text == "late a"
    assert limited.call_count == 2 and waits == [1.0]


async def test_an_outlier_gets_one_probe_cut_early_and_the_request_fails_over(
    streaming: bool,
) -> None:
    clock = Clock()
    health = RouteHealth(
        clock=clock, outlier_latency_gap=0.001, probe_interval=5.0, max_probe_interval=5.0
    )
    teach(health, clock, "a", 5.0)  # a hung a while ago: an outlier
    teach(health, clock, "b", 0.01, times=3)
    teach(health, clock, "c", 0.01, times=3)
    clients = fleet("a", "b", "c", a=hang())
    router = BalancedFailoverChatClient(routes(clients), health=health)
    for _ in range(5):  # an outlier: no traffic, and no probe before the interval
        assert (await collect(router, "hi", streaming=streaming)).error is None
    assert served(clients)["a"] == 0
    clock.advance(5.0)
    result = await collect(router, "hi", streaming=streaming)  # the probe: cut at 0.01 s
    assert result.error is None and result.text in ("from b", "from c")
    assert served(clients)["a"] == 1
    assert clients["a"].streams_closed == clients["a"].streams_opened  # nothing left open
    for _ in range(5):  # no probe again before the interval
        assert (await collect(router, "hi", streaming=streaming)).error is None
    assert served(clients)["a"] == 1
    clock.advance(5.0)
    assert health.judge("abc").outliers == {"a"}  # the cut probe kept it slow
    await collect(router, "hi", streaming=streaming)
    assert served(clients)["a"] == 2


async def test_a_cut_probe_is_not_held_against_the_routes_breaker(streaming: bool) -> None:
    clock = Clock()
    health = RouteHealth(clock=clock, outlier_latency_gap=0.001, probe_interval=1.0)
    teach(health, clock, "a", 5.0)
    teach(health, clock, "b", 0.01, times=3)
    hung = ScriptedChatClient(hang(), name="a")
    guarded = ChatPipeline.builder().use_circuit_breaker(fail_max=1).build(hung, name="a")
    router = BalancedFailoverChatClient(
        [Route("a", guarded), Route("b", ScriptedChatClient(reply("from b"), name="b"))],
        health=health,
    )
    assert health.judge("ab").outliers == {"a"}
    for _ in range(3):
        clock.advance(5.0)
        assert (await collect(router, "hi", streaming=streaming)).text == "from b"
    assert hung.call_count == 3  # a breaker counting the cuts would have opened at the first


async def test_a_recovered_outlier_earns_its_traffic_back(streaming: bool) -> None:
    clock = Clock()
    health = RouteHealth(clock=clock, outlier_latency_gap=0.001, probe_interval=1.0)
    teach(health, clock, "a", 3.0)
    teach(health, clock, "b", 0.01, times=3)
    teach(health, clock, "c", 0.01, times=3)
    clients = fleet("a", "b", "c")
    router = BalancedFailoverChatClient(routes(clients), health=health)
    assert health.judge("abc").outliers == {"a"}
    for _ in range(2):  # two probes answer at once (on the fake clock: in 0 s)
        clock.advance(1.0)
        await collect(router, "hi", streaming=streaming)
    assert served(clients)["a"] == 2
    assert health.judge("abc").outliers == set()  # two good probes in a row readmit it
    before = served(clients)["a"]
    for _ in range(60):
        await collect(router, "hi", streaming=streaming)
    assert served(clients)["a"] - before > 5


async def test_a_session_starts_on_its_route_while_that_route_is_healthy(
    streaming: bool,
) -> None:
    clients = fleet("a", "b", "c")
    affinity = SessionAffinity(MemoryAffinityStore())
    router = BalancedFailoverChatClient(routes(clients), strategy="round_robin", affinity=affinity)
    options = ChatOptions(session_id="s-1")
    first = (await collect(router, "hi", options, streaming=streaming)).text
    for _ in range(4):
        assert (await collect(router, "hi", options, streaming=streaming)).text == first


async def test_rpm_keeps_a_route_under_its_declared_limit(streaming: bool) -> None:
    clients = fleet("a", "b")
    router = BalancedFailoverChatClient(
        routes(clients, a={"rpm": 2}), strategy="round_robin", random_source=random.Random(6)
    )
    for _ in range(8):
        await collect(router, "hi", streaming=streaming)
    assert served(clients) == {"a": 2, "b": 6}


async def test_attempts_feed_health_and_leave_nothing_in_flight(streaming: bool) -> None:
    clock = Clock()
    health = RouteHealth(clock=clock)
    clients = fleet("a", "b", a=[reply("x", chunks=["x"]), fail(TransientProviderError())])
    router = BalancedFailoverChatClient(routes(clients), health=health, strategy="round_robin")
    for _ in range(4):
        await collect(router, "hi", streaming=streaming)
    stats = health.snapshot()
    assert {name: s.in_flight for name, s in stats.items()} == {"a": 0, "b": 0}
    assert stats["a"].samples == pytest.approx(2) and stats["b"].samples == pytest.approx(3)
    assert stats["a"].failure_ratio == pytest.approx(1 / 3)


async def test_an_abandoned_stream_and_a_cancelled_request_leave_nothing_in_flight() -> None:
    clock = Clock()
    health = RouteHealth(clock=clock)
    clients = fleet("a", a=[reply("one two", chunks=["one ", "two"]), hang()])
    router = BalancedFailoverChatClient(routes(clients), health=health)
    stream = router.get_streaming_response("hi")
    assert (await anext(stream)).text == "one "
    await stream.aclose()
    task = asyncio.create_task(router.get_response("hi"))
    await clients["a"].wait_for_calls(2)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert health.stats("a").in_flight == 0
    assert health.stats("a").samples == 0  # the caller's doing says nothing of the route


async def test_attempt_spans_say_why_the_route_was_chosen(otel, streaming: bool) -> None:  # type: ignore[no-untyped-def]
    clients = fleet("a", "b", a=fail(TransientProviderError()))
    router = BalancedFailoverChatClient(
        routes(clients),
        strategy="round_robin",
        tracer_provider=otel.tracer_provider,
        meter_provider=otel.meter_provider,
    )
    await collect(router, "hi", streaming=streaming)
    spans = otel.attempt_spans()
    assert [(s.name, s.attributes[ROUTE_SELECTION]) for s in spans] == [
        ("route_attempt a", "strategy"),
        ("route_attempt b", "failover"),
    ]
    # The attempt counter carries the reason too, so a dashboard can show the share of
    # attempts that were probes or failovers.
    counted = {
        (labels[ROUTE_NAME], labels[ROUTE_SELECTION]): value
        for labels, value in otel.points(ROUTE_ATTEMPT_COUNT_METRIC)
    }
    assert counted == {("a", "strategy"): 1, ("b", "failover"): 1}


def test_configuration_is_checked() -> None:
    client = ScriptedChatClient("x", name="a")
    with pytest.raises(ValueError, match="two routes are named 'a'"):
        BalancedFailoverChatClient([Route("a", client), Route("a", client)])
    with pytest.raises(ValueError, match="strategy"):
        BalancedFailoverChatClient([client], strategy="fastest")
    with pytest.raises(ValueError, match="exploration"):
        BalancedSettings(exploration=1.5)
    with pytest.raises(TypeError, match="health"):
        BalancedFailoverChatClient([client], health="redis://")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weight"):
        Route("a", client, weight=0)
    assert (
        "round_robin"
        in BalancedFailoverChatClient([client], strategy="round_robin").describe_layer()
    )


async def test_a_probe_cut_is_an_attempt_timeout_of_the_probed_route() -> None:
    clock = Clock()
    health = RouteHealth(clock=clock, outlier_latency_gap=0.001)
    teach(health, clock, "a", 5.0)
    teach(health, clock, "b", 0.01, times=2)
    teach(health, clock, "c", 0.01, times=2)
    clients = fleet("a", "b", "c", a=hang())
    outcomes: collections.Counter[tuple[str, str]] = collections.Counter()

    class Recording(BalancedFailoverChatClient):
        def on_routing_update(self, context, attempt, is_terminal):  # type: ignore[no-untyped-def]
            outcomes[(attempt.route_name, type(attempt.exception).__name__)] += 1

    router = Recording(routes(clients), health=health)
    assert health.judge("abc").outliers == {"a"}
    clock.advance(health.settings.probe_interval)
    await router.get_response("hi")
    assert outcomes[("a", AttemptTimeoutError.__name__)] == 1


async def test_weights_as_large_as_floats_go_still_spread_by_weight(streaming: bool) -> None:
    clients = fleet("heavy", "light", "tiny")
    router = BalancedFailoverChatClient(
        routes(
            clients,
            heavy={"weight": 1.5e308},
            light={"weight": 0.5e308},
            tiny={"weight": 5e-324},  # the smallest float: as good as never
        ),
        strategy="weighted",
        random_source=random.Random(5),
    )
    for _ in range(400):
        result = await collect(router, "hi", streaming=streaming)
        assert result.error is None
    counts = served(clients)
    assert counts["heavy"] + counts["light"] == 400 and counts["tiny"] == 0
    assert 2.4 < counts["heavy"] / counts["light"] < 3.8, counts


def test_a_weight_must_be_finite() -> None:
    client = ScriptedChatClient("ok", name="a")
    for weight in (math.inf, math.nan):
        with pytest.raises(ValueError, match=r"Route 'a'.*weight"):
            Route("a", client, weight=weight)


async def test_a_selection_that_fails_is_a_routing_error(streaming: bool) -> None:
    class Broken(random.Random):
        def choices(self, *args: object, **kwargs: object) -> list[Route]:  # type: ignore[override]
            raise ValueError("Total of weights must be finite")

    clients = fleet("a", "b")
    router = BalancedFailoverChatClient(
        routes(clients), strategy="weighted", random_source=Broken(1)
    )
    result = await collect(router, "hi", streaming=streaming)
    assert isinstance(result.error, RoutingError)
    assert str(result.error) == "route selection failed (weighted): ValueError"
    assert isinstance(result.error.__cause__, ValueError)
