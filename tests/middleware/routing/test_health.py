"""Route health: each signal from attempts, on a fake clock."""

from __future__ import annotations

import math

import pytest

from middleware.routing.health import HealthSettings, RouteHealth, counts_against_route
from pipeline.errors import (
    AttemptTimeoutError,
    QuotaExhaustedError,
    RateLimitedError,
    RequestInvalidError,
    TransientProviderError,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


def answered(health: RouteHealth, clock: Clock, route: str, latency: float) -> None:
    ticket = health.attempt_started(route)
    clock.advance(latency)
    ticket.first_update()
    ticket.ended("completed")


def failed(health: RouteHealth, clock: Clock, route: str, error: BaseException, wait=0.0) -> None:
    ticket = health.attempt_started(route)
    clock.advance(wait)
    ticket.ended("failed_before_output", error)


def test_an_unknown_route_is_healthy_and_unknown(clock: Clock) -> None:
    stats = RouteHealth(clock=clock).stats("a")
    assert (stats.in_flight, stats.latency, stats.failure_ratio, stats.cooldown) == (
        0,
        None,
        0.0,
        0.0,
    )


def test_in_flight_counts_started_and_not_ended_attempts(clock: Clock) -> None:
    health = RouteHealth(clock=clock)
    first, second = health.attempt_started("a"), health.attempt_started("a")
    assert health.stats("a").in_flight == 2
    first.first_update()
    assert health.stats("a").in_flight == 2  # streaming on: still in flight
    first.ended("completed")
    second.ended("abandoned")
    assert health.stats("a").in_flight == 0


def test_latency_is_a_peak_ewma_that_jumps_up_and_decays_down(clock: Clock) -> None:
    health = RouteHealth(clock=clock, latency_decay=5.0)
    answered(health, clock, "a", 0.4)
    assert health.stats("a").latency == pytest.approx(0.4)
    answered(health, clock, "a", 1.2)  # slower: taken at once
    assert health.stats("a").latency == pytest.approx(1.2)
    clock.advance(5.0 - 0.4)
    answered(health, clock, "a", 0.4)  # faster, 5 s later: one decay constant
    weight = math.exp(-1.0)
    assert health.stats("a").latency == pytest.approx(1.2 * weight + 0.4 * (1 - weight))


def test_an_attempt_waiting_for_its_first_update_counts_with_its_age(clock: Clock) -> None:
    health = RouteHealth(clock=clock)
    answered(health, clock, "a", 0.4)
    ticket = health.attempt_started("a")
    clock.advance(0.3)
    assert health.stats("a").latency == pytest.approx(0.4)  # younger than the estimate
    clock.advance(2.7)
    assert health.stats("a").latency == pytest.approx(3.0)  # a hang is seen while it hangs
    ticket.first_update()
    assert health.stats("a").latency == pytest.approx(3.0)  # and is then a sample


def test_a_failure_before_output_raises_the_estimate_to_its_wait_but_never_lowers_it(
    clock: Clock,
) -> None:
    health = RouteHealth(clock=clock)
    answered(health, clock, "a", 0.5)
    failed(health, clock, "a", AttemptTimeoutError(), wait=3.0)
    assert health.stats("a").latency == pytest.approx(3.0)
    failed(health, clock, "a", TransientProviderError(), wait=0.01)
    assert health.stats("a").latency == pytest.approx(3.0)


def test_failure_ratio_counts_deployment_failures_after_output_too_and_decays(
    clock: Clock,
) -> None:
    health = RouteHealth(clock=clock, failure_decay=10.0)
    for _ in range(3):
        answered(health, clock, "a", 0.0)
    ticket = health.attempt_started("a")
    ticket.first_update()
    ticket.ended("failed_after_output", TransientProviderError())
    assert health.stats("a").failure_ratio == pytest.approx(1 / 5)
    # Request errors say nothing about the deployment; cancellation is the caller's.
    failed(health, clock, "a", RequestInvalidError())
    health.attempt_started("a").ended("canceled")
    assert health.stats("a").failure_ratio == pytest.approx(1 / 6)
    clock.advance(10.0)
    stats = health.stats("a")
    assert stats.samples == pytest.approx(5 * math.exp(-1.0))
    assert stats.failure_ratio == pytest.approx(math.exp(-1.0) / (5 * math.exp(-1.0) + 1))


def test_retry_after_cools_the_route_for_that_long_capped(clock: Clock) -> None:
    health = RouteHealth(clock=clock, max_cooldown=5.0)
    failed(health, clock, "a", RateLimitedError(status_code=429, retry_after=1.5))
    assert health.cooling_down("a") and health.stats("a").cooldown == pytest.approx(1.5)
    clock.advance(1.5)
    assert not health.cooling_down("a")
    failed(health, clock, "a", TransientProviderError(status_code=503, retry_after=60))
    assert health.stats("a").cooldown == pytest.approx(5.0)
    failed(health, clock, "b", RateLimitedError(status_code=429))  # no Retry-After
    assert not health.cooling_down("b")


def test_an_exhausted_quota_cools_the_route_for_the_quota_cooldown(clock: Clock) -> None:
    health = RouteHealth(clock=clock, max_cooldown=5.0)
    failed(health, clock, "a", QuotaExhaustedError(status_code=429, code="insufficient_quota"))
    assert health.stats("a").cooldown == pytest.approx(900.0)  # never capped by max_cooldown
    assert health.stats("a").failure_ratio > 0  # a deployment failure
    clock.advance(899.0)
    assert health.cooling_down("a")
    clock.advance(1.0)
    assert not health.cooling_down("a")
    # A provider that says how long it will be: the longer of the two.
    short = RouteHealth(clock=clock, quota_cooldown=30.0)
    failed(short, clock, "a", QuotaExhaustedError(status_code=402))
    assert short.stats("a").cooldown == pytest.approx(30.0)
    failed(short, clock, "b", QuotaExhaustedError(status_code=402, retry_after=3600))
    assert short.stats("b").cooldown == pytest.approx(3600.0)


def test_a_slow_route_is_an_outlier_against_the_others_median(clock: Clock) -> None:
    health = RouteHealth(clock=clock)
    for route, latency in (("a", 1.5), ("b", 0.4), ("c", 0.5)):
        answered(health, clock, route, latency)
    judgement = health.judge(["a", "b", "c"])
    assert judgement.outliers == {"a"}
    assert judgement.probe_deadline == pytest.approx(0.45 * 1.25)  # 1.25x the healthy median
    answered(health, clock, "a", 0.6)  # not enough to fall under 2x the median at once
    clock.advance(30.0)
    answered(health, clock, "a", 0.6)  # a long time later: the estimate decayed
    assert health.judge(["a", "b", "c"]).outliers == set()


def test_a_failing_route_is_an_outlier_only_with_enough_failures(clock: Clock) -> None:
    health = RouteHealth(clock=clock, min_failures=2.0)
    for route in "bc":
        for _ in range(10):
            answered(health, clock, route, 0.1)
    for _ in range(9):
        answered(health, clock, "a", 0.1)
    failed(health, clock, "a", TransientProviderError())
    assert health.judge("abc").outliers == set()  # one failure is not yet a pattern here
    failed(health, clock, "a", TransientProviderError())
    assert health.judge("abc").outliers == {"a"}


def test_no_route_is_an_outlier_alone_or_all_alike(clock: Clock) -> None:
    health = RouteHealth(clock=clock)
    answered(health, clock, "a", 5.0)
    assert health.judge(["a"]).outliers == set()
    answered(health, clock, "b", 5.0)
    assert health.judge(["a", "b"]).outliers == set()


def test_probes_start_one_interval_in_and_back_off_while_unanswered(clock: Clock) -> None:
    health = RouteHealth(clock=clock, probe_interval=1.0, max_probe_interval=3.0)
    answered(health, clock, "a", 5.0)
    answered(health, clock, "b", 0.1)
    judgement = health.judge(["a", "b"])
    assert judgement.outliers == {"a"} and not judgement.probe_due(health, "a")
    clock.advance(1.0)
    assert health.judge(["a", "b"]).probe_due(health, "a")
    probe = health.attempt_started("a", probe=True)
    clock.advance(5.0)
    assert not health.judge(["a", "b"]).probe_due(health, "a")  # one at a time
    probe.ended("failed_before_output", AttemptTimeoutError())  # not answered: wait 2 s
    clock.advance(1.9)
    assert not health.judge(["a", "b"]).probe_due(health, "a")
    clock.advance(0.1)
    assert health.judge(["a", "b"]).probe_due(health, "a")
    health.attempt_started("a", probe=True).ended("failed_before_output", AttemptTimeoutError())
    clock.advance(2.9)  # doubled again, capped at 3 s
    assert not health.judge(["a", "b"]).probe_due(health, "a")
    clock.advance(0.1)
    assert health.judge(["a", "b"]).probe_due(health, "a")
    ticket = health.attempt_started("a", probe=True)  # answered in time: back to 1 s
    ticket.first_update()
    ticket.ended("completed")
    clock.advance(1.0)
    assert health.judge(["a", "b"]).probe_due(health, "a")


def test_good_probes_in_a_row_readmit_a_slow_route(clock: Clock) -> None:
    health = RouteHealth(clock=clock, probe_interval=1.0, recovery_probes=2)
    answered(health, clock, "a", 5.0)
    answered(health, clock, "b", 0.1)
    answered(health, clock, "c", 0.1)
    assert health.judge("abc").outliers == {"a"}
    for _ in range(2):
        clock.advance(1.0)
        assert health.judge("abc").probe_due(health, "a")
        ticket = health.attempt_started("a", probe=True)
        clock.advance(0.08)
        ticket.first_update()
        ticket.ended("completed")
    assert health.stats("a").latency == pytest.approx(0.08)
    assert health.judge("abc").outliers == set()


def test_an_attempt_cut_for_time_is_latency_not_a_failure(clock: Clock) -> None:
    health = RouteHealth(clock=clock)
    failed(health, clock, "a", AttemptTimeoutError(), wait=3.0)
    stats = health.stats("a")
    assert stats.latency == pytest.approx(3.0) and stats.failure_ratio == 0.0
    assert not counts_against_route(AttemptTimeoutError())


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="outlier_latency_ratio"):
        HealthSettings(outlier_latency_ratio=1.0)
    with pytest.raises(ValueError, match="latency_decay"):
        RouteHealth(latency_decay=0)


def test_counts_against_route_is_the_deployment_failure_rule() -> None:
    assert counts_against_route(TransientProviderError())
    assert counts_against_route(QuotaExhaustedError())
    assert not counts_against_route(RequestInvalidError())
