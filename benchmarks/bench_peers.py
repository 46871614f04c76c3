"""chat-pipeline against its peers, each in its own process, on one loopback fake server.

The contenders, each a client of the same OpenAI-compatible fake server:

* raw ``aiohttp`` (the baseline: POST, decode the JSON body or each SSE data line, take the
  text out) and raw ``httpx2`` (the same body and the same JSON parsing);
* the official ``openai`` SDK (``AsyncOpenAI``);
* a LiteLLM ``Router`` whose model list points at the fake server;
* a Pydantic AI ``Agent`` over ``OpenAIChatModel`` with an ``OpenAIProvider`` pointed at it;
* LangChain's ``ChatOpenAI`` (``langchain-openai``) with ``base_url``;
* chat-pipeline's full pipeline: telemetry API (no SDK) + ordered failover of two routes,
  each retry + circuit breaker over ``OpenAIChatClient`` on its default transport (aiohttp),
  and the same with ``transport="httpx2"``.

The fake server (``pipeline.testing.FakeOpenAIServer``, answering 50 words: 50 content
chunks when streamed) runs in its own process pinned to one core; each contender runs in a
process of its own pinned to the other core, started once and then driven job by job over a
pipe, so only one contender works at a time and its CPU time (``time.process_time``, all
its threads) is its own. Jobs: non-streaming and streaming at concurrency 1 and 32; each job
is preceded by warm-up requests at the same concurrency, then runs a fixed number of
requests. Rounds interleave the contenders (in a rotating order) so a noisy moment hits them
alike; each cell reports the minimum and the median over the rounds. Every answer's text is
checked against the server's.

Then the failover case, with each library's own default retry and failover settings: the
primary answers 500 every time, the backup answers. Reported per contender: primary calls
and latency of the first request, then over all requests the primary calls per request and
the latency p50. The openai SDK alone has retries but no failover (its requests fail).

Install the peers with the ``bench`` extra::

    pip install -e '.[bench]'
    python benchmarks/bench_peers.py [--requests 400] [--rounds 5] [--json OUT]

Contenders whose library is not installed are skipped (said so in the output).

CPU time on a shared machine moves from round to round; instruction counts hardly do
(only through how many events one socket read brings back)::

    python benchmarks/bench_peers.py --contenders aiohttp httpx2 chat-pipeline \
        chat-pipeline-httpx2 --instructions 120 [--jobs streaming-32 non-streaming-32]

counts each contender's client instructions per request under valgrind's callgrind (each
job in a fresh process with 120 and with 40 requests; the difference leaves out start-up;
the start-up heap is frozen out of the garbage collector, whose full collections would walk
it in one run and not the other).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _litellm_env import litellm_env

WORDS = 50
TEXT = " ".join(f"word{i:02d}" for i in range(WORDS))  # 50 words: 50 content chunks
MESSAGES = [{"role": "user", "content": "hello"}]
MODEL = "m"
API_KEY = "sk-bench"
PRIMARY_PREFIX = "/primary"  # requests under this path are the failing primary's
STATS_PATH = "/__stats"

JOBS = [
    ("non-streaming", False, 1),
    ("non-streaming", False, 32),
    ("streaming", True, 1),
    ("streaming", True, 32),
]
CONTENDERS = [
    "aiohttp",
    "httpx2",
    "openai",
    "litellm",
    "pydantic-ai",
    "langchain",
    "chat-pipeline",
    "chat-pipeline-httpx2",
]
LABELS = {
    "aiohttp": "raw aiohttp",
    "httpx2": "raw httpx2",
    "openai": "openai SDK",
    "litellm": "LiteLLM Router",
    "pydantic-ai": "Pydantic AI",
    "langchain": "LangChain",
    "chat-pipeline": "chat-pipeline",
    "chat-pipeline-httpx2": "chat-pipeline, httpx2",
}
BASELINE = "aiohttp"
RAW = ("aiohttp", "httpx2")  # no failover of their own

# On top of LiteLLM's settings (`_litellm_env`): LangChain's tracing off, and no other
# credentials of the environment reach a contender.
CHILD_ENV = {
    "LANGSMITH_TRACING": "false",
    "LANGCHAIN_TRACING_V2": "false",
    "TOKENIZERS_PARALLELISM": "false",
}
DROPPED_ENV = ("OPENAI_ORG_ID", "LANGSMITH_API_KEY", "LANGCHAIN_API_KEY", "LOGFIRE_TOKEN")

STARTUP_TIMEOUT = 300.0  # LiteLLM takes tens of seconds to import on a busy 2-core machine
JOB_TIMEOUT = 900.0

Call = Callable[[], Awaitable[str]]


def pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


# -- the fake server's process ------------------------------------------------------------


def serve(port: int, cpu: int | None) -> None:
    """Serve the fake API on 127.0.0.1:`port` (0: any free port) until terminated; prints
    ``listening on <origin>`` once it listens."""
    pin(cpu)
    from pipeline.testing import FakeOpenAIServer, FakeResponse, RecordedRequest

    failure = FakeResponse.error(500, message="primary down")

    class BenchServer(FakeOpenAIServer):
        """The fake server, plus a failing primary under ``/primary`` and a request count."""

        def __init__(self) -> None:
            super().__init__(port=port, default=FakeResponse(text=TEXT))
            self.primary_calls = 0
            self.total_calls = 0

        def response_for(self, request: RecordedRequest) -> FakeResponse:
            self.requests.clear()  # nobody reads them here: keep memory flat
            if request.path == STATS_PATH:
                return self.default
            self.total_calls += 1
            if request.path.startswith(PRIMARY_PREFIX + "/"):
                self.primary_calls += 1
                return failure
            return self.default

        async def _handle(
            self,
            writer: asyncio.StreamWriter,
            method: str,
            path: str,
            payload: Any,
            response: FakeResponse,
        ) -> bool:
            if path == STATS_PATH:
                stats = {
                    "primary": self.primary_calls,
                    "total": self.total_calls,
                    "connections": self.connections_accepted,
                }
                await self._send_json(writer, 200, stats)
                return True
            return await super()._handle(writer, method, path, payload, response)

    async def main() -> None:
        server = BenchServer()
        await server.start()
        print(f"listening on {server.origin}", flush=True)
        try:
            await asyncio.Event().wait()  # until SIGTERM
        finally:
            await server.stop()

    # The server should not be the bottleneck: uvloop when it is there (the gateway and test
    # extras install it). The contenders run on the standard event loop.
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())


# -- the contenders ---------------------------------------------------------------------


class Contender:
    """One library's client: `call(streaming)` makes a request returning the answer's text,
    `failover_call()` a request against a failing primary with a healthy backup."""

    version = ""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.base_url = f"{origin}/v1"
        self.primary_url = f"{origin}{PRIMARY_PREFIX}/v1"
        self._stats_http: Any = None

    async def server_stats(self) -> dict[str, int]:
        """The server's counts (primary calls, connections accepted), on a connection of
        its own, outside any measured part."""
        import httpx2

        if self._stats_http is None:
            self._stats_http = httpx2.AsyncClient(timeout=30)
        response = await self._stats_http.get(f"{self.origin}{STATS_PATH}")
        return dict(response.json())

    async def close_stats(self) -> None:
        if self._stats_http is not None:
            await self._stats_http.aclose()

    def call(self, streaming: bool) -> Call:
        raise NotImplementedError

    def failover_call(self) -> Call:
        raise NotImplementedError

    async def aclose(self) -> None:
        pass


class RawHttpx2(Contender):
    """The least any client must do: POST, decode, take the text out."""

    def __init__(self, origin: str) -> None:
        super().__init__(origin)
        import httpx2

        self.version = f"httpx2 {httpx2.__version__}"
        # Enough kept-alive connections for concurrency 32: the baseline churns none.
        limits = httpx2.Limits(max_connections=64, max_keepalive_connections=64)
        self.http = httpx2.AsyncClient(limits=limits, timeout=60)
        self.url = f"{self.base_url}/chat/completions"
        self.body = {"model": MODEL, "messages": MESSAGES}
        self.stream_body = {**self.body, "stream": True}
        self.headers = {"Authorization": f"Bearer {API_KEY}"}

    def call(self, streaming: bool) -> Call:
        http, url, headers = self.http, self.url, self.headers
        body, stream_body = self.body, self.stream_body
        loads = json.loads

        async def complete() -> str:
            response = await http.post(url, json=body, headers=headers)
            response.raise_for_status()
            return str(response.json()["choices"][0]["message"]["content"])

        async def stream() -> str:
            parts: list[str] = []
            async with http.stream("POST", url, json=stream_body, headers=headers) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        choices = loads(line[6:])["choices"]
                        if choices and (content := choices[0]["delta"].get("content")):
                            parts.append(content)
            return "".join(parts)

        return stream if streaming else complete

    async def aclose(self) -> None:
        await self.http.aclose()


class RawAiohttp(Contender):
    """The least any client must do, with aiohttp: the same body and JSON parsing as raw
    httpx2 (the session opens in the contender's event loop, at its first job)."""

    def __init__(self, origin: str) -> None:
        super().__init__(origin)
        import aiohttp

        self.version = f"aiohttp {aiohttp.__version__}"
        self.session: Any = None
        self.url = f"{self.base_url}/chat/completions"
        self.body = {"model": MODEL, "messages": MESSAGES}
        self.stream_body = {**self.body, "stream": True}
        self.headers = {"Authorization": f"Bearer {API_KEY}"}

    def call(self, streaming: bool) -> Call:
        import aiohttp

        if self.session is None:
            # Enough connections for concurrency 32; aiohttp keeps every idle one alive.
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=64),
                timeout=aiohttp.ClientTimeout(total=None, sock_read=60, sock_connect=60),
            )
        session, url, headers = self.session, self.url, self.headers
        body, stream_body = self.body, self.stream_body
        loads = json.loads

        async def complete() -> str:
            async with session.post(url, json=body, headers=headers) as response:
                response.raise_for_status()
                return str((await response.json())["choices"][0]["message"]["content"])

        async def stream() -> str:
            parts: list[str] = []
            async with session.post(url, json=stream_body, headers=headers) as response:
                response.raise_for_status()
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        choices = loads(line[6:])["choices"]
                        if choices and (content := choices[0]["delta"].get("content")):
                            parts.append(content)
            return "".join(parts)

        return stream if streaming else complete

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()


