"""Chaos: 1,000 requests at concurrency 100 through telemetry + ordered failover of three
routes (each with a breaker and retry) over real HTTP, against a fault server in its own
process (20% failures before output, 5% cuts after output, 10% hangs), half of them
streamed, with callers cancelling at random. Bounded in count and time; loopback only.

What must hold, for every request: its answer came whole from one upstream request (no
mixed or duplicated output) or it ended with a `pipeline.errors` type (or the caller's own
cancellation); no attempt followed committed output or a caller's cancellation; every
request the server saw was sent by an attempt the spans report, no attempt sent more than
its retries allow; no task outlives the run.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import random
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx2
import pytest

from middleware.routing import (
    FailoverAttempt,
    HedgingChatClient,
    OrderedFailoverChatClient,
    Route,
    RouteHealth,
    RoutingContext,
)
from pipeline import ChatOptions, ChatPipeline
from pipeline.errors import ChatPipelineError, CircuitOpenError, TransientProviderError
from pipeline.providers import OpenAIChatClient
from pipeline.testing import (
    FakeOpenAIServer,
    FakeResponse,
    ScriptedChatClient,
    ScriptStep,
    collect,
    fail,
    fail_after,
    reply,
)
from tests.chaos.fault_server import TOKENS
from tests.otel import Otel
from tests.processes import ChildProcess

pytestmark = pytest.mark.chaos

REQUESTS = 1000
CONCURRENCY = 100
TOKEN = re.compile(r"\[(r\d-\d+):(\d+)\] ")
READY = re.compile(r"^READY (\d+)$")  # the fault server's line once it listens


@pytest.fixture(scope="module")
def chaos_origin() -> Iterator[str]:
    """The fault server, in a process of its own, on the port it reports."""
    argv = [sys.executable, "-m", "tests.chaos.fault_server", "--seed", "20261130"]
    with ChildProcess("the chaos fault server", argv) as server:
        yield f"http://127.0.0.1:{server.wait_for_port(READY, timeout=60)}"


class Recorder(OrderedFailoverChatClient):
    """Ordered failover that keeps every request's attempts, by request id (session id)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attempts: dict[str, list[FailoverAttempt]] = {}

    def on_routing_update(
        self, context: RoutingContext, attempt: FailoverAttempt, is_terminal: bool
    ) -> None:
        request = context.options.session_id
        assert request is not None
        self.attempts.setdefault(request, []).append(attempt)


@dataclass
class Outcome:
    request: str
    streaming: bool
    cancel_after: int | None  # updates (streaming) or loop turns (whole) before cancelling
    text: str = ""
    error: BaseException | None = None
    cancelled: bool = False
    updates: list[str] = field(default_factory=list)


