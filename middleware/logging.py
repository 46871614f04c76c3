"""The logging layer: one stdlib log record when a request starts and one when it ends.

Records hold the model, the duration, the update count and the outcome (the exception's
type, never its message): message content, tool data and credentials are never logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable

from pipeline._streams import StreamEnd, StreamWatcher, forward
from pipeline.client import ChatClient, DelegatingChatClient, client_name, metadata_of
from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages

__all__ = ["LoggingChatClient"]

_DEFAULT_LOGGER = logging.getLogger("chat_pipeline")


class LoggingChatClient(DelegatingChatClient):
    """Logs request start (DEBUG) and end (INFO on success, WARNING on failure; INFO when
    the caller abandons or cancels a stream)."""

    keeps_raw_answers = True  # observes, never changes answers (`pipeline._forward`)

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
        self._default_model = metadata_of(inner).model_id or "-"

    def _model(self, options: ChatOptions | None) -> str:
        return (options.model_id if options else None) or self._default_model

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
        model = self._model(options)
        self.logger.debug("chat stream start: client=%s model=%s", self._name, model)
        watcher = _StreamLog(self, model, self._clock())
        return forward(lambda: self.inner.get_streaming_response(messages, options), watcher)


class _StreamLog(StreamWatcher):
    __slots__ = ("layer", "model", "started", "updates")
    counts_updates = True

    def __init__(self, layer: LoggingChatClient, model: str, started: float) -> None:
        self.layer = layer
        self.model = model
        self.started = started
        self.updates = 0

    def end(self, how: StreamEnd, error: BaseException | None) -> None:
        layer = self.layer
        if how in ("abandoned", "canceled"):
            layer.logger.info(
                "chat stream %s by caller: client=%s model=%s updates=%d",
                how,
                layer._name,
                self.model,
                self.updates,
            )
            return
        layer._end("stream", self.model, self.started, self.updates, error)