class OpenAISDK(Contender):
    def __init__(self, origin: str) -> None:
        super().__init__(origin)
        import openai

        self.version = f"openai {openai.__version__}"
        self.client = openai.AsyncOpenAI(api_key=API_KEY, base_url=self.base_url)
        self.failing: Any = None

    def call(self, streaming: bool) -> Call:
        client = self.client

        async def complete() -> str:
            completion = await client.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
            return completion.choices[0].message.content or ""

        async def stream() -> str:
            parts: list[str] = []
            chunks = await client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,  # type: ignore[arg-type]
                stream=True,
            )
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
            return "".join(parts)

        return stream if streaming else complete

    def failover_call(self) -> Call:
        import openai

        # No failover in the SDK: the primary alone, with its default retries.
        self.failing = openai.AsyncOpenAI(api_key=API_KEY, base_url=self.primary_url)
        client = self.failing

        async def complete() -> str:
            completion = await client.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
            return completion.choices[0].message.content or ""

        return complete

    async def aclose(self) -> None:
        await self.client.close()
        if self.failing is not None:
            await self.failing.close()


class LiteLLMRouter(Contender):
    def __init__(self, origin: str) -> None:
        super().__init__(origin)
        from importlib.metadata import version

        import litellm

        self.litellm = litellm
        self.version = f"litellm {version('litellm')}"
        self.router = litellm.Router(model_list=[self.deployment(MODEL, self.base_url)])

    @staticmethod
    def deployment(name: str, base_url: str) -> dict[str, Any]:
        return {
            "model_name": name,
            "litellm_params": {
                "model": f"openai/{MODEL}",
                "api_base": base_url,
                "api_key": API_KEY,
            },
        }

    @staticmethod
    def calls(router: Any, model: str, streaming: bool) -> Call:
        async def complete() -> str:
            response = await router.acompletion(model=model, messages=MESSAGES)
            return str(response.choices[0].message.content or "")

        async def stream() -> str:
            parts: list[str] = []
            response = await router.acompletion(model=model, messages=MESSAGES, stream=True)
            async for chunk in response:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
            return "".join(parts)

        return stream if streaming else complete

    def call(self, streaming: bool) -> Call:
        return self.calls(self.router, MODEL, streaming)

    def failover_call(self) -> Call:
        router = self.litellm.Router(
            model_list=[
                self.deployment("primary", self.primary_url),
                self.deployment("backup", self.base_url),
            ],
            fallbacks=[{"primary": ["backup"]}],
        )
        return self.calls(router, "primary", False)


