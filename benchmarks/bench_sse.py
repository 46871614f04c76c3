"""The providers' SSE reading vs httpx2's built-in `EventSource` and a plain line loop, on
the per-chunk path of a stream.

All read the same Chat Completions stream (one network chunk per event, as servers send
them) from an in-process httpx2 `MockTransport`, and decode each event's JSON: ours feeds
``response.aiter_bytes()`` to `SSEPayloads` (what the providers do); httpx2's iterates
``httpx2.EventSource(response)``; the line loop reads ``response.aiter_lines()`` and
``json.loads`` each ``data:`` line (what a hand-written client does, and the peer
benchmark's raw baseline). Prints microseconds per event, best of the rounds, and the
ratio to ours.

    python benchmarks/bench_sse.py [--events 2000] [--rounds 7]

With ``--long-lines``, the cost per byte of events whose data line is long, fed in the
64 KiB chunks a transport hands over: 1 KB lines and 10 MB lines (about 10 MB in all for
each), in the same run, and their ratio (1.0 is linear in bytes; a reader that searches the
unfinished line again on every chunk costs more per byte the longer the line).

    python benchmarks/bench_sse.py --long-lines [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx2

from pipeline.wire.sse import SSEPayloads


def stream_body(events: int) -> list[bytes]:
    chunk = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "gpt-4o-mini",
        "choices": [{"index": 0, "delta": {"content": "word "}, "finish_reason": None}],
    }
    return [f"data: {json.dumps(chunk)}\n\n".encode() for _ in range(events)] + [
        b"data: [DONE]\n\n"
    ]


def client_for(body: list[bytes]) -> httpx2.AsyncClient:
    async def pieces() -> AsyncIterator[bytes]:
        for piece in body:
            yield piece

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=pieces())

    return httpx2.AsyncClient(transport=httpx2.MockTransport(handler))


async def ours(http: httpx2.AsyncClient) -> int:
    count = 0
    async with http.stream("POST", "http://test/v1/chat/completions") as response:
        payloads = SSEPayloads("bench")
        async for chunk in response.aiter_bytes():
            count += len(payloads.feed(chunk))
        assert payloads.done
    return count


async def lines(http: httpx2.AsyncClient) -> int:
    count = 0
    async with http.stream("POST", "http://test/v1/chat/completions") as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                json.loads(line[6:])
                count += 1
    return count


async def builtin(http: httpx2.AsyncClient) -> int:
    count = 0
    async with http.stream("POST", "http://test/v1/chat/completions") as response:
        async for event in httpx2.EventSource(response):
            if event.data == "[DONE]":
                continue
            json.loads(event.data)
            count += 1
    return count


async def best_us_per_event(
    read: Callable[[httpx2.AsyncClient], Awaitable[int]], events: int, rounds: int
) -> float:
    best = float("inf")
    for _ in range(rounds):
        http = client_for(stream_body(events))
        start = time.perf_counter()
        assert await read(http) == events
        best = min(best, (time.perf_counter() - start) / events)
        await http.aclose()
    return best * 1e6


def long_line_body(size: int) -> list[bytes]:
    """Events of `size` bytes (a JSON string each), about 10 MB of them, then ``[DONE]``,
    in 64 KiB chunks: both sizes feed the reader the same bytes."""
    event = b'data: "' + b"x" * (size - 10) + b'"\n\n'
    body = event * max(1, 10_000_000 // len(event)) + b"data: [DONE]\n\n"
    step = 65_536
    return [body[i : i + step] for i in range(0, len(body), step)]


def ns_per_byte(body: list[bytes]) -> float:
    total = sum(len(chunk) for chunk in body)
    start = time.perf_counter()
    payloads = SSEPayloads("bench", max_line=20_000_000, max_event=20_000_000)
    for chunk in body:
        payloads.feed(chunk)
    assert payloads.done
    return (time.perf_counter() - start) / total * 1e9


def long_lines(rounds: int) -> None:
    sizes = {"1 KB lines": 1_000, "10 MB line": 10_000_000}
    bodies = {label: long_line_body(size) for label, size in sizes.items()}
    results = {label: float("inf") for label in sizes}
    for _ in range(rounds):  # interleaved, so a noisy moment hits both alike
        for label, body in bodies.items():
            results[label] = min(results[label], ns_per_byte(body))
    base = results["1 KB lines"]
    print(f"cost per byte, 64 KiB chunks, about 10 MB each, best of {rounds} rounds")
    for label, ns in results.items():
        print(f"  {label:<12} {ns:6.2f} ns/byte  ratio {ns / base:4.2f}x")


async def main(events: int, rounds: int) -> None:
    # Interleaved rounds, so a noisy moment hits them alike.
    readers = (
        ("SSEPayloads (ours)", ours),
        ("httpx2.EventSource", builtin),
        ("aiter_lines + json.loads", lines),
    )
    results = {label: float("inf") for label, _ in readers}
    for _ in range(rounds):
        for label, read in readers:
            results[label] = min(results[label], await best_us_per_event(read, events, 1))
    base = results["SSEPayloads (ours)"]
    print(f"{events} events per stream, best of {rounds} rounds")
    for label, us in results.items():
        print(f"  {label:<26} {us:6.2f} us/event  ratio {us / base:4.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--long-lines", action="store_true")
    args = parser.parse_args()
    if args.long_lines:
        long_lines(args.rounds)
    else:
        asyncio.run(main(args.events, args.rounds))
