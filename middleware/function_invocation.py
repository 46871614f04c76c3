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
import dataclasses
import hashlib
import inspect
import json
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, get_type_hints, runtime_checkable

import pydantic
from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.trace import SpanKind, Status, StatusCode

from middleware.routing.context import new_operation_id, operation_id_var
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
    "FunctionInvokingChatClient",
    "IdempotencyStore",
    "MemoryIdempotencyStore",
    "RedisIdempotencyStore",
    "Tool",
    "idempotency_key",
    "operation_scope",
    "tool",
]

_EXECUTE_TOOL = gen_ai.GenAiOperationNameValues.EXECUTE_TOOL.value


class _ToolArgumentsError(ValueError):
    """Arguments that do not fit the tool's signature (fields and error types only)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call: `name`, `description`, JSON-schema `parameters`.

    Build one with `Tool.from_function(fn)` or the `tool` decorator; calling `invoke`
    validates the arguments against the signature first.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any]
    arguments_model: type[pydantic.BaseModel] = dataclasses.field(repr=False)

    @classmethod
    def from_function(
        cls,
        function: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
    ) -> Tool:
        """Name from the function, description from its docstring, schema from its signature.

        Parameters need type annotations; ``*args``/``**kwargs`` are not supported.
        """
        if not callable(function):
            raise TypeError("Tool.from_function needs a callable")
        tool_name = name or getattr(function, "__name__", None)
        if not tool_name or not isinstance(tool_name, str):
            raise ValueError("a tool needs a name")
        signature = inspect.signature(function)
        try:
            hints = get_type_hints(function)
        except Exception as exc:
            raise TypeError(f"tool {tool_name!r}: cannot resolve its type hints") from exc
        fields: dict[str, Any] = {}
        for parameter in signature.parameters.values():
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                raise TypeError(f"tool {tool_name!r}: *args and **kwargs are not supported")
            if parameter.name not in hints:
                raise TypeError(
                    f"tool {tool_name!r}: parameter {parameter.name!r} needs a type annotation"
                )
            default = ... if parameter.default is parameter.empty else parameter.default
            fields[parameter.name] = (hints[parameter.name], default)
        model = pydantic.create_model(f"{tool_name}_arguments", **fields)
        schema = model.model_json_schema()
        schema.pop("title", None)
        return cls(
            name=tool_name,
            description=(description or inspect.getdoc(function) or "").strip(),
            parameters=schema,
            function=function,
            arguments_model=model,
        )

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments for the function, or `_ToolArgumentsError`."""
        try:
            parsed = self.arguments_model.model_validate(dict(arguments))
        except pydantic.ValidationError as exc:
            # Locations and error types only: the offending values may be user content.
            problems = "; ".join(
                f"{'.'.join(str(p) for p in error['loc']) or '(arguments)'}: {error['type']}"
                for error in exc.errors()
            )
            raise _ToolArgumentsError(problems) from None
        return {name: getattr(parsed, name) for name in type(parsed).model_fields}

    async def invoke(self, arguments: Mapping[str, Any]) -> Any:
        """Validate `arguments` and call the function (awaiting it when it is async)."""
        result = self.function(**self.validate(arguments))
        if inspect.isawaitable(result):
            result = await result
        return result


def tool(
    function: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
) -> Any:
    """Decorator: ``@tool`` or ``@tool(name=..., description=...)`` turns a function into a
    `Tool`."""
    if function is not None:
        return Tool.from_function(function, name=name, description=description)
    return lambda fn: Tool.from_function(fn, name=name, description=description)


# -- idempotency ----------------------------------------------------------------------------


@runtime_checkable
class IdempotencyStore(Protocol):
    """Where completed tool calls are recorded, by idempotency key."""

    async def get(self, key: str) -> tuple[bool, Any]:
        """``(True, result)`` when `key` is recorded as completed, else ``(False, None)``."""
        ...

    async def put(self, key: str, result: Any) -> None: ...


class MemoryIdempotencyStore:
    """An in-process store (the default). Bounded: the oldest keys are forgotten first."""

    def __init__(self, max_entries: int = 10_000) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self._results: dict[str, Any] = {}

    async def get(self, key: str) -> tuple[bool, Any]:
        if key in self._results:
            return True, self._results[key]
        return False, None

    async def put(self, key: str, result: Any) -> None:
        self._results[key] = result
        while len(self._results) > self.max_entries:
            del self._results[next(iter(self._results))]

    def __len__(self) -> int:
        return len(self._results)


