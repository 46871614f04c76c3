"""The retry layer: retry one client's deployment failures with tenacity.

Promises, for `get_response` and `get_streaming_response` alike:

* only failures `retry_on` accepts are retried (default: rate limits and transient
  failures); request errors, open circuits and caller cancellation never are;
* a stream is retried only before its first update; once an update reached the caller, a
  failure is raised as is;
* a ``Retry-After`` (`ProviderError.retry_after`, or the header of any HTTP status error
  that carries its response, such as a raw ``httpx2.HTTPStatusError``) is waited out when
  it is at most `max_retry_after`; a longer one ends the retries at once, so a router can
  fail over instead of idling;
* inside a router that could still move the request to another route (the request scope
  says so), a rate-limited answer or one carrying ``Retry-After`` is not waited out here
  at all (`defer_to_failover`): the deployment asked for time, another one can answer now;
* inside a router, every retry spends one call of the request's budget, and no retry starts
  when its delay would pass the request's deadline;
* each retry is an event (`chat_pipeline.retry`, with the error type, attempt number and
  delay) on the current span; no new span, no content;
* when the request's spend is logged (a spend layer or the gateway above), each call that
  failed and was retried is a record of its own, beside the attempt it belongs to (what it
  used: a provider's error answer, nothing); a call an open breaker refused is none.

Place it per client, beneath the router (on the route's own pipeline), so one blip is
retried once per route rather than multiplied by every layer above.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Annotated, Any, ClassVar, Self, TypeVar

from opentelemetry import trace
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from pydantic import Field, model_validator
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception
from tenacity.wait import wait_exponential, wait_random_exponential

from pipeline._metering import RetriedCalls
from pipeline._scope import current_budget, failover_possible
from pipeline._semconv import RETRY_ATTEMPT, RETRY_DELAY, RETRY_EVENT
from pipeline._settings import Settings
from pipeline._streams import OpenedLater, close_stream
from pipeline.client import ChatClient, DelegatingChatClient
from pipeline.errors import FailureKind, classify, is_retryable, retry_after_of
from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages

__all__ = ["RETRY_ATTEMPT", "RETRY_DELAY", "RETRY_EVENT", "RetryChatClient", "RetrySettings"]

_T = TypeVar("_T")


_Seconds = Annotated[float, Field(ge=0)]


class RetrySettings(Settings):
    """How one client is retried. `max_attempts` counts the first try (1 = no retry)."""

    code_only: ClassVar[frozenset[str]] = frozenset({"retry_on", "sleep"})

    max_attempts: Annotated[int, Field(ge=1)] = 3
    """Tries in all, the first one included (1: no retry)."""
    initial_delay: _Seconds = 0.5
    """Seconds before the first retry; each later delay doubles, up to `max_delay`."""
    max_delay: _Seconds = 8.0
    """The longest delay between two tries, in seconds (not less than `initial_delay`)."""
    jitter: bool = True
    """Whether each delay is randomised (so clients that failed together do not retry together)."""
    respect_retry_after: bool = True
    """Whether a provider's `Retry-After` sets the delay before the next try."""
    max_retry_after: _Seconds = 30.0
    """The longest `Retry-After` waited out, in seconds: a longer one ends the retries at once, so a
    router can fail over instead of idling."""
    defer_to_failover: bool = True
    """Inside a router that could still move the request to another route, a rate-limited answer or
    one with `Retry-After` is not waited out here: the request fails over at once."""
    retry_on: Callable[[BaseException], bool] = is_retryable
    """Which failures are retried (code only; default: rate limits and transient failures)."""
    sleep: Callable[[float], Awaitable[None]] = Field(default=asyncio.sleep, repr=False)
    """How a delay is waited out (code only; tests pass their own to move time without sleeping)."""

    @model_validator(mode="after")
    def _delays_in_order(self) -> Self:
        if self.max_delay < self.initial_delay:
            raise ValueError("max_delay must not be less than initial_delay")
        return self


