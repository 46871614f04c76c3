import asyncio
import contextlib
import gc
import random
import weakref

import pytest

from middleware.routing import (
    FailoverAttempt,
    FailoverChatClient,
    OrderedFailoverChatClient,
    Route,
    RoutingContext,
    RoutingSelection,
)
from middleware.routing._engine import AttemptState
from pipeline import ChatMessage, ChatOptions, ChatPipeline, _scope
from pipeline._retry_signal import signal_of as retry_signal_of
from pipeline.errors import (
    CircuitOpenError,
    RateLimitedError,
    RequestInvalidError,
    RoutingError,
    TransientProviderError,
)
from pipeline.providers import OpenAIChatClient
from pipeline.testing import (
    FakeOpenAIServer,
    FakeResponse,
    ScriptedChatClient,
    collect,
    fail,
    fail_after,
    hang,
    reply,
)

from .conftest import RecordingFailover


def routes(*scripts: object) -> list[ScriptedChatClient]:
    return [ScriptedChatClient(s, name=f"r{i}") for i, s in enumerate(scripts)]  # type: ignore[arg-type]


async def test_primary_succeeds_one_invocation_no_backup(streaming: bool) -> None:
    primary, backup = routes(reply("ab", chunks=["a", "b"]), reply("backup"))
    router = RecordingFailover([primary, backup])
    result = await collect(router, "hi", streaming=streaming)
    assert result.error is None and result.text == "ab"
    assert (primary.call_count, backup.call_count) == (1, 0)
    assert router.summary() == [("r0", "completed", True)]
    attempt = router.updates[0][0]
    assert attempt.response_completed and attempt.output_committed
    assert attempt.exception is None and attempt.number == 1
    assert attempt.time_to_first_update is not None


async def test_failure_before_output_fails_over_once(streaming: bool) -> None:
    error = TransientProviderError()
    primary, backup = routes(fail(error), reply("xy", chunks=["x", "y"]))
    router = RecordingFailover([primary, backup])
    result = await collect(router, "hi", streaming=streaming)
    assert result.error is None
    assert [u.text for u in result.updates] == (["x", "y"] if streaming else ["xy"])
    assert (primary.call_count, backup.call_count) == (1, 1)
    assert router.summary() == [
        ("r0", "failed_before_output", False),
        ("r1", "completed", True),
    ]
    first = router.updates[0][0]
    assert first.exception is error
    assert not first.output_committed and first.time_to_first_update is None
    assert [a.number for a, _ in router.updates] == [1, 2]


async def test_stream_failure_after_output_is_terminal() -> None:
    error = TransientProviderError()
    primary, backup = routes(fail_after(["partial"], error), reply("backup"))
    router = RecordingFailover([primary, backup])
    received: list[str] = []
    with pytest.raises(TransientProviderError) as caught:
        async for update in router.get_streaming_response("hi"):
            received.append(update.text)
    assert caught.value is error
    assert received == ["partial"]
    assert backup.call_count == 0
    assert router.summary() == [("r0", "failed_after_output", True)]
    attempt = router.updates[0][0]
    assert attempt.output_committed and attempt.time_to_first_update is not None
    assert any("'r0' failed after output was committed" in n for n in error.__notes__)


async def test_non_streaming_failure_is_always_before_output() -> None:
    # A non-streaming call returns nothing until it completes, so a failure never commits.
    primary, backup = routes(fail_after(["partial"], TransientProviderError()), reply("b"))
    router = RecordingFailover([primary, backup])
    assert (await router.get_response("hi")).text == "b"
    assert router.summary()[0][1] == "failed_before_output"


