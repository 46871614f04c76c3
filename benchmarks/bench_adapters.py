"""What the framework adapters cost: an agent over a pipeline against the same agent over the
framework's own OpenAI model, on one loopback fake server.

The contenders, each a client of the same OpenAI-compatible fake server (the one of
``bench_peers.py``: 50 words, 50 content chunks when streamed):

* ``pydantic-ai``: a Pydantic AI ``Agent`` over its ``OpenAIChatModel`` (the framework's own);
* ``pydantic-ai+pipeline``: the same agent over ``PipelineModel`` of a pipeline that is one
  ``OpenAIChatClient`` (the adapter and our provider client in place of theirs);
* ``pydantic-ai+full``: the same agent over ``PipelineModel`` of the full pipeline of
  ``bench_peers.py`` (telemetry API, ordered failover of two routes, each retry + circuit
  breaker over ``OpenAIChatClient``);
* ``langchain``, ``langchain+pipeline``, ``langchain+full``: the same with LangChain's
  ``ChatOpenAI`` and ``PipelineChatModel`` (``ainvoke``/``astream``).

Each contender runs in a process of its own pinned to one core, the server in another
pinned to the other (two cores, Linux); jobs (non-streaming and streaming at concurrency 1
and 32, after warm-up requests) are interleaved across contenders in rotating order, round
after round, and each cell reports the client's CPU time per request (``time.process_time``,
all its threads): minimum and median over the rounds, and its ratio to the framework's own
model in the same round. Every answer's text is checked against the server's::

    pip install -e '.[bench,pydantic-ai,langchain]'
    python benchmarks/bench_adapters.py [--requests 400] [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_peers as peers

FRAMEWORKS = {"pydantic-ai": "Pydantic AI", "langchain": "LangChain"}
CONTENDERS = [
    "pydantic-ai",
    "pydantic-ai+pipeline",
    "pydantic-ai+full",
    "langchain",
    "langchain+pipeline",
    "langchain+full",
]
LABELS = {
    "pydantic-ai": "Agent over OpenAIChatModel",
    "pydantic-ai+pipeline": "Agent over PipelineModel (one client)",
    "pydantic-ai+full": "Agent over PipelineModel (full pipeline)",
    "langchain": "ChatOpenAI",
    "langchain+pipeline": "PipelineChatModel (one client)",
    "langchain+full": "PipelineChatModel (full pipeline)",
}


def pipeline(origin: str, full: bool) -> Any:
    """One ``OpenAIChatClient`` as a pipeline, or bench_peers' full pipeline."""
    if full:
        return peers.ChatPipelineFull(origin).pipeline
    from pipeline import ChatPipeline
    from pipeline.providers import OpenAIChatClient

    client = OpenAIChatClient(peers.MODEL, api_key=peers.API_KEY, base_url=f"{origin}/v1")
    return ChatPipeline.builder().build(client, name=peers.MODEL)


class PydanticAIOverPipeline(peers.Contender):
    def __init__(self, origin: str, *, full: bool) -> None:
        super().__init__(origin)
        from importlib.metadata import version

        from pydantic_ai import Agent

        from pipeline.integrations.pydantic_ai import PipelineModel

        self.version = f"pydantic-ai-slim {version('pydantic-ai-slim')}, chat-pipeline"
        self.pipeline = pipeline(origin, full)
        self.agent = Agent(PipelineModel(self.pipeline))

    def call(self, streaming: bool) -> peers.Call:
        return peers.PydanticAI.calls(self.agent, streaming)

    async def aclose(self) -> None:
        await self.pipeline.aclose()


class LangChainOverPipeline(peers.Contender):
    def __init__(self, origin: str, *, full: bool) -> None:
        super().__init__(origin)
        from importlib.metadata import version

        from pipeline.integrations.langchain import PipelineChatModel

        self.version = f"langchain-core {version('langchain-core')}, chat-pipeline"
        self.chat = PipelineChatModel(chat=pipeline(origin, full))

    def call(self, streaming: bool) -> peers.Call:
        return peers.LangChain.calls(self.chat, streaming)

    async def aclose(self) -> None:
        await self.chat.aclose()


FACTORIES: dict[str, Callable[[str], peers.Contender]] = {
    "pydantic-ai": peers.PydanticAI,
    "pydantic-ai+pipeline": lambda origin: PydanticAIOverPipeline(origin, full=False),
    "pydantic-ai+full": lambda origin: PydanticAIOverPipeline(origin, full=True),
    "langchain": peers.LangChain,
    "langchain+pipeline": lambda origin: LangChainOverPipeline(origin, full=False),
    "langchain+full": lambda origin: LangChainOverPipeline(origin, full=True),
}


