"""``chat-pipeline serve`` plus one bare reservation per request: the floor of governance in
the gateway's own request path, for ``bench_gateway.py --governed``.

    python benchmarks/_reserving_gateway.py --config gateway.toml --port 0

The gateway of `--config` (which turns no governance on), with an ASGI layer in front that
makes, for each request to ``/v1/chat/completions``, one ``EVALSHA`` of the budgets' Lua
script reserving the same four counters the governed gateway's key counts against (a key's
and a team's budget, the key's requests and tokens a minute), through the same Redis client
(`pipeline._resp`, its cheapest call), and waits for the reply before the request goes on.
Nothing else: no key lookup, no estimate, no headers, no settlement. What this server costs
over the plain gateway is what a bare reservation costs where governance makes it: the same
round trip, the same wake-up of the worker between the request and the upstream call.
``BENCH_GOVERNED_REDIS`` names the Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline._reservations import (
    SCRIPT,
    BudgetCheck,
    Demand,
    Limits,
    RateCheck,
    Reservations,
    reserve_op,
)
from pipeline._resp import RespClient, encode_command

REDIS_VARIABLE = "BENCH_GOVERNED_REDIS"


def answered(future: asyncio.Future[Any], reply: Any, error: BaseException | None) -> None:
    """A reply's callback: `future` gets the reply or the error."""
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(reply)


def bare_reservation(reservations: Reservations) -> tuple[list[str], list[str], bytes]:
    """The floor's one reservation in `reservations`' namespace: the script's keys and
    argument (for ``RespClient.evalsha``) and the whole ``EVALSHA`` encoded (for
    ``RespClient.evalsha_then``). Four counters, as the governed benchmark's key counts
    against: a key's and a team's budget, the key's requests and tokens a minute."""
    limits = Limits(
        [
            BudgetCheck("bench-floor:b:k:x:m", 10**15),
            BudgetCheck("bench-floor:b:t:x:m", 10**15),
        ],
        [
            RateCheck("bench-floor:r:k:x:rpm", 10**9),
            RateCheck("bench-floor:r:k:x:tpm", 10**12, None, "tokens"),
        ],
    )
    demand = Demand(amount=1000, tokens=100, limits=limits, token="floor")
    keys = [*reservations._fixed, *limits.keys]
    args = [reserve_op(demand, len(reservations._fixed) + 1)]
    return keys, args, encode_command(["EVALSHA", SCRIPT.sha, len(keys), *keys, *args])


class BareReservation:
    """One bare reservation before each request to ``/v1/chat/completions`` (see the
    module docstring)."""

    def __init__(self, app: Any, redis_url: str) -> None:
        self.app = app
        self.client = RespClient(redis_url, timeout=5.0)
        reservations = Reservations(self.client, namespace="bench-floor")
        self.keys, self.args, self.command = bare_reservation(reservations)
        self._ready = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/chat/completions":
            loop = asyncio.get_running_loop()
            if not self._ready:  # the script loaded and the counters' epoch made, once
                await self.client.execute("SET", "bench-floor:epoch", 1)
                await self.client.evalsha(SCRIPT, self.keys, self.args)
                self._ready = True
            reply: asyncio.Future[Any] = loop.create_future()
            self.client.evalsha_then(SCRIPT, self.command, partial(answered, reply), loop)
            await reply
        await self.app(scope, receive, send)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args()
    from pipeline.gateway import server

    made = server.app_from_environment
    url = os.environ[REDIS_VARIABLE]
    # `serve` runs uvicorn on this module attribute (an app factory, one worker): the
    # gateway it makes, with the bare reservation in front.
    server.app_from_environment = lambda: BareReservation(made(), url)  # type: ignore[assignment,return-value]
    server.serve(args.config, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
