"""A scripted run that makes every metric of the library move, for the dashboard checks.

`run_phase`: primary fails behind a circuit breaker (which opens on the first failure: a
state change), backup answers after `BACKUP_DELAY` with token usage and a price (cost), then
fails one request before output (the last route: a terminal failure, which is no fallback),
and a third route fails after its first chunk (a committed failure). Half the routed
requests are streamed (time to first chunk). Each call of `run_phase` builds fresh
pipelines (a fresh breaker) on the given providers, so two phases move every counter twice;
a spend ledger records their attempts (priced by the routes' prices; the third route's
unpriced).

`FleetRun`: a balanced router over a fleet of three scripted deployments, one fast, one
that answers 429 with ``Retry-After`` (a cooldown, a failure ratio) and one slow, so the
route health gauges and the cooldown counter move. Its `RouteHealth` lives as long as the
run (gauges are read from it at every collection) and reads a fake clock that only the
scripted waits move: its latency estimates are the scripted delays exactly.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from middleware.routing import Route, RouteHealth
from middleware.routing.context import Price
from pipeline import ChatPipeline
from pipeline.errors import RateLimitedError, TransientProviderError
from pipeline.spend import SpendLedger, SpendRecord, SQLiteSpendStore
from pipeline.testing import ScriptedChatClient, collect, fail, fail_after, hang, reply
from pipeline.types import UsageDetails

BACKUP_DELAY = 0.05  # the backup's scripted time to first update, in seconds
ROUTED_REQUESTS = 4  # per phase, through primary -> backup
# + the terminal failure (primary, then backup) + the committed failure's single attempt
# + the response cache's miss (its hit makes no attempt)
ATTEMPTS_PER_PHASE = ROUTED_REQUESTS * 2 + 2 + 1 + 1


def _cached_pipeline(providers: dict[str, Any]) -> ChatPipeline:
    answer = reply(
        "an answer",
        chunks=["an ", "answer"],
        delay=BACKUP_DELAY,
        usage=UsageDetails(input_tokens=12, output_tokens=40, total_tokens=52),
    )
    backup = ScriptedChatClient(answer, name="backup", model_id="small-model")
    return (
        ChatPipeline.builder()
        .use_telemetry(**providers)
        .use_cache(meter_provider=providers["meter_provider"])
        .use_ordered_failover([Route("backup", backup, price=Price(0.5, 1.5))], **providers)
        .build()
    )


def _pipelines(providers: dict[str, Any], ledger: SpendLedger) -> tuple[ChatPipeline, ChatPipeline]:
    primary = (
        ChatPipeline.builder()
        .use_circuit_breaker(
            fail_max=1,
            reset_timeout=3600,
            name="primary",
            meter_provider=providers["meter_provider"],
        )
        .build(ScriptedChatClient(fail(TransientProviderError()), name="primary"))
    )
    answer = reply(
        "an answer",
        chunks=["an ", "answer"],
        delay=BACKUP_DELAY,
        usage=UsageDetails(input_tokens=12, output_tokens=40, total_tokens=52),
    )
    backup = ScriptedChatClient(
        [*[answer] * ROUTED_REQUESTS, fail(TransientProviderError())],
        name="backup",
        model_id="small-model",
    )
    routed = (
        ChatPipeline.builder()
        .use_telemetry(**providers)
        .use_spend(ledger, attribution={"team": "e2e", "key_name": "library"})
        .use_ordered_failover(
            [
                Route("primary", primary, price=Price(5.0, 15.0)),
                Route("backup", backup, price=Price(0.5, 1.5)),
            ],
            **providers,
        )
        .build()
    )
    flaky_client = ScriptedChatClient(
        fail_after(["partial "], TransientProviderError()), name="flaky", model_id="flaky-model"
    )
    flaky = (
        ChatPipeline.builder()
        .use_telemetry(**providers)
        .use_spend(ledger)  # a scripted route no price book knows: unpriced
        .use_ordered_failover([Route("flaky", flaky_client)], **providers)
        .build()
    )
    return routed, flaky


async def run_phase(*, meter_provider: Any, tracer_provider: Any) -> None:
    """One phase of the run; asserts what the caller saw."""
    providers = {"meter_provider": meter_provider, "tracer_provider": tracer_provider}
    ledger = SpendLedger(
        SQLiteSpendStore(Path(tempfile.mkdtemp(prefix="e2e-spend-")) / "spend.db"),
        meter_provider=meter_provider,
    )
    routed, flaky = _pipelines(providers, ledger)
    async with routed, flaky:
        for index in range(ROUTED_REQUESTS):
            result = await collect(routed, "question", streaming=index % 2 == 0)
            assert result.error is None and result.text == "an answer", result
        # The last route fails too: nowhere left to fall back to.
        failed = await collect(routed, "question", streaming=False)
        assert isinstance(failed.error, TransientProviderError), failed
        # Output reached the caller before the failure: no failover, a committed failure.
        failed = await collect(flaky, "question", streaming=True)
        assert isinstance(failed.error, TransientProviderError), failed
        assert [u.text for u in failed.updates] == ["partial "]
    await ledger.aclose()  # writes the phase's records (the written counter)
    await _ledger_down(meter_provider)
    # A response cache in front of a priced route: a miss, then a hit (a saved cost).
    cached = _cached_pipeline(providers)
    async with cached:
        for streaming in (False, True):
            result = await collect(cached, "a cached question", streaming=streaming)
            assert result.error is None and result.text == "an answer", result


class _DownStore:
    """A spend database that takes nothing: every write fails, as a stopped server's."""

    async def write(self, records: Sequence[SpendRecord]) -> None:
        raise ConnectionRefusedError("the spend database is down")

    async def summary(self, *args: Any, **kwargs: Any) -> list[Any]:
        raise ConnectionRefusedError("the spend database is down")

    async def records(self, *args: Any, **kwargs: Any) -> list[SpendRecord]:
        raise ConnectionRefusedError("the spend database is down")

    async def aclose(self) -> None:
        return None


