"""The event loop a synchronously called adapter runs its pipeline on.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["HomeLoop"]

T = TypeVar("T")


class HomeLoop:
    """The one event loop an adapter runs its pipeline on (see the module docstring)."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._lock = threading.Lock()
        self._home: asyncio.AbstractEventLoop | None = None
        self._private: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- which loop ------------------------------------------------------------------------

    def _private_loop(self) -> asyncio.AbstractEventLoop:
        """The private loop, started on first use (under the lock)."""
        if self._private is None or self._private.is_closed():
            loop = asyncio.new_event_loop()
            started = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(started.set)
                loop.run_forever()

            thread = threading.Thread(target=run, name=f"{self._owner} event loop", daemon=True)
            thread.start()
            started.wait()
            self._private, self._thread = loop, thread
        return self._private

    def for_async(self) -> asyncio.AbstractEventLoop | None:
        """None when the caller's loop is home (run there), else the private loop to hand
        the call to."""
        running = asyncio.get_running_loop()
        with self._lock:
            home = self._home
            if home is None or home.is_closed():
                self._home = running
                return None
            if home is running:
                return None
            if home is self._private:
                return home
        raise RuntimeError(
            f"{self._owner}: its pipeline runs on another event loop, and a pipeline's "
            "connections cannot move between loops; call it from one event loop (or build "
            "one model, over its own pipeline, per loop)"
        )

    def for_blocking(self) -> asyncio.AbstractEventLoop:
        """The private loop a blocking call is handed to."""
        with self._lock:
            home = self._home
            if home is None or home.is_closed() or home is self._private:
                home = self._home = self._private_loop()
                return home
        raise RuntimeError(
            f"{self._owner}: its pipeline already runs on the event loop of async calls; a "
            "blocking call cannot wait on that loop: use the async methods (ainvoke, astream, "
            "abatch) there, or one model per way of calling"
        )

    # -- running -----------------------------------------------------------------------------

    def run_blocking(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the private loop and wait for its result."""
        try:
            loop = self.for_blocking()
        except BaseException:
            coroutine.close()
            raise
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        if current is loop:
            coroutine.close()
            raise RuntimeError(
                f"{self._owner}: a blocking call from a task of its own event loop would "
                "deadlock; await the async method instead"
            )
        # run_coroutine_threadsafe starts the task in a copy of this thread's context.
        future = asyncio.run_coroutine_threadsafe(coroutine, loop)
        try:
            return future.result()
        except BaseException:
            # Interrupted while waiting (KeyboardInterrupt): the task must not run on.
            if not future.done():
                future.cancel()
                concurrent.futures.wait([future])
            raise

    async def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Await `coroutine` on the home loop: here, or handed to the private loop."""
        try:
            loop = self.for_async()
        except BaseException:
            coroutine.close()
            raise
        if loop is None:
            return await coroutine
        return await _handed_over(coroutine, loop)

    def close(self) -> None:
        """Stop the private loop (if one was started) and wait for its thread."""
        with self._lock:
            loop, thread = self._private, self._thread
            self._private = self._thread = None
            if self._home is loop:
                self._home = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if thread is threading.current_thread():
            return  # closed from a task of its own loop: it stops when that task yields
        thread.join()
        loop.close()


async def _handed_over(coroutine: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop) -> T:
    """Run `coroutine` as a task on `loop`; cancelling the caller cancels the task and waits
    until it has ended (its cleanup included) before the cancellation propagates."""
    tasks: list[asyncio.Task[T]] = []
    done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def start() -> None:
        # Runs on `loop`, in a copy of the caller's context (call_soon_threadsafe takes it).
        task = loop.create_task(coroutine)
        task.add_done_callback(lambda _: done.set_result(None))
        tasks.append(task)

    loop.call_soon_threadsafe(start)
    try:
        await asyncio.shield(asyncio.wrap_future(done))
    except asyncio.CancelledError:
        # Callbacks run in the order they were scheduled: the task exists by then.
        loop.call_soon_threadsafe(lambda: tasks[0].cancel())
        await asyncio.shield(asyncio.wrap_future(done))
        raise
    return tasks[0].result()
