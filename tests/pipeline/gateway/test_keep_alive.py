"""Keep-alive connections of the gateway (`pipeline.gateway._protocol`): bursts on one client
pool that reuse the last burst's idle connections, every answer checked; and, on raw
sockets, the races of a reused connection: a request's head and body in separate reads, a
pipelined request, the rest of a refused body arriving with the next request, a request
arriving as the keep-alive timer ends the connection."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import types
from collections.abc import AsyncIterator
from typing import Any

import anyio
import h11
import httpcore._async.http11
import httpx
import pytest

from pipeline.config import PipelineConfig
from pipeline.gateway._protocol import ConnectionLimits, GatewayProtocol
from pipeline.testing import FakeOpenAIServer, FakeResponse
from pipeline.testing._fake_server import RecordedRequest
from tests.pipeline.gateway.conftest import config, running

PATH = "/v1/chat/completions"


class _Upstream(FakeOpenAIServer):
    """Answers ``ask N`` with ``answer N``, except every third N: 503 ``Retry-After: 7``.
    While `gate` is clear, answers wait for it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()

    def response_for(self, request: RecordedRequest) -> FakeResponse:
        n = _number(request.json["messages"][-1]["content"])
        if n % 3 == 0:
            return FakeResponse.error(503, retry_after="7")
        return FakeResponse(text=f"answer {n}")

    async def _handle(
        self, writer: Any, method: str, path: str, payload: Any, response: Any
    ) -> bool:
        await self.gate.wait()
        return await super()._handle(writer, method, path, payload, response)


def _number(text: str) -> int:
    return int(text.removeprefix("ask "))


class _Watch:
    """What the gateway's connections did: the protocols it made (in order) and how many
    request heads they parsed (with an event for each)."""

    def __init__(self) -> None:
        self.protocols: list[GatewayProtocol] = []
        self.heads = 0
        self._head = asyncio.Event()

    def parsed(self) -> None:
        self.heads += 1
        self._head.set()

    async def wait_heads(self, count: int) -> None:
        async with asyncio.timeout(30):
            while self.heads < count:
                self._head.clear()
                await self._head.wait()


class _Watched(GatewayProtocol):
    def __init__(self, *args: Any, watch: _Watch, **options: Any) -> None:
        super().__init__(*args, **options)
        self._watch = watch
        watch.protocols.append(self)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._watch.parsed()


@contextlib.asynccontextmanager
async def serving(pipeline_config: PipelineConfig, watch: _Watch) -> AsyncIterator[int]:
    """The gateway on a free loopback port (its connections watched); yields the port."""

    def protocol(limits: ConnectionLimits) -> Any:
        return functools.partial(_Watched, limits=limits, watch=watch)

    async with running(pipeline_config, http_protocol=protocol) as run:
        yield int(run.url.rsplit(":", 1)[1])


@pytest.fixture
async def upstream() -> AsyncIterator[_Upstream]:
    async with _Upstream() as server:
        yield server


def _body(n: int, streaming: bool) -> bytes:
    messages = [{"role": "user", "content": f"ask {n}"}]
    return json.dumps({"model": "pipeline", "messages": messages, "stream": streaming}).encode()


