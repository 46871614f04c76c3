"""What each HTTP transport reads from its surroundings as httpx2 does (proxies and TLS
certificates from the environment), how its timeouts are read, how its errors classify, and
a client moving to a new event loop. Real servers on 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import base64
import enum
import json
import ssl
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import httpx2
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from pipeline.errors import (
    FailureKind,
    ProviderError,
    TransientProviderError,
    classify,
    retry_after_of,
)
from pipeline.providers import OpenAIChatClient
from pipeline.providers._aiohttp import client_timeout
from pipeline.providers._http import decode_json, encode_json
from pipeline.testing import FakeOpenAIServer, collect
from tests.compat.servers import ThreadedFakeServer

ANSWER = "Hello from the fake server."
_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")

# The tests that make requests run over both HTTP transports (`transport`, conftest.py).
both_transports = pytest.mark.usefixtures("transport")


@pytest.fixture(autouse=True)
def no_proxy_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the proxy variables it is about, and no others."""
    for name in _PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


@both_transports
async def test_the_proxy_from_the_environment_is_used_with_its_credentials(
    monkeypatch: pytest.MonkeyPatch, streaming: bool
) -> None:
    # The fake server answers a proxy's absolute-form request like any other, and records
    # the target it was asked for: the request went through the proxy.
    async with FakeOpenAIServer() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.origin.replace("http://", "http://who:CANARY@"))
        async with OpenAIChatClient("m", api_key="k", base_url="http://api.test/v1") as client:
            result = await collect(client, "hi", streaming=streaming)
    assert result.text == ANSWER
    [request] = proxy.requests
    assert request.path == "http://api.test/v1/chat/completions"
    assert request.headers["proxy-authorization"] == "Basic " + base64.b64encode(
        b"who:CANARY"
    ).decode("ascii")
    assert "CANARY" not in str(result.response)


@both_transports
async def test_no_proxy_exempts_a_host(monkeypatch: pytest.MonkeyPatch, streaming: bool) -> None:
    async with FakeOpenAIServer() as server, FakeOpenAIServer() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.origin)
        monkeypatch.setenv("NO_PROXY", "localhost")
        direct = f"http://localhost:{server.port}/v1"
        async with OpenAIChatClient("m", api_key="k", base_url=direct) as client:
            assert (await collect(client, "hi", streaming=streaming)).text == ANSWER
        async with OpenAIChatClient("m", api_key="k", base_url=server.base_url) as client:
            assert (await collect(client, "hi", streaming=streaming)).text == ANSWER
    assert (server.count(), len(proxy.requests)) == (1, 1)  # 127.0.0.1 is not exempt


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A test CA and a server certificate it signed for 127.0.0.1 (Debian's openssl)."""
    folder = tmp_path_factory.mktemp("tls")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (folder / "san").write_text("subjectAltName=IP:127.0.0.1\n")
    steps = [
        ["req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
         "-subj", "/CN=chat-pipeline test CA"],
        ["req", *key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "san"],
    ]  # fmt: skip
    for step in steps:
        subprocess.run(["openssl", *step], cwd=folder, check=True, capture_output=True)
    return {name: folder / name for name in ("ca.pem", "server.pem", "server.key")}


class TLSServer(FakeOpenAIServer):
    """The fake server behind TLS."""

    def __init__(self, certificate: Path, key: Path) -> None:
        super().__init__()
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(certificate, key)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.context)

    @property
    def base_url(self) -> str:
        return f"https://127.0.0.1:{self.port}/v1"


@pytest.fixture
async def tls_server(certificates: dict[str, Path]) -> AsyncIterator[TLSServer]:
    async with TLSServer(certificates["server.pem"], certificates["server.key"]) as server:
        yield server


@both_transports
async def test_tls_is_verified_against_ssl_cert_file(
    tls_server: TLSServer,
    certificates: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    streaming: bool,
) -> None:
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.setenv("SSL_CERT_FILE", str(certificates["ca.pem"]))
    async with OpenAIChatClient("m", api_key="k", base_url=tls_server.base_url) as client:
        assert (await collect(client, "hi", streaming=streaming)).text == ANSWER
    # The system's certificates do not know the test CA: a TLS failure, transient.
    monkeypatch.delenv("SSL_CERT_FILE")
    async with OpenAIChatClient("m", api_key="k", base_url=tls_server.base_url) as client:
        refused = await collect(client, "hi", streaming=streaming)
    assert isinstance(refused.error, TransientProviderError)
    assert classify(refused.error.__cause__) is FailureKind.TRANSIENT  # type: ignore[arg-type]
    assert tls_server.count() == 1


