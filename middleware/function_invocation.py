"""The function-invocation layer: run the model's tool calls and loop until it answers.

At most `max_iterations` rounds; a tool's failure, invalid arguments or an unknown tool
become results the model reads, never exceptions; a turn's calls run in one task group,
cancelled together; each call is claimed by its idempotency key, so it runs once.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from typing import Annotated, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.trace import SpanKind
from pydantic import Field

from middleware.idempotency import (
    Claim,
    IdempotencyStore,
    MemoryIdempotencyStore,
    RedisIdempotencyStore,
    claiming_store,
    idempotency_key,
)
from middleware.tools import Tool, ToolArgumentsError, tool
from pipeline import _scope
from pipeline._genai import ERROR_STATUS
from pipeline._scope import operation_scope
from pipeline._semconv import INVALID_ARGUMENTS, TOOL_TYPE_FUNCTION, TOOLS_SCOPE, tracer
from pipeline._settings import Settings
from pipeline._streams import caller_cancelling, ending_of
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
    "Claim",
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
_INVOKE_AGENT = gen_ai.GenAiOperationNameValues.INVOKE_AGENT.value

_logger = logging.getLogger("chat_pipeline.tools")


class FunctionInvocationSettings(Settings):
    """How the tool loop runs: at most `max_iterations` rounds of tool calls, a turn's
    calls concurrently when `allow_concurrent`, exception detail in tool results only with
    `include_detailed_errors`; a tool call's idempotency claim holds for `claim_ttl`
    seconds (longer than your slowest tool: a run holds its key at most this long, and
    another caller waits at most this long for a run elsewhere; a process that dies
    mid-call frees its key after this long, or after the lease of a store whose claims are
    leases, such as the Redis store)."""

    max_iterations: Annotated[int, Field(ge=1)] = 10
    """Rounds of tool calls a request may run before the loop stops."""
    allow_concurrent: bool = True
    """Whether the tool calls of one turn run concurrently (under structured concurrency: a failing
    or cancelled request cancels and awaits every sibling)."""
    include_detailed_errors: bool = False
    """Whether a tool's exception message reaches the model in its tool result (default: the
    exception's type only)."""
    claim_ttl: Annotated[float, Field(gt=0, le=86_400)] = 300.0
    """Seconds a tool call's idempotency claim holds: longer than your slowest tool (a run holds its
    key at most this long, and another caller waits at most this long for a run elsewhere)."""


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
        idempotency_store: IdempotencyStore | Any = None,
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
            claiming_store(idempotency_store)
            if idempotency_store is not None
            else MemoryIdempotencyStore()
        )
        self._in_flight: dict[str, _SharedRun] = {}
        self._tracer = tracer(TOOLS_SCOPE, tracer_provider)

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
                gen_ai.GEN_AI_TOOL_TYPE: TOOL_TYPE_FUNCTION,
            },
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                result = await self._execute_once(key, definition, call.arguments)
            except asyncio.CancelledError as exc:
                if caller_cancelling():
                    raise
                # A tool's own stray CancelledError is a failure of the tool.
                return self._failure(span, call, exc)
            except Exception as exc:
                return self._failure(span, call, exc)
        return FunctionResultContent(call.call_id, result)

    def _failure(
        self, span: trace.Span, call: FunctionCallContent, exc: BaseException
    ) -> FunctionResultContent:
        invalid = isinstance(exc, ToolArgumentsError)
        span.set_attribute(ERROR_TYPE, INVALID_ARGUMENTS if invalid else type(exc).__name__)
        span.set_status(ERROR_STATUS)
        if invalid:
            detail = f" ({exc})" if self.include_detailed_errors else ""
            text = f"Error: invalid arguments for {call.name!r}{detail}."
        else:
            detail = f": {exc}" if self.include_detailed_errors else ""
            text = f"Error: {call.name!r} failed with {type(exc).__name__}{detail}."
        return FunctionResultContent(call.call_id, text, exc)

    async def _execute_once(self, key: str, definition: Tool, arguments: Mapping[str, Any]) -> Any:
        """Run the call once per key: identical calls overlapping in this layer share one
        run (registered before any await, so none can slip past), and the store's claim
        keeps other layers and processes from running it too."""
        run = self._in_flight.get(key)
        if run is None:
            run = _SharedRun(self._claim_and_run(key, definition, arguments))
            self._in_flight[key] = run
            run.task.add_done_callback(lambda _: self._forget(key, run))
        return await run.wait()

    def _forget(self, key: str, run: _SharedRun) -> None:
        if self._in_flight.get(key) is run:
            del self._in_flight[key]

    async def _claim_and_run(self, key: str, definition: Tool, arguments: Mapping[str, Any]) -> Any:
        claim = await self.store.claim(key, self.settings.claim_ttl)
        if claim.done:
            return claim.result
        try:
            result = await definition.invoke(arguments)
        except BaseException:
            await self._give_back(claim, definition)
            raise
        try:
            await self.store.complete(claim, result)
        except Exception as exc:
            # The tool ran: its result stands. Only the record is missing, so a retry
            # after the claim expires may run it again; say so (type only, no content).
            _logger.warning(
                "tool %r ran but its result could not be recorded (%s); a retry after "
                "its claim expires may run it again",
                definition.name,
                type(exc).__name__,
            )
        return result

    async def _give_back(self, claim: Claim, definition: Tool) -> None:
        try:
            await self.store.release(claim)
        except Exception as exc:  # the original failure matters more; the claim expires
            _logger.warning(
                "tool %r: giving its idempotency claim back failed (%s); it expires by itself",
                definition.name,
                type(exc).__name__,
            )

    async def _run_all(
        self, calls: Sequence[FunctionCallContent], operation_id: str
    ) -> list[FunctionResultContent]:
        if not self.allow_concurrent or len(calls) < 2:
            return [await self._run_one(c, operation_id) for c in calls]
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._run_one(c, operation_id)) for c in calls]
        except BaseExceptionGroup as failed:
            # Every sibling was cancelled and awaited; raise the failure as itself.
            if len(failed.exceptions) == 1:
                raise failed.exceptions[0] from None
            raise
        return [task.result() for task in tasks]

    @contextlib.contextmanager
    def _operation(self) -> Iterator[str]:
        current = _scope.current_operation()
        if current is not None:
            yield current
            return
        with operation_scope() as fresh:
            yield fresh

    # -- the loop --------------------------------------------------------------------------

    def _agent_span(self) -> trace.Span:
        """The span of one tool-using request: every model call (a telemetry layer beneath
        makes a ``chat`` span per call) and every ``execute_tool`` span nest under it."""
        return self._tracer.start_span(
            _INVOKE_AGENT,
            kind=SpanKind.INTERNAL,
            attributes={gen_ai.GEN_AI_OPERATION_NAME: _INVOKE_AGENT},
        )

    @staticmethod
    def _end_agent_span(
        span: trace.Span, error: BaseException | None, usage: UsageDetails | None
    ) -> None:
        if span.is_recording():
            if usage is not None and usage.input_tokens is not None:
                span.set_attribute(gen_ai.GEN_AI_USAGE_INPUT_TOKENS, usage.input_tokens)
            if usage is not None and usage.output_tokens is not None:
                span.set_attribute(gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS, usage.output_tokens)
            if error is not None and ending_of(error) == "failed":
                # The type only: a message may quote a tool's arguments or the prompt.
                span.set_attribute(ERROR_TYPE, type(error).__name__)
                span.set_status(ERROR_STATUS)
        span.end()

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        conversation = list(as_messages(messages))
        shaped = self._options(options)
        produced: list[ChatMessage] = []
        usage: UsageDetails | None = None
        span = self._agent_span()
        error: BaseException | None = None
        try:
            with self._operation() as operation_id, trace.use_span(span, end_on_exit=False):
                for iteration in range(self.max_iterations + 1):
                    response = await self.inner.get_response(conversation, shaped)
                    if response.usage is not None:
                        usage = response.usage if usage is None else usage + response.usage
                    produced.extend(response.messages)
                    calls = _calls_of(response.messages)
                    if not calls or iteration == self.max_iterations:
                        break
                    conversation.extend(response.messages)
                    results = await self._run_all(calls, operation_id)
                    results_message = ChatMessage(ChatRole.TOOL, results)
                    conversation.append(results_message)
                    produced.append(results_message)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._end_agent_span(span, error, usage)
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
        # while an update is with the caller, nor is the agent span current then (the
        # caller's own spans must not nest under it).
        operation_id = _scope.current_operation() or _scope.new_operation_id()
        span = self._agent_span()
        span_context = trace.set_span_in_context(span) if span.get_span_context().is_valid else None
        usage: UsageDetails | None = None
        error: BaseException | None = None
        try:
            for iteration in range(self.max_iterations + 1):
                turn: list[ChatResponseUpdate] = []
                async with contextlib.aclosing(
                    self.inner.get_streaming_response(conversation, shaped)
                ) as stream:
                    while True:
                        token = otel_context.attach(span_context) if span_context else None
                        try:
                            update = await stream.__anext__()
                        except StopAsyncIteration:
                            break
                        finally:
                            if token is not None:
                                otel_context.detach(token)
                        turn.append(update)
                        if update.usage is not None:
                            usage = update.usage if usage is None else usage + update.usage
                        yield update
                response = ChatResponse.from_updates(turn)
                calls = _calls_of(response.messages)
                if not calls or iteration == self.max_iterations:
                    return
                conversation.extend(response.messages)
                operation = _scope.set_operation(operation_id)
                span_token = otel_context.attach(span_context) if span_context else None
                try:
                    results = await self._run_all(calls, operation_id)
                finally:
                    if span_token is not None:
                        otel_context.detach(span_token)
                    _scope.reset_operation(operation)
                conversation.append(ChatMessage(ChatRole.TOOL, results))
                yield ChatResponseUpdate(role=ChatRole.TOOL, contents=list(results))
        except GeneratorExit:
            raise  # the caller stopped reading: not an error of the request
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._end_agent_span(span, error, usage)


class _SharedRun:
    """One run of a tool call that overlapping identical calls wait for.

    The run is a task of its own, shielded from every waiter: a waiter's cancellation
    ends only that waiter. When the last waiter leaves before the run ended, the run is
    cancelled and awaited, so no tool runs on for nobody.
    """

    __slots__ = ("task", "waiters")

    def __init__(self, run: Any) -> None:
        self.task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(run)
        self.waiters = 0

    async def wait(self) -> Any:
        self.waiters += 1
        try:
            return await asyncio.shield(self.task)
        finally:
            self.waiters -= 1
            if self.waiters == 0 and not self.task.done():
                self.task.cancel()
                await asyncio.wait({self.task})
                if not self.task.cancelled():
                    self.task.exception()  # retrieved: the waiter's own error propagates
