"""Chaos for shared state: two replicas (this process and one of its own), each with 1,000
requests in flight, share circuit breakers, session affinity and tool idempotency through
one real redis-server, which is paused (SIGSTOP: it keeps its sockets and answers nothing)
in the middle of a run, then resumed. The pipeline is `tests.chaos.redis_replica`'s: a
tool loop (an idempotent charge per request) over ordered failover of routes a, b, c, each
behind a shared breaker, with Redis session affinity. Both replicas run the same requests
(same sessions, same operations), half of them streamed.

1. Healthy: every request answered; each charge ran once across both replicas (the other
   replica's request waited for that run and got its result); each session served by its
   recorded route; no "Redis unavailable" warning.
2. Paused mid-run, while every charge is running: every request still answered. The charge
   that ran stands (once, in one replica); the other replica's wait ends at its bound with
   a tool failure (the call did not run there); lookups and breakers fall back to local
   decisions (route a, first in order); one warning per component per outage.
3. Still paused, new requests: each answered with a tool failure; no charge ran.
4. Resumed, the requests of 3 again: each charge runs once across both replicas (the claims
   Redis took late, for callers long gone, free their keys within the lease); components
   say Redis is reachable again.
5. Shared again: a breaker opened in Redis by a third party keeps both replicas off its
   route, and sessions recorded in Redis keep their route, in both replicas.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any

import pytest
import redis.asyncio as redis_asyncio

from tests.chaos.breakers import trip
from tests.chaos.redis_replica import Replica
from tests.middleware.remote_replica import Remote, remote
from tests.redis_server import RedisServer

pytestmark = pytest.mark.chaos

N = 1000  # requests in flight in each replica
ANSWER = re.compile(r"<([abc])\|(.*)>")
FAILED = "Error: 'charge' failed with TimeoutError."


def parsed(answers: list[str]) -> list[tuple[str, str]]:
    """(route, tool result) of each answer; every request must have been answered."""
    found = []
    for answer in answers:
        match = ANSWER.fullmatch(answer)
        assert match is not None, f"a request was not answered: {answer!r}"
        found.append((match[1], match[2]))
    return found


class Replicas:
    """This process's replica and the other one, driven together."""

    def __init__(self, here: Replica, there: Remote) -> None:
        self.here = here
        self.there = there

    async def burst(self, phase: str, gated: bool) -> tuple[dict[str, int], dict[str, int]]:
        await self.there.send(f"burst {phase} {N} {int(gated)}")
        self.here.start(phase, N, gated)  # both bursts race
        settled = await self.here.settled(N)
        return settled, await self.there.read_json()

    async def release(self) -> tuple[dict[str, Any], dict[str, Any]]:
        await self.there.send("release")
        done = await self.here.finish()
        return done, await self.there.read_json()

    async def logs(self) -> tuple[dict[str, int], dict[str, int]]:
        await self.there.send("log")
        return dict(self.here.log.counts), await self.there.read_json()


async def record_sessions(keys: Any, namespace: str, phase: str, route: str) -> None:
    """Sessions ``phase-s<i>`` of even i were last served by `route`."""
    await keys.mset({f"{namespace}:affinity:{phase}-s{i}": route for i in range(0, N, 2)})