def _check(
    n: int, streaming: bool, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    """The answer to ``ask n``: its own (no other request's), whole, in its call shape."""
    if n % 3 == 0:
        assert status == 503, (n, status, body)
        assert json.loads(body)["error"]["type"] == "server_error"
        assert (b"retry-after", b"7") in headers
        return
    assert status == 200, (n, status, body)
    if not streaming:
        assert json.loads(body)["choices"][0]["message"]["content"] == f"answer {n}"
        return
    text = ""
    lines = body.decode().split("\n")
    assert "data: [DONE]" in lines, body
    for line in lines:
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    assert text == f"answer {n}", body


# -- bursts on one pool ---------------------------------------------------------------------


async def test_bursts_on_one_pool_reuse_its_connections_and_every_answer_arrives(
    upstream: _Upstream, streaming: bool
) -> None:
    # Two bursts on one client pool, an idle moment between them: the second burst goes
    # out on the first one's idle connections; every answer (503s and answers, the
    # request's own) arrives. The pool keeps every connection: httpx's own pool (httpcore
    # 1.0.9) can close a connection it has just handed to a request when it bounds its
    # idle connections (encode/httpcore#1110), losing an answer the gateway sent.
    count = 300
    watch = _Watch()
    settings = {"max_connections": 4 * count, "max_concurrent_per_key": 10 * count}
    async with serving(config({"a": upstream}, gateway=settings), watch) as port:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(limits=limits, timeout=60) as http:

            async def ask(n: int) -> None:
                response = await http.post(
                    f"http://127.0.0.1:{port}{PATH}", content=_body(n, streaming)
                )
                _check(n, streaming, response.status_code, response.headers.raw, response.content)

            async with asyncio.timeout(120):
                await asyncio.gather(*(ask(n) for n in range(count)))
                opened = len(watch.protocols)
                await asyncio.gather(*(ask(n) for n in range(count, 2 * count)))
    assert 0 < opened <= count
    assert len(watch.protocols) < opened + count  # the second burst reused connections
    assert upstream.count() == 2 * count


# -- raw sockets ----------------------------------------------------------------------------


def _request(n: int, streaming: bool, content_type: bytes = b"application/json") -> bytes:
    body = _body(n, streaming)
    return (
        b"POST %s HTTP/1.1\r\nhost: gateway\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
        % (PATH.encode(), content_type, len(body))
    ) + body


class _Client:
    """One raw connection to the gateway; responses read with h11."""

    def __init__(
        self, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.port = port
        self.reader = reader
        self.writer = writer
        self._h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, port: int) -> _Client:
        return cls(port, *await asyncio.open_connection("127.0.0.1", port))

    async def response(self) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """The next whole response (status, headers, body)."""
        if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
            self._h11.start_next_cycle()
        # h11 reads responses to requests it sent: tell it one was (the bytes went raw).
        if self._h11.our_state is h11.IDLE:
            self._h11.send(
                h11.Request(
                    method="POST", target=PATH, headers=[("host", "x"), ("content-length", "0")]
                )
            )
            self._h11.send(h11.EndOfMessage())
        status = 0
        headers: list[tuple[bytes, bytes]] = []
        body = b""
        async with asyncio.timeout(30):
            while True:
                event = self._h11.next_event()
                if event is h11.NEED_DATA:
                    self._h11.receive_data(await self.reader.read(65536))
                elif isinstance(event, h11.Response):
                    status, headers = event.status_code, list(event.headers)
                elif isinstance(event, h11.Data):
                    body += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    return status, headers, body
                else:
                    raise AssertionError(f"unexpected {event!r}")

    async def until_closed(self) -> bytes:
        """What the gateway still sends until it ends the connection (a reset raises)."""
        async with asyncio.timeout(30):
            return await self.reader.read()

    def close(self) -> None:
        self.writer.close()


@contextlib.asynccontextmanager
async def connected(upstream: _Upstream) -> AsyncIterator[tuple[_Watch, _Client]]:
    """The gateway over `upstream`, its connections watched, and one raw connection to it."""
    watch = _Watch()
    async with serving(config({"a": upstream}), watch) as port:
        client = await _Client.open(port)
        try:
            yield watch, client
        finally:
            client.close()


async def _answered(client: _Client, n: int, streaming: bool) -> None:
    status, headers, body = await client.response()
    _check(n, streaming, status, headers, body)
    assert (b"connection", b"close") not in headers  # the connection stays open


async def _served_not_idle(
    client: _Client, protocol: GatewayProtocol, upstream: _Upstream, n: int, streaming: bool
) -> None:
    """Request `n`, sent while `upstream` holds its answers (its gate clear), is served with
    no keep-alive timer running on its connection, which is idle once it is answered."""
    async with asyncio.timeout(30):
        while not any(r.json["messages"][-1]["content"] == f"ask {n}" for r in upstream.requests):
            await upstream.wait_for_requests(len(upstream.requests) + 1)
    assert protocol.timeout_keep_alive_task is None  # serving: not idle
    upstream.gate.set()
    await _answered(client, n, streaming)
    assert protocol.timeout_keep_alive_task is not None  # idle again


async def test_a_head_and_its_body_in_separate_reads_on_a_reused_connection(
    upstream: _Upstream, streaming: bool
) -> None:
    async with connected(upstream) as (watch, client):
        for n in (1, 2, 3, 4):  # each on the connection the last left idle
            request = _request(n, streaming)
            head, body = request.split(b"\r\n\r\n", 1)
            client.writer.write(head + b"\r\n\r\n")
            await watch.wait_heads(n)  # the gateway read the head alone
            client.writer.write(body)
            await _answered(client, n, streaming)
    assert len(watch.protocols) == 1
    assert upstream.count() == 4


async def test_a_pipelined_request_is_answered_after_the_first(
    upstream: _Upstream, streaming: bool
) -> None:
    async with connected(upstream) as (watch, client):
        client.writer.write(_request(1, streaming))
        await _answered(client, 1, streaming)
        # Two requests in one write on the reused connection: answered in order.
        client.writer.write(_request(2, streaming) + _request(3, streaming))
        await _answered(client, 2, streaming)
        await _answered(client, 3, streaming)
        client.writer.write(_request(4, streaming))
        await _answered(client, 4, streaming)
    assert len(watch.protocols) == 1
    assert [_number(r.json["messages"][-1]["content"]) for r in upstream.requests] == [1, 2, 3, 4]


async def test_a_pipelined_request_whose_body_comes_later_is_not_taken_for_idle(
    upstream: _Upstream, streaming: bool
) -> None:
    # A second request pipelined behind the first, its body not sent yet. While the first
    # is served, the second waits unread: its body deadline (which would answer 408 into
    # the first answer) starts only when it does. When the first answer ends, the second
    # request starts; its answer has not (it is not answered early), so once its body
    # arrives no keep-alive timer runs while it is served.
    async with connected(upstream) as (watch, client):
        head, body = _request(2, streaming).split(b"\r\n\r\n", 1)
        upstream.gate.clear()
        client.writer.write(_request(1, streaming) + head + b"\r\n\r\n")
        await watch.wait_heads(2)
        (protocol,) = watch.protocols
        assert protocol._deadline is None  # no deadline runs for the waiting request
        upstream.gate.set()
        await _answered(client, 1, streaming)
        assert protocol._deadline is not None  # its body deadline, from its start
        upstream.gate.clear()  # the next answer waits
        client.writer.write(body)
        await _served_not_idle(client, protocol, upstream, 2, streaming)


async def test_the_rest_of_a_refused_body_and_the_next_request_in_one_read(
    upstream: _Upstream, streaming: bool
) -> None:
    # A refusal (415) answered before its body arrived keeps the connection; the rest of
    # that body and the next request then come in one read. The next request is served,
    # and no keep-alive timer runs while it is (one armed as the refused body ended would
    # end the connection under the answer once it fired).
    async with connected(upstream) as (watch, client):
        refused = _request(1, streaming, content_type=b"text/plain")
        head, body = refused.split(b"\r\n\r\n", 1)
        client.writer.write(head + b"\r\n\r\n")
        status, headers, _ = await client.response()
        assert status == 415
        assert (b"connection", b"close") not in headers
        upstream.gate.clear()  # the next answer waits
        client.writer.write(body + _request(2, streaming))
        (protocol,) = watch.protocols
        await _served_not_idle(client, protocol, upstream, 2, streaming)


async def test_a_request_arriving_as_the_keep_alive_timer_ends_the_connection(
    upstream: _Upstream, streaming: bool
) -> None:
    # The inherent race of keep-alive: the client sends a request on an idle connection
    # just as the server ends it. The gateway reads that request for nothing and the client
    # reads the end of the connection (no answer: it knows the request was not served and
    # may send it again), never a reset, which would be all it sees.
    async with connected(upstream) as (watch, client):
        client.writer.write(_request(1, streaming))
        await _answered(client, 1, streaming)
        (protocol,) = watch.protocols
        timer = protocol.timeout_keep_alive_task
        assert timer is not None
        # The request reaches the gateway's socket (loopback: at once) before its loop
        # reads it; the timer fires first.
        client.writer.write(_request(2, streaming))
        timer.cancel()
        protocol.timeout_keep_alive_handler()
        assert await client.until_closed() == b""
        # A new connection is served.
        fresh = await _Client.open(client.port)
        try:
            fresh.writer.write(_request(4, streaming))
            await _answered(fresh, 4, streaming)
        finally:
            fresh.close()
    assert [_number(r.json["messages"][-1]["content"]) for r in upstream.requests] == [1, 4]


async def test_an_idle_connection_closed_to_make_room_ends_once(
    upstream: _Upstream, streaming: bool
) -> None:
    # One connection allowed: a second one makes the first, idle, end (it lingers, reading
    # for nothing, until its client closes). Its keep-alive timer stops: firing during the
    # linger, it would end the connection a second time (and count it twice as lingering).
    watch = _Watch()
    async with serving(config({"a": upstream}, gateway={"max_connections": 1}), watch) as port:
        first = await _Client.open(port)
        try:
            first.writer.write(_request(1, streaming))
            await _answered(first, 1, streaming)
            second = await _Client.open(port)
            try:
                second.writer.write(_request(2, streaming))
                await _answered(second, 2, streaming)
            finally:
                second.close()
            assert await first.until_closed() == b""  # ended without a word, no reset
            assert watch.protocols[0].timeout_keep_alive_task is None
        finally:
            first.close()


# -- the client's pool ----------------------------------------------------------------------


async def test_httpx_pool_loses_an_answer_closing_a_connection_it_handed_to_a_request(
    upstream: _Upstream, streaming: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # encode/httpcore#1110, as the gateway's chaos test met it: httpx's pool (httpcore
    # 1.0.9) hands an idle connection to a request; before the request starts on it,
    # another request's pass over the pool picks that connection to close (expired, here;
    # surplus to `max_keepalive_connections`, in the chaos test), and closes it once the
    # request went out on it: the gateway got the request and answers, the client raises
    # ReadError from its own ClosedResourceError. The pass closes what it picked one by
    # one, yielding between them (the picked connection was the 21st here); a busy loop
    # (1,000 requests in flight) lets the request go out meanwhile. Here the close waits
    # for it to have gone out, which makes the order certain.
    clock = [1000.0]  # httpcore's idea of the time, to expire idle connections at will
    monkeypatch.setattr(
        httpcore._async.http11, "time", types.SimpleNamespace(monotonic=lambda: clock[0])
    )
    pool = httpcore.AsyncConnectionPool
    close = pool._close_connections
    picked: list[list[Any]] = []

    async def close_once_the_request_went_out(self: Any, closing: list[Any]) -> None:
        if closing and not picked:
            picked.append(list(closing))
            async with asyncio.timeout(30):
                await upstream.wait_for_requests(2)  # the gateway got the request
        await close(self, closing)

    monkeypatch.setattr(pool, "_close_connections", close_once_the_request_went_out)
    watch = _Watch()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=5)
    async with (
        FakeOpenAIServer() as other,
        serving(config({"a": upstream}), watch) as port,
        httpx.AsyncClient(limits=limits, timeout=30) as http,
    ):
        gateway = f"http://127.0.0.1:{port}{PATH}"
        # Idle connections to another origin, first in the pool; then one to the gateway.
        await asyncio.gather(
            *(http.post(other.origin + PATH, content=_body(1, False)) for _ in range(20))
        )
        response = await http.post(gateway, content=_body(1, streaming))
        _check(1, streaming, response.status_code, response.headers.raw, response.content)
        connections = http._transport._pool.connections  # type: ignore[attr-defined]
        (handed,) = [c for c in connections if str(port) in c.info()]
        upstream.gate.clear()  # the gateway's answer waits until the client failed
        lost = asyncio.create_task(http.post(gateway, content=_body(2, streaming)))
        await asyncio.sleep(0)  # one turn: the request is handed the idle connection
        clock[0] += 10  # every idle connection has expired
        closing = asyncio.create_task(http.post(other.origin + PATH, content=_body(4, False)))
        (outcome,) = await asyncio.gather(lost, return_exceptions=True)
        upstream.gate.set()
        assert (await closing).status_code == 200
    assert handed in picked[0]  # picked to close, after it was handed to a request
    # Once httpcore keeps a connection it handed out, this fails: a bounded httpx pool is
    # then safe under bursts (say so in docs/gateway/operations.md).
    assert isinstance(outcome, httpx.ReadError), outcome
    causes = []
    error: BaseException | None = outcome
    while error is not None:
        causes.append(type(error))
        error = error.__cause__ or error.__context__
    assert anyio.ClosedResourceError in causes  # the client closed its own connection
    assert upstream.count() == 2  # and the gateway had its request
