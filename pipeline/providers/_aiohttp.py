"""`AiohttpTransport`: the providers' HTTP calls over an ``aiohttp.ClientSession``.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import functools
import os
import ssl
import urllib.request
from typing import Any

import aiohttp
import httpx2
from yarl import URL

from pipeline.providers._http import (
    DEFAULT_MAX_RESPONSE_BYTES,
    StatusError,
    TransportName,
    basic_auth,
    bounded_body,
    capped_body,
    decode_json,
    status_error_of,
    too_large,
    transport_error,
)

__all__ = ["AiohttpTransport", "client_timeout", "environment_proxy"]

_POOL_SIZE = 100
_KEEPALIVE_SECONDS = 5.0  # httpx2's keepalive_expiry


def client_timeout(timeout: float | httpx2.Timeout) -> aiohttp.ClientTimeout:
    """`timeout`, read as httpx2 reads it, as aiohttp's settings (see the module
    docstring). Raises `TypeError`/`ValueError` as ``httpx2.Timeout`` does."""
    parts = timeout if isinstance(timeout, httpx2.Timeout) else httpx2.Timeout(timeout)
    pool = parts.pool
    connect = parts.connect
    return aiohttp.ClientTimeout(
        total=None,
        connect=None if pool is None or connect is None else pool + connect,
        sock_connect=connect,
        sock_read=parts.read,
    )


def environment_proxy(url: httpx2.URL) -> tuple[str | None, dict[str, str] | None]:
    """The proxy the environment names for `url` (``HTTPS_PROXY``, ``HTTP_PROXY`` or
    ``ALL_PROXY``, unless ``NO_PROXY`` exempts its host) without its credentials, and the
    ``Proxy-Authorization`` header they stand for."""
    proxies = urllib.request.getproxies()
    found = proxies.get(url.scheme) or proxies.get("all")
    if not found or urllib.request.proxy_bypass(url.host):
        return None, None
    proxy = httpx2.URL(found if "://" in found else f"http://{found}")
    headers = None
    if proxy.username or proxy.password:
        headers = {"Proxy-Authorization": basic_auth(proxy.username, proxy.password)}
        proxy = proxy.copy_with(username=None, password=None)
    return str(proxy), headers


@functools.lru_cache(maxsize=4)
def _ssl_context(cafile: str | None, capath: str | None) -> ssl.SSLContext:
    # One per certificate setting, shared by every client (loading the certificates is the
    # slow part of opening a session); the arguments are only the cache's key.
    return httpx2.create_ssl_context()


class AiohttpTransport:
    """Calls through an ``aiohttp.ClientSession``: the transport's own (see the module
    docstring) or one the caller gave (used as is, in its own loop, and left open)."""

    __slots__ = (
        "_base_url",
        "_current",
        "_loop",
        "_owned",
        "_proxy_headers",
        "_proxy_request_headers",
        "_timeout",
        "max_response_bytes",
        "status_error",
        "timeout",
    )

    name: TransportName = "aiohttp"
    errors: tuple[type[Exception], ...] = (aiohttp.ClientError,)

    def __init__(
        self,
        session: aiohttp.ClientSession | None,
        *,
        timeout: float | httpx2.Timeout,
        base_url: httpx2.URL,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        status_error: StatusError = status_error_of,
    ) -> None:
        self.max_response_bytes = max_response_bytes
        self.status_error = status_error
        self.timeout = timeout if isinstance(timeout, httpx2.Timeout) else httpx2.Timeout(timeout)
        self._timeout = client_timeout(self.timeout)
        self._base_url = base_url
        self._owned = session is None
        self._current = session
        # The proxy's credentials: on its CONNECT for an https target, else on each request
        # (aiohttp sends `proxy_headers` only on a CONNECT).
        self._proxy_headers: dict[str, str] | None = None
        self._proxy_request_headers: dict[str, str] | None = None
        # The loop the transport's own session belongs to (a given session: not checked).
        self._loop: asyncio.AbstractEventLoop | None = None

    def target(self, url: httpx2.URL) -> URL:
        return URL(str(url), encoded=True)  # httpx2 already encoded it

    async def _session(self) -> aiohttp.ClientSession:
        """The transport's own session, opened in the running loop."""
        loop = asyncio.get_running_loop()
        stale = self._current
        if stale is not None and self._loop is not None:
            if self._loop.is_closed():
                await stale.close()  # its connections died with their loop
            else:
                stale.detach()  # still another loop's: not ours to close from here
        proxy, proxy_headers = environment_proxy(self._base_url)
        if self._base_url.scheme == "https":
            self._proxy_headers = proxy_headers
        else:
            self._proxy_request_headers = proxy_headers
        tls: ssl.SSLContext | bool = True
        if self._base_url.scheme == "https" or proxy is not None:
            tls = _ssl_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=_POOL_SIZE, keepalive_timeout=_KEEPALIVE_SECONDS, ssl=tls
            ),
            timeout=self._timeout,
            proxy=proxy,
            # Proxies are read above, once; aiohttp's own reading costs two thread hops per
            # request and takes credentials from ~/.netrc.
            trust_env=False,
        )
        self._current, self._loop = session, loop
        return session

    async def post_json(
        self, target: Any, body: bytes, headers: dict[str, str], provider: str, where: str
    ) -> Any:
        try:
            response = await self._post(target, body, headers, provider, where)
            try:
                # Chunk by chunk (aiohttp decompresses each one bounded), so the size bound
                # holds while the body arrives; a body that came whole (a chat answer, as a
                # rule) is done at its first read, without a read that finds its end.
                content = response.content
                limit = self.max_response_bytes
                data = await content.readany()
                if not content.at_eof():
                    data = await capped_body(content.readany, limit, provider, where, data)
                elif len(data) > limit:
                    raise too_large(limit, provider, where)
            finally:
                response.release()
        except aiohttp.ClientError as exc:
            raise transport_error(exc, provider, where) from exc
        return decode_json(data, provider)

    async def open_stream(
        self, target: Any, body: bytes, headers: dict[str, str], provider: str, where: str
    ) -> _AiohttpStream:
        return _AiohttpStream(await self._post(target, body, headers, provider, where))

    async def _post(
        self, target: Any, body: bytes, headers: dict[str, str], provider: str, where: str
    ) -> aiohttp.ClientResponse:
        """The response once its head arrived; an error status is its `ProviderError`."""
        session = self._current
        if session is None or (self._loop is not None and self._loop is not _running_loop()):
            session = await self._session()
        if self._proxy_request_headers is not None:
            headers = {**headers, **self._proxy_request_headers}
        response = await session.post(
            target, data=body, headers=headers, proxy_headers=self._proxy_headers
        )
        status = response.status
        if status >= 400:
            try:
                error_body = await bounded_body(response.content.readany, self.errors)
            finally:
                response.release()
            raise self.status_error(status, response.headers, error_body, provider, where)
        return response

    async def aclose(self) -> None:
        session = self._current
        if self._owned and session is not None:
            self._current = None
            await session.close()


_running_loop = asyncio.get_running_loop


class _AiohttpStream:
    __slots__ = ("_response", "read")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        # The stream's own reader, called directly: no iterator between it and the caller.
        self.read = response.content.readany

    async def aclose(self) -> None:
        self._response.release()  # closes the connection unless the body was read to its end
