"""HedgingChatClient: who wins, what the losers become, the budget, the boundaries that do
not move, the limits hedges count against, and what telemetry says (both call shapes).

Timing is driven by gates (a `sleep` the test opens), `hang()` and injected clocks. The
hedge delay of most tests is a tiny real timer: the attempt it hedges is gated or hangs,
so whether the hedge starts never depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import pytest

from middleware.routing import (
    BalancedSettings,
    FailoverAttempt,
    HedgingChatClient,
    HedgingSettings,
    MemoryAffinityStore,
    Route,
    RouteHealth,
    RoutingContext,
    SessionAffinity,
)
from pipeline import ChatMessage, ChatOptions, ChatPipeline
from pipeline.config import HedgedRouterConfig, parse_config
from pipeline.errors import (
    AttemptTimeoutError,
    ConfigError,
    RateLimitedError,
    RequestTimeoutError,
    TransientProviderError,
)
from pipeline.testing import ScriptedChatClient, collect, fail, fail_after, hang, reply
from tests.otel import Otel

TINY = 0.001  # seconds: the hedge delay of tests whose hedged attempt is gated or hangs


class Gate:
    """A `sleep` for `ScriptedChatClient`: a scripted delay lasts until the test opens it."""

    def __init__(self) -> None:
        self._opened = asyncio.Event()

    async def sleep(self, seconds: float) -> None:
        await self._opened.wait()

    def open(self) -> None:
        self._opened.set()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


class Recording(HedgingChatClient):
    """Records every attempt as ``(route, number, outcome, is_terminal)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.updates: list[tuple[str, int, str, bool]] = []
        self._reported = asyncio.Event()

    def on_routing_update(
        self, context: RoutingContext, attempt: FailoverAttempt, is_terminal: bool
    ) -> None:
        self.updates.append((attempt.route_name, attempt.number, attempt.outcome, is_terminal))
        self._reported.set()

    async def wait_for_updates(self, count: int) -> None:
        """Return once `count` attempts have been reported (each report wakes it once)."""
        while len(self.updates) < count:
            self._reported.clear()
            await self._reported.wait()


def hedger(*routes: Route, **options: Any) -> Recording:
    # Round robin over (a, b) starts on a and hedges on b; over (a, b, c) it starts on a,
    # hedges on c, then on b.
    options.setdefault("strategy", "round_robin")
    options.setdefault("delay", TINY)
    return Recording(list(routes), **options)


def calm_health() -> RouteHealth:
    """Route health that never calls a route an outlier (tests of the hedging alone)."""
    return RouteHealth(outlier_latency_gap=1000.0, outlier_failure_gap=1.0)


def scripted(name: str, script: Any, gate: Gate | None = None) -> ScriptedChatClient:
    if gate is None:
        return ScriptedChatClient(script, name=name)
    return ScriptedChatClient(script, name=name, sleep=gate.sleep)


def nothing_left_running() -> None:
    assert asyncio.all_tasks() == {asyncio.current_task()}


def closed_every_stream(*clients: ScriptedChatClient) -> None:
    for client in clients:
        assert client.streams_closed == client.streams_opened, client


async def test_an_attempt_that_answers_in_time_is_the_only_one(otel: Otel, streaming: bool) -> None:
    a, b = scripted("a", reply("from a")), scripted("b", reply("from b"))
    router = hedger(Route("a", a), Route("b", b), delay=60.0, **otel.providers)
    result = await collect(router, "hi", streaming=streaming)
    assert result.error is None and result.text == "from a"
    assert router.updates == [("a", 1, "completed", True)]
    assert (a.call_count, b.call_count) == (1, 0)
    (span,) = otel.attempt_spans()
    attributes = dict(span.attributes or {})
    assert (
        attributes["chat_pipeline.route.selection"] == "strategy"
        and attributes["chat_pipeline.route.hedge"] is False
    )
    assert otel.total("chat_pipeline.route.hedges.started") == 0
    nothing_left_running()


