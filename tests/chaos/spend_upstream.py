"""Two fake OpenAI-compatible upstreams in one process, for the spend ledger's exactly-once
test: they count what they answer, so the ledger can be checked against them.

``python -m tests.chaos.spend_upstream`` listens on a free loopback port and prints ``READY
<port>``. ``/primary/v1/chat/completions`` answers with a 503 (before any output) every call
of a request whose number (its prompt is ``question <number>``) is a multiple of
`FAIL_EVERY` (its retry fails too: the gateway fails over), and the first call of one whose
number is `RETRIED` past a multiple (its retry is answered); the others with
`USAGE["primary"]` tokens. ``/backup/v1/chat/completions`` always answers, with
`USAGE["backup"]`. ``GET /stats`` returns how many requests each received, and how many the
primary failed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline.testing import FakeOpenAIServer, FakeResponse, RecordedRequest

FAIL_EVERY = 8
RETRIED = FAIL_EVERY // 2
USAGE = {"primary": (100, 20), "backup": (150, 30)}


def number_of(request: RecordedRequest) -> int | None:
    """The request's number, from its prompt ``question <number>`` (None: another prompt)."""
    try:
        return int(request.json["messages"][0]["content"].rsplit(" ", 1)[1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


class Upstreams(FakeOpenAIServer):
    def __init__(self) -> None:
        super().__init__()
        self.received = {"primary": 0, "backup": 0}
        self.failed = 0
        self.refused_once: set[int] = set()  # requests whose first call was refused

    def response_for(self, request: RecordedRequest) -> FakeResponse:
        name = request.path.split("/")[1]
        if name not in self.received:
            return self.default
        self.received[name] += 1
        self.requests.clear()  # counts are kept above: the log would grow by 10,000s
        number = number_of(request)
        if name == "primary" and number is not None:
            refused = number % FAIL_EVERY == 0
            if number % FAIL_EVERY == RETRIED and number not in self.refused_once:
                self.refused_once.add(number)
                refused = True
            if refused:
                self.failed += 1
                return FakeResponse.error(503)
        return FakeResponse(text="ok", chunks=["o", "k"], usage=USAGE[name])

    async def _handle(
        self,
        writer: asyncio.StreamWriter,
        method: str,
        path: str,
        payload: Any,
        response: FakeResponse,
    ) -> bool:
        if path == "/stats":
            await self._send_json(writer, 200, {**self.received, "failed": self.failed})
            await writer.drain()
            return True
        return await super()._handle(writer, method, path, payload, response)


async def main() -> None:
    server = Upstreams()
    await server.start()
    print(f"READY {server.port}", flush=True)
    await asyncio.Event().wait()  # until the test stops the process


if __name__ == "__main__":
    asyncio.run(main())
