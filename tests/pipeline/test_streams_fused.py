"""`pipeline._streams.forward` chains: one loop for every watcher of a stack of layers.

Every scenario runs twice, through a chain of `forward` streams (which join into one loop)
and through a reference made of one async generator per layer (the loop `forward` was
before it fused chains), and both must give the same story: every watcher hook in the same
order with the same arguments, the same updates, the same exception (type, message,
notes) and the same reads and closes of the inner stream. The routing engine's stream,
which runs the layers above it itself when they wrap it, is checked the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from middleware.routing import Route
from pipeline import ChatPipeline, ChatResponseUpdate
from pipeline._streams import (
    NO_WATCHER,
    Adopting,
    Forwarded,
    OpenedLater,
    StreamEnd,
    StreamWatcher,
    caller_cancelling,
    close_stream,
    ending_of,
    forward,
)
from pipeline.errors import TransientProviderError
from pipeline.testing import ScriptedChatClient, fail, fail_after, reply
from tests.pipeline.test_streams import Inner

Updates = AsyncGenerator[ChatResponseUpdate, None]
Forward = Callable[[Callable[[], Updates], StreamWatcher], Updates]


async def nested_forward(
    open_stream: Callable[[], Updates], watcher: StreamWatcher = NO_WATCHER
) -> Updates:
    """The reference: `forward` as one async generator per layer, as it was before it
    fused chains (kept verbatim, so the fused loop is checked against it)."""
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
    ended = False
    update_hook = None if type(watcher).update is StreamWatcher.update else watcher.update
    try:
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
            if update_hook is not None:
                update_hook(update)
            try:
                yield update
            except BaseException:
                ended = True
                how: StreamEnd = "canceled" if caller_cancelling() else "abandoned"
                close_error = await close_stream(stream)
                ended_by = watcher.end(how, close_error)
                if ended_by is not None:
                    await ended_by
                if close_error is not None:
                    raise close_error from None
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
    close_error = await close_stream(stream)
    if close_error is not None:
        ended_by = watcher.end(ending_of(close_error), close_error)
        if ended_by is not None:
            await ended_by
        raise close_error
    ended_by = watcher.end("completed", None)
    if ended_by is not None:
        await ended_by


IMPLEMENTATIONS: dict[str, Any] = {"nested": nested_forward, "fused": forward}


def fresh(error: Any) -> Any:
    """A new exception like `error` (each run adds its own notes), or `error` if not one."""
    return type(error)(*error.args) if isinstance(error, BaseException) else error


def fresh_failures(failures: dict[str, BaseException] | None) -> dict[str, BaseException]:
    return {hook: fresh(error) for hook, error in (failures or {}).items()}


def described(error: BaseException | None) -> Any:
    if error is None:
        return None
    return (type(error).__name__, str(error), tuple(getattr(error, "__notes__", ())))


class Named(StreamWatcher):
    """Writes every hook it hears into the shared `log`, under its name; `fail` maps a
    hook's name to the exception it raises there (``"update"`` on the first update,
    ``"enter"`` on the third enter: the second step)."""

    def __init__(
        self,
        name: str,
        log: list[tuple[Any, ...]],
        *,
        scoped: bool = False,
        awaitables: bool = False,
        fail: dict[str, BaseException] | None = None,
    ) -> None:
        self.name = name
        self.log = log
        self.scoped = scoped
        self.awaitables = awaitables
        self.fail = fail or {}
        self.entered = 0

    def _hook(self, *event: Any) -> Awaitable[None] | None:
        error = self.fail.get(event[0])
        if not self.awaitables:
            self.log.append((self.name, *event))
            if error is not None:
                raise error
            return None

        async def later() -> None:
            await asyncio.sleep(0)  # a real suspension, as a layer doing I/O there would
            self.log.append((self.name, "awaited", *event))
            if error is not None:
                raise error

        return later()

    def start(self) -> Awaitable[None] | None:
        return self._hook("start")

    def enter(self) -> Any:
        self.entered += 1
        self.log.append((self.name, "enter", self.entered))
        if self.entered == 3 and "enter" in self.fail:
            raise self.fail["enter"]
        return self.entered

    def exit(self, token: Any) -> None:
        self.log.append((self.name, "exit", token))

    def update(self, update: ChatResponseUpdate) -> None:
        self.log.append((self.name, "update", update.text))
        if "update" in self.fail:
            raise self.fail["update"]

    def end(self, how: StreamEnd, error: BaseException | None) -> Awaitable[None] | None:
        return self._hook("end", how, described(error))


@dataclass
class Story:
    """What one run of a scenario did."""

    log: list[tuple[Any, ...]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    error: Any = None
    inner: tuple[int, int] = (0, 0)  # the inner stream's reads and closes


@dataclass
class Scenario:
    levels: int = 3
    texts: tuple[str, ...] = ("a", "b")
    inner_error: BaseException | None = None
    close_error: BaseException | None = None
    scoped: bool = False
    awaitables: bool = False
    fail: dict[int, dict[str, BaseException]] = field(default_factory=dict)  # level -> hooks
    open_error: int | None = None  # the level whose opener raises
    caller: str = "read"  # read | close-after-first | throw-after-first | close-unread
    opened_later: bool = False  # the innermost stream is an `OpenedLater`


SCENARIOS: dict[str, Scenario] = {
    "completes": Scenario(),
    "completes-scoped": Scenario(scoped=True),
    "completes-awaitables": Scenario(awaitables=True, scoped=True),
    "one-level": Scenario(levels=1, scoped=True),
    "empty": Scenario(texts=()),
    "inner-fails": Scenario(inner_error=ValueError("boom"), scoped=True),
    "inner-fails-first": Scenario(texts=(), inner_error=ValueError("boom")),
    "inner-fails-and-close-fails": Scenario(
        inner_error=ValueError("boom"), close_error=OSError("reset"), scoped=True
    ),
    "close-fails-after-completing": Scenario(close_error=OSError("reset")),
    "caller-closes": Scenario(caller="close-after-first", scoped=True),
    "caller-closes-and-close-fails": Scenario(
        caller="close-after-first", close_error=OSError("reset")
    ),
    "caller-throws": Scenario(caller="throw-after-first", scoped=True),
    "closed-unread": Scenario(caller="close-unread"),
    "outer-start-fails": Scenario(fail={0: {"start": KeyError("start")}}),
    "middle-start-fails": Scenario(fail={1: {"start": KeyError("start")}}, scoped=True),
    "inner-start-fails-awaited": Scenario(
        fail={2: {"start": KeyError("start")}}, awaitables=True, scoped=True
    ),
    "middle-opener-fails": Scenario(open_error=1, scoped=True),
    "innermost-opener-fails": Scenario(open_error=2),
    "middle-update-fails": Scenario(fail={1: {"update": KeyError("update")}}, scoped=True),
    "inner-update-fails-close-fails": Scenario(
        fail={2: {"update": KeyError("update")}}, close_error=OSError("reset")
    ),
    "inner-end-fails": Scenario(fail={2: {"end": KeyError("end")}}, scoped=True),
    "inner-end-fails-awaited": Scenario(fail={2: {"end": KeyError("end")}}, awaitables=True),
    "middle-end-fails-on-abandon": Scenario(
        fail={1: {"end": KeyError("end")}}, caller="close-after-first"
    ),
    "middle-enter-fails": Scenario(fail={1: {"enter": KeyError("enter")}}, scoped=True),
    "opened-later": Scenario(opened_later=True, scoped=True),
    "opened-later-empty": Scenario(opened_later=True, texts=()),
    "opened-later-fails": Scenario(opened_later=True, texts=(), inner_error=ValueError("x")),
    "opened-later-closed": Scenario(opened_later=True, caller="close-after-first"),
}


async def run(scenario: Scenario, implementation: Forward) -> Story:
    story = Story()
    inner = Inner(
        *scenario.texts, error=fresh(scenario.inner_error), close_error=fresh(scenario.close_error)
    )

    def innermost() -> Updates:
        if not scenario.opened_later:
            return inner

        async def open_inner() -> tuple[Updates, ChatResponseUpdate | None]:
            try:
                return inner, await inner.__anext__()
            except StopAsyncIteration:
                return inner, None
            except BaseException:
                await close_stream(inner)
                raise

        return OpenedLater(open_inner)

    def opener(level: int) -> Callable[[], Updates]:
        def open_level() -> Updates:
            if scenario.open_error == level:
                raise LookupError(f"opening level {level}")
            if level == scenario.levels - 1:
                return innermost()
            return implementation(opener(level + 1), watcher(level + 1))

        return open_level

    def watcher(level: int) -> Named:
        return Named(
            "ABC"[level],
            story.log,
            scoped=scenario.scoped,
            awaitables=scenario.awaitables,
            fail=fresh_failures(scenario.fail.get(level)),
        )

    stream = implementation(opener(0), watcher(0))
    try:
        if scenario.caller == "close-unread":
            await stream.aclose()
        elif scenario.caller == "read":
            async for update in stream:
                story.texts.append(update.text)
        else:
            story.texts.append((await anext(stream)).text)
            if scenario.caller == "close-after-first":
                await stream.aclose()
            else:
                await stream.athrow(RuntimeError("thrown"))
    except BaseException as exc:
        story.error = described(exc)
    story.inner = (inner.reads, inner.closes)
    return story


@pytest.mark.parametrize("name", SCENARIOS)
async def test_a_fused_chain_tells_every_watcher_what_nested_loops_would(name: str) -> None:
    scenario = SCENARIOS[name]
    nested = await run(scenario, nested_forward)
    fused = await run(scenario, forward)
    assert fused.log == nested.log
    assert (fused.texts, fused.error) == (nested.texts, nested.error)
    if not scenario.opened_later:
        assert fused.inner == nested.inner
    else:
        # A fused chain reads an `OpenedLater`'s stream itself and closes it once; nested,
        # an empty one was closed once by the `OpenedLater` and again by the layer above.
        assert fused.inner[0] == nested.inner[0]
        assert fused.inner[1] == 1


async def test_a_fused_chain_is_one_loop_and_its_inner_streams_are_joined() -> None:
    log: list[tuple[Any, ...]] = []
    middle = forward(lambda: Inner("a"), Named("B", log))
    outer = forward(lambda: middle, Named("A", log))
    assert type(outer) is Forwarded
    assert [u.text async for u in outer] == ["a"]
    assert log == [
        ("A", "start"),
        ("B", "start"),
        ("B", "update", "a"),
        ("A", "update", "a"),
        ("B", "end", "completed", None),
        ("A", "end", "completed", None),
    ]
    # The joined stream belongs to the chain that opened it: reading it is a mistake.
    with pytest.raises(RuntimeError, match="joined"):
        await anext(middle)


async def test_a_stream_read_once_elsewhere_is_read_not_joined() -> None:
    log: list[tuple[Any, ...]] = []
    inner = forward(lambda: Inner("a", "b"), Named("B", log))
    assert (await anext(inner)).text == "a"
    outer = forward(lambda: inner, Named("A", log))
    assert [u.text async for u in outer] == ["b"]
    assert log[-2:] == [("B", "end", "completed", None), ("A", "end", "completed", None)]


async def test_the_callers_cancellation_while_it_holds_an_update_cancels_every_level() -> None:
    for implementation in (nested_forward, forward):
        log: list[tuple[Any, ...]] = []
        inner = Inner("a", "b")
        holding = asyncio.Event()

        async def caller(implementation: Forward = implementation) -> None:
            stream = implementation(
                lambda: implementation(lambda: inner, Named("B", log)),  # noqa: B023
                Named("A", log),  # noqa: B023
            )
            try:
                async for _ in stream:
                    holding.set()  # noqa: B023
                    await asyncio.Event().wait()  # until cancelled
            finally:
                await stream.aclose()

        task = asyncio.create_task(caller())
        await holding.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert log[-2:] == [("B", "end", "canceled", None), ("A", "end", "canceled", None)]
        assert inner.closes == 1


async def test_a_dropped_stream_is_closed_by_the_loop_and_its_watchers_hear_it() -> None:
    # As an async generator dropped between updates is: the loop closes it (abandoned).
    log: list[tuple[Any, ...]] = []
    inner = Inner("a", "b")
    stream = forward(lambda: forward(lambda: inner, Named("B", log)), Named("A", log))
    assert (await anext(stream)).text == "a"
    del stream
    for _ in range(10):  # the loop's finalizer schedules the close: a few turns at most
        if inner.closes:
            break
        await asyncio.sleep(0)
    assert inner.closes == 1
    assert log[-2:] == [("B", "end", "abandoned", None), ("A", "end", "abandoned", None)]


# -- the routing engine's stream runs the layers above it ------------------------------------


def routed(name: str) -> tuple[list[Any], list[Any], str, dict[int, dict[str, BaseException]]]:
    """A routed scenario, made afresh for each run: (primary's script, backup's script,
    how the caller reads, the watchers' failures by level)."""
    ab = [reply("ab", chunks=["a", "b"])]
    down = TransientProviderError
    return {
        "completes": (ab, [], "read", {}),
        "fails-over-before-output": (
            [fail(down("down"))],
            [reply("xy", chunks=["x", "y"])],
            "read",
            {},
        ),
        "fails-after-output": ([fail_after(["a"], down("cut"))], [], "read", {}),
        "caller-closes": (ab, [], "close-after-first", {}),
        "caller-throws": (ab, [], "throw-after-first", {}),
        "every-route-fails": ([fail(down("one"))], [fail(down("two"))], "read", {}),
        "outer-update-fails": (ab, [], "read", {0: {"update": KeyError("u")}}),
        "inner-update-fails": (ab, [], "read", {1: {"update": KeyError("u")}}),
        "outer-enter-fails": (ab, [], "read", {0: {"enter": KeyError("e")}}),
        "inner-end-fails": (ab, [], "read", {1: {"end": KeyError("end")}}),
    }[name]


ROUTED = (
    "completes",
    "fails-over-before-output",
    "fails-after-output",
    "caller-closes",
    "caller-throws",
    "every-route-fails",
    "outer-update-fails",
    "inner-update-fails",
    "outer-enter-fails",
    "inner-end-fails",
)


async def run_routed(name: str, implementation: Forward) -> tuple[Story, list[Any]]:
    primary_steps, backup_steps, caller, failures = routed(name)
    story = Story()
    primary = ScriptedChatClient(*primary_steps)
    backup = ScriptedChatClient(*(backup_steps or [reply("z")]))
    router = (
        ChatPipeline.builder()
        .use_ordered_failover([Route("primary", primary), Route("backup", backup)])
        .build()
    )
    engine: Any = router.client
    contexts: list[Any] = []
    select = engine.select_client

    def recording(context: Any) -> Any:
        contexts.append(context)
        return select(context)

    engine.select_client = recording

    def watcher(level: int) -> Named:
        return Named("AB"[level], story.log, scoped=True, fail=failures.get(level))

    # Two layers above the router's stream, as logging and telemetry would be.
    stream = implementation(
        lambda: implementation(lambda: engine.get_streaming_response("hi"), watcher(1)),
        watcher(0),
    )
    try:
        if caller == "read":
            async for update in stream:
                story.texts.append(update.text)
        else:
            story.texts.append((await anext(stream)).text)
            if caller == "close-after-first":
                await stream.aclose()
            else:
                await stream.athrow(RuntimeError("thrown"))
    except BaseException as exc:
        story.error = described(exc)
    story.inner = (primary.streams_opened, primary.streams_closed)
    await router.aclose()
    attempts = contexts[0].attempts if contexts else []
    return story, [(a.route_name, a.outcome, described(a.exception)) for a in attempts]


@pytest.mark.parametrize("name", ROUTED)
async def test_layers_above_a_router_hear_what_nested_loops_would(name: str) -> None:
    nested, nested_attempts = await run_routed(name, nested_forward)
    fused, fused_attempts = await run_routed(name, forward)
    assert fused.log == nested.log
    assert (fused.texts, fused.error, fused.inner) == (nested.texts, nested.error, nested.inner)
    assert fused_attempts == nested_attempts


async def test_a_routers_stream_read_on_its_own_runs_no_layers() -> None:
    router = (
        ChatPipeline.builder()
        .use_ordered_failover([Route("only", ScriptedChatClient(reply("ab", chunks=["a", "b"])))])
        .build()
    )
    stream = router.get_streaming_response("hi")
    assert type(stream) is Adopting
    assert [u.text async for u in stream] == ["a", "b"]
    await router.aclose()
