"""A fault-injecting OpenAI-compatible server for the chaos test, run in its own process.

``python -m tests.chaos.fault_server --seed N`` listens on a free loopback port and prints
``READY <port>``. Requests to ``/r<k>/v1/chat/completions`` are answered by route ``r<k>``
with a fault drawn per request from a seeded generator: a success (whose every token names
the request that produced it, ``[r1-17:0] [r1-17:1] ...``, so a client can prove its answer
came whole from one request), a failure before any output (500, 503, 429, an in-band error,
a cut before content), a cut after some output, or a hang. ``GET /stats`` returns what it
did, request by request, with the ``traceparent`` each request carried.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any

from pipeline.testing import FakeOpenAIServer, FakeResponse, RecordedRequest

TOKENS = 6  # tokens per successful answer

PRE_OUTPUT = 0.20
MID_STREAM = 0.05
HANG = 0.10


class ChaosServer(FakeOpenAIServer):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self._random = random.Random(seed)
        self.log: list[dict[str, Any]] = []

    def response_for(self, request: RecordedRequest) -> FakeResponse:
        if request.path == "/stats":
            return self.default
        route = request.path.split("/")[1]
        tag = f"{route}-{len(self.log)}"
        streaming = bool(isinstance(request.json, dict) and request.json.get("stream"))
        draw = self._random.random()
        tokens = [f"[{tag}:{i}] " for i in range(TOKENS)]
        if draw < PRE_OUTPUT:
            fault, response = self._random.choice(
                [
                    ("status_500", FakeResponse.error(500)),
                    ("status_503", FakeResponse.error(503)),
                    ("status_429", FakeResponse.error(429, retry_after="0")),
                    ("in_band_error", FakeResponse(in_band_error={"code": "500"}, error_after=0)),
                    ("cut_before_output", FakeResponse(chunks=tokens, disconnect_after=1)),
                ]
            )
        elif draw < PRE_OUTPUT + MID_STREAM:
            cut = 1 + self._random.randint(2, TOKENS - 1)  # the role chunk, then some tokens
            fault, response = "cut_after_output", FakeResponse(chunks=tokens, disconnect_after=cut)
        elif draw < PRE_OUTPUT + MID_STREAM + HANG:
            fault, response = "hang", FakeResponse(hang=True)
        else:
            fault, response = "ok", FakeResponse(text="".join(tokens), chunks=tokens)
        if fault in ("cut_before_output", "cut_after_output", "in_band_error") and not streaming:
            # A whole response has no stream to cut or to carry an in-band error: its
            # failure is a status, before any output.
            fault, response = "status_502", FakeResponse.error(502)
        self.log.append(
            {
                "route": route,
                "tag": tag,
                "fault": fault,
                "streaming": streaming,
                "traceparent": request.headers.get("traceparent"),
            }
        )
        return response

    async def _handle(
        self,
        writer: asyncio.StreamWriter,
        method: str,
        path: str,
        payload: Any,
        response: FakeResponse,
    ) -> bool:
        if path == "/stats":
            await self._send_json(writer, 200, self.log)
            await writer.drain()
            return True
        return await super()._handle(writer, method, path, payload, response)


async def main(seed: int) -> None:
    server = ChaosServer(seed)
    await server.start()
    print(f"READY {server.port}", flush=True)
    await asyncio.Event().wait()  # until the test kills the process


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(main(parser.parse_args().seed))
