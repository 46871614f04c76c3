"""Shared timing helpers: best-of-repeats timing of async callables in one event loop."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable


async def best_per_op(op: Callable[[], Awaitable[object]], *, ops: int, repeats: int = 5) -> float:
    """Seconds per call of `op`, the best of `repeats` runs of `ops` calls (bounded loops)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(ops):
            await op()
        best = min(best, (time.perf_counter() - start) / ops)
    return best


def report(label: str, baseline: float, measured: float, unit: str = "call") -> str:
    added_us = (measured - baseline) * 1e6
    return (
        f"{label:<46} {measured * 1e6:8.2f} us/{unit}  ratio {measured / baseline:5.2f}x  "
        f"added {added_us:+7.2f} us/{unit}"
    )
