"""The Python floor of a gateway: an ASGI app that forwards bytes and does nothing else.

    python benchmarks/_floor.py --upstream http://127.0.0.1:PORT/v1 --port 0

On uvicorn (uvloop, httptools), one worker: each request's key is checked (constant time,
``Authorization: Bearer``), its body is sent as it came to the upstream's same path with an
aiohttp session (keep-alive, one connector), the upstream's status, content type and bytes
go back as they arrive, and one log line is written per request. No JSON is parsed, no
model is routed, no span is made: what any Python gateway on this stack pays for the bytes
alone, measured beside ``chat-pipeline serve`` by ``bench_gateway.py``.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import sys
import time
from typing import Any

import aiohttp
import uvicorn

KEYS_VARIABLE = "BENCH_GATEWAY_KEYS"

_log = logging.getLogger("floor")
_UNAUTHORIZED = b'{"error":{"message":"missing or invalid API key","type":"invalid_request_error"}}'


class Floor:
    """The forwarder (an ASGI app)."""

    def __init__(self, upstream: str, key: str) -> None:
        self._upstream = upstream.rstrip("/").removesuffix("/v1")
        self._key = b"Bearer " + key.encode()
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        started = time.perf_counter()
        authorization = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
        if not hmac.compare_digest(authorization, self._key):
            await _answer(send, 401, b"application/json", _UNAUTHORIZED)
            self._line(scope, 401, started)
            return
        body = bytearray()
        while True:  # bounded by the client's body
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        session = self._session
        if session is None:
            raise RuntimeError("the forwarder was not started (no lifespan)")
        async with session.post(
            self._upstream + scope["path"],
            data=bytes(body),
            headers={"content-type": "application/json"},
        ) as upstream:
            await send(
                {
                    "type": "http.response.start",
                    "status": upstream.status,
                    "headers": [
                        (b"content-type", upstream.headers.get("content-type", "").encode())
                    ],
                }
            )
            async for chunk in upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            self._line(scope, upstream.status, started)

    def _line(self, scope: dict[str, Any], status: int, started: float) -> None:
        _log.info(
            "%s %s %s %.1f ms",
            scope["method"],
            scope["path"],
            status,
            (time.perf_counter() - started) * 1000,
        )

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._session is not None:
                    await self._session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _answer(send: Any, status: int, content_type: bytes, body: bytes) -> None:
    headers = [(b"content-type", content_type)]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app = Floor(args.upstream, os.environ[KEYS_VARIABLE])
    uvicorn.run(
        _ready(app),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="info",
    )
    return 0


def _ready(app: Floor) -> Any:
    """`app`, with ``/readyz`` answered without a key, like the gateway's."""

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/readyz":
            await _answer(send, 200, b"text/plain", b"ok")
            return
        await app(scope, receive, send)

    return asgi


if __name__ == "__main__":
    sys.exit(main())
