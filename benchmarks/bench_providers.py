"""Our HTTP clients and a full pipeline, on both transports, vs raw aiohttp and raw httpx2,
against loopback fake servers.

The baseline does the least any client must: POST, then decode the JSON body (or each SSE
data payload), with a raw ``aiohttp.ClientSession``; raw ``httpx2.AsyncClient`` does the
same. Both are measured per wire format (Chat Completions, Anthropic Messages and Gemini's
``generateContent``) in the same run. Our clients and the full pipeline run once per
transport (``transport="aiohttp"``, the default, and ``transport="httpx2"``), each with its
own default pool. The fake servers run in their own processes (``chat-pipeline fake-server
[--format anthropic|gemini]``) so the client process's CPU time is the client's alone. For
concurrency 1 and 32, non-streaming and streaming, prints requests per second and client CPU
milliseconds per 1,000 requests, and both ratios to the baseline of the same format. The
old ``httpx`` and the official ``openai``, ``anthropic`` and ``google-genai`` SDKs are
measured too when they are installed. ``--formats gemini`` (say) measures one format only.

Bedrock Converse has no raw baseline worth the name (every request is signed): its baseline is
boto3's ``bedrock-runtime`` client (``converse``, ``converse_stream`` read to its end), on
the same fake (``--format bedrock``, which checks every signature), run in 32 threads for
concurrency 32 since boto3 is synchronous; ours signs with botocore and decodes the event
stream with botocore's parser too.

    python benchmarks/bench_providers.py [--requests 1000] [--rounds 3] [--formats ...]
    python benchmarks/bench_providers.py --own-code --requests 5000 --rounds 5
    python benchmarks/bench_providers.py --instructions [--requests 100] [--baseline DIR]

``--own-code`` measures only the pipeline's own code per call, in process: the full
pipeline around scripted routes minus the bare scripted client.

``--instructions`` counts, under valgrind's callgrind, the instructions per call of raw
aiohttp, ``OpenAIChatClient`` alone and the full pipeline (both on aiohttp, Chat Completions
against the openai fake server in its own process, which is not counted), whole and
streamed, at concurrency 1 and 32: what the CPU-time mode compares, without a shared
machine's noise. One process under callgrind runs every contender; for each cell the counts
of ``--requests`` and 5x ``--requests`` calls (each zeroed before and dumped after with
``callgrind_control``) are subtracted, so what every count shares drops out.
``--baseline DIR`` counts the checkout at DIR too (its ``pipeline`` and ``middleware``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import aiohttp
import httpx2

from middleware.routing import Route
from pipeline import ChatClient, ChatMessage, ChatPipeline
from pipeline.providers import (
    AnthropicChatClient,
    BedrockChatClient,
    GeminiChatClient,
    OpenAIChatClient,
)

MESSAGES = [{"role": "user", "content": "hello"}]
OPENAI_BODY = {"model": "m", "messages": MESSAGES}
OPENAI_STREAM = {**OPENAI_BODY, "stream": True, "stream_options": {"include_usage": True}}
ANTHROPIC_BODY = {"model": "m", "max_tokens": 64, "messages": MESSAGES}
ANTHROPIC_STREAM = {**ANTHROPIC_BODY, "stream": True}
ANTHROPIC_HEADERS = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
GEMINI_BODY = {"contents": [{"role": "user", "parts": [{"text": "hello"}]}]}
GEMINI_HEADERS = {"x-goog-api-key": "k"}
BEDROCK_MODEL = "anthropic.claude-sonnet-4-5-20250929-v1:0"
BEDROCK_MESSAGES = [{"role": "user", "content": [{"text": "hello"}]}]
FORMATS = ("openai", "anthropic", "gemini", "bedrock")

Call = Callable[[], Awaitable[object]]
Maker = Callable[[bool], Call]


async def run(requests: int, concurrency: int, call: Call) -> tuple[float, float]:
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


def raw_calls(http: Any, url: str, body: dict[str, Any], stream_body: dict[str, Any],
              headers: dict[str, str]) -> Maker:  # fmt: skip
    """POST and decode, with a raw client (httpx2's, or the old httpx's: same API)."""

    async def call() -> object:
        response = await http.post(url, json=body, headers=headers)
        return response.json()

    async def stream() -> object:
        # The least any client must do: read the lines and decode each data payload.
        async with http.stream("POST", url, json=stream_body, headers=headers) as response:
            return [
                json.loads(line[6:])
                async for line in response.aiter_lines()
                if line.startswith("data: {")
            ]

    return lambda streaming: stream if streaming else call


def raw_aiohttp_calls(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      stream_body: dict[str, Any], headers: dict[str, str]) -> Maker:  # fmt: skip
    """POST and decode, with a raw aiohttp session (the same body and JSON parsing)."""

    async def call() -> object:
        async with session.post(url, json=body, headers=headers) as response:
            return await response.json()

    async def stream() -> object:
        async with session.post(url, json=stream_body, headers=headers) as response:
            return [json.loads(line[6:]) async for line in response.content
                    if line.startswith(b"data: {")]  # fmt: skip

    return lambda streaming: stream if streaming else call


def gemini_raw_calls(
    raw: httpx2.AsyncClient, session: aiohttp.ClientSession, gemini_url: str
) -> list[tuple[str, str, Maker]]:
    """The baselines of Gemini's wire, which has a URL per call shape (the stream's with
    ``alt=sse``)."""
    whole = f"{gemini_url}/models/m:generateContent"
    streamed = f"{gemini_url}/models/m:streamGenerateContent?alt=sse"
    body = (GEMINI_BODY, GEMINI_BODY, GEMINI_HEADERS)

    def split(whole_calls: Maker, streamed_calls: Maker) -> Maker:
        return lambda streaming: streamed_calls(True) if streaming else whole_calls(False)

    return [
        ("gemini", BASELINE, split(raw_aiohttp_calls(session, whole, *body),
                                   raw_aiohttp_calls(session, streamed, *body))),
        ("gemini", "raw httpx2", split(raw_calls(raw, whole, *body),
                                       raw_calls(raw, streamed, *body))),
    ]  # fmt: skip


def client_calls(client: ChatClient) -> Maker:
    messages = [ChatMessage.user("hello")]

    def make(streaming: bool) -> Call:
        if not streaming:
            return lambda: client.get_response(messages)

        async def drain() -> object:
            return [u async for u in client.get_streaming_response(messages)]

        return drain

    return make


def full_pipeline(primary: ChatClient, backup: ChatClient) -> ChatPipeline:
    route = ChatPipeline.builder().use_circuit_breaker().use_retry().build(primary)
    return (
        ChatPipeline.builder()
        .use_logging()
        .configure_options(lambda o: o.with_(temperature=0.1))
        .use_ordered_failover([Route("primary", route), Route("backup", backup)])
        .build()
    )


def gemini_sdk_calls(gemini_url: str) -> list[tuple[str, str, Maker]]:
    try:
        from google import genai
        from google.genai import types
    except ImportError:
        print("(google-genai SDK not installed: skipped)")
        return []
    origin, _, version = gemini_url.rpartition("/")
    options = types.HttpOptions(
        base_url=origin, api_version=version, retry_options=types.HttpRetryOptions(attempts=1)
    )
    sdk = genai.Client(api_key="k", http_options=options)

    def make(streaming: bool) -> Call:
        if not streaming:
            return lambda: sdk.aio.models.generate_content(model="m", contents="hello")

        async def drain() -> object:
            stream = await sdk.aio.models.generate_content_stream(model="m", contents="hello")
            return [chunk async for chunk in stream]

        return drain

    return [("gemini", "google-genai SDK", make)]


def sdk_calls(openai_url: str, anthropic_url: str) -> list[tuple[str, str, Maker]]:
    found: list[tuple[str, str, Maker]] = []
    try:
        import openai
    except ImportError:
        print("(openai SDK not installed: skipped)")
    else:
        sdk = openai.AsyncOpenAI(api_key="k", base_url=openai_url)

        def openai_make(streaming: bool) -> Call:
            if not streaming:
                return lambda: sdk.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]

            async def drain() -> object:
                stream = await sdk.chat.completions.create(
                    model="m",
                    messages=MESSAGES,
                    stream=True,  # type: ignore[arg-type]
                )
                return [c async for c in stream]

            return drain

        found.append(("openai", "openai SDK", openai_make))
    try:
        import anthropic
    except ImportError:
        print("(anthropic SDK not installed: skipped)")
    else:
        asdk = anthropic.AsyncAnthropic(api_key="k", base_url=anthropic_url)

        def anthropic_make(streaming: bool) -> Call:
            if not streaming:
                return lambda: asdk.messages.create(model="m", max_tokens=64, messages=MESSAGES)  # type: ignore[arg-type]

            async def drain() -> object:
                stream = await asdk.messages.create(
                    model="m",
                    max_tokens=64,
                    messages=MESSAGES,
                    stream=True,  # type: ignore[arg-type]
                )
                return [e async for e in stream]

            return drain

        found.append(("anthropic", "anthropic SDK", anthropic_make))
    return found


BASELINE = "raw aiohttp (baseline)"
TRANSPORTS = ("aiohttp", "httpx2")


def bedrock_calls(bedrock_url: str, closables: list[Any]) -> list[tuple[str, str, Maker]]:
    """boto3's bedrock-runtime client (the baseline: first) and ours on both transports."""
    import boto3
    import botocore.config

    sdk = boto3.client(
        "bedrock-runtime",
        endpoint_url=bedrock_url,
        config=botocore.config.Config(max_pool_connections=64, retries={"total_max_attempts": 1}),
    )
    threads = ThreadPoolExecutor(max_workers=32)

    def converse() -> object:
        return sdk.converse(modelId=BEDROCK_MODEL, messages=BEDROCK_MESSAGES)

    def converse_stream() -> object:
        response = sdk.converse_stream(modelId=BEDROCK_MODEL, messages=BEDROCK_MESSAGES)
        return list(response["stream"])

    def boto3_make(streaming: bool) -> Call:
        work = converse_stream if streaming else converse
        return lambda: asyncio.get_running_loop().run_in_executor(threads, work)

    found: list[tuple[str, str, Maker]] = [("bedrock", "boto3 (baseline)", boto3_make)]
    for transport in TRANSPORTS:
        ours = BedrockChatClient(BEDROCK_MODEL, base_url=bedrock_url, transport=transport)
        closables.append(ours)
        found.append(("bedrock", f"BedrockChatClient, {transport}", client_calls(ours)))
    return found


