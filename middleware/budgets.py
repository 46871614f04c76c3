"""The budgets layer: a budget and rate limits over a pipeline in library use, counted in a
Redis that every process shares (the gateway's own reservations, `pipeline._governance`).

`BudgetChatClient` (builder: ``use_budgets``) reserves each call's estimated maximum cost
and takes its rate-limit cells before calling the layers beneath, in one Redis round trip,
and settles with what the call's attempts cost (the routers beneath log each attempt;
without one, the call's usage at `price`). Refused: `BudgetExceededError`,
`RateLimitExceededError` (with ``retry_after``), or `BudgetUnavailableError` when Redis
cannot answer and ``fail_closed`` is set; with it unset, calls are served unchecked.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from decimal import Decimal
from typing import Any

from pipeline import _scope
from pipeline._governance import Admission, Governor, RateCost, Subject
from pipeline.client import ChatClient, DelegatingChatClient
from pipeline.keys import Budget
from pipeline.pricing import Price, estimate_input_tokens
from pipeline.types import (
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    Messages,
    UsageDetails,
    as_messages,
)

__all__ = ["BudgetChatClient"]


class BudgetChatClient(DelegatingChatClient):
    """Holds calls through it to `budget`, `rpm` and `tpm`, counted under `scope` in the
    Redis at `redis` (a URL) shared by every process using the same scope (see the module
    docstring). `price` prices a call no router beneath logged attempts for, and bounds
    each call's reservation."""

    def __init__(
        self,
        inner: ChatClient,
        redis: str,
        *,
        scope: str = "default",
        budget: Budget | None = None,
        rpm: int | None = None,
        tpm: int | None = None,
        price: Price | None = None,
        fail_closed: bool = False,
        namespace: str = "chat_pipeline:budgets",
        timeout: float = 0.5,
        default_max_output_tokens: int = 4096,
        leave_open: bool = False,
    ) -> None:
        super().__init__(inner, leave_open=leave_open)
        from pipeline._reservations import Reservations
        from pipeline._resp import RespClient

        self.subject = Subject(f"lib:{scope}", scope, budget, rpm, tpm)
        self._prepared = False
        self.price = price
        self._costs = (
            RateCost.of(
                [(Decimal(str(price.input_per_million)), Decimal(str(price.output_per_million)))]
            )
            if price is not None
            else RateCost()
        )
        self.governor = Governor(
            Reservations(
                RespClient(redis, timeout=timeout), namespace=namespace, rebuild_delay=0.0
            ),
            fail_closed=fail_closed,
            default_max_output_tokens=default_max_output_tokens,
        )

    def describe_layer(self) -> str:
        return f"BudgetChatClient({self.subject.name})"

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            reservations = self.governor.reservations
            await reservations.aclose()
            await reservations.redis.aclose()

    async def _admit(self, messages: Messages, options: ChatOptions | None) -> Admission:
        if not self._prepared:
            # Once: a fresh or restarted Redis gets its counters made before the first call.
            self._prepared = True
            await self.governor.reservations.prepare(5.0)
        return await self.governor.admit(
            self.subject,
            input_tokens=estimate_input_tokens(as_messages(messages)),
            max_output_tokens=options.max_output_tokens if options is not None else None,
            costs=self._costs,
        )

    def _settle(
        self, admission: Admission, log: _scope.AttemptLog, usage: UsageDetails | None
    ) -> None:
        if not log.attempts and usage is not None and self.price is not None:
            # No router beneath logged the call: it was the one attempt.
            cost = self.price.charge(usage).amount
            tokens = (usage.input_tokens or 0) + (usage.output_tokens or 0)
            admission.settled = True
            self.governor.settle(admission, cost, tokens)
            return
        admission.settle(log)

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        admission = await self._admit(messages, options)
        log, token = _scope.open_attempt_log()
        usage = None
        try:
            response = await self.inner.get_response(messages, options)
            usage = response.usage
            return response
        finally:
            if token is not None:
                _scope.exit_attempt_log(token)
            self._settle(admission, log, usage)

    async def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        admission = await self._admit(messages, options)
        log, token = _scope.open_attempt_log()
        usage: UsageDetails | None = None
        stream: Any = None
        try:
            stream = self.inner.get_streaming_response(messages, options)
            # The log is current in the stream's first step (where a router beneath starts
            # its request and takes it), never while the caller holds an update.
            try:
                first = await anext(stream)
            except StopAsyncIteration:
                return
            finally:
                if token is not None:
                    _scope.exit_attempt_log(token)
                    token = None
            update: ChatResponseUpdate | None = first
            while update is not None:
                if update.usage is not None:
                    usage = update.usage if usage is None else usage + update.usage
                yield update
                update = await anext(stream, None)
        finally:
            if stream is not None:
                await stream.aclose()
            if token is not None:
                _scope.exit_attempt_log(token)
            self._settle(admission, log, usage)
