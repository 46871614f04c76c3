"""The spend layer: every provider attempt of a request (and every cache hit) becomes a
`SpendRecord` in a `SpendLedger`, with whose request it was.

`SpendChatClient` (builder: ``use_spend``) promises:

* **one record per attempt that reached a provider**: the routers beneath price each
  attempt when it ends (a route's `Price`, else the ledger's book) and log it in the
  request's `AttemptLog` (`pipeline._scope`) with what it used: the provider's counts, or,
  where none came (a stream without a usage chunk, a stream cut or cancelled before it),
  counts from what streamed, marked *estimated*. A failover is a record per attempt, a hedge
  a record per attempt started; a cache hit beneath is a record of its own (cost 0, what
  it saved), and so is each retried call (`use_retry`) beneath a router. Routers that nest
  (a route whose client is a router) record each provider call once: the innermost logs
  it. Without a router beneath, the call itself is the one attempt, priced at the layer's
  `price` when it has one (a `pipeline._metering.DirectAttempt`). The same for
  `get_response` and `get_streaming_response`: the records are made once the call ended
  (however it ended);
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
from pipeline._metering import DirectAttempt
from pipeline._streams import StreamEnd, StreamWatcher, forward
from pipeline.client import ChatClient, DelegatingChatClient, client_name, metadata_of
from pipeline.pricing import Price
from pipeline.spend import Attribution, SpendLedger
from pipeline.types import (
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    Messages,
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
    """Records the spend of each request in `ledger` (see the module docstring). `price`
    prices the call when no router is beneath (the route's own price: it wins over the
    ledger's book). With `close_ledger`, closing the layer closes the ledger (after the
    layers beneath)."""

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
        if price is not None and not isinstance(price, Price):
            raise TypeError(f"price must be a Price, not {type(price).__name__}")
        self.ledger = ledger
        self.price = price
        self._attribution = attribution
        self._close_ledger = close_ledger
        self._clock = clock
        metadata = metadata_of(inner)
        # A router beneath logs each attempt; without one, the call is the attempt.
        self._routed = metadata.provider_name == "router"
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
        direct = self._direct(log, messages, options)
        mark = direct.enter() if direct is not None else None
        try:
            response = await self.inner.get_response(messages, options)
        except BaseException as exc:
            if direct is not None:
                direct.exit(mark)
                direct.failed(exc)
            if token is not None:
                _scope.exit_attempt_log(token)
            self._ended(log, messages, options)
            raise
        if direct is not None:
            direct.exit(mark)
            direct.responded(response)
        if token is not None:
            _scope.exit_attempt_log(token)
        self._ended(log, messages, options)
        return response

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return forward(
            lambda: self.inner.get_streaming_response(messages, options),
            _SpendWatch(self, messages, options),
        )

    def _direct(
        self, log: _scope.AttemptLog, messages: Messages, options: ChatOptions | None
    ) -> DirectAttempt | None:
        """Without a router beneath, the call itself is the request's attempt."""
        if self._routed:
            return None
        return DirectAttempt(
            log,
            route=self._name,
            client=self.inner,
            messages=messages,
            options=options,
            price=self.price,
            clock=self._clock,
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

    def _ended(
        self, log: _scope.AttemptLog, messages: Messages, options: ChatOptions | None
    ) -> None:
        """The call ended: record what its log holds that is not recorded yet."""
        if len(log.attempts) != log.recorded:
            self._record(log, self._who(messages, options, log))

    def _record(self, log: _scope.AttemptLog, who: Attribution | None) -> None:
        """Record the log's attempts not yet recorded, and any that come late."""
        request_id = log.request_id or _scope.new_operation_id()
        ledger = self.ledger

        def take(log: _scope.AttemptLog) -> None:
            fresh = log.attempts[log.recorded :]
            if not fresh:
                return
            log.recorded = len(log.attempts)
            ledger.record_attempts(fresh, request_id, who)

        take(log)
        log.late = take


class _SpendWatch(StreamWatcher):
    """A streamed call through the layer: its attempt log (when it is the layer's own) and
    its direct attempt (without a router beneath) current in the steps before the first
    update (where a router beneath starts its request and takes them), its records made at
    its end."""

    __slots__ = ("direct", "layer", "log", "messages", "options", "own", "scoped", "steps")

    def __init__(
        self, layer: SpendChatClient, messages: Messages, options: ChatOptions | None
    ) -> None:
        self.layer = layer
        self.messages = messages
        self.options = options
        self.scoped = True
        self.steps = 0
        self.log: _scope.AttemptLog | None = None
        self.direct: DirectAttempt | None = None
        self.own = False

    def start(self) -> None:
        prices = self.layer.ledger.prices
        log = _scope.current_attempt_log()
        self.own = log is None  # made current around the first steps only when it is ours
        if log is None:
            log = _scope.AttemptLog(prices)
        elif log.prices is None:
            log.prices = prices
        self.log = log
        self.direct = self.layer._direct(log, self.messages, self.options)

    def enter(self) -> Any:
        log, direct = self.log, self.direct
        return (
            _scope.enter_attempt_log(log) if self.own and log is not None else None,
            direct.enter() if direct is not None else None,
        )

    def exit(self, token: Any) -> None:
        log_token, mark_token = token
        if mark_token is not None:
            _scope.exit_attempt_mark(mark_token)
        if log_token is not None:
            _scope.exit_attempt_log(log_token)
        # Opening the stream, then its first step (where its first update comes): later
        # steps need no scope.
        self.steps += 1
        if self.steps == 2:
            self.scoped = False

    def update(self, update: ChatResponseUpdate) -> None:
        direct = self.direct
        if direct is not None:
            direct.update(update)

    def end(self, how: StreamEnd, error: BaseException | None) -> None:
        log = self.log
        if log is None:
            return
        direct = self.direct
        if direct is not None:
            direct.end(how, error)
        self.layer._ended(log, self.messages, self.options)
