"""`RoutingChatClient`: pick a client per request, and the attempt engine every router shares.

The engine owns the promise of this package: another attempt happens only while it is
still safe. For `get_response` and `get_streaming_response` alike:

* a failure before any output reached the caller may move to another route (failover
  routers only), unless the caller is being cancelled, the attempt limit or the request
  budget is reached, or the policy says no;
* once a streamed update reached the caller the attempt is terminal: the caller keeps the
  updates and gets the original exception, with a note naming the route;
* caller cancellation is terminal (`canceled`) and propagates; a `CancelledError` raised by
  a client while the caller's task is not being cancelled is an ordinary failure;
* a caller that closes the stream early ends the attempt as `abandoned`, and the inner
  stream is closed.

Every attempt is reported once, as a `FailoverAttempt`, through the routers' own hook.
"""

from __future__ import annotations

import abc
import asyncio
import contextvars
import inspect
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue

from middleware.routing._telemetry import RouteTelemetry
from middleware.routing.context import (
    AttemptOutcome,
    FailoverAttempt,
    Price,
    RequestBudget,
    Route,
    RoutingContext,
    RoutingSelection,
    SelectionResult,
    current_budget_var,
    new_operation_id,
    operation_id_var,
)
from pipeline.client import (
    AsyncClosing,
    ChatClient,
    ChatClientMetadata,
    client_name,
    ensure_chat_client,
)
from pipeline.errors import RequestBudgetExceededError, RoutingError
from pipeline.types import (
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    Messages,
    UsageDetails,
    as_messages,
)

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

__all__ = ["RoutingChatClient"]

Selector = Callable[[RoutingContext], SelectionResult | Awaitable[SelectionResult]]


def _caller_cancelling(exc: BaseException) -> bool:
    """True when `exc` is the caller's own cancellation, not one a client raised by itself."""
    if not isinstance(exc, asyncio.CancelledError):
        return False
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _caller_closing() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _close_stream(stream: AsyncGenerator[ChatResponseUpdate, None]) -> BaseException | None:
    """Close `stream`; return what closing raised instead of raising it."""
    try:
        await stream.aclose()
    except BaseException as exc:  # the caller decides what a failed close means
        return exc
    return None


