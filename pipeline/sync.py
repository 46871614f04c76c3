"""A synchronous facade for scripts and notebooks without an event loop.

`SyncChatClient` runs an async client on a private event loop. It is a convenience for
code that is not async; the async client stays the core. It cannot be used from inside a
running event loop (it raises `RuntimeError`): there, await the async client directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import TracebackType
from typing import Self

from pipeline.client import ChatClient, ensure_chat_client
from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages

__all__ = ["SyncChatClient"]


class SyncChatClient:
    """Blocking `get_response` and `stream` over an async `ChatClient`."""

    def __init__(self, client: ChatClient) -> None:
        self.client = ensure_chat_client(client)
        self._runner = asyncio.Runner()

    def _check_no_running_loop(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        raise RuntimeError(
            "SyncChatClient cannot run inside a running event loop; await the async client"
        )

    def get_response(self, messages: Messages, options: ChatOptions | None = None) -> ChatResponse:
        self._check_no_running_loop()
        return self._runner.run(self.client.get_response(messages, options))

    def stream(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> Iterator[ChatResponseUpdate]:
        """Yield updates as they arrive; closing the iterator early closes the stream."""
        self._check_no_running_loop()
        stream = self.client.get_streaming_response(messages, options)

        async def next_update() -> ChatResponseUpdate:
            return await stream.__anext__()

        try:
            while True:
                try:
                    yield self._runner.run(next_update())
                except StopAsyncIteration:
                    return
        finally:
            self._runner.run(stream.aclose())

    def close(self) -> None:
        """Close the client, then the private event loop."""
        try:
            self._runner.run(self.client.aclose())
        finally:
            self._runner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
