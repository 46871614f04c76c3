"""What the failed attempts of a request said about asking again, carried by the failure
that ends it.

A router's request that fails has usually heard from several routes: one rate limited
with ``Retry-After: 30``, one whose breaker opens again in 5 s, one that failed and said
nothing. A `RetrySignal` is what they said together: when the earliest of them may serve
again, and whether one refused for a rate limit without saying when. The router attaches
it to the exception it raises (`attach`), so whoever answers the caller (the gateway)
reads every attempt's word from the one failure it gets (`signal_of`), even a request
that got another request's failure (a cache's single flight); a failure without one
speaks for itself (its own ``Retry-After``, its own kind). Request-local: nothing here
outlives the failure it is attached to.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from pipeline.errors import FailureKind, classify, retry_after_of

__all__ = ["NOTHING", "RetrySignal", "attach", "signal_of"]

_ATTRIBUTE = "_chat_pipeline_retry_signal"


@dataclass(frozen=True, slots=True)
class RetrySignal:
    """`at`: when (on `time.monotonic`) the earliest attempt said a route may serve again
    (a ``Retry-After``, an open breaker's next probe), None when none said; `rate_limited`:
    an attempt was refused for a rate limit without saying when."""

    at: float | None = None
    rate_limited: bool = False

    def wait(self) -> float | None:
        """Seconds from now until `at` (never negative), or None."""
        if self.at is None:
            return None
        return max(0.0, self.at - time.monotonic())

    def joined(self, other: RetrySignal) -> RetrySignal:
        """What this and `other` said together: the earlier time, either flag."""
        at = self.at
        if other.at is not None and (at is None or other.at < at):
            at = other.at
        return RetrySignal(at, self.rate_limited or other.rate_limited)


NOTHING = RetrySignal()


def signal_of(exc: BaseException) -> RetrySignal:
    """What `exc` says about asking again: the signal a router attached to it, else its own
    word (its ``Retry-After`` or an open breaker's wait; a rate limit that gave none)."""
    attached = getattr(exc, _ATTRIBUTE, None)
    if isinstance(attached, RetrySignal):
        return attached
    wait = retry_after_of(exc)
    if wait is not None:
        return RetrySignal(time.monotonic() + wait)
    if classify(exc) is FailureKind.RATE_LIMITED:
        return RetrySignal(rate_limited=True)
    return NOTHING


def attach(exc: BaseException, signal: RetrySignal) -> None:
    """Make `signal` what `exc` says (the router raising it heard it from every attempt)."""
    with contextlib.suppress(AttributeError, TypeError):  # an exception without a __dict__
        setattr(exc, _ATTRIBUTE, signal)
