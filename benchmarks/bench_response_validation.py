"""Overhead of response validation on the request path.

Baseline: the same pipeline without the validation layer (a `ChatPipeline` around an
in-process `ScriptedChatClient` answering a small invoice JSON), measured in the same run.
Prints time per request, the ratio to the baseline and the microseconds added, for a
pydantic model of a few fields, the same shape as a JSON schema (and, when the `jsonschema`
package is installed, the same schema checked by it in a callable), and both streaming modes.

    python benchmarks/bench_response_validation.py [--calls 20000] [--chunks 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pydantic
from _timing import best_per_op, report

from pipeline import ChatClient, ChatMessage, ChatPipeline
from pipeline.testing import ScriptedChatClient, reply


class Invoice(pydantic.BaseModel):
    number: str
    customer: str
    total: float
    currency: str
    paid: bool


SCHEMA = {
    "type": "object",
    "required": ["number", "customer", "total", "currency", "paid"],
    "properties": {
        "number": {"type": "string"},
        "customer": {"type": "string"},
        "total": {"type": "number"},
        "currency": {"type": "string"},
        "paid": {"type": "boolean"},
    },
}

ANSWER = json.dumps(
    {"number": "INV-1042", "customer": "ACME Ltd", "total": 1234.5, "currency": "EUR", "paid": True}
)


def chunked(count: int) -> list[str]:
    size = -(-len(ANSWER) // count)
    return [ANSWER[i : i + size] for i in range(0, len(ANSWER), size)]


def pipeline(validator: Any = None, *, chunks: list[str] | None = None, **options: Any) -> Any:
    builder = ChatPipeline.builder()
    if validator is not None:
        builder.use_response_validation(validator, **options)
    return builder.build(ScriptedChatClient(reply(ANSWER, chunks=chunks)))


async def drain(client: ChatClient, messages: list[ChatMessage]) -> None:
    async for _ in client.get_streaming_response(messages):
        pass


async def main(calls: int, chunk_count: int, rounds: int) -> None:
    messages = [ChatMessage.user("the invoice as JSON")]
    chunks = chunked(chunk_count)
    streams = max(1, calls // chunk_count)
    plain = pipeline()
    plain_s = pipeline(chunks=chunks)

    def call(client: Any) -> Callable[[], Awaitable[object]]:
        return lambda: client.get_response(messages)

    def stream(client: Any) -> Callable[[], Awaitable[object]]:
        return lambda: drain(client, messages)

    calls_cases = [
        ("no validation (baseline)", call(plain)),
        ("pydantic model (5 fields)", call(pipeline(Invoice))),
        ("JSON schema, same shape (jsonschema-rs)", call(pipeline(SCHEMA))),
        ("callable (json.loads)", call(pipeline(lambda r: json.loads(r.text)))),
    ]
    try:  # the pure-Python peer, measured when installed (pip install jsonschema)
        from jsonschema import validators

        peer = validators.validator_for(SCHEMA)(SCHEMA)

        def with_jsonschema(response: Any) -> Any:
            instance = json.loads(response.text)
            peer.validate(instance)
            return instance

        calls_cases.append(
            ("callable: jsonschema (pure Python) peer", call(pipeline(with_jsonschema)))
        )
    except ImportError:
        pass
    stream_cases = [
        ("no validation (baseline)", stream(plain_s)),
        ("pydantic model, unbuffered", stream(pipeline(Invoice, chunks=chunks))),
        (
            "pydantic model, buffer_streams",
            stream(pipeline(Invoice, chunks=chunks, buffer_streams=True)),
        ),
        ("JSON schema, unbuffered", stream(pipeline(SCHEMA, chunks=chunks))),
    ]
    # Rounds interleave the variants, and each keeps its best round: a busy machine slows
    # every variant of a round alike, and the baseline is measured in every round.
    best_calls = [float("inf")] * len(calls_cases)
    best_streams = [float("inf")] * len(stream_cases)
    for _ in range(rounds):
        for i, (_, op) in enumerate(calls_cases):
            best_calls[i] = min(best_calls[i], await best_per_op(op, ops=calls, repeats=1))
        for i, (_, op) in enumerate(stream_cases):
            best_streams[i] = min(best_streams[i], await best_per_op(op, ops=streams, repeats=1))
    print(f"get_response, {calls} calls, best of {rounds} rounds (answer: {len(ANSWER)} chars)")
    for (label, _), t in zip(calls_cases, best_calls, strict=True):
        print(report(label, best_calls[0], t))
    print(f"\nget_streaming_response, {streams} streams x {len(chunks)} updates, best of {rounds}")
    for (label, _), t in zip(stream_cases, best_streams, strict=True):
        print(report(label, best_streams[0], t, "stream"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.chunks, args.rounds))