def bedrock_environment() -> None:
    """The fake's test key in this process's environment, and nothing else of AWS's."""
    from pipeline.testing import FakeBedrockServer

    os.environ.update(FakeBedrockServer().environment())
    os.environ.pop("AWS_PROFILE", None)


async def measure(
    urls: dict[str, str], requests: int, rounds: int, formats: tuple[str, ...] = FORMATS
) -> None:
    openai_url, anthropic_url, gemini_url = urls["openai"], urls["anthropic"], urls["gemini"]
    bedrock_url = urls.get("bedrock")
    limits = httpx2.Limits(max_connections=64, max_keepalive_connections=64)
    raw = httpx2.AsyncClient(limits=limits, timeout=30)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
    chat_url = f"{openai_url}/chat/completions"
    messages_url = f"{anthropic_url}/v1/messages"
    closables: list[Any] = [raw]
    # (wire format, label, calls); the first of each format is its baseline.
    contenders: list[tuple[str, str, Maker]] = [
        ("openai", BASELINE,
         raw_aiohttp_calls(session, chat_url, OPENAI_BODY, OPENAI_STREAM, {})),
        ("openai", "raw httpx2", raw_calls(raw, chat_url, OPENAI_BODY, OPENAI_STREAM, {})),
        ("anthropic", BASELINE,
         raw_aiohttp_calls(session, messages_url, ANTHROPIC_BODY, ANTHROPIC_STREAM,
                           ANTHROPIC_HEADERS)),
        ("anthropic", "raw httpx2",
         raw_calls(raw, messages_url, ANTHROPIC_BODY, ANTHROPIC_STREAM, ANTHROPIC_HEADERS)),
    ]  # fmt: skip
    contenders += gemini_raw_calls(raw, session, gemini_url)
    makers: tuple[tuple[str, Any], ...] = (
        ("openai", OpenAIChatClient),
        ("anthropic", AnthropicChatClient),
        ("gemini", GeminiChatClient),
    )
    for transport in TRANSPORTS:
        for fmt, make in makers:
            url = urls[fmt]
            single = make("m", api_key="k", base_url=url, transport=transport)
            full = full_pipeline(
                make("m", api_key="k", base_url=url, transport=transport),
                make("m", api_key="k", base_url=url, transport=transport),
            )
            closables += [single, full]
            contenders.append((fmt, f"{make.__name__}, {transport}", client_calls(single)))
            contenders.append((fmt, f"full pipeline, {transport}", client_calls(full)))
    try:
        import httpx
    except ImportError:
        print("(old httpx not installed: skipped)")
    else:
        legacy = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64), timeout=30
        )
        closables.append(legacy)
        contenders.append(
            ("openai", f"raw httpx {httpx.__version__}",
             raw_calls(legacy, chat_url, OPENAI_BODY, OPENAI_STREAM, {})),
        )  # fmt: skip
    contenders += sdk_calls(openai_url, anthropic_url)
    contenders += gemini_sdk_calls(gemini_url)
    if bedrock_url is not None:
        contenders += bedrock_calls(bedrock_url, closables)
    # The first contender of each format is its baseline (boto3's client for Bedrock).
    baselines: dict[str, str] = {}
    for fmt, label, _ in contenders:
        baselines.setdefault(fmt, label)
    # The formats in blocks, baseline first.
    contenders = [c for c in contenders if c[0] in formats]
    contenders.sort(key=lambda c: FORMATS.index(c[0]))

    for streaming in (False, True):
        for concurrency in (1, 32):
            kind = "streaming" if streaming else "non-streaming"
            print(f"\n{kind}, concurrency {concurrency}, {requests} requests, best of {rounds}")
            calls = [(fmt, label, make(streaming)) for fmt, label, make in contenders]
            # Rounds interleave the contenders, so a noisy moment hits them alike; the best
            # round of each is kept.
            best: dict[tuple[str, str], tuple[float, float]] = {}
            for _ in range(rounds):
                for fmt, label, call in calls:
                    rps, cpu = await run(requests, concurrency, call)
                    if (fmt, label) not in best or rps > best[fmt, label][0]:
                        best[fmt, label] = (rps, cpu)
            for fmt, label, _ in calls:
                base_rps, base_cpu = best[fmt, baselines[fmt]]
                rps, cpu = best[fmt, label]
                print(
                    f"  {fmt:<9} {label:<30} {rps:8.0f} req/s  {cpu:7.1f} ms CPU/1k  "
                    f"throughput {rps / base_rps:5.2f}x  CPU {cpu / base_cpu:5.2f}x"
                )
    for closable in closables:
        await closable.aclose()
    await session.close()


