"""The response-validation layer: check each response's shape before the caller trusts it.

A valid answer comes back with `ChatResponse.value` set; an invalid one raises
`ResponseValidationError`, whose message never quotes the response; a turn asking for
tool calls passes unchecked.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncGenerator
from typing import Any

from pipeline._settings import Settings
from pipeline._streams import OpenedLater, StreamWatcher, forward
from pipeline._validation import ShapeCheck
from pipeline.client import ChatClient, DelegatingChatClient, client_name
from pipeline.errors import ResponseValidationError
from pipeline.types import (
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    FunctionCallContent,
    Messages,
)

__all__ = ["ResponseValidationChatClient", "ResponseValidationSettings"]

Updates = AsyncGenerator[ChatResponseUpdate, None]


class ResponseValidationSettings(Settings):
    """How responses are validated: `buffer_streams` holds streamed updates until the
    response validated (so a streamed request can still fail over); `strip_fences` accepts
    JSON wrapped in one markdown code fence."""

    buffer_streams: bool = False
    """Hold a stream's updates until the whole answer validated, so an invalid streamed answer fails
    before output and the router can still fail over."""
    strip_fences: bool = False
    """Also accept an answer that is exactly one markdown code fence around the JSON (prose around a
    fence still fails)."""


def _asks_for_tools(response: ChatResponse) -> bool:
    if not response.messages:
        return False
    return any(type(content) is FunctionCallContent for content in response.messages[-1].contents)


class _Collect(StreamWatcher):
    """Keeps every update of a stream (the response is validated from them)."""

    __slots__ = ("updates",)

    def __init__(self) -> None:
        self.updates: list[ChatResponseUpdate] = []

    def update(self, update: ChatResponseUpdate) -> None:
        self.updates.append(update)


class ResponseValidationChatClient(DelegatingChatClient):
    """Validates every response of the inner client (see the module docstring).

    `validator` is a pydantic model class, a JSON schema dict or a callable taking the
    `ChatResponse`; keyword `options` are the fields of `ResponseValidationSettings`. A bad
    validator (or a schema that is not a valid JSON schema) fails here, at construction.
    """

    def __init__(
        self,
        inner: ChatClient,
        validator: Any,
        settings: ResponseValidationSettings | None = None,
        *,
        leave_open: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(inner, leave_open=leave_open)
        self.settings = ResponseValidationSettings.from_options(settings, options)
        self.check = ShapeCheck(validator, strip_fences=self.settings.strip_fences)
        self._provider = client_name(inner)

    def describe_layer(self) -> str:
        buffered = ", buffered" if self.settings.buffer_streams else ""
        return f"ResponseValidationChatClient({self.check.name}{buffered})"

    async def _validate(self, response: ChatResponse) -> Any:
        """The validated value of `response`; raises `ResponseValidationError`."""
        try:
            value = self.check(response)
            if self.check.may_await and inspect.isawaitable(value):
                value = await value
        except ResponseValidationError as error:
            if error.provider is None:
                error.provider = self._provider
            if error.usage is None:
                error.usage = response.usage  # what the refused answer cost (spend ledger)
            raise
        return value

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        response = await self.inner.get_response(messages, options)
        if _asks_for_tools(response):
            return response
        value = await self._validate(response)
        # A copy (the constructor, cheaper than dataclasses.replace): the inner client's
        # object may be shared, by a cache for example.
        return ChatResponse(
            messages=response.messages,
            response_id=response.response_id,
            model_id=response.model_id,
            finish_reason=response.finish_reason,
            usage=response.usage,
            value=value,
        )

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> Updates:
        if self.settings.buffer_streams:
            return OpenedLater(lambda: self._buffer(messages, options))
        return self._checked(messages, options)

    async def _value_update(self, updates: list[ChatResponseUpdate]) -> ChatResponseUpdate | None:
        """Validate the response `updates` make; the update carrying its value, if any."""
        response = ChatResponse.from_updates(updates)
        if _asks_for_tools(response):
            return None
        value = await self._validate(response)
        if value is None:
            return None
        return ChatResponseUpdate(
            role=ChatRole.ASSISTANT,
            response_id=response.response_id,
            model_id=response.model_id,
            value=value,
        )

    async def _checked(self, messages: Messages, options: ChatOptions | None) -> Updates:
        collect = _Collect()
        inner = forward(lambda: self.inner.get_streaming_response(messages, options), collect)
        try:
            async for update in inner:
                yield update
        finally:
            # Closing a finished generator does nothing; closing one the caller left (at
            # our yield) closes the inner stream the way `forward` promises.
            await inner.aclose()
        last = await self._value_update(collect.updates)
        if last is not None:
            yield last

    async def _buffer(
        self, messages: Messages, options: ChatOptions | None
    ) -> tuple[Updates, ChatResponseUpdate | None]:
        collect = _Collect()
        # Read to the end (the inner stream is bounded by its provider and closed by
        # `forward` however it ends), then validate before anything is released.
        async for _ in forward(
            lambda: self.inner.get_streaming_response(messages, options), collect
        ):
            pass
        updates = collect.updates
        last = await self._value_update(updates)
        if last is not None:
            updates.append(last)
        if not updates:
            return _release([]), None
        return _release(updates[1:]), updates[0]


async def _release(updates: list[ChatResponseUpdate]) -> Updates:
    for update in updates:
        yield update
