"""One way to forward a stream and to tell how it ended.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from types import AsyncGeneratorType, TracebackType
from typing import Any, Literal, TypeAlias

from pipeline.types import ChatResponseUpdate

__all__ = [
    "NO_WATCHER",
    "OpenedLater",
    "StreamEnd",
    "StreamWatcher",
    "caller_cancelling",
    "close_stream",
    "ending_of",
    "forward",
    "left_open",
]

StreamEnd: TypeAlias = Literal["completed", "failed", "abandoned", "canceled"]
Updates: TypeAlias = AsyncGenerator[ChatResponseUpdate, None]


def caller_cancelling() -> bool:
    """True while the current task is being cancelled (by its caller or a deadline)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def ending_of(error: BaseException) -> StreamEnd:
    """How a call that raised `error` ended: ``canceled`` only for the caller's own
    cancellation, ``failed`` for anything else (a client's stray `CancelledError` included)."""
    if isinstance(error, asyncio.CancelledError) and caller_cancelling():
        return "canceled"
    return "failed"


def left_open(stream: Updates) -> bool:
    """Whether `stream`, which ran out or failed, may hold something to close: anything but
    a native async generator whose frame ended (its ``aclose()`` would return at once)."""
    return type(stream) is not AsyncGeneratorType or stream.ag_frame is not None


async def close_stream(stream: Updates) -> BaseException | None:
    """Close `stream` and return what closing raised instead of raising it."""
    try:
        await stream.aclose()
    except BaseException as exc:  # the caller decides what a failed close means
        return exc
    return None


class StreamWatcher:
    """What a layer sees of a stream it forwards. Every hook is optional.

    `start()` runs at the caller's first read, before the inner stream is opened (a
    stream that is never read starts nothing); if it raises, the exception propagates and
    nothing else is called. `start()` and `end()` may return an awaitable (a layer that
    must do I/O there, like a breaker sharing its state): `forward` awaits it; returning
    ``None`` (the default) costs nothing more. With `scoped` true, `enter()` runs
    before each step of the inner stream and `exit(token)` after it, so the layer can make
    a context current while the layers beneath run, and never while the caller holds an
    update. With `counts_updates` true, `updates` counts the updates passed on, without a
    call per update.
    """

    __slots__ = ()
    scoped = False
    # True: `forward` counts the updates in the watcher's `updates` attribute (which the
    # watcher defines, starting at 0) instead of calling a hook per update.
    counts_updates = False

    def start(self) -> Awaitable[None] | None:
        return None

    def enter(self) -> Any:
        return None

    def exit(self, token: Any) -> None:
        return None

    def update(self, update: ChatResponseUpdate) -> None:
        return None

    def end(self, how: StreamEnd, error: BaseException | None) -> Awaitable[None] | None:
        """Called once, after the inner stream was closed."""
        return None


NO_WATCHER = StreamWatcher()


