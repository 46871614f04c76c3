import asyncio

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from middleware.retry import RETRY_EVENT, RetryChatClient, RetrySettings
from middleware.routing import OrderedFailoverChatClient, Route
from pipeline import ChatPipeline
from pipeline.errors import (
    CircuitOpenError,
    RateLimitedError,
    RequestInvalidError,
    TransientProviderError,
)
from pipeline.testing import ScriptedChatClient, collect, fail, fail_after, hang, reply


class FakeTime:
    """A clock and a sleep that advances it, so delays are checked without waiting."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def retrying(client: ScriptedChatClient, fake: FakeTime, **policy: object) -> RetryChatClient:
    policy.setdefault("jitter", False)
    return RetryChatClient(client, RetrySettings(sleep=fake.sleep, **policy))  # type: ignore[arg-type]


async def test_transient_failures_are_retried_with_backoff(streaming: bool) -> None:
    fake = FakeTime()
    inner = ScriptedChatClient(
        [fail(TransientProviderError()), fail(TransientProviderError()), reply("ok")]
    )
    result = await collect(retrying(inner, fake, initial_delay=0.5), "hi", streaming=streaming)
    assert result.text == "ok"
    assert inner.call_count == 3
    assert fake.sleeps == [0.5, 1.0]


async def test_retry_after_is_honoured(streaming: bool) -> None:
    fake = FakeTime()
    inner = ScriptedChatClient(
        [fail(RateLimitedError(status_code=429, retry_after=7.0)), reply("ok")]
    )
    result = await collect(retrying(inner, fake), "hi", streaming=streaming)
    assert result.text == "ok"
    assert fake.sleeps == [7.0]


async def test_retry_after_beyond_the_cap_gives_up_at_once(streaming: bool) -> None:
    fake = FakeTime()
    error = RateLimitedError(retry_after=120.0)
    inner = ScriptedChatClient([fail(error), reply("ok")])
    result = await collect(retrying(inner, fake, max_retry_after=30.0), "hi", streaming=streaming)
    assert result.error is error
    assert inner.call_count == 1 and fake.sleeps == []


async def test_retry_after_ignored_when_asked(streaming: bool) -> None:
    fake = FakeTime()
    inner = ScriptedChatClient([fail(RateLimitedError(retry_after=120.0)), reply("ok")])
    client = retrying(inner, fake, respect_retry_after=False, initial_delay=0.25)
    assert (await collect(client, "hi", streaming=streaming)).text == "ok"
    assert fake.sleeps == [0.25]


async def test_gives_up_after_max_attempts_with_the_last_error(streaming: bool) -> None:
    fake = FakeTime()
    errors = [TransientProviderError() for _ in range(3)]
    inner = ScriptedChatClient([fail(e) for e in errors])
    result = await collect(retrying(inner, fake, max_attempts=3), "hi", streaming=streaming)
    assert result.error is errors[2]
    assert inner.call_count == 3


@pytest.mark.parametrize(
    "error", [RequestInvalidError(status_code=400), CircuitOpenError(), ValueError("bug")]
)
async def test_request_errors_are_not_retried(streaming: bool, error: Exception) -> None:
    fake = FakeTime()
    inner = ScriptedChatClient([fail(error), reply("ok")])
    result = await collect(retrying(inner, fake), "hi", streaming=streaming)
    assert result.error is error
    assert inner.call_count == 1


async def test_stream_is_not_retried_after_its_first_update() -> None:
    fake = FakeTime()
    error = TransientProviderError()
    inner = ScriptedChatClient([fail_after(["partial"], error), reply("again")])
    result = await collect(retrying(inner, fake), "hi", streaming=True)
    assert result.error is error
    assert [u.text for u in result.updates] == ["partial"]
    assert inner.call_count == 1


async def test_empty_stream_is_returned_as_is() -> None:
    inner = ScriptedChatClient(reply(""))
    result = await collect(retrying(inner, FakeTime()), "hi", streaming=True)
    assert result.error is None and result.updates == []
    assert inner.streams_closed == 1


async def test_abandoning_a_retried_stream_closes_the_inner_one() -> None:
    inner = ScriptedChatClient([fail(TransientProviderError()), reply("ab", chunks=["a", "b"])])
    stream = retrying(inner, FakeTime()).get_streaming_response("hi")
    assert (await anext(stream)).text == "a"
    await stream.aclose()
    assert inner.streams_abandoned == 1
    assert inner.streams_opened == inner.streams_closed == 2


async def test_caller_cancellation_is_never_retried(streaming: bool) -> None:
    inner = ScriptedChatClient([hang(), reply("ok")])
    task = asyncio.create_task(collect(retrying(inner, FakeTime()), "hi", streaming=streaming))
    await inner.wait_for_calls(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert inner.call_count == 1


async def test_each_retry_is_a_span_event_without_content(streaming: bool) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    inner = ScriptedChatClient([fail(TransientProviderError("CANARY-retry")), reply("ok")])
    with tracer.start_as_current_span("request"):
        await collect(retrying(inner, FakeTime(), initial_delay=0.5), "CANARY", streaming=streaming)
    (span,) = exporter.get_finished_spans()
    (event,) = span.events
    assert event.name == RETRY_EVENT
    assert dict(event.attributes or {}) == {
        "error.type": "TransientProviderError",
        "chat_pipeline.retry.attempt": 2,
        "chat_pipeline.retry.delay": 0.5,
    }
    assert "CANARY" not in repr(span.to_json())


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="max_attempts must be at least 1"):
        RetrySettings(max_attempts=0)
    with pytest.raises(TypeError, match="max_attempts must be an int"):
        RetrySettings(max_attempts=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="initial_delay"):
        RetrySettings(initial_delay=-1)
    with pytest.raises(ValueError, match="max_delay must not be less"):
        RetrySettings(initial_delay=2, max_delay=1)
    with pytest.raises(TypeError, match="retry_on"):
        RetrySettings(retry_on=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ChatPipeline.builder().use_retry(max_attempts=0)


async def test_retries_count_against_the_routers_provider_call_budget(streaming: bool) -> None:
    fake = FakeTime()
    primary = ScriptedChatClient(fail(TransientProviderError()), name="primary")
    backup = ScriptedChatClient(reply("backup"), name="backup")
    primary_route = (
        ChatPipeline.builder()
        .use_retry(max_attempts=5, jitter=False, sleep=fake.sleep)
        .build(primary)
    )
    router = OrderedFailoverChatClient(
        [Route("primary", primary_route), Route("backup", backup)],
        max_provider_calls_per_request=3,
    )
    result = await collect(router, "hi", streaming=streaming)
    assert isinstance(result.error, TransientProviderError)
    assert primary.call_count == 3
    assert backup.call_count == 0


async def test_retry_stops_before_the_request_deadline(streaming: bool) -> None:
    fake = FakeTime()
    primary = ScriptedChatClient(fail(TransientProviderError()), name="primary")
    backup = ScriptedChatClient(reply("backup"), name="backup")
    route = RetryChatClient(
        primary,
        RetrySettings(
            max_attempts=10, initial_delay=4.0, max_delay=4.0, jitter=False, sleep=fake.sleep
        ),
    )
    router = OrderedFailoverChatClient(
        [Route("primary", route), Route("backup", backup)],
        request_timeout=10.0,
        min_attempt_budget=1.0,
        clock=fake.clock,
    )
    result = await collect(router, "hi", streaming=streaming)
    # 0s try, sleep 4, 4s try, sleep 4, 8s try; a third sleep would pass the deadline.
    assert primary.call_count == 3 and fake.sleeps == [4.0, 4.0]
    # 2 seconds were left, more than min_attempt_budget: the backup still gets its turn.
    assert result.text == "backup"


async def test_no_attempt_starts_below_min_attempt_budget(streaming: bool) -> None:
    fake = FakeTime()
    # The first attempt uses 9.5 of the request's 10 seconds, then fails before output.
    primary = ScriptedChatClient(
        fail(TransientProviderError(), delay=9.5), sleep=fake.sleep, name="primary"
    )
    backup = ScriptedChatClient(reply("backup"), name="backup")
    router = OrderedFailoverChatClient(
        [primary, backup], request_timeout=10.0, min_attempt_budget=1.0, clock=fake.clock
    )
    result = await collect(router, "hi", streaming=streaming)
    assert isinstance(result.error, TransientProviderError)
    assert backup.call_count == 0


async def test_request_timeout_bounds_a_hanging_route(streaming: bool) -> None:
    primary = ScriptedChatClient(hang(), name="primary")
    backup = ScriptedChatClient(reply("backup"), name="backup")
    router = OrderedFailoverChatClient([primary, backup], request_timeout=0.05)
    result = await collect(router, "hi", streaming=streaming)
    # The whole request's time went to the primary: no time is left for the backup.
    assert isinstance(result.error, TimeoutError)
    assert backup.call_count == 0


async def test_a_raw_http_status_error_has_its_retry_after_honoured(streaming: bool) -> None:
    import httpx2

    request = httpx2.Request("POST", "http://127.0.0.1:9/v1/chat/completions")
    response = httpx2.Response(429, headers={"Retry-After": "2"}, request=request)
    raw = httpx2.HTTPStatusError("429", request=request, response=response)
    inner = ScriptedChatClient([fail(raw), reply("ok")])
    fake = FakeTime()
    result = await collect(retrying(inner, fake, initial_delay=0.1), "hi", streaming=streaming)
    assert result.text == "ok"
    assert fake.sleeps == [2.0]
