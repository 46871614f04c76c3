"""A fixed workload for instruction counts: N calls through a healthy circuit breaker, with
or without a ratio policy, local or shared through Redis, or through the bare client, so
the breaker's own cost can be measured without depending on the machine's load.

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python benchmarks/breaker_calls.py --layer breaker --calls 2000 [--streaming] \\
        [--redis redis://127.0.0.1:6379/0]

Layers: ``bare`` (the client alone), ``breaker`` (the consecutive count only), ``ratio``
(plus `failure_ratio`), ``ratio_slow`` (plus `failure_ratio` and `slow_call_duration`). Run
it with two numbers of calls; the difference over the difference in calls is the cost per
call in instructions (callgrind prints the total as "Collected"), start-up left out.
`python benchmarks/bench_breaker.py --instructions 2000` runs them all.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from typing import Any

from pipeline import ChatClient, ChatMessage, ChatPipeline
from pipeline.testing import ScriptedChatClient, reply

LAYERS: dict[str, dict[str, Any]] = {
    "bare": {},
    "breaker": {},
    "ratio": {"failure_ratio": 0.5},
    "ratio_slow": {"failure_ratio": 0.5, "slow_call_duration": 10.0},
}


async def main(layer: str, calls: int, streaming: bool, redis: str | None) -> None:
    messages = [ChatMessage.user("hello")]
    bare = ScriptedChatClient(lambda m, o: reply("ok"))
    client: ChatClient = bare
    if layer != "bare":
        options = dict(LAYERS[layer])
        if redis is not None:
            # Generous: callgrind slows this process some fifty times.
            options.update(redis=redis, name=f"bench-{uuid.uuid4().hex}", redis_timeout=30)
        client = ChatPipeline.builder().use_circuit_breaker(**options).build(bare)
    for _ in range(calls):
        if streaming:
            async for _update in client.get_streaming_response(messages):
                pass
        else:
            await client.get_response(messages)
    await client.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layer", choices=list(LAYERS), required=True)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--streaming", action="store_true")
    parser.add_argument("--redis", default=None, help="share the breaker through this Redis")
    args = parser.parse_args()
    asyncio.run(main(args.layer, args.calls, args.streaming, args.redis))