@pytest.mark.parametrize("how", ["cancel", "timeout"])
async def test_caller_cancellation_is_terminal(streaming: bool, how: str) -> None:
    primary, backup = routes(hang(), reply("backup"))
    router = RecordingFailover([primary, backup])

    async def call() -> object:
        if how == "timeout":
            async with asyncio.timeout(0):
                return await collect(router, "hi", streaming=streaming)
        return await collect(router, "hi", streaming=streaming)

    task = asyncio.create_task(call())
    if how == "cancel":
        await primary.wait_for_calls(1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        with pytest.raises(TimeoutError):
            await task
    assert backup.call_count == 0
    assert router.summary() == [("r0", "canceled", True)]
    assert isinstance(router.updates[0][0].exception, asyncio.CancelledError)
    if streaming:
        assert primary.streams_closed == 1


async def test_caller_cancelling_after_output_is_canceled_and_committed() -> None:
    primary, backup = routes(hang(after=["first"]), reply("backup"))
    router = RecordingFailover([primary, backup])
    received: list[str] = []

    async def consume() -> None:
        async for update in router.get_streaming_response("hi"):
            received.append(update.text)
            first_update.set()

    first_update = asyncio.Event()
    task = asyncio.create_task(consume())
    await first_update.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert received == ["first"]
    assert backup.call_count == 0
    assert router.summary() == [("r0", "canceled", True)]
    assert router.updates[0][0].output_committed
    assert primary.streams_closed == 1


async def test_client_raised_cancelled_error_may_fail_over(streaming: bool) -> None:
    primary, backup = routes(fail(asyncio.CancelledError()), reply("b"))
    router = RecordingFailover([primary, backup])
    result = await collect(router, "hi", streaming=streaming)
    assert result.text == "b"
    assert router.summary() == [("r0", "failed_before_output", False), ("r1", "completed", True)]


async def test_attempt_cap_leaves_later_routes_untouched(streaming: bool) -> None:
    errors = [TransientProviderError(f"e{i}") for i in range(3)]
    clients = routes(fail(errors[0]), fail(errors[1]), fail(errors[2]), reply("never"))
    router = RecordingFailover(clients, max_attempts_per_request=2)
    result = await collect(router, "hi", streaming=streaming)
    assert result.error is errors[1]
    assert [c.call_count for c in clients] == [1, 1, 0, 0]
    assert router.summary() == [
        ("r0", "failed_before_output", False),
        ("r1", "failed_before_output", True),
    ]


async def test_all_routes_fail_reraises_the_last(streaming: bool) -> None:
    errors = [TransientProviderError(), TransientProviderError()]
    router = RecordingFailover(routes(fail(errors[0]), fail(errors[1])))
    result = await collect(router, "hi", streaming=streaming)
    assert result.error is errors[1]
    assert router.summary()[-1] == ("r1", "failed_before_output", True)


@pytest.mark.parametrize(
    ("errors", "wait", "rate_limited"),
    [
        # A route said when (30 s), the last one failed without a word: 30 s.
        ((RateLimitedError(retry_after=30.0), TransientProviderError()), 30.0, False),
        # The earliest time wins.
        ((TransientProviderError(retry_after=60.0), RateLimitedError(retry_after=5.0)), 5.0, False),
        ((CircuitOpenError(retry_after=12.0), TransientProviderError()), 12.0, False),
        # A rate limit that gave no time is said apart (the gateway waits its own time).
        ((RateLimitedError(), TransientProviderError()), None, True),
        ((TransientProviderError(), TransientProviderError()), None, False),
    ],
)
async def test_the_failure_carries_what_every_attempt_said(
    streaming: bool, errors: tuple[Exception, ...], wait: float | None, rate_limited: bool
) -> None:
    router = OrderedFailoverChatClient(routes(*(fail(error) for error in errors)))
    result = await collect(router, "hi", streaming=streaming)
    assert result.error is errors[-1]  # the last failure, as ever
    signal = retry_signal_of(result.error)
    said = signal.wait()
    assert (said is None) is (wait is None)
    if wait is not None:
        assert said is not None and wait - 1.0 <= said <= wait
    assert signal.rate_limited is rate_limited


async def test_nested_routers_pass_every_attempts_word_up(streaming: bool) -> None:
    inner = OrderedFailoverChatClient(
        routes(fail(RateLimitedError(retry_after=20.0)), fail(TransientProviderError()))
    )
    outer = OrderedFailoverChatClient(
        [Route("inner", inner), Route("last", ScriptedChatClient(fail(TransientProviderError())))]
    )
    result = await collect(outer, "hi", streaming=streaming)
    said = retry_signal_of(result.error).wait()
    assert said is not None and 19.0 <= said <= 20.0


@pytest.mark.parametrize("bad", [0, -1])
def test_max_attempts_rejects_zero_and_negatives(bad: int) -> None:
    with pytest.raises(ValueError, match="max_attempts_per_request must be positive"):
        OrderedFailoverChatClient([ScriptedChatClient()], max_attempts_per_request=bad)
    router = OrderedFailoverChatClient([ScriptedChatClient()])
    with pytest.raises(ValueError):
        router.max_attempts_per_request = bad
    with pytest.raises(TypeError):
        router.max_attempts_per_request = 1.5  # type: ignore[assignment]


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="at least one route"):
        OrderedFailoverChatClient([])
    with pytest.raises(TypeError, match=r"routes\[1\] must be a ChatClient"):
        OrderedFailoverChatClient([ScriptedChatClient(), "nope"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="sequence"):
        OrderedFailoverChatClient(ScriptedChatClient())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="request_timeout"):
        OrderedFailoverChatClient([ScriptedChatClient()], request_timeout=0)
    with pytest.raises(ValueError, match="min_attempt_budget"):
        OrderedFailoverChatClient([ScriptedChatClient()], min_attempt_budget=-1)
    with pytest.raises(TypeError, match="should_failover"):
        OrderedFailoverChatClient([ScriptedChatClient()], should_failover=3)  # type: ignore[arg-type]