class RoutingChatClient(AsyncClosing, abc.ABC):
    """A chat client that selects the client to call for each request.

    `select_client(context)` runs once per request and the selected client is invoked once.
    A `None` selection raises `RoutingError`; a selector that raises ends the request with
    its exception, and no attempt is reported. Subclasses that own their routes list them
    in `owned_clients()`; `aclose()` closes each of them once unless ``leave_open``.
    """

    def __init__(
        self,
        *,
        leave_open: bool = False,
        name: str | None = None,
        clock: Callable[[], float] = time.perf_counter,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        self.leave_open = leave_open
        self._clock = clock
        self._telemetry = RouteTelemetry(tracer_provider, meter_provider)
        self._metadata = ChatClientMetadata(
            provider_name="router", name=name or type(self).__name__
        )
        self._closed = False

    @classmethod
    def create(
        cls,
        selector: Selector,
        *,
        name: str | None = None,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> RoutingChatClient:
        """A router around a plain (sync or async) `selector(context)`.

        It never closes the clients the selector returns: it does not own them.
        """
        if not callable(selector):
            raise TypeError("RoutingChatClient.create() needs a callable selector")
        return _SelectorRoutingChatClient(
            selector, name=name, tracer_provider=tracer_provider, meter_provider=meter_provider
        )

    @abc.abstractmethod
    async def select_client(self, context: RoutingContext) -> SelectionResult:
        """Choose the client (or `Route`, or `RoutingSelection`) for the next attempt."""

    def owned_clients(self) -> Iterable[ChatClient]:
        """The clients this router closes on `aclose()` (none by default)."""
        return ()

    @property
    def metadata(self) -> ChatClientMetadata:
        return self._metadata

    def describe_layer(self) -> str:
        names = [client_name(c) for c in self.owned_clients()]
        return f"{type(self).__name__}({', '.join(names)})" if names else type(self).__name__

    async def aclose(self) -> None:
        """Close every owned client exactly once (unless ``leave_open``)."""
        if self._closed:
            return
        self._closed = True
        if self.leave_open:
            return
        seen: set[int] = set()
        errors: list[Exception] = []
        for client in self.owned_clients():
            if id(client) in seen:
                continue
            seen.add(id(client))
            try:
                await client.aclose()
            except Exception as exc:  # close the rest, then report every failure
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ExceptionGroup("closing routed clients failed", errors)

    # -- policy hooks (FailoverChatClient overrides them) ----------------------------------

    def _attempt_limit(self) -> int | None:
        """Most attempts one request may make, captured when the request starts."""
        return 1

    def _new_budget(self) -> RequestBudget | None:
        """The request's call and time budget, or `None` when no limit applies."""
        return current_budget_var.get()

    def _may_fail_over(self, context: RoutingContext, exc: BaseException) -> bool:
        return False

    def _report(self, context: RoutingContext, attempt: FailoverAttempt, terminal: bool) -> None:
        """Called once after every attempt; an exception here ends the request with it."""

    @property
    def _min_attempt_budget(self) -> float:
        return 0.0

    # -- the engine ------------------------------------------------------------------------

    def _context(
        self, messages: Messages, options: ChatOptions | None, streaming: bool
    ) -> RoutingContext:
        if options is not None and not isinstance(options, ChatOptions):
            raise TypeError(f"options must be ChatOptions or None, not {type(options).__name__}")
        return RoutingContext(
            as_messages(messages),
            options.clone() if options is not None else ChatOptions(),
            streaming=streaming,
        )

    async def _select(self, context: RoutingContext) -> _Attempt:
        result = await self.select_client(context)
        options: ChatOptions | None = None
        attributes: Mapping[str, AttributeValue] | None = None
        if isinstance(result, RoutingSelection):
            options = result.options
            attributes = result.attributes
            result = result.client
        if result is None:
            raise RoutingError(f"{self._metadata.name}: the selector chose no client")
        price = None
        if isinstance(result, Route):
            name, client, price = result.name, result.client, result.price
        else:
            client = ensure_chat_client(result, "the selected client")
            name = client_name(client)
        if options is None:
            # Each attempt gets its own copy, so nothing one attempt's layers do to its
            # options can reach the next attempt or the request baseline.
            options = context.options.clone()
        elif not isinstance(options, ChatOptions):
            raise TypeError("RoutingSelection.options must be ChatOptions or None")
        return _Attempt(name, client, options, price, attributes)

    def _is_terminal(
        self,
        context: RoutingContext,
        exc: BaseException,
        outcome: AttemptOutcome,
        limit: int | None,
        budget: RequestBudget | None,
    ) -> bool:
        if outcome != "failed_before_output" or not isinstance(
            exc, Exception | asyncio.CancelledError
        ):
            return True
        # The attempt being judged is not in context.attempts yet: it is number len + 1.
        if limit is not None and len(context.attempts) + 1 >= limit:
            return True
        if budget is not None:
            if budget.calls_left is not None and budget.calls_left <= 0:
                return True
            remaining = budget.remaining()
            if remaining is not None and remaining < max(self._min_attempt_budget, 1e-9):
                return True
        return not self._may_fail_over(context, exc)

    def _begin(
        self, context: RoutingContext, attempt: _Attempt, budget: RequestBudget | None
    ) -> None:
        if budget is not None and not budget.take_call():
            raise RequestBudgetExceededError(
                f"{self._metadata.name}: the request used every provider call it was allowed"
            )
        span = self._telemetry.start(attempt.route_name, len(context.attempts) + 1)
        attempt.span = span
        if attempt.attributes and span.is_recording():
            span.set_attributes(attempt.attributes)
        # A sampled-out span still carries a valid context its children must inherit (or
        # they would start traces of their own); only the no-op API's span has none.
        if span.get_span_context().is_valid:
            attempt.span_context = trace.set_span_in_context(span)

    @staticmethod
    def _enter(attempt: _Attempt, budget: RequestBudget | None) -> _Tokens:
        """Make the attempt span and the request budget current while the route runs."""
        return (
            otel_context.attach(attempt.span_context) if attempt.span_context is not None else None,
            current_budget_var.set(budget) if budget is not None else None,
        )

    @staticmethod
    def _exit(tokens: _Tokens) -> None:
        span_token, budget_token = tokens
        if budget_token is not None:
            current_budget_var.reset(budget_token)
        if span_token is not None:
            otel_context.detach(span_token)

    def _finish(
        self,
        context: RoutingContext,
        attempt: _Attempt,
        outcome: AttemptOutcome,
        exception: BaseException | None,
        duration: float,
        time_to_first_update: float | None,
        response_completed: bool,
        output_committed: bool,
        terminal: bool,
        usage: UsageDetails | None = None,
    ) -> None:
        record = FailoverAttempt(
            route_name=attempt.route_name,
            client=attempt.client,
            number=len(context.attempts) + 1,
            outcome=outcome,
            exception=exception,
            duration=duration,
            time_to_first_update=time_to_first_update,
            response_completed=response_completed,
            output_committed=output_committed,
        )
        context.attempts.append(record)
        if attempt.span is not None:
            self._telemetry.finish(attempt.span, record, terminal, attempt.price, usage)
        self._report(context, record, terminal)

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        context = self._context(messages, options, streaming=False)
        # Every route of this request shares one operation id, so a tool call that a route
        # completed before failing is not repeated by the next one.
        operation = (
            operation_id_var.set(new_operation_id()) if operation_id_var.get() is None else None
        )
        try:
            limit = self._attempt_limit()
            budget = self._new_budget()
            clock = self._clock
            while True:
                attempt = await self._select(context)
                self._begin(context, attempt, budget)
                started = clock()
                tokens = self._enter(attempt, budget)
                failure: BaseException | None = None
                try:
                    remaining = budget.remaining() if budget is not None else None
                    if remaining is None:
                        response = await attempt.client.get_response(
                            context.messages, attempt.options
                        )
                    else:
                        async with asyncio.timeout(remaining):
                            response = await attempt.client.get_response(
                                context.messages, attempt.options
                            )
                except BaseException as exc:
                    failure = exc
                finally:
                    self._exit(tokens)
                duration = clock() - started
                if failure is None:
                    self._finish(
                        context,
                        attempt,
                        "completed",
                        None,
                        duration,
                        duration,
                        True,
                        True,
                        True,
                        response.usage,
                    )
                    return response
                outcome: AttemptOutcome = (
                    "canceled" if _caller_cancelling(failure) else "failed_before_output"
                )
                terminal = self._is_terminal(context, failure, outcome, limit, budget)
                self._finish(
                    context, attempt, outcome, failure, duration, None, False, False, terminal
                )
                if terminal:
                    raise failure
        finally:
            if operation is not None:
                operation_id_var.reset(operation)

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return self._stream(self._context(messages, options, streaming=True))

    async def _stream(self, context: RoutingContext) -> AsyncGenerator[ChatResponseUpdate, None]:
        limit = self._attempt_limit()
        budget = self._new_budget()
        clock = self._clock
        while True:
            attempt = await self._select(context)
            self._begin(context, attempt, budget)
            elapsed = 0.0  # time spent inside the route, not with the caller
            first_update: float | None = None
            usage: UsageDetails | None = None
            error: BaseException | None = None
            stream: AsyncGenerator[ChatResponseUpdate, None] | None = None
            tokens = self._enter(attempt, budget)
            mark = clock()
            try:
                stream = attempt.client.get_streaming_response(context.messages, attempt.options)
            except BaseException as exc:
                error = exc
            finally:
                self._exit(tokens)
            elapsed += clock() - mark
            if stream is not None:
                # Without a span context or a budget there is nothing to make current: skip
                # the bookkeeping on every update.
                plain = attempt.span_context is None and budget is None
                while True:
                    tokens = _NO_TOKENS if plain else self._enter(attempt, budget)
                    mark = clock()
                    try:
                        remaining = budget.remaining() if budget is not None else None
                        if remaining is None:
                            update = await stream.__anext__()
                        else:
                            async with asyncio.timeout(remaining):
                                update = await stream.__anext__()
                    except StopAsyncIteration:
                        break
                    except BaseException as exc:
                        error = exc
                        break
                    finally:
                        elapsed += clock() - mark
                        if not plain:
                            self._exit(tokens)
                    if first_update is None:
                        first_update = elapsed
                    if update.usage is not None:
                        usage = update.usage if usage is None else usage + update.usage
                    try:
                        yield update
                    except BaseException:
                        # The caller closed the stream (GeneratorExit) or threw into it.
                        mark = clock()
                        close_error = await _close_stream(stream)
                        elapsed += clock() - mark
                        self._finish(
                            context,
                            attempt,
                            "canceled" if _caller_closing() else "abandoned",
                            close_error,
                            elapsed,
                            first_update,
                            False,
                            True,
                            True,
                        )
                        if close_error is not None:
                            raise close_error from None
                        raise
                mark = clock()
                close_error = await _close_stream(stream)
                elapsed += clock() - mark
                if error is None:
                    error = close_error
                elif close_error is not None:
                    error.add_note(
                        f"closing the stream of route {attempt.route_name!r} also failed: "
                        f"{type(close_error).__name__}"
                    )
            committed = first_update is not None
            if error is None:
                self._finish(
                    context,
                    attempt,
                    "completed",
                    None,
                    elapsed,
                    first_update,
                    True,
                    committed,
                    True,
                    usage,
                )
                return
            outcome: AttemptOutcome
            if _caller_cancelling(error):
                outcome = "canceled"
            elif committed:
                outcome = "failed_after_output"
                error.add_note(
                    f"chat-pipeline: route {attempt.route_name!r} failed after output was "
                    "committed to the caller; the streamed response is incomplete"
                )
            else:
                outcome = "failed_before_output"
            terminal = self._is_terminal(context, error, outcome, limit, budget)
            self._finish(
                context,
                attempt,
                outcome,
                error,
                elapsed,
                first_update,
                False,
                committed,
                terminal,
            )
            if terminal:
                raise error


_Tokens = tuple[
    "contextvars.Token[otel_context.Context] | None",
    "contextvars.Token[RequestBudget | None] | None",
]
_NO_TOKENS: _Tokens = (None, None)  # nothing was made current


class _Attempt:
    """What the engine knows about the attempt in progress."""

    __slots__ = ("attributes", "client", "options", "price", "route_name", "span", "span_context")

    def __init__(
        self,
        route_name: str,
        client: ChatClient,
        options: ChatOptions,
        price: Price | None,
        attributes: Mapping[str, AttributeValue] | None,
    ) -> None:
        self.route_name = route_name
        self.client = client
        self.options = options
        self.price = price
        self.attributes = attributes
        self.span: Span | None = None
        self.span_context: otel_context.Context | None = None


class _SelectorRoutingChatClient(RoutingChatClient):
    def __init__(
        self,
        selector: Selector,
        *,
        name: str | None,
        tracer_provider: TracerProvider | None,
        meter_provider: MeterProvider | None,
    ) -> None:
        super().__init__(
            leave_open=True,
            name=name,
            tracer_provider=tracer_provider,
            meter_provider=meter_provider,
        )
        self._selector = selector

    def describe_layer(self) -> str:
        return f"RoutingChatClient({getattr(self._selector, '__name__', 'selector')})"

    async def select_client(self, context: RoutingContext) -> SelectionResult:
        result = self._selector(context)
        if inspect.isawaitable(result):
            return await result
        return result
