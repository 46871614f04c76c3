"""The chat client protocol and the base of every layer.

A `ChatClient` answers a conversation either whole (`get_response`) or as a stream of
updates (`get_streaming_response`, an async generator). Callers that stop reading a stream
early close it (``async with contextlib.aclosing(stream)`` or ``await stream.aclose()``);
every layer closes the inner stream it opened, so closing the outermost stream releases
everything beneath it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self, runtime_checkable

from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages

if TYPE_CHECKING:
    # Only for the annotation: importing numpy would triple `import pipeline`'s time.
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "AsyncClosing",
    "ChatClient",
    "ChatClientMetadata",
    "DelegatingChatClient",
    "EmbeddingGenerator",
    "check_options",
    "circuit_open",
    "client_name",
    "close_all",
    "ensure_chat_client",
    "metadata_of",
]


@dataclass(frozen=True, slots=True)
class ChatClientMetadata:
    """What telemetry and routing know about a client. Never holds credentials."""

    provider_name: str | None = None
    model_id: str | None = None
    server_address: str | None = None
    server_port: int | None = None
    name: str | None = None


@runtime_checkable
class ChatClient(Protocol):
    """An async chat client. Every layer and provider implements this."""

    @property
    def metadata(self) -> ChatClientMetadata: ...

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse: ...

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class EmbeddingGenerator(Protocol):
    """Turns texts into vectors: `generate` returns a float32 array of shape ``(n, d)``."""

    async def generate(self, values: Sequence[str]) -> npt.NDArray[np.float32]: ...

    async def aclose(self) -> None: ...


_CLIENT_METHODS = ("get_response", "get_streaming_response", "aclose")


def ensure_chat_client(client: object, what: str = "client") -> ChatClient:
    """Return `client` typed as a `ChatClient`, or raise `TypeError` naming `what`.

    The three methods are required; `metadata` is not (see `metadata_of`).
    """
    for method in _CLIENT_METHODS:
        if not callable(getattr(client, method, None)):
            raise TypeError(
                f"{what} must be a ChatClient (get_response, get_streaming_response, aclose), "
                f"not {type(client).__name__}"
            )
    return client  # type: ignore[return-value]


def metadata_of(client: object) -> ChatClientMetadata:
    """`client.metadata`, or metadata naming the client's type when it has none."""
    metadata = getattr(client, "metadata", None)
    if metadata is None:
        return ChatClientMetadata(name=type(client).__name__)
    return metadata  # type: ignore[no-any-return]


def check_options(options: object) -> ChatOptions | None:
    """Return `options` if it is `None` or a `ChatOptions`, else raise `TypeError`."""
    if options is None or type(options) is ChatOptions or isinstance(options, ChatOptions):
        return options
    raise TypeError(f"options must be ChatOptions or None, not {type(options).__name__}")


async def raising(error: BaseException) -> Any:
    """A coroutine that raises `error` when awaited: for a `get_response` that returns the
    inner call's coroutine instead of awaiting it in one of its own, so a bad argument still
    fails where the call is awaited, as it does in an ``async def``."""
    raise error


Answer = Coroutine[Any, Any, ChatResponse]
"""What `get_response` returns without a coroutine of its own (the inner call's)."""


def client_name(client: ChatClient) -> str:
    """A readable name for a client: its metadata name, else provider/model, else its type."""
    metadata = metadata_of(client)
    if metadata.name:
        return metadata.name
    if metadata.provider_name and metadata.model_id:
        return f"{metadata.provider_name}/{metadata.model_id}"
    return metadata.model_id or metadata.provider_name or type(client).__name__


def circuit_open(client: object) -> bool:
    """True when a circuit breaker in `client`'s chain of layers is open (its calls would
    fail fast): a layer says so with a true ``circuit_open`` attribute."""
    current: object = client
    for _ in range(64):  # a chain is short; the bound guards against a cycle
        if getattr(current, "circuit_open", False) is True:
            return True
        following = getattr(current, "inner", None) or getattr(current, "client", None)
        if following is None:
            return False
        current = following
    return False


async def close_all(resources: Iterable[object], what: str = "clients") -> None:
    """Close each of `resources` once (by identity), all of them even when some fail; then
    raise the one failure, or an `ExceptionGroup` of several."""
    seen: set[int] = set()
    errors: list[Exception] = []
    for resource in resources:
        if id(resource) in seen:
            continue
        seen.add(id(resource))
        try:
            await resource.aclose()  # type: ignore[attr-defined]
        except Exception as exc:  # close the rest, then report every failure
            errors.append(exc)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ExceptionGroup(f"closing {what} failed", errors)


class AsyncClosing:
    """``async with client:`` closes the client (calls `aclose()`) on the way out."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class DelegatingChatClient(AsyncClosing):
    """A layer that forwards everything to `inner`; subclasses override what they change.

    `aclose()` closes the inner client once, unless the layer was built with
    ``leave_open=True``.
    """

    keeps_raw_answers: ClassVar[bool] = False
    """Whether the layer passes its inner client's responses and updates on as it gets them
    (observing, never changing or replacing them): a provider below only such layers may
    answer with its own payload on the gateway's forwarded path (`pipeline._forward`)."""

    def __init__(self, inner: ChatClient, *, leave_open: bool = False) -> None:
        self.inner: ChatClient = ensure_chat_client(inner, "inner")
        self.leave_open = leave_open
        self._closed = False

    @property
    def metadata(self) -> ChatClientMetadata:
        return metadata_of(self.inner)

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        return await self.inner.get_response(messages, options)

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return self.inner.get_streaming_response(messages, options)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.leave_open:
            await self.inner.aclose()

    def describe_layer(self) -> str:
        """How this layer appears in `ChatPipeline.describe()`."""
        return type(self).__name__

    def __repr__(self) -> str:
        return f"{type(self).__name__}(inner={self.inner!r})"