async def test_a_slow_attempt_is_hedged_and_the_hedge_wins(otel: Otel, streaming: bool) -> None:
    a = scripted("a", hang())
    b = scripted("b", reply("from b", chunks=["from ", "b"]))
    router = hedger(Route("a", a), Route("b", b), **otel.providers)
    result = await collect(router, "hi", streaming=streaming)
    assert result.error is None and result.text == "from b"
    # The loser is reported first (cancelled once b answered), the winner last, terminal.
    assert router.updates == [("a", 1, "abandoned", False), ("b", 2, "completed", True)]
    closed_every_stream(a, b)
    assert a.streams_opened == (1 if streaming else 0)
    assert (
        otel.total("chat_pipeline.route.hedges.started", **{"chat_pipeline.route.name": "b"}) == 1
    )
    assert otel.total("chat_pipeline.route.hedges.won", **{"chat_pipeline.route.name": "b"}) == 1
    nothing_left_running()


async def test_the_first_attempt_wins_when_it_answers_before_the_hedge(
    otel: Otel, streaming: bool
) -> None:
    gate = Gate()
    a = scripted("a", reply("from a", chunks=["from ", "a"], delay=1.0), gate)
    b = scripted("b", hang())
    router = hedger(Route("a", a), Route("b", b), **otel.providers)
    request = asyncio.create_task(collect(router, "hi", streaming=streaming))
    await b.wait_for_calls(1)  # the hedge is running
    gate.open()
    result = await request
    assert result.text == "from a"
    assert router.updates == [("b", 2, "abandoned", False), ("a", 1, "completed", True)]
    closed_every_stream(a, b)
    assert otel.total("chat_pipeline.route.hedges.started") == 1
    assert otel.total("chat_pipeline.route.hedges.won") == 0
    nothing_left_running()


async def test_no_output_of_a_loser_ever_reaches_the_caller(streaming: bool) -> None:
    # Both answer in the same turn of the event loop: the attempt started first wins, and
    # the update the other already produced is dropped, its stream closed.
    gate = Gate()
    a = scripted("a", reply("a1a2", chunks=["a1", "a2"], delay=1.0), gate)
    b = scripted("b", reply("b1b2", chunks=["b1", "b2"], delay=1.0), gate)
    router = hedger(Route("a", a), Route("b", b))
    request = asyncio.create_task(collect(router, "hi", streaming=streaming))
    await b.wait_for_calls(1)
    gate.open()
    result = await request
    assert result.text == "a1a2"
    if streaming:
        assert [u.text for u in result.updates] == ["a1", "a2"]
    assert router.updates == [("b", 2, "abandoned", False), ("a", 1, "completed", True)]
    closed_every_stream(a, b)
    if streaming:
        assert b.streams_abandoned == 1  # closed while holding its first update
    nothing_left_running()


async def test_an_empty_answer_can_win(streaming: bool) -> None:
    a, b = scripted("a", hang()), scripted("b", reply(""))
    router = hedger(Route("a", a), Route("b", b))
    result = await collect(router, "hi", streaming=streaming)
    assert result.error is None and result.text == ""
    if streaming:
        assert result.updates == [] and b.streams_opened == 1  # a stream that ran out
    assert router.updates == [("a", 1, "abandoned", False), ("b", 2, "completed", True)]
    closed_every_stream(a, b)
    nothing_left_running()


async def test_over_http_the_losers_call_is_closed_and_the_winners_answer_arrives_once(
    streaming: bool,
) -> None:
    # Real provider clients against fake servers: the hung deployment's HTTP call is closed
    # once the hedge answered, and the caller gets the hedge's answer exactly once.
    from pipeline.providers import OpenAIChatClient
    from pipeline.testing import FakeOpenAIServer, FakeResponse

    hung = FakeOpenAIServer(default=FakeResponse(hang=True))
    fast = FakeOpenAIServer(default=FakeResponse(text="from b", chunks=["from ", "b"]))
    async with hung, fast:
        a = OpenAIChatClient("m", api_key="k", base_url=hung.base_url, name="a")
        b = OpenAIChatClient("m", api_key="k", base_url=fast.base_url, name="b")
        router = hedger(Route("a", a), Route("b", b))
        result = await collect(router, "hi", streaming=streaming)
        await hung.wait_for_disconnects(1)  # the loser's call was closed, not left hanging
        await a.aclose()
        await b.aclose()
    assert result.error is None and result.text == "from b"
    if streaming:
        assert [u.text for u in result.updates if u.text] == ["from ", "b"]
    assert (len(hung.requests), len(fast.requests)) == (1, 1)
    assert router.updates == [("a", 1, "abandoned", False), ("b", 2, "completed", True)]


