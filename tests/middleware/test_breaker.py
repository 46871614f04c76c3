import asyncio
import logging
import subprocess
import sys
import textwrap
import threading
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pybreaker
import pytest
import redis.asyncio as redis_asyncio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from middleware.breaker import (
    STATE_CHANGE_EVENT,
    STATE_CHANGE_METRIC,
    BreakerSettings,
    CircuitBreakerChatClient,
)
from middleware.routing import OrderedFailoverChatClient, Route
from pipeline import ChatPipeline
from pipeline.errors import (
    CircuitOpenError,
    ContentFilteredError,
    RequestInvalidError,
    TransientProviderError,
)
from pipeline.testing import (
    ScriptedChatClient,
    ScriptStep,
    collect,
    fail,
    fail_after,
    hang,
    reply,
)
from tests.middleware.breaker_replica import Burst, Clock, replica
from tests.middleware.remote_replica import remote
from tests.otel import Otel
from tests.redis_server import RedisServer, free_port


class FakeNow:
    def __init__(self) -> None:
        self.value = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.value

    def advance(self, seconds: float) -> None:
        self.value += timedelta(seconds=seconds)


def breaker(
    inner: ScriptedChatClient, now: FakeNow | None = None, **options: object
) -> CircuitBreakerChatClient:
    changes: list[tuple[str, str, str]] = []
    if "redis" in options:
        # Generous: a loaded test machine must not make Redis look down (then each breaker
        # decides alone), except in the tests about a slow Redis, which set their own.
        options.setdefault("redis_timeout", 5)
    fake = now or FakeNow()
    client = CircuitBreakerChatClient(
        inner,
        # One fake time drives the three clocks (`clock_steps` tests them apart).
        now=fake,
        clock=lambda: fake().timestamp(),
        redis_clock=lambda: fake().timestamp(),
        on_state_change=lambda *change: changes.append(change),
        **options,  # type: ignore[arg-type]
    )
    client.changes = changes  # type: ignore[attr-defined]
    return client


async def test_opens_after_fail_max_and_then_fails_fast(streaming: bool) -> None:
    inner = ScriptedChatClient(lambda m, o: fail(TransientProviderError()), name="p")
    client = breaker(inner, fail_max=3, name="p")
    for _ in range(3):
        result = await collect(client, "hi", streaming=streaming)
        assert isinstance(result.error, TransientProviderError)
    assert client.state == "open"
    result = await collect(client, "hi", streaming=streaming)
    assert isinstance(result.error, CircuitOpenError)
    assert inner.call_count == 3
    assert client.changes == [("p", "closed", "open")]  # type: ignore[attr-defined]


async def test_an_open_breakers_error_says_when_it_lets_a_probe_through(
    streaming: bool,
) -> None:
    now = FakeNow()
    inner = ScriptedChatClient(lambda m, o: fail(TransientProviderError()), name="p")
    client = breaker(inner, now, fail_max=1, reset_timeout=30, name="p")
    await collect(client, "hi", streaming=streaming)
    now.advance(12)
    result = await collect(client, "hi", streaming=streaming)
    assert isinstance(result.error, CircuitOpenError)
    assert result.error.retry_after == pytest.approx(18)  # a gateway's Retry-After


@pytest.mark.parametrize("error", [RequestInvalidError(status_code=400), ContentFilteredError()])
async def test_request_errors_do_not_count(streaming: bool, error: Exception) -> None:
    inner = ScriptedChatClient(
        [fail(TransientProviderError()), fail(error), fail(TransientProviderError())]
    )
    client = breaker(inner, fail_max=2)
    for _ in range(3):
        await collect(client, "hi", streaming=streaming)
    # The request error in between reset the consecutive count.
    assert client.state == "closed"


