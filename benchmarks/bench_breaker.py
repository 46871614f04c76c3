"""Latency when the primary hangs until its timeout: circuit breaker on vs off.

The primary route takes `--timeout` seconds and then fails (as a provider read timeout
does); the backup answers after `--backup-latency`. Prints p50/p99 per request over
`--requests` requests for: the backup alone (the baseline), failover without a breaker, and
failover with a breaker (fail_max=5), where p99 after the breaker opens should sit within a
few milliseconds of the backup's own latency.

    python benchmarks/bench_breaker.py [--requests 200] [--timeout 2.0] [--backup-latency 0.02]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

from middleware.routing import OrderedFailoverChatClient, Route
from pipeline import ChatClient, ChatPipeline
from pipeline.errors import TransientProviderError
from pipeline.testing import ScriptedChatClient, fail, reply


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return statistics.median(ordered), p99


async def timed(call: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await call()
    return time.perf_counter() - start


def router(timeout: float, backup_latency: float, breaker: bool) -> ChatClient:
    primary = ScriptedChatClient(
        lambda m, o: fail(TransientProviderError("read timeout"), delay=timeout), name="primary"
    )
    backup = ScriptedChatClient(reply("ok", delay=backup_latency), name="backup")
    route = (
        ChatPipeline.builder()
        .use_circuit_breaker(fail_max=5, reset_timeout=3600, enabled=breaker)
        .build(primary)
    )
    return OrderedFailoverChatClient([Route("primary", route), Route("backup", backup)])


async def main(requests: int, primary_seconds: float, backup_latency: float) -> None:
    backup_alone = ScriptedChatClient(reply("ok", delay=backup_latency))
    base = [await timed(lambda: backup_alone.get_response("hi")) for _ in range(requests)]

    # Without a breaker every request waits for the timeout; run them concurrently so the
    # benchmark ends in about one timeout (a sleep's latency does not depend on concurrency).
    off = router(primary_seconds, backup_latency, breaker=False)
    without = await asyncio.gather(
        *(timed(lambda: off.get_response("hi")) for _ in range(requests))
    )

    on = router(primary_seconds, backup_latency, breaker=True)
    with_breaker = [await timed(lambda: on.get_response("hi")) for _ in range(requests)]
    after_open = with_breaker[5:]

    print(
        f"{requests} requests, primary fails after {primary_seconds:.1f} s, "
        f"backup {backup_latency * 1000:.0f} ms"
    )
    rows = [
        ("backup alone (baseline)", base),
        ("failover, breaker off", list(without)),
        ("failover, breaker on (all requests)", with_breaker),
        ("failover, breaker on (after it opened)", after_open),
    ]
    _, base_p99 = percentiles(base)
    for label, samples in rows:
        p50, p99 = percentiles(samples)
        print(
            f"{label:<42} p50 {p50 * 1000:9.2f} ms  p99 {p99 * 1000:9.2f} ms  "
            f"p99 - baseline p99 {(p99 - base_p99) * 1000:+9.2f} ms"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--backup-latency", type=float, default=0.02)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.timeout, args.backup_latency))
