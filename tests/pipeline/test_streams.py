"""`pipeline._streams`: how a layer forwards a stream and hears how it ended.

The endings a layer tells apart (completed, failed, canceled) are checked for both call
shapes, through a layer that classifies a whole response with `ending_of` and forwards a
stream with `forward`; what only a stream has (abandoning, scoping, closing) is checked on
streams, against a hand-made inner stream that counts how often it is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import pytest

from pipeline import ChatOptions, ChatResponse, ChatResponseUpdate, ChatRole
from pipeline._streams import (
    OpenedLater,
    StreamEnd,
    StreamWatcher,
    caller_cancelling,
    close_stream,
    ending_of,
    forward,
)
from pipeline.client import DelegatingChatClient
from pipeline.testing import ScriptedChatClient, collect, fail, hang, reply
from pipeline.types import Messages, TextContent

Updates = AsyncGenerator[ChatResponseUpdate, None]


def update(text: str) -> ChatResponseUpdate:
    return ChatResponseUpdate(role=ChatRole.ASSISTANT, contents=[TextContent(text)])


class Inner(AsyncGenerator[ChatResponseUpdate, None]):
    """An inner stream: yields `texts`, then raises `error` (if any) or ends; `aclose`
    counts its calls and raises `close_error` (if any)."""

    def __init__(
        self,
        *texts: str,
        error: BaseException | None = None,
        close_error: BaseException | None = None,
    ) -> None:
        self.texts = list(texts)
        self.error = error
        self.close_error = close_error
        self.reads = 0
        self.closes = 0

    def __aiter__(self) -> Inner:
        return self

    async def __anext__(self) -> ChatResponseUpdate:
        self.reads += 1
        if self.texts:
            return update(self.texts.pop(0))
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    async def asend(self, value: None) -> ChatResponseUpdate:
        return await self.__anext__()

    async def athrow(self, typ: Any, value: Any = None, traceback: Any = None) -> Any:
        raise typ if value is None else value

    async def aclose(self) -> None:
        self.closes += 1
        if self.close_error is not None:
            raise self.close_error


class Recorder(StreamWatcher):
    """A watcher that records every hook it hears, in order, in `events`."""

    def __init__(self, *, scoped: bool = False, awaitables: bool = False) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.scoped = scoped
        self.awaitables = awaitables
        self.depth = 0  # how many `enter` calls are not exited yet
        self.tokens = 0

    def _hook(self, *event: Any) -> Awaitable[None] | None:
        if not self.awaitables:
            self.events.append(event)
            return None

        async def later() -> None:
            await asyncio.sleep(0)  # a real suspension, as a layer doing I/O there would
            self.events.append(("awaited", *event))

        return later()

    def start(self) -> Awaitable[None] | None:
        return self._hook("start")

    def enter(self) -> Any:
        self.depth += 1
        self.tokens += 1
        self.events.append(("enter", self.tokens))
        return self.tokens

    def exit(self, token: Any) -> None:
        self.depth -= 1
        self.events.append(("exit", token))

    def update(self, update: ChatResponseUpdate) -> None:
        self.events.append(("update", update.text))

    def end(self, how: StreamEnd, error: BaseException | None) -> Awaitable[None] | None:
        return self._hook("end", how, error)

    def ends(self) -> list[tuple[Any, ...]]:
        return [e for e in self.events if e[0] in ("end", "awaited") and "end" in e]


class Ending(DelegatingChatClient):
    """A layer that hears how each request ended: a whole response through `ending_of`, a
    stream through `forward`."""

    def __init__(self, inner: ScriptedChatClient) -> None:
        super().__init__(inner)
        self.ends: list[tuple[StreamEnd, BaseException | None]] = []

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        try:
            response = await self.inner.get_response(messages, options)
        except BaseException as exc:
            self.ends.append((ending_of(exc), exc))
            raise
        self.ends.append(("completed", None))
        return response

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> Updates:
        layer = self

        class Ends(StreamWatcher):
            def end(self, how: StreamEnd, error: BaseException | None) -> None:
                layer.ends.append((how, error))

        return forward(lambda: self.inner.get_streaming_response(messages, options), Ends())


# -- the endings both call shapes share ------------------------------------------------------


async def test_a_request_that_runs_out_completed(streaming: bool) -> None:
    inner = ScriptedChatClient(reply("abc", chunks=["a", "b", "c"]))
    layer = Ending(inner)
    result = await collect(layer, "hi", streaming=streaming)
    assert result.error is None and result.text == "abc"
    assert layer.ends == [("completed", None)]
    assert inner.streams_closed == inner.streams_opened == (1 if streaming else 0)


async def test_a_failure_propagates_unchanged_and_failed(streaming: bool) -> None:
    error = ValueError("boom")
    layer = Ending(ScriptedChatClient(fail(error)))
    result = await collect(layer, "hi", streaming=streaming)
    assert result.error is error
    assert layer.ends == [("failed", error)]


async def test_the_callers_cancellation_is_canceled(streaming: bool) -> None:
    inner = ScriptedChatClient(hang())
    layer = Ending(inner)
    request = asyncio.create_task(collect(layer, "hi", streaming=streaming))
    await inner.wait_for_calls(1)  # the request now waits inside the inner client
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    assert [how for how, _ in layer.ends] == ["canceled"]
    assert isinstance(layer.ends[0][1], asyncio.CancelledError)
    assert inner.streams_closed == inner.streams_opened


async def test_a_clients_own_cancelled_error_is_a_failure(streaming: bool) -> None:
    # Nobody cancelled the caller: a CancelledError out of a client is an ordinary failure.
    error = asyncio.CancelledError()
    layer = Ending(ScriptedChatClient(fail(error)))
    with pytest.raises(asyncio.CancelledError) as raised:
        await collect(layer, "hi", streaming=streaming)
    assert raised.value is error
    assert layer.ends == [("failed", error)]


# -- caller_cancelling, ending_of, close_stream ---------------------------------------------


async def test_caller_cancelling_is_true_only_while_the_task_is_being_cancelled() -> None:
    waiting = asyncio.Event()
    seen: list[bool] = []

    async def request() -> None:
        seen.append(caller_cancelling())
        waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append(caller_cancelling())
            seen.append(ending_of(asyncio.CancelledError()) == "canceled")
            seen.append(ending_of(ValueError()) == "failed")
            raise

    task = asyncio.create_task(request())
    await waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [False, True, True, True]
    assert caller_cancelling() is False
    assert ending_of(asyncio.CancelledError()) == "failed"


async def test_close_stream_returns_what_closing_raised() -> None:
    fine, broken = Inner(), Inner(close_error=OSError("reset"))
    assert await close_stream(fine) is None
    error = await close_stream(broken)
    assert isinstance(error, OSError) and str(error) == "reset"
    assert (fine.closes, broken.closes) == (1, 1)


# -- forward: starting, hooks, scoping -------------------------------------------------------


async def test_a_stream_never_read_starts_nothing() -> None:
    opened: list[Inner] = []
    watcher = Recorder()
    stream = forward(lambda: opened.append(Inner("a")) or opened[-1], watcher)
    await stream.aclose()
    assert opened == [] and watcher.events == []


async def test_start_runs_at_the_first_read_before_the_inner_stream_opens() -> None:
    watcher = Recorder()

    def open_stream() -> Inner:
        watcher.events.append(("open",))
        return Inner("a", "b")

    stream = forward(open_stream, watcher)
    assert watcher.events == []
    texts = [u.text async for u in stream]
    assert texts == ["a", "b"]
    assert watcher.events == [
        ("start",),
        ("open",),
        ("update", "a"),
        ("update", "b"),
        ("end", "completed", None),
    ]


async def test_a_start_that_raises_propagates_and_nothing_else_runs() -> None:
    opened: list[Inner] = []

    class Refusing(Recorder):
        def start(self) -> None:
            raise PermissionError("circuit open")

    watcher = Refusing(scoped=True)
    with pytest.raises(PermissionError):
        await anext(forward(lambda: opened.append(Inner("a")) or opened[-1], watcher))
    assert opened == [] and watcher.events == []


async def test_awaitable_start_and_end_are_awaited_in_place() -> None:
    inner = Inner("a")
    watcher = Recorder(awaitables=True)
    texts = []
    async for u in forward(lambda: inner, watcher):
        texts.append(u.text)
        assert watcher.events == [("awaited", "start"), ("update", "a")]
    assert texts == ["a"]
    # The end was awaited before the stream finished, after the inner stream was closed.
    assert watcher.events[-1] == ("awaited", "end", "completed", None)
    assert inner.closes == 1


async def test_a_scoped_watcher_is_entered_around_each_step_never_while_the_caller_reads() -> None:
    watcher = Recorder(scoped=True)
    depths = []
    async for _ in forward(lambda: Inner("a", "b"), watcher):
        depths.append(watcher.depth)
    assert depths == [0, 0]
    assert watcher.depth == 0
    steps = [e for e in watcher.events if e[0] in ("enter", "exit", "update")]
    # Opening, two updates and the step that found the end: each inside its own enter/exit,
    # the exit handed the token of its enter.
    assert steps == [
        ("enter", 1),
        ("exit", 1),
        ("enter", 2),
        ("exit", 2),
        ("update", "a"),
        ("enter", 3),
        ("exit", 3),
        ("update", "b"),
        ("enter", 4),
        ("exit", 4),
    ]


async def test_a_watcher_may_stop_scoping_between_steps() -> None:
    class Once(Recorder):
        def update(self, update: ChatResponseUpdate) -> None:
            super().update(update)
            self.scoped = False  # nothing left to make current

    watcher = Once(scoped=True)
    texts = [u.text async for u in forward(lambda: Inner("a", "b", "c"), watcher)]
    assert texts == ["a", "b", "c"]
    assert [e for e in watcher.events if e[0] == "enter"] == [("enter", 1), ("enter", 2)]
    assert watcher.depth == 0


class Counting(StreamWatcher):
    """A watcher that has `forward` count its updates, and records the count at its end."""

    __slots__ = ("at_end", "scoped", "updates")
    counts_updates = True

    def __init__(self, *, scoped: bool) -> None:
        self.scoped = scoped
        self.updates = 0
        self.at_end: list[tuple[StreamEnd, int]] = []

    def end(self, how: StreamEnd, error: BaseException | None) -> None:
        self.at_end.append((how, self.updates))


@pytest.mark.parametrize("scoped", [False, True])
@pytest.mark.parametrize(
    ("inner", "read", "ended"),
    [
        (lambda: Inner("a", "b", "c"), 3, ("completed", 3)),
        (lambda: Inner("a", "b", error=OSError("reset")), 2, ("failed", 2)),
        (lambda: Inner("a", "b", "c"), 1, ("abandoned", 1)),  # the caller closes after one
    ],
)
async def test_a_counting_watcher_hears_the_updates_passed_on_by_its_end(
    scoped: bool, inner: Callable[[], Inner], read: int, ended: tuple[StreamEnd, int]
) -> None:
    watcher = Counting(scoped=scoped)
    stream = forward(inner, watcher)
    texts = []
    with contextlib.suppress(OSError):
        async with contextlib.aclosing(stream):
            while len(texts) < read:
                texts.append((await anext(stream)).text)
            if ended[0] != "abandoned":
                assert [u.text async for u in stream] == []
    assert texts == ["a", "b", "c"][:read]
    assert watcher.at_end == [ended]


async def test_opening_that_raises_is_reported_once_and_propagates() -> None:
    error = ConnectionError("refused")
    watcher = Recorder(scoped=True)

    def open_stream() -> Inner:
        raise error

    with pytest.raises(ConnectionError) as raised:
        await anext(forward(open_stream, watcher))
    assert raised.value is error
    assert watcher.ends() == [("end", "failed", error)]
    assert watcher.depth == 0


# -- forward: how a stream ended, and closing it exactly once -----------------------------


@pytest.mark.parametrize("failing", ["reading", "closing"])
async def test_a_stream_failing_to_read_or_to_close_failed_and_was_closed_once(
    failing: str,
) -> None:
    # A close error fails a stream that had completed, like an error while reading.
    error = OSError("reset")
    inner = Inner("a", error=error) if failing == "reading" else Inner("a", close_error=error)
    watcher = Recorder()
    texts: list[str] = []
    with pytest.raises(OSError) as raised:
        async for u in forward(lambda: inner, watcher):
            texts.append(u.text)
    assert raised.value is error and texts == ["a"]
    assert watcher.ends() == [("end", "failed", error)]
    assert inner.closes == 1


async def test_a_failing_stream_that_also_fails_to_close_keeps_its_error_with_a_note() -> None:
    error = ValueError("bad chunk")
    inner = Inner(error=error, close_error=OSError("reset"))
    watcher = Recorder()
    with pytest.raises(ValueError) as raised:
        await anext(forward(lambda: inner, watcher))
    assert raised.value is error
    assert raised.value.__notes__ == ["closing the failed stream also raised OSError"]
    assert watcher.ends() == [("end", "failed", error)]
    assert inner.closes == 1


@pytest.mark.parametrize(
    ("stop", "close_error"),
    [("aclose", None), ("aclose", OSError("reset")), ("athrow", None)],
    ids=["closed", "closed-and-closing-fails", "thrown-into"],
)
@pytest.mark.parametrize("scoped", [False, True], ids=["plain", "scoped"])
@pytest.mark.parametrize("read", [1, 2], ids=["after-the-first", "after-the-second"])
async def test_a_caller_that_stops_reading_abandons_the_stream(
    stop: str, close_error: OSError | None, scoped: bool, read: int
) -> None:
    # What the caller threw propagates; a close error replaces the GeneratorExit of a close.
    # (A watcher that is not scoped is forwarded by a loop of its own: both are checked.)
    inner = Inner("a", "b", "c", close_error=close_error)
    watcher = Recorder(scoped=scoped)
    stream = forward(lambda: inner, watcher)
    assert [(await anext(stream)).text for _ in range(read)] == ["a", "b"][:read]
    raised: BaseException | None = None
    try:
        await (stream.aclose() if stop == "aclose" else stream.athrow(KeyError("stop")))
    except (OSError, KeyError) as exc:
        raised = exc
    if close_error is not None:
        assert raised is close_error
    else:
        assert isinstance(raised, KeyError) if stop == "athrow" else raised is None
    assert watcher.ends() == [("end", "abandoned", close_error)]
    assert (inner.closes, inner.reads) == (1, read)
    assert watcher.depth == 0


async def test_a_caller_cancelled_while_holding_an_update_is_canceled() -> None:
    inner = Inner("a", "b")
    watcher = Recorder()
    holding = asyncio.Event()

    async def caller() -> None:
        async with contextlib.aclosing(forward(lambda: inner, watcher)) as stream:
            async for _ in stream:
                holding.set()
                await asyncio.Event().wait()  # until cancelled

    task = asyncio.create_task(caller())
    await holding.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert watcher.ends() == [("end", "canceled", None)]
    assert inner.closes == 1


# -- OpenedLater ------------------------------------------------------------------------------


def opened_later(
    inner: Inner, *, first: bool = True
) -> tuple[OpenedLater, list[int], Callable[[], int]]:
    opens: list[int] = []

    async def open_inner() -> tuple[Updates, ChatResponseUpdate | None]:
        opens.append(1)
        return inner, (await inner.__anext__() if first else None)

    return OpenedLater(open_inner), opens, lambda: inner.closes


async def test_opened_later_opens_at_the_first_read_then_reads_the_inner_stream() -> None:
    inner = Inner("a", "b", "c")
    stream, opens, _ = opened_later(inner)
    assert opens == []
    texts = [u.text async for u in stream]
    assert texts == ["a", "b", "c"]
    assert opens == [1] and inner.reads == 4  # three updates and the end, each read once


async def test_opened_later_with_no_first_update_is_empty_and_closes_the_inner_stream() -> None:
    inner = Inner("never")
    stream, opens, closes = opened_later(inner, first=False)
    assert [u async for u in stream] == []
    assert opens == [1] and closes() == 1


async def test_opened_later_closed_before_reading_opens_nothing() -> None:
    stream, opens, closes = opened_later(Inner("a"))
    await stream.aclose()
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert opens == [] and closes() == 0


async def test_opened_later_closing_closes_the_inner_stream() -> None:
    stream, _, closes = opened_later(Inner("a", "b"))
    assert (await stream.asend(None)).text == "a"
    await stream.aclose()
    assert closes() == 1


async def test_opened_later_thrown_into_before_reading_raises_and_opens_nothing() -> None:
    stream, opens, _ = opened_later(Inner("a"))
    with pytest.raises(KeyError):
        await stream.athrow(KeyError("stop"))
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert opens == []
