"""Hostile and slow clients against the gateway on a real uvicorn server: bodies that are
not UTF-8 JSON or nest too deep, slow heads and bodies, idle connections, and clients that
would take every slot. Raw sockets play the slow clients; the SDK or httpx the others."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.pipeline.gateway.conftest import Running, config, running

pytestmark = pytest.mark.gateway

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
BODY = {"model": "pipeline", "messages": MESSAGES}
CHAT = "/v1/chat/completions"
WITHIN = 30  # seconds: the bound on waiting for what the server does next


class Raw:
    """One raw HTTP/1.1 connection to the gateway."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self) -> tuple[int, dict[str, str], bytes]:
        """The next response: status, headers, body (by Content-Length)."""
        async with asyncio.timeout(WITHIN):
            status = int((await self.reader.readline()).split(b" ", 2)[1])
            headers: dict[str, str] = {}
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return status, headers, body

    async def closed(self) -> bytes:
        """Whatever the server still sends, once it closed the connection."""
        async with asyncio.timeout(WITHIN):
            return await self.reader.read()

    def close(self) -> None:
        self.writer.close()


@contextlib.asynccontextmanager
async def connections(
    gateway: Running, count: int, local: str = "127.0.0.1"
) -> AsyncIterator[list[Raw]]:
    port = int(gateway.url.rsplit(":", 1)[1])
    opened = []
    try:
        for _ in range(count):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(local, 0))
            opened.append(Raw(reader, writer))
        yield opened
    finally:
        for raw in opened:
            raw.close()


def head(length: int | None = None, *, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else ""
    return (
        f"POST {CHAT} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        f"{size}{extra}\r\n"
    ).encode()


def request(body: dict[str, Any] | None = None) -> bytes:
    data = json.dumps(body or BODY).encode()
    return head(len(data)) + data


# -- bodies ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "encoding", "status"),
    [
        ("text/plain", "utf-8", 415),
        ("application/x-www-form-urlencoded", "utf-8", 415),
        ("application/json; charset=utf-16", "utf-16", 415),
        ("application/json", "utf-16", 400),  # JSON in UTF-16 bytes: json.loads would take it
        ("application/json", "utf-16-le", 400),
        ("application/json", "utf-32", 400),
        ("application/json; charset=UTF-8", "utf-8", 200),
        ("application/vnd.example+json", "utf-8", 200),
        (None, "utf-8", 200),  # no Content-Type: taken as JSON
    ],
)
async def test_only_json_in_utf8_is_accepted(
    primary: FakeOpenAIServer,
    streaming: bool,
    content_type: str | None,
    encoding: str,
    status: int,
) -> None:
    body = json.dumps({**BODY, "stream": streaming}).encode(encoding)
    headers = {"content-type": content_type} if content_type else {}
    async with running(config({"primary": primary})) as gateway, httpx.AsyncClient() as http:
        response = await http.post(f"{gateway.url}{CHAT}", content=body, headers=headers)
    assert response.status_code == status, response.text
    if status != 200:
        error = response.json()["error"]
        assert error["code"] == ("unsupported_content_type" if status == 415 else "invalid_json")
        assert error["type"] == "invalid_request_error"
    assert primary.count() == (1 if status == 200 else 0)


def nested(depth: int) -> Any:
    value: Any = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}}
    return value