async def test_caller_closing_the_stream_abandons_the_attempt() -> None:
    primary, backup = routes(reply("abc", chunks=["a", "b", "c"]), reply("b"))
    router = RecordingFailover([primary, backup])
    async with contextlib.aclosing(router.get_streaming_response("hi")) as stream:
        assert (await anext(stream)).text == "a"
    assert primary.streams_abandoned == 1 and primary.streams_closed == 1
    assert backup.call_count == 0
    assert router.summary() == [("r0", "abandoned", True)]
    attempt = router.updates[0][0]
    assert attempt.output_committed and not attempt.response_completed


async def test_caller_closing_the_stream_past_its_first_update_abandons_the_attempt() -> None:
    # Past the first update the engine reads a plain stream in a loop of its own.
    primary, backup = routes(reply("abc", chunks=["a", "b", "c"]), reply("b"))
    router = RecordingFailover([primary, backup])
    async with contextlib.aclosing(router.get_streaming_response("hi")) as stream:
        assert [(await anext(stream)).text for _ in range(2)] == ["a", "b"]
    assert primary.streams_abandoned == 1 and primary.streams_closed == 1
    assert backup.call_count == 0
    assert router.summary() == [("r0", "abandoned", True)]


async def test_a_failure_past_the_second_update_is_terminal_and_keeps_the_output() -> None:
    error = TransientProviderError("reset")
    primary, backup = routes(fail_after(["a", "b"], error), reply("backup"))
    router = RecordingFailover([primary, backup])
    result = await collect(router, "hi", streaming=True)
    assert result.error is error and [u.text for u in result.updates] == ["a", "b"]
    assert router.summary() == [("r0", "failed_after_output", True)]
    assert primary.streams_closed == 1 and backup.call_count == 0
    attempt = router.updates[0][0]
    assert attempt.output_committed and attempt.time_to_first_update is not None


async def test_stream_creation_failure_may_fail_over() -> None:
    class Broken(ScriptedChatClient):
        def get_streaming_response(self, messages, options=None):  # type: ignore[no-untyped-def]
            raise TransientProviderError("cannot open")

    broken = Broken(name="broken")
    backup = ScriptedChatClient(reply("b"), name="backup")
    router = RecordingFailover([broken, backup])
    result = await collect(router, "hi", streaming=True)
    assert result.text == "b"
    assert router.summary() == [
        ("broken", "failed_before_output", False),
        ("backup", "completed", True),
    ]


async def test_empty_stream_completes_without_committing() -> None:
    primary, backup = routes(reply(""), reply("b"))
    router = RecordingFailover([primary, backup])
    result = await collect(router, "hi", streaming=True)
    assert result.error is None and result.updates == []
    assert backup.call_count == 0
    attempt, terminal = router.updates[0]
    assert (attempt.outcome, terminal, attempt.output_committed) == ("completed", True, False)
    assert attempt.response_completed and attempt.time_to_first_update is None


async def test_close_failure_of_an_empty_stream_is_pre_output_and_fails_over() -> None:
    close_error = TransientProviderError("close")
    primary, backup = routes(reply("").failing_on_close(close_error), reply("b"))
    router = RecordingFailover([primary, backup])
    result = await collect(router, "hi", streaming=True)
    assert result.text == "b"
    assert router.updates[0][0].exception is close_error
    assert router.summary()[0] == ("r0", "failed_before_output", False)


async def test_close_failure_after_output_is_terminal() -> None:
    close_error = TransientProviderError("close")
    primary, backup = routes(reply("a").failing_on_close(close_error), reply("b"))
    router = RecordingFailover([primary, backup])
    result = await collect(router, "hi", streaming=True)
    assert result.error is close_error
    assert [u.text for u in result.updates] == ["a"]
    assert router.summary() == [("r0", "failed_after_output", True)]
    assert backup.call_count == 0


async def test_close_failure_on_abandon_is_raised_and_recorded() -> None:
    close_error = OSError("close")
    primary = ScriptedChatClient(reply("ab", chunks=["a", "b"]).failing_on_close(close_error))
    router = RecordingFailover([primary])
    stream = router.get_streaming_response("hi")
    await anext(stream)
    with pytest.raises(OSError) as caught:
        await stream.aclose()
    assert caught.value is close_error
    assert router.updates[0][0].exception is close_error
    assert router.summary() == [("scripted", "abandoned", True)]


async def test_selector_raising_or_returning_none_reports_no_attempt(streaming: bool) -> None:
    class Policy(FailoverChatClient):
        def __init__(self, result: object) -> None:
            super().__init__()
            self.result = result
            self.updates: list[FailoverAttempt] = []

        async def select_client(self, context: RoutingContext):  # type: ignore[no-untyped-def]
            if isinstance(self.result, BaseException):
                raise self.result
            return self.result

        def on_routing_update(self, context, attempt, is_terminal):  # type: ignore[no-untyped-def]
            self.updates.append(attempt)

    boom = LookupError("selector")
    raising = Policy(boom)
    result = await collect(raising, "hi", streaming=streaming)
    assert result.error is boom and raising.updates == []
    empty = Policy(None)
    result = await collect(empty, "hi", streaming=streaming)
    assert isinstance(result.error, RoutingError) and empty.updates == []


