"""The sliding window of a circuit breaker's ratio policies: how many calls ended in the last
`window` seconds, how many of them failed, how many were slow.

The window is `BUCKETS` buckets of ``window / BUCKETS`` seconds each, numbered from the
breaker's monotonic clock (bucket ``k`` holds the outcomes that ended in
``[k * width, (k + 1) * width)`` of it), so a wall clock that jumps moves nothing. Replicas
add their outcomes up in Redis on Redis' clock (`middleware._breaker_redis` moves each
process's bucket numbers onto it). A bucket leaves the window
whole, so an outcome counts for between ``0.9 * window`` and ``window`` seconds after it
ended (as in Polly's rolling health metrics, which also use ten). Totals are kept as
outcomes are added and buckets leave (subtract on evict, as resilience4j does), so reading
them costs the same whatever the window holds.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["BUCKETS", "Counts", "RatioPolicy", "SlidingWindow"]

BUCKETS = 10
_EMPTY: list[int | None] = [None] * BUCKETS


class Counts(NamedTuple):
    """Calls that ended, of which failed and of which slow (a call may be both)."""

    calls: int
    failures: int
    slow: int


class SlidingWindow:
    """Outcomes per bucket over the last `BUCKETS` buckets (numbered by
    `RatioPolicy.bucket` from the breaker's clock). The newest bucket seen is the current
    one; outcomes added to an older bucket count if it is still in the window, else
    nowhere."""

    __slots__ = ("_calls", "_failures", "_held", "_newest", "_slow", "calls", "failures", "slow")

    def __init__(self) -> None:
        self._held: list[int | None] = [None] * BUCKETS  # the bucket each slot holds
        self._calls = [0] * BUCKETS
        self._failures = [0] * BUCKETS
        self._slow = [0] * BUCKETS
        self._newest: int | None = None
        self.calls = self.failures = self.slow = 0

    def add(self, bucket: int, calls: int, failures: int, slow: int) -> None:
        """Count outcomes that ended in `bucket`."""
        self.slide(bucket)
        newest = self._newest
        if newest is not None and bucket <= newest - BUCKETS:
            return  # already out of the window
        slot = bucket % BUCKETS
        if self._held[slot] != bucket:
            self._evict(slot)
            self._held[slot] = bucket
        self._calls[slot] += calls
        self._failures[slot] += failures
        self._slow[slot] += slow
        self.calls += calls
        self.failures += failures
        self.slow += slow

    def counts(self, bucket: int) -> Counts:
        """The outcomes in the window that ends with `bucket` (the current one)."""
        self.slide(bucket)
        return Counts(self.calls, self.failures, self.slow)

    def slide(self, bucket: int) -> None:
        """Drop the buckets that are out of the window once `bucket` is the current one."""
        newest = self._newest
        if newest is not None and bucket <= newest:
            return
        self._newest = bucket
        if newest is None:
            return
        if bucket - newest >= BUCKETS:
            # Everything the window held is older than the new window: one pass over the slots.
            for slot in range(BUCKETS):
                self._evict(slot)
            return
        # Only the slots of buckets that just left can hold anything to drop.
        for old in range(newest - BUCKETS + 1, bucket - BUCKETS + 1):
            slot = old % BUCKETS
            if self._held[slot] == old:
                self._evict(slot)

    def buckets(self) -> list[tuple[int, int, int, int]]:
        """``(bucket, calls, failures, slow)`` of every bucket holding something."""
        return [
            (bucket, self._calls[slot], self._failures[slot], self._slow[slot])
            for slot, bucket in enumerate(self._held)
            if bucket is not None and self._calls[slot]
        ]

    def clear(self) -> None:
        if self._held != _EMPTY:
            self._held = [None] * BUCKETS
            self._calls = [0] * BUCKETS
            self._failures = [0] * BUCKETS
            self._slow = [0] * BUCKETS
            self.calls = self.failures = self.slow = 0

    def _evict(self, slot: int) -> None:
        if self._held[slot] is None:
            return
        self.calls -= self._calls[slot]
        self.failures -= self._failures[slot]
        self.slow -= self._slow[slot]
        self._calls[slot] = self._failures[slot] = self._slow[slot] = 0
        self._held[slot] = None


class RatioPolicy:
    """When the window opens the circuit: with at least `minimum_calls` calls in it, a
    failure ratio at or above `failure_ratio`, or (with `slow_call_duration`) a ratio of
    calls slower than that at or above `slow_call_ratio`. ``None`` turns a ratio off."""

    __slots__ = ("failure_ratio", "minimum_calls", "slow_call_ratio", "width")

    def __init__(
        self,
        *,
        window: float,
        minimum_calls: int,
        failure_ratio: float | None,
        slow_call_ratio: float | None,
    ) -> None:
        self.width = window / BUCKETS
        self.minimum_calls = minimum_calls
        self.failure_ratio = failure_ratio
        self.slow_call_ratio = slow_call_ratio

    def bucket(self, seconds: float) -> int:
        """The bucket of a moment (seconds of the clock the window follows)."""
        return int(seconds // self.width)

    def passed(self, counts: Counts) -> str | None:
        """Which threshold `counts` reach (``"failure_ratio"`` or ``"slow_call_ratio"``),
        or ``None``. Ratios are divided out, so 3 failures in 10 calls reach 0.3 exactly."""
        calls = counts.calls
        if calls < self.minimum_calls or calls <= 0:
            return None
        if self.failure_ratio is not None and counts.failures / calls >= self.failure_ratio:
            return "failure_ratio"
        if self.slow_call_ratio is not None and counts.slow / calls >= self.slow_call_ratio:
            return "slow_call_ratio"
        return None
