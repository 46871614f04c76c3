"""Overhead of response validation on the request path.

Baseline: the same pipeline without the validation layer (a `ChatPipeline` around an
in-process `ScriptedChatClient` answering a small invoice JSON), measured in the same run.
Prints time per request, the ratio to the baseline and the microseconds added, for a
pydantic model of a few fields, the same shape as a JSON schema, and both streaming modes.

    python benchmarks/bench_response_validation.py [--calls 20000] [--chunks 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
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


async def main(calls: int, chunk_count: int) -> None:
    messages = [ChatMessage.user("the invoice as JSON")]
    print(f"get_response, {calls} calls, best of 5 (answer: {len(ANSWER)} characters)")
    base = await best_per_op(lambda: pipeline().get_response(messages), ops=1)  # warm up
    plain = pipeline()
    base = await best_per_op(lambda: plain.get_response(messages), ops=calls)
    print(report("no validation (baseline)", base, base))
    for label, client in (
        ("pydantic model (5 fields)", pipeline(Invoice)),
        ("JSON schema (same shape, jsonschema)", pipeline(SCHEMA)),
        ("callable (json.loads)", pipeline(lambda r: json.loads(r.text))),
    ):
        t = await best_per_op(lambda c=client: c.get_response(messages), ops=calls)
        print(report(label, base, t))

    chunks = chunked(chunk_count)
    streams = max(1, calls // 2)
    print(f"\nget_streaming_response, {streams} streams x {len(chunks)} updates, best of 5")
    plain_s = pipeline(chunks=chunks)
    base = await best_per_op(lambda: drain(plain_s, messages), ops=streams)
    print(report("no validation (baseline)", base, base, "stream"))
    for label, client in (
        ("pydantic model, unbuffered", pipeline(Invoice, chunks=chunks)),
        ("pydantic model, buffer_streams", pipeline(Invoice, chunks=chunks, buffer_streams=True)),
        ("JSON schema, unbuffered", pipeline(SCHEMA, chunks=chunks)),
    ):
        t = await best_per_op(lambda c=client: drain(c, messages), ops=streams)
        print(report(label, base, t, "stream"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--chunks", type=int, default=20)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.chunks))
