"""A provider's side of the forwarded path (`pipeline._forward`): the client's body sent with
the route's own fields, and a stream's reads turned into updates that keep their events.

`chat_completions_body` is the Chat Completions request a forwarded body becomes: the
route's model and token field, and the stream fields every streamed request carries (usage
asked for, as on the parsed path). `ForwardedReads` feeds each event of a read to the
format's own stream reader (so what fails, and what the layers above see, is what the
parsed path gives) and makes one update of each read that carries anything, keeping its
events, and those of the reads before it that carried nothing, in ``raw_representation``:
an update comes exactly where the parsed path's first one would, so output is committed
(and failover ends) at the same event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from pipeline._json_codec import dumps
from pipeline.types import ChatResponseUpdate, UsageDetails

if TYPE_CHECKING:
    from pipeline._forward import Forward

__all__ = ["ForwardedReads", "chat_completions_body"]

_TOKEN_FIELDS = ("max_completion_tokens", "max_tokens")


def chat_completions_body(
    forward: Forward,
    *,
    model: str | None,
    max_tokens_field: str,
    max_tokens: int | None,
    stream: bool,
) -> bytes:
    """The forwarded body of a Chat Completions request, as JSON bytes."""
    body = dict(forward.body)
    if model is not None:
        body["model"] = model
    else:
        body.pop("model", None)
    if "max_tokens" in body or "max_completion_tokens" in body:
        for name in _TOKEN_FIELDS:
            body.pop(name, None)
        if max_tokens is not None:
            body[max_tokens_field] = max_tokens
    body.pop("stream", None)
    body.pop("stream_options", None)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return dumps(body)


class _Reader(Protocol):
    """A format's stream reader (`pipeline.providers._base.StreamReader`)."""

    def feed(self, payload: Any) -> ChatResponseUpdate | None: ...
    def finish(self) -> ChatResponseUpdate | None: ...


class ForwardedReads:
    """One forwarded stream's reads as updates (see the module docstring)."""

    __slots__ = ("_held", "_reader")

    def __init__(self, reader: _Reader) -> None:
        self._reader = reader
        self._held: list[Any] = []

    def read(self, payloads: list[Any]) -> tuple[ChatResponseUpdate | None, Exception | None]:
        """The update of one read's events (None when they carry nothing yet), and the
        failure an event was (the events before it are the update's)."""
        merged: ChatResponseUpdate | None = None
        failure: Exception | None = None
        held = self._held
        feed = self._reader.feed
        for payload in payloads:
            try:
                update = feed(payload)
            except Exception as exc:  # a failure after the events before it, as parsed
                failure = exc
                break
            held.append(payload)
            if update is not None:
                merged = update if merged is None else _merged(merged, update)
        if merged is not None:
            merged.raw_representation = held
            self._held = []
        return merged, failure

    def finish(self) -> ChatResponseUpdate | None:
        """What is still pending once the stream ended (the format reader's), with the
        events held for it."""
        tail = self._reader.finish()
        if tail is not None:
            tail.raw_representation = self._held
            self._held = []
        return tail


def _merged(first: ChatResponseUpdate, then: ChatResponseUpdate) -> ChatResponseUpdate:
    """Two updates of one read as one: contents in order, the last ids, model and finish
    reason, usage summed."""
    usage: UsageDetails | None = first.usage
    if then.usage is not None:
        usage = then.usage if usage is None else usage + then.usage
    return ChatResponseUpdate(
        first.role,
        [*first.contents, *then.contents],
        then.response_id or first.response_id,
        then.model_id or first.model_id,
        then.finish_reason or first.finish_reason,
        usage,
    )
