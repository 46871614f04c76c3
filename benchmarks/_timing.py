"""Shared timing helpers: best-of-repeats timing of async callables in one event loop."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable


async def best_per_op(
    op: Callable[[], Awaitable[object]],
    *,
    ops: int,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds per call of `op`, the best of `repeats` runs of `ops` calls (bounded loops).

    `clock=time.process_time` counts this process's CPU time (all its threads) instead of
    wall time: steadier on a machine shared with other work."""
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        for _ in range(ops):
            await op()
        best = min(best, (clock() - start) / ops)
    return best


def report(label: str, baseline: float, measured: float, unit: str = "call") -> str:
    added_us = (measured - baseline) * 1e6
    return (
        f"{label:<46} {measured * 1e6:8.2f} us/{unit}  ratio {measured / baseline:5.2f}x  "
        f"added {added_us:+7.2f} us/{unit}"
    )
