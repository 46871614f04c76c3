"""The function-invocation layer: run the model's tool calls and loop until it answers.

Promises, for `get_response` and `get_streaming_response` alike:

* model turn -> tool calls -> tool results -> model turn, at most `max_iterations` rounds
  of tool calls; after the last round the model's response is returned as it is;
* the tools are offered to the model on a clone of the options (the caller's object is
  never mutated); tool calls of one turn run concurrently when `allow_concurrent`;
* arguments are validated against the tool's signature before the call; a tool that
  raises, invalid arguments and unknown tool names become tool results the model can read
  (the exception's type only, unless ``include_detailed_errors=True``), never exceptions;
* every tool call has an idempotency key made of the request's operation id, the tool name
  and the canonical arguments; a call whose key is recorded as completed in the store is
  not executed again: its recorded result is reused. The operation id is the one of the
  enclosing `operation_scope`, else the one a router set for the request (so the routes of
  one non-streaming request share it), else a fresh one per request;
* streaming: the model's updates (tool calls included) are forwarded as they come, and
  each round's tool results are yielded as one update with role ``tool``;
* tool arguments and results never reach logs or telemetry (tool spans carry the tool name
  and call id only).

Order matters: a router outside this layer runs one route per whole tool loop (on a
non-streaming failover the backup starts the loop again, and the idempotency store keeps
side effects from repeating); a router inside it may pick a route per model turn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from typing import Annotated, Any

from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.trace import SpanKind, Status, StatusCode
from pydantic import Field

from middleware.idempotency import (
    IdempotencyStore,
    MemoryIdempotencyStore,
    RedisIdempotencyStore,
    idempotency_key,
)
from middleware.tools import Tool, ToolArgumentsError, tool
from pipeline import _scope
from pipeline._scope import operation_scope
from pipeline._settings import Settings
from pipeline.client import ChatClient, DelegatingChatClient
from pipeline.types import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    FunctionCallContent,
    FunctionResultContent,
    Messages,
    UsageDetails,
    as_messages,
)

__all__ = [
    "FunctionInvocationSettings",
    "FunctionInvokingChatClient",
    "IdempotencyStore",
    "MemoryIdempotencyStore",
    "RedisIdempotencyStore",
    "Tool",
    "ToolArgumentsError",
    "idempotency_key",
    "tool_table",
    "operation_scope",
    "tool",
]

_EXECUTE_TOOL = gen_ai.GenAiOperationNameValues.EXECUTE_TOOL.value


class FunctionInvocationSettings(Settings):
    """How the tool loop runs: at most `max_iterations` rounds of tool calls, a turn's
    calls concurrently when `allow_concurrent`, exception detail in tool results only with
    `include_detailed_errors`."""

    max_iterations: Annotated[int, Field(ge=1)] = 10
    allow_concurrent: bool = True
    include_detailed_errors: bool = False


def tool_table(tools: Sequence[Tool | Callable[..., Any]]) -> dict[str, Tool]:
    """Tools by name (functions become `Tool`s); `TypeError`/`ValueError` for bad ones."""
    if isinstance(tools, str) or not isinstance(tools, Sequence):
        raise TypeError("tools must be a sequence of Tool objects or functions")
    table: dict[str, Tool] = {}
    for item in tools:
        definition = item if isinstance(item, Tool) else Tool.from_function(item)
        if definition.name in table:
            raise ValueError(f"two tools are named {definition.name!r}")
        table[definition.name] = definition
    return table


def _calls_of(messages: Sequence[ChatMessage]) -> list[FunctionCallContent]:
    return [c for m in messages for c in m.contents if isinstance(c, FunctionCallContent)]


class FunctionInvokingChatClient(DelegatingChatClient):
    """Runs tool calls and loops (see the module docstring)."""

    def __init__(
        self,
        inner: ChatClient,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        settings: FunctionInvocationSettings | None = None,
        *,
        idempotency_store: IdempotencyStore | None = None,
        tracer_provider: Any = None,
        leave_open: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(inner, leave_open=leave_open)
        self.settings = FunctionInvocationSettings.from_options(settings, options)
        self.tools = tool_table(tools)
        self.max_iterations = self.settings.max_iterations
        self.allow_concurrent = self.settings.allow_concurrent
        self.include_detailed_errors = self.settings.include_detailed_errors
        # `is None`, not `or`: an empty store is falsy (it has a length) but must be kept.
        self.store: IdempotencyStore = (
            idempotency_store if idempotency_store is not None else MemoryIdempotencyStore()
        )
        self._in_flight: dict[str, asyncio.Future[Any]] = {}
        from pipeline import __version__

        self._tracer = trace.get_tracer("chat_pipeline.tools", __version__, tracer_provider)

    def describe_layer(self) -> str:
        return f"FunctionInvokingChatClient({', '.join(self.tools)})"

    def _options(self, options: ChatOptions | None) -> ChatOptions:
        shaped = options.clone() if options is not None else ChatOptions()
        offered = {getattr(t, "name", None) for t in shaped.tools or []}
        shaped.tools = [
            *(shaped.tools or []),
            *(t for t in self.tools.values() if t.name not in offered),
        ]
        return shaped

    # -- running calls ---------------------------------------------------------------------

    async def _run_one(self, call: FunctionCallContent, operation_id: str) -> FunctionResultContent:
        definition = self.tools.get(call.name)
        if definition is None:
            return FunctionResultContent(
                call.call_id, f"Error: there is no tool named {call.name!r}."
            )
        key = idempotency_key(operation_id, call.name, call.arguments)
        with self._tracer.start_as_current_span(
            f"{_EXECUTE_TOOL} {call.name}",
            kind=SpanKind.INTERNAL,
            attributes={
                gen_ai.GEN_AI_OPERATION_NAME: _EXECUTE_TOOL,
                gen_ai.GEN_AI_TOOL_NAME: call.name,
                gen_ai.GEN_AI_TOOL_CALL_ID: call.call_id,
            },
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                result = await self._execute_once(key, definition, call.arguments)
            except Exception as exc:
                invalid = isinstance(exc, ToolArgumentsError)
                span.set_attribute(
                    ERROR_TYPE, "invalid_arguments" if invalid else type(exc).__name__
                )
                span.set_status(Status(StatusCode.ERROR))
                if invalid:
                    detail = f" ({exc})" if self.include_detailed_errors else ""
                    text = f"Error: invalid arguments for {call.name!r}{detail}."
                else:
                    detail = f": {exc}" if self.include_detailed_errors else ""
                    text = f"Error: {call.name!r} failed with {type(exc).__name__}{detail}."
                return FunctionResultContent(call.call_id, text, exc)
        return FunctionResultContent(call.call_id, result)

    async def _execute_once(self, key: str, definition: Tool, arguments: Mapping[str, Any]) -> Any:
        """Execute unless the store has the key; identical concurrent calls share one run."""
        found, result = await self.store.get(key)
        if found:
            return result
        running = self._in_flight.get(key)
        if running is not None:
            return await asyncio.shield(running)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        try:
            result = await definition.invoke(arguments)
            await self.store.put(key, result)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved here: the waiters (if any) get it too
            raise
        else:
            future.set_result(result)
        finally:
            del self._in_flight[key]
        return result

    async def _run_all(
        self, calls: Sequence[FunctionCallContent], operation_id: str
    ) -> list[FunctionResultContent]:
        if self.allow_concurrent and len(calls) > 1:
            return list(await asyncio.gather(*(self._run_one(c, operation_id) for c in calls)))
        return [await self._run_one(c, operation_id) for c in calls]

    @contextlib.contextmanager
    def _operation(self) -> Iterator[str]:
        current = _scope.current_operation()
        if current is not None:
            yield current
            return
        with operation_scope() as fresh:
            yield fresh

    # -- the loop --------------------------------------------------------------------------

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        conversation = list(as_messages(messages))
        shaped = self._options(options)
        produced: list[ChatMessage] = []
        usage: UsageDetails | None = None
        with self._operation() as operation_id:
            for iteration in range(self.max_iterations + 1):
                response = await self.inner.get_response(conversation, shaped)
                if response.usage is not None:
                    usage = response.usage if usage is None else usage + response.usage
                produced.extend(response.messages)
                calls = _calls_of(response.messages)
                if not calls or iteration == self.max_iterations:
                    break
                conversation.extend(response.messages)
                results = ChatMessage(ChatRole.TOOL, await self._run_all(calls, operation_id))
                conversation.append(results)
                produced.append(results)
        return ChatResponse(
            messages=produced,
            response_id=response.response_id,
            model_id=response.model_id,
            finish_reason=response.finish_reason,
            usage=usage,
            value=response.value,  # the final turn's validated answer, if a layer checked it
        )

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return self._stream(list(as_messages(messages)), self._options(options))

    async def _stream(
        self, conversation: list[ChatMessage], shaped: ChatOptions
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        # The operation id is fixed once; it is never left set in the caller's context
        # while an update is with the caller.
        operation_id = _scope.current_operation() or _scope.new_operation_id()
        for iteration in range(self.max_iterations + 1):
            turn: list[ChatResponseUpdate] = []
            async with contextlib.aclosing(
                self.inner.get_streaming_response(conversation, shaped)
            ) as stream:
                async for update in stream:
                    turn.append(update)
                    yield update
            response = ChatResponse.from_updates(turn)
            calls = _calls_of(response.messages)
            if not calls or iteration == self.max_iterations:
                return
            conversation.extend(response.messages)
            token = _scope.set_operation(operation_id)
            try:
                results = await self._run_all(calls, operation_id)
            finally:
                _scope.reset_operation(token)
            conversation.append(ChatMessage(ChatRole.TOOL, results))
            yield ChatResponseUpdate(role=ChatRole.TOOL, contents=list(results))