@pytest.mark.timeout(900)
async def test_shared_state_through_a_redis_pause_with_1000_requests_in_flight_per_replica(
    redis_server: RedisServer,
) -> None:
    namespace = f"chaos-{uuid.uuid4().hex[:8]}"
    keys = redis_asyncio.Redis.from_url(redis_server.url)
    here = Replica(redis_server.url, namespace)
    async with remote("tests.chaos.redis_replica", redis_server.url, namespace, bound=300) as there:
        replicas = Replicas(here, there)
        figures: dict[str, Any] = {}

        # 1. Healthy.
        await record_sessions(keys, namespace, "p1", "c")
        mine, theirs = await replicas.burst("p1", gated=True)
        assert mine["running"] + theirs["running"] == N, "each charge runs in one replica"
        assert mine["running"] + mine["waiting"] == N == theirs["running"] + theirs["waiting"]
        done, other = await replicas.release()
        assert sorted(done["ran"] + other["ran"]) == list(range(N)), "each charge once"
        for answers in (done["answers"], other["answers"]):
            assert parsed(answers) == [
                ("c" if i % 2 == 0 else "a", f"charged p1-{i}") for i in range(N)
            ]
        logs = await replicas.logs()
        assert all(log.get("breaker unavailable", 0) == 0 for log in logs), logs
        assert all(log.get("affinity unavailable", 0) == 0 for log in logs), logs
        figures["healthy: charges run here/there"] = (len(done["ran"]), len(other["ran"]))

        # 2. Paused while every charge is running.
        await record_sessions(keys, namespace, "p2", "c")
        mine, theirs = await replicas.burst("p2", gated=True)
        assert mine["running"] + theirs["running"] == N
        redis_server.pause()
        done, other = await replicas.release()
        assert sorted(done["ran"] + other["ran"]) == list(range(N)), "each charge once"
        for i, (a, b) in enumerate(
            zip(parsed(done["answers"]), parsed(other["answers"]), strict=True)
        ):
            # The run that held the claim stands; the wait elsewhere ended at its bound.
            assert {a[1], b[1]} == {f"charged p2-{i}", FAILED}
            assert a[0] == b[0] == "a"  # no lookup, local breakers: the first route
        logs_here, logs_there = await replicas.logs()
        for log, ran in ((logs_here, done["ran"]), (logs_there, other["ran"])):
            assert log.get("affinity unavailable") == 1  # once per outage
            assert 1 <= log.get("breaker unavailable", 0) <= len("abc")  # once per breaker
            assert log.get("result unrecorded", 0) == len(ran)  # a retry may run it again
        figures["paused mid-run: charges run here/there"] = (len(done["ran"]), len(other["ran"]))

        # 3. Still paused: new requests.
        mine, theirs = await replicas.burst("p3", gated=False)
        assert mine["ended"] == theirs["ended"] == N
        done, other = await replicas.release()
        assert done["ran"] == other["ran"] == [], "no charge runs without its claim"
        for answers in (done["answers"], other["answers"]):
            assert parsed(answers) == [("a", FAILED)] * N
        # Throttled: not a warning per request (at most one more, should a minute pass).
        for before, now in zip((logs_here, logs_there), await replicas.logs(), strict=True):
            for what in ("affinity unavailable", "breaker unavailable"):
                assert now.get(what, 0) - before.get(what, 0) <= 1, (what, before, now)

        # 4. Resumed: the requests of 3 again.
        redis_server.resume()
        figures["claims Redis took after their callers gave up"] = len(
            await keys.keys(f"{namespace}:tool:*:claim")
        )
        mine, theirs = await replicas.burst("p3", gated=False)
        # (Some wait for a claim Redis took after its caller gave up: until its lease ends.)
        done, other = await replicas.release()
        assert sorted(done["ran"] + other["ran"]) == list(range(N)), "each charge once"
        for answers in (done["answers"], other["answers"]):
            assert [result for _, result in parsed(answers)] == [
                f"charged p3-{i}" for i in range(N)
            ]
        for log in await replicas.logs():
            assert log.get("affinity back") == 1 and log.get("breaker back", 0) >= 1, log

        # 5. Shared again.
        await trip(f"{namespace}-a", redis_server.url)
        await record_sessions(keys, namespace, "p5", "c")
        warned = await replicas.logs()
        mine, theirs = await replicas.burst("p5", gated=False)
        done, other = await replicas.release()
        assert sorted(done["ran"] + other["ran"]) == list(range(N)), "each charge once"
        for finished in (done, other):
            assert parsed(finished["answers"]) == [
                ("c" if i % 2 == 0 else "b", f"charged p5-{i}") for i in range(N)
            ]
            assert finished["calls"]["a"] == 0, "a call went through a breaker open in Redis"
        after = await replicas.logs()
        for before, now in zip(warned, after, strict=True):
            assert now.get("breaker unavailable") == before.get("breaker unavailable")
            assert now.get("affinity unavailable") == before.get("affinity unavailable")
            assert now.get("claim lost", 0) == 0  # no claim ran out under its holder
        figures["log lines (here, there)"] = after
        print(f"\nredis chaos: 2 replicas x {N} requests in flight, 5 phases: {figures}")
    await here.aclose()
    await keys.aclose()
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
