"""HTTP plumbing shared by the providers: errors from statuses and transports, deadlines,
and server-sent event streams decoded to JSON payloads."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx2

from pipeline.errors import FailureKind, ProviderError, parse_retry_after, provider_error
from pipeline.providers._sse import MalformedSSE, SSEDecoder
from pipeline.providers._wire import error_from_payload, malformed

__all__ = [
    "DEFAULT_TIMEOUT",
    "DONE",
    "deadline",
    "endpoint",
    "positive_or_none",
    "post_json",
    "sse_json",
    "status_error",
    "transport_error",
]

DEFAULT_TIMEOUT = httpx2.Timeout(60.0, connect=10.0)
_MAX_ERROR_BODY = 64 * 1024
_MAX_DRAINED_LINES = 100


def endpoint(url: httpx2.URL | str) -> str:
    """The URL without its query string (which may carry keys on some gateways)."""
    return str(httpx2.URL(str(url)).copy_with(query=None))


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


async def post_json(
    http: httpx2.AsyncClient,
    url: httpx2.URL,
    body: dict[str, Any],
    headers: dict[str, str],
    *,
    provider: str,
    where: str,
) -> Any:
    """POST `body` and return the decoded JSON answer; every failure is a `ProviderError`."""
    try:
        response = await http.post(url, json=body, headers=headers)
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


DONE: Any = object()
"""What `sse_json` yields, last, when the stream said it is complete."""


async def sse_json(
    lines: AsyncIterator[str], provider: str, *, end_type: str | None = None
) -> AsyncGenerator[Any, None]:
    """The decoded JSON payloads of an SSE stream, then `DONE` when it says it is complete:
    a ``[DONE]`` data line (Chat Completions) or a payload whose ``type`` is `end_type`
    (``message_stop`` in the Messages API). An ``error`` event raises its `ProviderError`;
    malformed SSE or JSON raises one of kind `UNKNOWN` (code ``malformed``).
    """
    decoder = SSEDecoder()
    async for line in lines:
        try:
            data = decoder.feed(line)
        except MalformedSSE:
            raise malformed(provider, "a line that is not server-sent events") from None
        if data is None:
            continue
        if data.strip() == "[DONE]":
            break
        try:
            payload = json.loads(data)
        except ValueError:
            raise malformed(provider, "an event's data is not JSON") from None
        if decoder.event == "error":
            raise error_from_payload(
                payload.get("error", payload) if isinstance(payload, dict) else None, provider
            )
        if end_type is not None and type(payload) is dict and payload.get("type") == end_type:
            break
        yield payload
    else:
        return  # the body ended without saying the stream was complete
    # Read to the end of the body (normally just the chunked terminator), so the connection
    # goes back to the pool instead of being closed half-read.
    drained = 0
    async for _ in lines:
        drained += 1
        if drained >= _MAX_DRAINED_LINES:
            break
    yield DONE
