"""HTTP plumbing shared by the providers: errors from statuses and transports."""

from __future__ import annotations

import json
from typing import Any

import httpx2

from pipeline.errors import FailureKind, ProviderError, parse_retry_after, provider_error
from pipeline.providers._chat_completions import error_from_payload, malformed

__all__ = ["endpoint", "post_json", "status_error", "transport_error"]

_MAX_ERROR_BODY = 64 * 1024


def endpoint(url: httpx2.URL | str) -> str:
    """The URL without its query string (which may carry keys on some gateways)."""
    return str(httpx2.URL(str(url)).copy_with(query=None))


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

    The body is read (bounded) only for its machine-readable ``error.code``/``error.type``.
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
