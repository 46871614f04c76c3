"""OpenAIChatClient through a full pipeline vs raw httpx, against one loopback fake server.

The baseline does the least any client must: POST, then decode the JSON body (or each SSE
data payload). The fake server runs in its own process (``chat-pipeline fake-server``) so the client
process's CPU time is the client's alone. For concurrency 1 and 32, non-streaming and
streaming, prints requests per second and client CPU milliseconds per 1,000 requests, and
the ratio to raw ``httpx2.AsyncClient`` measured in the same run. The official ``openai`` SDK
is measured too when it is installed.

    python benchmarks/bench_providers.py [--requests 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import httpx2

from middleware.routing import Route
from pipeline import ChatClient, ChatMessage, ChatPipeline
from pipeline.providers import OpenAIChatClient

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
STREAM_BODY = {**BODY, "stream": True, "stream_options": {"include_usage": True}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def run(
    requests: int, concurrency: int, call: Callable[[], Awaitable[object]]
) -> tuple[float, float]:
    """Requests per second and client CPU ms per 1,000 requests (bounded count)."""
    queue = iter(range(requests))

    async def worker() -> None:
        for _ in queue:
            await call()

    for _ in range(min(20, requests)):  # warm the connection pool
        await call()
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return requests / wall, cpu * 1000 * 1000 / requests


async def measure(base_url: str, requests: int, rounds: int) -> None:
    limits = httpx2.Limits(max_connections=64, max_keepalive_connections=64)
    raw = httpx2.AsyncClient(limits=limits, timeout=30)
    bare = OpenAIChatClient(
        "m", api_key="k", base_url=base_url, http_client=httpx2.AsyncClient(limits=limits)
    )
    route = (
        ChatPipeline.builder()
        .use_circuit_breaker()
        .use_retry()
        .build(
            OpenAIChatClient(
                "m",
                api_key="k",
                base_url=base_url,
                http_client=httpx2.AsyncClient(limits=limits),
            )
        )
    )
    backup = OpenAIChatClient("m", api_key="k", base_url=base_url)
    full = (
        ChatPipeline.builder()
        .use_logging()
        .configure_options(lambda o: o.with_(temperature=0.1))
        .use_ordered_failover([Route("primary", route), Route("backup", backup)])
        .build()
    )
    messages = [ChatMessage.user("hello")]
    url = f"{base_url}/chat/completions"

    async def raw_call() -> object:
        response = await raw.post(url, json=BODY)
        return response.json()

    async def raw_stream() -> object:
        # The least any client must do: read the lines and decode each data payload.
        async with raw.stream("POST", url, json=STREAM_BODY) as response:
            return [
                json.loads(line[6:])
                async for line in response.aiter_lines()
                if line.startswith("data: {")
            ]

    def via(client: ChatClient, streaming: bool) -> Callable[[], Awaitable[object]]:
        if not streaming:
            return lambda: client.get_response(messages)

        async def drain() -> object:
            return [u async for u in client.get_streaming_response(messages)]

        return drain

    contenders: list[tuple[str, Callable[[bool], Callable[[], Awaitable[object]]]]] = [
        ("OpenAIChatClient", lambda s: via(bare, s)),
        ("full pipeline", lambda s: via(full, s)),
    ]
    try:
        import openai  # type: ignore[import-not-found]

        sdk = openai.AsyncOpenAI(api_key="k", base_url=base_url)

        def sdk_call(streaming: bool) -> Callable[[], Awaitable[object]]:
            if not streaming:
                return lambda: sdk.chat.completions.create(model="m", messages=BODY["messages"])

            async def drain() -> object:
                stream = await sdk.chat.completions.create(
                    model="m", messages=BODY["messages"], stream=True
                )
                return [c async for c in stream]

            return drain

        contenders.append(("openai SDK", sdk_call))
    except ImportError:
        print("(openai SDK not installed: skipped)")

    for streaming in (False, True):
        for concurrency in (1, 32):
            kind = "streaming" if streaming else "non-streaming"
            print(f"\n{kind}, concurrency {concurrency}, {requests} requests, best of {rounds}")
            calls = [("raw httpx (baseline)", raw_stream if streaming else raw_call)]
            calls += [(label, make(streaming)) for label, make in contenders]
            # Rounds interleave the contenders, so a noisy moment hits them alike; the
            # best round of each is kept.
            best: dict[str, tuple[float, float]] = {}
            for _ in range(rounds):
                for label, call in calls:
                    rps, cpu = await run(requests, concurrency, call)
                    if label not in best or rps > best[label][0]:
                        best[label] = (rps, cpu)
            base_rps, base_cpu = best["raw httpx (baseline)"]
            for label, _ in calls:
                rps, cpu = best[label]
                print(
                    f"  {label:<22} {rps:8.0f} req/s  {cpu:7.1f} ms CPU/1k  "
                    f"throughput {rps / base_rps:5.2f}x  CPU {cpu / base_cpu:5.2f}x"
                )
    await raw.aclose()
    await bare.aclose()
    await full.aclose()


def main(requests: int, rounds: int) -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "fake-server", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        server.stdout.readline()  # the server prints its URL once it listens
        # On Linux with two or more cores, give the server and the client a core each, so
        # they do not take turns on one and blur the client's numbers.
        if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2:
            os.sched_setaffinity(server.pid, {1})
            os.sched_setaffinity(0, {0})
            print("server pinned to CPU 1, client to CPU 0")
        asyncio.run(measure(f"http://127.0.0.1:{port}/v1", requests, rounds))
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    main(args.requests, args.rounds)
