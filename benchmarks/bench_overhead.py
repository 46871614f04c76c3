"""Overhead of the pipeline and of each layer around an in-process client.

Baseline: the bare `ScriptedChatClient`, measured in the same run. Prints time per call and
per streamed update, the ratio to the baseline, and the microseconds added; then, per
request of a short stream, the hedging router against ordered failover (its healthy first
route answers before any hedge is due: what hedging costs when it does not fire).

    python benchmarks/bench_overhead.py [--calls 20000] [--updates 200000]
    python benchmarks/bench_overhead.py --instructions [--calls 2000]

``--instructions`` counts the routers' instructions per request under valgrind's callgrind
instead (each router runs `calls` and 4x `calls` requests in a fresh process; the
difference cancels the start-up), which other load on the machine does not move.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import best_per_op, report

from middleware.function_invocation import tool
from middleware.routing import (
    BalancedFailoverChatClient,
    HedgingChatClient,
    OrderedFailoverChatClient,
)
from pipeline import ChatClient, ChatMessage, ChatPipeline
from pipeline.testing import ScriptedChatClient, reply


@tool
def echo(text: str) -> str:
    """Echo the text back."""
    return text


async def drain(client: ChatClient, messages: list[ChatMessage]) -> None:
    async for _ in client.get_streaming_response(messages):
        pass


NO_HEDGE = 60.0  # seconds: an in-process answer never waits that long, so no hedge fires


def hedging(*routes: ScriptedChatClient) -> HedgingChatClient:
    # A fixed delay: a percentile of in-process answers (microseconds) would hedge at once.
    return HedgingChatClient(list(routes), delay=NO_HEDGE, strategy="round_robin")


async def main(calls: int, updates: int) -> None:
    messages = [ChatMessage.user("hello")]
    bare = ScriptedChatClient(reply("ok"))
    empty = ChatPipeline.builder().build(ScriptedChatClient(reply("ok")))
    failover = (
        ChatPipeline.builder()
        .use_ordered_failover(
            [ScriptedChatClient(reply("ok"), name="primary"), ScriptedChatClient(name="backup")]
        )
        .build()
    )
    retry = ChatPipeline.builder().use_retry().build(ScriptedChatClient(reply("ok")))
    breaker = ChatPipeline.builder().use_circuit_breaker().build(ScriptedChatClient(reply("ok")))
    tools = (
        ChatPipeline.builder()
        .use_function_invocation([echo])
        .build(ScriptedChatClient(reply("ok")))
    )
    hedged = hedging(
        ScriptedChatClient(reply("ok"), name="primary"), ScriptedChatClient(name="backup")
    )

    print(f"get_response, {calls} calls, best of 5")
    base = await best_per_op(lambda: bare.get_response(messages), ops=calls)
    print(report("bare ScriptedChatClient (baseline)", base, base))
    for label, client in (
        ("empty ChatPipeline", empty),
        ("ordered failover, healthy", failover),
        ("retry layer, healthy", retry),
        ("circuit breaker, healthy", breaker),
        ("function invocation, no tool called", tools),
        ("hedging, healthy first route (no hedge)", hedged),
    ):
        t = await best_per_op(lambda c=client: c.get_response(messages), ops=calls)
        print(report(label, base, t))

    chunks = ["x"] * 1000
    streams = max(1, updates // len(chunks))
    bare_s = ScriptedChatClient(reply("x" * 1000, chunks=chunks))
    empty_s = ChatPipeline.builder().build(ScriptedChatClient(reply("x" * 1000, chunks=chunks)))
    failover_s = OrderedFailoverChatClient(
        [ScriptedChatClient(reply("x" * 1000, chunks=chunks)), ScriptedChatClient()]
    )
    retry_s = (
        ChatPipeline.builder()
        .use_retry()
        .build(ScriptedChatClient(reply("x" * 1000, chunks=chunks)))
    )
    breaker_s = (
        ChatPipeline.builder()
        .use_circuit_breaker()
        .build(ScriptedChatClient(reply("x" * 1000, chunks=chunks)))
    )
    tools_s = (
        ChatPipeline.builder()
        .use_function_invocation([echo])
        .build(ScriptedChatClient(reply("x" * 1000, chunks=chunks)))
    )
    hedged_s = hedging(
        ScriptedChatClient(reply("x" * 1000, chunks=chunks), name="a"), ScriptedChatClient()
    )
    print(f"\nget_streaming_response, {streams} streams x {len(chunks)} updates, best of 5")
    base = await best_per_op(lambda: drain(bare_s, messages), ops=streams) / len(chunks)
    print(report("bare ScriptedChatClient (baseline)", base, base, "update"))
    for label, client in (
        ("empty ChatPipeline", empty_s),
        ("ordered failover, healthy", failover_s),
        ("retry layer, healthy", retry_s),
        ("circuit breaker, healthy", breaker_s),
        ("function invocation, no tool called", tools_s),
        ("hedging, healthy first route (no hedge)", hedged_s),
    ):
        t = await best_per_op(lambda c=client: drain(c, messages), ops=streams) / len(chunks)
        print(report(label, base, t, "update"))

    # Per request of a short stream (ten updates): the hedging router's first update goes
    # through a task of its own, so its cost is per request, not per update.
    short = ["x"] * 10
    requests = max(1, calls // 2)
    bare_r = ScriptedChatClient(reply("x" * 10, chunks=short))
    failover_r = OrderedFailoverChatClient(
        [ScriptedChatClient(reply("x" * 10, chunks=short)), ScriptedChatClient()]
    )
    hedged_r = hedging(ScriptedChatClient(reply("x" * 10, chunks=short), name="a"), bare_r)
    print(f"\nget_streaming_response, {requests} streams x {len(short)} updates, best of 5")
    base = await best_per_op(lambda: drain(bare_r, messages), ops=requests)
    print(report("bare ScriptedChatClient (baseline)", base, base, "stream"))
    ordered = await best_per_op(lambda: drain(failover_r, messages), ops=requests)
    print(report("ordered failover, healthy", base, ordered, "stream"))
    hedge = await best_per_op(lambda: drain(hedged_r, messages), ops=requests)
    print(report("hedging, healthy first route (no hedge)", base, hedge, "stream"))
    print(f"hedging / ordered failover: {hedge / ordered:.2f}x per stream")


ROUTERS = ("bare", "ordered", "balanced", "hedging")
SHAPES = ("get_response", "stream10")


async def run_router(router: str, shape: str, calls: int) -> None:
    """`calls` requests of `shape` through `router` (a fixed workload for callgrind)."""
    messages = [ChatMessage.user("hello")]
    short = ["x"] * 10

    def scripted(name: str = "primary") -> ScriptedChatClient:
        return ScriptedChatClient(reply("x" * 10, chunks=short), name=name)

    client: ChatClient
    if router == "bare":
        client = scripted()
    elif router == "ordered":
        client = OrderedFailoverChatClient([scripted(), scripted("backup")])
    elif router == "balanced":  # what hedging builds on: the same choice, no race
        client = BalancedFailoverChatClient(
            [scripted(), scripted("backup")], strategy="round_robin"
        )
    else:
        client = hedging(scripted(), scripted("backup"))
    for _ in range(calls):
        if shape == "stream10":
            await drain(client, messages)
        else:
            await client.get_response(messages)


def instruction_counts(calls: int) -> None:
    import os
    import re
    import shutil
    import subprocess

    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")

    def count(router: str, shape: str, n: int) -> int:
        done = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
             __file__, "--run-router", router, shape, str(n)],
            capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )  # fmt: skip
        found = re.search(r"Collected : (\d+)", done.stderr)
        if found is None:
            raise SystemExit(done.stderr[-2000:])
        return int(found.group(1))

    print(f"instructions per request (callgrind, {4 * calls} minus {calls} requests)")
    for shape in SHAPES:
        per = {
            router: (count(router, shape, 4 * calls) - count(router, shape, calls)) / (3 * calls)
            for router in ROUTERS
        }
        print(
            f"  {shape:<13} bare {per['bare']:8.0f}  ordered {per['ordered']:8.0f}"
            f"  balanced {per['balanced']:8.0f}  hedging (no hedge) {per['hedging']:8.0f}"
            f"  hedging / ordered {per['hedging'] / per['ordered']:4.2f}x"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--updates", type=int, default=200_000)
    parser.add_argument("--instructions", action="store_true")
    parser.add_argument("--run-router", nargs=3, metavar=("ROUTER", "SHAPE", "CALLS"))
    args = parser.parse_args()
    if args.run_router is not None:
        router, shape, count = args.run_router
        asyncio.run(run_router(router, shape, int(count)))
    elif args.instructions:
        instruction_counts(args.calls if args.calls != 20_000 else 2000)
    else:
        asyncio.run(main(args.calls, args.updates))
