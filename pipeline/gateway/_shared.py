"""What the gateway's formats, layers and handler share, and what they need of the app: the
inbound formats implement `InboundFormat` and `StreamEncoder`, the layers share `NO_KEY` and
`READ_TIMED_OUT`, and the handler and endpoints see the app through `GatewayState` and
`ServedTarget` (a leaf: no module below the app imports the app)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from pipeline._forward import Forward
from pipeline.client import ChatClient
from pipeline.gateway.settings import GatewaySettings
from pipeline.gateway.wire import ChatRequest, WireError
from pipeline.types import ChatResponse, ChatResponseUpdate

__all__ = [
    "NO_KEY",
    "ON_DISCONNECT",
    "READ_TIMED_OUT",
    "Forwarder",
    "GatewayState",
    "InboundFormat",
    "ServedTarget",
    "StreamEncoder",
]

NO_KEY = ""
"""The caller identity (`Exchange.key`) of a request to a gateway without keys."""

READ_TIMED_OUT = "chat_pipeline.read_timed_out"
"""Scope key the connection sets when the request's body did not arrive in time."""

ON_DISCONNECT = "chat_pipeline.on_disconnect"
"""Scope key the gateway's connections set (to None) on every request: the callable the app
leaves there is called when the client goes away before the response is complete (so the
app need not wait on ``receive`` in a task of its own to find out)."""


class StreamEncoder(Protocol):
    """The events of one streamed answer in an inbound format."""

    def update(self, update: ChatResponseUpdate) -> str | bytes:
        """The events for one update ("" when it carries nothing to send)."""

    def end(self) -> str | bytes:
        """The events that end a complete stream."""

    def error(self, error: WireError) -> str:
        """The in-band error event that ends this stream when it failed after output."""


class InboundFormat(Protocol):
    """An API the gateway serves (a path, a request body, its answers and errors)."""

    path: str
    """The endpoint, e.g. ``/v1/chat/completions``."""
    x_api_key: bool
    """Whether the key may come in ``x-api-key`` (Anthropic clients) besides
    ``Authorization: Bearer``."""
    stream_headers: list[tuple[bytes, bytes]]
    """The response headers of a stream."""
    request_id_header: bytes | None
    """A header the format's clients read the request id from, sent besides
    ``x-request-id`` (Anthropic's SDKs read ``request-id``); None for none."""

    def parse(self, body: bytes, *, session_id: str | None) -> ChatRequest:
        """The request a body describes; `WireError` (a 4xx) naming what is wrong."""

    def error_body(self, error: WireError) -> bytes:
        """The format's error body."""

    def new_response_id(self) -> str:
        """A fresh id for a response (the gateway's own: failover may change upstreams)."""

    def completion(
        self, response: ChatResponse, request: ChatRequest, *, response_id: str, created: int
    ) -> bytes:
        """The body of a non-streaming answer."""

    def encoder(
        self, request: ChatRequest, *, model: str, response_id: str, created: int
    ) -> StreamEncoder:
        """The encoder of one streamed answer."""


class Forwarder(Protocol):
    """The forwarded path of an inbound format (`pipeline._forward`): which requests may go
    as their clients wrote them, and how the providers' own answers are written back."""

    def forward(self, request: ChatRequest) -> Forward | None:
        """The request's `Forward`, or None when its body cannot go as it came."""

    def completion(
        self, payload: Any, request: ChatRequest, *, response_id: str, created: int
    ) -> bytes | None:
        """The body of a whole answer from the provider's payload, or None to write the
        parsed answer."""

    def encoder(
        self,
        parsed: Callable[[], StreamEncoder],
        request: ChatRequest,
        *,
        model: str,
        response_id: str,
        created: int,
    ) -> StreamEncoder:
        """The encoder of a stream whose updates may carry the provider's events (the
        encoder `parsed` makes, when one is needed, writes the others)."""


class ServedTarget(Protocol):
    """What the handler needs of what a model name serves (`pipeline.gateway.app.Target`)."""

    @property
    def client(self) -> ChatClient: ...
    @property
    def instructions(self) -> str | None: ...
    @property
    def route(self) -> str | None: ...
    @property
    def forwards(self) -> bool:
        """Whether a client below may forward requests (`pipeline._forward`)."""

    @property
    def caches(self) -> bool:
        """Whether a response cache is among its layers."""


class GatewayState(Protocol):
    """What the handler and the plain endpoints need of one worker's gateway
    (`pipeline.gateway.app.Gateway`)."""

    @property
    def settings(self) -> GatewaySettings: ...
    @property
    def targets(self) -> Mapping[str, ServedTarget]: ...
    def target(self, model: str) -> ServedTarget | None:
        """What a model name serves: its exact name's target, else the first matching
        pattern's (`[gateway] models` may hold glob patterns), else None."""

    @property
    def models(self) -> Mapping[str, str]: ...
    @property
    def started_at(self) -> int: ...
    @property
    def spend(self) -> Any:
        """The worker's `pipeline.spend.SpendLedger` (``[spend]``), or None."""

    @property
    def admin_key(self) -> bytes | None:
        """The admin endpoints' key (``[gateway] admin_key_env``), or None."""

    async def readiness(self) -> tuple[bool, dict[str, str]]:
        """Whether this worker is ready, and each check's result."""