@pytest.mark.parametrize("where", ["tool-schema", "tool-call-arguments", "response-format"])
async def test_json_nested_deeper_than_the_bound_is_400_never_a_503(
    primary: FakeOpenAIServer, backup: FakeOpenAIServer, streaming: bool, where: str
) -> None:
    # Before, 500 levels behind a router were a RecursionError in the pipeline: a 503 with
    # Retry-After (a 500 streaming), so clients retried a request that could never succeed.
    deep = nested(350)  # 700 levels of objects, 15 kB: far under the body limit
    body: dict[str, Any] = {**BODY, "stream": streaming}
    if where == "tool-schema":
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    elif where == "tool-call-arguments":
        call = {"id": "c1", "type": "function", "function": {"name": "f"}}
        call["function"]["arguments"] = json.dumps(deep)  # type: ignore[index]
        body["messages"] = [
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ]
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": deep}}
    cfg = config({"primary": primary, "backup": backup})
    async with running(cfg) as gateway, httpx.AsyncClient() as http:
        response = await http.post(f"{gateway.url}{CHAT}", json=body)
        assert response.status_code == 400, response.text
        assert "retry-after" not in response.headers
        assert response.json()["error"]["code"] == "invalid_json" or where == "tool-call-arguments"
        # Shallow bodies full of brackets (in strings, or many siblings) are fine.
        brackets = {**BODY, "messages": [{"role": "user", "content": "[{" * 5000}]}
        siblings = {
            **BODY,
            "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)],
        }
        for fine in (
            brackets,
            siblings,
            {
                **BODY,
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": nested(30)}}
                ],
            },
        ):
            assert (await http.post(f"{gateway.url}{CHAT}", json=fine)).status_code == 200
    assert primary.count() == 3


# -- slots ---------------------------------------------------------------------------------------


async def test_slow_bodies_take_no_slot(primary: FakeOpenAIServer, streaming: bool) -> None:
    # A gateway without keys, two slots per client: before, four connections sending their
    # body slowly took every slot of every client, and each real request got 429.
    cfg = config({"primary": primary}, gateway={"max_concurrent_per_key": 2})
    data = json.dumps({**BODY, "stream": streaming}).encode()
    async with running(cfg) as gateway, connections(gateway, 4) as slow:
        for raw in slow:
            await raw.send(head(len(data)) + data[:10])  # the rest never comes
        client = gateway.client()
        for _ in range(3):
            response = await client.chat.completions.create(
                model="pipeline", messages=MESSAGES, stream=streaming
            )
            if streaming:
                assert [c async for c in response]  # type: ignore[union-attr]
        await client.close()
    assert primary.count() == 3


async def test_without_keys_each_client_address_has_its_own_slots(
    primary: FakeOpenAIServer,
) -> None:
    cfg = config({"primary": primary}, gateway={"max_concurrent_per_key": 1})
    primary.script(FakeResponse(hang=True))
    other = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    async with (
        running(cfg) as gateway,
        httpx.AsyncClient(base_url=gateway.url) as near,
        httpx.AsyncClient(base_url=gateway.url, transport=other) as far,
    ):
        busy = asyncio.create_task(far.post(CHAT, json=BODY))
        await primary.wait_for_requests(1)
        second = await far.post(CHAT, json=BODY)
        assert second.status_code == 429
        assert second.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert "client" in second.json()["error"]["message"]
        assert (await near.post(CHAT, json=BODY)).status_code == 200  # another client
        busy.cancel()
        with pytest.raises(asyncio.CancelledError):
            await busy


# -- deadlines -----------------------------------------------------------------------------------


async def test_a_body_that_does_not_arrive_in_time_is_408(primary: FakeOpenAIServer) -> None:
    cfg = config({"primary": primary}, gateway={"body_timeout": 0.3})
    data = json.dumps(BODY).encode()
    async with running(cfg) as gateway, connections(gateway, 1) as (raw,):
        await raw.send(head(len(data)) + data[:10])
        status, headers, body = await raw.response()
        assert status == 408 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert headers["x-request-id"].startswith("req_")
        assert await raw.closed() == b""
    assert primary.count() == 0


