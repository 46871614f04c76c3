"""Overhead of the pipeline and of each layer around an in-process client.

Baseline: the bare `ScriptedChatClient`, measured in the same run. Prints time per call and
per streamed update, the ratio to the baseline, and the microseconds added.

    python benchmarks/bench_overhead.py [--calls 20000] [--updates 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import best_per_op, report

from middleware.function_invocation import tool
from middleware.routing import OrderedFailoverChatClient
from pipeline import ChatClient, ChatMessage, ChatPipeline
from pipeline.testing import ScriptedChatClient, reply


@tool
def echo(text: str) -> str:
    """Echo the text back."""
    return text


async def drain(client: ChatClient, messages: list[ChatMessage]) -> None:
    async for _ in client.get_streaming_response(messages):
        pass


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

    print(f"get_response, {calls} calls, best of 5")
    base = await best_per_op(lambda: bare.get_response(messages), ops=calls)
    print(report("bare ScriptedChatClient (baseline)", base, base))
    for label, client in (
        ("empty ChatPipeline", empty),
        ("ordered failover, healthy", failover),
        ("retry layer, healthy", retry),
        ("circuit breaker, healthy", breaker),
        ("function invocation, no tool called", tools),
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
    print(f"\nget_streaming_response, {streams} streams x {len(chunks)} updates, best of 5")
    base = await best_per_op(lambda: drain(bare_s, messages), ops=streams) / len(chunks)
    print(report("bare ScriptedChatClient (baseline)", base, base, "update"))
    for label, client in (
        ("empty ChatPipeline", empty_s),
        ("ordered failover, healthy", failover_s),
        ("retry layer, healthy", retry_s),
        ("circuit breaker, healthy", breaker_s),
        ("function invocation, no tool called", tools_s),
    ):
        t = await best_per_op(lambda c=client: drain(c, messages), ops=streams) / len(chunks)
        print(report(label, base, t, "update"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--updates", type=int, default=200_000)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.updates))