async def test_update_raising_on_terminal_replaces_the_result(streaming: bool) -> None:
    replacement = KeyError("policy")

    class Policy(OrderedFailoverChatClient):
        def on_routing_update(self, context, attempt, is_terminal):  # type: ignore[no-untyped-def]
            if is_terminal:
                raise replacement

    router = Policy(routes(reply("a")))
    result = await collect(router, "hi", streaming=streaming)
    assert result.error is replacement


async def test_update_raising_on_nonterminal_stops_routing(streaming: bool) -> None:
    stop = KeyError("stop")
    seen: list[bool] = []

    class Policy(OrderedFailoverChatClient):
        def on_routing_update(self, context, attempt, is_terminal):  # type: ignore[no-untyped-def]
            seen.append(is_terminal)
            if not is_terminal:
                raise stop

    primary, backup = routes(fail(TransientProviderError()), reply("b"))
    result = await collect(Policy([primary, backup]), "hi", streaming=streaming)
    assert result.error is stop
    assert seen == [False]
    assert backup.call_count == 0


async def test_selection_options_apply_to_one_attempt_only(streaming: bool) -> None:
    primary, backup = routes(fail(TransientProviderError()), reply("b"))
    caller_options = ChatOptions(temperature=0.5, additional_properties={"k": 1})

    class Policy(FailoverChatClient):
        def __init__(self) -> None:
            super().__init__(max_attempts_per_request=2)
            self.baselines: list[ChatOptions] = []

        async def select_client(self, context: RoutingContext):  # type: ignore[no-untyped-def]
            self.baselines.append(context.options.clone())
            if not context.attempts:
                assert context.options is not caller_options
                shaped = context.options.clone()
                shaped.model_id = "special"
                shaped.additional_properties["k"] = 2
                context.messages.append(ChatMessage.system("added by selector"))
                return RoutingSelection(primary, shaped)
            return backup

    policy = Policy()
    result = await collect(policy, "hi", caller_options, streaming=streaming)
    assert result.text == "b"
    first, second = primary.calls[0], backup.calls[0]
    assert first.options is not None and first.options.model_id == "special"
    assert second.options is not None and second.options.model_id is None
    assert second.options.additional_properties == {"k": 1}
    assert policy.baselines[0] == policy.baselines[1] == caller_options
    assert caller_options == ChatOptions(temperature=0.5, additional_properties={"k": 1})
    assert [m.text for m in first.messages] == ["hi", "added by selector"]
    assert [m.text for m in second.messages] == ["hi", "added by selector"]


async def test_caller_messages_list_is_never_changed(streaming: bool) -> None:
    messages = [ChatMessage.user("hi")]

    def selector(context: RoutingContext) -> ScriptedChatClient:
        context.messages.append(ChatMessage.system("x"))
        return client

    from middleware.routing import RoutingChatClient

    client = ScriptedChatClient()
    await collect(RoutingChatClient.create(selector), messages, streaming=streaming)
    assert len(messages) == 1
    assert len(client.calls[0].messages) == 2


async def test_attempt_options_never_leak_between_attempts(streaming: bool) -> None:
    class Mutating(ScriptedChatClient):
        async def get_response(self, messages, options=None):  # type: ignore[no-untyped-def]
            assert options is not None
            options.additional_properties["leak"] = True
            return await super().get_response(messages, options)

        def get_streaming_response(self, messages, options=None):  # type: ignore[no-untyped-def]
            assert options is not None
            options.additional_properties["leak"] = True
            return super().get_streaming_response(messages, options)

    first = Mutating(fail(TransientProviderError()), name="m")
    second = ScriptedChatClient(reply("ok"), name="s")
    await collect(OrderedFailoverChatClient([first, second]), "hi", streaming=streaming)
    assert second.calls[0].options_snapshot is not None
    assert "leak" not in second.calls[0].options_snapshot.additional_properties


async def test_repeated_client_is_tried_once_per_position(streaming: bool) -> None:
    flaky = ScriptedChatClient([fail(TransientProviderError()), reply("second try")], name="f")
    router = RecordingFailover([Route("first", flaky), Route("again", flaky)])
    result = await collect(router, "hi", streaming=streaming)
    assert result.text == "second try"
    assert flaky.call_count == 2
    assert [a.route_name for a, _ in router.updates] == ["first", "again"]


async def test_request_errors_do_not_fail_over(streaming: bool) -> None:
    error = RequestInvalidError(status_code=400)
    primary, backup = routes(fail(error), reply("b"))
    router = RecordingFailover([primary, backup])
    result = await collect(router, "hi", streaming=streaming)
    assert result.error is error
    assert backup.call_count == 0
    assert router.summary() == [("r0", "failed_before_output", True)]