class PydanticAI(Contender):
    def __init__(self, origin: str) -> None:
        super().__init__(origin)
        from importlib.metadata import version

        from pydantic_ai import Agent

        self.version = f"pydantic-ai-slim {version('pydantic-ai-slim')}"
        self.agent = Agent(self.model(self.base_url))

    @staticmethod
    def model(base_url: str) -> Any:
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        return OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url, api_key=API_KEY))

    @staticmethod
    def calls(agent: Any, streaming: bool) -> Call:
        async def complete() -> str:
            result = await agent.run("hello")
            return str(result.output)

        async def stream() -> str:
            parts: list[str] = []
            async with agent.run_stream("hello") as result:
                # debounce_by=None: each chunk reaches the caller as it arrives, as with
                # the other contenders (the default groups them in 0.1 s windows).
                async for delta in result.stream_text(delta=True, debounce_by=None):
                    parts.append(delta)
            return "".join(parts)

        return stream if streaming else complete

    def call(self, streaming: bool) -> Call:
        return self.calls(self.agent, streaming)

    def failover_call(self) -> Call:
        from pydantic_ai import Agent
        from pydantic_ai.models.fallback import FallbackModel

        model = FallbackModel(self.model(self.primary_url), self.model(self.base_url))
        return self.calls(Agent(model), False)


