"""HTTP plumbing shared by the providers: errors from statuses and transports, deadlines,
and server-sent event streams decoded to JSON payloads."""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import json
import json.scanner
import re
from collections.abc import AsyncIterator
from typing import Any, cast

import httpx2

from pipeline.errors import FailureKind, ProviderError, parse_retry_after, provider_error
from pipeline.providers._sse import MalformedSSE, SSEDecoder
from pipeline.providers._wire import error_from_payload, malformed

__all__ = [
    "Utf8Lines",
    "encode_json",
    "service_url",
    "DEFAULT_LIMITS",
    "DEFAULT_TIMEOUT",
    "deadline",
    "endpoint",
    "positive_or_none",
    "post_json",
    "SSEPayloads",
    "drain",
    "next_payloads",
    "status_error",
    "transport_error",
]

DEFAULT_TIMEOUT = httpx2.Timeout(60.0, connect=10.0)
# Every connection the pool may open is kept alive when idle. httpx2's default keeps 20 of
# its 100, so concurrency above 20 closes and reopens connections on every burst: at 32
# concurrent streams that churn was most of the pipeline's extra CPU over a raw client.
DEFAULT_LIMITS = httpx2.Limits(max_connections=100, max_keepalive_connections=100)
_MAX_ERROR_BODY = 64 * 1024
_MAX_DRAINED_CHUNKS = 100


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
        token = base64.b64encode(f"{url.username}:{url.password}".encode()).decode()
        basic = f"Basic {token}"
        url = url.copy_with(username=None, password=None)
    return url, basic