async def test_a_loser_that_would_answer_after_the_winner_is_never_seen() -> None:
    late = Gate()
    a = scripted("a", reply("a1", delay=1.0), late)
    b = scripted("b", reply("b1b2", chunks=["b1", "b2"]))
    router = hedger(Route("a", a), Route("b", b))
    seen: list[str] = []
    async with contextlib.aclosing(router.get_streaming_response("hi")) as stream:
        async for update in stream:
            seen.append(update.text)
            late.open()  # a could answer now, but it was cancelled when b won
    assert seen == ["b1", "b2"]
    assert router.updates == [("a", 1, "abandoned", False), ("b", 2, "completed", True)]
    closed_every_stream(a, b)
    nothing_left_running()


async def test_a_failure_before_output_while_another_runs_does_not_end_the_request(
    streaming: bool,
) -> None:
    first, second = Gate(), Gate()
    a = scripted("a", fail(TransientProviderError("a failed"), delay=1.0), first)
    b = scripted("b", reply("from b", delay=1.0), second)
    router = hedger(Route("a", a), Route("b", b))
    request = asyncio.create_task(collect(router, "hi", streaming=streaming))
    await b.wait_for_calls(1)
    first.open()  # a fails while b runs
    await router.wait_for_updates(1)
    second.open()
    result = await request
    assert result.error is None and result.text == "from b"
    assert router.updates == [
        ("a", 1, "failed_before_output", False),
        ("b", 2, "completed", True),
    ]
    closed_every_stream(a, b)
    nothing_left_running()


async def test_a_failure_while_a_hedge_runs_may_start_the_next_route_at_once(
    otel: Otel, streaming: bool
) -> None:
    # The hedge (c) fails while a, past its delay, still waits: b starts as a hedge at once.
    gate = Gate()
    a = scripted("a", hang())
    b = scripted("b", reply("from b"))
    c = scripted("c", fail(TransientProviderError(), delay=1.0), gate)
    router = hedger(Route("a", a), Route("b", b), Route("c", c), **otel.providers)
    request = asyncio.create_task(collect(router, "hi", streaming=streaming))
    await c.wait_for_calls(1)
    gate.open()
    result = await request
    assert result.error is None and result.text == "from b"
    assert router.updates == [
        ("c", 2, "failed_before_output", False),
        ("a", 1, "abandoned", False),
        ("b", 3, "completed", True),
    ]
    assert otel.total("chat_pipeline.route.hedges.started") == 2
    assert otel.total("chat_pipeline.route.hedges.won", **{"chat_pipeline.route.name": "b"}) == 1
    closed_every_stream(a, b, c)
    nothing_left_running()


async def test_when_the_last_attempt_standing_fails_the_router_fails_over(
    otel: Otel, streaming: bool
) -> None:
    a = scripted("a", fail(TransientProviderError()))
    b = scripted("b", reply("from b"))
    router = hedger(Route("a", a), Route("b", b), delay=60.0, **otel.providers)
    result = await collect(router, "hi", streaming=streaming)
    assert result.text == "from b"
    assert router.updates == [("a", 1, "failed_before_output", False), ("b", 2, "completed", True)]
    second = otel.attempt_spans()[1]
    attributes = dict(second.attributes or {})
    assert (
        attributes["chat_pipeline.route.selection"] == "failover"
        and attributes["chat_pipeline.route.hedge"] is False
    )
    assert otel.total("chat_pipeline.route.hedges.started") == 0
    nothing_left_running()


async def test_when_every_attempt_fails_the_last_failure_is_raised(streaming: bool) -> None:
    gate = Gate()
    last = TransientProviderError("b failed")
    a = scripted("a", fail(TransientProviderError("a failed"), delay=1.0), gate)
    b = scripted("b", fail(last, delay=1.0), gate)
    router = hedger(Route("a", a), Route("b", b))
    request = asyncio.create_task(collect(router, "hi", streaming=streaming))
    await b.wait_for_calls(1)
    gate.open()
    result = await request
    assert result.error is last
    assert router.updates == [
        ("a", 1, "failed_before_output", False),
        ("b", 2, "failed_before_output", True),
    ]
    closed_every_stream(a, b)
    nothing_left_running()


