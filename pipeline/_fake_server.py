"""A fault-injecting OpenAI-compatible HTTP server for tests, benchmarks and demos.

It speaks enough HTTP/1.1 (keep-alive, chunked streaming) for httpx and the ``openai`` SDK,
on 127.0.0.1 only. Each request takes the next scripted `FakeResponse` for its path, or the
default one; every request is recorded so tests can assert exactly who was called.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import numpy as np

from pipeline._counting import CountWaiters

__all__ = ["CHAT_PATH", "EMBEDDINGS_PATH", "FakeOpenAIServer", "FakeResponse", "RecordedRequest"]

CHAT_PATH = "/v1/chat/completions"
EMBEDDINGS_PATH = "/v1/embeddings"

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    408: "Request Timeout",
    422: "Unprocessable Entity",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


@dataclass(frozen=True, slots=True)
class FakeResponse:
    """What the server does with one request.

    * `text` / `chunks`: the answer (streamed as `chunks`, default: word by word);
    * `tool_calls`: ``(name, arguments_json)`` pairs, streamed in `tool_call_pieces` pieces;
    * `status`, `body`, `headers`: an error status (``Retry-After`` goes in `headers`);
    * `latency` before the response starts, `first_chunk_delay`, `chunk_delay`;
    * `disconnect_after`: send that many SSE events (the first carries only the role), then
      drop the connection;
    * `in_band_error` (an ``error`` object) sent after `error_after` chunks on a 200 stream;
    * `raw_lines`: SSE lines sent as they are (for malformed streams); `omit_done`;
    * `hang`: never answer, until the client goes away; `hang_after`: send that many SSE
      events, then wait until the client goes away (both count in `disconnects`);
    * `embedding_dimensions`: for ``/embeddings`` (vectors are a hash of each text).
    """

    text: str = "Hello from the fake server."
    chunks: Sequence[str] | None = None
    tool_calls: Sequence[tuple[str, str]] = ()
    tool_call_pieces: int = 3
    status: int = 200
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    latency: float = 0.0
    first_chunk_delay: float = 0.0
    chunk_delay: float = 0.0
    disconnect_after: int | None = None
    in_band_error: Mapping[str, Any] | None = None
    error_after: int = 0
    raw_lines: Sequence[str] | None = None
    omit_done: bool = False
    hang: bool = False
    hang_after: int | None = None
    usage: tuple[int, int] = (5, 7)
    model: str | None = None
    embedding_dimensions: int = 8

    @classmethod
    def error(
        cls,
        status: int,
        *,
        code: str | None = None,
        message: str = "error",
        retry_after: str | None = None,
    ) -> FakeResponse:
        """An error status with an OpenAI-style error body."""
        headers = {"Retry-After": retry_after} if retry_after is not None else {}
        body = {"error": {"message": message, "type": "error", "code": code}}
        return cls(status=status, body=body, headers=headers)


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    method: str
    path: str
    headers: Mapping[str, str]
    json: Any


def fake_embedding(text: str, dimensions: int) -> list[float]:
    """A deterministic unit vector for `text` (not semantic: a hash)."""
    digest = hashlib.sha256(text.encode()).digest()
    seed = int.from_bytes(digest[:8], "little")
    vector = np.random.default_rng(seed).standard_normal(dimensions)
    return [float(x) for x in vector / np.linalg.norm(vector)]


class FakeOpenAIServer:
    """An OpenAI-compatible server on ``127.0.0.1`` (a free port unless one is given).

    ``async with FakeOpenAIServer() as server:`` starts it; `server.base_url` is the
    ``/v1`` URL to give a client. `script(...)` queues responses per path; `requests` and
    `count(path)` tell who was called.
    """

    def __init__(
        self, *, port: int = 0, default: FakeResponse | None = None, host: str = "127.0.0.1"
    ) -> None:
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("the fake server listens on loopback only")
        self._host = host
        self._port = port
        self.default = default or FakeResponse()
        self._scripts: dict[str, deque[FakeResponse]] = {}
        self.requests: list[RecordedRequest] = []
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._request_waiters = CountWaiters()
        self.disconnects = 0  # responses the client went away from (see `hang`)
        self._disconnect_waiters = CountWaiters()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the server is not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def base_url(self) -> str:
        return f"http://{self._host}:{self.port}/v1"

    def script(self, *responses: FakeResponse, path: str = CHAT_PATH) -> None:
        """Queue `responses` for the next requests to `path` (then the default applies)."""
        self._scripts.setdefault(path, deque()).extend(responses)

    def count(self, path: str = CHAT_PATH) -> int:
        return sum(1 for r in self.requests if r.path == path)

    async def wait_for_requests(self, count: int = 1) -> None:
        """Return once at least `count` requests (any path) have arrived."""
        await self._request_waiters.wait(len(self.requests), count)

    async def wait_for_disconnects(self, count: int = 1) -> None:
        """Return once clients went away from at least `count` hanging responses."""
        await self._disconnect_waiters.wait(self.disconnects, count)

    async def _until_client_leaves(self, reader: asyncio.StreamReader) -> None:
        await reader.read()  # returns when the client closes the connection
        self.disconnects += 1
        self._disconnect_waiters.notify(self.disconnects)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self._host, self._port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def serve_forever(self) -> None:
        await self.start()
        assert self._server is not None
        await self._server.serve_forever()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- HTTP ------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went away, or the server is stopping
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _one_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        request_line = await reader.readline()
        if not request_line:
            return False
        method, target, _ = request_line.decode("latin-1").split(" ", 2)
        headers: dict[str, str] = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        path = target.split("?", 1)[0]
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None
        self.requests.append(RecordedRequest(method, path, headers, payload))
        self._request_waiters.notify(len(self.requests))
        queue = self._scripts.get(path)
        response = queue.popleft() if queue else self.default
        if response.hang:
            await self._until_client_leaves(reader)
            return False
        if response.latency:
            await asyncio.sleep(response.latency)
        # Any ".../chat/completions" is served, so Azure-style deployment paths work too.
        is_chat = path.endswith("/chat/completions")
        is_embeddings = path.endswith("/embeddings")
        if method != "POST" or not (is_chat or is_embeddings):
            await self._send_json(writer, 404, {"error": {"message": "not found", "code": None}})
            return True
        if response.status >= 400:
            await self._send_json(writer, response.status, response.body, response.headers)
            return True
        if payload is None or not isinstance(payload, dict):
            await self._send_json(writer, 400, {"error": {"message": "bad json", "code": None}})
            return True
        if is_embeddings:
            await self._send_json(writer, 200, self._embeddings(payload, response))
            return True
        if payload.get("stream"):
            return await self._stream(reader, writer, payload, response)
        await self._send_json(writer, 200, self._completion(payload, response))
        return True

    async def _send_json(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        body: Any,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        head = [
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}",
            "Content-Type: application/json",
            f"Content-Length: {len(data)}",
            *(f"{k}: {v}" for k, v in (headers or {}).items()),
        ]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data)
        await writer.drain()

    def _model(self, payload: Mapping[str, Any], response: FakeResponse) -> str:
        return response.model or str(payload.get("model") or "fake-model")

    def _completion(self, payload: Mapping[str, Any], response: FakeResponse) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": response.text or None}
        if response.tool_calls:
            message["tool_calls"] = [
                {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(response.tool_calls)
            ]
        prompt, completion = response.usage
        return {
            "id": f"chatcmpl-fake-{len(self.requests)}",
            "object": "chat.completion",
            "model": self._model(payload, response),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if response.tool_calls else "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        }

    def _embeddings(self, payload: Mapping[str, Any], response: FakeResponse) -> dict[str, Any]:
        inputs = payload.get("input")
        texts = [inputs] if isinstance(inputs, str) else list(inputs or [])
        return {
            "object": "list",
            "model": self._model(payload, response),
            "data": [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": fake_embedding(str(t), response.embedding_dimensions),
                }
                for i, t in enumerate(texts)
            ],
            "usage": {"prompt_tokens": len(texts), "total_tokens": len(texts)},
        }

    def _chunk_payloads(self, payload: Mapping[str, Any], response: FakeResponse) -> list[str]:
        base = {
            "id": f"chatcmpl-fake-{len(self.requests)}",
            "object": "chat.completion.chunk",
            "model": self._model(payload, response),
        }

        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            return json.dumps(
                {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            )

        if response.chunks is not None:
            pieces = list(response.chunks)
        else:
            words = response.text.split(" ")
            pieces = [w + " " for w in words[:-1]] + [words[-1]] if response.text else []
        out = [chunk({"role": "assistant", "content": ""})]
        out += [chunk({"content": piece}) for piece in pieces]
        for index, (name, arguments) in enumerate(response.tool_calls):
            out.append(
                chunk(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": f"call_{index}",
                                "type": "function",
                                "function": {"name": name, "arguments": ""},
                            }
                        ]
                    }
                )
            )
            size = max(1, -(-len(arguments) // max(1, response.tool_call_pieces)))
            for start in range(0, len(arguments), size):
                part = arguments[start : start + size]
                out.append(
                    chunk({"tool_calls": [{"index": index, "function": {"arguments": part}}]})
                )
        out.append(chunk({}, "tool_calls" if response.tool_calls else "stop"))
        prompt, completion = response.usage
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        out.append(json.dumps({**base, "choices": [], "usage": usage}))
        return out

    async def _stream(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        payload: Mapping[str, Any],
        response: FakeResponse,
    ) -> bool:
        head = (
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            "Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        writer.write(head.encode("latin-1"))
        await writer.drain()
        if response.first_chunk_delay:
            await asyncio.sleep(response.first_chunk_delay)

        async def send(text: str) -> None:
            data = text.encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()

        if response.raw_lines is not None:
            for line in response.raw_lines:
                await send(line + "\n")
        else:
            for index, data in enumerate(self._chunk_payloads(payload, response)):
                if response.disconnect_after is not None and index >= response.disconnect_after:
                    writer.transport.abort()
                    return False
                if response.hang_after is not None and index >= response.hang_after:
                    await self._until_client_leaves(reader)
                    return False
                if response.in_band_error is not None and index >= response.error_after:
                    await send(
                        "data: " + json.dumps({"error": dict(response.in_band_error)}) + "\n\n"
                    )
                    break
                if index > 1 and response.chunk_delay:  # between content events
                    await asyncio.sleep(response.chunk_delay)
                await send(f"data: {data}\n\n")
            if not response.omit_done and response.in_band_error is None:
                await send("data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True
