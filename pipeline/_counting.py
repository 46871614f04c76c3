"""A count that can be awaited: tests wait for the n-th call instead of sleeping."""

from __future__ import annotations

import asyncio

__all__ = ["CountWaiters"]


class CountWaiters:
    """Futures waiting for a count to reach a number; `notify(count)` wakes the due ones."""

    def __init__(self) -> None:
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []

    async def wait(self, current: int, count: int) -> None:
        if current >= count:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((count, future))
        await future

    def notify(self, current: int) -> None:
        due = [w for w in self._waiting if w[0] <= current]
        for waiter in due:
            self._waiting.remove(waiter)
            if not waiter[1].done():
                waiter[1].set_result(None)