async def test_the_budget_refuses_hedges_beyond_its_fraction_of_requests(
    otel: Otel, streaming: bool
) -> None:
    # Half a token a request, a bucket of one: every other request may hedge. Without a
    # hedge, a's attempt is cut at its attempt timeout and the request fails over.
    a = scripted("a", hang())
    b = scripted("b", reply("from b"))
    router = hedger(
        Route("a", a),
        Route("b", b, weight=1e-9),  # never first
        strategy="weighted",
        random_source=random.Random(7),
        health=calm_health(),
        budget=0.5,
        budget_burst=1.0,
        attempt_timeout=0.05,
        **otel.providers,
    )
    selections = []
    for _ in range(4):
        before = len(otel.attempt_spans())
        result = await collect(router, "hi", streaming=streaming)
        assert result.text == "from b"
        spans = otel.attempt_spans()[before:]
        selections.append([(s.attributes or {})["chat_pipeline.route.selection"] for s in spans])
    # Spans end in the order the attempts are reported: a hedge wins after a is cancelled.
    assert selections == [
        ["strategy", "hedge"],
        ["strategy", "failover"],
        ["strategy", "hedge"],
        ["strategy", "failover"],
    ]
    assert otel.total("chat_pipeline.route.hedges.started") == 2
    assert (a.call_count, b.call_count) == (4, 4)
    nothing_left_running()


async def test_caller_cancellation_cancels_every_attempt_and_starts_none(
    streaming: bool,
) -> None:
    a, b, c = scripted("a", hang()), scripted("b", reply("from b")), scripted("c", hang())
    router = hedger(Route("a", a), Route("b", b), Route("c", c))
    request = asyncio.create_task(collect(router, "hi", streaming=streaming))
    await c.wait_for_calls(1)  # the hedge runs beside a
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    assert router.updates == [("a", 1, "canceled", False), ("c", 2, "canceled", True)]
    assert b.call_count == 0
    closed_every_stream(a, b, c)
    nothing_left_running()


async def test_caller_closing_the_stream_abandons_the_winner() -> None:
    a = scripted("a", hang())
    b = scripted("b", reply("b1b2", chunks=["b1", "b2"]))
    router = hedger(Route("a", a), Route("b", b))
    stream = router.get_streaming_response("hi")
    first = await stream.__anext__()
    assert first.text == "b1"
    await stream.aclose()
    assert router.updates == [("a", 1, "abandoned", False), ("b", 2, "abandoned", True)]
    assert b.streams_abandoned == 1
    closed_every_stream(a, b)
    nothing_left_running()


async def test_nothing_switches_after_the_winners_first_update() -> None:
    cut = TransientProviderError("cut")
    a = scripted("a", hang())
    b = scripted("b", reply("from b"))
    c = scripted("c", fail_after(["c1"], cut))
    router = hedger(Route("a", a), Route("b", b), Route("c", c))
    result = await collect(router, "hi", streaming=True)
    assert result.error is cut and result.text == "c1"
    assert router.updates == [("a", 1, "abandoned", False), ("c", 2, "failed_after_output", True)]
    assert b.call_count == 0
    closed_every_stream(a, b, c)
    nothing_left_running()


async def test_hedges_count_against_the_provider_calls_of_a_request(streaming: bool) -> None:
    a, b, c = scripted("a", hang()), scripted("b", reply("from b")), scripted("c", hang())
    router = hedger(
        Route("a", a),
        Route("b", b),
        Route("c", c),
        max_hedged_attempts=2,
        max_provider_calls_per_request=2,
        attempt_timeout=0.05,
    )
    result = await collect(router, "hi", streaming=streaming)
    assert isinstance(result.error, AttemptTimeoutError)
    assert (a.call_count, b.call_count, c.call_count) == (1, 0, 1)
    assert router.updates == [
        ("a", 1, "failed_before_output", False),
        ("c", 2, "failed_before_output", True),
    ]
    closed_every_stream(a, b, c)
    nothing_left_running()


