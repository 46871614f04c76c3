"""Ordered failover of two real HTTP clients against two fake servers."""

import pytest

from middleware.routing import FailoverAttempt, OrderedFailoverChatClient, Route, RoutingContext
from pipeline import ChatPipeline
from pipeline.errors import RateLimitedError
from pipeline.providers import OpenAIChatClient
from pipeline.testing import FakeOpenAIServer, FakeResponse, collect

# Every test runs over both HTTP transports (the `transport` fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("transport")


class Recording(OrderedFailoverChatClient):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.attempts: list[FailoverAttempt] = []

    def on_routing_update(
        self, context: RoutingContext, attempt: FailoverAttempt, is_terminal: bool
    ) -> None:
        self.attempts.append(attempt)


async def test_503_primary_then_backup_streams(streaming: bool) -> None:
    async with FakeOpenAIServer() as primary, FakeOpenAIServer() as backup:
        primary.script(FakeResponse.error(503))
        backup.script(FakeResponse(text="served by the backup"))
        router = Recording(
            [
                Route("primary", OpenAIChatClient("m", api_key="k", base_url=primary.base_url)),
                Route("backup", OpenAIChatClient("m", api_key="k", base_url=backup.base_url)),
            ]
        )
        async with ChatPipeline.builder().use_failover(router).build() as chat:
            result = await collect(chat, "hi", streaming=streaming)
        assert result.text == "served by the backup"
        assert (primary.count(), backup.count()) == (1, 1)
        assert [(a.route_name, a.outcome) for a in router.attempts] == [
            ("primary", "failed_before_output"),
            ("backup", "completed"),
        ]


async def test_429_with_retry_after_is_retried_after_that_delay(streaming: bool) -> None:
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    async with FakeOpenAIServer() as server:
        server.script(FakeResponse.error(429, retry_after="4"))
        chat = (
            ChatPipeline.builder()
            .use_retry(max_attempts=2, sleep=fake_sleep)
            .build(OpenAIChatClient("m", api_key="k", base_url=server.base_url))
        )
        result = await collect(chat, "hi", streaming=streaming)
        assert result.text == "Hello from the fake server."
        assert slept and slept[0] >= 4.0
        assert server.count() == 2
        await chat.aclose()


async def test_400_is_neither_retried_nor_failed_over(streaming: bool) -> None:
    async def fake_sleep(seconds: float) -> None:
        raise AssertionError("no retry expected")

    async with FakeOpenAIServer() as primary, FakeOpenAIServer() as backup:
        primary.script(FakeResponse.error(400, code="invalid_value"))
        route = (
            ChatPipeline.builder()
            .use_retry(sleep=fake_sleep)
            .build(OpenAIChatClient("m", api_key="k", base_url=primary.base_url))
        )
        router = OrderedFailoverChatClient(
            [Route("primary", route), OpenAIChatClient("m", api_key="k", base_url=backup.base_url)]
        )
        result = await collect(router, "hi", streaming=streaming)
        assert result.error is not None and getattr(result.error, "status_code", None) == 400
        assert (primary.count(), backup.count()) == (1, 0)
        await router.aclose()


async def test_rate_limit_exhausting_retries_fails_over(streaming: bool) -> None:
    async def fake_sleep(seconds: float) -> None:
        return None

    async with FakeOpenAIServer() as primary, FakeOpenAIServer() as backup:
        primary.script(*[FakeResponse.error(429, retry_after="1")] * 3)
        route = (
            ChatPipeline.builder()
            # Retries first (by default a rate limit in a router moves to the backup at once).
            .use_retry(max_attempts=2, sleep=fake_sleep, defer_to_failover=False)
            .build(OpenAIChatClient("m", api_key="k", base_url=primary.base_url))
        )
        router = Recording(
            [
                Route("primary", route),
                Route("backup", OpenAIChatClient("m", api_key="k", base_url=backup.base_url)),
            ]
        )
        result = await collect(router, "hi", streaming=streaming)
        assert result.error is None
        assert (primary.count(), backup.count()) == (2, 1)
        assert isinstance(router.attempts[0].exception, RateLimitedError)
        await router.aclose()


async def test_an_exhausted_quota_fails_over_unretried_and_cools_the_route(
    streaming: bool,
) -> None:
    from middleware.routing import BalancedFailoverChatClient
    from middleware.routing.health import RouteHealth

    async def fake_sleep(seconds: float) -> None:
        raise AssertionError("an exhausted quota is never retried")

    async with FakeOpenAIServer() as primary, FakeOpenAIServer() as backup:
        primary.script(FakeResponse.error(429, code="insufficient_quota", retry_after="1"))
        route = (
            ChatPipeline.builder()
            .use_retry(max_attempts=3, sleep=fake_sleep, defer_to_failover=False)
            .build(OpenAIChatClient("m", api_key="k", base_url=primary.base_url))
        )
        health = RouteHealth()
        router = BalancedFailoverChatClient(
            [
                Route("primary", route),
                Route("backup", OpenAIChatClient("m", api_key="k", base_url=backup.base_url)),
            ],
            strategy="round_robin",
            health=health,
        )
        for _ in range(2):  # round robin: the primary's turn comes within two requests
            result = await collect(router, "hi", streaming=streaming)
            assert result.error is None and result.text == "Hello from the fake server."
        assert (primary.count(), backup.count()) == (1, 2)  # failed over, never retried
        assert health.stats("primary").cooldown > 800  # the quota cooldown, not Retry-After's 1 s
        # While it cools, the primary is left alone, whoever's turn it is.
        for _ in range(4):
            assert (await collect(router, "hi", streaming=streaming)).error is None
        assert (primary.count(), backup.count()) == (1, 6)
        await router.aclose()