class LangChain(Contender):
    def __init__(self, origin: str) -> None:
        super().__init__(origin)
        from importlib.metadata import version

        self.version = (
            f"langchain-openai {version('langchain-openai')}, "
            f"langchain-core {version('langchain-core')}"
        )
        self.chat = self.model(self.base_url)

    @staticmethod
    def model(base_url: str) -> Any:
        from langchain_openai import ChatOpenAI

        return ChatOpenAI(model=MODEL, base_url=base_url, api_key=API_KEY)  # type: ignore[arg-type]

    @staticmethod
    def calls(chat: Any, streaming: bool) -> Call:
        messages = [("user", "hello")]

        async def complete() -> str:
            message = await chat.ainvoke(messages)
            return str(message.content)

        async def stream() -> str:
            parts: list[str] = []
            async for chunk in chat.astream(messages):
                if chunk.content:
                    parts.append(chunk.content)
            return "".join(parts)

        return stream if streaming else complete

    def call(self, streaming: bool) -> Call:
        return self.calls(self.chat, streaming)

    def failover_call(self) -> Call:
        chat = self.model(self.primary_url).with_fallbacks([self.model(self.base_url)])
        return self.calls(chat, False)


class ChatPipelineFull(Contender):
    """Telemetry API + ordered failover of two routes, each retry + breaker over the
    OpenAI client: every layer at its defaults, the HTTP transport too."""

    transport: str | None = None  # the client's default

    def __init__(self, origin: str) -> None:
        super().__init__(origin)
        from importlib.metadata import version

        from pipeline.providers import _http

        transport = self.transport or _http.DEFAULT_TRANSPORT
        self.version = f"chat-pipeline {version('chat-pipeline')}, {transport} transport"
        self.pipeline = self.build(self.base_url, self.base_url)
        self.failing: Any = None

    def build(self, primary_url: str, backup_url: str) -> Any:
        from middleware.routing import Route
        from pipeline import ChatPipeline
        from pipeline.providers import OpenAIChatClient

        def route(name: str, base_url: str) -> Route:
            client = OpenAIChatClient(
                MODEL, api_key=API_KEY, base_url=base_url, transport=self.transport
            )
            built = (
                ChatPipeline.builder().use_circuit_breaker().use_retry().build(client, name=name)
            )
            return Route(name, built)

        return (
            ChatPipeline.builder()
            .use_telemetry()
            .use_ordered_failover([route("a", primary_url), route("b", backup_url)])
            .build()
        )

    @staticmethod
    def calls(pipeline: Any, streaming: bool) -> Call:
        from pipeline import ChatMessage

        messages = [ChatMessage.user("hello")]

        async def complete() -> str:
            response = await pipeline.get_response(messages)
            return str(response.text)

        async def stream() -> str:
            parts: list[str] = []
            async for update in pipeline.get_streaming_response(messages):
                if text := update.text:
                    parts.append(text)
            return "".join(parts)

        return stream if streaming else complete

    def call(self, streaming: bool) -> Call:
        return self.calls(self.pipeline, streaming)

    def failover_call(self) -> Call:
        self.failing = self.build(self.primary_url, self.base_url)
        return self.calls(self.failing, False)

    async def aclose(self) -> None:
        await self.pipeline.aclose()
        if self.failing is not None:
            await self.failing.aclose()


