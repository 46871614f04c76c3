"""The gateway's HTTP/1.1 connections: uvicorn's httptools protocol, with deadlines and a
bound on connections.

uvicorn (httptools) gives a connection no deadline until its first response: a client
that opens connections and sends nothing, or trickles a request head or body a byte at a
time, holds the connection (and, before this layer, a request slot) for ever. Here each
connection of a worker has:

* a head deadline (`ConnectionLimits.header_timeout`): from the connection's opening, or
  from the first byte of a request after an idle keep-alive period, to the end of the
  request head. Past it: ``408`` and the connection closed (silently when it sent
  nothing at all). A head larger than `ConnectionLimits.max_head_bytes` is ``431``;
* a body deadline (`ConnectionLimits.body_timeout`), armed only when a body did not
  arrive with its head: past it the request is marked (`READ_TIMED_OUT`) and its read
  woken, so the app answers ``408`` (see `pipeline.gateway._body`), and the connection
  is closed; an app that does not answer within the same time more loses the connection;
* keep-alive: an idle connection stays open ``timeout_keep_alive`` seconds (uvicorn's own
  timer, set from ``[gateway] keep_alive_timeout``);
* a response sent before its request's body was all read (a refusal: 401, 413, 429 ...)
  ends the connection once the rest of the body arrived, read for nothing, or once the
  body deadline passed. Closing at once would reset the connection under the client
  still sending, and it could lose the response;
* a bound (`ConnectionLimits.max_connections`): a connection beyond it closes the
  connection idle the longest (between requests, or opened and silent), as nginx reuses
  its idle keep-alive connections; when none is idle, the new connection is answered
  ``503`` with ``Retry-After`` and closed.

Every answer given here carries an OpenAI error body and an ``x-request-id``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from pipeline.gateway._body import READ_TIMED_OUT
from pipeline.gateway._exchange import REQUEST_ID_HEADER, request_id_of

__all__ = ["ConnectionLimits", "GatewayProtocol", "protocol_factory"]

_logger = logging.getLogger("chat_pipeline.gateway")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one worker allows its connections (see the module docstring)."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 1024
    max_head_bytes: int = 64 * 1024
    retry_after: float = 1.0


def _answer(
    status: int, reason: bytes, message: str, code: str, extra: bytes = b""
) -> tuple[bytes, bytes]:
    """A response that closes the connection, with an OpenAI error body: its head up to
    the request id's value, and its body."""
    error_type = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    ).encode()
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n%s%s: " % (status, reason, len(body), extra, REQUEST_ID_HEADER)
    ), body


class GatewayProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines and the bound of the module
    docstring. uvicorn makes one per connection (through `protocol_factory`)."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        limits: ConnectionLimits,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._in_head = False  # bytes of a request head arrived, the head is not complete
        self._head_bytes = 0
        self._in_body = False  # the head is complete, the body is not
        self._answered_early = False  # the response went out before the body was all read
        # When the connection became idle (opened, or its last response sent): the
        # connection idle the longest is the one a new connection closes at the bound.
        self._idle_since: float | None = None

    # -- connections -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._limits.max_connections and not self._make_room():
            _refused(len(self.connections) - 1)
            self._send_and_close(*_too_many(self._limits))
            return
        self._idle_since = time.monotonic()
        self._deadline = self.loop.call_later(self._limits.header_timeout, self._head_late)

    def _make_room(self) -> bool:
        """Close the connection idle the longest; False when none is idle."""
        oldest: GatewayProtocol | None = None
        since = math.inf
        for connection in self.connections:
            if (
                connection is not self
                and isinstance(connection, GatewayProtocol)
                and connection._idle_since is not None
                and connection._idle_since < since
                and not connection.transport.is_closing()
            ):
                oldest, since = connection, connection._idle_since
        if oldest is None:
            return False
        _logger.debug("closing the connection idle the longest to accept a new one")
        oldest.transport.close()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self._idle_since = None
        super().connection_lost(exc)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _send_and_close(self, head: bytes, body: bytes) -> None:
        if self.transport.is_closing():
            return
        request_id = request_id_of(None).encode()
        self.transport.write(head + request_id + b"\r\n\r\n" + body)
        self.transport.close()

    # -- reading -----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head:
            # Only chunks that left the head incomplete are counted: the chunk that
            # completes it is at most one read.
            self._head_bytes += len(data)
            if self._head_bytes > self._limits.max_head_bytes:
                self._in_head = False
                self._send_and_close(*_HEAD_TOO_LARGE)
        elif self._in_body and self._deadline is None:
            # The body did not come with its head: from now on it has a deadline.
            self._deadline = self.loop.call_later(self._limits.body_timeout, self._body_late)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._idle_since = None
        self._answered_early = False
        self._in_head = True
        self._head_bytes = 0
        if self._deadline is None:  # after an idle keep-alive period
            self._deadline = self.loop.call_later(self._limits.header_timeout, self._head_late)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._in_body = True
        self._cancel_deadline()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._cancel_deadline()
        super().on_message_complete()
        if self._answered_early:
            self.transport.close()  # the rest of the body came in: the client has read it all

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self._in_body:
            # Answered before its body was all read (a refusal): the rest is read for
            # nothing (uvicorn drops it), then the connection ends, at the latest at the
            # body deadline.
            self._answered_early = True
            if self._deadline is None:
                self._deadline = self.loop.call_later(self._limits.body_timeout, self._abort)
            return
        self._idle_since = time.monotonic()

    # -- deadlines ---------------------------------------------------------------------------

    def _head_late(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if not self._in_head:
            # Opened and silent (the head of a request that began arrives with its bytes).
            _logger.debug("closing a connection that sent no request in time")
            self.transport.close()
            return
        _logger.debug("a request head did not arrive in time: 408")
        self._in_head = False
        self._send_and_close(*_HEAD_LATE)

    def _body_late(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if self.transport.is_closing() or not self._in_body or cycle is None:
            return
        if self._answered_early:
            self.transport.close()
            return
        if cycle.response_started:
            return  # being answered: the connection ends at the body deadline after it
        _logger.debug("a request body did not arrive in time: 408")
        cycle.scope[READ_TIMED_OUT] = True  # type: ignore[literal-required]
        cycle.message_event.set()
        # The app answers 408 and the connection closes; one that does not loses it.
        self._deadline = self.loop.call_later(self._limits.body_timeout, self._abort)

    def _abort(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def protocol_factory(limits: ConnectionLimits) -> Any:
    """What uvicorn's ``http`` setting takes to make a `GatewayProtocol` per connection (a
    picklable callable, so worker processes get it too)."""
    return functools.partial(GatewayProtocol, limits=limits)


_last_refusal_warning = -math.inf


def _refused(open_connections: int) -> None:
    global _last_refusal_warning
    # One warning a minute at most: a flood would otherwise log a line per connection.
    now = time.monotonic()
    if now - _last_refusal_warning >= 60:
        _last_refusal_warning = now
        _logger.warning(
            "%d connections open, none idle: new connections are answered 503",
            open_connections,
        )


def _too_many(limits: ConnectionLimits) -> tuple[bytes, bytes]:
    return _answer(
        503,
        b"Service Unavailable",
        "the gateway has too many connections open; retry later",
        "too_many_connections",
        b"retry-after: %d\r\n" % max(1, math.ceil(limits.retry_after)),
    )


_HEAD_LATE = _answer(
    408, b"Request Timeout", "the request head did not arrive in time", "request_timeout"
)
_HEAD_TOO_LARGE = _answer(
    431,
    b"Request Header Fields Too Large",
    "the request head is too large",
    "request_header_fields_too_large",
)