SPOOLED_PER_PHASE = 1  # the down ledger's queue holds one record: spooled at its close
DROPPED_PER_PHASE = 2  # the records beyond its queue


async def _ledger_down(meter_provider: Any) -> None:
    """A ledger whose database is down and whose queue is full: records are dropped
    (``queue_full``) and, at its close, spooled (the spooled and dropped counters)."""
    down = SpendLedger(
        _DownStore(),
        spool=tempfile.mkdtemp(prefix="e2e-spool-"),
        max_queue=SPOOLED_PER_PHASE,
        meter_provider=meter_provider,
    )
    now = datetime.now(UTC)
    down.record(
        SpendRecord(f"e2e-down-{index}", now, None, 1, "down", None, None, None, cost=Decimal(0))
        for index in range(SPOOLED_PER_PHASE + DROPPED_PER_PHASE)
    )
    assert (down.queued, down.dropped) == (SPOOLED_PER_PHASE, DROPPED_PER_PHASE)
    await down.aclose()
    assert down.spooled == SPOOLED_PER_PHASE


# -- a balanced fleet -------------------------------------------------------------------------

FAST = 0.02  # east's time to first update, in seconds of the fleet's fake clock
SLOW = 0.5  # central's
WEST_RETRY_AFTER = 30.0  # west's every answer: 429, Retry-After this many seconds
FLEET_REQUESTS = 8  # per phase
HEDGE_DELAY = 0.01  # seconds (real ones: the hung route never answers) before the hedge
# Between phases the clock moves past west's cooldown and the time its failures decay over,
# so each phase tries west again (a new cooldown each phase).
BETWEEN_PHASES = 60.0