async def test_caller_cancellation_does_not_count(streaming: bool) -> None:
    inner = ScriptedChatClient(hang())
    client = breaker(inner, fail_max=1)
    task = asyncio.create_task(collect(client, "hi", streaming=streaming))
    await inner.wait_for_calls(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.state == "closed"
    assert client.breaker.fail_counter == 0


async def test_failure_after_streamed_output_counts() -> None:
    inner = ScriptedChatClient(fail_after(["partial"], TransientProviderError()))
    client = breaker(inner, fail_max=1)
    result = await collect(client, "hi", streaming=True)
    assert isinstance(result.error, TransientProviderError)
    assert [u.text for u in result.updates] == ["partial"]
    assert client.state == "open"


async def test_abandoned_stream_counts_as_nothing() -> None:
    inner = ScriptedChatClient(reply("ab", chunks=["a", "b"]))
    client = breaker(inner, fail_max=1)
    stream = client.get_streaming_response("hi")
    await anext(stream)
    await stream.aclose()
    assert client.state == "closed" and inner.streams_abandoned == 1


async def test_half_open_probe_closes_on_success(streaming: bool) -> None:
    now = FakeNow()
    inner = ScriptedChatClient([fail(TransientProviderError()), reply("recovered")], name="p")
    client = breaker(inner, now, fail_max=1, reset_timeout=30, name="p")
    await collect(client, "hi", streaming=streaming)
    assert client.state == "open"
    now.advance(29)
    assert isinstance((await collect(client, "hi", streaming=streaming)).error, CircuitOpenError)
    now.advance(2)
    assert (await collect(client, "hi", streaming=streaming)).text == "recovered"
    assert client.state == "closed"
    assert client.changes == [  # type: ignore[attr-defined]
        ("p", "closed", "open"),
        ("p", "open", "half-open"),
        ("p", "half-open", "closed"),
    ]
    assert inner.call_count == 2


async def test_a_success_between_failures_starts_the_count_again(streaming: bool) -> None:
    # A closed breaker's success takes a short path only when no failure is counted.
    transient = fail(TransientProviderError())
    inner = ScriptedChatClient([transient, reply("ok"), transient, reply("ok"), transient])
    client = breaker(inner, fail_max=2)
    outcomes = [(await collect(client, "hi", streaming=streaming)).error for _ in range(5)]
    assert [type(e).__name__ if e else None for e in outcomes] == [
        "TransientProviderError",
        None,
        "TransientProviderError",
        None,
        "TransientProviderError",
    ]
    assert client.state == "closed" and client.breaker.fail_counter == 1


async def test_a_listener_added_to_the_breaker_hears_every_success(streaming: bool) -> None:
    heard: list[str] = []

    class Successes(pybreaker.CircuitBreakerListener):
        def success(self, cb: pybreaker.CircuitBreaker) -> None:
            heard.append(cb.name)

    client = breaker(ScriptedChatClient([reply("a"), reply("b")]), name="p")
    client.breaker.add_listener(Successes())
    for _ in range(2):
        assert (await collect(client, "hi", streaming=streaming)).error is None
    assert heard == ["p", "p"]


async def test_half_open_probe_failure_reopens(streaming: bool) -> None:
    now = FakeNow()
    inner = ScriptedChatClient(lambda m, o: fail(TransientProviderError()))
    client = breaker(inner, now, fail_max=1, reset_timeout=30)
    await collect(client, "hi", streaming=streaming)
    now.advance(31)
    result = await collect(client, "hi", streaming=streaming)
    assert isinstance(result.error, TransientProviderError)
    assert client.state == "open"
    assert isinstance((await collect(client, "hi", streaming=streaming)).error, CircuitOpenError)
    assert inner.call_count == 2


async def test_only_one_probe_at_a_time(streaming: bool) -> None:
    now = FakeNow()
    inner = ScriptedChatClient([fail(TransientProviderError()), hang(), reply("ok")])
    client = breaker(inner, now, fail_max=1, reset_timeout=1)
    await collect(client, "hi", streaming=streaming)
    now.advance(2)
    probe = asyncio.create_task(collect(client, "hi", streaming=streaming))
    await inner.wait_for_calls(2)
    second = await collect(client, "hi", streaming=streaming)
    assert isinstance(second.error, CircuitOpenError)
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe
    # The cancelled probe released its slot: the next call probes and closes the circuit.
    assert (await collect(client, "hi", streaming=streaming)).text == "ok"
    assert client.state == "closed"


async def test_open_circuit_fails_over_in_microseconds(streaming: bool) -> None:
    primary = ScriptedChatClient(lambda m, o: fail(TransientProviderError()), name="primary")
    backup = ScriptedChatClient(reply("backup"), name="backup")
    guarded = ChatPipeline.builder().use_circuit_breaker(fail_max=2).build(primary)
    router = OrderedFailoverChatClient([Route("primary", guarded), Route("backup", backup)])
    for _ in range(5):
        assert (await collect(router, "hi", streaming=streaming)).text == "backup"
    assert primary.call_count == 2
    assert backup.call_count == 5


async def test_retry_breaker_failover_never_exceed_max_attempts(streaming: bool) -> None:
    async def no_sleep(_: float) -> None:
        return None

    primary = ScriptedChatClient(lambda m, o: fail(TransientProviderError()), name="primary")
    backup = ScriptedChatClient(reply("backup"), name="backup")
    route = (
        ChatPipeline.builder()
        .use_circuit_breaker(fail_max=100)
        .use_retry(max_attempts=3, sleep=no_sleep)
        .build(primary)
    )
    router = OrderedFailoverChatClient([Route("primary", route), Route("backup", backup)])
    for request in range(1, 6):
        before = primary.call_count
        assert (await collect(router, "hi", streaming=streaming)).text == "backup"
        assert primary.call_count - before <= 3, request


async def test_state_changes_are_span_events() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    client = breaker(ScriptedChatClient(fail(TransientProviderError())), fail_max=1, name="p")
    with provider.get_tracer("t").start_as_current_span("request"):
        await collect(client, "hi", streaming=False)
    (span,) = exporter.get_finished_spans()
    assert [(e.name, dict(e.attributes or {})) for e in span.events] == [
        (
            STATE_CHANGE_EVENT,
            {
                "chat_pipeline.circuit_breaker.name": "p",
                "chat_pipeline.circuit_breaker.from": "closed",
                "chat_pipeline.circuit_breaker.to": "open",
                "chat_pipeline.circuit_breaker.reason": "fail_max",
            },
        )
    ]


def test_options_are_validated_where_written() -> None:
    with pytest.raises(ValueError, match="fail_max must be at least 1"):
        ChatPipeline.builder().use_circuit_breaker(fail_max=0)
    with pytest.raises(ValueError, match="reset_timeout must be positive"):
        ChatPipeline.builder().use_circuit_breaker(reset_timeout=0)
    with pytest.raises(TypeError, match="counts"):
        CircuitBreakerChatClient(ScriptedChatClient(), counts=3)  # type: ignore[arg-type]


# -- ratio policies ------------------------------------------------------------------------


def sleeping_on(now: FakeNow) -> Callable[[float], Awaitable[None]]:
    """A `sleep` for `ScriptedChatClient` that moves the fake clock instead of waiting, so a
    scripted delay is a call's duration as the breaker sees it."""

    async def sleep(seconds: float) -> None:
        now.advance(seconds)

    return sleep


def ratio_breaker(
    steps: list[ScriptStep], now: FakeNow, **options: object
) -> tuple[CircuitBreakerChatClient, ScriptedChatClient]:
    inner = ScriptedChatClient(steps, name="p", repeat_last=False, sleep=sleeping_on(now))
    options.setdefault("fail_max", 1000)  # the consecutive count never opens it here
    return breaker(inner, now, name="p", **options), inner


F = fail(TransientProviderError())
OK = reply("ok")


async def run(client: CircuitBreakerChatClient, calls: int, streaming: bool) -> list[str]:
    """`calls` requests in a row; each one's error type, or its text."""
    results = []
    for _ in range(calls):
        result = await collect(client, "hi", streaming=streaming)
        results.append(type(result.error).__name__ if result.error else result.text)
    return results


async def test_failure_ratio_opens_at_minimum_calls_not_one_call_earlier(
    streaming: bool,
) -> None:
    now = FakeNow()
    # 5 failures in 9 calls (never 2 in a row): above the ratio, below minimum_calls.
    steps = [F, OK, F, OK, F, OK, F, OK, F, OK]
    client, inner = ratio_breaker(steps, now, failure_ratio=0.5, minimum_calls=10)
    await run(client, 9, streaming)
    assert client.state == "closed"
    # The tenth call succeeds, and brings the window to minimum_calls at exactly the
    # ratio (5 of 10): it opens the circuit.
    assert await run(client, 1, streaming) == ["ok"]
    assert client.state == "open"
    assert await run(client, 1, streaming) == ["CircuitOpenError"]
    assert inner.call_count == 10
    assert client.changes == [("p", "closed", "open")]  # type: ignore[attr-defined]


async def test_below_the_failure_ratio_the_circuit_stays_closed(streaming: bool) -> None:
    now = FakeNow()
    steps = [OK, OK, F, OK, F] * 10  # 2 failures in every 5 calls: never 0.45 or more
    client, inner = ratio_breaker(steps, now, failure_ratio=0.5, minimum_calls=5)
    results = await run(client, 50, streaming)
    assert results.count("TransientProviderError") == 20 and results.count("ok") == 30
    assert client.state == "closed" and inner.call_count == 50


@pytest.mark.parametrize(("later", "opens"), [(9.5, True), (10.0, False)])
async def test_the_window_slides(streaming: bool, later: float, opens: bool) -> None:
    now = FakeNow()  # on a whole second: a bucket (of window / 10) starts now
    client, inner = ratio_breaker([F] * 7, now, failure_ratio=0.5, minimum_calls=4, window=10)
    await run(client, 3, streaming)
    now.advance(later)
    await run(client, 1, streaming)
    # Still in the window, the three earlier failures make four: open. A window later,
    # they have left it: one call, closed.
    assert client.state == ("open" if opens else "closed")
    if not opens:
        now.advance(0.5)
        await run(client, 2, streaming)
        assert client.state == "closed"  # three calls in the window
        await run(client, 1, streaming)
        assert client.state == "open"  # the fourth
        assert inner.call_count == 7


def slow(seconds: float) -> ScriptStep:
    return reply("slow", delay=seconds)


async def test_slow_calls_open_the_circuit(streaming: bool) -> None:
    now = FakeNow()
    # Slow means slower than slow_call_duration: 2.0 s exactly is not.
    steps = [OK, slow(2.0), slow(2.5), OK, slow(3.0), OK]
    client, inner = ratio_breaker(
        steps, now, slow_call_duration=2.0, slow_call_ratio=0.4, minimum_calls=5
    )
    # Every call succeeds; two of the first four are slow (below minimum_calls).
    assert await run(client, 4, streaming) == ["ok", "slow", "slow", "ok"]
    assert client.state == "closed"
    # The fifth is slow too: 3 of 5 >= 0.4 (2 of 5 would have been enough).
    assert await run(client, 1, streaming) == ["slow"]
    assert client.state == "open"
    assert await run(client, 1, streaming) == ["CircuitOpenError"]
    assert inner.call_count == 5


async def test_a_slow_failure_is_slow_and_failed(streaming: bool) -> None:
    now = FakeNow()
    slow_failure = fail(TransientProviderError(), delay=5)
    client, _ = ratio_breaker(
        [OK, slow_failure], now, slow_call_duration=1.0, slow_call_ratio=0.5, minimum_calls=2
    )
    await run(client, 2, streaming)
    assert client.state == "open"  # 1 of 2 slow (and 1 of 2 failed: no failure_ratio set)


async def test_a_stream_is_slow_to_start_not_slow_to_finish(streaming: bool) -> None:
    now = FakeNow()
    # First update at once, then 5 s to the second: get_response takes 5 s (slow); the
    # stream's first update took no time (not slow).
    long_to_finish = reply("ab", chunks=["a", "b"], chunk_delay=5)
    client, _ = ratio_breaker(
        [long_to_finish] * 3, now, slow_call_duration=1.0, slow_call_ratio=0.5, minimum_calls=3
    )
    assert await run(client, 3, streaming) == ["ab"] * 3
    assert client.state == ("closed" if streaming else "open")
    # Long to start is slow either way, and so is a stream that ends without an update.
    for step in (reply("late", chunks=["la", "te"], delay=5), fail(RequestInvalidError(), delay=5)):
        client, _ = ratio_breaker(
            [step] * 3, now, slow_call_duration=1.0, slow_call_ratio=0.5, minimum_calls=3
        )
        await run(client, 3, streaming)
        assert client.state == "open"


async def test_request_errors_are_calls_that_did_not_fail(streaming: bool) -> None:
    now = FakeNow()
    invalid = fail(RequestInvalidError(status_code=400))
    client, _ = ratio_breaker([invalid] * 10, now, failure_ratio=0.1, minimum_calls=2)
    assert await run(client, 10, streaming) == ["RequestInvalidError"] * 10
    assert client.state == "closed"
    # They are calls: one failure among the ten is below 0.1 of eleven.
    client, _ = ratio_breaker([*[invalid] * 10, F], now, failure_ratio=0.1, minimum_calls=2)
    await run(client, 11, streaming)
    assert client.state == "closed"


async def test_cancelled_calls_are_not_calls(streaming: bool) -> None:
    now = FakeNow()
    client, inner = ratio_breaker([F, hang(), F], now, failure_ratio=0.5, minimum_calls=2)
    await run(client, 1, streaming)
    task = asyncio.create_task(collect(client, "hi", streaming=streaming))
    await inner.wait_for_calls(2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Had the cancelled call counted as a success, 1 failure in 2 calls would have opened.
    assert client.state == "closed"
    await run(client, 1, streaming)
    assert client.state == "open"


async def test_abandoned_streams_are_not_calls() -> None:
    now = FakeNow()
    two = reply("ab", chunks=["a", "b"])
    client, _ = ratio_breaker([F, two, F], now, failure_ratio=0.5, minimum_calls=2)
    await run(client, 1, streaming=True)
    stream = client.get_streaming_response("hi")
    await anext(stream)
    await stream.aclose()
    assert client.state == "closed"
    await run(client, 1, streaming=True)
    assert client.state == "open"


async def test_after_a_ratio_opening_the_probe_closes_and_the_window_starts_empty(
    streaming: bool,
) -> None:
    now = FakeNow()
    steps = [F, F, F, OK, F, OK, F]
    client, inner = ratio_breaker(steps, now, failure_ratio=0.5, minimum_calls=3, reset_timeout=30)
    await run(client, 3, streaming)
    assert client.state == "open"
    now.advance(29)
    assert await run(client, 1, streaming) == ["CircuitOpenError"]
    now.advance(2)
    assert await run(client, 1, streaming) == ["ok"]  # the probe
    assert client.state == "closed"
    # The three failures from before are gone, and the probe is not in the new window:
    # 2 failures in 3 calls only now reach minimum_calls.
    await run(client, 2, streaming)
    assert client.state == "closed"
    await run(client, 1, streaming)
    assert client.state == "open"
    assert inner.call_count == 7
    assert client.changes == [  # type: ignore[attr-defined]
        ("p", "closed", "open"),
        ("p", "open", "half-open"),
        ("p", "half-open", "closed"),
        ("p", "closed", "open"),
    ]


async def test_a_failed_or_slow_probe_opens_again(streaming: bool) -> None:
    now = FakeNow()
    steps = [slow(5), slow(5), F, slow(5), OK]
    client, inner = ratio_breaker(
        steps, now, slow_call_duration=1.0, minimum_calls=2, reset_timeout=30
    )
    await run(client, 2, streaming)
    assert client.state == "open"
    now.advance(31)
    await run(client, 1, streaming)  # the probe fails
    assert client.state == "open"
    now.advance(31)
    assert await run(client, 1, streaming) == ["slow"]  # succeeds, but slowly
    assert client.state == "open"
    assert await run(client, 1, streaming) == ["CircuitOpenError"]
    now.advance(31)
    assert await run(client, 1, streaming) == ["ok"]
    assert client.state == "closed" and inner.call_count == 5


async def test_the_opening_event_says_why(streaming: bool) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    now = FakeNow()
    client, _ = ratio_breaker(
        [F, OK, slow(3), slow(3)], now, failure_ratio=0.5, minimum_calls=2, reset_timeout=1,
        slow_call_duration=1.0,
    )  # fmt: skip
    with provider.get_tracer("t").start_as_current_span("request"):
        await run(client, 2, streaming)
        now.advance(2)
        await run(client, 1, streaming)  # a slow probe
    (span,) = exporter.get_finished_spans()
    opened = [
        (e.attributes or {}).get("chat_pipeline.circuit_breaker.reason")
        for e in span.events
        if (e.attributes or {}).get("chat_pipeline.circuit_breaker.to") == "open"
    ]
    assert opened == ["failure_ratio", "probe"]


def test_ratio_settings_are_validated() -> None:
    use = ChatPipeline.builder().use_circuit_breaker
    for name in ("failure_ratio", "slow_call_ratio"):
        with pytest.raises(ValueError, match=f"{name} must be positive"):
            use(**{name: 0, "slow_call_duration": 1.0})
        with pytest.raises(ValueError, match=f"{name} must be at most 1"):
            use(**{name: 1.5, "slow_call_duration": 1.0})
    with pytest.raises(ValueError, match="window must be positive"):
        use(failure_ratio=0.5, window=0)
    with pytest.raises(ValueError, match="slow_call_duration must be positive"):
        use(slow_call_duration=-1)
    with pytest.raises(ValueError, match="minimum_calls must be at least 1"):
        use(failure_ratio=0.5, minimum_calls=0)
    with pytest.raises(TypeError, match="minimum_calls must be an integer"):
        use(failure_ratio=0.5, minimum_calls=2.5)
    # A slow-call ratio without what makes a call slow would do nothing: an error.
    with pytest.raises(ValueError, match="slow_call_ratio: needs slow_call_duration"):
        use(slow_call_ratio=0.2)
    settings = BreakerSettings(slow_call_duration=2.0, slow_call_ratio=0.2)
    with pytest.raises(ValueError, match="slow_call_ratio: needs slow_call_duration"):
        settings.replace(slow_call_duration=None)
    # Copies carry what was given, not the defaults: these are fine.
    assert BreakerSettings.from_options(BreakerSettings(), {"fail_max": 3}).fail_max == 3
    use(settings, fail_max=3)
    assert settings.replace(failure_ratio=1.0).slow_call_ratio == 0.2


SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from pipeline import ChatPipeline
    from pipeline.errors import TransientProviderError
    from pipeline.testing import ScriptedChatClient, fail

    async def main() -> None:
        inner = ScriptedChatClient(lambda m, o: fail(TransientProviderError()))
        chat = ChatPipeline.builder().use_circuit_breaker(
            fail_max=2, reset_timeout=300, name=sys.argv[2], redis=sys.argv[1]
        ).build(inner)
        for _ in range(2):
            try:
                await chat.get_response("hi")
            except TransientProviderError:
                pass
        print(chat.client.state)

    asyncio.run(main())
    """
)


async def test_redis_breaker_is_shared_between_processes(
    redis_url: str, streaming: bool, request: pytest.FixtureRequest
) -> None:
    name = f"shared-{request.node.name}"
    tripped = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", SCRIPT, redis_url, name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert tripped.returncode == 0, tripped.stderr
    assert tripped.stdout.strip() == "open"
    inner = ScriptedChatClient(reply("never"))
    chat = (
        ChatPipeline.builder()
        .use_circuit_breaker(fail_max=2, reset_timeout=300, name=name, redis=redis_url)
        .build(inner)
    )
    result = await collect(chat, "hi", streaming=streaming)
    assert isinstance(result.error, CircuitOpenError)
    assert inner.call_count == 0


async def test_state_changes_are_counted(otel: Otel) -> None:
    inner = ScriptedChatClient(lambda m, o: fail(TransientProviderError()))
    client = CircuitBreakerChatClient(
        inner, fail_max=1, name="p", meter_provider=otel.meter_provider, now=FakeNow()
    )
    await collect(client, "hi", streaming=False)
    assert otel.points(STATE_CHANGE_METRIC) == [
        (
            {
                "chat_pipeline.circuit_breaker.name": "p",
                "chat_pipeline.circuit_breaker.from": "closed",
                "chat_pipeline.circuit_breaker.to": "open",
            },
            1,
        )
    ]


# -- shared through Redis ------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
# A fractional second: a breaker that kept its opening in whole seconds would reopen early.
T0 = datetime(2026, 1, 1, 0, 0, 0, 900_000, tzinfo=UTC)


def fake_now(start: datetime = T0) -> FakeNow:
    now = FakeNow()
    now.value = start
    return now


def breaker_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "chat_pipeline.breaker" and r.levelno == logging.WARNING
    ]


async def test_sub_second_open_time_is_shared(
    redis_url: str, streaming: bool, request: pytest.FixtureRequest
) -> None:
    name = f"subsecond-{request.node.name}"
    now = fake_now()
    client = redis_asyncio.Redis.from_url(redis_url)  # a client of the caller's own
    tripping = ScriptedChatClient([fail(TransientProviderError()), reply("again")])
    first = breaker(tripping, now, fail_max=1, reset_timeout=0.3, name=name, redis=client)
    await collect(first, "hi", streaming=streaming)
    assert first.state == "open"
    # Another replica, which never saw a failure, learns the opening from Redis to the ms.
    recovering = ScriptedChatClient(reply("recovered"))
    other = breaker(recovering, now, fail_max=1, reset_timeout=0.3, name=name, redis=redis_url)
    now.advance(0.29)
    assert isinstance((await collect(other, "hi", streaming=streaming)).error, CircuitOpenError)
    assert recovering.call_count == 0
    now.advance(0.02)
    assert (await collect(other, "hi", streaming=streaming)).text == "recovered"
    assert other.changes == [  # type: ignore[attr-defined]
        (name, "closed", "open"),
        (name, "open", "half-open"),
        (name, "half-open", "closed"),
    ]
    # The replica that tripped it hears that the probe closed it.
    assert (await collect(first, "hi", streaming=streaming)).text == "again"
    assert first.state == "closed"
    await first.aclose()
    await other.aclose()
    await client.aclose()


async def test_consecutive_failures_are_counted_across_replicas(
    redis_url: str, streaming: bool, request: pytest.FixtureRequest
) -> None:
    name = f"count-{request.node.name}"
    now = fake_now()
    failing = ScriptedChatClient(lambda m, o: fail(TransientProviderError()))
    healthy = ScriptedChatClient(lambda m, o: reply("ok"))
    a = breaker(failing, now, fail_max=3, name=name, redis=redis_url)
    b = breaker(healthy, now, fail_max=3, name=name, redis=redis_url)
    c = breaker(ScriptedChatClient(lambda m, o: fail(TransientProviderError())), now,
                fail_max=3, name=name, redis=redis_url)  # fmt: skip
    for each in (a, a):
        await collect(each, "hi", streaming=streaming)
    # A success anywhere resets the shared count: two more failures do not open it.
    assert (await collect(b, "hi", streaming=streaming)).text == "ok"
    for each in (c, a):
        await collect(each, "hi", streaming=streaming)
    assert (await collect(b, "hi", streaming=streaming)).text == "ok"
    # Three in a row, from two replicas, do; the third replica then fails fast.
    for each in (a, c, a):
        await collect(each, "hi", streaming=streaming)
    assert isinstance((await collect(b, "hi", streaming=streaming)).error, CircuitOpenError)
    assert healthy.call_count == 2
    for each in (a, b, c):
        await each.aclose()


async def test_exactly_one_half_open_probe_across_two_processes(
    redis_url: str, streaming: bool, request: pytest.FixtureRequest
) -> None:
    name = f"probe-{request.node.name}"
    tripper = breaker(
        ScriptedChatClient(fail(TransientProviderError())),
        fake_now(),
        fail_max=1,
        reset_timeout=30,
        name=name,
        redis=redis_url,
    )
    await collect(tripper, "hi", streaming=streaming)
    assert tripper.state == "open"
    await tripper.aclose()
    later = T0 + timedelta(seconds=31)  # both replicas' clocks: past the reset timeout
    burst_size = 20
    async with remote("tests.middleware.breaker_replica", redis_url, name, "1") as other:
        assert await other.ask(f"clock {later.isoformat()}") == ["ok"]
        client, inner = replica(redis_url, name, later)
        await other.send(f"burst {burst_size} ok {int(streaming)}")
        burst = Burst(client, inner, burst_size, streaming)  # both bursts race
        admitted_here, refused_here = await burst.settled()
        word, admitted, word2, refused = await other.read()
        assert (word, word2) == ("admitted", "refused")
        # Exactly one probe between the two processes; every other call failed fast.
        assert admitted_here + int(admitted) == 1
        assert refused_here + int(refused) == 2 * burst_size - 1
        await other.send("release")
        served_here = await burst.finish()
        word, served = await other.read()
        assert served_here + int(served) == 1
    # The probe's success closed the shared circuit: a third replica is let through.
    third, third_inner = replica(redis_url, name, later)
    third_inner.gate.set()
    assert (await collect(third, "hi", streaming=streaming)).text == "ok"
    assert third.state == "closed" and third_inner.calls == 1
    await client.aclose()
    await third.aclose()


IN_FLIGHT = 1000  # calls in flight in each of two replicas (redis-py's default pool: 100)


async def test_two_replicas_share_every_fact_with_1000_calls_in_flight_each(
    redis_url: str,
    streaming: bool,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    name = f"many-{request.node.name}"
    fail_max = IN_FLIGHT * 3 // 2  # crossed only by the two replicas' failures together
    clock = Clock(T0)
    later = T0 + timedelta(seconds=31)
    keys = redis_asyncio.Redis.from_url(redis_url)
    prefix = f"chat_pipeline:breaker:{{{name}}}"
    async with remote("tests.middleware.breaker_replica", redis_url, name, str(fail_max)) as other:
        assert await other.ask(f"clock {T0.isoformat()}") == ["ok"]
        client, inner = replica(redis_url, name, clock, fail_max)

        async def both(outcome: str) -> tuple[int, int, int]:
            """A burst in each replica at once; admitted, refused and served in total."""
            await other.send(f"burst {IN_FLIGHT} {outcome} {int(streaming)}")
            inner.expect(outcome)
            burst = Burst(client, inner, IN_FLIGHT, streaming)
            admitted, refused = await burst.settled()
            word, admitted_there, word2, refused_there = await other.read()
            assert (word, word2) == ("admitted", "refused")
            await other.send("release")
            served = await burst.finish()
            word, served_there = await other.read()
            return (
                admitted + int(admitted_there),
                refused + int(refused_there),
                served + int(served_there),
            )

        # 1. Closed: every call of both replicas is let through, and every failure of
        #    both counts in Redis (2,000 INCRs at once): the shared circuit opens once.
        assert await both("fail") == (2 * IN_FLIGHT, 0, 0)
        assert int(await keys.get(f"{prefix}:failures")) == 2 * IN_FLIGHT
        assert await keys.get(f"{prefix}:opened") is not None
        # 2. Past the reset timeout: exactly one half-open probe across both replicas for
        #    2,000 calls in flight; it is served, every other call fails fast.
        clock.now = later
        assert await other.ask(f"clock {later.isoformat()}") == ["ok"]
        assert await both("ok") == (1, 2 * IN_FLIGHT - 1, 1)
        state, warnings_here = await other.ask("state"), len(breaker_warnings(caplog))
    # The probe closed the shared circuit (and reset the count); Redis never looked down.
    assert await keys.get(f"{prefix}:opened") is None
    assert int(await keys.get(f"{prefix}:failures")) == 0
    assert state[3] == "0" and warnings_here == 0, "a healthy Redis reported unavailable"
    print(
        f"\nbreaker: 2 replicas x {IN_FLIGHT} calls in flight: {2 * IN_FLIGHT} failures "
        "counted, 1 probe, 0 Redis warnings"
    )
    await client.aclose()
    await keys.aclose()


async def test_a_cancelled_probe_gives_its_claim_back(
    redis_url: str, streaming: bool, request: pytest.FixtureRequest
) -> None:
    name = f"claim-{request.node.name}"
    now = fake_now()
    prober = ScriptedChatClient([fail(TransientProviderError()), hang()])
    other_inner = ScriptedChatClient(reply("ok"))
    a = breaker(prober, now, fail_max=1, reset_timeout=1, probe_claim_ttl=5, name=name,
                redis=redis_url)  # fmt: skip
    b = breaker(other_inner, now, fail_max=1, reset_timeout=1, name=name, redis=redis_url)
    await collect(a, "hi", streaming=streaming)
    now.advance(2)
    probe = asyncio.create_task(collect(a, "hi", streaming=streaming))
    await prober.wait_for_calls(2)
    # The other replica fails fast while the probe is out; the claim expires by itself.
    assert isinstance((await collect(b, "hi", streaming=streaming)).error, CircuitOpenError)
    redis = redis_asyncio.Redis.from_url(redis_url)
    prefix = f"chat_pipeline:breaker:{{{name}}}"
    claim = f"{prefix}:probe:{(await redis.get(f'{prefix}:opened')).decode()}"
    assert 0 < await redis.pttl(claim) <= 5000
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe
    assert await redis.exists(claim) == 0
    # So the other replica probes at once, and closes the circuit for both.
    assert (await collect(b, "hi", streaming=streaming)).text == "ok"
    assert b.state == "closed" and other_inner.call_count == 1
    await redis.aclose()
    await a.aclose()
    await b.aclose()


async def test_an_attempt_cut_for_time_opens_the_shared_breaker(
    redis_url: str, streaming: bool, request: pytest.FixtureRequest
) -> None:
    name = f"cut-{request.node.name}"
    primary = ScriptedChatClient([reply("warm"), hang()], name="primary")
    backup = ScriptedChatClient(lambda m, o: reply("backup"), name="backup")
    guarded = breaker(primary, fail_max=1, name=name, redis=redis_url)
    # Connected first, so the cut falls on the hanging call, not on reaching Redis (an
    # attempt cut before the deployment was called is no failure of the deployment).
    assert (await collect(guarded, "hi", streaming=streaming)).text == "warm"
    router = OrderedFailoverChatClient(
        [Route("primary", guarded), Route("backup", backup)], attempt_timeout=0.5
    )
    assert (await collect(router, "hi", streaming=streaming)).text == "backup"
    assert primary.call_count == 2 and guarded.state == "open"
    # The cut counted against the deployment in Redis: another replica skips it too.
    elsewhere = ScriptedChatClient(reply("never"))
    replica_breaker = breaker(elsewhere, name=name, redis=redis_url)
    result = await collect(replica_breaker, "hi", streaming=streaming)
    assert isinstance(result.error, CircuitOpenError) and elsewhere.call_count == 0
    await guarded.aclose()
    await replica_breaker.aclose()


async def test_a_paused_redis_does_not_stall_the_process(
    redis_server: RedisServer,
    streaming: bool,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    canary = "CANARY-breaker-prompt-5e"
    inner = ScriptedChatClient(lambda m, o: reply("ok"))
    client = CircuitBreakerChatClient(
        inner,
        name=f"paused-{request.node.name}",
        redis=redis_server.url,
        redis_timeout=0.2,
        redis_retry_interval=0,  # every call tries Redis: the worst case
    )
    assert (await collect(client, canary, streaming=streaming)).text == "ok"  # connected
    # Should the event loop block on Redis, this resumes it so the test fails, not hangs.
    resumed_by_watchdog = threading.Event()

    def watchdog() -> None:
        resumed_by_watchdog.set()
        redis_server.resume()

    timer = threading.Timer(30, watchdog)
    redis_server.pause()
    timer.start()
    try:
        call = asyncio.create_task(collect(client, canary, streaming=streaming))
        call_was_pending: list[bool] = []

        async def other_work() -> None:
            call_was_pending.append(not call.done())

        # Other work of the process runs while the call waits on Redis (a blocking Redis
        # call would hold the whole event loop until the watchdog resumed the server).
        await asyncio.create_task(other_work())
        result = await call
        later = await asyncio.gather(
            *(collect(client, canary, streaming=streaming) for _ in range(5))
        )
        # All served while Redis is still stopped: nothing waited for it to come back.
        assert redis_server.paused and not resumed_by_watchdog.is_set()
    finally:
        timer.cancel()
        redis_server.resume()
    assert call_was_pending == [True]
    assert result.text == "ok" and [r.text for r in later] == ["ok"] * 5
    (warning,) = breaker_warnings(caplog)
    assert "TimeoutError" in warning.getMessage()
    assert all(canary not in r.getMessage() for r in caplog.records)
    await client.aclose()


async def test_redis_down_at_build_time(
    streaming: bool, caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    inner = ScriptedChatClient(
        [reply("ok"), fail(TransientProviderError()), fail(TransientProviderError())]
    )
    chat = (
        ChatPipeline.builder()
        .use_circuit_breaker(fail_max=2, name=f"down-{request.node.name}", redis=url)
        .build(inner)
    )  # builds: Redis is not contacted until a call
    assert (await collect(chat, "hi", streaming=streaming)).text == "ok"
    for _ in range(2):
        error = (await collect(chat, "hi", streaming=streaming)).error
        assert isinstance(error, TransientProviderError)
    # This process's breaker still works: it opened on its own.
    assert isinstance((await collect(chat, "hi", streaming=streaming)).error, CircuitOpenError)
    assert inner.call_count == 3
    (warning,) = breaker_warnings(caplog)
    assert "ConnectionError" in warning.getMessage()
    await chat.aclose()


async def test_redis_down_mid_run_then_back(
    redis_server: RedisServer,
    streaming: bool,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    caplog.set_level(logging.INFO, logger="chat_pipeline.breaker")
    name = f"midrun-{request.node.name}"
    now = fake_now()
    healthy = ScriptedChatClient(lambda m, o: reply("ok"))
    failing = ScriptedChatClient(lambda m, o: fail(TransientProviderError()))
    options: dict[str, object] = {
        "fail_max": 2, "name": name, "redis": redis_server.url, "redis_retry_interval": 0
    }  # fmt: skip
    client = breaker(healthy, now, **options)
    peer = breaker(failing, now, **options)
    assert (await collect(client, "hi", streaming=streaming)).text == "ok"
    redis_server.stop()
    assert (await collect(client, "hi", streaming=streaming)).text == "ok"
    error = (await collect(peer, "hi", streaming=streaming)).error
    assert isinstance(error, TransientProviderError)  # the failure, never a Redis error
    assert len(breaker_warnings(caplog)) == 2  # one per breaker, per outage
    redis_server.start()  # back, on the same port, empty
    assert (await collect(client, "hi", streaming=streaming)).text == "ok"
    assert any("reachable again" in r.getMessage() for r in caplog.records)
    # Shared again: two failures of the peer open the circuit for the other replica too.
    for _ in range(2):
        await collect(peer, "hi", streaming=streaming)
    assert isinstance((await collect(client, "hi", streaming=streaming)).error, CircuitOpenError)
    await client.aclose()
    await peer.aclose()


@pytest.mark.parametrize(
    "url",
    ["nonsense", "http://user:s3cret@127.0.0.1:6379", "redis://:s3cret@[::1", "redis://h:99999"],
)
def test_a_malformed_redis_url_is_a_clear_error(url: str) -> None:
    with pytest.raises(ValueError, match="redis: must be a redis://") as raised:
        CircuitBreakerChatClient(ScriptedChatClient(), redis=url)
    assert "s3cret" not in str(raised.value)


def test_a_synchronous_redis_client_is_refused() -> None:
    import redis

    with pytest.raises(TypeError, match="would block the event loop"):
        CircuitBreakerChatClient(ScriptedChatClient(), redis=redis.Redis())
    with pytest.raises(TypeError, match=r"redis must be a URL or a redis\.asyncio client"):
        CircuitBreakerChatClient(ScriptedChatClient(), redis=3)


# -- ratio policies, shared through Redis ---------------------------------------------------


async def test_replicas_share_one_window(
    redis_url: str, streaming: bool, request: pytest.FixtureRequest
) -> None:
    name = f"window-{request.node.name}"
    now = fake_now()
    options: dict[str, object] = {
        "failure_ratio": 0.5, "minimum_calls": 4, "window": 10, "fail_max": 1000,
        "reset_timeout": 30, "name": name, "redis": redis_url,
    }  # fmt: skip
    failing = ScriptedChatClient(lambda m, o: fail(TransientProviderError()))
    healthy = ScriptedChatClient(lambda m, o: reply("ok"))
    a = breaker(failing, now, **options)
    b = breaker(healthy, now, **options)
    for each in (a, b, a):
        await collect(each, "hi", streaming=streaming)
    assert a.state == b.state == "closed"  # 3 calls in the shared window
    # The fourth call, a success on the replica that never saw a failure, brings the
    # shared window to minimum_calls with 2 of 4 failed: it opens, for both.
    assert (await collect(b, "hi", streaming=streaming)).text == "ok"
    assert b.state == "open"
    assert isinstance((await collect(a, "hi", streaming=streaming)).error, CircuitOpenError)
    assert (failing.call_count, healthy.call_count) == (2, 2)
    assert b.changes == [(name, "closed", "open")]  # type: ignore[attr-defined]
    # The probe closes it, and the shared window starts empty.
    now.advance(31)
    assert (await collect(b, "hi", streaming=streaming)).text == "ok"
    redis = redis_asyncio.Redis.from_url(redis_url)
    assert await redis.exists(f"chat_pipeline:breaker:{{{name}}}:window") == 0
    for _ in range(3):
        await collect(a, "hi", streaming=streaming)
    assert a.state == "closed"  # 3 failures: below minimum_calls
    # A window later they are gone: three more failures are not enough either.
    now.advance(10)
    for _ in range(3):
        await collect(a, "hi", streaming=streaming)
    assert a.state == "closed"
    assert (await collect(b, "hi", streaming=streaming)).text == "ok"  # 3 of 4 failed
    assert b.state == "open"
    assert isinstance((await collect(a, "hi", streaming=streaming)).error, CircuitOpenError)
    await redis.aclose()
    await a.aclose()
    await b.aclose()


async def test_two_replicas_open_one_window_together_with_1000_calls_in_flight_each(
    redis_url: str,
    streaming: bool,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    name = f"window-many-{request.node.name}"
    # More calls than one replica makes: neither can open it alone.
    minimum_calls = IN_FLIGHT * 3 // 2
    fail_max = 10 * IN_FLIGHT  # the consecutive count stays out of it
    keys = redis_asyncio.Redis.from_url(redis_url)
    prefix = f"chat_pipeline:breaker:{{{name}}}"
    policy = ("0.5", str(minimum_calls))
    async with remote(
        "tests.middleware.breaker_replica", redis_url, name, str(fail_max), *policy
    ) as other:
        assert await other.ask(f"clock {T0.isoformat()}") == ["ok"]
        client, inner = replica(
            redis_url, name, T0, fail_max, failure_ratio=0.5, minimum_calls=minimum_calls
        )
        # In each replica 1,000 calls in flight at once, 6 of every 10 failing.
        await other.send(f"burst {IN_FLIGHT} mix6 {int(streaming)}")
        inner.expect("mix6")
        burst = Burst(client, inner, IN_FLIGHT, streaming)
        admitted, refused = await burst.settled()
        word, admitted_there, word2, refused_there = await other.read()
        assert (word, word2) == ("admitted", "refused")
        assert (admitted + int(admitted_there), refused + int(refused_there)) == (2000, 0)
        await other.send("release")
        served = await burst.finish()
        word, served_there = await other.read()
        assert served + int(served_there) == 2 * IN_FLIGHT * 4 // 10
        # 2,000 calls, 1,200 failed: open in both (the next call of each fails fast).
        inner.expect("ok")
        burst = Burst(client, inner, 1, streaming)
        assert await burst.settled() == (0, 1)
        await burst.finish()
        assert await other.ask(f"burst 1 ok {int(streaming)}") == [
            "admitted", "0", "refused", "1"
        ]  # fmt: skip
        await other.ask("release")
        state = await other.ask("state")
    assert await keys.get(f"{prefix}:opened") is not None
    assert client.state == "open" and state[1] == "open"
    assert state[3] == "0" and breaker_warnings(caplog) == [], "Redis reported unavailable"
    print(
        f"\nbreaker window: 2 replicas x {IN_FLIGHT} calls in flight, 60% failing, "
        f"minimum_calls {minimum_calls}: opened together"
    )
    await client.aclose()
    await keys.aclose()


async def test_a_paused_redis_leaves_the_window_to_local_state(
    redis_server: RedisServer,
    streaming: bool,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    now = fake_now()
    inner = ScriptedChatClient([OK, F, OK, F, OK])
    client = breaker(
        inner, now, name=f"paused-window-{request.node.name}", redis=redis_server.url,
        redis_timeout=0.2, redis_retry_interval=60, failure_ratio=0.5, minimum_calls=4,
        fail_max=1000,
    )  # fmt: skip
    assert (await collect(client, "hi", streaming=streaming)).text == "ok"  # connected
    redis_server.pause()
    try:
        # The first call waits out redis_timeout once; then Redis is skipped.
        for _ in range(2):
            await collect(client, "hi", streaming=streaming)
        assert client.state == "closed"  # 3 calls
        await collect(client, "hi", streaming=streaming)
        assert client.state == "open"  # the fourth: 2 of 4 failed, counted here alone
        result = await collect(client, "hi", streaming=streaming)
        assert redis_server.paused
    finally:
        redis_server.resume()
    assert isinstance(result.error, CircuitOpenError) and inner.call_count == 4
    (warning,) = breaker_warnings(caplog)
    assert "TimeoutError" in warning.getMessage()
    await client.aclose()


# -- clocks that jump -------------------------------------------------------------------------
# The wall clock (`now`) jumps; durations and the window follow the monotonic `clock`
# (here the process's own: these tests' calls take far less than their windows).


async def test_a_wall_clock_stepped_back_still_counts_every_outcome(streaming: bool) -> None:
    wall = FakeNow()
    inner = ScriptedChatClient(F)
    client = CircuitBreakerChatClient(
        inner, now=wall, name="p", failure_ratio=0.5, minimum_calls=40, window=60,
        fail_max=1000,
    )  # fmt: skip
    await run(client, 1, streaming)
    wall.advance(-3600)  # an hour back: a wall-clock window would drop every outcome
    await run(client, 38, streaming)
    assert client.state == "closed"  # 39 calls: below minimum_calls
    await run(client, 1, streaming)
    assert client.state == "open"  # the fortieth failure in a row
    assert await run(client, 1, streaming) == ["CircuitOpenError"]
    assert inner.call_count == 40


async def test_a_wall_clock_stepped_forward_makes_no_call_in_flight_slow(
    streaming: bool,
) -> None:
    wall = FakeNow()
    gate = asyncio.Event()

    async def held(seconds: float) -> None:
        await gate.wait()

    inner = ScriptedChatClient(reply("ok", delay=1), sleep=held)
    client = CircuitBreakerChatClient(
        inner, now=wall, name="p", slow_call_duration=60, slow_call_ratio=0.5,
        minimum_calls=20, fail_max=1000,
    )  # fmt: skip
    calls = [asyncio.create_task(collect(client, "hi", streaming=streaming)) for _ in range(20)]
    await inner.wait_for_calls(20)  # all 20 in flight
    wall.advance(3600)  # an hour forward, while they run
    gate.set()
    results = await asyncio.gather(*calls)
    assert [result.text for result in results] == ["ok"] * 20
    assert client.state == "closed"  # none was slow: 20 fast calls of a healthy deployment
    assert await run(client, 1, streaming) == ["ok"]


async def test_replicas_whose_wall_clocks_differ_share_one_window(
    redis_url: str, streaming: bool, request: pytest.FixtureRequest
) -> None:
    # An hour apart: buckets numbered from the wall clocks would never meet. On Redis'
    # clock they do.
    name = f"apart-{request.node.name}"
    options: dict[str, Any] = {
        "failure_ratio": 0.5, "minimum_calls": 4, "window": 60, "fail_max": 1000,
        "name": name, "redis": redis_url, "redis_timeout": 5,
    }  # fmt: skip
    early, late = FakeNow(), FakeNow()
    late.advance(3600)
    a = CircuitBreakerChatClient(ScriptedChatClient(F), now=early, **options)
    b = CircuitBreakerChatClient(ScriptedChatClient(OK), now=late, **options)
    for each in (a, a, b):
        await collect(each, "hi", streaming=streaming)
    assert a.state == b.state == "closed"
    assert (await collect(b, "hi", streaming=streaming)).text == "ok"  # 2 of 4 failed
    assert b.state == "open"
    assert isinstance((await collect(a, "hi", streaming=streaming)).error, CircuitOpenError)
    await a.aclose()
    await b.aclose()
