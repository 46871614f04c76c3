"""One request through the gateway: its id, what its head says, and the response sent.

Every layer of the gateway's stack (`pipeline.gateway.app`) works on the same `Exchange`,
kept in the ASGI scope under `EXCHANGE`: the request id, the headers the layers need (read
in one pass), the caller's key and limit, the body once read, and what happened (status,
failure, the routing story for the server span). Responses go through it too, so each
one carries ``x-request-id`` and the status is known to the telemetry layer without
wrapping ``send``.

Request ids: an incoming ``x-request-id`` of 1 to 256 printable ASCII characters is kept;
anything else (absent, longer, unprintable) is replaced by a fresh id. Fresh ids are a
random per-process prefix and a counter (unique across replicas in practice, and cheaper
than a random number per request).
"""

from __future__ import annotations

import contextvars
import itertools
import json
import os
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from pipeline._scope import AttemptLog, RouteReport
from pipeline.gateway.wire import NOT_RETRYABLE, ChatRequest, WireError

if TYPE_CHECKING:
    from pipeline.gateway._shared import InboundFormat

__all__ = [
    "EXCHANGE",
    "ASGIApp",
    "JSON",
    "REQUEST_ID_HEADER",
    "SESSION_HEADER",
    "TAGS_HEADER",
    "Exchange",
    "Message",
    "Receive",
    "RequestIdMiddleware",
    "Scope",
    "Send",
    "current_request_id",
    "loggable",
    "request_id_of",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

EXCHANGE = "chat_pipeline.exchange"
"""The ASGI scope key of a request's `Exchange`."""

REQUEST_ID_HEADER = b"x-request-id"
SESSION_HEADER = b"x-session-id"
"""The request header carrying the session id (`Exchange.session`: session affinity keeps
its route)."""
TAGS_HEADER = b"x-chat-pipeline-tags"
"""The request header carrying the caller's spend tags, comma-separated."""
JSON = [(b"content-type", b"application/json")]

# The request headers `Exchange` reads (a set: the others are passed over in one look-up).
_READ = frozenset(
    {
        b"authorization",
        b"content-length",
        b"content-type",
        REQUEST_ID_HEADER,
        SESSION_HEADER,
        b"x-api-key",
        b"anthropic-beta",
        TAGS_HEADER,
        b"traceparent",
        b"tracestate",
        b"baggage",
    }
)

_VALID_ID = re.compile(rb"[\x20-\x7e]{1,256}")
_PREFIX = "req_" + os.urandom(6).hex()
_counter = itertools.count(1)

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "chat_pipeline_gateway_request_id", default=None
)
current_request_id = _request_id.get
"""The id of the gateway request being served in this context (for log lines), if any."""


_PLAIN = re.compile(r"[A-Za-z0-9._:/@+*#,-]{1,256}")
_LOGGED_CHARACTERS = 256


def loggable(value: str) -> str:
    """`value` (something a client wrote: a model name, a request id) as one field of a
    log line: as it is when it holds only characters that can neither end the line nor
    start another field (letters, digits, ``._:/@+*#,-``); otherwise quoted as a JSON
    string (so spaces, ``=``, quotes, line breaks, NUL and anything outside ASCII are
    escaped), its first 256 characters only."""
    if _PLAIN.fullmatch(value):
        return value
    if len(value) > _LOGGED_CHARACTERS:
        return json.dumps(value[:_LOGGED_CHARACTERS])[:-1] + '..."'
    return json.dumps(value)


def request_id_of(value: bytes | None) -> str:
    """The request's id: the caller's ``x-request-id`` when it is valid, else a fresh one."""
    if value is not None and _VALID_ID.fullmatch(value):
        return value.decode("ascii")
    return f"{_PREFIX}{next(_counter):x}"


