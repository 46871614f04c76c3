"""`RawHTTPServer`: answers every request with the same bytes, as a misbehaving server would
(a gzip bomb, bytes that are not UTF-8), on 127.0.0.1."""

from __future__ import annotations

import asyncio
from types import TracebackType


class RawHTTPServer:
    """Answers each request with `head` (the status line and headers, without the blank
    line), then `body` in one write, then closes the connection."""

    def __init__(self, head: str, body: bytes) -> None:
        self._head = head
        self._body = body
        self._server: asyncio.Server | None = None
        self.requests = 0

    @property
    def base_url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            self.requests += 1
            writer.write(
                self._head.encode()
                + f"\r\ncontent-length: {len(self._body)}\r\nconnection: close\r\n\r\n".encode()
                + self._body
            )
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> RawHTTPServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