class ChatPipelineHttpx2(ChatPipelineFull):
    """The same pipeline, its OpenAI clients on the httpx2 transport."""

    transport = "httpx2"


FACTORIES: dict[str, Callable[[str], Contender]] = {
    "aiohttp": RawAiohttp,
    "httpx2": RawHttpx2,
    "openai": OpenAISDK,
    "litellm": LiteLLMRouter,
    "pydantic-ai": PydanticAI,
    "langchain": LangChain,
    "chat-pipeline": ChatPipelineFull,
    "chat-pipeline-httpx2": ChatPipelineHttpx2,
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def run_job(contender: Contender, streaming: bool, concurrency: int, requests: int,
                  warmup: int) -> dict[str, Any]:  # fmt: skip
    """`warmup` then `requests` calls by `concurrency` workers (bounded counts)."""
    call = contender.call(streaming)
    wrong = 0

    async def timed(latencies: list[float]) -> None:
        nonlocal wrong
        start = time.perf_counter()
        text = await call()
        latencies.append(time.perf_counter() - start)
        if text != TEXT:
            wrong += 1

    async def drive(count: int, latencies: list[float]) -> None:
        queue = iter(range(count))

        async def worker() -> None:
            for _ in queue:
                await timed(latencies)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    await drive(warmup, [])
    warm_wrong, wrong = wrong, 0
    latencies: list[float] = []
    connections = (await contender.server_stats())["connections"]
    cpu, wall = time.process_time(), time.perf_counter()
    await drive(requests, latencies)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    connections = (await contender.server_stats())["connections"] - connections
    return {
        "requests": requests,
        "cpu_ms_per_request": cpu * 1000 / requests,
        "throughput": requests / wall,
        "p50_ms": percentile(latencies, 0.50) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "wrong_answers": wrong + warm_wrong,
        # Connections the server accepted while measured (a warm pool that keeps its
        # connections opens none).
        "new_connections": connections,
    }


async def run_failover(contender: Contender, requests: int) -> dict[str, Any]:
    """`requests` sequential calls against the failing primary; per request, its latency,
    its outcome and how many primary calls the server saw."""
    call = contender.failover_call()

    async def primary_calls() -> int:
        return (await contender.server_stats())["primary"]

    rows: list[dict[str, Any]] = []
    for _ in range(requests):
        before = await primary_calls()
        start = time.perf_counter()
        try:
            text = await call()
            outcome = "ok" if text == TEXT else "wrong answer"
        except Exception as exc:  # the failure is the result here, reported by type
            outcome = f"error: {type(exc).__name__}"
        latency = time.perf_counter() - start
        rows.append(
            {"latency_ms": latency * 1000, "primary_calls": await primary_calls() - before,
             "outcome": outcome}
        )  # fmt: skip
    latencies = [r["latency_ms"] for r in rows]
    return {
        "requests": requests,
        "first_latency_ms": rows[0]["latency_ms"],
        "first_primary_calls": rows[0]["primary_calls"],
        "last_latency_ms": rows[-1]["latency_ms"],
        "last_primary_calls": rows[-1]["primary_calls"],
        "primary_calls_per_request": sum(r["primary_calls"] for r in rows) / requests,
        "p50_ms": percentile(latencies, 0.5),
        "ok": sum(r["outcome"] == "ok" for r in rows),
        "outcomes": sorted({r["outcome"] for r in rows}),
        "per_request": rows,
    }


def contender_main(name: str, origin: str, cpu: int | None) -> None:
    """A contender's process: read jobs (JSON lines) from stdin, answer JSON lines."""
    pin(cpu)
    # Results go to a private copy of stdout; anything the libraries print goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def answer(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")

    with asyncio.Runner() as runner:
        contender = FACTORIES[name](origin)
        answer({"ready": True, "version": contender.version})
        try:
            for line in sys.stdin:  # ends when the parent closes the pipe
                job = json.loads(line)
                if job["kind"] == "quit":
                    break
                if job["kind"] == "failover":
                    result = runner.run(run_failover(contender, job["requests"]))
                else:
                    result = runner.run(
                        run_job(contender, job["streaming"], job["concurrency"],
                                job["requests"], job["warmup"])
                    )  # fmt: skip
                answer(result)
        finally:
            runner.run(contender.aclose())
            runner.run(contender.close_stats())


def count_main(name: str, origin: str, job: str) -> None:
    """One job in a fresh process (run under callgrind by `instruction_counts`)."""
    streaming, concurrency, requests = job.split(",")

    async def one() -> None:
        contender = FACTORIES[name](origin)
        # The start-up heap out of the collector's way: whether a full collection (which
        # would walk it all) falls in the short run or the long one must not move the count.
        gc.collect()
        gc.freeze()
        try:
            result = await run_job(contender, streaming == "1", int(concurrency),
                                   int(requests), 0)  # fmt: skip
            if result["wrong_answers"]:
                raise SystemExit(f"{name}: {result['wrong_answers']} wrong answers")
        finally:
            await contender.aclose()
            await contender.close_stats()

    asyncio.run(one())


def instruction_counts(args: argparse.Namespace) -> int:
    """Client instructions per request, counted by valgrind's callgrind (other load on the
    machine moves them little): each contender runs each job in a fresh process twice, with
    `args.instructions` requests and with a third of them, and the difference divided by the
    difference in requests leaves out the start-up. The server runs outside valgrind."""
    env = child_env()
    env["PYTHONHASHSEED"] = "0"
    script = os.path.abspath(__file__)
    server = Child([sys.executable, script, "--serve", "0"], env)  # it reports its port
    large = args.instructions
    small = max(1, large // 3)
    selected = [j for j in JOBS if f"{j[0]}-{j[2]}" in args.jobs]
    counts: dict[str, dict[str, float]] = {}
    try:
        origin = server.line(60).split(" on ")[-1].strip()
        print(f"client instructions per request (callgrind, {large} minus {small} requests, "
              f"{WORDS} chunks per stream)", flush=True)  # fmt: skip
        for name in args.contenders:
            counts[name] = {}
            for label, streaming, concurrency in selected:
                measured = []
                for requests in (small, large):
                    done = subprocess.run(
                        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                         sys.executable, script, "--contender", name, "--origin", origin,
                         "--count-job", f"{int(streaming)},{concurrency},{requests}"],
                        capture_output=True, text=True, env=env, timeout=JOB_TIMEOUT,
                    )  # fmt: skip
                    found = [line for line in done.stderr.splitlines() if "Collected :" in line]
                    if done.returncode != 0 or not found:
                        print(f"{LABELS[name]}, {label} {concurrency}: failed")
                        print(done.stderr[-2000:])
                        return 1
                    measured.append(int(found[-1].split(":")[-1]))
                job = f"{label}, concurrency {concurrency}"
                counts[name][job] = (measured[1] - measured[0]) / (large - small)
                print(f"  {LABELS[name]:<16} {job:<30} {counts[name][job] / 1e6:7.2f}M",
                      flush=True)  # fmt: skip
    finally:
        server.process.terminate()
        server.process.wait(timeout=10)
    jobs = [f"{label}, concurrency {c}" for label, _, c in selected]
    print("\n| contender | " + " | ".join(jobs) + " |\n|---|" + "---|" * len(jobs))
    for name, row in counts.items():
        cells = []
        for job in jobs:
            cell = f"{row[job] / 1e6:.2f}M"
            if name != BASELINE and BASELINE in counts:
                cell += f" ({row[job] / counts[BASELINE][job]:.2f}x)"
            cells.append(cell)
        print(f"| {LABELS[name]} | " + " | ".join(cells) + " |")
    return 0


# -- the parent: starts the processes, interleaves the rounds, prints the tables ----------


class Child:
    """A child process answering one JSON line per line sent, each within a deadline."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True
        )
        self.buffer = b""

    def line(self, timeout: float) -> str:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer within {timeout:.0f} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                data = os.read(fd, 65536)
                if not data:
                    raise RuntimeError(f"the process exited (code {self.process.wait()})")
                self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()

    def ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        return dict(json.loads(self.line(timeout)))

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.process.stdin is not None:
                self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


def child_env() -> dict[str, str]:
    env = litellm_env(CHILD_ENV, DROPPED_ENV)
    # The benchmark's directory is not the project's: make `pipeline` importable from a
    # checkout as well as from an install.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def summarize(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def print_tables(names: list[str], results: dict[str, dict[str, list[dict[str, Any]]]],
                 rounds: int) -> None:  # fmt: skip
    jobs = [f"{label}, concurrency {c}" for label, _, c in JOBS]
    heads = "| contender | " + " | ".join(jobs) + " |"
    rule = "|---|" + "---|" * len(jobs)

    def table(title: str, cell: Callable[[str, str], str]) -> None:
        print(f"\n{title}\n\n{heads}\n{rule}")
        for name in names:
            print(f"| {LABELS[name]} | " + " | ".join(cell(name, job) for job in jobs) + " |")

    def stat(name: str, job: str, key: str) -> dict[str, float]:
        return summarize([r[key] for r in results[name][job]])

    def cpu(name: str, job: str) -> str:
        mine = stat(name, job, "cpu_ms_per_request")
        text = f"{mine['min']:.2f} / {mine['median']:.2f}"
        if name != BASELINE and BASELINE in results:
            base = stat(BASELINE, job, "cpu_ms_per_request")
            text += f" ({mine['min'] / base['min']:.2f}x / {mine['median'] / base['median']:.2f}x)"
        return text

    def latency(name: str, job: str) -> str:
        p50, p99 = stat(name, job, "p50_ms"), stat(name, job, "p99_ms")
        text = f"{p50['median']:.1f} / {p99['min']:.1f} / {p99['median']:.1f}"
        if name != BASELINE and BASELINE in results:
            base = stat(BASELINE, job, "p99_ms")
            text += f" ({p99['median'] / base['median']:.2f}x)"
        return text

    def throughput(name: str, job: str) -> str:
        rps = stat(name, job, "throughput")
        return f"{rps['max']:.0f} / {rps['median']:.0f}"

    table(
        f"client CPU ms per request, min / median of {rounds} rounds "
        "(ratio to raw aiohttp: min / min, median / median)",
        cpu,
    )
    table(
        "latency ms: p50 (median of rounds) / p99 (min of rounds) / p99 (median of rounds) "
        "(p99 median ratio to raw aiohttp)",
        latency,
    )
    table("throughput, requests/s: best / median of rounds", throughput)

    def connections(name: str, job: str) -> str:
        return f"{stat(name, job, 'new_connections')['median']:.0f}"

    table("connections opened while measured (median of rounds; 0 = no pool churn)", connections)


def print_failover(names: list[str], failover: dict[str, dict[str, Any]], requests: int) -> None:
    print(
        "\nfailover, library defaults: the primary answers 500 every time, the backup answers\n"
        f"\n| contender | first request | last request | all {requests}: primary calls per "
        "request, latency p50 | outcomes |\n|---|---|---|---|---|"
    )
    for name in names:
        if name not in failover:
            continue
        f = failover[name]
        first = f"{f['first_latency_ms']:.1f} ms, {f['first_primary_calls']} primary calls"
        last = f"{f['last_latency_ms']:.1f} ms, {f['last_primary_calls']} primary calls"
        print(
            f"| {LABELS[name]} | {first} | {last} | {f['primary_calls_per_request']:.2f}, "
            f"{f['p50_ms']:.1f} ms | {f['ok']}/{f['requests']} ok; {', '.join(f['outcomes'])} |"
        )


def main(args: argparse.Namespace) -> int:
    two_cores = hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2
    server_cpu, client_cpu = (1, 0) if two_cores else (None, None)
    env = child_env()
    script = os.path.abspath(__file__)
    server = Child([sys.executable, script, "--serve", "0"]  # it reports the port it got
                   + (["--cpu", str(server_cpu)] if two_cores else []), env)  # fmt: skip
    children: dict[str, Child] = {}
    try:
        origin = server.line(60).split(" on ")[-1].strip()
        print(f"fake server on {origin} ({WORDS} chunks per stream)"
              + (", pinned to CPU 1; each contender in its own process on CPU 0"
                 if two_cores else "; not pinned (needs Linux and two cores)"))  # fmt: skip
        print(f"Python {platform.python_version()}, {platform.machine()}")
        versions: dict[str, str] = {}
        for name in args.contenders:
            argv = [sys.executable, script, "--contender", name, "--origin", origin]
            child = Child(argv + (["--cpu", str(client_cpu)] if two_cores else []), env)
            try:
                ready = json.loads(child.line(STARTUP_TIMEOUT))
            except (RuntimeError, TimeoutError) as exc:
                print(f"{LABELS[name]}: skipped, it did not start ({exc}; see stderr)")
                child.stop()
                continue
            children[name] = child
            versions[name] = ready["version"]
            print(f"  {LABELS[name]:<16} {ready['version']}")
        names = [n for n in args.contenders if n in children]

        results: dict[str, dict[str, list[dict[str, Any]]]] = {n: {} for n in names}
        for round_ in range(args.rounds):
            started = time.monotonic()
            for label, streaming, concurrency in JOBS:
                job = f"{label}, concurrency {concurrency}"
                # The order rotates each round so no contender always goes first.
                shift = round_ % len(names)
                for name in names[shift:] + names[:shift]:
                    request = {
                        "kind": "job",
                        "streaming": streaming,
                        "concurrency": concurrency,
                        "requests": args.requests,
                        "warmup": max(20, 2 * concurrency),
                    }
                    result = children[name].ask(request, JOB_TIMEOUT)
                    results[name].setdefault(job, []).append(result)
                    if result["wrong_answers"]:
                        print(f"  {LABELS[name]}, {job}: {result['wrong_answers']} wrong answers")
            print(f"round {round_ + 1}/{args.rounds}: {time.monotonic() - started:.0f} s",
                  flush=True)  # fmt: skip
        print_tables(names, results, args.rounds)

        failover: dict[str, dict[str, Any]] = {}
        if args.failover_requests:
            for name in names:
                if name in RAW:
                    continue
                request = {"kind": "failover", "requests": args.failover_requests}
                failover[name] = children[name].ask(request, JOB_TIMEOUT)
            print_failover(names, failover, args.failover_requests)

        if args.json:
            with open(args.json, "w") as out:
                json.dump(
                    {
                        "python": platform.python_version(),
                        "pinned": two_cores,
                        "chunks_per_stream": WORDS,
                        "requests_per_job": args.requests,
                        "rounds": args.rounds,
                        "versions": versions,
                        "results": results,
                        "failover": failover,
                    },
                    out,
                    indent=1,
                )
            print(f"\nwrote {args.json}")
    finally:
        for child in children.values():
            child.stop()  # closing its stdin ends its job loop
        server.process.terminate()
        try:
            server.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=10)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=400, help="measured requests per job")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--failover-requests", type=int, default=12,
                        help="sequential requests in the failover case (0: skip it)")  # fmt: skip
    parser.add_argument("--contenders", nargs="+", choices=list(FACTORIES), default=CONTENDERS,
                        help="default: all")  # fmt: skip
    parser.add_argument("--json", metavar="OUT", help="write every figure as JSON to OUT")
    parser.add_argument("--instructions", type=int, metavar="N",
                        help="count client instructions per request under callgrind instead "
                             "(N and N/3 requests per job; try --contenders aiohttp "
                             "chat-pipeline --instructions 120)")  # fmt: skip
    parser.add_argument("--jobs", nargs="+", default=[f"{j[0]}-{j[2]}" for j in JOBS],
                        choices=[f"{j[0]}-{j[2]}" for j in JOBS],
                        help="with --instructions: the jobs to count (default: all)")  # fmt: skip
    parser.add_argument("--count-job", help=argparse.SUPPRESS)
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--contender", choices=list(FACTORIES), help=argparse.SUPPRESS)
    parser.add_argument("--origin", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.cpu)
    elif args.contender is not None and args.count_job is not None:
        count_main(args.contender, args.origin, args.count_job)
    elif args.contender is not None:
        contender_main(args.contender, args.origin, args.cpu)
    elif args.instructions is not None:
        if args.instructions < 3:
            parser.error("--instructions must be at least 3")
        sys.exit(instruction_counts(args))
    else:
        if args.requests < 1 or args.rounds < 1 or args.failover_requests < 0:
            parser.error("--requests and --rounds must be at least 1")
        sys.exit(main(args))
