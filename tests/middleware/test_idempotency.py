import asyncio
import logging
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as redis_asyncio

from middleware import idempotency
from middleware.function_invocation import FunctionInvokingChatClient, operation_scope, tool
from middleware.idempotency import (
    Claim,
    MemoryIdempotencyStore,
    RedisIdempotencyStore,
    claiming_store,
    idempotency_key,
)
from pipeline import FunctionCallContent, FunctionResultContent
from pipeline.testing import ScriptedChatClient, call_tools, collect, reply
from tests.middleware.idempotency_replica import Charges, charges
from tests.middleware.remote_replica import remote
from tests.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]


async def test_memory_claim_is_atomic_and_a_waiter_gets_the_result() -> None:
    store = MemoryIdempotencyStore()
    first = await store.claim("k", ttl=60)
    assert not first.done and first.token
    waiter = asyncio.create_task(store.claim("k", ttl=60))
    await asyncio.sleep(0)
    assert not waiter.done()  # held: the second caller waits
    await store.complete(first, {"charged": 5})
    assert await waiter == Claim("k", True, {"charged": 5})
    assert await store.claim("k", ttl=60) == Claim("k", True, {"charged": 5})
    assert not store._claims


async def test_memory_waiter_cancellation_leaves_the_holder_alone() -> None:
    store = MemoryIdempotencyStore()
    holder = await store.claim("k", ttl=60)
    waiter = asyncio.create_task(store.claim("k", ttl=60))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    held = store._claims["k"]
    assert held.token == holder.token and not held.done.done()
    # Released (the call failed): the next caller claims it and runs it.
    await store.release(holder)
    again = await store.claim("k", ttl=60)
    assert not again.done and again.token != holder.token


async def test_memory_claim_of_a_dead_holder_expires() -> None:
    store = MemoryIdempotencyStore()
    gone = await store.claim("k", ttl=1e-9)  # a holder that never comes back
    taken = await store.claim("k", ttl=60)
    assert not taken.done and taken.token != gone.token
    await store.complete(gone, "late")  # the late holder's result is kept, not its claim
    assert store._claims["k"].token == taken.token


async def test_a_get_put_store_is_adapted_with_shared_local_claims() -> None:
    class GetPut:
        def __init__(self) -> None:
            self.data: dict[str, object] = {}

        async def get(self, key: str) -> tuple[bool, object]:
            return (True, self.data[key]) if key in self.data else (False, None)

        async def put(self, key: str, result: object) -> None:
            self.data[key] = result

    legacy = GetPut()
    adapted = claiming_store(legacy)
    assert claiming_store(legacy) is adapted  # every layer using it shares its claims
    claim = await adapted.claim("k", 60)
    waiter = asyncio.create_task(adapted.claim("k", 60))
    await asyncio.sleep(0)
    assert not waiter.done()
    await adapted.complete(claim, "r")
    assert legacy.data == {"k": "r"}
    assert await waiter == Claim("k", True, "r")
    store = MemoryIdempotencyStore()
    assert claiming_store(store) is store
    with pytest.raises(TypeError, match="claim/complete/release"):
        claiming_store(object())


async def test_redis_claim_is_set_nx_with_an_expiry(redis_url: str) -> None:
    namespace = f"idem-{uuid.uuid4().hex[:8]}"
    first = RedisIdempotencyStore(redis_url, namespace=namespace)
    second = RedisIdempotencyStore(redis_url, namespace=namespace, max_poll_interval=0.02)
    redis = redis_asyncio.Redis.from_url(redis_url)
    key = idempotency_key("op-redis", "t", {"x": 1})
    claim = await first.claim(key, ttl=30)
    assert not claim.done
    assert 0 < await redis.pttl(f"{namespace}:{key}:claim") <= 30_000
    waiter = asyncio.create_task(second.claim(key, ttl=30))
    await first.release(claim)  # the call failed: the waiter claims and runs it
    taken = await waiter
    assert not taken.done and taken.token != claim.token
    await second.complete(taken, {"ok": True})
    assert await redis.exists(f"{namespace}:{key}:claim") == 0
    assert await first.claim(key, ttl=30) == Claim(key, True, {"ok": True})
    assert await first.get(key) == (True, {"ok": True})  # the earlier protocol still works
    for client in (first, second):
        await client.aclose()
    await redis.aclose()


