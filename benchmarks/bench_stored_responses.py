"""What storing a response costs a Responses request, in process: the gateway's ASGI app
(one scripted route, no network) driven through httpx's ASGI transport, each request with
`store: false` (the baseline, measured in the same run) and with the default `store`
(kept in the memory store), for a conversation of `--messages` messages of `--message-bytes`
characters each; and a continuation by `previous_response_id` (a lookup, then a store).

    python benchmarks/bench_stored_responses.py
    python benchmarks/bench_stored_responses.py --messages 200 --message-bytes 2000
    python benchmarks/bench_stored_responses.py --redis-url redis://127.0.0.1:6379/0

CPU time of this process (`time.process_time`), the best of `--repeats` interleaved rounds
of `--requests` requests each: steadier than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import httpx
from _timing import best_per_op, report

from pipeline.config import parse_config
from pipeline.gateway.app import create_app


def conversation(messages: int, size: int) -> list[dict[str, Any]]:
    roles = ("user", "assistant")
    return [
        {"role": roles[index % 2], "content": f"{index} " + "x" * size}
        for index in range(messages - 1)
    ] + [{"role": "user", "content": "and now?"}]


async def run(arguments: argparse.Namespace) -> None:
    gateway: dict[str, Any] = {"responses_max_count": 100_000, "responses_max_bytes": 1 << 34}
    if arguments.redis_url:
        os.environ["BENCH_STORED_RESPONSES_REDIS"] = arguments.redis_url
        gateway |= {"responses_store": "redis", "redis_url_env": "BENCH_STORED_RESPONSES_REDIS"}
    config = parse_config(
        {
            "routes": {"scripted": {"provider": "scripted", "reply": "A short answer."}},
            "gateway": gateway,
        }
    )
    app = create_app(config)
    items = conversation(arguments.messages, arguments.message_bytes)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:

            async def post(**body: Any) -> Any:
                response = await client.post(
                    "/v1/responses", json={"model": "pipeline", "input": items, **body}
                )
                if response.status_code != 200:
                    raise RuntimeError(f"{response.status_code}: {response.text}")
                return response.json()

            first = await post()
            one = [{"role": "user", "content": "and now?"}]

            async def continued() -> Any:
                body = {"model": "pipeline", "input": one, "previous_response_id": first["id"]}
                response = await client.post("/v1/responses", json=body)
                if response.status_code != 200:
                    raise RuntimeError(f"{response.status_code}: {response.text}")

            async def stateless() -> Any:
                return await post(store=False)

            # Rounds interleave the three, so a busy machine slows each alike; the best
            # round of each is kept.
            best = {stateless: float("inf"), post: float("inf"), continued: float("inf")}
            for _ in range(arguments.repeats):
                for op in best:
                    measured = await best_per_op(
                        op, ops=arguments.requests, repeats=1, clock=time.process_time
                    )
                    best[op] = min(best[op], measured)
            baseline, stored, chained = best.values()
    size = arguments.messages * arguments.message_bytes
    print(
        f"{arguments.messages} messages of {arguments.message_bytes} characters "
        f"(~{size // 1024} KiB), {arguments.requests} requests, best of {arguments.repeats}"
    )
    print(report("store: false (baseline)", baseline, baseline, "request"))
    kind = "redis" if arguments.redis_url else "memory"
    print(report(f"store (default, {kind})", baseline, stored, "request"))
    print(report("previous_response_id (lookup + store)", baseline, chained, "request"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--messages", type=int, default=20)
    parser.add_argument("--message-bytes", type=int, default=500)
    parser.add_argument("--redis-url", help="store in this Redis instead of in memory")
    asyncio.run(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
