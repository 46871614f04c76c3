"""Every name the project's telemetry exports is a convention's or the project's own.

The suites' telemetry is walked here: the demo, a failover with a retry and a breaker
change, a hedge, a cache miss and hit, and the gateway's three formats (streamed and not,
with its own cache). Every span name, span attribute, event, event attribute, metric and
metric attribute must be in a semantic-convention namespace the project uses (`gen_ai.*`,
the HTTP, server, url, network and error conventions, OpenInference's span kind) or in
the project's own, ``chat_pipeline.*``. ``ai.*`` is the Vercel AI SDK's namespace.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from middleware.routing import Route
from pipeline import ChatPipeline
from pipeline.cli import _demo_pipeline
from pipeline.config import parse_config
from pipeline.errors import TransientProviderError
from pipeline.testing import (
    FakeAnthropicServer,
    FakeOpenAIServer,
    ScriptedChatClient,
    collect,
    fail,
    hang,
    reply,
)
from tests.otel import Otel
from tests.pipeline.gateway.conftest import config, running

ALLOWED = re.compile(
    r"(gen_ai|chat_pipeline|http|server|url|network|client)\.[a-z0-9_.\-]+"
    r"|error\.type|exception\.(type|message|stacktrace|escaped)|openinference\.span\.kind"
)
"""Attribute and metric names: a convention's namespace or the project's own. (Exception
events are OpenTelemetry's own, and the suites check they carry no content.)"""
SPAN_NAMES = re.compile(r"(chat|route_attempt|execute_tool|POST|GET) ?.*|exception")
"""Span and event names: the GenAI conventions' (``chat {model}``, ``execute_tool {tool}``),
the attempt spans, the HTTP server's ``{method} {route}``."""


def names(otel: Otel) -> Iterator[tuple[str, str]]:
    """(what, name) of every exported name and attribute key."""
    for span in otel.finished():
        yield "span", span.name.split(" ")[0] if " " in span.name else span.name
        for key in span.attributes or {}:
            yield "span attribute", key
        for event in span.events:
            yield "event", event.name
            for key in event.attributes or {}:
                yield "event attribute", key
    data = otel.reader.get_metrics_data()
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                yield "metric", metric.name
                for point in metric.data.data_points:
                    for key in point.attributes or {}:
                        yield "metric attribute", key


def outside(otel: Otel) -> set[tuple[str, str]]:
    found = set()
    for what, name in names(otel):
        if what == "span":
            if not SPAN_NAMES.fullmatch(name):
                found.add((what, name))
        elif what == "event":
            if not (name == "exception" or ALLOWED.fullmatch(name)):
                found.add((what, name))
        elif not ALLOWED.fullmatch(name):
            found.add((what, name))
    return found


def exported(otel: Otel) -> set[str]:
    return {name for _, name in names(otel)}


async def test_the_librarys_telemetry_uses_no_foreign_namespace(
    otel: Otel, streaming: bool
) -> None:
    # The demo: a failover before output, then a streamed answer.
    demo = _demo_pipeline(otel.tracer_provider, otel.meter_provider)
    async with demo:
        assert (await collect(demo, "hi", streaming=streaming)).error is None

    # A retry, then a breaker that opens, then a failover to the backup.
    flaky = ScriptedChatClient([fail(TransientProviderError(status_code=503))] * 4, name="flaky")
    backup = ScriptedChatClient(reply("from backup"), name="backup")
    resilient = (
        ChatPipeline.builder(**otel.providers)
        .use_circuit_breaker(fail_max=1)
        .use_retry(max_attempts=2, initial_delay=0.0, jitter=False)
        .build(flaky)
    )
    chat = (
        ChatPipeline.builder(**otel.providers)
        .use_telemetry()
        .use_cache()
        .use_ordered_failover([Route("flaky", resilient), Route("backup", backup)])
        .build()
    )
    async with chat:
        first = await collect(chat, "the same question", streaming=streaming)
        again = await collect(chat, "the same question", streaming=streaming)
    assert first.text == again.text == "from backup"

    # A hedge: the first route hangs, the hedge answers.
    slow = ScriptedChatClient(hang(), name="slow")
    fast = ScriptedChatClient(reply("from fast"), name="fast")
    hedged = (
        ChatPipeline.builder(**otel.providers)
        .use_telemetry()
        .use_hedging(
            [Route("slow", slow), Route("fast", fast)], strategy="round_robin", delay=0.001
        )
        .build()
    )
    async with hedged:
        assert (await collect(hedged, "hi", streaming=streaming)).text == "from fast"

    seen = exported(otel)
    # The walk saw what it means to check: the routing, retry, breaker, hedge and cache names.
    for name in (
        "chat_pipeline.route.name",
        "chat_pipeline.route.output_committed",
        "chat_pipeline.route.time_to_first_update",
        "chat_pipeline.route.hedge",
        "chat_pipeline.route.attempt.count",
        "chat_pipeline.retry",
        "chat_pipeline.circuit_breaker.state_change",
        "chat_pipeline.cache.result",
        "chat_pipeline.cache.lookups",
    ):
        assert name in seen, name
    assert outside(otel) == set()
    assert not [name for name in seen if name.startswith("ai.")]


@pytest.mark.gateway
async def test_the_gateways_telemetry_uses_no_foreign_namespace(
    otel: Otel, streaming: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_TEST_UPSTREAM_KEY", "upstream-key")
    async with FakeOpenAIServer() as primary, FakeAnthropicServer() as claude:
        cfg = parse_config(
            {
                "routes": {
                    "primary": {
                        "provider": "openai",
                        "model": "model-primary",
                        "base_url": primary.base_url,
                    },
                    "claude": {
                        "provider": "anthropic",
                        "model": "claude-test",
                        "base_url": claude.base_url,
                        "api_key_env": "GATEWAY_TEST_UPSTREAM_KEY",
                    },
                },
                "router": {"kind": "ordered", "order": ["primary", "claude"]},
                "layers": {"telemetry": True},
                "cache": {"store": "memory"},
            }
        )
        async with (
            running(cfg, **otel.providers) as gateway,
            httpx.AsyncClient(base_url=gateway.url, timeout=30) as client,
        ):
            message = {"role": "user", "content": "hi"}
            for _ in range(2):  # a cache miss, then a hit
                bodies = [
                    ("/v1/chat/completions", {"model": "pipeline", "messages": [message]}),
                    ("/v1/responses", {"model": "pipeline", "input": "hi"}),
                    (
                        "/v1/messages",
                        {"model": "pipeline", "max_tokens": 64, "messages": [message]},
                    ),
                ]
                for path, body in bodies:
                    response = await client.post(path, json={**body, "stream": streaming})
                    assert response.status_code == 200, response.text
            await gateway.gateway.wait_idle()
    seen = exported(otel)
    for name in (
        "http.server.request.duration",
        "chat_pipeline.route.name",
        "chat_pipeline.gateway.model",
        "chat_pipeline.cache.result",
    ):
        assert name in seen, name
    assert outside(otel) == set()


@pytest.mark.gateway
async def test_the_http_duration_metric_carries_scheme_and_protocol_version(
    otel: Otel,
) -> None:
    async with (
        FakeOpenAIServer() as primary,
        running(config({"primary": primary}), **otel.providers) as gateway,
    ):
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            response = await client.post(
                "/v1/chat/completions",
                json={"model": "pipeline", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert response.status_code == 200
        await gateway.gateway.wait_idle()
    points = otel.points("http.server.request.duration")
    assert points
    for attributes, count in points:
        assert attributes["url.scheme"] == "http"
        assert attributes["network.protocol.version"] == "1.1"
        assert count >= 1
    (server,) = [s for s in otel.finished() if s.name == "POST /v1/chat/completions"]
    assert server.attributes is not None
    assert server.attributes["url.scheme"] == "http"
    assert server.attributes["network.protocol.version"] == "1.1"
