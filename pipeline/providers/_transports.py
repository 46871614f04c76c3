"""Picking a provider client's transport: `make_transport` (over `pipeline.providers._http`'s
`Httpx2Transport` and `pipeline.providers._aiohttp`'s `AiohttpTransport`, which import only
the shared plumbing below them).
"""

from __future__ import annotations

import sys

import httpx2

from pipeline.providers._http import (
    DEFAULT_LIMITS,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_TRANSPORT,
    TRANSPORTS,
    Httpx2Transport,
    StatusError,
    Transport,
    status_error_of,
)

__all__ = ["make_transport"]


def make_transport(
    transport: object,
    http_client: object,
    timeout: float | httpx2.Timeout,
    base_url: httpx2.URL,
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    status_error: StatusError = status_error_of,
) -> Transport:
    """The transport a client asked for: `transport` (``"aiohttp"`` or ``"httpx2"``; None:
    the one `http_client` implies, else `DEFAULT_TRANSPORT`) over `http_client` (an
    ``httpx2.AsyncClient`` or an ``aiohttp.ClientSession``, used as is and left open) or a
    client of the transport's own with `timeout`, for the service at `base_url`; a
    non-streamed answer's decoded body may hold `max_response_bytes`; an error status becomes
    the `ProviderError` `status_error` makes of it.

    Raises `ValueError` for an unknown transport or one that contradicts `http_client`, and
    `TypeError` for an `http_client` of another kind.
    """
    if transport is not None and transport not in TRANSPORTS:
        raise ValueError(
            f"transport must be one of {', '.join(map(repr, TRANSPORTS))}, not {transport!r}"
        )
    if http_client is None:
        name = transport or DEFAULT_TRANSPORT
        if name == "httpx2":
            return Httpx2Transport(
                httpx2.AsyncClient(timeout=timeout, limits=DEFAULT_LIMITS),
                owned=True,
                max_response_bytes=max_response_bytes,
                status_error=status_error,
            )
        from pipeline.providers._aiohttp import AiohttpTransport

        return AiohttpTransport(
            None,
            timeout=timeout,
            base_url=base_url,
            max_response_bytes=max_response_bytes,
            status_error=status_error,
        )
    if isinstance(http_client, httpx2.AsyncClient):
        if transport not in (None, "httpx2"):
            raise ValueError(f"transport={transport!r} cannot call through an httpx2.AsyncClient")
        return Httpx2Transport(
            http_client,
            owned=False,
            max_response_bytes=max_response_bytes,
            status_error=status_error,
        )
    # An aiohttp session is one only if aiohttp was imported to make it.
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(http_client, aiohttp.ClientSession):
        if transport not in (None, "aiohttp"):
            raise ValueError(f"transport={transport!r} cannot call through an aiohttp session")
        from pipeline.providers._aiohttp import AiohttpTransport

        return AiohttpTransport(
            http_client,
            timeout=timeout,
            base_url=base_url,
            max_response_bytes=max_response_bytes,
            status_error=status_error,
        )
    raise TypeError(
        "http_client must be an httpx2.AsyncClient or an aiohttp.ClientSession, "
        f"not {type(http_client).__name__}"
    )
