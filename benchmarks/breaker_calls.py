"""A fixed workload for instruction counts: N calls through a healthy circuit breaker
(no Redis) or through the bare client, so the breaker's own cost can be measured without
depending on the machine's load.

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python benchmarks/breaker_calls.py --layer breaker --calls 2000 [--streaming]

Run it with ``--layer bare`` and ``--layer breaker``, for ``get_response`` and (with
``--streaming``) one-update streams; (breaker - bare) / calls is the breaker's cost per
call in instructions (callgrind prints the total as "Collected"). Imports and set-up are
the same in both runs, so they cancel out.
"""

from __future__ import annotations

import argparse
import asyncio

from pipeline import ChatClient, ChatMessage, ChatPipeline
from pipeline.testing import ScriptedChatClient, reply


async def main(layer: str, calls: int, streaming: bool) -> None:
    messages = [ChatMessage.user("hello")]
    bare = ScriptedChatClient(lambda m, o: reply("ok"))
    client: ChatClient = (
        bare if layer == "bare" else ChatPipeline.builder().use_circuit_breaker().build(bare)
    )
    for _ in range(calls):
        if streaming:
            async for _update in client.get_streaming_response(messages):
                pass
        else:
            await client.get_response(messages)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layer", choices=["bare", "breaker"], required=True)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--streaming", action="store_true")
    args = parser.parse_args()
    asyncio.run(main(args.layer, args.calls, args.streaming))
