"""The spend layer: every provider attempt of a request (and every cache hit) becomes a
`SpendRecord` in a `SpendLedger`, with whose request it was.

`SpendChatClient` (builder: ``use_spend``) promises:

* **one record per attempt that reached a provider**: the routers beneath price each
  attempt when it ends (a route's `Price`, else the ledger's book) and log it in the
  request's `AttemptLog` (`pipeline._scope`) with what it used: the provider's counts, or,
  where none came (a stream without a usage chunk, a stream cut or cancelled before it),
  counts from what streamed, marked *estimated*. A failover is a record per attempt, a hedge
  a record per attempt started; a cache hit beneath is a record of its own (cost 0, what
  it saved). Without a router beneath, the call itself is the one attempt (at `price`,
  the route's, when given). The same for `get_response` and `get_streaming_response`: the
  records are made once the call ended (however it ended);
* **attribution**: `attribution` is a function of the request (``(messages, options) ->
  Attribution | mapping | None``) or a fixed `Attribution` (or mapping of its fields);
  what a server in front says (the gateway: its caller's key, user, team, tags, path) wins
  field by field, tags are joined, and the session defaults to ``options.session_id``. A
  function that raises is logged (its type) and the records go without it: the answer
  already reached the caller;
* **never in the request's way**: recording queues the records (`SpendLedger.record`); the
  database is written by the ledger's own task. No prompt or answer text is recorded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

from pipeline import _scope
from pipeline._streams import StreamEnd, StreamWatcher, forward
from pipeline.client import ChatClient, DelegatingChatClient, client_name, metadata_of
from pipeline.pricing import Price, direct_attempt, response_characters, streamed_characters
from pipeline.spend import Attribution, SpendLedger, SpendRecord
from pipeline.types import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    Messages,
    UsageDetails,
    as_messages,
)

__all__ = ["AttributionSource", "SpendChatClient"]

_logger = logging.getLogger("chat_pipeline.spend")

AttributionSource = (
    Attribution
    | Mapping[str, Any]
    | Callable[[list[ChatMessage], ChatOptions], Attribution | Mapping[str, Any] | None]
    | None
)
"""Whose requests they are: fixed, or a function of each request's messages and options."""