async def test_a_body_trickling_in_cannot_push_its_deadline_back(
    primary: FakeOpenAIServer,
) -> None:
    cfg = config({"primary": primary}, gateway={"body_timeout": 0.5})
    data = json.dumps(BODY).encode()
    async with running(cfg) as gateway, connections(gateway, 1) as (raw,):
        await raw.send(head(len(data)))

        async def trickle() -> None:
            for byte in data[:-1]:  # bounded: never the whole body
                await raw.send(bytes([byte]))
                await asyncio.sleep(0.05)  # the attacker's pace, not a wait for the server

        trickling = asyncio.create_task(trickle())
        status, _, _ = await raw.response()
        trickling.cancel()
        assert status == 408
        assert await raw.closed() == b""


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/com", b"POST / HTTP/1.1\r\nHost: x\r\n"])
async def test_a_head_that_does_not_arrive_in_time_ends_the_connection(
    primary: FakeOpenAIServer, sent: bytes
) -> None:
    cfg = config({"primary": primary}, gateway={"header_timeout": 0.3})
    async with running(cfg) as gateway, connections(gateway, 1) as (raw,):
        if sent:
            await raw.send(sent)
            status, headers, body = await raw.response()
            assert status == 408 and headers["connection"] == "close"
            assert json.loads(body)["error"]["code"] == "request_timeout"
        assert await raw.closed() == b""  # a silent connection is closed without a word


async def test_a_head_too_large_is_431(primary: FakeOpenAIServer) -> None:
    async with running(config({"primary": primary})) as gateway, connections(gateway, 1) as (raw,):
        await raw.send(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\n".encode())
        for index in range(20):  # 20 x 4 kB headers, past the 64 kB bound
            await raw.send(f"X-Filler-{index}: {'a' * 4096}\r\n".encode())
        status, _, body = await raw.response()
        assert status == 431
        assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"


async def test_a_refusal_before_the_body_still_reaches_the_client(
    primary: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The 401 goes out before the body is read; the connection is not closed under a
    # client still sending (which would reset it, losing the 401).
    monkeypatch.setenv("GATEWAY_TEST_KEYS", "key-1")
    cfg = config({"primary": primary}, gateway={"api_keys_env": "GATEWAY_TEST_KEYS"})
    data = json.dumps(BODY).encode()
    async with running(cfg) as gateway, connections(gateway, 1) as (raw,):
        await raw.send(head(len(data)) + data[:10])
        status, _, _ = await raw.response()
        assert status == 401
        await raw.send(data[10:])
        raw.writer.write_eof()
        assert await raw.closed() == b""


KEYED = "Authorization: Bearer key-1\r\n"


@pytest.mark.parametrize(
    ("status", "start", "keyed"),
    [
        (401, f"POST {CHAT} HTTP/1.1\r\nContent-Type: application/json\r\n", False),
        (405, f"PUT {CHAT} HTTP/1.1\r\nContent-Type: application/json\r\n", True),
        (415, f"POST {CHAT} HTTP/1.1\r\nContent-Type: text/plain\r\n", True),
    ],
    ids=["401", "405", "415"],
)
async def test_an_early_answer_reads_a_small_body_for_nothing_and_keeps_the_connection(
    primary: FakeOpenAIServer,
    monkeypatch: pytest.MonkeyPatch,
    status: int,
    start: str,
    keyed: bool,
) -> None:
    monkeypatch.setenv("GATEWAY_TEST_KEYS", "key-1")
    cfg = config({"primary": primary}, gateway={"api_keys_env": "GATEWAY_TEST_KEYS"})
    data = json.dumps(BODY).encode()
    early = f"{start}Host: gateway\r\n{KEYED if keyed else ''}Content-Length: {len(data)}\r\n\r\n"
    async with running(cfg) as gateway, connections(gateway, 1) as (raw,):
        await raw.send(early.encode() + data[:10])  # the body's rest is still to come
        answered, headers, _ = await raw.response()
        assert answered == status
        assert "close" not in headers.get("connection", "")  # it says the connection stays
        await raw.send(data[10:])
        # The next request on the same connection is answered.
        await raw.send(head(len(data), extra=KEYED) + data)
        assert (await raw.response())[0] == 200
    assert primary.count() == 1


@pytest.mark.parametrize("framing", ["large", "chunked", "expect-continue"])
async def test_an_early_answer_that_will_not_read_the_body_says_connection_close(
    primary: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch, framing: str
) -> None:
    monkeypatch.setenv("GATEWAY_TEST_KEYS", "key-1")
    cfg = config({"primary": primary}, gateway={"api_keys_env": "GATEWAY_TEST_KEYS"})
    if framing == "large":  # more still to come than is worth reading for nothing
        extra, first = "Content-Length: 5000000\r\n", b'{"model": "x", "pad": "'
    elif framing == "chunked":  # a length nobody knows
        extra, first = "Transfer-Encoding: chunked\r\n", b'5\r\n{"mod\r\n'
    else:  # waiting for 100 Continue, which a refusal never sends
        extra, first = "Content-Length: 100\r\nExpect: 100-continue\r\n", b""
    request_head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n{extra}\r\n"
    ).encode()
    async with running(cfg) as gateway, connections(gateway, 1) as (raw,):
        await raw.send(request_head + first)
        status, headers, body = await raw.response()
        assert status == 401 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
        if framing == "large":
            with contextlib.suppress(ConnectionError):
                await raw.send(b"x" * 100_000)  # still sending: read for nothing, no reset
        raw.writer.write_eof()
        assert await raw.closed() == b""


async def test_the_sdks_pooled_client_reuses_a_connection_after_an_early_answer(
    primary: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A body large enough to arrive after its head, so the 401 goes out before it is read:
    # the pooled connection the SDK reuses for its next request must answer it.
    monkeypatch.setenv("GATEWAY_TEST_KEYS", "key-1")
    cfg = config({"primary": primary}, gateway={"api_keys_env": "GATEWAY_TEST_KEYS"})
    big = [{"role": "user", "content": "x" * 600_000}]
    async with running(cfg) as gateway:
        # One connection in the pool: every request goes over the one the 401 came on.
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=1))
        wrong = gateway.client("key-2", http_client=http)
        right = gateway.client("key-1", http_client=http)
        for _ in range(3):
            with pytest.raises(openai.AuthenticationError):
                await wrong.chat.completions.create(model="pipeline", messages=big)
            answer = await right.chat.completions.create(model="pipeline", messages=MESSAGES)
            assert answer.choices[0].message.content
        await http.aclose()
    assert primary.count() == 3


