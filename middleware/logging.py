"""The logging layer: one stdlib log record when a request starts and one when it ends.

Records hold the model, the duration, the update count and the outcome (the exception's
type, never its message): message content, tool data and credentials are never logged.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable

from pipeline.client import ChatClient, DelegatingChatClient, client_name
from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages

__all__ = ["LoggingChatClient"]

_DEFAULT_LOGGER = logging.getLogger("chat_pipeline")


class LoggingChatClient(DelegatingChatClient):
    """Logs request start (DEBUG) and end (INFO on success, WARNING on failure)."""

    def __init__(
        self,
        inner: ChatClient,
        logger: logging.Logger | None = None,
        *,
        leave_open: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__(inner, leave_open=leave_open)
        self.logger = logger or _DEFAULT_LOGGER
        self._clock = clock
        self._name = client_name(inner)

    def _model(self, options: ChatOptions | None) -> str:
        return (options.model_id if options else None) or self.inner.metadata.model_id or "-"

    def _end(
        self, kind: str, model: str, started: float, updates: int, error: BaseException | None
    ) -> None:
        duration_ms = (self._clock() - started) * 1000
        if error is None:
            self.logger.info(
                "chat %s done: client=%s model=%s duration_ms=%.1f updates=%d",
                kind,
                self._name,
                model,
                duration_ms,
                updates,
            )
        else:
            self.logger.warning(
                "chat %s failed: client=%s model=%s duration_ms=%.1f updates=%d error=%s",
                kind,
                self._name,
                model,
                duration_ms,
                updates,
                type(error).__name__,
            )

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        model = self._model(options)
        self.logger.debug("chat request start: client=%s model=%s", self._name, model)
        started = self._clock()
        try:
            response = await self.inner.get_response(messages, options)
        except BaseException as exc:
            self._end("request", model, started, 0, exc)
            raise
        self._end("request", model, started, 1, None)
        return response

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return self._stream(
            self.inner.get_streaming_response(messages, options), self._model(options)
        )

    async def _stream(
        self, inner: AsyncGenerator[ChatResponseUpdate, None], model: str
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        self.logger.debug("chat stream start: client=%s model=%s", self._name, model)
        started = self._clock()
        updates = 0
        try:
            async with contextlib.aclosing(inner):
                async for update in inner:
                    updates += 1
                    yield update
        except GeneratorExit:
            self.logger.info(
                "chat stream abandoned by caller: client=%s model=%s updates=%d",
                self._name,
                model,
                updates,
            )
            raise
        except BaseException as exc:
            self._end("stream", model, started, updates, exc)
            raise
        self._end("stream", model, started, updates, None)
