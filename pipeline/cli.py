"""The `chat-pipeline` command (also `python -m pipeline`).

``chat-pipeline demo`` runs an embedded, network-free pipeline: a primary route that fails
before any output and a backup that streams the answer, printing one line per attempt.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

from middleware.routing import FailoverAttempt, OrderedFailoverChatClient, Route, RoutingContext
from pipeline.builder import ChatPipeline
from pipeline.errors import TransientProviderError
from pipeline.testing import ScriptedChatClient, fail, reply

__all__ = ["main"]

DEMO_ANSWER = "Failover kept this answer flowing: the backup route streamed it."


class _RecordingFailover(OrderedFailoverChatClient):
    """Ordered failover that keeps a line per attempt, for the demo to print."""

    def __init__(self, routes: Sequence[Route]) -> None:
        super().__init__(routes)
        self.lines: list[str] = []

    def on_routing_update(
        self, context: RoutingContext, attempt: FailoverAttempt, is_terminal: bool
    ) -> None:
        ttfu = (
            f"{attempt.time_to_first_update * 1000:.2f} ms"
            if attempt.time_to_first_update is not None
            else "-"
        )
        error = type(attempt.exception).__name__ if attempt.exception is not None else "-"
        self.lines.append(
            f"  attempt {attempt.number}: route={attempt.route_name} outcome={attempt.outcome} "
            f"committed={attempt.output_committed} time_to_first_update={ttfu} "
            f"error={error} terminal={is_terminal}"
        )


def _demo_pipeline() -> tuple[ChatPipeline, _RecordingFailover]:
    primary = ScriptedChatClient(
        fail(TransientProviderError(status_code=503, provider="simulated")),
        name="primary",
        model_id="simulated-large",
    )
    words = [word + " " for word in DEMO_ANSWER.split(" ")]
    words[-1] = words[-1].rstrip()
    backup = ScriptedChatClient(
        reply(DEMO_ANSWER, chunks=words, chunk_delay=0.01),
        name="backup",
        model_id="simulated-small",
    )
    router = _RecordingFailover([Route("primary", primary), Route("backup", backup)])
    return ChatPipeline.builder().use_logging().use_failover(router).build(name="demo"), router


async def _demo(question: str) -> int:
    chat, router = _demo_pipeline()
    async with chat:
        print(f"pipeline: {' -> '.join(chat.describe())}")
        print(f"question: {question}")
        print("answer:   ", end="")
        async for update in chat.get_streaming_response(question):
            print(update.text, end="", flush=True)
        print()
        print("attempts:")
        for line in router.lines:
            print(line)
    return 0


async def _fake_server(port: int) -> int:
    from pipeline.testing import FakeOpenAIServer

    server = FakeOpenAIServer(port=port)
    await server.start()
    print(f"fake OpenAI-compatible server on {server.base_url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()
    return 0  # pragma: no cover - ends by interruption


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chat-pipeline", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the embedded, network-free demo pipeline")
    demo.add_argument("question", nargs="?", default="What does failover do?")
    server = commands.add_parser(
        "fake-server", help="serve a fake OpenAI-compatible API on 127.0.0.1 until interrupted"
    )
    server.add_argument("--port", type=int, default=8765)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return asyncio.run(_demo(args.question))
    if args.command == "fake-server":
        return asyncio.run(_fake_server(args.port))
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse exits
    return 2  # pragma: no cover