class RetryChatClient(DelegatingChatClient):
    """Retries the inner client's retryable failures (see the module docstring)."""

    def __init__(
        self,
        inner: ChatClient,
        settings: RetrySettings | None = None,
        *,
        leave_open: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(inner, leave_open=leave_open)
        self.policy = self.settings = RetrySettings.from_options(settings, options)
        backoff = wait_random_exponential if self.policy.jitter else wait_exponential
        self._backoff = backoff(multiplier=self.policy.initial_delay, max=self.policy.max_delay)

    def describe_layer(self) -> str:
        return f"RetryChatClient(max_attempts={self.policy.max_attempts})"

    def _wait(self, state: RetryCallState) -> float:
        delay = float(self._backoff(state))
        outcome = state.outcome
        error = outcome.exception() if outcome is not None else None
        retry_after = retry_after_of(error) if error is not None else None
        if (
            error is not None
            and self.policy.defer_to_failover
            and (retry_after is not None or classify(error) is FailureKind.RATE_LIMITED)
            and failover_possible(error)
        ):
            return math.inf  # the router moves on at once; the stop condition gives up here
        if self.policy.respect_retry_after and retry_after is not None:
            if retry_after > self.policy.max_retry_after:
                return math.inf  # the stop condition turns this into "give up now"
            delay = max(delay, float(retry_after))
        return delay

    def _stop(self, state: RetryCallState) -> bool:
        if state.attempt_number >= self.policy.max_attempts or math.isinf(state.upcoming_sleep):
            return True
        budget = current_budget()
        if budget is None:
            return False
        remaining = budget.remaining()
        if remaining is not None and state.upcoming_sleep >= remaining:
            return True
        # Spending the call here, once the retry is certain, keeps the count exact.
        return not budget.take_call()

    @staticmethod
    def _before_sleep(state: RetryCallState) -> None:
        outcome = state.outcome
        error = outcome.exception() if outcome is not None else None
        trace.get_current_span().add_event(
            RETRY_EVENT,
            {
                ERROR_TYPE: type(error).__name__,
                RETRY_ATTEMPT: state.attempt_number + 1,
                RETRY_DELAY: state.upcoming_sleep,
            },
        )

    def _worth_retrying(self, first_error: Exception) -> bool:
        """Whether a failed first try goes to tenacity at all."""
        return self.policy.max_attempts > 1 and self.policy.retry_on(first_error)

    def _retrying(self, calls: RetriedCalls | None) -> AsyncRetrying:
        before_sleep = self._before_sleep
        if calls is not None:

            def before_sleep(state: RetryCallState) -> None:
                outcome = state.outcome
                error = outcome.exception() if outcome is not None else None
                if error is not None:
                    calls.retried(error)
                self._before_sleep(state)

        return AsyncRetrying(
            stop=self._stop,
            wait=self._wait,
            retry=retry_if_exception(self.policy.retry_on),
            sleep=self.policy.sleep,
            before_sleep=before_sleep,
            reraise=True,
        )

    async def _retry_after(
        self,
        first_error: Exception,
        attempt: Callable[[], Awaitable[_T]],
        calls: RetriedCalls | None,
    ) -> _T:
        """Hand a failed first try to tenacity, which replays it as its attempt 1; `calls`
        logs each retried one (when the request is logged).

        The first try runs outside tenacity because almost every call succeeds at once, and
        tenacity's bookkeeping would otherwise cost every call; replaying the failure keeps
        attempt numbers, waits, stops and events exactly tenacity's.
        """
        replay: Exception | None = first_error

        async def attempt_or_replay() -> _T:
            nonlocal replay
            if replay is not None:
                error, replay = replay, None
                raise error
            if calls is not None:
                calls.trying()
            return await attempt()

        return await self._retrying(calls)(attempt_or_replay)

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        calls = RetriedCalls.of(self.inner, messages, options)
        try:
            return await self.inner.get_response(messages, options)
        except Exception as exc:  # cancellation is a BaseException: never retried
            if not self._worth_retrying(exc):
                raise
            first_error = exc
        return await self._retry_after(
            first_error, lambda: self.inner.get_response(messages, options), calls
        )

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        # Retrying happens at the first read; past the first update nothing is retried
        # (the caller already has output) and the caller reads the inner stream directly.
        return OpenedLater(lambda: self._open_with_retry(messages, options))

    async def _open(
        self, messages: Messages, options: ChatOptions | None
    ) -> tuple[AsyncGenerator[ChatResponseUpdate, None], ChatResponseUpdate | None]:
        """Open the inner stream and read its first update (None for an empty stream)."""
        stream = self.inner.get_streaming_response(messages, options)
        try:
            return stream, await stream.__anext__()
        except StopAsyncIteration:
            return stream, None
        except BaseException as exc:
            # A stream that failed before output is finished; closing it releases anything
            # a non-generator implementation still holds.
            close_error = await close_stream(stream)
            if close_error is not None:
                exc.add_note(f"closing the failed stream raised {type(close_error).__name__}")
            raise

    async def _open_with_retry(
        self, messages: Messages, options: ChatOptions | None
    ) -> tuple[AsyncGenerator[ChatResponseUpdate, None], ChatResponseUpdate | None]:
        calls = RetriedCalls.of(self.inner, messages, options)
        try:
            return await self._open(messages, options)
        except Exception as exc:
            if not self._worth_retrying(exc):
                raise
            return await self._retry_after(exc, lambda: self._open(messages, options), calls)