class Exchange:
    """One request and its response (see the module docstring).

    The head fields are raw header values (``None`` when absent); `key` is the caller's
    identity, the same in every replica and process (set by the auth layer: a virtual key's
    id, a keyed hash of an ``api_keys_env`` key, `NO_KEY` without keys; never a key's
    position nor its secret), `key_name` what log lines show of it, `logged_id` the request
    id as a log line's field (`loggable`), and `virtual_key` the
    caller's `pipeline.keys.VirtualKey` when it has one; `request` is the
    parsed body (set by the body layer); `status`, `failure` and `disconnected` say how the
    request ended;
    `report`, `route`, `model`, `response_model` and `response_id` are the routing story
    the server span and the log line tell; `attempts` the request's priced attempts (when
    the gateway records spend), `tags` its ``x-chat-pipeline-tags`` header.
    """

    __slots__ = (
        "anthropic_beta",
        "attempts",
        "authorization",
        "builtin_tools",
        "carrier",
        "content_length",
        "content_type",
        "disconnected",
        "extra_headers",
        "failure",
        "format",
        "key",
        "key_name",
        "logged_id",
        "model",
        "report",
        "request",
        "request_id",
        "response_id",
        "response_model",
        "route",
        "scope",
        "send",
        "session",
        "started",
        "status",
        "tags",
        "virtual_key",
        "x_api_key",
    )

    def __init__(self, scope: Scope, send: Send, format: InboundFormat) -> None:
        self.started = time.perf_counter()
        self.anthropic_beta: bytes | None = None  # the betas an Anthropic client asked for
        self.scope = scope
        self.send = send
        self.format = format
        request_id = authorization = x_api_key = length = content_type = session = None
        tags: bytes | None = None
        carrier: dict[str, str] | None = None
        read = _READ
        for name, value in scope["headers"]:
            if name not in read:
                continue  # most of a request's headers: one look-up, not a comparison each
            if name == b"authorization":
                authorization = value
            elif name == b"content-length":
                length = value
            elif name == b"content-type":
                content_type = value
            elif name == REQUEST_ID_HEADER:
                request_id = value
            elif name == SESSION_HEADER:
                session = value.decode("latin-1")
            elif name == b"x-api-key":
                x_api_key = value
            elif name == b"anthropic-beta":
                self.anthropic_beta = value
            elif name == TAGS_HEADER:
                tags = value
            else:  # traceparent, tracestate, baggage
                if carrier is None:
                    carrier = {}
                carrier[name.decode()] = value.decode("latin-1")
        if request_id is not None and _VALID_ID.fullmatch(request_id):
            given = request_id.decode("ascii")
            self.request_id = given
            self.logged_id = loggable(given)
        else:  # a fresh id is one field of a log line as it is: nothing to escape
            self.request_id = self.logged_id = f"{_PREFIX}{next(_counter):x}"
        self.authorization: bytes | None = authorization
        self.x_api_key: bytes | None = x_api_key
        self.content_length: bytes | None = length
        self.content_type: bytes | None = content_type
        self.session: str | None = session
        self.tags: bytes | None = tags  # the caller's spend tags, comma-separated
        self.carrier = carrier
        self.key: str | None = None
        self.key_name: str | None = None
        self.virtual_key: Any = None
        self.request: ChatRequest | None = None
        self.status = 0
        self.failure: BaseException | None = None
        self.disconnected = False
        self.report: RouteReport | None = None
        # The request's priced attempts (when the gateway records spend): see `_scope`.
        self.attempts: AttemptLog | None = None
        self.route: str | None = None
        self.model: str | None = None
        self.response_model: str | None = None
        self.response_id: str | None = None
        # Headers a layer adds to whatever response the request gets (what was done with
        # its built-in tools).
        self.extra_headers: list[tuple[bytes, bytes]] = []
        self.builtin_tools: str | None = None  # what was done with its built-in tools

    def _id_headers(self) -> list[tuple[bytes, bytes]]:
        request_id = self.request_id.encode()
        extra = self.format.request_id_header
        ids = [(REQUEST_ID_HEADER, request_id)]
        if extra is not None:
            ids.append((extra, request_id))
        if self.extra_headers:
            ids += self.extra_headers
        return ids

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the status line and headers (with the request id)."""
        self.status = status
        headers = [*headers, *self._id_headers()]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def body_part(self, data: bytes, more: bool = True) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    async def whole(
        self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = JSON
    ) -> None:
        """A complete response with a body."""
        self.status = status
        headers = [
            *headers,
            (b"content-length", str(len(body)).encode()),
            *self._id_headers(),
        ]
        send = self.send
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def error(self, error: WireError) -> None:
        """An error response, in the inbound format's own error body."""
        headers = [*JSON, *error.headers()]
        if error.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        elif error.should_retry is False or error.code in NOT_RETRYABLE:
            headers.append((b"x-should-retry", b"false"))
        await self.whole(error.status, self.format.error_body(error), headers)


class RequestIdMiddleware:
    """``x-request-id`` on every response of the endpoints the inbound formats do not
    serve (models, health, readiness, metrics, unknown paths). The formats' own endpoints
    answer through their `Exchange`, which adds it."""

    __slots__ = ("app",)

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        value = None
        for name, header in scope["headers"]:
            if name == REQUEST_ID_HEADER:
                value = header
                break
        header_value = request_id_of(value).encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = message.get("headers", ())
                message["headers"] = [*headers, (REQUEST_ID_HEADER, header_value)]
            await send(message)

        await self.app(scope, receive, send_with_id)


enter_request_id = _request_id.set
"""Make a request id the current request's (for log lines); returns the token
`exit_request_id` takes."""


exit_request_id = _request_id.reset