# -- connections ---------------------------------------------------------------------------------


async def test_past_the_bound_the_connection_idle_the_longest_makes_room(
    primary: FakeOpenAIServer,
) -> None:
    cfg = config({"primary": primary}, gateway={"max_connections": 4})
    async with running(cfg) as gateway, connections(gateway, 4) as idle:
        await idle[0].send(request())
        assert (await idle[0].response())[0] == 200  # idle again, since after the others
        async with connections(gateway, 1) as (new,):
            await new.send(request())
            assert (await new.response())[0] == 200
        assert await idle[1].closed() == b""  # the oldest idle one, silent since it opened


async def test_past_the_bound_with_none_idle_a_new_connection_gets_503(
    primary: FakeOpenAIServer,
) -> None:
    cfg = config({"primary": primary}, gateway={"max_connections": 3, "retry_after": 4})
    async with running(cfg) as gateway, connections(gateway, 3) as busy:
        for raw in busy:
            await raw.send(b"POST / HTTP/1.1\r\n")  # heads on their way: not idle
        async with connections(gateway, 1) as (new,):
            status, headers, body = await new.response()
        assert status == 503
        assert headers["retry-after"] == "4" and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        for raw in busy:  # they can still send their requests
            await raw.send(b"Host: x\r\n\r\n")
            assert (await raw.response())[0] == 404


async def test_the_sdk_reads_the_503_past_the_bound_not_a_reset(
    primary: FakeOpenAIServer,
) -> None:
    # The refused connection shuts its sending side and reads what the client still sends:
    # closed at once, the client's request would meet a reset and the SDK lose the 503.
    cfg = config({"primary": primary}, gateway={"max_connections": 1})
    async with running(cfg) as gateway, connections(gateway, 1) as (busy,):
        await busy.send(b"POST / HTTP/1.1\r\n")
        client = gateway.client()
        for _ in range(3):
            with pytest.raises(openai.InternalServerError) as raised:
                await client.chat.completions.create(model="pipeline", messages=MESSAGES)
            assert raised.value.status_code == 503
            assert raised.value.code == "too_many_connections"
        await client.close()
    assert primary.count() == 0