async def forward(
    open_stream: Callable[[], Updates], watcher: StreamWatcher = NO_WATCHER
) -> Updates:
    """Open the inner stream with `open_stream()` at the caller's first read (after
    `watcher.start()`), and yield its updates.

    See the module docstring for how the end is classified; `watcher.end` hears it once,
    after the inner stream was closed, and the exception (if any) propagates unchanged.
    """
    started = watcher.start()
    if started is not None:
        await started
    scoped = watcher.scoped
    token = watcher.enter() if scoped else None
    try:
        stream = open_stream()
    except BaseException as error:
        ended_by = watcher.end(ending_of(error), error)
        if ended_by is not None:
            await ended_by
        raise
    finally:
        if scoped:
            watcher.exit(token)
    ended = False  # set once the end was reported from inside the loop
    # Hooks the watcher does not override cost nothing per update; `scoped` is read at each
    # step, so a watcher may stop scoping once it has nothing to make current (it never
    # starts again: a watcher that is not scoped now runs the loop without the scope's steps).
    update_hook = None if type(watcher).update is StreamWatcher.update else watcher.update
    counts = watcher.counts_updates
    try:
        if watcher.scoped:
            while True:
                scoped = watcher.scoped
                token = watcher.enter() if scoped else None
                try:
                    update = await stream.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    if scoped:
                        watcher.exit(token)
                if counts:
                    watcher.updates += 1  # type: ignore[attr-defined]
                if update_hook is not None:
                    update_hook(update)
                try:
                    yield update
                except BaseException:
                    # The caller closed the stream (GeneratorExit) or threw into it.
                    ended = True
                    await _caller_left(stream, watcher)
                    raise
        else:
            anext = stream.__anext__
            while True:
                try:
                    update = await anext()
                except StopAsyncIteration:
                    break
                if counts:
                    watcher.updates += 1  # type: ignore[attr-defined]
                if update_hook is not None:
                    update_hook(update)
                try:
                    yield update
                except BaseException:
                    ended = True
                    await _caller_left(stream, watcher)
                    raise
    except BaseException as error:
        if ended:
            raise
        close_error = await close_stream(stream)
        if close_error is not None:
            error.add_note(f"closing the failed stream also raised {type(close_error).__name__}")
        ended_by = watcher.end(ending_of(error), error)
        if ended_by is not None:
            await ended_by
        raise
    # A native generator that ran out has nothing left to close; anything else is closed
    # here (`close_stream`, inline).
    if left_open(stream):
        close_error = None
        try:
            await stream.aclose()
        except BaseException as exc:
            close_error = exc
        if close_error is not None:
            ended_by = watcher.end(ending_of(close_error), close_error)
            if ended_by is not None:
                await ended_by
            raise close_error
    ended_by = watcher.end("completed", None)
    if ended_by is not None:
        await ended_by


async def _caller_left(stream: Updates, watcher: StreamWatcher) -> None:
    """The caller closed a forwarded stream (or threw into it): close the inner stream,
    tell the watcher, and raise what closing raised, if anything (the caller's exception
    propagates otherwise)."""
    how: StreamEnd = "canceled" if caller_cancelling() else "abandoned"
    close_error = await close_stream(stream)
    ended_by = watcher.end(how, close_error)
    if ended_by is not None:
        await ended_by
    if close_error is not None:
        raise close_error from None


class OpenedLater(AsyncGenerator[ChatResponseUpdate, None]):
    """A stream opened at the caller's first read by `open()`, which returns the inner
    stream and its first update (``None`` when it is empty), for layers that must do async
    work before the first update (the retry layer retries there).

    After the first update the caller reads the inner stream directly: no hop per update.
    Closing closes the inner stream; closing before the first read opens nothing.
    """

    __slots__ = ("_closed", "_open", "_stream")

    def __init__(
        self, open: Callable[[], Awaitable[tuple[Updates, ChatResponseUpdate | None]]]
    ) -> None:
        self._open = open
        self._stream: Updates | None = None
        self._closed = False

    def __aiter__(self) -> OpenedLater:
        return self

    def __anext__(self) -> Awaitable[ChatResponseUpdate]:  # type: ignore[override]
        stream = self._stream
        if stream is not None:
            return stream.__anext__()
        return self._first()

    async def _first(self) -> ChatResponseUpdate:
        if self._closed:
            raise StopAsyncIteration
        stream, first = await self._open()
        self._stream = stream
        if first is None:
            await self.aclose()
            raise StopAsyncIteration
        return first

    async def asend(self, value: None) -> ChatResponseUpdate:
        return await self.__anext__()

    async def athrow(
        self,
        typ: Any,
        value: Any = None,
        traceback: TracebackType | None = None,
    ) -> ChatResponseUpdate:
        if self._stream is None:
            self._closed = True
            raise typ if value is None else value
        return await self._stream.athrow(typ, value, traceback)

    async def aclose(self) -> None:
        self._closed = True
        if self._stream is not None:
            await self._stream.aclose()