class FakeClock:
    """Monotonic seconds that move only when a scripted client waits (its `sleep`)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


class FleetRun:
    """Phases of requests through a balanced router (round robin, so every route is tried
    whatever the estimates say) over ``east`` (answers after `FAST`), ``west`` (429 with
    ``Retry-After``) and ``central`` (answers after `SLOW`); every request is answered."""

    def __init__(self, *, meter_provider: Any, tracer_provider: Any) -> None:
        self.providers = {"meter_provider": meter_provider, "tracer_provider": tracer_provider}
        self.clock = FakeClock()
        self.health = RouteHealth(clock=self.clock, meter_provider=meter_provider)
        self.attempts = 0  # over every phase so far

    async def phase(self) -> dict[str, int]:
        """One phase; the calls each route got in it (asserting every route got some)."""
        self.clock.now += BETWEEN_PHASES
        sleep = self.clock.sleep
        answer = "an answer"
        clients = {
            "east": ScriptedChatClient(reply(answer, delay=FAST), name="east", sleep=sleep),
            "west": ScriptedChatClient(
                fail(RateLimitedError("busy", retry_after=WEST_RETRY_AFTER)),
                name="west",
                sleep=sleep,
            ),
            "central": ScriptedChatClient(reply(answer, delay=SLOW), name="central", sleep=sleep),
        }
        chat = (
            ChatPipeline.builder()
            .use_telemetry(**self.providers)
            .use_balanced_failover(
                [Route(name, client) for name, client in clients.items()],
                strategy="round_robin",
                health=self.health,
                **self.providers,
            )
            .build()
        )
        async with chat:
            for index in range(FLEET_REQUESTS):
                result = await collect(chat, "question", streaming=index % 2 == 0)
                assert result.error is None and result.text == answer, result
        calls = {name: client.call_count for name, client in clients.items()}
        assert all(calls.values()), f"a route got no attempt in this phase: {calls}"
        self.attempts += sum(calls.values())
        await self._hedged()
        return calls

    async def _hedged(self) -> None:
        """One request through a hedging router that starts on a hung ``central`` and hedges
        on ``east``, which wins (route health of its own: the fleet's gauges stay the
        balanced router's)."""
        hung = ScriptedChatClient(hang(), name="central")
        fast = ScriptedChatClient(reply("hedged answer"), name="east")
        chat = (
            ChatPipeline.builder()
            .use_telemetry(**self.providers)
            .use_hedging(
                [Route("central", hung), Route("east", fast)],
                strategy="round_robin",
                delay=HEDGE_DELAY,
                health=RouteHealth(outlier_latency_gap=1000.0, outlier_failure_gap=1.0),
                **self.providers,
            )
            .build()
        )
        async with chat:
            result = await collect(chat, "question", streaming=True)
        assert result.error is None and result.text == "hedged answer", result
        assert (hung.call_count, fast.call_count) == (1, 1)
        self.attempts += 2


# Dashboard series no run here makes yet, by metric: a query that reads one is expected to
# answer nothing (the dashboard suites mark it so, strictly: once a run makes the series,
# the mark must go).
NO_HEDGES = "the fleet gateway runs a balanced router, no hedges"
_LEDGER_HEALTHY = "the e2e gateways' spend databases never fail: nothing is spooled or dropped"
AWAITING: dict[str, dict[str, str]] = {
    "gateway": {
        "chat_pipeline_spend_spooled_total": _LEDGER_HEALTHY,
        "chat_pipeline_spend_dropped_total": _LEDGER_HEALTHY,
        "chat_pipeline_route_hedges_started_total": NO_HEDGES,
        "chat_pipeline_route_hedges_won_total": NO_HEDGES,
        "chat_pipeline_cache_lookups_total": "the e2e gateways run no response cache",
        "chat_pipeline_cache_saved_cost_total": "the e2e gateways run no response cache",
    },
}


def awaiting(query: str, source: str = "library") -> str | None:
    """Why `query` cannot answer from `source` (see `AWAITING`), or None."""
    return next((why for metric, why in AWAITING.get(source, {}).items() if metric in query), None)