async def test_custom_should_failover(streaming: bool) -> None:
    primary, backup = routes(fail(TransientProviderError()), reply("b"))
    router = RecordingFailover([primary, backup], should_failover=lambda exc: False)
    result = await collect(router, "hi", streaming=streaming)
    assert isinstance(result.error, TransientProviderError) and backup.call_count == 0


async def test_leave_open_and_each_owned_client_closed_once() -> None:
    shared, other = ScriptedChatClient(name="a"), ScriptedChatClient(name="b")
    router = OrderedFailoverChatClient([shared, other, Route("again", shared)])
    await router.aclose()
    await router.aclose()
    assert (shared.close_count, other.close_count) == (1, 1)
    kept = ScriptedChatClient()
    async with OrderedFailoverChatClient([kept], leave_open=True):
        pass
    assert kept.close_count == 0


async def test_close_failures_do_not_stop_closing_the_rest() -> None:
    class BadClose(ScriptedChatClient):
        async def aclose(self) -> None:
            await super().aclose()
            raise OSError("close")

    bad, good = BadClose(name="bad"), ScriptedChatClient(name="good")
    with pytest.raises(OSError):
        await OrderedFailoverChatClient([bad, good]).aclose()
    assert good.close_count == 1


async def test_nested_routers_return_the_leaf_response(streaming: bool) -> None:
    leaf_fail, leaf_ok, outer_backup = routes(
        fail(TransientProviderError()), reply("leaf", chunks=["le", "af"]), reply("outer")
    )
    inner = RecordingFailover([leaf_fail, leaf_ok], name="inner")
    outer = RecordingFailover([Route("inner", inner), outer_backup])
    result = await collect(outer, "hi", streaming=streaming)
    assert result.text == "leaf"
    assert outer_backup.call_count == 0
    assert outer.summary() == [("inner", "completed", True)]
    assert inner.summary() == [
        ("r0", "failed_before_output", False),
        ("r1", "completed", True),
    ]


async def test_duration_excludes_caller_time_and_ttfu_marks_commitment() -> None:
    now = [0.0]

    def clock() -> float:
        return now[0]

    async def ticking_sleep(seconds: float) -> None:
        now[0] += seconds

    primary = ScriptedChatClient(
        reply("abc", chunks=["a", "b", "c"], chunk_delay=1.0), sleep=ticking_sleep
    )
    router = RecordingFailover([primary], clock=clock)
    async for _ in router.get_streaming_response("hi"):
        now[0] += 100.0  # the caller takes its time between updates
    attempt = router.updates[0][0]
    assert attempt.duration == pytest.approx(2.0)
    assert attempt.time_to_first_update == pytest.approx(0.0)


async def test_ttfu_counts_only_route_time_before_first_update() -> None:
    now = [0.0]

    async def ticking_sleep(seconds: float) -> None:
        now[0] += seconds

    slow_fail = ScriptedChatClient(
        fail_after(["x"], TransientProviderError(), chunk_delay=5.0), sleep=ticking_sleep
    )
    router = RecordingFailover([slow_fail], clock=lambda: now[0])
    with pytest.raises(TransientProviderError):
        async for _ in router.get_streaming_response("hi"):
            now[0] += 7.0
    attempt = router.updates[0][0]
    assert attempt.time_to_first_update == 0.0
    assert attempt.duration == 0.0


async def test_state_is_released_after_many_mixed_concurrent_requests() -> None:
    rng = random.Random(7)
    # Fresh exceptions per call, as real clients raise them: a shared instance would keep
    # the traceback of its last raise (and so one request's frames) alive on purpose.
    scripts = [
        lambda: reply("ok", chunks=["o", "k"]),
        lambda: fail(TransientProviderError()),
        lambda: fail_after(["p"], TransientProviderError()),
        lambda: fail(RequestInvalidError()),
    ]
    primary = ScriptedChatClient(lambda m, o: rng.choice(scripts)(), name="primary")
    backup = ScriptedChatClient(reply("b"), name="backup")
    router = RecordingFailover([primary, backup])
    refs: list[weakref.ref[RoutingContext]] = []

    async def one(i: int) -> None:
        mode = i % 4
        if mode == 0:
            await collect(router, "hi", streaming=False)
        elif mode == 1:
            await collect(router, "hi", streaming=True)
        elif mode == 2:  # abandoned after the first update (or failure)
            with contextlib.suppress(Exception):
                async with contextlib.aclosing(router.get_streaming_response("hi")) as stream:
                    await anext(stream, None)
        else:  # cancelled while the selected route hangs
            gate = ScriptedChatClient(hang(), name="gate")
            local = RecordingFailover([gate, backup], leave_open=True)
            task = asyncio.create_task(collect(local, "hi", streaming=bool(i % 8 == 3)))
            await gate.wait_for_calls(1)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert local.summary() == [("gate", "canceled", True)]
            refs.extend(weakref.ref(c) for c in local.contexts)

    total = 10_000
    for start in range(0, total, 500):
        await asyncio.gather(*(one(i) for i in range(start, start + 500)))
        refs.extend(weakref.ref(c) for c in router.contexts)
        assert all(c.state == {} for c in router.contexts)
        router.contexts.clear()
        router.updates.clear()
    gc.collect()
    assert [r for r in refs if r() is not None] == []
    assert len(refs) == total
    assert primary.streams_opened == primary.streams_closed