@contextmanager
def fake_server(wire_format: str) -> Iterator[str]:
    """A fake server in its own process, on the port it got (port 0); yields its base URL
    once it listens."""
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline",
            "fake-server",
            "--port",
            "0",
            "--format",
            wire_format,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        url = server.stdout.readline().split(" on ")[-1].strip()  # printed once it listens
        # On Linux with two or more cores, give the servers and the client a core each, so
        # they do not take turns on one and blur the client's numbers.
        if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2:
            os.sched_setaffinity(server.pid, {1})
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


def main(requests: int, rounds: int, formats: tuple[str, ...] = FORMATS) -> None:
    bedrock_environment()
    # The three HTTP formats' servers always run (their contenders are built together);
    # Bedrock's only when asked for.
    wanted = ("openai", "anthropic", "gemini", *(("bedrock",) if "bedrock" in formats else ()))
    with contextlib.ExitStack() as servers:
        urls = {fmt: servers.enter_context(fake_server(fmt)) for fmt in wanted}
        if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2:
            os.sched_setaffinity(0, {0})
            print("servers pinned to CPU 1, client to CPU 0")
        asyncio.run(measure(urls, requests, rounds, formats))


async def own_code(calls: int, rounds: int) -> None:
    """The pipeline's own code per call: `full_pipeline` around in-process scripted routes
    minus the bare scripted client, in process CPU time (best of `rounds`)."""
    from pipeline.testing import ScriptedChatClient

    messages = [ChatMessage.user("hello")]

    def scripted() -> ScriptedChatClient:
        return ScriptedChatClient("Hello from the fake server.")

    async def per_call(client: ChatClient, streaming: bool) -> float:
        best = math.inf
        for _ in range(rounds):
            started = time.process_time()
            for _ in range(calls):
                if streaming:
                    async for _update in client.get_streaming_response(messages):
                        pass
                else:
                    await client.get_response(messages)
            best = min(best, (time.process_time() - started) / calls)
        return best

    for streaming in (False, True):
        bare = await per_call(scripted(), streaming)
        full = await per_call(full_pipeline(scripted(), scripted()), streaming)
        print(
            f"{'streaming' if streaming else 'non-streaming':14} bare {bare * 1e6:6.1f} us, "
            f"full pipeline {full * 1e6:6.1f} us: its own code {(full - bare) * 1e6:6.1f} us"
        )


