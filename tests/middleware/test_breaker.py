import asyncio
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from middleware.breaker import STATE_CHANGE_EVENT, STATE_CHANGE_METRIC, CircuitBreakerChatClient
from middleware.routing import OrderedFailoverChatClient, Route
from pipeline import ChatPipeline
from pipeline.errors import (
    CircuitOpenError,
    ContentFilteredError,
    RequestInvalidError,
    TransientProviderError,
)
from pipeline.testing import ScriptedChatClient, collect, fail, fail_after, hang, reply
from tests.otel import Otel


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
    client = CircuitBreakerChatClient(
        inner,
        now=now or FakeNow(),
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