class RedisIdempotencyStore:
    """Shares completed tool calls between processes through Redis (``redis.asyncio``).

    Results are stored as JSON (tools used with it must return JSON-serializable values)
    under ``{namespace}:{key}`` for `ttl` seconds.
    """

    def __init__(
        self, redis: Any, *, namespace: str = "chat_pipeline:tool", ttl: float = 86_400
    ) -> None:
        if isinstance(redis, str):
            import redis.asyncio as redis_asyncio

            redis = redis_asyncio.Redis.from_url(redis)
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        self._redis = redis
        self.namespace = namespace
        self.ttl = ttl

    async def get(self, key: str) -> tuple[bool, Any]:
        raw = await self._redis.get(f"{self.namespace}:{key}")
        if raw is None:
            return False, None
        return True, json.loads(raw)

    async def put(self, key: str, result: Any) -> None:
        await self._redis.set(
            f"{self.namespace}:{key}", json.dumps(result), px=int(self.ttl * 1000)
        )

    async def aclose(self) -> None:
        await self._redis.aclose()


def idempotency_key(operation_id: str, tool_name: str, arguments: Mapping[str, Any]) -> str:
    """A stable key for one tool call: operation id, tool name, canonical JSON arguments."""
    canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(f"{operation_id}\0{tool_name}\0{canonical}".encode())
    return digest.hexdigest()


@contextlib.contextmanager
def operation_scope(operation_id: str | None = None) -> Iterator[str]:
    """Run requests under one operation id, so tool calls are idempotent across them (for
    example when the caller retries a whole request)."""
    value = operation_id or new_operation_id()
    token = operation_id_var.set(value)
    try:
        yield value
    finally:
        operation_id_var.reset(token)


# -- the layer ------------------------------------------------------------------------------


def _calls_of(messages: Sequence[ChatMessage]) -> list[FunctionCallContent]:
    return [c for m in messages for c in m.contents if isinstance(c, FunctionCallContent)]


class FunctionInvokingChatClient(DelegatingChatClient):
    """Runs tool calls and loops (see the module docstring)."""

    def __init__(
        self,
        inner: ChatClient,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        *,
        max_iterations: int = 10,
        allow_concurrent: bool = True,
        idempotency_store: IdempotencyStore | None = None,
        include_detailed_errors: bool = False,
        tracer_provider: Any = None,
        leave_open: bool = False,
    ) -> None:
        super().__init__(inner, leave_open=leave_open)
        self.validate_options(tools=tools, max_iterations=max_iterations)
        self.tools: dict[str, Tool] = {}
        for item in tools:
            definition = item if isinstance(item, Tool) else Tool.from_function(item)
            if definition.name in self.tools:
                raise ValueError(f"two tools are named {definition.name!r}")
            self.tools[definition.name] = definition
        self.max_iterations = max_iterations
        self.allow_concurrent = allow_concurrent
        # `is None`, not `or`: an empty store is falsy (it has a length) but must be kept.
        self.store: IdempotencyStore = (
            idempotency_store if idempotency_store is not None else MemoryIdempotencyStore()
        )
        self.include_detailed_errors = include_detailed_errors
        self._in_flight: dict[str, asyncio.Future[Any]] = {}
        from pipeline import __version__

        self._tracer = trace.get_tracer("chat_pipeline.tools", __version__, tracer_provider)

    @staticmethod
    def validate_options(*, tools: Sequence[Any] = (), max_iterations: int = 10, **_: Any) -> None:
        """Raise `TypeError`/`ValueError` for options the constructor would refuse."""
        if isinstance(tools, str) or not isinstance(tools, Sequence):
            raise TypeError("tools must be a sequence of Tool objects or functions")
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int):
            raise TypeError("max_iterations must be an int")
        if max_iterations < 1:
            raise ValueError(f"max_iterations must be at least 1, got {max_iterations}")

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
                invalid = isinstance(exc, _ToolArgumentsError)
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
        current = operation_id_var.get()
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
        operation_id = operation_id_var.get() or new_operation_id()
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
            token = operation_id_var.set(operation_id)
            try:
                results = await self._run_all(calls, operation_id)
            finally:
                operation_id_var.reset(token)
            conversation.append(ChatMessage(ChatRole.TOOL, results))
            yield ChatResponseUpdate(role=ChatRole.TOOL, contents=list(results))