# --instructions: the contenders the child counts, raw aiohttp's first (the ratios' base).
COUNTED = (BASELINE, "OpenAIChatClient alone", "full pipeline")


async def counted_calls(calls: int, concurrency: int, call: Call) -> None:
    queue = iter(range(calls))

    async def worker() -> None:
        for _ in queue:
            await call()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def instructions_child(url: str) -> None:
    """Under callgrind: run the calls each stdin line asks for ("contender streaming
    concurrency calls"), answering "done" on stdout when they ended; the parent zeroes the
    counts before the line and dumps them after the answer."""
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
    single = OpenAIChatClient("m", api_key="k", base_url=url)
    full = full_pipeline(
        OpenAIChatClient("m", api_key="k", base_url=url),
        OpenAIChatClient("m", api_key="k", base_url=url),
    )
    makers: dict[str, Maker] = {
        COUNTED[0]: raw_aiohttp_calls(
            session, f"{url}/chat/completions", OPENAI_BODY, OPENAI_STREAM, {}
        ),
        COUNTED[1]: client_calls(single),
        COUNTED[2]: client_calls(full),
    }
    print("ready", flush=True)
    while line := sys.stdin.readline():  # bounded by the parent's lines
        contender, streaming, concurrency, calls = line.rstrip("\n").split("|")
        call = makers[contender](streaming == "1")
        await counted_calls(int(calls), int(concurrency), call)
        print("done", flush=True)
    for closable in (single, full):
        await closable.aclose()
    await session.close()


