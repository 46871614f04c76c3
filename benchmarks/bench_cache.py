"""The response cache: what a hit and a miss cost, cached answers through the gateway
against LiteLLM's proxy with its Redis cache, and Redis round trips per hit.

    python benchmarks/bench_cache.py                 # everything (needs redis-server, litellm)
    python benchmarks/bench_cache.py --no-litellm    # the in-process figures and ours only
    python benchmarks/bench_cache.py --no-gateway    # the in-process sections only

Sections, each a ratio of figures measured in the same run:

1. **exact hit, in process**: a pipeline with ``use_cache()`` (memory store) answering an
   8 KB conversation from the cache, against the same pipeline without the layer over a
   `ScriptedChatClient` (which answers at once). CPU time per call (``time.process_time``),
   best of interleaved rounds; target: at most 100 us more than the bare call.
2. **a miss's added cost**: every request new (a counter in the last message), through an
   `OpenAIChatClient` to the fake upstream (a separate process) over loopback HTTP: this
   process's CPU per request with the cache (a lookup, the call, a store) against without;
   target: at most 5% more. The in-process figure over the scripted client is printed too.
3. **through `chat-pipeline serve`**: the gateway (one worker, ``[cache] store = "redis"``)
   and the LiteLLM proxy (one worker, ``cache: true`` with ``type: redis``), in front of the
   same fake upstream, the same Redis and the same repeated request, so after the warm-up
   every answer is a cache hit (checked: Redis's ``keyspace_hits`` grow by at least one per
   request for each). Cached answers per CPU-second of the server plus Redis; target: ours
   at least 5x LiteLLM's. Uses `bench_gateway`'s servers and load generator.
4. **Redis round trips per hit**: commands a `RedisCacheStore` sends per hit, sequential
   hits (target: one), and for 1,000 concurrent hits.
5. **Redis paused**: 1,000 concurrent requests while redis-server is stopped (SIGSTOP):
   every one answered, the slowest's latency against the store's timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import bench_gateway as bg
from _litellm_env import litellm_env

from middleware.cache import RedisCacheStore
from pipeline import ChatMessage, ChatOptions, ChatPipeline
from pipeline.testing import ScriptedChatClient, reply
from tests.processes import uvicorn_log_config
from tests.redis_server import RedisServer, counting_client

REDIS_VARIABLE = "BENCH_CACHE_REDIS"


def conversation(size: int = 8192, tag: str = "") -> list[ChatMessage]:
    """About `size` bytes of conversation: alternating turns of 512 characters."""
    turns = []
    sentence = "The quick brown fox jumps over the lazy dog while the cache keeps count. "
    text = (sentence * 8)[:500]
    for i in range(size // 512):
        turns.append(ChatMessage.user(f"{i} {text}") if i % 2 == 0 else ChatMessage.assistant(text))
    turns.append(ChatMessage.user(f"and the last question {tag}"))
    return turns


async def cpu_per_call(call: Callable[[int], Awaitable[Any]], calls: int) -> float:
    gc.collect()
    started = time.process_time()
    for i in range(calls):
        await call(i)
    return (time.process_time() - started) / calls


async def best_of(
    variants: dict[str, Callable[[int], Awaitable[Any]]], calls: int, rounds: int
) -> dict[str, float]:
    best: dict[str, float] = {}
    offset = 0
    for _ in range(rounds):
        for name, call in variants.items():
            # Each round's calls get their own numbers: a miss stays a miss.
            def numbered(i: int, call: Any = call, offset: int = offset) -> Awaitable[Any]:
                return call(offset + i)

            value = await cpu_per_call(numbered, calls)
            best[name] = min(best.get(name, float("inf")), value)
        offset += calls
    return best


async def streamed(chat: Any, messages: Any, options: Any = None) -> None:
    async for _ in chat.get_streaming_response(messages, options):
        pass


async def section_hit(calls: int, rounds: int) -> dict[str, float]:
    text = "A cached answer of a few sentences. " * 8
    bare = ChatPipeline.builder().build(
        ScriptedChatClient(reply(text, chunks=[text[:100], text[100:]]))
    )
    cached = (
        ChatPipeline.builder()
        .use_cache()
        .build(ScriptedChatClient(reply(text, chunks=[text[:100], text[100:]])))
    )
    messages = conversation()
    await cached.get_response(messages)
    results = {}
    for shape in ("get_response", "get_streaming_response"):
        if shape == "get_response":
            variants = {
                "bare": lambda i: bare.get_response(messages),
                "hit": lambda i: cached.get_response(messages),
            }
        else:
            variants = {
                "bare": lambda i: streamed(bare, messages),
                "hit": lambda i: streamed(cached, messages),
            }
        best = await best_of(variants, calls, rounds)
        extra = (best["hit"] - best["bare"]) * 1e6
        print(
            f"  {shape}: bare {best['bare'] * 1e6:.1f} us, hit {best['hit'] * 1e6:.1f} us "
            f"CPU per call: a hit costs {extra:+.1f} us (target <= +100 us)"
        )
        results[shape] = extra
    return results


async def section_miss(upstream: str, calls: int, rounds: int) -> dict[str, float]:
    from pipeline.providers import OpenAIChatClient

    def provider() -> OpenAIChatClient:
        return OpenAIChatClient("fake-model", api_key="sk-bench", base_url=upstream)

    bare = ChatPipeline.builder().build(provider())
    cached = ChatPipeline.builder().use_cache().build(provider())
    scripted_bare = ChatPipeline.builder().build(ScriptedChatClient("ok"))
    scripted_cached = ChatPipeline.builder().use_cache().build(ScriptedChatClient("ok"))
    base = conversation()
    prefix = base[:-1]

    numbers = itertools.count()

    def fresh(_: int) -> list[ChatMessage]:
        # Every request new, across variants, rounds and shapes: each one a miss.
        return [*prefix, ChatMessage.user(f"question number {next(numbers)}")]

    await bare.get_response(fresh(-1))
    await cached.get_response(fresh(-2))
    results = {}
    for shape in ("get_response", "get_streaming_response"):
        if shape == "get_response":
            variants = {
                "no cache": lambda i: bare.get_response(fresh(i)),
                "miss": lambda i: cached.get_response(fresh(i)),
            }
            local = {
                "no cache": lambda i: scripted_bare.get_response(fresh(i)),
                "miss": lambda i: scripted_cached.get_response(fresh(i)),
            }
        else:
            variants = {
                "no cache": lambda i: streamed(bare, fresh(i)),
                "miss": lambda i: streamed(cached, fresh(i)),
            }
            local = {
                "no cache": lambda i: streamed(scripted_bare, fresh(i)),
                "miss": lambda i: streamed(scripted_cached, fresh(i)),
            }
        best = await best_of(variants, calls, rounds)
        inproc = await best_of(local, calls * 4, rounds)
        ratio = best["miss"] / best["no cache"] - 1
        print(
            f"  {shape}: over HTTP no cache {best['no cache'] * 1e6:.0f} us, miss "
            f"{best['miss'] * 1e6:.0f} us CPU per request: {ratio * 100:+.1f}% (target <= +5%); "
            f"over the scripted client {(inproc['miss'] - inproc['no cache']) * 1e6:+.1f} us"
        )
        results[shape] = ratio
    for chat in (bare, cached, scripted_bare, scripted_cached):
        await chat.aclose()
    return results


async def section_round_trips(url: str) -> None:
    client = counting_client(url)
    store = RedisCacheStore(client, namespace="bench-round-trips", timeout=5.0)
    inner = ScriptedChatClient(lambda messages, options: reply(f"re {messages[-1].text}"))
    chat = ChatPipeline.builder().use_cache(store).build(inner)
    await chat.get_response("one question")
    texts = [f"question {i}" for i in range(1000)]
    await asyncio.gather(*(chat.get_response(t) for t in texts))
    await asyncio.sleep(0.2)  # the writes land beside the answers
    client.sent.clear()
    for _ in range(100):
        await chat.get_response("one question")
    sequential = len(client.sent) / 100
    client.sent.clear()
    calls = inner.call_count
    await asyncio.gather(*(chat.get_response(t) for t in texts))
    assert inner.call_count == calls, "the concurrent lookups were not all hits"
    print(
        f"  sequential hits: {sequential:.2f} Redis commands per hit (target 1); "
        f"1,000 concurrent hits: {len(client.sent)} commands in all"
    )
    await store.aclose()
    await client.aclose()


async def section_paused(server: RedisServer, bound: float) -> None:
    store = RedisCacheStore(server.url, namespace="bench-paused", timeout=bound)
    inner = ScriptedChatClient(lambda messages, options: reply(f"re {messages[-1].text}"))
    chat = ChatPipeline.builder().use_cache(store).build(inner)

    async def timed(text: str) -> float:
        started = time.perf_counter()
        await chat.get_response(text, ChatOptions())
        return time.perf_counter() - started

    async def wave(name: str) -> list[float]:
        return list(await asyncio.gather(*(timed(f"{name} {i}") for i in range(1000))))

    await wave("warm-up")
    healthy = await wave("healthy")  # misses, Redis answering
    server.pause()
    try:
        paused = await wave("paused")  # the first lookups wait out the timeout
        skipped = await wave("skipped")  # Redis skipped for its retry interval
    finally:
        server.resume()
    answered = inner.call_count == 4000
    print(
        f"  1,000 concurrent misses each: Redis healthy, slowest {max(healthy) * 1000:.0f} ms; "
        f"Redis paused (SIGSTOP), slowest {max(paused) * 1000:.0f} ms, "
        f"{(max(paused) - max(healthy)) * 1000:+.0f} ms (store timeout {bound * 1000:.0f} ms); "
        f"then skipped, slowest {max(skipped) * 1000:.0f} ms; "
        f"{'every request answered' if answered else 'NOT every request answered'}"
    )
    await store.aclose()


def redis_cpu_and_hits(server: RedisServer) -> tuple[float, int]:
    import redis

    client = redis.Redis.from_url(server.url)
    try:
        stats = client.info("stats")
    finally:
        client.close()
    assert server.process is not None
    return bg.cpu_seconds(server.process.pid), int(stats["keyspace_hits"])


def gateway_config(workdir: Path, upstream: str) -> Path:
    path = workdir / "gateway-cache.toml"
    path.write_text(
        f'[routes.primary]\nprovider = "openai"\nmodel = "fake-model"\nbase_url = "{upstream}"\n'
        f'[cache]\nstore = "redis"\nredis_url_env = "{REDIS_VARIABLE}"\n'
        f'[gateway]\napi_keys_env = "{bg.KEYS_VARIABLE}"\n'
    )
    return path


def litellm_config(workdir: Path, upstream: str, port: int) -> Path:
    path = bg.litellm_config(workdir, upstream)
    import json

    config = json.loads(path.read_text())
    config["litellm_settings"].update(
        {"cache": True, "cache_params": {"type": "redis", "host": "127.0.0.1", "port": port}}
    )
    path.write_text(json.dumps(config, indent=2))
    return path


def section_gateway(
    workdir: Path, upstream: str, server: RedisServer, args: argparse.Namespace
) -> dict[str, float]:
    # The servers run from a temporary directory: they import this checkout's code.
    checkout = str(Path(__file__).resolve().parents[1])
    pythonpath = os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")]))
    env = {
        **os.environ,
        bg.KEYS_VARIABLE: bg.API_KEY,
        REDIS_VARIABLE: server.url,
        "PYTHONPATH": pythonpath,
    }
    results: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(
                bg.started(
                    "chat-pipeline serve [cache] redis",
                    [
                        sys.executable, "-m", "pipeline", "serve",
                        "--config", str(gateway_config(workdir, upstream)),
                        "--port", "0", "--log-level", "info",
                    ],
                    ready_path="/readyz",
                    workdir=workdir,
                    env=env,
                )
            )
        ]  # fmt: skip
        if not args.no_litellm:
            servers.append(
                stack.enter_context(
                    bg.started(
                        "LiteLLM proxy, redis cache",
                        [
                            args.litellm_python, "-m", "litellm.proxy.proxy_cli",
                            "--config", str(litellm_config(workdir, upstream, server.port)),
                            "--host", "127.0.0.1", "--port", "0", "--num_workers", "1",
                            "--log_config",
                            str(uvicorn_log_config(workdir / "litellm-uvicorn-log.json")),
                        ],
                        ready_path="/health/liveliness",
                        workdir=workdir,
                        env=litellm_env(),
                        model="fake-model",
                    )
                )
            )  # fmt: skip
        for shape in ("non-streaming", "streaming"):
            best: dict[str, tuple[float, float, int]] = {}
            for _ in range(args.rounds):
                for one in servers:
                    stream = shape == "streaming"
                    bg.measure(one, stream=stream, concurrency=16, requests=50, warmup=50)
                    redis_before, hits_before = redis_cpu_and_hits(server)
                    result = bg.measure(
                        one, stream=stream, concurrency=16, requests=args.requests, warmup=0
                    )
                    redis_after, hits_after = redis_cpu_and_hits(server)
                    cpu = result.cpu_per_request + (redis_after - redis_before) / args.requests
                    hits = hits_after - hits_before
                    kept = best.get(one.name)
                    if kept is None or cpu < kept[0]:
                        best[one.name] = (cpu, result.throughput, hits)
            print(f"\n  {shape}, concurrency 16, {args.requests} requests, the same request")
            for name, (cpu, throughput, hits) in best.items():
                print(
                    f"    {name:36} {1 / cpu:8.0f} cached answers per CPU-second (server + "
                    f"Redis), {throughput:6.0f} req/s, Redis hits {hits} "
                    f"({'all cached' if hits >= args.requests else 'NOT all cached'})"
                )
            names = list(best)
            if len(names) == 2:
                ratio = best[names[1]][0] / best[names[0]][0]
                print(
                    f"    ours / LiteLLM: {ratio:.1f}x cached answers per CPU-second (target >= 5x)"
                )
                results[shape] = ratio
    return results


async def in_process(args: argparse.Namespace, upstream: str, server: RedisServer) -> None:
    print("\n1. exact hit, in process, 8 KB conversation")
    await section_hit(args.calls, args.rounds)
    print("\n2. a miss's added cost")
    await section_miss(upstream, max(200, args.calls // 10), args.rounds)
    print("\n4. Redis round trips per hit")
    await section_round_trips(server.url)
    print("\n5. Redis paused")
    await section_paused(server, 0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--litellm-python", default=sys.executable)
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument(
        "--no-gateway", action="store_true", help="only the in-process sections (1, 2, 4, 5)"
    )
    args = parser.parse_args()
    print(f"bench_cache, {time.strftime('%Y-%m-%d')}, Python {sys.version.split()[0]}")
    workdir = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    server = RedisServer()
    server.start()
    try:
        with bg._fake_upstream(workdir) as upstream:
            asyncio.run(in_process(args, upstream, server))
            if args.no_gateway:
                return 0
            print("\n3. through chat-pipeline serve, cached answers")
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, {bg.CLIENT_CORE})
            section_gateway(workdir, upstream, server, args)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