async def test_the_request_deadline_bounds_every_attempt(streaming: bool) -> None:
    clock = Clock()  # frozen: the decisions never depend on how much real time passed
    a, b = scripted("a", hang()), scripted("b", hang())
    router = hedger(Route("a", a), Route("b", b), request_timeout=0.05, clock=clock)
    result = await collect(router, "hi", streaming=streaming)
    assert isinstance(result.error, RequestTimeoutError)
    assert [u[:3] for u in router.updates] == [
        ("a", 1, "failed_before_output"),
        ("b", 2, "failed_before_output"),
    ]
    closed_every_stream(a, b)
    nothing_left_running()


async def test_the_retry_layer_does_not_wait_out_retry_after_while_a_hedge_runs(
    streaming: bool,
) -> None:
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    first, second = Gate(), Gate()
    limited = ScriptedChatClient(
        [fail(RateLimitedError(status_code=429, retry_after=1.0), delay=1.0), reply("late a")],
        name="a",
        sleep=first.sleep,
    )
    retried = ChatPipeline.builder().use_retry(max_attempts=3, sleep=sleep).build(limited)
    b = scripted("b", reply("from b", delay=1.0), second)
    router = hedger(Route("a", retried), Route("b", b))
    request = asyncio.create_task(collect(router, "hi", streaming=streaming))
    await b.wait_for_calls(1)
    first.open()  # a's 429 comes while the hedge runs: the retry layer gives up at once
    await router.wait_for_updates(1)
    assert router.updates == [("a", 1, "failed_before_output", False)]
    second.open()
    result = await request
    assert result.text == "from b"
    assert (limited.call_count, waits) == (1, [])
    nothing_left_running()


async def test_a_session_starts_on_the_route_that_won_its_last_request(
    otel: Otel, streaming: bool
) -> None:
    gate = Gate()
    a = scripted("a", reply("from a", delay=1.0), gate)
    b = scripted("b", reply("from b"))
    affinity = SessionAffinity(MemoryAffinityStore(max_sessions=10, ttl=60))
    router = hedger(Route("a", a), Route("b", b), affinity=affinity, **otel.providers)
    options = ChatOptions(session_id="s")
    assert (await collect(router, "hi", options, streaming=streaming)).text == "from b"
    router.settings = router.settings.replace(delay=60.0)
    assert (await collect(router, "hi", options, streaming=streaming)).text == "from b"
    last = otel.attempt_spans()[-1]
    assert (last.attributes or {})["chat_pipeline.route.selection"] == "preferred"
    assert b.call_count == 2
    nothing_left_running()


async def test_each_attempt_gets_its_own_routes_instructions(streaming: bool) -> None:
    a = scripted("a", hang())
    b = scripted("b", reply("from b"))
    router = hedger(
        Route("a", a, instructions="Rules of a."), Route("b", b, instructions="Rules of b.")
    )
    messages = [ChatMessage.system("Caller's rules."), ChatMessage.user("hi")]
    assert (await collect(router, messages, streaming=streaming)).text == "from b"
    assert [m.text for m in a.calls[0].messages] == ["Rules of a.", "hi"]
    assert [m.text for m in b.calls[0].messages] == ["Rules of b.", "hi"]
    assert [m.text for m in messages] == ["Caller's rules.", "hi"]


async def test_hedged_attempts_are_sibling_spans_under_the_request(
    otel: Otel, streaming: bool
) -> None:
    a = scripted("a", hang())
    b = scripted("b", reply("from b"))
    chat = (
        ChatPipeline.builder(**otel.providers)
        .use_telemetry()
        .use_hedging([Route("a", a), Route("b", b)], strategy="round_robin", delay=TINY)
        .build()
    )
    assert (await collect(chat, "hi", streaming=streaming)).text == "from b"
    (request_span,) = [s for s in otel.finished() if s.name.startswith("chat")]
    attempts = {s.name: s for s in otel.attempt_spans()}
    assert set(attempts) == {"route_attempt a", "route_attempt b"}
    for span in attempts.values():
        assert span.parent is not None
        assert span.parent.span_id == request_span.context.span_id
        assert span.context.trace_id == request_span.context.trace_id
    first = dict(attempts["route_attempt a"].attributes or {})
    hedge = dict(attempts["route_attempt b"].attributes or {})
    assert (first["chat_pipeline.route.selection"], first["chat_pipeline.route.hedge"]) == (
        "strategy",
        False,
    )
    assert (first["chat_pipeline.route.attempt"], first["chat_pipeline.route.outcome"]) == (
        1,
        "abandoned",
    )
    assert (hedge["chat_pipeline.route.selection"], hedge["chat_pipeline.route.hedge"]) == (
        "hedge",
        True,
    )
    assert (hedge["chat_pipeline.route.attempt"], hedge["chat_pipeline.route.outcome"]) == (
        2,
        "completed",
    )
    story = dict(request_span.attributes or {})
    assert story["chat_pipeline.route.name"] == "b"
    assert (
        story["chat_pipeline.route.attempts"] == 2 and story["chat_pipeline.route.fallback"] is True
    )
    await chat.aclose()
    nothing_left_running()