async def test_concurrent_requests_have_independent_state(streaming: bool) -> None:
    release = asyncio.Event()
    all_waiting = asyncio.Event()
    waiting: list[RoutingContext] = []

    class Policy(FailoverChatClient):
        def __init__(self) -> None:
            super().__init__(max_attempts_per_request=3)

        async def select_client(self, context: RoutingContext):  # type: ignore[no-untyped-def]
            context.state["count"] = context.state.get("count", 0) + 1
            if context.state["count"] == 1:
                waiting.append(context)
                if len(waiting) == 20:
                    all_waiting.set()
                await release.wait()
                return failing
            return ok

    failing = ScriptedChatClient(fail(TransientProviderError()), name="failing")
    ok = ScriptedChatClient(lambda m, o: reply(m[-1].text), name="ok")
    policy = Policy()
    tasks = [asyncio.create_task(collect(policy, f"q{i}", streaming=streaming)) for i in range(20)]
    await all_waiting.wait()  # every request's first attempt is under way at once
    assert len({id(context.state) for context in waiting}) == 20
    release.set()
    results = await asyncio.gather(*tasks)
    assert [r.text for r in results] == [f"q{i}" for i in range(20)]
    assert failing.call_count == 20 and ok.call_count == 20


async def test_pipeline_around_failover(streaming: bool) -> None:
    primary, backup = routes(fail(TransientProviderError()), reply("b"))
    chat = ChatPipeline.builder().use_logging().use_ordered_failover([primary, backup]).build()
    assert (await collect(chat, "hi", streaming=streaming)).text == "b"
    await chat.aclose()
    assert primary.close_count == backup.close_count == 1