class SpendChatClient(DelegatingChatClient):
    """Records the spend of each request in `ledger` (see the module docstring). With
    `close_ledger`, closing the layer closes the ledger (after the layers beneath). `price`
    prices a call with no router beneath (the route's own price), else the ledger's book
    does."""

    def __init__(
        self,
        inner: ChatClient,
        ledger: SpendLedger,
        *,
        attribution: AttributionSource = None,
        leave_open: bool = False,
        close_ledger: bool = False,
        price: Price | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__(inner, leave_open=leave_open)
        if not isinstance(ledger, SpendLedger):
            raise TypeError(f"ledger must be a SpendLedger, not {type(ledger).__name__}")
        if attribution is not None and not callable(attribution):
            attribution = Attribution.of(attribution)
        self.ledger = ledger
        self.price = price
        self._attribution = attribution
        self._close_ledger = close_ledger
        self._clock = clock
        metadata = metadata_of(inner)
        # A router beneath logs each attempt; without one, the call is the attempt.
        self._routed = metadata.provider_name == "router"
        self._metadata = metadata
        self._name = client_name(inner)

    def describe_layer(self) -> str:
        return f"SpendChatClient({self.ledger.store!r})"

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            if self._close_ledger:
                await self.ledger.aclose()

    # -- calls ---------------------------------------------------------------------------------

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        log, token = _scope.open_attempt_log(self.ledger.prices)
        call = _Call(self, messages, options, log)
        try:
            response = await self.inner.get_response(messages, options)
        except BaseException as exc:
            if token is not None:
                _scope.exit_attempt_log(token)
            call.ended(error=exc)
            raise
        if token is not None:
            _scope.exit_attempt_log(token)
        call.ended(response=response)
        return response

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return forward(
            lambda: self.inner.get_streaming_response(messages, options),
            _SpendWatch(self, messages, options),
        )

    # -- records -------------------------------------------------------------------------------

    def _who(
        self, messages: Messages, options: ChatOptions | None, log: _scope.AttemptLog
    ) -> Attribution | None:
        """The request's attribution: the layer's, under what the server in front says."""
        base: Attribution | None = None
        source = self._attribution
        if callable(source):
            try:
                base = Attribution.of(
                    source(as_messages(messages), options if options is not None else ChatOptions())
                )
            except Exception as exc:  # the answer reached the caller: record without it
                _logger.warning(
                    "the spend layer's attribution function failed (%s); records go without it",
                    type(exc).__name__,
                )
        else:
            base = source
        server = log.attribution
        who = server.over(base) if isinstance(server, Attribution) else base
        session = options.session_id if options is not None else None
        if session is not None and (who is None or who.session is None):
            who = Attribution(session=session).over(who)
        return who

    def _record(self, log: _scope.AttemptLog, who: Attribution | None) -> None:
        """Record the log's attempts not yet recorded, and any that come late."""
        request_id = log.request_id or _scope.new_operation_id()
        ledger = self.ledger

        def take(log: _scope.AttemptLog) -> None:
            fresh = log.attempts[log.recorded :]
            if not fresh:
                return
            log.recorded = len(log.attempts)
            ledger.record(SpendRecord.of_attempt(a, request_id, who) for a in fresh)

        take(log)
        log.late = take


class _Call:
    """One call through the layer: what it needs to record the call when it ends."""

    __slots__ = (
        "characters",
        "first_update",
        "layer",
        "log",
        "messages",
        "model",
        "options",
        "started",
        "started_at",
        "usage",
    )

    def __init__(
        self,
        layer: SpendChatClient,
        messages: Messages,
        options: ChatOptions | None,
        log: _scope.AttemptLog,
    ) -> None:
        self.layer = layer
        self.messages = messages
        self.options = options
        self.log = log
        self.started_at = time.time()
        self.started = layer._clock()
        self.first_update: float | None = None
        # Without a router beneath: what the stream said (a router tallies its own).
        self.usage: UsageDetails | None = None
        self.model: str | None = None
        self.characters = 0

    def ended(
        self,
        *,
        outcome: str | None = None,
        error: BaseException | None = None,
        response: ChatResponse | None = None,
    ) -> None:
        layer, log = self.layer, self.log
        if not layer._routed and len(log.attempts) == log.recorded:
            self._direct(outcome, error, response)
        if len(log.attempts) == log.recorded:
            return
        layer._record(log, layer._who(self.messages, self.options, log))

    def _direct(
        self, outcome: str | None, error: BaseException | None, response: ChatResponse | None
    ) -> None:
        """No router beneath: the call itself was the attempt (at the route's price, else
        the book's)."""
        layer = self.layer
        if response is not None:
            self.usage, self.model = response.usage, response.model_id
            self.characters = response_characters(response)
            self.first_update = layer._clock() - self.started
        attempt = direct_attempt(
            layer._metadata,
            route=layer._name,
            price=layer.price,
            book=self.log.prices,
            messages=self.messages,
            options=self.options,
            outcome=outcome,
            error=error,
            output_began=self.first_update is not None,
            reported=self.usage,
            model_served=self.model,
            characters=self.characters,
            started_at=self.started_at,
            duration=layer._clock() - self.started,
            time_to_first_update=self.first_update,
        )
        if attempt is not None:
            self.log.add(attempt)


class _SpendWatch(StreamWatcher):
    """A streamed call through the layer: its attempt log current in its first step (where
    the router beneath starts its request and takes it), its records made at its end."""

    __slots__ = ("call", "layer", "messages", "options", "own", "scoped", "steps")

    def __init__(
        self, layer: SpendChatClient, messages: Messages, options: ChatOptions | None
    ) -> None:
        self.layer = layer
        self.messages = messages
        self.options = options
        self.scoped = True
        self.steps = 0
        self.call: _Call | None = None

    def start(self) -> None:
        outer = _scope.current_attempt_log()
        if outer is not None and outer.prices is None:
            outer.prices = self.layer.ledger.prices
        log = outer if outer is not None else _scope.AttemptLog(self.layer.ledger.prices)
        self.call = _Call(self.layer, self.messages, self.options, log)
        self.own = outer is None  # made current around steps only when it is ours

    def enter(self) -> Any:
        call = self.call
        if call is None or not self.own:
            return None
        return _scope.enter_attempt_log(call.log)

    def exit(self, token: Any) -> None:
        if token is not None:
            _scope.exit_attempt_log(token)
        # Opening the stream, then its first step (where a router beneath starts its
        # request and takes the log): later steps need no scope.
        self.steps += 1
        if self.steps == 2:
            self.scoped = False

    def update(self, update: ChatResponseUpdate) -> None:
        call = self.call
        if call is None:
            return
        if call.first_update is None:
            call.first_update = self.layer._clock() - call.started
        if self.layer._routed:
            return
        if update.usage is not None:
            call.usage = update.usage if call.usage is None else call.usage + update.usage
        if update.model_id is not None:
            call.model = update.model_id
        call.characters += streamed_characters(update)

    def end(self, how: StreamEnd, error: BaseException | None) -> None:
        call = self.call
        if call is None:
            return
        outcome: str | None = None
        if how in ("canceled", "abandoned"):
            outcome = how
        elif how == "failed" and call.first_update is not None:
            outcome = "failed_after_output"
        call.ended(outcome=outcome, error=error)