def test_an_aiohttp_client_moves_to_a_new_event_loop(streaming: bool) -> None:
    """A client built outside any loop serves from one loop, then from another (as
    separate ``asyncio.run`` calls do): an aiohttp session belongs to one loop, so the
    transport opens a new one."""
    server = ThreadedFakeServer()
    server.start()
    try:
        client = OpenAIChatClient("m", api_key="k", base_url=server.base_url, transport="aiohttp")
        for _ in range(2):
            assert asyncio.run(collect(client, "hi", streaming=streaming)).text == ANSWER
        asyncio.run(client.aclose())
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [
        (30.0, aiohttp.ClientTimeout(None, 60.0, 30.0, 30.0)),
        (httpx2.Timeout(60.0, connect=10.0), aiohttp.ClientTimeout(None, 70.0, 60.0, 10.0)),
        (httpx2.Timeout(5.0, pool=None), aiohttp.ClientTimeout(None, None, 5.0, 5.0)),
        (httpx2.Timeout(None), aiohttp.ClientTimeout(None, None, None, None)),
    ],
)
def test_timeouts_are_read_as_httpx2_reads_them(
    timeout: float | httpx2.Timeout, expected: aiohttp.ClientTimeout
) -> None:
    assert client_timeout(timeout) == expected


def _request_info() -> aiohttp.RequestInfo:
    url = aiohttp.client.URL("http://api.test")
    return aiohttp.RequestInfo(url, "POST", CIMultiDictProxy(CIMultiDict()), url)


def _aiohttp_failures() -> Iterator[tuple[BaseException, FailureKind]]:
    key = aiohttp.client_reqrep.ConnectionKey("api.test", 443, True, True, None, None, None, None)
    yield (
        aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "refused")),
        (FailureKind.TRANSIENT),
    )
    yield aiohttp.ClientConnectorDNSError(key, OSError(-2, "unknown")), FailureKind.TRANSIENT
    yield aiohttp.ServerDisconnectedError(), FailureKind.TRANSIENT
    yield aiohttp.SocketTimeoutError(), FailureKind.TRANSIENT
    yield aiohttp.ConnectionTimeoutError(), FailureKind.TRANSIENT
    yield aiohttp.ClientPayloadError("cut"), FailureKind.TRANSIENT
    yield aiohttp.ClientOSError(104, "reset"), FailureKind.TRANSIENT
    yield aiohttp.InvalidURL("nope"), FailureKind.UNKNOWN
    statuses = {
        429: FailureKind.RATE_LIMITED,
        503: FailureKind.TRANSIENT,
        400: FailureKind.REQUEST_INVALID,
        401: FailureKind.AUTHENTICATION,
    }
    for status, kind in statuses.items():
        yield aiohttp.ClientResponseError(_request_info(), (), status=status), kind


@pytest.mark.parametrize(("error", "kind"), list(_aiohttp_failures()), ids=repr)
def test_aiohttp_errors_classify_as_httpx2s_do(error: BaseException, kind: FailureKind) -> None:
    assert classify(error) is kind


def test_retry_after_of_an_aiohttp_status_error() -> None:
    info = _request_info()
    error = aiohttp.ClientResponseError(info, (), status=429, headers={"Retry-After": "3"})  # type: ignore[arg-type]
    assert retry_after_of(error) == 3.0
    assert retry_after_of(aiohttp.ClientResponseError(info, (), status=429)) is None


def test_bodies_decode_as_json_loads_decodes_them() -> None:
    for body in (b'{"a": 1}', b' {"a": "\xc3\xa9"}\n', '{"a": 1}'.encode("utf-16")):
        assert decode_json(body, "p") == json.loads(body)
    for bad in (b"", b"not json", b'{"a": 1} x', b"\xff\xfe\xff"):
        with pytest.raises(ProviderError, match="the body is not JSON"):
            decode_json(bad, "p")


