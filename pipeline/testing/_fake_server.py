"""Fault-injecting fake LLM HTTP servers for tests, benchmarks and demos: the shared HTTP
machinery and the OpenAI-compatible one (`FakeOpenAIServer`).

They speak enough HTTP/1.1 (keep-alive, chunked streaming) for httpx2 and the official
SDKs, on 127.0.0.1 only. Each request takes the next scripted `FakeResponse` for its path,
or the default one; every request is recorded so tests can assert exactly who was called.
The wire format is close enough to the real APIs that the official SDKs, validating their
response types strictly, accept every success and map every error to the right exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, Self

from pipeline._counting import CountWaiters
from pipeline.testing import _fake_responses

__all__ = [
    "CHAT_PATH",
    "EMBEDDINGS_PATH",
    "MODELS_PATH",
    "RESPONSES_PATH",
    "FakeOpenAIServer",
    "FakeResponse",
    "FakeServer",
    "RecordedRequest",
]

CHAT_PATH = "/v1/chat/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
MODELS_PATH = "/v1/models"
RESPONSES_PATH = _fake_responses.RESPONSES_PATH

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Payload Too Large",
    422: "Unprocessable Entity",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    529: "Site Overloaded",
}


@dataclass(frozen=True, slots=True)
class FakeResponse:
    """What the server does with one request (the same script serves every format).

    * `text` / `chunks`: the answer (streamed as `chunks`, default: word by word);
    * `tool_calls`: ``(name, arguments_json)`` pairs, streamed in `tool_call_pieces` pieces;
    * `stop_reason`: the format's own finish/stop reason (default: the natural one; in the
      Responses API, ``max_output_tokens`` or ``content_filter`` answer ``incomplete``);
    * `status` with `error_type`, `error_code`, `error_message`: an error answered in the
      format's own error body (`body` replaces it verbatim; with a success status, `body` is
      the answer, for a format's variants: Chat Completions, Bedrock); ``Retry-After`` goes
      in `headers`;
    * `latency` before the response starts, `first_chunk_delay`, `chunk_delay`;
    * `disconnect_after`: send that many SSE events, then drop the connection. The first
      events carry no content: the role chunk (OpenAI); ``response.created``,
      ``response.in_progress``, ``response.output_item.added`` and
      ``response.content_part.added`` (Responses); ``message_start``,
      ``content_block_start`` and ``ping`` (Anthropic);
    * `in_band_error` (an ``error`` object) sent after `error_after` events on a 200 stream;
    * `raw_lines`: SSE lines sent as they are (for malformed streams); `raw_body`: bytes
      sent as a stream's body as they are (a binary framing's: Bedrock's event stream);
      `omit_done` leaves out ``[DONE]`` (OpenAI), ``response.completed`` (Responses),
      ``message_stop`` (Anthropic) or ``metadata`` (Bedrock);
    * `hang`: never answer, until the client goes away; `hang_after`: send that many SSE
      events, then wait until the client goes away (both count in `disconnects`);
    * `usage`: (input, output) tokens; `cache_usage`: (written, read) prompt-cache tokens
      (Anthropic: reported apart from input; OpenAI formats: the read ones as the cached
      part of the input); `reasoning_tokens`: the part of the output spent reasoning;
    * `reasoning`: the model's reasoning text, answered before the text: a Responses
      ``reasoning`` item (its summary when the request asks ``reasoning.summary``; its
      ``encrypted_content``, which the server checks when it comes back, when the request
      includes ``reasoning.encrypted_content``), a Chat Completions ``reasoning_content``;
    * `custom_tool_calls`: ``(name, input_text)`` calls of custom (free-form) tools:
      Responses ``custom_tool_call`` items; in Chat Completions, function calls with the one
      argument ``input`` (how a custom tool is offered there);
    * `embedding_dimensions`: for ``/embeddings`` (vectors are a hash of each text);
    * `thinking`: the reasoning of a fake that thinks when asked to (Anthropic: a
      ``thinking`` block with a signature, when the request's ``thinking`` is on; ""
      answers a block without text, as ``display: "omitted"`` does).
    """

    text: str = "Hello from the fake server."
    chunks: Sequence[str] | None = None
    tool_calls: Sequence[tuple[str, str]] = ()
    tool_call_pieces: int = 3
    stop_reason: str | None = None
    status: int = 200
    body: Any = None
    error_type: str | None = None
    error_code: str | None = None
    error_message: str = "error"
    headers: Mapping[str, str] = field(default_factory=dict)
    latency: float = 0.0
    first_chunk_delay: float = 0.0
    chunk_delay: float = 0.0
    disconnect_after: int | None = None
    in_band_error: Mapping[str, Any] | None = None
    error_after: int = 0
    raw_lines: Sequence[str] | None = None
    raw_body: bytes | None = None
    omit_done: bool = False
    hang: bool = False
    hang_after: int | None = None
    usage: tuple[int, int] = (5, 7)
    cache_usage: tuple[int, int] = (0, 0)
    reasoning_tokens: int = 0
    reasoning: str | None = None
    custom_tool_calls: Sequence[tuple[str, str]] = ()
    model: str | None = None
    embedding_dimensions: int = 8
    thinking: str = "Let me think about that."

    @classmethod
    def error(
        cls,
        status: int,
        *,
        code: str | None = None,
        type: str | None = None,
        message: str = "error",
        retry_after: str | None = None,
    ) -> FakeResponse:
        """An error status, answered in the server's own error format."""
        headers = {"Retry-After": retry_after} if retry_after is not None else {}
        return cls(
            status=status,
            error_type=type,
            error_code=code,
            error_message=message,
            headers=headers,
        )

    def pieces(self) -> list[str]:
        """The text as streamed: `chunks`, or word by word."""
        if self.chunks is not None:
            return list(self.chunks)
        if not self.text:
            return []
        words = self.text.split(" ")
        return [w + " " for w in words[:-1]] + [words[-1]]

    def chat_tool_calls(self) -> list[tuple[str, str]]:
        """The tool calls as Chat Completions answers them: custom calls as functions of
        ``input``."""
        custom = [(name, json.dumps({"input": text})) for name, text in self.custom_tool_calls]
        return [*self.tool_calls, *custom]

    def argument_pieces(self, arguments: str) -> list[str]:
        size = max(1, -(-len(arguments) // max(1, self.tool_call_pieces)))
        return [arguments[start : start + size] for start in range(0, len(arguments), size)]


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One request a fake server received: its method, path (as sent, query left out),
    headers (names lowercased), decoded JSON body (None if it was not JSON) and raw body."""

    method: str
    path: str
    headers: Mapping[str, str]
    json: Any
    body: bytes = b""
    query: str = ""
    """The query string, without its ``?``."""


def fake_embedding(text: str, dimensions: int) -> list[float]:
    """A deterministic unit vector for `text` (not semantic: a hash)."""
    import numpy as np  # lazily: importing the fake servers stays light

    digest = hashlib.sha256(text.encode()).digest()
    seed = int.from_bytes(digest[:8], "little")
    vector = np.random.default_rng(seed).standard_normal(dimensions)
    return [float(x) for x in vector / np.linalg.norm(vector)]


class _Stream:
    """One chunked SSE response being written."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer

    async def open(self) -> None:
        head = (
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            "Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        self.writer.write(head.encode("latin-1"))
        await self.writer.drain()

    async def send(self, text: str) -> None:
        data = text.encode()
        self.writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await self.writer.drain()

    async def close(self) -> None:
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()


class FakeServer:
    """The HTTP machinery of a fake server on ``127.0.0.1`` (a free port unless given).

    ``async with Server() as server:`` starts it. `script(...)` queues responses per path;
    `requests`, `count(path)` and `wait_for_requests(n)` tell who was called.
    """

    default_path = CHAT_PATH
    wire_format: ClassVar[str] = ""
    """The API it speaks, as ``chat-pipeline fake-server --format`` names it (and the pytest
    plugin its fixture, ``fake_<wire_format>_server``); empty: neither offers it."""
    title: ClassVar[str] = ""
    """What the command says it serves (``fake {title} server on {base_url}``)."""
    paces_events: ClassVar[bool] = False
    """Whether its streams pause `FakeResponse.chunk_delay` between content events
    (``chat-pipeline fake-server --chunk-delay`` refuses a fake that does not)."""

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
        self.connections_accepted = 0  # a client whose pool churns opens many
        self._disconnect_waiters = CountWaiters()
        self._readers: dict[asyncio.StreamWriter, asyncio.StreamReader] = {}
        self._id_tag = os.urandom(4).hex()
        self._answers = itertools.count(1)

    def answer_tag(self) -> str:
        """A tag no other answer of this server (nor of any other server) has: the ids of an
        answer's tool calls are made from it, so no two calls ever share an id (an agent
        treats a call id it has seen as answered already)."""
        return f"{self._id_tag}{next(self._answers)}"

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the server is not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def origin(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The URL to give a client of the API it speaks."""
        return self.origin

    def fixture_environment(self) -> Mapping[str, str | None]:
        """The environment a test using it runs in (None: unset), as the pytest plugin's
        fixture sets it: nothing, unless its clients find their credentials there."""
        return {}

    def script(self, *responses: FakeResponse, path: str | None = None) -> None:
        """Queue `responses` for the next requests to `path` (then the default applies)."""
        self._scripts.setdefault(path or self.default_path, deque()).extend(responses)

    def response_for(self, request: RecordedRequest) -> FakeResponse:
        """What to answer `request`: the next scripted response for its path, else the
        default. Override it to decide per request (a fault mix, an echo of the request)."""
        queue = self._scripts.get(request.path)
        return queue.popleft() if queue else self.default

    def count(self, path: str | None = None) -> int:
        path = path or self.default_path
        return sum(1 for r in self.requests if r.path == path)

    async def wait_for_requests(self, count: int = 1) -> None:
        """Return once at least `count` requests (any path) have arrived."""
        await self._request_waiters.wait(len(self.requests), count)

    async def wait_for_disconnects(self, count: int = 1) -> None:
        """Return once clients went away from at least `count` held responses."""
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
        self.connections_accepted += 1
        self._readers[writer] = reader
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went away, or the server is stopping
        finally:
            self._connections.discard(task)
            self._readers.pop(writer, None)
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
        path, _, query = target.partition("?")
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None
        request = RecordedRequest(method, path, headers, payload, body, query)
        self.requests.append(request)
        self._request_waiters.notify(len(self.requests))
        response = self.response_for(request)
        if response.hang:
            await self._until_client_leaves(reader)
            return False
        if response.latency:
            await asyncio.sleep(response.latency)
        return await self._handle(writer, method, path, payload, response)

    async def _handle(
        self,
        writer: asyncio.StreamWriter,
        method: str,
        path: str,
        payload: Any,
        response: FakeResponse,
    ) -> bool:
        """Answer one request; False closes the connection."""
        raise NotImplementedError

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

    async def _send_events(
        self,
        writer: asyncio.StreamWriter,
        response: FakeResponse,
        events: list[str],
        *,
        error_event: str,
        done_event: str,
        first_content: int,
    ) -> bool:
        """Stream `events` (whole SSE events), injecting the response's faults: a cut after
        `disconnect_after` events, `error_event` after `error_after` events, delays, and
        `done_event` last unless omitted. `first_content` is the index of the first event with
        content; `chunk_delay` separates the content events after it."""
        stream = _Stream(writer)
        await stream.open()
        if response.first_chunk_delay:
            await asyncio.sleep(response.first_chunk_delay)
        if response.raw_lines is not None:
            for line in response.raw_lines:
                await stream.send(line + "\n")
            await stream.close()
            return True
        for index, event in enumerate(events):
            if response.disconnect_after is not None and index >= response.disconnect_after:
                writer.transport.abort()
                return False
            if response.hang_after is not None and index >= response.hang_after:
                await self._until_client_leaves(self._readers[writer])
                return False
            if response.in_band_error is not None and index >= response.error_after:
                await stream.send(error_event)
                break
            if index > first_content and response.chunk_delay:  # between content events
                await asyncio.sleep(response.chunk_delay)
            await stream.send(event)
        else:
            if response.disconnect_after is not None and response.disconnect_after <= len(events):
                writer.transport.abort()
                return False
            if not response.omit_done:
                await stream.send(done_event)
        await stream.close()
        return True

    def _model(self, payload: Mapping[str, Any], response: FakeResponse) -> str:
        return response.model or str(payload.get("model") or "fake-model")


def _openai_error_type(status: int) -> str:
    if status == 429:
        return "requests"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


class FakeOpenAIServer(FakeServer):
    """An OpenAI-compatible server: ``/v1/chat/completions`` (any ``.../chat/completions``,
    so Azure-style deployment paths work too), ``/v1/responses`` (the Responses API,
    `pipeline.testing._fake_responses`: requests checked as strictly as the API checks them,
    answers streamed as its typed events), ``/v1/embeddings`` and ``GET /v1/models``.

    `base_url` is the ``/v1`` URL to give a client. `models` are the ids ``/v1/models``
    lists. Streams send the usage chunk only when ``stream_options.include_usage`` asks for
    it; ``n`` > 1 answers that many choices.
    """

    wire_format = "openai"
    title = "OpenAI-compatible"
    paces_events = True

    def __init__(
        self,
        *,
        port: int = 0,
        default: FakeResponse | None = None,
        host: str = "127.0.0.1",
        models: Sequence[str] = ("fake-model",),
    ) -> None:
        super().__init__(port=port, default=default, host=host)
        self.models = tuple(models)
        # The encrypted reasoning this server issued: only these may come back.
        self.issued_reasoning: set[str] = set()
        self.returned_reasoning = 0  # encrypted reasoning items that came back, verified

    @property
    def base_url(self) -> str:
        return f"{self.origin}/v1"

    async def _handle(
        self,
        writer: asyncio.StreamWriter,
        method: str,
        path: str,
        payload: Any,
        response: FakeResponse,
    ) -> bool:
        is_chat = path.endswith("/chat/completions")
        is_embeddings = path.endswith("/embeddings")
        is_responses = path == _fake_responses.RESPONSES_PATH
        if path == MODELS_PATH or path.startswith(MODELS_PATH + "/"):
            return await self._models(writer, method, path)
        if method != "POST" or not (is_chat or is_embeddings or is_responses):
            await self._send_json(writer, 404, self._error_body(404, "not found", None, None))
            return True
        if response.status >= 400:
            body = response.body
            if body is None:
                body = self._error_body(
                    response.status,
                    response.error_message,
                    response.error_type,
                    response.error_code,
                )
            await self._send_json(writer, response.status, body, response.headers)
            return True
        if payload is None or not isinstance(payload, dict):
            await self._send_json(writer, 400, self._error_body(400, "bad json", None, None))
            return True
        if is_embeddings:
            await self._send_json(writer, 200, self._embeddings(payload, response))
            return True
        if is_responses:
            return await self._responses(writer, payload, response)
        if response.body is not None and not payload.get("stream"):
            await self._send_json(writer, 200, response.body, response.headers)
            return True
        if payload.get("stream"):
            events = [f"data: {data}\n\n" for data in self._chunk_payloads(payload, response)]
            error = "data: " + json.dumps({"error": dict(response.in_band_error or {})}) + "\n\n"
            return await self._send_events(
                writer,
                response,
                events,
                error_event=error,
                done_event="data: [DONE]\n\n",
                first_content=1,
            )
        await self._send_json(writer, 200, self._completion(payload, response))
        return True

    @staticmethod
    def _error_body(
        status: int,
        message: str,
        type_: str | None,
        code: str | None,
        param: str | None = None,
    ) -> dict[str, Any]:
        return {
            "error": {
                "message": message,
                "type": type_ or _openai_error_type(status),
                "param": param,
                "code": code,
            }
        }

    async def _responses(
        self, writer: asyncio.StreamWriter, payload: dict[str, Any], response: FakeResponse
    ) -> bool:
        """``POST /v1/responses`` (see `pipeline.testing._fake_responses`)."""
        refused = _fake_responses.problem(payload, self.issued_reasoning)
        if refused is not None:
            param, message, *rest = refused
            status, code = 400, "invalid_request_error"
            if len(rest) == 2 and isinstance(rest[0], int):
                status, code = rest[0], str(rest[1])
            body = self._error_body(status, message, None, code, param)
            await self._send_json(writer, status, body)
            return True
        self.returned_reasoning += _fake_responses.reasoning_returned(payload)
        number = len(self.requests)
        if not payload.get("stream"):
            body = _fake_responses.response_body(
                payload, response, number, self.issued_reasoning, tag=self.answer_tag()
            )
            await self._send_json(writer, 200, body)
            return True
        events, end, in_band, first_content = _fake_responses.events(
            payload, response, number, self.issued_reasoning, tag=self.answer_tag()
        )
        return await self._send_events(
            writer,
            response,
            events,
            error_event=in_band,
            done_event=end,
            first_content=first_content,
        )

    async def _models(self, writer: asyncio.StreamWriter, method: str, path: str) -> bool:
        if method != "GET":
            await self._send_json(writer, 405, self._error_body(405, "use GET", None, None))
            return True
        entries = [
            {"id": model, "object": "model", "created": 1700000000, "owned_by": "fake"}
            for model in self.models
        ]
        wanted = path[len(MODELS_PATH) + 1 :]
        if not wanted:
            await self._send_json(writer, 200, {"object": "list", "data": entries})
            return True
        for entry in entries:
            if entry["id"] == wanted:
                await self._send_json(writer, 200, entry)
                return True
        body = self._error_body(404, "no such model", None, "model_not_found")
        await self._send_json(writer, 404, body)
        return True

    @staticmethod
    def _choices(payload: Mapping[str, Any]) -> int:
        n = payload.get("n")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1

    def _finish_reason(self, response: FakeResponse) -> str:
        return response.stop_reason or ("tool_calls" if response.chat_tool_calls() else "stop")

    def _usage(self, response: FakeResponse, choices: int) -> dict[str, Any]:
        prompt, completion = response.usage
        completion *= choices
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": response.cache_usage[1]},
            "completion_tokens_details": {"reasoning_tokens": response.reasoning_tokens * choices},
        }

    def _completion(self, payload: Mapping[str, Any], response: FakeResponse) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": response.text or None}
        if response.reasoning is not None:
            message["reasoning_content"] = response.reasoning
        calls = response.chat_tool_calls()
        if calls:
            tag = self.answer_tag()
            message["tool_calls"] = [
                {
                    "id": f"call_{tag}_{i}",
                    "type": "function",
                    "function": {"name": n, "arguments": a},
                }
                for i, (n, a) in enumerate(calls)
            ]
        choices = self._choices(payload)
        return {
            "id": f"chatcmpl-fake-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self._model(payload, response),
            "choices": [
                {
                    "index": index,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": self._finish_reason(response),
                }
                for index in range(choices)
            ],
            "usage": self._usage(response, choices),
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
            "created": int(time.time()),
            "model": self._model(payload, response),
        }
        choices = self._choices(payload)

        def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            return json.dumps({**base, "choices": [choice]})

        out: list[str] = []
        tag = self.answer_tag()
        # Choice by choice, each a chunk of its own (a client reads them by index).
        for index in range(choices):
            out.append(chunk(index, {"role": "assistant", "content": ""}))
            if response.reasoning:
                words = response.reasoning.split(" ")
                pieces = [w + " " for w in words[:-1]] + [words[-1]]
                out += [chunk(index, {"reasoning_content": piece}) for piece in pieces]
            out += [chunk(index, {"content": piece}) for piece in response.pieces()]
            for call, (name, arguments) in enumerate(response.chat_tool_calls()):
                start = {
                    "index": call,
                    "id": f"call_{tag}_{call}",
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
                out.append(chunk(index, {"tool_calls": [start]}))
                for part in response.argument_pieces(arguments):
                    delta = {"index": call, "function": {"arguments": part}}
                    out.append(chunk(index, {"tool_calls": [delta]}))
            out.append(chunk(index, {}, self._finish_reason(response)))
        options = payload.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            out.append(json.dumps({**base, "choices": [], "usage": self._usage(response, choices)}))
        return out
