"""`AiohttpTransport`: the providers' HTTP calls over an ``aiohttp.ClientSession``.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import ssl
import urllib.request
from collections.abc import Awaitable, Callable
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


def client_timeout(timeout: float | httpx2.Timeout, *, read: bool = True) -> aiohttp.ClientTimeout:
    """`timeout`, read as httpx2 reads it, as aiohttp's settings (see the module
    docstring); without its read timeout unless `read`. Raises `TypeError`/`ValueError` as
    ``httpx2.Timeout`` does."""
    parts = timeout if isinstance(timeout, httpx2.Timeout) else httpx2.Timeout(timeout)
    pool = parts.pool
    connect = parts.connect
    return aiohttp.ClientTimeout(
        total=None,
        connect=None if pool is None or connect is None else pool + connect,
        sock_connect=connect,
        sock_read=parts.read if read else None,
    )


# The context the read watch's callback runs in: it reads no context variable, and a copy of
# a request's (what `call_later` makes by default) would keep its per-request objects alive
# while the timer waits in the loop's queue.
_NO_CONTEXT = contextvars.Context()
_CHECKS_PER_TIMEOUT = 8


class _Waiting:
    """One whole-answer call of a `_ReadWatch`: the task that waits, and when its wait for
    a byte is over."""

    __slots__ = ("_cancelling", "_fired", "_task", "_watch", "due")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self._task = task
        self._cancelling = task.cancelling()
        self._fired = False
        self._watch: _ReadWatch | None = None
        self.due = 0.0

    def progress(self) -> None:
        """A read returned: the next one has the whole timeout again."""
        watch = self._watch
        if watch is not None:
            self.due = watch.loop.time() + watch.seconds

    def expire(self) -> None:
        self._fired = True
        self._task.cancel()

    def timed_out(self) -> bool:
        """Whether the `CancelledError` being handled is this wait's expiry alone (asked
        once, by the cancelled task's handler of it; a cancellation of the caller's own at
        the same time wins)."""
        return self._fired and self._task.uncancel() <= self._cancelling

    def stop(self) -> None:
        watch = self._watch
        if watch is not None:
            watch.waiting.discard(self)


class _ReadWatch:
    """The read timeout of a session's whole-answer calls (httpx2's: no byte for `seconds`
    while a call waits for one), on one loop timer for all of them, which checks every
    eighth of the timeout while any call waits: a wait ends between `seconds` and an eighth
    more after its last byte. aiohttp's own (``sock_read``) moves a loop timer at every read
    of the socket, two a whole answer: more than the rest of a call's timing cost."""

    __slots__ = ("_handle", "_period", "loop", "seconds", "waiting")

    def __init__(self, seconds: float, loop: asyncio.AbstractEventLoop) -> None:
        self.seconds = seconds
        self.loop = loop
        self.waiting: set[_Waiting] = set()
        self._period = seconds / _CHECKS_PER_TIMEOUT
        self._handle: asyncio.TimerHandle | None = None

    def add(self, waiting: _Waiting) -> None:
        waiting._watch = self
        waiting.due = self.loop.time() + self.seconds
        self.waiting.add(waiting)
        if self._handle is None:
            self._handle = self.loop.call_later(self._period, self._check, context=_NO_CONTEXT)

    def _check(self) -> None:
        self._handle = None
        if not self.waiting:
            return  # nothing waits: the next call sets the timer again
        now = self.loop.time()
        for waiting in [w for w in self.waiting if w.due <= now]:
            self.waiting.discard(waiting)
            waiting.expire()
        self._handle = self.loop.call_later(self._period, self._check, context=_NO_CONTEXT)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


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
        "_read_timeout",
        "_timeout",
        "_watch",
        "_whole_timeout",
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
        # A whole answer's read timeout is a `_ReadWatch`'s, not aiohttp's (on the
        # transport's own session: a given one keeps its own timeouts, as it came).
        self._read_timeout = self.timeout.read if session is None else None
        self._whole_timeout = client_timeout(self.timeout, read=False)
        self._watch: _ReadWatch | None = None
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
        if self._read_timeout is not None:
            # A new loop's watch: the last one's stops by itself once its calls are done.
            self._watch = _ReadWatch(self._read_timeout, loop)
        self._current, self._loop = session, loop
        return session

    async def post_json(
        self, target: Any, body: bytes, headers: dict[str, str], provider: str, where: str
    ) -> Any:
        waiting = None
        if self._read_timeout is not None:
            task = _current_task()
            if task is not None:
                waiting = _Waiting(task)
        try:
            response = await self._post(
                target,
                body,
                headers,
                provider,
                where,
                waiting,
            )
            try:
                # Chunk by chunk (aiohttp decompresses each one bounded), so the size bound
                # holds while the body arrives; a body that came whole (a chat answer, as a
                # rule) is done at its first read, without a read that finds its end.
                content = response.content
                limit = self.max_response_bytes
                if waiting is not None:
                    waiting.progress()
                data = await content.readany()
                if not content.at_eof():
                    read = content.readany if waiting is None else _timed(content.readany, waiting)
                    data = await capped_body(read, limit, provider, where, data)
                elif len(data) > limit:
                    raise too_large(limit, provider, where)
            finally:
                response.release()
        except aiohttp.ClientError as exc:
            raise transport_error(exc, provider, where) from exc
        except asyncio.CancelledError:
            if waiting is None or not waiting.timed_out():
                raise
            expired = aiohttp.SocketTimeoutError("Timeout on reading data from socket")
            raise transport_error(expired, provider, where) from expired
        finally:
            if waiting is not None:
                waiting.stop()
        return decode_json(data, provider)

    async def open_stream(
        self, target: Any, body: bytes, headers: dict[str, str], provider: str, where: str
    ) -> _AiohttpStream:
        return _AiohttpStream(await self._post(target, body, headers, provider, where))

    async def _post(
        self,
        target: Any,
        body: bytes,
        headers: dict[str, str],
        provider: str,
        where: str,
        waiting: _Waiting | None = None,
    ) -> aiohttp.ClientResponse:
        """The response once its head arrived; an error status is its `ProviderError`
        (`waiting`: a whole-answer call the session's `_ReadWatch` times instead of
        aiohttp)."""
        session = self._current
        if session is None or (self._loop is not None and self._loop is not _running_loop()):
            session = await self._session()
        if self._proxy_request_headers is not None:
            headers = {**headers, **self._proxy_request_headers}
        watch = self._watch
        if waiting is None or watch is None:
            waiting = None
            response = await session.post(
                target, data=body, headers=headers, proxy_headers=self._proxy_headers
            )
        else:
            watch.add(waiting)
            response = await session.post(
                target,
                data=body,
                headers=headers,
                proxy_headers=self._proxy_headers,
                timeout=self._whole_timeout,
            )
        status = response.status
        if status >= 400:
            read = response.content.readany
            try:
                if waiting is None:
                    error_body = await bounded_body(read, self.errors)
                else:
                    waiting.progress()
                    try:
                        error_body = await bounded_body(_timed(read, waiting), self.errors)
                    except asyncio.CancelledError:
                        if not waiting.timed_out():
                            raise
                        error_body = b""  # as a read that failed: the status classifies it
            finally:
                response.release()
            raise self.status_error(status, response.headers, error_body, provider, where)
        return response

    async def aclose(self) -> None:
        session = self._current
        if self._owned and session is not None:
            self._current = None
            if self._watch is not None:
                self._watch.close()
            await session.close()


_running_loop = asyncio.get_running_loop
_current_task = asyncio.current_task


def _timed(
    read: Callable[[], Awaitable[bytes]], waiting: _Waiting
) -> Callable[[], Awaitable[bytes]]:
    """`read`, telling `waiting` of each chunk that came."""

    async def timed() -> bytes:
        data = await read()
        waiting.progress()
        return data

    return timed


class _AiohttpStream:
    __slots__ = ("_response", "read")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        # The stream's own reader, called directly: no iterator between it and the caller.
        self.read = response.content.readany

    async def aclose(self) -> None:
        self._response.release()  # closes the connection unless the body was read to its end