class Counted:
    """A child process under callgrind, counting the calls it is asked for."""

    def __init__(self, tree: Path, url: str, workdir: Path) -> None:
        self.out = workdir / f"callgrind.{abs(hash(tree))}"
        self.process = subprocess.Popen(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={self.out}.%p",
                sys.executable,
                __file__,
                "--instructions-child",
                url,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONPATH": str(tree)},
        )
        self.stdin: IO[str] = self.process.stdin  # type: ignore[assignment]
        self.stdout: IO[str] = self.process.stdout  # type: ignore[assignment]
        if self.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the counted child under {tree} did not start")

    def control(self, flag: str) -> None:
        subprocess.run(
            ["callgrind_control", flag, str(self.process.pid)], check=True, capture_output=True
        )

    def count(self, contender: str, streaming: bool, concurrency: int, calls: int) -> int:
        """The instructions of `calls` calls (and of the fixed work around every count)."""
        self.control("-z")
        self.stdin.write(f"{contender}|{int(streaming)}|{concurrency}|{calls}\n")
        self.stdin.flush()
        if self.stdout.readline().strip() != "done":
            raise RuntimeError(f"the counted child failed on {contender}")
        self.control("-d")
        dumps = self.out.parent.glob(f"{self.out.name}.{self.process.pid}.*")
        latest = max(dumps, key=lambda path: int(path.suffix[1:]))
        found = re.search(r"^summary: (\d+)", latest.read_text(), re.MULTILINE)
        if found is None:
            raise RuntimeError(f"no summary in {latest}")
        return int(found.group(1))

    def close(self) -> None:
        self.stdin.close()
        self.process.wait(timeout=600)


def instructions(calls: int, baseline: Path | None) -> None:
    """Instructions per call of each contender, as the difference of 5x `calls` and `calls`
    calls over 4x `calls`, and as ratios to raw aiohttp's in the same tree."""
    trees = {"this checkout": Path(__file__).resolve().parents[1]}
    if baseline is not None:
        trees["baseline"] = baseline.resolve()
    more = calls * 5
    with fake_server("openai") as url, tempfile.TemporaryDirectory() as work:
        for name, tree in trees.items():
            child = Counted(tree, url, Path(work))
            try:
                print(f"\n{name} ({tree}): instructions per call, thousands "
                      f"({more} calls minus {calls}, over {more - calls})")  # fmt: skip
                for streaming in (False, True):
                    for concurrency in (1, 32):
                        per_call: dict[str, float] = {}
                        for contender in COUNTED:
                            child.count(contender, streaming, concurrency, calls)  # warm
                            low = child.count(contender, streaming, concurrency, calls)
                            high = child.count(contender, streaming, concurrency, more)
                            per_call[contender] = (high - low) / (more - calls)
                        base = per_call[BASELINE]
                        cells = "  ".join(
                            f"{label} {count / 1000:8.1f}k ({count / base:4.2f}x)"
                            for label, count in per_call.items()
                        )
                        kind = "streamed" if streaming else "whole"
                        print(f"  {kind:8} c{concurrency:<3} {cells}", flush=True)
            finally:
                child.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--requests", type=int, help="calls a round (default 1,000; --instructions: 100)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument(
        "--own-code",
        action="store_true",
        help="only the pipeline's own code per call, in process (--requests calls a round)",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="instructions per call under callgrind (--requests and 5x that many calls)",
    )
    parser.add_argument("--baseline", type=Path, help="with --instructions: a checkout too")
    parser.add_argument("--instructions-child", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instructions_child:
        asyncio.run(instructions_child(args.instructions_child))
    elif args.instructions:
        instructions(args.requests or 100, args.baseline)
    elif args.own_code:
        asyncio.run(own_code(args.requests or 1000, args.rounds))
    else:
        main(args.requests or 1000, args.rounds, tuple(args.formats))
