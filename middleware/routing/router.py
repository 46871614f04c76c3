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
import inspect
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from types import TracebackType
from typing import Self

from middleware.routing.context import (
    AttemptOutcome,
    FailoverAttempt,
    RequestBudget,
    Route,
    RoutingContext,
    RoutingSelection,
    SelectionResult,
    current_budget_var,
)
from pipeline.client import ChatClient, ChatClientMetadata, client_name, ensure_chat_client
from pipeline.errors import RoutingError
from pipeline.types import (
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    Messages,
    as_messages,
)

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


class RoutingChatClient(abc.ABC):
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
    ) -> None:
        self.leave_open = leave_open
        self._clock = clock
        self._metadata = ChatClientMetadata(
            provider_name="router", name=name or type(self).__name__
        )
        self._closed = False

    @classmethod
    def create(cls, selector: Selector, *, name: str | None = None) -> RoutingChatClient:
        """A router around a plain (sync or async) `selector(context)`.

        It never closes the clients the selector returns: it does not own them.
        """
        if not callable(selector):
            raise TypeError("RoutingChatClient.create() needs a callable selector")
        return _SelectorRoutingChatClient(selector, name=name)

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

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- policy hooks (FailoverChatClient overrides them) ----------------------------------

    def _attempt_limit(self) -> int | None:
        """Most attempts one request may make, captured when the request starts."""
        return 1

    def _new_budget(self) -> RequestBudget | None:
        """The request's call and time budget, or `None` when no limit applies."""
        return current_budget_var.get()

    def _may_fail_over(self, context: RoutingContext, exc: BaseException) -> bool:
        return False

    def _report(  # noqa: B027 - a hook: doing nothing is the one-shot router's policy
        self, context: RoutingContext, attempt: FailoverAttempt, terminal: bool
    ) -> None:
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

    async def _select(self, context: RoutingContext) -> tuple[str, ChatClient, ChatOptions]:
        result = await self.select_client(context)
        options: ChatOptions | None = None
        if isinstance(result, RoutingSelection):
            options = result.options
            result = result.client
        if result is None:
            raise RoutingError(f"{self._metadata.name}: the selector chose no client")
        if isinstance(result, Route):
            name, client = result.name, result.client
        else:
            client = ensure_chat_client(result, "the selected client")
            name = client_name(client)
        if options is None:
            # Each attempt gets its own copy, so nothing one attempt's layers do to its
            # options can reach the next attempt or the request baseline.
            options = context.options.clone()
        elif not isinstance(options, ChatOptions):
            raise TypeError("RoutingSelection.options must be ChatOptions or None")
        return name, client, options

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

    def _finish(
        self,
        context: RoutingContext,
        route_name: str,
        client: ChatClient,
        outcome: AttemptOutcome,
        exception: BaseException | None,
        duration: float,
        time_to_first_update: float | None,
        response_completed: bool,
        output_committed: bool,
        terminal: bool,
    ) -> None:
        attempt = FailoverAttempt(
            route_name=route_name,
            client=client,
            number=len(context.attempts) + 1,
            outcome=outcome,
            exception=exception,
            duration=duration,
            time_to_first_update=time_to_first_update,
            response_completed=response_completed,
            output_committed=output_committed,
        )
        context.attempts.append(attempt)
        self._report(context, attempt, terminal)

    def _start_attempt(self, budget: RequestBudget | None) -> None:
        if budget is not None and not budget.take_call():
            from pipeline.errors import RequestBudgetExceededError

            raise RequestBudgetExceededError(
                f"{self._metadata.name}: the request used every provider call it was allowed"
            )

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        context = self._context(messages, options, streaming=False)
        limit = self._attempt_limit()
        budget = self._new_budget()
        clock = self._clock
        while True:
            name, client, attempt_options = await self._select(context)
            self._start_attempt(budget)
            started = clock()
            token = current_budget_var.set(budget) if budget is not None else None
            try:
                remaining = budget.remaining() if budget is not None else None
                if remaining is None:
                    response = await client.get_response(context.messages, attempt_options)
                else:
                    async with asyncio.timeout(remaining):
                        response = await client.get_response(context.messages, attempt_options)
            except BaseException as exc:
                duration = clock() - started
                outcome: AttemptOutcome = (
                    "canceled" if _caller_cancelling(exc) else "failed_before_output"
                )
                terminal = self._is_terminal(context, exc, outcome, limit, budget)
                self._finish(
                    context, name, client, outcome, exc, duration, None, False, False, terminal
                )
                if terminal:
                    raise
                continue
            finally:
                if token is not None:
                    current_budget_var.reset(token)
            duration = clock() - started
            self._finish(
                context, name, client, "completed", None, duration, duration, True, True, True
            )
            return response

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return self._stream(self._context(messages, options, streaming=True))

    async def _stream(self, context: RoutingContext) -> AsyncGenerator[ChatResponseUpdate, None]:
        limit = self._attempt_limit()
        budget = self._new_budget()
        clock = self._clock
        while True:
            name, client, attempt_options = await self._select(context)
            self._start_attempt(budget)
            elapsed = 0.0  # time spent inside the route, not with the caller
            first_update: float | None = None
            error: BaseException | None = None
            stream: AsyncGenerator[ChatResponseUpdate, None] | None = None
            token = current_budget_var.set(budget) if budget is not None else None
            mark = clock()
            try:
                stream = client.get_streaming_response(context.messages, attempt_options)
            except BaseException as exc:
                error = exc
            finally:
                if token is not None:
                    current_budget_var.reset(token)
            elapsed += clock() - mark
            if stream is not None:
                while True:
                    token = current_budget_var.set(budget) if budget is not None else None
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
                        if token is not None:
                            current_budget_var.reset(token)
                    if first_update is None:
                        first_update = elapsed
                    try:
                        yield update
                    except BaseException:
                        # The caller closed the stream (GeneratorExit) or threw into it.
                        mark = clock()
                        close_error = await _close_stream(stream)
                        elapsed += clock() - mark
                        self._finish(
                            context,
                            name,
                            client,
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
                        f"closing the stream of route {name!r} also failed: "
                        f"{type(close_error).__name__}"
                    )
            committed = first_update is not None
            if error is None:
                self._finish(
                    context,
                    name,
                    client,
                    "completed",
                    None,
                    elapsed,
                    first_update,
                    True,
                    committed,
                    True,
                )
                return
            outcome: AttemptOutcome
            if _caller_cancelling(error):
                outcome = "canceled"
            elif committed:
                outcome = "failed_after_output"
                error.add_note(
                    f"chat-pipeline: route {name!r} failed after output was committed to "
                    "the caller; the streamed response is incomplete"
                )
            else:
                outcome = "failed_before_output"
            terminal = self._is_terminal(context, error, outcome, limit, budget)
            self._finish(
                context,
                name,
                client,
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


class _SelectorRoutingChatClient(RoutingChatClient):
    def __init__(self, selector: Selector, *, name: str | None) -> None:
        super().__init__(leave_open=True, name=name)
        self._selector = selector

    async def select_client(self, context: RoutingContext) -> SelectionResult:
        result = self._selector(context)
        if inspect.isawaitable(result):
            return await result
        return result
