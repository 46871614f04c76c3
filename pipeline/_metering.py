"""A call logged as its request's one attempt where no router beneath logs attempts (the
spend layer over a plain client, a gateway's route served by name): `DirectAttempt`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pipeline import _scope
from pipeline._streams import StreamEnd, StreamWatcher, ending_of
from pipeline.client import ChatClient, metadata_of
from pipeline.pricing import (
    Price,
    priced_attempt,
    reached_provider,
    response_characters,
    streamed_characters,
)
from pipeline.types import ChatOptions, ChatResponse, ChatResponseUpdate, Messages, as_messages

__all__ = ["DirectAttempt", "RetriedCalls"]


class DirectAttempt(StreamWatcher):
    """One call of `client` logged in `log` as attempt 1 of route `route`, once, when it
    ended: what it used (the provider's counts, else counted from its output and marked
    estimated, as a router's attempts are) at `price` (a route's own: it wins) or else the
    log's book. A call a breaker refused, or that never went on the wire, is no attempt.

    It is an `AttemptMark` (`pipeline._scope`): current while the call runs before output
    (`enter` / `exit`), so a logger beneath (a cache hit, a router its client's metadata
    does not show) counts its records on it, and a retry beneath records its retried calls
    under its route and price. When records beneath stand for it, it logs none.

    For a stream, hand it to `forward` as the watcher: it is current in the steps before
    the first update, tallies the updates, and logs at the end. For a whole response, make
    it current around the call (`enter`, `exit`) and end it with `responded` or `failed`.
    """

    __slots__ = (
        "beneath",
        "characters",
        "client",
        "clock",
        "first",
        "log",
        "logged",
        "messages",
        "model",
        "number",
        "options",
        "price",
        "route_name",
        "scoped",
        "started",
        "started_at",
        "usage",
        "within",
    )

    def __init__(
        self,
        log: _scope.AttemptLog,
        *,
        route: str,
        client: ChatClient,
        messages: Messages,
        options: ChatOptions | None,
        price: Price | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.log = log
        self.route_name = route
        self.number = 1
        self.price = price
        self.beneath = 0
        self.client = client
        self.messages = messages
        self.options = options
        self.clock = clock
        self.within = _scope.current_attempt_mark()  # the attempt above it, if any
        self.scoped = True
        self.logged = False
        self.started_at = time.time()
        self.started = clock()
        self.first: float | None = None  # seconds to the first update (or the response)
        self.usage: Any = None
        self.model: str | None = None
        self.characters = 0

    # -- the call ------------------------------------------------------------------------------

    def enter(self) -> Any:
        """Make this the current attempt mark (give the token back to `exit`)."""
        return _scope.enter_attempt_mark(self)

    def exit(self, token: Any) -> None:
        _scope.exit_attempt_mark(token)
        if self.first is not None:
            self.scoped = False  # past the first update nothing beneath starts logging

    def update(self, update: ChatResponseUpdate) -> None:
        if self.first is None:
            self.first = self.clock() - self.started
        if update.usage is not None:
            self.usage = update.usage if self.usage is None else self.usage + update.usage
        if update.model_id is not None:
            self.model = update.model_id
        self.characters += streamed_characters(update)

    def end(self, how: StreamEnd, error: BaseException | None) -> None:
        if how == "completed" or how == "canceled" or how == "abandoned":
            outcome: str = how
        else:
            outcome = "failed_after_output" if self.first is not None else "failed_before_output"
        self.ended(outcome, error)

    def responded(self, response: ChatResponse) -> None:
        """The call answered with `response`: log it."""
        self.first = self.clock() - self.started
        self.usage, self.model = response.usage, response.model_id
        self.characters = response_characters(response)
        self.ended("completed", None)

    def failed(self, error: BaseException) -> None:
        """The call (for a whole response) ended with `error`: log it."""
        self.ended("canceled" if ending_of(error) == "canceled" else "failed_before_output", error)

    # -- the record ----------------------------------------------------------------------------

    def ended(self, outcome: str, error: BaseException | None) -> _scope.PricedAttempt | None:
        """Log the call as it ended (`outcome`, `error`), once; returns what was logged (None:
        records beneath stand for it, it reached no provider, or it was logged already)."""
        if self.logged:
            return None
        self.logged = True
        if self.beneath:
            within = self.within
            if within is not None:
                within.beneath += 1  # the records beneath stand for the attempt above too
            return None
        if not reached_provider(error):
            return None
        metadata = metadata_of(self.client)
        options = self.options
        log = self.log
        attempt = priced_attempt(
            route=self.route_name,
            number=1,
            outcome=outcome,
            provider=metadata.provider_name,
            model_requested=(options.model_id if options is not None else None)
            or metadata.model_id,
            model_served=self.model,
            reported=self.usage,
            characters=self.characters,
            messages=as_messages(self.messages),
            error=error,
            price=self.price,
            book=log.prices,
            started_at=self.started_at,
            duration=self.clock() - self.started,
            time_to_first_update=self.first,
        )
        log.add(attempt, self.within)
        return attempt


class RetriedCalls:
    """The calls a retry layer makes within one attempt (the current `AttemptMark`, a
    router's or a `DirectAttempt`): each call that failed and was retried is logged beside
    the attempt, whose own record stands for its last call, under the attempt's route,
    number and price, with what it used (a provider's error answer: nothing), unless a
    logger beneath logged it (a router in the route). None (`of`) when the request is not
    logged."""

    __slots__ = ("beneath", "client", "log", "mark", "messages", "options", "started", "started_at")

    def __init__(
        self,
        log: _scope.AttemptLog,
        mark: _scope.AttemptMark,
        client: ChatClient,
        messages: Messages,
        options: ChatOptions | None,
    ) -> None:
        self.log = log
        self.mark = mark
        self.client = client
        self.messages = messages
        self.options = options
        self.trying()

    @classmethod
    def of(
        cls, client: ChatClient, messages: Messages, options: ChatOptions | None
    ) -> RetriedCalls | None:
        """The calls of `client` about to be made in this context, when they are logged."""
        mark = _scope.current_attempt_mark()
        if mark is None:
            return None
        log = _scope.current_attempt_log()
        return None if log is None else cls(log, mark, client, messages, options)

    def trying(self) -> None:
        """A call starts."""
        self.started_at = time.time()
        self.started = time.perf_counter()
        self.beneath = self.mark.beneath

    def retried(self, error: BaseException) -> None:
        """The call that started last failed with `error` and is retried: log it."""
        mark = self.mark
        if mark.beneath != self.beneath or not reached_provider(error):
            return
        metadata = metadata_of(self.client)
        options = self.options
        log = self.log
        log.add(
            priced_attempt(
                route=mark.route_name,
                number=mark.number,
                outcome="failed_before_output",
                provider=metadata.provider_name,
                model_requested=(options.model_id if options is not None else None)
                or metadata.model_id,
                model_served=None,
                reported=None,
                characters=0,
                messages=as_messages(self.messages),
                error=error,
                price=mark.price,
                book=log.prices,
                started_at=self.started_at,
                duration=time.perf_counter() - self.started,
                time_to_first_update=None,
            )
        )