class AsyncPolicy(FailoverChatClient):
    """Every hook a coroutine function, each yielding to the loop before it answers."""

    def __init__(self, clients: list[ScriptedChatClient], **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.clients = clients
        self.updates: list[tuple[str, str, bool]] = []
        self.decisions: list[str] = []

    async def select_client(self, context: RoutingContext) -> ScriptedChatClient:
        await asyncio.sleep(0)
        return self.clients[len(context.attempts) % len(self.clients)]

    async def on_routing_update(
        self, context: RoutingContext, attempt: FailoverAttempt, is_terminal: bool
    ) -> None:
        await asyncio.sleep(0)
        self.updates.append((attempt.route_name, attempt.outcome, is_terminal))

    async def should_failover(self, context: RoutingContext, exception: BaseException) -> bool:
        await asyncio.sleep(0)
        self.decisions.append(type(exception).__name__)
        return isinstance(exception, TransientProviderError)


async def test_async_policy_hooks_are_awaited(streaming: bool) -> None:
    primary, backup = routes(fail(TransientProviderError()), reply("ok"))
    router = AsyncPolicy([primary, backup])
    result = await collect(router, "hi", streaming=streaming)
    assert result.error is None and result.text == "ok"
    assert router.updates == [("r0", "failed_before_output", False), ("r1", "completed", True)]
    assert router.decisions == ["TransientProviderError"]


async def test_async_should_failover_can_refuse(streaming: bool) -> None:
    error = RequestInvalidError()
    primary, backup = routes(fail(error), reply("never"))
    router = AsyncPolicy([primary, backup])
    result = await collect(router, "hi", streaming=streaming)
    assert result.error is error
    assert backup.call_count == 0
    assert router.updates == [("r0", "failed_before_output", True)]


async def test_async_should_failover_callable_on_ordered_router(streaming: bool) -> None:
    async def only_transient(exception: BaseException) -> bool:
        await asyncio.sleep(0)
        return isinstance(exception, TransientProviderError)

    first, second, third = routes(
        fail(TransientProviderError()), fail(RequestInvalidError()), reply("never")
    )
    router = RecordingFailover([first, second, third], should_failover=only_transient)
    result = await collect(router, "hi", streaming=streaming)
    assert isinstance(result.error, RequestInvalidError)
    assert [c.call_count for c in (first, second, third)] == [1, 1, 0]


async def test_a_runaway_policy_ends_at_the_default_cap(streaming: bool) -> None:
    from middleware.routing.failover import DEFAULT_MAX_ATTEMPTS

    errors = [TransientProviderError(f"e{i}") for i in range(DEFAULT_MAX_ATTEMPTS)]
    failing = ScriptedChatClient([fail(e) for e in errors], name="failing")
    router = AsyncPolicy([failing])
    result = await collect(router, "hi", streaming=streaming)
    assert result.error is errors[-1]
    assert failing.call_count == DEFAULT_MAX_ATTEMPTS == 10
    assert [terminal for _, _, terminal in router.updates] == [False] * 9 + [True]


async def test_no_attempt_limit_only_when_asked_explicitly(streaming: bool) -> None:
    flaky = ScriptedChatClient(
        [fail(TransientProviderError()) for _ in range(14)] + [reply("finally")], name="flaky"
    )
    router = AsyncPolicy([flaky], max_attempts_per_request=None)
    result = await collect(router, "hi", streaming=streaming)
    assert result.text == "finally"
    assert flaky.call_count == 15


def test_failover_settings_are_validated_once() -> None:
    with pytest.raises(ValueError, match="max_attempts_per_request must be positive, got 0"):
        AsyncPolicy([], max_attempts_per_request=0)
    with pytest.raises(ValueError, match="unknown setting; did you mean 'request_timeout'"):
        AsyncPolicy([], request_timout=3)


async def test_a_hanging_route_is_cut_by_the_attempt_timeout(streaming: bool) -> None:
    from pipeline.errors import AttemptTimeoutError

    primary, backup = routes(hang(), reply("backup"))
    # The backup's attempt has the same limit: wide enough that it always answers in time.
    router = RecordingFailover([primary, backup], attempt_timeout=0.5)
    result = await collect(router, "hi", streaming=streaming)
    assert result.error is None and result.text == "backup"
    first = router.updates[0][0]
    assert first.outcome == "failed_before_output"
    assert isinstance(first.exception, AttemptTimeoutError)
    assert isinstance(first.exception, TimeoutError)
    assert isinstance(first.exception.__cause__, TimeoutError)
    if streaming:
        assert primary.streams_closed == 1


async def test_the_time_kept_for_the_backup_cuts_a_hanging_primary(streaming: bool) -> None:
    primary, backup = routes(hang(), reply("backup"))
    # The primary is cut after 0.1 s; the backup keeps 4.9 s, far more than it needs.
    router = RecordingFailover([primary, backup], request_timeout=5.0, min_attempt_budget=4.9)
    result = await collect(router, "hi", streaming=streaming)
    assert result.text == "backup"
    assert router.summary() == [
        ("r0", "failed_before_output", False),
        ("r1", "completed", True),
    ]


async def test_the_request_deadline_is_a_typed_timeout(streaming: bool) -> None:
    from pipeline.errors import RequestTimeoutError

    (only,) = routes(hang())
    router = RecordingFailover([only], request_timeout=0.01)
    result = await collect(router, "hi", streaming=streaming)
    assert isinstance(result.error, RequestTimeoutError)
    assert isinstance(result.error, TimeoutError)
    assert router.summary() == [("r0", "failed_before_output", True)]


async def test_the_attempt_timeout_ends_at_the_first_update() -> None:
    from pipeline.errors import RequestTimeoutError

    now = [0.0]
    primary, backup = routes(hang(after=["a"]), reply("backup"))
    # Deadlines are on the router's clock. The first update has 60 s to come; then the
    # clock jumps past the attempt's limit, leaving the request 0.05 s: were the attempt
    # limit still applied, it would cut the attempt at once, as an attempt timeout.
    router = RecordingFailover(
        [primary, backup], attempt_timeout=60.0, request_timeout=100.05, clock=lambda: now[0]
    )
    received: list[str] = []
    with pytest.raises(RequestTimeoutError):
        async for update in router.get_streaming_response("hi"):
            received.append(update.text)
            now[0] = 100.0
    # Once output is committed only the request deadline applies, and nothing fails over.
    assert received == ["a"]
    assert backup.call_count == 0
    assert router.summary() == [("r0", "failed_after_output", True)]


async def test_a_hanging_primary_opens_its_breaker_then_the_backup_serves_at_once(
    streaming: bool,
) -> None:
    primary = ScriptedChatClient(hang(), name="primary")
    backup = ScriptedChatClient(reply("backup"), name="backup")
    guarded = ChatPipeline.builder().use_circuit_breaker(fail_max=2).build(primary, name="primary")
    # The backup's attempt has the same limit: wide enough that it always answers in time.
    router = RecordingFailover([guarded, backup], attempt_timeout=0.5)
    for _ in range(2):
        assert (await collect(router, "hi", streaming=streaming)).text == "backup"
    assert primary.call_count == 2
    breaker = guarded.client
    assert breaker.state == "open"  # type: ignore[attr-defined]
    # Open: the primary is skipped in microseconds, the backup answers.
    assert (await collect(router, "hi", streaming=streaming)).text == "backup"
    assert primary.call_count == 2
    assert router.updates[-2][0].exception.__class__.__name__ == "CircuitOpenError"


async def test_a_caller_timeout_is_not_the_routes_fault(streaming: bool) -> None:
    primary = ScriptedChatClient(hang(), name="primary")
    guarded = ChatPipeline.builder().use_circuit_breaker(fail_max=1).build(primary, name="p")
    router = RecordingFailover([guarded])
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await collect(router, "hi", streaming=streaming)
    assert guarded.client.state == "closed"  # type: ignore[attr-defined]
    assert router.summary() == [("p", "canceled", True)]


async def test_route_instructions_reach_only_that_routes_attempt(streaming: bool) -> None:
    primary, backup = routes(fail(TransientProviderError()), reply("ok"))
    router = RecordingFailover(
        [Route("primary", primary, instructions="Answer in JSON."), Route("backup", backup)]
    )
    conversation = [ChatMessage.system("Be kind."), ChatMessage.user("hi")]
    result = await collect(router, conversation, streaming=streaming)
    assert result.text == "ok"
    sent_to_primary = primary.calls[0].messages
    assert [(m.role.value, m.text) for m in sent_to_primary] == [
        ("system", "Answer in JSON."),
        ("user", "hi"),
    ]
    # The backup's attempt and the caller's own list never see the primary's instructions.
    assert [m.text for m in backup.calls[0].messages] == ["Be kind.", "hi"]
    assert [m.text for m in conversation] == ["Be kind.", "hi"]


async def test_route_instructions_come_first_without_a_system_message(streaming: bool) -> None:
    (only,) = routes(reply("ok"))
    router = RecordingFailover([Route("only", only, instructions="Be brief.")])
    await collect(router, "hi", streaming=streaming)
    assert [(m.role.value, m.text) for m in only.calls[0].messages] == [
        ("system", "Be brief."),
        ("user", "hi"),
    ]


def test_route_instructions_are_validated() -> None:
    with pytest.raises(ValueError, match="instructions must be a non-empty string"):
        Route("r", ScriptedChatClient(), instructions="")


@pytest.mark.parametrize(("depth", "sent"), [(600, True), (100_000, False)])
async def test_deeply_nested_options_are_sent_or_refused_with_a_typed_error(
    streaming: bool, depth: int, sent: bool
) -> None:
    """Options are cloned per request and per attempt without recursion: JSON the wire can
    carry is sent; JSON too deep to encode is refused before sending, as the caller's
    mistake (`UnsendableRequestError`), never a `RecursionError`, and not failed over."""
    from pipeline.errors import UnsendableRequestError
    from pipeline.providers import OpenAIChatClient
    from pipeline.testing import FakeOpenAIServer

    deep: dict[str, object] = {}
    current = deep
    for _ in range(depth - 1):
        inner: dict[str, object] = {}
        current["a"] = inner
        current = inner
    options = ChatOptions(additional_properties={"metadata": deep})
    async with FakeOpenAIServer() as server:
        backup = ScriptedChatClient(reply("backup"), name="backup")
        primary = OpenAIChatClient("m", api_key="k", base_url=server.base_url, name="primary")
        router = RecordingFailover([primary, backup])
        result = await collect(router, "hi", options, streaming=streaming)
        await primary.aclose()
    if sent:
        assert result.error is None and len(server.requests) == 1
    else:
        assert isinstance(result.error, UnsendableRequestError)
        assert server.requests == []
    assert backup.call_count == 0
    outcome = "completed" if sent else "failed_before_output"
    assert router.summary() == [("primary", outcome, True)]  # terminal: not failed over


async def test_no_request_state_outlives_its_request_over_a_real_http_client(
    streaming: bool,
) -> None:
    # A real HTTP client copies the request's context into what outlives the request: its
    # read timer (cancelled, it stays in the loop until its deadline) and each pooled
    # connection's reader. Every fifth request fails over (the primary answers 503 first);
    # every request is logged (as under a spend layer), so its attempts are marked too.
    async with FakeOpenAIServer() as first, FakeOpenAIServer() as second:
        first.script(
            *[FakeResponse.error(503) if n % 5 == 0 else FakeResponse() for n in range(48)]
        )
        clients = [
            OpenAIChatClient(model="m", base_url=server.base_url, api_key="k")
            for server in (first, second)
        ]
        router = RecordingFailover(clients)
        gate = asyncio.Semaphore(8)

        async def one() -> None:
            async with gate:
                log, token = _scope.open_attempt_log()
                try:
                    result = await collect(router, "hi", streaming=streaming)
                finally:
                    if token is not None:
                        _scope.exit_attempt_log(token)
                assert result.error is None and result.text and len(log.attempts) >= 1

        await asyncio.gather(*(one() for _ in range(48)))
        assert (first.count(), second.count()) == (48, 10)
        refs = [weakref.ref(c) for c in router.contexts]
        router.contexts.clear()
        router.updates.clear()
        assert len(refs) == 48
        gc.collect()
        # The clients and their pooled connections are still open, as between requests.
        assert [r for r in refs if r() is not None] == []  # and so no RequestState either
        attempts = [o for o in gc.get_objects() if isinstance(o, AttemptState)]
        assert [a for a in attempts if a.client in clients] == []
        await router.aclose()
