"""Latency when the primary hangs until its timeout: circuit breaker on vs off.

The primary route takes `--timeout` seconds and then fails (as a provider read timeout
does); the backup answers after `--backup-latency`. Prints p50/p99 per request over
`--requests` requests for: the backup alone (the baseline), failover without a breaker, and
failover with a breaker (fail_max=5), where p99 after the breaker opens should sit within a
few milliseconds of the backup's own latency.

    python benchmarks/bench_breaker.py [--requests 200] [--timeout 2.0] [--backup-latency 0.02]

With ``--instructions CALLS``, the cost per call of a healthy breaker instead, in
instructions (valgrind's callgrind: other load on the machine does not move them), for
`get_response` and one-update streams, all in the same run: the bare client (the baseline),
the breaker with the consecutive count only, with `failure_ratio`, and with `failure_ratio`
and `slow_call_duration`; then the same breakers shared through a redis-server started for
the run (the client's instructions only; Redis round trips per call counted by the server).
Each variant runs twice, with CALLS and a quarter of them, in a fresh process; the
difference leaves out the start-up.

    python benchmarks/bench_breaker.py --instructions 2000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

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


WORKLOAD = Path(__file__).resolve().parent / "breaker_calls.py"
LAYERS = ["bare", "breaker", "ratio", "ratio_slow"]


def collected(layer: str, calls: int, streaming: bool, redis: str | None) -> int:
    """Instructions of one run of `breaker_calls.py` under callgrind."""
    argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
            str(WORKLOAD), "--layer", layer, "--calls", str(calls)]  # fmt: skip
    if streaming:
        argv.append("--streaming")
    if redis is not None:
        argv += ["--redis", redis]
    done = subprocess.run(
        argv, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"}
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{layer}: callgrind run failed\n{done.stderr[-2000:]}")
    return int(found.group(1))


def round_trips(port: int) -> int:
    """The reads a healthy breaker sends (``MGET``, or ``EVALSHA`` with a window) so far: the
    commands its scripts run inside count in the server's totals, but are no round trips."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    reads = (stats.get(f"cmdstat_{name}", {}) for name in ("mget", "evalsha"))
    return sum(int(read.get("calls", 0)) for read in reads)


def instructions(calls: int) -> None:
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.redis_server import running_redis_server

    few = max(1, calls // 4)
    print(f"Healthy breaker, instructions per call (callgrind, {calls} minus {few} calls)")
    with running_redis_server() as server:
        for shared in (False, True):
            redis = server.url if shared else None
            for streaming in (False, True):
                shape = "one-update stream" if streaming else "get_response"
                where = "shared through Redis" if shared else "local"
                print(f"  {shape}, {where}:")
                per_call: dict[str, float] = {}
                for layer in LAYERS if not shared else LAYERS[1:]:
                    before = round_trips(server.port)
                    small = collected(layer, few, streaming, redis)
                    middle = round_trips(server.port)
                    large = collected(layer, calls, streaming, redis)
                    after = round_trips(server.port)
                    per_call[layer] = (large - small) / (calls - few)
                    # The difference leaves out connecting and loading scripts, too.
                    commands = ((after - middle) - (middle - before)) / (calls - few)
                    line = f"    {layer:<11} {per_call[layer]:10.0f}"
                    if "bare" in per_call and layer != "bare":
                        line += f"   added over bare {per_call[layer] - per_call['bare']:+9.0f}"
                    if layer.startswith("ratio"):
                        line += f"   over breaker {per_call[layer] - per_call['breaker']:+8.0f}"
                        line += f" ({per_call[layer] / per_call['breaker'] - 1:+.1%})"
                    if shared:
                        line += f"   Redis round trips per call {commands:.2f}"
                    print(line, flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--backup-latency", type=float, default=0.02)
    parser.add_argument(
        "--instructions",
        type=int,
        metavar="CALLS",
        help="count a healthy breaker's instructions per call under callgrind instead",
    )
    args = parser.parse_args()
    if args.instructions:
        instructions(args.instructions)
    else:
        asyncio.run(main(args.requests, args.timeout, args.backup_latency))
