"""Telemetry names have one home (`pipeline._semconv`), and every scope says which
conventions and which version of the library it speaks."""

import ast
import re
from pathlib import Path

from opentelemetry.semconv.schemas import Schemas

import pipeline
from middleware.routing import Route
from middleware.tools import tool
from pipeline import ChatPipeline, FunctionCallContent, _semconv
from pipeline.errors import TransientProviderError
from pipeline.testing import ScriptedChatClient, call_tools, fail, reply
from tests.otel import Otel

ROOT = Path(pipeline.__file__).resolve().parents[1]
# A name this project defines in OpenTelemetry's namespaces or its own.
TELEMETRY_NAME = re.compile(r"(ai\.route|chat_pipeline|gen_ai|openinference)\.[a-z_.]+")
# Strings of that shape that are no telemetry name: the tiered router's request hints and
# the gateway's ASGI scope keys.
NOT_TELEMETRY = {
    "chat_pipeline.route",
    "chat_pipeline.kind",
    "chat_pipeline.exchange",
    "chat_pipeline.read_timed_out",
    "chat_pipeline.on_disconnect",
}


def test_the_schema_url_is_that_of_the_installed_conventions() -> None:
    newest = list(Schemas)[-1]
    assert newest.value == _semconv.SCHEMA_URL
    assert _semconv.SCHEMA_URL.startswith("https://opentelemetry.io/schemas/1.")


def _names_outside_semconv() -> list[str]:
    found = []
    for package in ("pipeline", "middleware"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "_semconv.py":
                continue
            tree = ast.parse(path.read_text())
            loggers = {
                id(argument)
                for node in ast.walk(tree)
                if isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "getLogger"
                for argument in node.args
            }
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno} {node.value}"
                for node in ast.walk(tree)
                if isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and TELEMETRY_NAME.fullmatch(node.value)
                and node.value not in NOT_TELEMETRY
                and id(node) not in loggers
            ]
    return found


def test_every_telemetry_name_is_defined_in_semconv() -> None:
    assert _names_outside_semconv() == []


def test_no_metric_shares_a_name_with_an_attribute_of_another_meaning() -> None:
    # The request span's attempt count and the counter of attempts are different things.
    assert _semconv.ROUTE_ATTEMPTS == "chat_pipeline.route.attempts"
    assert _semconv.ROUTE_ATTEMPT_COUNT_METRIC == "chat_pipeline.route.attempt.count"
    metrics = {getattr(_semconv, n) for n in _semconv.__all__ if n.endswith("_METRIC")}
    assert _semconv.ROUTE_ATTEMPTS not in metrics


async def test_every_scope_carries_the_version_and_the_schema(otel: Otel) -> None:
    @tool
    def lookup(query: str) -> str:
        """Look it up."""
        return "found"

    primary = ScriptedChatClient(fail(TransientProviderError()), name="primary")
    backup = ScriptedChatClient(
        [call_tools(FunctionCallContent("c1", "lookup", {"query": "x"})), reply("ok")],
        name="backup",
    )
    chat = (
        ChatPipeline.builder(**otel.providers)
        .use_function_invocation([lookup])
        .use_telemetry()
        .use_ordered_failover(
            [
                Route(
                    "primary",
                    ChatPipeline.builder(**otel.providers)
                    .use_circuit_breaker(fail_max=1)
                    .build(primary),
                ),
                Route("backup", backup),
            ]
        )
        .build()
    )
    assert (await chat.get_response("find it")).text == "ok"
    expected = (pipeline.__version__, _semconv.SCHEMA_URL)
    span_scopes = {
        s.instrumentation_scope.name: (
            s.instrumentation_scope.version,
            s.instrumentation_scope.schema_url,
        )
        for s in otel.finished()
        if s.instrumentation_scope is not None
    }
    data = otel.reader.get_metrics_data()
    assert data is not None
    metric_scopes = {
        s.scope.name: (s.scope.version, s.scope.schema_url)
        for resource in data.resource_metrics
        for s in resource.scope_metrics
    }
    assert span_scopes == {
        "chat_pipeline": expected,
        "chat_pipeline.routing": expected,
        "chat_pipeline.tools": expected,
    }
    assert metric_scopes == {
        "chat_pipeline": expected,
        "chat_pipeline.routing": expected,
        "chat_pipeline.breaker": expected,
    }