def positive_or_none(value: float | None, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds or None")
    return float(value)


def transport_error(exc: httpx2.HTTPError, provider: str, url: str) -> ProviderError:
    """Timeouts, refused or reset connections and broken HTTP are transient."""
    return provider_error(
        FailureKind.TRANSIENT,
        f"transport failure: {type(exc).__name__}",
        provider=provider,
        url=url,
    )


async def status_error(response: httpx2.Response, provider: str, url: str) -> ProviderError:
    """The `ProviderError` for an HTTP error status, with `retry_after` and the error code.

    The body is read (bounded) only for its machine-readable ``error.code``/``error.type``
    (the shape of both the Chat Completions and the Anthropic Messages APIs).
    """
    body = b""
    try:
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > _MAX_ERROR_BODY:
                break
    except httpx2.HTTPError:
        pass  # the status alone still classifies the failure
    error: Any = None
    try:
        decoded = json.loads(body) if body else None
    except ValueError:
        decoded = None
    if isinstance(decoded, dict):
        error = decoded.get("error")
    result = error_from_payload(error, provider, status_code=response.status_code, url=url)
    result.retry_after = parse_retry_after(response.headers.get("retry-after"))
    return result


def encode_json(body: Any) -> bytes:
    """`body` as compact UTF-8 JSON; `TypeError`/`ValueError` for what JSON cannot hold
    (other objects, NaN and infinities, lone surrogates)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


async def post_json(
    http: httpx2.AsyncClient,
    url: httpx2.URL,
    body: bytes,
    headers: dict[str, str],
    *,
    provider: str,
    where: str,
) -> Any:
    """POST `body` (JSON bytes; `headers` name the content type) and return the decoded JSON
    answer; every failure is a `ProviderError`."""
    try:
        response = await http.post(url, content=body, headers=headers)
        if response.status_code >= 400:
            raise await status_error(response, provider, where)
        try:
            return response.json()
        except ValueError:
            raise malformed(provider, "the body is not JSON") from None
    except httpx2.HTTPError as exc:
        raise transport_error(exc, provider, where) from exc


@contextlib.asynccontextmanager
async def deadline(seconds: float | None, provider: str, what: str) -> AsyncIterator[None]:
    """Bound the block to `seconds` (None: unbounded); overrunning is a transient failure."""
    if seconds is None:
        yield
        return
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise provider_error(
            FailureKind.TRANSIENT,
            f"no {what} within {seconds:g} s",
            provider=provider,
            code="stream_timeout",
        ) from None


_LINE_END = re.compile(r"\r\n|\r|\n")


class Utf8Lines:
    """Splits a byte stream into lines (``\r\n``, ``\n`` or ``\r``), decoded as UTF-8
    whatever charset the response declared: server-sent events are UTF-8 by definition, and
    a declared ``base64`` or ``utf-16`` must not pick our decoder. Bytes that are not UTF-8
    are a `ProviderError` (``malformed``). Synchronous, so reading a stream costs no extra
    generator step per line."""

    __slots__ = ("_decoder", "_pending", "_provider", "_split_character")

    def __init__(self, provider: str) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._split_character = False
        self._pending = ""
        self._provider = provider

    def feed(self, chunk: bytes) -> list[str]:
        """The lines `chunk` completes (the rest waits for the next chunk)."""
        if self._split_character:
            text = self._decode(chunk)
        else:
            try:
                text = chunk.decode()
            except UnicodeDecodeError:
                # A character split across chunks (the incremental decoder keeps its first
                # half for the next chunk), or bytes that are not UTF-8.
                text = self._decode(chunk)
        text = self._pending + text
        carry = ""
        if text.endswith("\r"):
            # A CR may be the first half of a CRLF that the next chunk completes.
            text, carry = text[:-1], "\r"
        # str.split is several times cheaper than the regex, and servers send LF only.
        lines = _LINE_END.split(text) if "\r" in text else text.split("\n")
        self._pending = lines.pop() + carry
        return lines

    def _decode(self, chunk: bytes) -> str:
        try:
            text = self._decoder.decode(chunk)
        except UnicodeDecodeError:
            raise malformed(self._provider, "the stream is not UTF-8 text") from None
        self._split_character = bool(self._decoder.getstate()[0])
        return text

    def finish(self) -> list[str]:
        """The last, unterminated line (if any), once the stream ended."""
        try:
            tail = self._pending + self._decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise malformed(self._provider, "the stream is not UTF-8 text") from None
        self._pending = ""
        return [line for line in _LINE_END.split(tail) if line]


# The C scanner behind json.loads, called directly: json.loads spends three Python calls
# and two regex matches around it, for every chunk of every stream.
# (typeshed types the scanner's context as a scanner; any decoder's settings will do.)
_scan_json = json.scanner.make_scanner(cast(Any, json.JSONDecoder()))


def _loads(data: str) -> Any:
    try:
        value, end = _scan_json(data, 0)
    except StopIteration:
        return json.loads(data)  # leading whitespace, or not JSON: json.loads decides
    if end != len(data) and data[end:].strip():
        raise ValueError("extra data after the JSON value")
    return value


class SSEPayloads:
    """The decoded JSON payloads of a server-sent event byte stream, fed chunk by chunk.

    `feed(chunk)` returns the payloads the chunk completes, and `finish()` those the body's
    end completes. Once the stream says it is complete, `done` is set and nothing more is
    returned: a ``[DONE]`` data line (Chat Completions) or a payload whose ``type`` is
    `end_type` (``message_stop`` in the Messages API; that payload is not returned). An
    ``error`` event is its `ProviderError`; malformed SSE, JSON or UTF-8 is one of kind
    `UNKNOWN` (code ``malformed``). A failure never costs the payloads before it: when a
    chunk completes some, they are returned and the failure is kept in `failure` (the
    reader raises it once it has passed them on), and the next `feed` or `finish` raises
    it. Synchronous, so a stream reader pays no generator step per chunk for it.
    """

    __slots__ = ("_decoder", "_end_type", "_lines", "_provider", "done", "failure")

    def __init__(self, provider: str, *, end_type: str | None = None) -> None:
        self._lines = Utf8Lines(provider)
        self._decoder = SSEDecoder()
        self._provider = provider
        self._end_type = end_type
        self.done = False
        self.failure: ProviderError | None = None

    def feed(self, chunk: bytes) -> list[Any]:
        if self.failure is not None:
            raise self.failure
        return self._payloads(self._lines.feed(chunk)) if not self.done else []

    def finish(self) -> list[Any]:
        if self.failure is not None:
            raise self.failure
        return self._payloads(self._lines.finish()) if not self.done else []

    def _payloads(self, lines: list[str]) -> list[Any]:
        provider, end_type = self._provider, self._end_type
        events: list[tuple[str, str]] = []
        failure: ProviderError | None = None
        try:
            self._decoder.events(lines, events)
        except MalformedSSE:
            failure = malformed(provider, "a line that is not server-sent events")
        payloads: list[Any] = []
        for event, data in events:
            if data[:1] != "{" and data.strip() == "[DONE]":
                self.done = True
                return payloads  # what follows the end does not count, bad or not
            try:
                payload = _loads(data)
            except ValueError:
                failure = malformed(provider, "an event's data is not JSON")
                break
            if event == "error":
                failure = error_from_payload(
                    payload.get("error", payload) if isinstance(payload, dict) else None,
                    provider,
                )
                break
            if end_type is not None and type(payload) is dict and payload.get("type") == end_type:
                self.done = True
                return payloads
            payloads.append(payload)
        if failure is not None:
            if not payloads:
                raise failure
            self.failure = failure
        return payloads


async def next_payloads(chunks: AsyncIterator[bytes], payloads: SSEPayloads) -> list[Any] | None:
    """The payloads of the next chunks that complete any (None once the body ended and
    left none)."""
    while True:
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            return payloads.finish() or None
        batch = payloads.feed(chunk)
        if batch:
            return batch


async def drain(chunks: AsyncIterator[bytes]) -> None:
    """Read a complete stream's body to its end (normally just the chunked terminator), so
    the connection goes back to the pool instead of being closed half-read (bounded)."""
    drained = 0
    async for _ in chunks:
        drained += 1
        if drained >= _MAX_DRAINED_CHUNKS:
            break