def test_bodies_encode_as_the_strict_standard_library_encodes_them() -> None:
    class Text(str):
        pass

    strict = {"ensure_ascii": False, "separators": (",", ":"), "allow_nan": False}
    for body in (
        {"model": "m", "messages": [{"role": "user", "content": "h\u00e9llo"}], "t": 0.1},
        {"a": None, "b": [1, 2.5, True]},  # a null: written by the standard library
        {"big": 2**70, 1: "a key that is no string", "text": Text("x")},
    ):
        assert encode_json(body) == json.dumps(body, **strict).encode()  # type: ignore[arg-type]
    for bad in ({"t": float("nan")}, [float("inf")], {"a": "\ud800"}, {"d": object()}):
        with pytest.raises((TypeError, ValueError)):
            encode_json(bad)


def test_enums_and_uuids_encode_alike_whichever_encoder_writes_the_body() -> None:
    class Tier(enum.Enum):
        FLEX = "flex"

    class Seed(enum.IntEnum):
        ONE = 1

    ident = uuid.UUID(int=7)
    expected = b'"flex",1,"00000000-0000-0000-0000-000000000007"'
    # A body without a null may be written by orjson; one with a null is always written
    # by the standard library (which refuses NaN where orjson would write null).
    assert encode_json([Tier.FLEX, Seed.ONE, ident]) == b"[" + expected + b"]"
    assert encode_json([Tier.FLEX, Seed.ONE, ident, None]) == b"[" + expected + b",null]"


@pytest.mark.parametrize("name", [None, "aiohttp", "httpx2"])
async def test_a_route_names_its_transport_in_toml(name: str | None) -> None:
    from pipeline.config import parse_config
    from pipeline.providers import _http

    route = {"provider": "anthropic", "model": "m", "base_url": "http://127.0.0.1:1"}
    if name is not None:
        route["transport"] = name
    config = parse_config({"routes": {"a": route}})
    async with config.build_route("a").client as client:
        assert client.transport == (name or _http.DEFAULT_TRANSPORT)


# -- the read timeout of the aiohttp transport --------------------------------------------------


class _StallingServer:
    """Answers every request with a head and the start of a body, then sends `pieces` more
    bytes `pace` seconds apart (the server's pace, not a wait for a state), then closes the
    connection when `finish`, else sends nothing more until the test ends."""

    def __init__(
        self, streaming: bool, *, pieces: int = 0, pace: float = 0.0, finish: bool = False
    ) -> None:
        self.streaming = streaming
        self.pieces = pieces
        self.pace = pace
        self.finish = finish
        self.done = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._answer, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def __aexit__(self, *exc: object) -> None:
        self.done.set()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        if self.streaming:
            event = b'data: {"id": "c", "choices": []}\n\n'
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(event), event)
            )
        else:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: 4096\r\n\r\n{"
            )
        for _ in range(self.pieces):  # bounded
            await writer.drain()
            await asyncio.sleep(self.pace)
            writer.write(b":\n\n" if self.streaming else b" ")
        await writer.drain()
        if not self.finish:
            await self.done.wait()
        writer.close()


async def test_an_aiohttp_answer_whose_body_stalls_ends_at_the_read_timeout(
    streaming: bool,
) -> None:
    async with (
        _StallingServer(streaming) as url,
        OpenAIChatClient("m", api_key="k", base_url=url, timeout=0.2, transport="aiohttp") as c,
    ):
        result = await collect(c, "hi", streaming=streaming)
    assert isinstance(result.error, TransientProviderError)
    assert isinstance(result.error.__cause__, aiohttp.SocketTimeoutError)
    assert str(result.error).endswith("transport failure: SocketTimeoutError")


async def test_an_aiohttp_whole_answer_that_keeps_coming_is_read_past_its_timeout() -> None:
    # 25 bytes a tenth of a second apart: 2.5 s of body, no gap near the 1.5 s timeout. The
    # answer ends short of its length when the server closes: cut by the server, not by the
    # timeout.
    server = _StallingServer(False, pieces=25, pace=0.1, finish=True)
    async with (
        server as url,
        OpenAIChatClient("m", api_key="k", base_url=url, timeout=1.5, transport="aiohttp") as c,
    ):
        result = await collect(c, "hi", streaming=False)
    assert isinstance(result.error, TransientProviderError)
    assert isinstance(result.error.__cause__, aiohttp.ClientPayloadError)
