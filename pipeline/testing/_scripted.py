"""`ScriptedChatClient`: an in-process chat client that plays a script, one step per call.

Used by tests (through `pipeline.testing`), by the demo and by ``provider = "scripted"``
routes in configuration, which is why it lives in the core, apart from the test servers.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from pipeline._counting import CountWaiters
from pipeline.client import ChatClientMetadata, check_options
from pipeline.types import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    FunctionCallContent,
    Messages,
    TextContent,
    UsageDetails,
    as_messages,
)

__all__ = [
    "RecordedCall",
    "ScriptStep",
    "ScriptedChatClient",
    "call_tools",
    "fail",
    "fail_after",
    "hang",
    "reply",
]


@dataclass(frozen=True, slots=True)
class ScriptStep:
    """What one call does. Build steps with `reply`, `fail`, `fail_after`, `hang`, `call_tools`."""

    chunks: tuple[str, ...] = ()
    delay: float = 0.0
    chunk_delay: float = 0.0
    error: BaseException | None = None
    error_after_chunks: int | None = None
    hang_after_chunks: int | None = None
    close_error: BaseException | None = None
    tool_calls: tuple[FunctionCallContent, ...] = ()
    finish_reason: str | None = "stop"
    usage: UsageDetails | None = None

    def failing_on_close(self, exc: BaseException) -> ScriptStep:
        """This step, except that its stream raises `exc` when it is closed or runs out."""
        return dataclasses.replace(self, close_error=exc)

    @property
    def text(self) -> str:
        return "".join(self.chunks)


StepSource: TypeAlias = ScriptStep | Callable[[list[ChatMessage], ChatOptions | None], ScriptStep]


def reply(
    text: str,
    *,
    chunks: Sequence[str] | None = None,
    chunk_delay: float = 0.0,
    usage: UsageDetails | None = None,
    finish_reason: str = "stop",
    delay: float = 0.0,
) -> ScriptStep:
    """Answer `text` after `delay`; streamed as `chunks` (default: one) `chunk_delay` apart."""
    parts = tuple(chunks) if chunks is not None else ((text,) if text else ())
    if chunks is not None and "".join(parts) != text:
        raise ValueError("reply(): chunks must join to the text")
    return ScriptStep(
        chunks=parts, delay=delay, chunk_delay=chunk_delay, usage=usage, finish_reason=finish_reason
    )


def fail(exc: BaseException, *, delay: float = 0.0) -> ScriptStep:
    """Raise `exc` after `delay`, before any output: at the first `__anext__` when streaming."""
    return ScriptStep(error=exc, error_after_chunks=0, delay=delay, finish_reason=None)


def fail_after(
    chunks: Sequence[str], exc: BaseException, *, chunk_delay: float = 0.0
) -> ScriptStep:
    """Stream `chunks`, then raise `exc` (non-streaming calls just raise `exc`)."""
    return ScriptStep(
        chunks=tuple(chunks),
        chunk_delay=chunk_delay,
        error=exc,
        error_after_chunks=len(chunks),
        finish_reason=None,
    )


def hang(after: Sequence[str] = ()) -> ScriptStep:
    """Stream the chunks of `after` (if any), then wait until the call is cancelled."""
    return ScriptStep(chunks=tuple(after), hang_after_chunks=len(after), finish_reason=None)


def call_tools(*calls: FunctionCallContent, text: str = "") -> ScriptStep:
    """Ask for the given tool calls (with optional text before them)."""
    return ScriptStep(
        chunks=(text,) if text else (), tool_calls=tuple(calls), finish_reason="tool_calls"
    )


@dataclass(slots=True)
class RecordedCall:
    """One call a `ScriptedChatClient` received. `options` is the very object passed in."""

    messages: list[ChatMessage]
    options: ChatOptions | None
    streaming: bool
    options_snapshot: ChatOptions | None = field(default=None)


class ScriptedChatClient:
    """A chat client that plays `script`, one step per call.

    When the script runs out the last step repeats (or, with ``repeat_last=False``, the call
    raises `RuntimeError`). Counters: `call_count`, `calls`, `streams_opened`,
    `streams_closed` (every stream that ended, however), `streams_abandoned` (closed by the
    caller before the end), `close_count` (`aclose()` calls).
    """

    def __init__(
        self,
        script: str | StepSource | Sequence[StepSource] = "ok",
        *,
        name: str | None = "scripted",
        model_id: str = "scripted-model",
        provider_name: str = "scripted",
        repeat_last: bool = True,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if isinstance(script, str):
            steps: list[StepSource] = [reply(script)]
        elif isinstance(script, ScriptStep) or callable(script):
            steps = [script]
        else:
            steps = list(script)
        if not steps:
            raise ValueError("ScriptedChatClient needs at least one script step")
        self._steps = steps
        self._repeat_last = repeat_last
        self._sleep = sleep
        self._metadata = ChatClientMetadata(
            provider_name=provider_name, model_id=model_id, name=name
        )
        self.calls: list[RecordedCall] = []
        self.streams_opened = 0
        self.streams_closed = 0
        self.streams_abandoned = 0
        self.close_count = 0
        self._call_waiters = CountWaiters()

    @property
    def metadata(self) -> ChatClientMetadata:
        return self._metadata

    @property
    def call_count(self) -> int:
        return len(self.calls)

    async def wait_for_calls(self, count: int = 1) -> None:
        """Return once at least `count` calls have started."""
        await self._call_waiters.wait(len(self.calls), count)

    def _record(
        self, messages: Messages, options: ChatOptions | None, streaming: bool
    ) -> ScriptStep:
        normalized = list(as_messages(messages))
        check_options(options)
        index = len(self.calls)
        self.calls.append(
            RecordedCall(
                normalized, options, streaming, None if options is None else options.clone()
            )
        )
        self._call_waiters.notify(len(self.calls))
        if index >= len(self._steps) and not self._repeat_last:
            raise RuntimeError(f"script exhausted after {len(self._steps)} calls")
        source = self._steps[min(index, len(self._steps) - 1)]
        return source if isinstance(source, ScriptStep) else source(normalized, options)

    def _model_id(self, options: ChatOptions | None) -> str | None:
        return (options.model_id if options else None) or self._metadata.model_id

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        step = self._record(messages, options, streaming=False)
        if step.delay:
            await self._sleep(step.delay)
        if step.hang_after_chunks is not None:
            await asyncio.get_running_loop().create_future()
        if step.error is not None and step.error_after_chunks == 0:
            raise step.error
        for _ in step.chunks[1:]:
            if step.chunk_delay:
                await self._sleep(step.chunk_delay)
        if step.error is not None:
            raise step.error
        contents: list[TextContent | FunctionCallContent] = []
        if step.text:
            contents.append(TextContent(step.text))
        contents.extend(step.tool_calls)
        return ChatResponse(
            messages=[ChatMessage(ChatRole.ASSISTANT, contents)],
            response_id=f"scripted-{len(self.calls)}",
            model_id=self._model_id(options),
            finish_reason=step.finish_reason,
            usage=step.usage,
        )

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        step = self._record(messages, options, streaming=True)
        return self._stream(step, self._model_id(options), f"scripted-{len(self.calls)}")

    async def _stream(
        self, step: ScriptStep, model_id: str | None, response_id: str
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        self.streams_opened += 1
        try:
            if step.delay:
                await self._sleep(step.delay)
            for index, chunk in enumerate(step.chunks):
                if step.error is not None and index == step.error_after_chunks:
                    break
                if index and step.chunk_delay:
                    await self._sleep(step.chunk_delay)
                last = (
                    index == len(step.chunks) - 1
                    and not step.tool_calls
                    and step.error is None
                    and step.hang_after_chunks is None
                )
                yield ChatResponseUpdate(
                    role=ChatRole.ASSISTANT,
                    contents=[TextContent(chunk)],
                    response_id=response_id,
                    model_id=model_id,
                    finish_reason=step.finish_reason if last else None,
                    usage=step.usage if last else None,
                )
            if step.hang_after_chunks is not None:
                await asyncio.get_running_loop().create_future()
            if step.error is not None:
                raise step.error
            if step.tool_calls:
                yield ChatResponseUpdate(
                    role=ChatRole.ASSISTANT,
                    contents=list(step.tool_calls),
                    response_id=response_id,
                    model_id=model_id,
                    finish_reason=step.finish_reason,
                    usage=step.usage,
                )
        except GeneratorExit:
            self.streams_abandoned += 1
            raise
        finally:
            self.streams_closed += 1
            if step.close_error is not None:
                raise step.close_error

    async def aclose(self) -> None:
        self.close_count += 1

    def __repr__(self) -> str:
        return f"ScriptedChatClient(name={self._metadata.name!r}, calls={len(self.calls)})"
