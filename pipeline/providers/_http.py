"""HTTP plumbing shared by the providers: the transports, errors from statuses and
transport failures, deadlines and URLs.

A provider client talks HTTP through a `Transport`: `Httpx2Transport` (an
``httpx2.AsyncClient``) or `AiohttpTransport` (an ``aiohttp.ClientSession``, in
`pipeline.providers._aiohttp`), picked by `pipeline.providers._transports.make_transport`.
Either one gives the same answers to the client: JSON bodies, a stream's body chunk by
chunk, `ProviderError`s for error statuses, and its own failures as `Transport.errors`
(which `transport_error` turns into a transient `ProviderError`). Reading server-sent events
is `pipeline.wire.sse`'s.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, Literal, Protocol, TypeAlias, get_args

import httpx2
from opentelemetry.propagate import inject
from opentelemetry.trace import get_current_span

from pipeline._json_codec import dumps_strict, loads
from pipeline.errors import FailureKind, ProviderError, parse_retry_after, provider_error
from pipeline.wire import error_from_payload, malformed

__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "DEFAULT_TIMEOUT",
    "DEFAULT_TRANSPORT",
    "Httpx2Transport",
    "StreamBody",
    "Transport",
    "TransportName",
    "Deadline",
    "StatusError",
    "basic_auth",
    "bounded_body",
    "capped_body",
    "decode_json",
    "drain",
    "encode_json",
    "endpoint",
    "positive_bytes",
    "positive_or_none",
    "service_url",
    "status_error",
    "status_error_of",
    "too_large",
    "traced",
    "transport_error",
]

TransportName: TypeAlias = Literal["aiohttp", "httpx2"]
TRANSPORTS: tuple[TransportName, ...] = get_args(TransportName)

# aiohttp: in `bench_peers.py` a raw aiohttp call costs a fraction of a raw httpx2 call's
# client CPU (see README's "Against the peers"), and the pipeline's calls cost that much.
DEFAULT_TRANSPORT: TransportName = "aiohttp"

DEFAULT_TIMEOUT = httpx2.Timeout(60.0, connect=10.0)
# Every connection the pool may open is kept alive when idle. httpx2's default keeps 20 of
# its 100, so concurrency above 20 closes and reopens connections on every burst: at 32
# concurrent streams that churn was most of the pipeline's extra CPU over a raw client.
# (aiohttp's pool keeps every idle connection; its limit is the same 100.)
DEFAULT_LIMITS = httpx2.Limits(max_connections=100, max_keepalive_connections=100)
_MAX_ERROR_BODY = 64 * 1024
# A non-streamed answer's decoded body: far above any chat response's, and a bound on what a
# decompression bomb can make this process hold.
DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
_MAX_DRAINED_CHUNKS = 100

Read: TypeAlias = Callable[[], Awaitable[bytes]]

StatusError: TypeAlias = Callable[[int, Mapping[str, str], bytes, str, str], ProviderError]
"""How a transport turns an error status into its `ProviderError`: (status, response
headers, the body's first bytes, provider, endpoint). `status_error_of` reads the body's
``error`` object and ``Retry-After``; an API whose errors say more in headers reads those."""


# -- URLs -------------------------------------------------------------------------------------


def endpoint(url: httpx2.URL | str) -> str:
    """The URL as we store, print and record it: without its query string (which may carry
    keys on some gateways) and without user info (which may carry a password)."""
    return str(httpx2.URL(str(url)).copy_with(query=None, username=None, password=None))


def service_url(base_url: object, what: str = "base_url") -> tuple[httpx2.URL, str | None]:
    """`base_url` parsed and without user info, and the ``Authorization: Basic`` value its
    user info stood for (or None). Credentials never stay in a URL we keep: the HTTP
    client logs request URLs, and errors, reprs and spans name the endpoint.

    Raises `ValueError` for a URL that does not parse or is not http(s) with a host.
    """
    if not isinstance(base_url, str):
        raise TypeError(f"{what} must be a string, not {type(base_url).__name__}")
    try:
        url = httpx2.URL(base_url.rstrip("/") + "/")
    except (httpx2.InvalidURL, ValueError, TypeError):
        raise ValueError(f"{what} is not a valid URL") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"{what} must be an http(s) URL with a host")
    basic = None
    if url.username or url.password:
        basic = basic_auth(url.username, url.password)
        url = url.copy_with(username=None, password=None)
    return url, basic


def basic_auth(username: str, password: str) -> str:
    """The value of a Basic ``Authorization`` (or ``Proxy-Authorization``) header."""
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


def positive_or_none(value: float | None, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds or None")
    return float(value)


def traced(headers: dict[str, str]) -> dict[str, str]:
    """`headers` plus the current trace context (W3C ``traceparent``, through the globally
    configured OpenTelemetry propagators) when a valid span is current; else `headers`."""
    # The check alone costs a quarter of the propagators' work, which finds nothing to add.
    if not get_current_span().get_span_context().is_valid:
        return headers
    carrier: dict[str, str] = {}
    inject(carrier)
    return {**headers, **carrier} if carrier else headers


# -- errors -----------------------------------------------------------------------------------


def transport_error(exc: BaseException, provider: str, url: str) -> ProviderError:
    """Timeouts, refused or reset connections, TLS and DNS failures and broken HTTP are
    transient (the exception, of the transport's own `Transport.errors`, is named by type
    only: its message may quote the URL)."""
    return provider_error(
        FailureKind.TRANSIENT,
        f"transport failure: {type(exc).__name__}",
        provider=provider,
        url=url,
    )


def status_error(
    status: int, retry_after: str | None, body: bytes, provider: str, url: str
) -> ProviderError:
    """The `ProviderError` for an HTTP error status, with `retry_after` (``Retry-After``,
    else a Google error's ``RetryInfo``) and the error code.

    The body is read only for its machine-readable ``error.code``/``error.type`` (the shape
    of the Chat Completions and the Anthropic Messages APIs) or ``error.status`` and
    ``error.details`` (Google's).
    """
    error: Any = None
    try:
        decoded = json.loads(body) if body else None
    except ValueError:
        decoded = None
    if isinstance(decoded, dict):
        error = decoded.get("error")
    result = error_from_payload(error, provider, status_code=status, url=url)
    header = parse_retry_after(retry_after)
    if header is not None or result.retry_after is None:
        result.retry_after = header  # the header, else what the body said (Google's)
    return result


def status_error_of(
    status: int, headers: Mapping[str, str], body: bytes, provider: str, url: str
) -> ProviderError:
    """`status_error` of a response: its ``Retry-After`` and body (the default `StatusError`)."""
    return status_error(status, headers.get("retry-after"), body, provider, url)


async def bounded_body(read: Read, errors: tuple[type[Exception], ...]) -> bytes:
    """An error response's body, read up to a bound (a failure to read it leaves what was
    read: the status alone still classifies the failure)."""
    body = b""
    with contextlib.suppress(*errors):
        while len(body) <= _MAX_ERROR_BODY:
            chunk = await read()
            if not chunk:
                break
            body += chunk
    return body


async def capped_body(read: Read, limit: int, provider: str, url: str, first: bytes = b"") -> bytes:
    """A response's whole body, decoded (the transport decompresses it chunk by chunk, each
    chunk bounded), failing with a `ProviderError` (code ``response_too_large``) as soon as
    it passes `limit` bytes: never more than `limit` and one chunk are held. `first` is what
    the caller already read of it."""
    if len(first) > limit:
        raise too_large(limit, provider, url)
    body = bytearray(first)
    while True:
        chunk = await read()
        if not chunk:
            return bytes(body)
        if len(body) + len(chunk) > limit:
            raise too_large(limit, provider, url)
        body += chunk


def too_large(limit: int, provider: str, url: str) -> ProviderError:
    """The failure of a response body larger than `limit` bytes."""
    return provider_error(
        FailureKind.UNKNOWN,
        f"the response body is larger than {limit} bytes",
        provider=provider,
        code="response_too_large",
        url=url,
    )


def positive_bytes(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int (bytes)")
    return value


def decode_json(body: bytes, provider: str) -> Any:
    """A response body's JSON (UTF-8, or UTF-16/32 as `json.loads` detects them)."""
    try:
        return loads(body)
    except ValueError:
        raise malformed(provider, "the body is not JSON") from None


encode_json = dumps_strict
"""`body` as compact UTF-8 JSON for a request (`pipeline._json_codec.dumps_strict`)."""


# -- deadlines --------------------------------------------------------------------------------


class Deadline:
    """Bound the ``async with`` block to `seconds` (None: unbounded); overrunning is a
    transient failure. A `TimeoutError` the block raises itself (a transport's own timeout)
    is not ours and passes through. (A class, not a generator: it is entered on every
    stream, and unbounded it costs two calls.)"""

    __slots__ = ("_provider", "_seconds", "_timeout", "_what")

    def __init__(self, seconds: float | None, provider: str, what: str) -> None:
        self._seconds = seconds
        self._provider = provider
        self._what = what
        self._timeout: asyncio.Timeout | None = None

    async def __aenter__(self) -> None:
        if self._seconds is not None:
            self._timeout = asyncio.timeout(self._seconds)
            await self._timeout.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        timeout = self._timeout
        if timeout is None:
            return
        try:
            await timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            if not timeout.expired():
                raise
            raise provider_error(
                FailureKind.TRANSIENT,
                f"no {self._what} within {self._seconds:g} s",
                provider=self._provider,
                code="stream_timeout",
            ) from None


async def drain(read: Read) -> None:
    """Read a complete stream's body to its end (normally just the chunked terminator), so
    the connection goes back to the pool instead of being closed half-read (bounded)."""
    for _ in range(_MAX_DRAINED_CHUNKS):
        if not await read():
            return


# -- transports -------------------------------------------------------------------------------


class StreamBody(Protocol):
    """An open streamed response (status below 400)."""

    async def read(self) -> bytes:
        """The body's next chunk as it arrives; ``b""`` at its end."""

    async def aclose(self) -> None:
        """Release the response: its connection goes back to the pool if the body was read
        to its end, and is closed otherwise."""


class Transport(Protocol):
    """How a provider client makes its HTTP calls. Every failure of the transport itself
    is one of `errors`; error statuses are `ProviderError`s already."""

    name: TransportName
    errors: tuple[type[Exception], ...]
    status_error: StatusError

    @property
    def timeout(self) -> httpx2.Timeout:
        """The timeouts of its calls, as httpx2 reads them."""

    def target(self, url: httpx2.URL) -> Any:
        """`url` in the form `post_json` and `open_stream` take (built once per client)."""

    async def post_json(
        self, target: Any, body: bytes, headers: dict[str, str], provider: str, where: str
    ) -> Any:
        """POST `body` (JSON bytes; `headers` name the content type) and return the decoded
        JSON answer; an error status or a body that is not JSON is a `ProviderError`."""

    async def open_stream(
        self, target: Any, body: bytes, headers: dict[str, str], provider: str, where: str
    ) -> StreamBody:
        """POST `body` and return the response once its head arrived; an error status is a
        `ProviderError` (the response released)."""

    async def aclose(self) -> None:
        """Close the HTTP client if the transport made it (a given one is left open)."""


class Httpx2Transport:
    """Calls through an ``httpx2.AsyncClient``: the client's own (a pool of 100
    connections, every one kept alive when idle) or one the caller gave."""

    __slots__ = ("_owned", "http", "max_response_bytes", "status_error")

    name: TransportName = "httpx2"
    errors: tuple[type[Exception], ...] = (httpx2.HTTPError,)

    def __init__(
        self,
        http: httpx2.AsyncClient,
        *,
        owned: bool,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        status_error: StatusError = status_error_of,
    ) -> None:
        self.http = http
        self._owned = owned
        self.max_response_bytes = max_response_bytes
        self.status_error = status_error

    @property
    def timeout(self) -> httpx2.Timeout:
        return self.http.timeout

    def target(self, url: httpx2.URL) -> httpx2.URL:
        return url

    async def post_json(
        self, target: Any, body: bytes, headers: dict[str, str], provider: str, where: str
    ) -> Any:
        # Streamed, so the body is read (and decompressed) a bounded chunk at a time and the
        # size bound holds while it arrives; `open_stream` turns an error status into its
        # `ProviderError`.
        try:
            stream = await self.open_stream(target, body, headers, provider, where)
            try:
                data = await capped_body(stream.read, self.max_response_bytes, provider, where)
            finally:
                await stream.aclose()
        except httpx2.HTTPError as exc:
            raise transport_error(exc, provider, where) from exc
        return decode_json(data, provider)

    async def open_stream(
        self, target: Any, body: bytes, headers: dict[str, str], provider: str, where: str
    ) -> _Httpx2Stream:
        manager = self.http.stream("POST", target, content=body, headers=headers)
        response = await manager.__aenter__()
        stream = _Httpx2Stream(manager, response)
        if response.status_code >= 400:
            try:
                error_body = await bounded_body(stream.read, self.errors)
            finally:
                await stream.aclose()
            raise self.status_error(
                response.status_code, response.headers, error_body, provider, where
            )
        return stream

    async def aclose(self) -> None:
        if self._owned:
            await self.http.aclose()


class _Httpx2Stream:
    __slots__ = ("_chunks", "_manager")

    def __init__(
        self,
        manager: contextlib.AbstractAsyncContextManager[httpx2.Response],
        response: httpx2.Response,
    ) -> None:
        self._manager = manager
        self._chunks = response.aiter_bytes()

    async def read(self) -> bytes:
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            return b""

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            await self._manager.__aexit__(None, None, None)
