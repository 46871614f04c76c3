"""Shared pieces of the compatibility tests: call counting, recorded sleeps, pipelines."""

from __future__ import annotations

from typing import Any

from middleware.routing import Route
from pipeline import ChatPipeline
from pipeline.client import DelegatingChatClient
from pipeline.testing import Collected
from pipeline.types import (
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    FunctionCallContent,
    Messages,
)
from tests.otel import Otel


class CountingClient(DelegatingChatClient):
    """Counts the calls that reach the provider client beneath it: one per HTTP request."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.calls = 0

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        self.calls += 1
        return await super().get_response(messages, options)

    def get_streaming_response(self, messages: Messages, options: ChatOptions | None = None) -> Any:
        self.calls += 1
        return super().get_streaming_response(messages, options)


class Sleeps:
    """Records retry delays instead of sleeping (tests never wait on the clock)."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


def resilient(client: CountingClient, name: str, sleep: Sleeps, fail_max: int = 2) -> Any:
    """A route: breaker outside retry (one failed request is one breaker failure)."""
    return (
        ChatPipeline.builder()
        .use_circuit_breaker(fail_max=fail_max, reset_timeout=600.0)
        .use_retry(max_attempts=2, initial_delay=0.5, jitter=False, sleep=sleep)
        .build(client, name=name)
    )


def failover(otel: Otel, primary: Any, backup: Any) -> ChatPipeline:
    """Telemetry around ordered failover over routes "a" then "b"."""
    return (
        ChatPipeline.builder()
        .use_telemetry(**otel.providers)
        .use_ordered_failover([Route("a", primary), Route("b", backup)], **otel.providers)
        .build()
    )


def outcomes(otel: Otel) -> list[tuple[str, str]]:
    """(route, outcome) of every finished failover attempt span, in order."""
    return [
        (
            str(span.attributes["chat_pipeline.route.name"]),
            str(span.attributes["chat_pipeline.route.outcome"]),
        )
        for span in otel.attempt_spans()
        if span.attributes is not None
    ]


def function_calls(result: Collected) -> list[FunctionCallContent]:
    assert result.response is not None
    return [
        content
        for message in result.response.messages
        for content in message.contents
        if isinstance(content, FunctionCallContent)
    ]


def streamed_text(updates: list[ChatResponseUpdate]) -> str:
    return "".join(u.text for u in updates)
