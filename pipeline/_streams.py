"""One way to forward a stream and to tell how it ended.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncGenerator, Awaitable, Callable
from types import TracebackType
from typing import Any, Literal, TypeAlias

from pipeline.types import ChatResponseUpdate

__all__ = [
    "NO_WATCHER",
    "Adopting",
    "Forwarded",
    "OpenedLater",
    "StreamEnd",
    "StreamWatcher",
    "caller_cancelling",
    "close_stream",
    "ending_of",
    "forward",
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
    update.
    """

    __slots__ = ()
    scoped = False

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


_OUT: Any = object()  # a level that is not entered now
# `raise await self._failed_at(...)` and the like (B904): what they return is the error being
# handled, or the one a watcher raised instead, whose context that error already is.

_NEW, _RUNNING, _OPEN, _DONE, _JOINED, _ADOPTED = (
    "new",
    "running",
    "open",
    "done",
    "joined",
    "adopted",
)


class Forwarded(AsyncGenerator[ChatResponseUpdate, None]):
    """`forward(open_stream, watcher)`: open the inner stream with `open_stream()` at the
    caller's first read (after `watcher.start()`), and yield its updates.

    See the module docstring for how the end is classified; `watcher.end` hears it once,
    after the inner stream was closed, and the exception (if any) propagates unchanged.

    One loop serves a chain of watchers: opening a level may return another `Forwarded`
    that was never read (the layer beneath forwards too); its watcher becomes the next
    level of this chain and its opener is called in turn, until one returns a stream of
    another kind, the one this chain reads. Every watcher then hears exactly what it would
    in a loop of its own wrapped around the next: `start` outer first, each `enter` before
    the inner levels' and each `exit` after them, `update` and `end` inner first; an inner
    level's end runs while the outer levels are still entered, an exception an inner hook
    raises is the error the outer levels end with, and a caller that closes the stream or
    throws into it abandons every level.

    The stream read may be an `OpenedLater` nobody has read (its opener is awaited here, no
    hop), or an `Adopting` stream (the routing engine's), which then runs the levels itself
    (`leave`, `reenter`, `failed_at`, `unwind`, `completed`, `abandoned`) and is read
    directly.
    """

    __slots__ = (
        "__weakref__",
        "_finalizer",
        "_hooks",
        "_open",
        "_state",
        "_stream",
        "_tokens",
        "_watcher",
        "_watchers",
    )

    # Set at the first read: the levels, outermost first, each one's `update` (None when it
    # does not override it) and `enter` token (_OUT while it is not entered).
    _watchers: list[StreamWatcher]
    _hooks: list[Callable[[ChatResponseUpdate], None] | None]
    _tokens: list[Any]

    def __init__(
        self, open_stream: Callable[[], Updates], watcher: StreamWatcher = NO_WATCHER
    ) -> None:
        self._open: Callable[[], Updates] | None = open_stream
        self._watcher = watcher
        self._state = _NEW
        self._stream: Updates | None = None
        self._finalizer: Callable[[Any], object] | None = None

    def __aiter__(self) -> Forwarded:
        return self

    async def asend(self, value: None) -> ChatResponseUpdate:
        return await self.__anext__()

    async def __anext__(self) -> ChatResponseUpdate:
        state = self._state
        stream: Updates
        if state is _ADOPTED:
            assert self._stream is not None
            return await self._stream.__anext__()
        if state is _OPEN:
            self._state = _RUNNING
            watchers, tokens = self._watchers, self._tokens
            level = 0
            try:
                for level, watcher in enumerate(watchers):
                    if watcher.scoped:
                        tokens[level] = watcher.enter()
            except BaseException as error:
                # The levels beneath this one are not entered: they are abandoned.
                raise await self._failed_at(level, error)  # noqa: B904
            opened = self._stream
            assert opened is not None
            stream = opened
            try:
                update = await stream.__anext__()
            except StopAsyncIteration:
                ran_out = True
            except BaseException as error:
                raise await self._failed_at(len(watchers) - 1, error, exit_first=True)  # noqa: B904
            else:
                ran_out = False
        elif state is _NEW:
            self._state = _RUNNING
            hooks = sys.get_asyncgen_hooks()  # closed at the loop's shutdown, or when dropped
            if hooks.firstiter is not None:
                hooks.firstiter(self)
            self._finalizer = hooks.finalizer
            # Start and open every level, each left entered (as a loop of its own would be
            # while it reads the next level).
            watchers, tokens = [], []
            update_hooks: list[Callable[[ChatResponseUpdate], None] | None] = []
            self._watchers, self._hooks, self._tokens = watchers, update_hooks, tokens
            open_stream: Callable[[], Updates] | None = self._open
            watcher = self._watcher
            self._open = None
            while open_stream is not None:
                try:
                    started = watcher.start()
                    if started is not None:
                        await started
                except BaseException as error:
                    raise await self.unwind(error)  # noqa: B904
                scoped = watcher.scoped
                token = watcher.enter() if scoped else None
                try:
                    stream = open_stream()
                except BaseException as error:
                    failure = error
                    try:
                        ended_by = watcher.end(ending_of(error), error)
                        if ended_by is not None:
                            await ended_by
                    except BaseException as raised:
                        failure = raised
                    finally:
                        if scoped:
                            watcher.exit(token)
                    raise await self.unwind(failure)  # noqa: B904
                if scoped:
                    watcher.exit(token)
                watchers.append(watcher)
                update_hooks.append(
                    None if type(watcher).update is StreamWatcher.update else watcher.update
                )
                self._stream = stream
                try:
                    tokens.append(watcher.enter() if watcher.scoped else _OUT)
                except BaseException as error:
                    tokens.append(_OUT)
                    raise await self._failed_at(len(watchers) - 1, error)  # noqa: B904
                if type(stream) is Forwarded and stream._state is _NEW:
                    # The layer beneath forwards too: its watcher joins this chain.
                    stream._state = _JOINED
                    open_stream, watcher = stream._open, stream._watcher
                    stream._open = None
                    self._stream = None
                else:
                    open_stream = None
            if type(stream) is Adopting and stream._open is not None:
                # It runs the levels itself from here on (their ends too), and is read
                # directly.
                adopted = stream._open(self)
                stream._open = None
                self._stream = adopted
                self._state = _ADOPTED
                return await adopted.__anext__()
            try:
                if type(stream) is OpenedLater and stream._stream is None and not stream._closed:
                    # Its opener is awaited here, and its stream read directly.
                    stream._closed = True
                    stream, first = await stream._open()
                    self._stream = stream
                    ran_out = first is None
                    if first is not None:
                        update = first
                else:
                    update = await stream.__anext__()
                    ran_out = False
            except StopAsyncIteration:
                ran_out = True
            except BaseException as error:
                raise await self._failed_at(len(watchers) - 1, error, exit_first=True)  # noqa: B904
        else:
            self._misused(state, "anext")
            raise StopAsyncIteration
        if ran_out:
            # Outside the handlers above, so what ending raises has not a StopAsyncIteration
            # as its context.
            # (`completed`, inline: this runs once per stream.)
            self._state = _DONE
            ended_with: BaseException | None = None
            level = len(watchers)
            closing = True
            while level:
                level -= 1
                watcher = watchers[level]
                token = tokens[level]
                if token is not _OUT:
                    tokens[level] = _OUT
                    watcher.exit(token)
                if closing:
                    closing = False
                    try:
                        await stream.aclose()
                    except BaseException as exc:
                        ended_with = exc
                try:
                    if ended_with is None:
                        ended_by = watcher.end("completed", None)
                    else:
                        ended_by = watcher.end(ending_of(ended_with), ended_with)
                    if ended_by is not None:
                        await ended_by
                except BaseException as raised:
                    ended_with = raised
            if ended_with is not None:
                raise ended_with
            raise StopAsyncIteration
        level = len(watchers)
        hook_of = self._hooks
        try:
            while level:
                level -= 1
                token = tokens[level]
                if token is not _OUT:
                    tokens[level] = _OUT
                    watchers[level].exit(token)
                hook = hook_of[level]
                if hook is not None:
                    hook(update)
        except BaseException as error:
            raise await self._failed_at(level, error)  # noqa: B904
        self._state = _OPEN
        return update

    @staticmethod
    def _misused(state: str, what: str) -> None:
        if state is _RUNNING:
            raise RuntimeError(f"{what}(): the stream is already running")
        if state is _JOINED:
            raise RuntimeError(f"{what}(): the stream was joined to the stream that opened it")

    # -- ending the levels (also called by an adopting stream) -----------------------------

    def leave(self, update: ChatResponseUpdate) -> tuple[int, BaseException] | None:
        """Exit every level and tell it of `update`, innermost first; on an exception, the
        level that raised it and the exception (the levels inner to it are done)."""
        watchers, hooks, tokens = self._watchers, self._hooks, self._tokens
        level = len(watchers)
        try:
            while level:
                level -= 1
                token = tokens[level]
                if token is not _OUT:
                    tokens[level] = _OUT
                    watchers[level].exit(token)
                hook = hooks[level]
                if hook is not None:
                    hook(update)
        except BaseException as error:
            return level, error
        return None

    def reenter(self) -> tuple[int, BaseException] | None:
        """Enter every scoped level, outermost first, before the next step; on an
        exception, the level that raised it (not entered) and the exception."""
        watchers, tokens = self._watchers, self._tokens
        level = 0
        try:
            for level, watcher in enumerate(watchers):
                if watcher.scoped:
                    tokens[level] = watcher.enter()
        except BaseException as error:
            return level, error
        return None

    async def _end(
        self, watcher: StreamWatcher, how: StreamEnd, error: BaseException | None
    ) -> BaseException | None:
        """`watcher.end(how, error)`; returns what it raised, if anything."""
        try:
            ended_by = watcher.end(how, error)
            if ended_by is not None:
                await ended_by
        except BaseException as raised:
            return raised
        return None

    def _exit(self, level: int) -> None:
        token = self._tokens[level]
        if token is not _OUT:
            self._tokens[level] = _OUT
            self._watchers[level].exit(token)

    async def unwind(self, error: BaseException, level: int | None = None) -> BaseException:
        """`error` reached the levels above `level` (default: every level), which are
        entered, reading: each exits and ends with it (or with what an inner end raised
        instead); returns the error the stream ends with. Once the levels ended, returns
        `error` as it is."""
        if self._state is _DONE:
            return error
        self._state = _DONE
        return await self._unwind(error, len(self._watchers) if level is None else level)

    async def _unwind(self, error: BaseException, level: int) -> BaseException:
        watchers = self._watchers
        while level:
            level -= 1
            self._exit(level)
            error = await self._end(watchers[level], ending_of(error), error) or error
        return error

    async def _abandon_below(
        self, level: int, how: StreamEnd, close_error: BaseException | None, close: bool
    ) -> BaseException | None:
        """Close the stream read (with `close`; else closing it raised `close_error`) and
        end the levels beneath `level` (not entered) with `how`, innermost first, as nested
        loops each closing the next would; returns what closing raised (an end's exception
        replaces it)."""
        stream = self._stream
        if close and stream is not None:
            try:
                await stream.aclose()
            except BaseException as exc:
                close_error = exc
        watchers = self._watchers
        below = len(watchers)
        while below > level + 1:
            below -= 1
            close_error = await self._end(watchers[below], how, close_error) or close_error
        return close_error

    async def _failed_at(
        self, level: int, error: BaseException, *, exit_first: bool = False
    ) -> BaseException:
        return await self.failed_at(level, error, exit_first=exit_first, close=True)

    async def failed_at(
        self,
        level: int,
        error: BaseException,
        close_error: BaseException | None = None,
        *,
        exit_first: bool = False,
        close: bool = False,
    ) -> BaseException:
        """`error` was raised in `level`'s loop: the levels beneath are abandoned (the
        stream read is closed, with `close`; else closing it raised `close_error`), `level`
        ends failed, and the levels above hear it; returns the error the stream ends with."""
        self._state = _DONE
        if exit_first:
            self._exit(level)
        how: StreamEnd = "canceled" if caller_cancelling() else "abandoned"
        close_error = await self._abandon_below(level, how, close_error, close)
        if close_error is not None:
            error.add_note(f"closing the failed stream also raised {type(close_error).__name__}")
        error = await self._end(self._watchers[level], ending_of(error), error) or error
        return await self._unwind(error, level)

    async def completed(self, *, close: bool = False) -> BaseException | None:
        """The stream read ran out: close it (with `close`) and end every level, innermost
        first, as completed (or with the error closing or an inner end raised); returns
        that error, if any."""
        self._state = _DONE
        watchers = self._watchers
        level = len(watchers) - 1
        self._exit(level)
        error: BaseException | None = None
        stream = self._stream
        if close and stream is not None:
            try:
                await stream.aclose()
            except BaseException as exc:
                error = exc
        watcher = watchers[level]
        try:
            ended_by = watcher.end("completed", None) if error is None else None
            if ended_by is not None:
                await ended_by
        except BaseException as raised:
            error = raised
        else:
            if error is not None:  # closing failed
                error = await self._end(watcher, ending_of(error), error) or error
        while level:
            level -= 1
            self._exit(level)
            watcher = watchers[level]
            if error is None:
                try:
                    ended_by = watcher.end("completed", None)
                    if ended_by is not None:
                        await ended_by
                except BaseException as raised:
                    error = raised
            else:
                error = await self._end(watcher, ending_of(error), error) or error
        return error

    async def abandoned(self, close_error: BaseException | None = None) -> BaseException | None:
        """The caller stopped reading between updates (closing the stream read raised
        `close_error`): end every level abandoned (or canceled, while the caller is being
        cancelled); returns what closing raised (or an end raised instead)."""
        self._state = _DONE
        how: StreamEnd = "canceled" if caller_cancelling() else "abandoned"
        return await self._abandon_below(-1, how, close_error, False)

    async def athrow(
        self,
        typ: Any,
        value: Any = None,
        traceback: TracebackType | None = None,
    ) -> ChatResponseUpdate:
        state = self._state
        if state is _ADOPTED:
            assert self._stream is not None
            return await self._stream.athrow(typ, value, traceback)
        if state is _OPEN:
            close_error = await self._abandoned()
            if close_error is not None:
                raise close_error from None
        else:
            self._misused(state, "athrow")
            self._state, self._open = _DONE, None
        raise typ if value is None else value

    async def aclose(self) -> None:
        state = self._state
        if state is _ADOPTED:
            assert self._stream is not None
            await self._stream.aclose()
        elif state is _OPEN:
            close_error = await self._abandoned()
            if close_error is not None:
                raise close_error from None
        elif state is not _JOINED:
            self._misused(state, "aclose")
            self._state, self._open = _DONE, None

    async def _abandoned(self) -> BaseException | None:
        self._state = _DONE
        how: StreamEnd = "canceled" if caller_cancelling() else "abandoned"
        return await self._abandon_below(-1, how, None, True)

    def __del__(self) -> None:
        # As for an async generator: one dropped between updates is closed by the loop.
        if self._state is _OPEN and self._finalizer is not None:
            self._finalizer(self)