async def test_one_key_runs_once_across_two_processes(redis_url: str, streaming: bool) -> None:
    namespace = f"idem-{uuid.uuid4().hex[:8]}"
    operation = f"order-{uuid.uuid4().hex[:8]}"
    redis = redis_asyncio.Redis.from_url(redis_url)
    started = asyncio.Event()
    proceed = asyncio.Event()

    @tool
    async def charge(amount: int) -> str:
        await redis.rpush(f"{namespace}:runs", "here")
        started.set()
        await proceed.wait()
        return "charged here"

    model = ScriptedChatClient(
        [call_tools(FunctionCallContent("c1", "charge", {"amount": 5})), reply("Done.")]
    )
    store = RedisIdempotencyStore(redis_url, namespace=namespace)
    chat = FunctionInvokingChatClient(model, [charge], idempotency_store=store)
    with operation_scope(operation):
        request = asyncio.create_task(collect(chat, "charge me 5", streaming=streaming))
    await started.wait()  # this process holds the claim and is running the tool
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.middleware.idempotency_replica",
        redis_url,
        namespace,
        operation,
        stdout=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    assert process.stdout is not None
    try:
        async with asyncio.timeout(60):  # bounds the other process
            assert (await process.stdout.readline()).decode().strip() == "waiting"
            proceed.set()
            said = (await process.stdout.readline()).decode().strip()
            assert await process.wait() == 0
            result = await request
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    # The other process waited for this one's run and reused its result.
    assert said == "result charged here"
    assert await redis.lrange(f"{namespace}:runs", 0, -1) == [b"here"]
    assert result.error is None and result.text.endswith("Done.")
    tool_result = model.calls[1].messages[-1].contents[0]
    assert isinstance(tool_result, FunctionResultContent)
    assert tool_result.result == "charged here"
    await store.aclose()
    await redis.aclose()


IN_FLIGHT = 1000  # tool calls in flight in each of two replicas (redis-py's default pool: 100)


async def test_two_replicas_run_each_of_1000_concurrent_calls_once(
    redis_url: str, streaming: bool
) -> None:
    namespace = f"idem-many-{uuid.uuid4().hex[:8]}"
    here = charges(redis_url, namespace)
    async with remote(
        "tests.middleware.idempotency_replica", redis_url, namespace, "burst"
    ) as other:
        # The same 1,000 calls (one per operation) in both replicas at once.
        await other.send(f"go {IN_FLIGHT} {int(streaming)}")
        tasks = here.start(IN_FLIGHT, streaming)
        started, waiting = await here.settled(IN_FLIGHT)
        word, started_there, word2, waiting_there = await other.read()
        assert (word, word2) == ("started", "waiting")
        # Every call is in flight: each key is running in exactly one replica, and the
        # other replica's call waits for that run.
        assert started + int(started_there) == IN_FLIGHT
        assert started + waiting == IN_FLIGHT == int(started_there) + int(waiting_there)
        await other.send("release")
        ok, failed = await here.finish(tasks)
        answer = await other.read()
    assert (ok, failed) == (IN_FLIGHT, 0)
    assert answer[:4] == ["ok", str(IN_FLIGHT), "failed", "0"]
    ran_there = [] if answer[5] == "-" else [int(a) for a in answer[5].split(",")]
    assert sorted(here.ran + ran_there) == list(range(IN_FLIGHT)), "a call ran twice or never"
    print(
        f"\nidempotency: 2 replicas x {IN_FLIGHT} tool calls in flight: each ran once "
        f"({started} here, {started_there} there), none failed"
    )
    await here.chat.aclose()
    await here.store.aclose()