async def test_no_prompt_or_error_text_reaches_telemetry(otel: Otel, streaming: bool) -> None:
    first, second = Gate(), Gate()
    a = scripted("a", fail(TransientProviderError("CANARY-error-text"), delay=1.0), first)
    b = scripted("b", reply("CANARY-answer", delay=1.0), second)
    router = hedger(
        Route("a", a, instructions="CANARY-instructions"), Route("b", b), **otel.providers
    )
    chat = ChatPipeline.builder(**otel.providers).use_telemetry().use_failover(router).build()
    request = asyncio.create_task(collect(chat, "CANARY-prompt", streaming=streaming))
    await b.wait_for_calls(1)
    first.open()
    await router.wait_for_updates(1)  # a's failure is on its span
    second.open()
    assert (await request).text == "CANARY-answer"
    exported = list(otel.everything_exported())
    assert "TransientProviderError" in "".join(exported)
    assert not [text for text in exported if "CANARY" in text]
    await chat.aclose()


async def test_a_percentile_delay_follows_the_routes_recent_times_to_first_update() -> None:
    clock = Clock()
    delays = [0.1 * (i + 1) for i in range(10)]  # 0.1 .. 1.0 s
    a = ScriptedChatClient([reply("a", delay=d) for d in delays], name="a", sleep=clock.sleep)
    b = ScriptedChatClient(reply("b", delay=0.5), name="b", sleep=clock.sleep)
    router = HedgingChatClient(
        [Route("a", a), Route("b", b, weight=1e-9)],  # every request on a: b has no samples
        strategy="weighted",
        random_source=random.Random(3),
        health=calm_health(),
        delay="p90",
        min_delay_samples=10,
        delay_window=10,
        fallback_delay=7.0,
        clock=clock,
    )
    for _ in range(10):
        assert router.hedge_delay("a", streaming=False) == 7.0  # too few samples anywhere
        await router.get_response("hi")
    assert router.hedge_delay("a", streaming=False) == pytest.approx(0.91)  # 9th to 10th
    # b has no samples of its own yet: every route's samples together.
    assert router.hedge_delay("b", streaming=False) == pytest.approx(0.91)
    # Streamed requests wait for a first update, not a whole response: samples of their own.
    assert router.hedge_delay("a", streaming=True) == 7.0
    for _ in range(10):  # the window keeps the last ten: all of 1.0 s now
        await router.get_response("hi")
    assert router.hedge_delay("a", streaming=False) == pytest.approx(1.0)
    fixed = HedgingChatClient([Route("a", a)], delay=0.25)
    assert fixed.hedge_delay("a") == 0.25


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"delay": "p100"}, ValueError, "delay must be a percentile such as 'p90'"),
        ({"delay": "fast"}, ValueError, "delay must be a percentile such as 'p90'"),
        ({"delay": 0}, ValueError, "delay must be positive, finite seconds, got 0"),
        ({"delay": None}, ValueError, "delay must be seconds"),
        ({"budget": 1.5}, ValueError, "budget must be at most 1"),
        ({"max_hedged_attempts": 0}, ValueError, "max_hedged_attempts must be at least 1"),
        ({"budget_burst": 0.5}, ValueError, "budget_burst must be at least 1"),
        ({"settings": BalancedSettings()}, TypeError, "settings must be HedgingSettings"),
    ],
)
def test_settings_are_checked_where_they_are_written(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        HedgingChatClient([Route("a", ScriptedChatClient())], **options)


def test_settings_take_seconds_or_a_percentile() -> None:
    assert HedgingSettings(delay=1).delay == 1.0
    assert HedgingSettings(delay="p99.9").delay == "p99.9"
    assert HedgingSettings().delay == "p90"


async def test_the_builder_gives_each_pipeline_its_own_router(streaming: bool) -> None:
    a, b = scripted("a", reply("from a")), scripted("b", reply("from b"))
    builder = ChatPipeline.builder().use_hedging([Route("a", a), Route("b", b)], delay=60.0)
    first, second = builder.build(), builder.build()
    assert first.client is not second.client
    assert isinstance(first.client, HedgingChatClient)
    assert first.describe() == ["HedgingChatClient(a, b; peak_ewma, delay 60.0, budget 0.1)"]
    assert (await collect(first, "hi", streaming=streaming)).error is None
    await first.aclose()
    await second.aclose()


def test_toml_kind_hedged_builds_a_hedging_router() -> None:
    config = parse_config(
        {
            "routes": {"a": {"provider": "scripted"}, "b": {"provider": "scripted"}},
            "router": {
                "kind": "hedged",
                "delay": "p95",
                "budget": 0.05,
                "max_hedged_attempts": 2,
                "attempt_timeout": 3.0,
                "health": {"latency_decay": 3.0},
            },
        }
    )
    assert isinstance(config.router, HedgedRouterConfig)
    chat = config.build()
    router = chat.client
    assert isinstance(router, HedgingChatClient)
    assert (router.settings.delay, router.settings.budget) == ("p95", 0.05)
    assert router.settings.max_hedged_attempts == 2 and router.settings.attempt_timeout == 3.0
    assert router.health.settings.latency_decay == 3.0
    assert [route.name for route in router.routes] == ["a", "b"]


def test_toml_errors_name_the_hedging_keys() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(
            {
                "routes": {"a": {"provider": "scripted"}, "b": {"provider": "scripted"}},
                "router": {
                    "kind": "hedged",
                    "delay": "p100",
                    "budget": 2,
                    "max_hedged_attempts": 0,
                    "routes": ["a", "zz"],
                },
            }
        )
    lines = str(caught.value).splitlines()
    assert any(line.startswith("router.delay: expected a percentile") for line in lines)
    assert "router.budget: expected at most 1.0, got 2" in lines
    assert "router.max_hedged_attempts: expected at least 1, got 0" in lines
    assert "router.routes[1]: names no route: 'zz'" in lines


class SlowToStop:
    """A `sleep` that lasts until cancelled, then takes until the test releases it to stop:
    a losing attempt that is slow to shut down."""

    def __init__(self) -> None:
        self.stopping = asyncio.Event()
        self.release = asyncio.Event()

    async def sleep(self, seconds: float) -> None:
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            self.stopping.set()
            await self.release.wait()
            raise


async def test_a_cancel_while_a_loser_shuts_down_still_ends_every_attempt(
    otel: Otel, streaming: bool
) -> None:
    slow = SlowToStop()
    a = ScriptedChatClient(reply("from a", delay=1.0), name="a", sleep=slow.sleep)
    b = scripted("b", reply("from b", chunks=["from ", "b"]))
    health = calm_health()
    router = hedger(Route("a", a), Route("b", b), health=health, **otel.providers)
    request = asyncio.create_task(collect(router, "hi", streaming=streaming))
    await slow.stopping.wait()  # b answered: a is being shut down
    request.cancel()  # the caller leaves before a has stopped
    slow.release.set()
    with pytest.raises(asyncio.CancelledError):
        await request
    # Both attempts were reported (the caller cancelled before the winner reached it), both
    # routes are idle again, and both attempt spans ended.
    assert sorted(router.updates) == [("a", 1, "canceled", False), ("b", 2, "canceled", True)]
    assert {name: stats.in_flight for name, stats in health.snapshot().items()} == {"a": 0, "b": 0}
    assert sorted(span.name for span in otel.attempt_spans()) == [
        "route_attempt a",
        "route_attempt b",
    ]
    closed_every_stream(a, b)
    nothing_left_running()