forward = Forwarded  # what every layer calls (a class: no call more per stream)


class Adopting(AsyncGenerator[ChatResponseUpdate, None]):
    """A stream made by `open(chain)`, an async generator that, given a `Forwarded` chain
    whose levels wrap it (else `None`), runs those levels itself: it calls `chain.leave`
    before it yields each update and `chain.reenter` when it resumes, and ends them with
    `chain.completed`, `chain.unwind` (a failure), `chain.failed_at` (a level's hook
    raised) or `chain.abandoned` (the caller stopped reading), exactly as the chain would
    around it. The chain then reads it directly: one loop for the levels and the stream.

    Read on its own, it makes its generator with no chain at the first read.
    """

    __slots__ = ("_open", "_stream")

    def __init__(self, open: Callable[[Forwarded | None], Updates]) -> None:
        self._open: Callable[[Forwarded | None], Updates] | None = open
        self._stream: Updates | None = None

    def __aiter__(self) -> Adopting:
        return self

    def __anext__(self) -> Awaitable[ChatResponseUpdate]:  # type: ignore[override]
        stream = self._stream
        if stream is None:
            if self._open is None:
                return _ran_out()
            stream = self._stream = self._open(None)
            self._open = None
        return stream.__anext__()

    async def asend(self, value: None) -> ChatResponseUpdate:
        return await self.__anext__()

    async def athrow(
        self,
        typ: Any,
        value: Any = None,
        traceback: TracebackType | None = None,
    ) -> ChatResponseUpdate:
        if self._stream is None:
            self._open = None
            raise typ if value is None else value
        return await self._stream.athrow(typ, value, traceback)

    async def aclose(self) -> None:
        self._open = None
        if self._stream is not None:
            await self._stream.aclose()


async def _ran_out() -> ChatResponseUpdate:
    raise StopAsyncIteration


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