async def test_claims_a_redis_stall_orphans_free_their_keys_after_the_lease(
    redis_server: RedisServer, streaming: bool
) -> None:
    calls = 50
    namespace = f"idem-stall-{uuid.uuid4().hex[:8]}"
    # Connections opened and the claim script loaded first, so the claims below reach
    # Redis's socket buffers during the stall: Redis takes them when it resumes, for
    # callers long gone.
    client = redis_asyncio.Redis.from_url(redis_server.url)
    assert await asyncio.gather(*(client.ping() for _ in range(calls))) == [True] * calls
    await client.script_load(idempotency._CLAIM)
    store = RedisIdempotencyStore(client, namespace=namespace, timeout=0.3, lease=3.0)
    charges = Charges(store)
    charges.gate.set()  # the tool answers at once
    redis_server.pause()
    try:
        ok, failed = await charges.finish(charges.start(calls, streaming))
    finally:
        redis_server.resume()
    # Each call failed (its claim timed out: the tool did not run).
    assert (ok, failed, charges.ran) == (0, calls, [])
    keys = redis_asyncio.Redis.from_url(redis_server.url)
    orphans = len(await keys.keys(f"{namespace}:*:claim"))
    print(f"\nidempotency: {orphans} claims taken by Redis after their callers gave up")
    assert orphans > 0, "the stall left no claim behind: nothing was tested"
    # The same calls again (with a timeout a loaded machine cannot miss: the stall is over):
    # each key is free within the lease, not after claim_ttl (300 s by default), and each
    # call runs once.
    after = RedisIdempotencyStore(redis_server.url, namespace=namespace, timeout=5)
    again = Charges(after)
    async with asyncio.timeout(30):
        assert await again.finish(again.start(calls, streaming)) == (calls, 0)
    assert sorted(again.ran) == list(range(calls))
    for each in (charges, again):
        await each.chat.aclose()
        await each.store.aclose()
    await keys.aclose()
    await client.aclose()


class TickingStore(RedisIdempotencyStore):
    """Renews its claims when the test says so: each wait to renew is announced on
    `waiting` (with its length), then lasts until a `tick`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waiting: asyncio.Queue[float] = asyncio.Queue()
        self.ticks: asyncio.Queue[None] = asyncio.Queue()

    async def _wait_to_renew(self, seconds: float) -> None:
        self.waiting.put_nowait(seconds)
        await self.ticks.get()


async def test_a_redis_claim_is_a_lease_renewed_while_its_call_runs(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    namespace = f"idem-lease-{uuid.uuid4().hex[:8]}"
    store = TickingStore(redis_url, namespace=namespace, lease=6)
    keys = redis_asyncio.Redis.from_url(redis_url)
    claim_key = f"{namespace}:k:claim"
    claim = await store.claim("k", ttl=300)
    assert 0 < await keys.pttl(claim_key) <= 6000  # the lease, not the claim's 300 s
    assert await store.waiting.get() == pytest.approx(2)  # renewed every third of a lease
    await keys.pexpire(claim_key, 500)  # nearly run out
    store.ticks.put_nowait(None)
    await store.waiting.get()  # renewed: waiting for the next renewal
    assert 5000 < await keys.pttl(claim_key) <= 6000
    # Completing stops the renewals and gives the claim up.
    await store.complete(claim, "done")
    assert await keys.exists(claim_key) == 0 and not store._renewals
    # A claim that ran out (an outage longer than the lease) and was taken by another
    # holder is not renewed over theirs; a warning says the call may run twice.
    lost = await store.claim("k2", ttl=300)
    await store.waiting.get()
    await keys.set(f"{namespace}:k2:claim", "another holder")
    with caplog.at_level(logging.WARNING, logger="chat_pipeline.tools"):
        store.ticks.put_nowait(None)
        await asyncio.gather(*store._renewals.values())
    assert await keys.get(f"{namespace}:k2:claim") == b"another holder"
    assert "claim ran out before the call finished" in caplog.text
    await store.release(lost)  # not ours any more: left alone
    assert await keys.get(f"{namespace}:k2:claim") == b"another holder"
    await store.aclose()
    await keys.aclose()