def contender_main(name: str, origin: str, cpu: int | None) -> None:
    """A contender's process: read jobs (JSON lines) from stdin, answer JSON lines."""
    peers.pin(cpu)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the libraries print goes to stderr
    with asyncio.Runner() as runner:
        contender = FACTORIES[name](origin)
        out.write(json.dumps({"ready": True, "version": contender.version}) + "\n")
        try:
            for line in sys.stdin:  # ends when the parent closes the pipe
                job = json.loads(line)
                result = runner.run(
                    peers.run_job(
                        contender,
                        job["streaming"],
                        job["concurrency"],
                        job["requests"],
                        job["warmup"],
                    )
                )
                out.write(json.dumps(result) + "\n")
        finally:
            runner.run(contender.aclose())
            runner.run(contender.close_stats())


def print_table(names: list[str], results: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    jobs = [f"{label}, concurrency {c}" for label, _, c in peers.JOBS]
    print("\nclient CPU per request, ms: min / median over the rounds (ratio to the framework's")
    print("own model: median of the per-round ratios)")
    print("\n| contender | " + " | ".join(jobs) + " |\n|---|" + "---|" * len(jobs))
    for name in names:
        own = name.split("+")[0]
        cells = []
        for job in jobs:
            cpu = [r["cpu_ms_per_request"] for r in results[name][job]]
            cell = f"{min(cpu):.2f} / {statistics.median(cpu):.2f}"
            if own != name and own in results:
                base = [r["cpu_ms_per_request"] for r in results[own][job]]
                ratios = [a / b for a, b in zip(cpu, base, strict=True)]
                cell += f" ({statistics.median(ratios):.2f}x)"
            cells.append(cell)
        print(f"| {LABELS[name]} | " + " | ".join(cells) + " |")


def main(args: argparse.Namespace) -> int:
    two_cores = hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2
    server_cpu, client_cpu = (1, 0) if two_cores else (None, None)
    env = peers.child_env()
    bench = os.path.abspath(peers.__file__)
    script = os.path.abspath(__file__)
    server_argv = [sys.executable, bench, "--serve", "0"]  # it reports the port it got
    server = peers.Child(server_argv + (["--cpu", str(server_cpu)] if two_cores else []), env)
    children: dict[str, peers.Child] = {}
    try:
        origin = server.line(60).split(" on ")[-1].strip()
        print(f"fake server on {origin} ({peers.WORDS} chunks per stream), Python "
              f"{platform.python_version()}" + (", server and client pinned to one core each"
                                                if two_cores else ", not pinned"))  # fmt: skip
        versions: dict[str, str] = {}
        for name in args.contenders:
            argv = [sys.executable, script, "--contender", name, "--origin", origin]
            child = peers.Child(argv + (["--cpu", str(client_cpu)] if two_cores else []), env)
            ready = json.loads(child.line(peers.STARTUP_TIMEOUT))
            children[name] = child
            versions[name] = ready["version"]
            print(f"  {LABELS[name]:<42} {ready['version']}")
        names = list(children)
        results: dict[str, dict[str, list[dict[str, Any]]]] = {n: {} for n in names}
        wrong = 0
        for round_ in range(args.rounds):
            started = time.monotonic()
            for label, streaming, concurrency in peers.JOBS:
                job = f"{label}, concurrency {concurrency}"
                shift = round_ % len(names)  # no contender always goes first
                for name in names[shift:] + names[:shift]:
                    request = {
                        "streaming": streaming,
                        "concurrency": concurrency,
                        "requests": args.requests,
                        "warmup": max(20, 2 * concurrency),
                    }
                    result = children[name].ask(request, peers.JOB_TIMEOUT)
                    results[name].setdefault(job, []).append(result)
                    wrong += result["wrong_answers"]
            print(f"round {round_ + 1}/{args.rounds}: {time.monotonic() - started:.0f} s",
                  flush=True)  # fmt: skip
        print_table(names, results)
        if wrong:
            print(f"\n{wrong} wrong answers")
        if args.json:
            with open(args.json, "w") as out:
                record = {"python": platform.python_version(), "pinned": two_cores,
                          "requests_per_job": args.requests, "rounds": args.rounds,
                          "versions": versions, "results": results}  # fmt: skip
                json.dump(record, out, indent=1)
            print(f"\nwrote {args.json}")
        return 1 if wrong else 0
    finally:
        for child in children.values():
            child.stop()
        server.process.terminate()
        server.process.wait(timeout=10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=400, help="measured requests per job")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=CONTENDERS)
    parser.add_argument("--json", metavar="OUT", help="write every figure as JSON to OUT")
    parser.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--origin", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.contender is not None:
        contender_main(args.contender, args.origin, args.cpu)
    else:
        sys.exit(main(args))
