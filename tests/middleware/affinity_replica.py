"""Another replica: a process routing sessions with the test process through one Redis
affinity store.

    python -m tests.middleware.affinity_replica URL NAMESPACE

Builds an ordered failover router over routes ``a`` then ``b`` (both always answer with
their name) with a `RedisAffinityStore` on URL under NAMESPACE; prints ``ready``. Commands,
one a line, each answered by one line:

* ``burst N PREFIX STREAMING``: N requests at once, for the sessions PREFIX-0 .. PREFIX-N-1
  (STREAMING ``1`` or ``0``): ``a A b B failed F warnings W`` (W: the store's warnings so
  far);
* ``quit``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import Counter

from middleware.routing import OrderedFailoverChatClient, Route
from middleware.routing.affinity import RedisAffinityStore, SessionAffinity
from pipeline import ChatOptions
from pipeline.testing import ScriptedChatClient, collect, reply


class WarningCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def router(url: str, namespace: str) -> tuple[OrderedFailoverChatClient, RedisAffinityStore]:
    # A generous timeout: a loaded test machine must not make Redis look down.
    store = RedisAffinityStore(url, ttl=300, namespace=namespace, timeout=5)
    routes = [Route(n, ScriptedChatClient(lambda m, o, n=n: reply(n), name=n)) for n in "ab"]
    return OrderedFailoverChatClient(routes, affinity=SessionAffinity(store)), store


async def burst(
    chat: OrderedFailoverChatClient, n: int, prefix: str, streaming: bool
) -> Counter[str]:
    """N requests at once, one per session; how many each route served (``failed``: none)."""
    results = await asyncio.gather(
        *(
            collect(chat, "hi", ChatOptions(session_id=f"{prefix}-{i}"), streaming=streaming)
            for i in range(n)
        )
    )
    return Counter(r.text if r.error is None else "failed" for r in results)


async def main(url: str, namespace: str) -> None:
    loop = asyncio.get_running_loop()
    warnings = WarningCounter()
    logging.getLogger("chat_pipeline.routing.affinity").addHandler(warnings)
    chat, store = router(url, namespace)
    print("ready", flush=True)
    while True:
        command = (await loop.run_in_executor(None, sys.stdin.readline)).split()
        if not command or command[0] == "quit":
            break
        assert command[0] == "burst", command
        served = await burst(chat, int(command[1]), command[2], command[3] == "1")
        print(
            f"a {served['a']} b {served['b']} failed {served['failed']} warnings {warnings.count}",
            flush=True,
        )
    await chat.aclose()
    await store.aclose()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:3]))