async def one_request(chat: ChatPipeline, outcome: Outcome) -> None:
    """One request in a task of its own, which the caller cancels after `cancel_after`
    updates (streaming) or loop turns (whole), as a caller that gives up would."""
    options = ChatOptions(session_id=outcome.request)
    enough = asyncio.Event()

    async def consume() -> str:
        if not outcome.streaming:
            return (await chat.get_response("hi", options)).text
        async for update in chat.get_streaming_response("hi", options):
            outcome.updates.append(update.text)
            if outcome.cancel_after is not None and len(outcome.updates) >= outcome.cancel_after:
                enough.set()
        return "".join(outcome.updates)

    request = asyncio.ensure_future(consume())
    if outcome.cancel_after is not None:
        if outcome.streaming:
            waiter = asyncio.ensure_future(enough.wait())
            await asyncio.wait({request, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
        else:
            for _ in range(outcome.cancel_after):
                await asyncio.sleep(0)  # a few loop turns: the request is under way
        request.cancel()
    try:
        outcome.text = await request
    except asyncio.CancelledError:
        outcome.cancelled = True
        outcome.text = "".join(outcome.updates)
    except Exception as exc:
        outcome.error = exc
        outcome.text = "".join(outcome.updates)


def tokens(text: str) -> list[tuple[str, int]]:
    found = [(tag, int(index)) for tag, index in TOKEN.findall(text)]
    assert "".join(f"[{t}:{i}] " for t, i in found) == text, "stray text in an answer"
    return found


@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", ["aiohttp", "httpx2"])
async def test_chaos(chaos_origin: str, otel: Otel, transport: str) -> None:
    rng = random.Random(7)
    http = httpx2.AsyncClient(
        limits=httpx2.Limits(max_connections=400, max_keepalive_connections=400),
        timeout=httpx2.Timeout(10.0),
    )
    # The fault server lives for the module: this run's requests are those after `seen`.
    seen = len((await http.get(f"{chaos_origin}/stats")).json())
    # httpx2: one shared client; aiohttp: each route's own session. Either way the clients
    # send the attempt span's traceparent, which the server records.
    given: dict[str, Any] = (
        {"http_client": http} if transport == "httpx2" else {"transport": transport}
    )
    routes = []
    for k in range(3):
        client = OpenAIChatClient(
            "chaos", base_url=f"{chaos_origin}/r{k}/v1", api_key="k", timeout=10.0, **given
        )
        guarded = (
            ChatPipeline.builder(**otel.providers)
            .use_circuit_breaker(fail_max=5, reset_timeout=0.2, name=f"chaos-r{k}")
            .use_retry(max_attempts=2, initial_delay=0.0, jitter=False)
            .build(client, name=f"r{k}")
        )
        routes.append(Route(f"r{k}", guarded))
    # Generous limits: a hang costs attempt_timeout, and nothing here depends on speed
    # (on a slow machine more attempts are cut, which the invariants cover too).
    router = Recorder(routes, attempt_timeout=2.0, request_timeout=30.0, **otel.providers)
    chat = ChatPipeline.builder(**otel.providers).use_telemetry().use_failover(router).build()

    outcomes = [
        Outcome(
            request=f"req-{i}",
            streaming=i % 2 == 1,
            cancel_after=rng.randint(1, 3) if rng.random() < 0.1 else None,
        )
        for i in range(REQUESTS)
    ]
    gate = asyncio.Semaphore(CONCURRENCY)

    async def run(outcome: Outcome) -> None:
        async with gate:
            await one_request(chat, outcome)

    started = time.monotonic()
    async with asyncio.timeout(600):  # bounded: the run takes seconds on a quiet machine
        await asyncio.gather(*(run(o) for o in outcomes))
    elapsed = time.monotonic() - started
    await chat.aclose()
    stats = (await http.get(f"{chaos_origin}/stats")).json()[seen:]
    await http.aclose()

    # 1. Every request: a whole answer from one upstream request, a pipeline error, or
    #    the caller's own cancellation. Partial streamed output is one request's prefix.
    answered = failed = cancelled = 0
    for outcome in outcomes:
        found = tokens(outcome.text)
        tags = {tag for tag, _ in found}
        assert len(tags) <= 1, f"{outcome.request}: output mixed from {sorted(tags)}"
        assert [i for _, i in found] == list(range(len(found))), "duplicated or missing output"
        if outcome.cancelled:
            cancelled += 1
            assert outcome.cancel_after is not None
        elif outcome.error is None:
            answered += 1
            assert len(found) == TOKENS, f"{outcome.request}: an incomplete answer"
        else:
            failed += 1
            assert isinstance(outcome.error, ChatPipelineError), repr(outcome.error)

    # 2. No attempt after committed output or after the caller cancelled.
    for outcome in outcomes:
        attempts = router.attempts.get(outcome.request, [])
        for attempt in attempts[:-1]:
            assert not attempt.output_committed, f"{outcome.request}: a backup after output"
            assert attempt.outcome != "canceled", f"{outcome.request}: a backup after cancel"
        if outcome.error is not None and attempts:
            assert attempts[-1].outcome in ("failed_before_output", "failed_after_output")

    # 3. Server-side requests against the attempts the spans report.
    spans = {
        format(s.context.span_id, "016x"): s for s in otel.attempt_spans() if s.context is not None
    }
    assert len(spans) == sum(len(a) for a in router.attempts.values())
    sent: dict[str, int] = {}
    for entry in stats:
        traceparent = entry["traceparent"]
        assert traceparent, "an upstream request outside any attempt"
        span_id = traceparent.split("-")[2]
        assert span_id in spans, "an upstream request no attempt span reports"
        sent[span_id] = sent.get(span_id, 0) + 1
    for span_id, span in spans.items():
        attributes = dict(span.attributes or {})
        retries = sum(1 for e in span.events if e.name == "chat_pipeline.retry")
        calls = sent.get(span_id, 0)
        assert calls <= 1 + retries, f"{span.name}: {calls} upstream calls, {retries} retries"
        if attributes.get("error.type") == CircuitOpenError.__name__:
            assert calls == 0, "a call went through an open breaker"
        if attributes["chat_pipeline.route.outcome"] == "completed":
            assert calls >= 1
    faults = {entry["fault"] for entry in stats}
    assert {"ok", "hang", "status_500", "cut_after_output", "in_band_error"} <= faults

    # 4. Nothing outlives the run.
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
    assert answered > 0 and cancelled > 0
    print(
        f"\nchaos: {REQUESTS} requests in {elapsed:.1f} s: {answered} answered, {failed} "
        f"failed with a pipeline error, {cancelled} cancelled by their caller; "
        f"{len(stats)} upstream requests for {len(spans)} attempts"
    )


async def test_a_hanging_primary_is_cut_then_skipped_once_its_breaker_opens(
    otel: Otel, streaming: bool
) -> None:
    async with (
        FakeOpenAIServer(default=FakeResponse(hang=True)) as primary_server,
        FakeOpenAIServer() as backup_server,
    ):
        primary = (
            ChatPipeline.builder()
            .use_circuit_breaker(fail_max=3, reset_timeout=60)
            .build(OpenAIChatClient("m", base_url=primary_server.base_url), name="primary")
        )
        backup = OpenAIChatClient("m", base_url=backup_server.base_url, name="backup")
        router = Recorder([Route("primary", primary), Route("backup", backup)], attempt_timeout=0.1)
        async with router:
            for i in range(8):
                result = await collect(
                    router, "hi", ChatOptions(session_id=f"h-{i}"), streaming=streaming
                )
                assert result.error is None and result.text == "Hello from the fake server."
        # Three hangs cut at the attempt limit opened the breaker; the rest never waited.
        # (A cut can come before a slow machine's request even reached the server, so the
        # server may have seen fewer than three; never more.)
        assert primary_server.count() <= 3
        assert backup_server.count() == 8
        errors = [type(router.attempts[f"h-{i}"][0].exception).__name__ for i in range(8)]
        assert errors == ["AttemptTimeoutError"] * 3 + ["CircuitOpenError"] * 5


# -- a hedged router, 1,000 requests in flight at once ------------------------------------------

HEDGED = 1000
# The request an attempt belongs to (the attempts' tasks inherit the request's context).
_REQUEST: contextvars.ContextVar[HedgedOutcome | None] = contextvars.ContextVar(
    "chaos_hedged_request", default=None
)


class HedgeRecorder(HedgingChatClient):
    """A hedging router that counts every attempt it reports, by route."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reported: dict[str, int] = {}

    def on_routing_update(
        self, context: RoutingContext, attempt: FailoverAttempt, is_terminal: bool
    ) -> None:
        self.reported[attempt.route_name] = self.reported.get(attempt.route_name, 0) + 1


@dataclass
class HedgedOutcome:
    request: str
    streaming: bool
    # "" (never), "turns" (after a few loop turns), "first" (after the first update) or
    # "stopping" (when an attempt of its starts shutting down: a losing hedge, mostly).
    cancel: str
    task: asyncio.Task[str] | None = None
    text: str = ""
    error: BaseException | None = None
    cancelled: bool = False


def chaotic(name: str, rng: random.Random) -> ScriptedChatClient:
    """A route that answers after a few milliseconds, fails before or after output, or
    hangs, at random; and that takes a few turns of the loop to stop when cancelled (a
    losing hedge being shut down while its caller cancels is the case that leaked)."""

    def step(messages: Any, options: Any) -> ScriptStep:
        roll = rng.random()
        delay = rng.uniform(0.0, 0.004)
        if roll < 0.6:
            return reply(f"{name}1 {name}2", chunks=[f"{name}1 ", f"{name}2"], delay=delay)
        if roll < 0.75:
            return fail(TransientProviderError("before"), delay=delay)
        if roll < 0.85:
            return fail_after([f"{name}1 "], TransientProviderError("after"), chunk_delay=delay)
        return reply("never", delay=3600.0)  # hangs, until cut or cancelled

    async def slow_to_stop(seconds: float) -> None:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            outcome = _REQUEST.get()
            if outcome is not None and outcome.cancel == "stopping" and outcome.task is not None:
                outcome.task.cancel()  # the caller leaves while this attempt stops
            for _ in range(rng.randint(1, 3)):
                await asyncio.sleep(0)
            raise

    return ScriptedChatClient(step, name=name, sleep=slow_to_stop)


async def one_hedged_request(chat: ChatPipeline, outcome: HedgedOutcome) -> None:
    async def consume() -> str:
        _REQUEST.set(outcome)
        if not outcome.streaming:
            return (await chat.get_response("hi")).text
        parts = []
        async for update in chat.get_streaming_response("hi"):
            parts.append(update.text)
            outcome.text = "".join(parts)
            if outcome.cancel == "first":
                assert outcome.task is not None
                outcome.task.cancel()
        return outcome.text

    outcome.task = request = asyncio.ensure_future(consume())
    if outcome.cancel == "turns":
        for _ in range(3):
            await asyncio.sleep(0)
        request.cancel()
    try:
        outcome.text = await request
    except asyncio.CancelledError:
        outcome.cancelled = True
    except Exception as exc:
        outcome.error = exc


@pytest.mark.timeout(120)
async def test_hedged_requests_with_random_cancels_leave_nothing_in_flight(otel: Otel) -> None:
    rng = random.Random(31)
    clients = {name: chaotic(name, rng) for name in ("a", "b", "c")}
    health = RouteHealth(outlier_latency_gap=1000.0, outlier_failure_gap=1.0)
    router = HedgeRecorder(
        [Route(name, client) for name, client in clients.items()],
        health=health,
        delay=0.002,
        max_hedged_attempts=2,
        budget=1.0,
        budget_burst=float(HEDGED),
        attempt_timeout=0.5,
        request_timeout=5.0,
        **otel.providers,
    )
    modes = ["", "", "", "", "", "turns", "first", "stopping", "stopping", "stopping"]
    outcomes = [
        HedgedOutcome(f"hedged-{i}", streaming=i % 2 == 1, cancel=rng.choice(modes))
        for i in range(HEDGED)
    ]
    chat = ChatPipeline.builder(**otel.providers).use_failover(router).build()
    started = time.monotonic()
    async with asyncio.timeout(60):  # bounded: all 1,000 in flight at once
        await asyncio.gather(*(one_hedged_request(chat, outcome) for outcome in outcomes))
    elapsed = time.monotonic() - started

    # Every answer came whole from one route; every failure is a pipeline error; only
    # requests whose callers cancel were cancelled.
    answered = cancelled = failed = 0
    for outcome in outcomes:
        words = outcome.text.split()
        assert len({word[0] for word in words}) <= 1, f"{outcome.request}: mixed output"
        if outcome.cancelled:
            cancelled += 1
            assert outcome.cancel, f"{outcome.request}: cancelled, though its caller did not"
        elif outcome.error is None:
            answered += 1
            assert [word[1:] for word in words] == ["1", "2"], outcome.text
        else:
            failed += 1
            assert isinstance(outcome.error, ChatPipelineError), repr(outcome.error)
    # Every route is idle again; every attempt was reported and its span ended.
    assert {name: stats.in_flight for name, stats in health.snapshot().items()} == {
        name: 0 for name in clients
    }
    calls = {name: client.call_count for name, client in clients.items()}
    assert router.reported == calls
    spans = collections.Counter(span.name for span in otel.attempt_spans())
    assert spans == {f"route_attempt {name}": count for name, count in calls.items()}
    for client in clients.values():
        assert client.streams_closed == client.streams_opened
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
    hedges = otel.total("chat_pipeline.route.hedges.started")
    assert answered > 0 and cancelled > 0 and hedges > 0
    await chat.aclose()
    print(
        f"\nhedged chaos: {HEDGED} requests at once in {elapsed:.1f} s: {answered} answered, "
        f"{failed} failed, {cancelled} cancelled; {sum(calls.values())} attempts, "
        f"{hedges} hedges"
    )
