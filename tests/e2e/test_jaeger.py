"""Traces in a real Jaeger 2, through a real OpenTelemetry Collector on the shipped config.

Both are built from the Go module proxy by ``scripts/build-otel`` (./scripts/test runs it).
The collector runs a copy of the shipped ``otel-collector.yaml`` with only its endpoints
moved onto loopback ports and its Tempo exporter dropped (`tests.e2e.servers.collector_config`);
Jaeger keeps traces in memory. Sent through the collector:

* ``chat-pipeline demo --otlp`` (OTLP/HTTP, spans and metrics);
* three ``chat-pipeline serve`` (OTLP/gRPC): ordered failover in front of fake upstreams (a
  failover, a cut after output, a terminal failure and tool-call rounds), a balanced fleet,
  and a hedging router over a hung route and a fast one;
* an in-process pipeline's metrics (the scripted runs of `tests.e2e.scripted`);
* a span and a span event carrying every content attribute the collector must drop.

Jaeger's query API (``/api/traces``, what its UI reads) must show each trace with the
documented tree, parents, kinds, service names and statuses, and no content; Debian's
Prometheus, scraping the collector's Prometheus exporter, must answer every query of the
shipped Grafana dashboard with labelled series.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from pipeline.cli import DEMO_ANSWER
from pipeline.telemetry import configure
from tests.e2e import gateway, scripted
from tests.e2e.servers import (
    SHIPPED_COLLECTOR_CONFIG,
    Collector,
    Jaeger,
    Prometheus,
    otel_binary,
    poll,
    running_prometheus,
)
from tests.e2e.test_prometheus import dashboard_targets

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

COMPOSE = Path(__file__).resolve().parents[2] / "examples/observability/docker-compose.yaml"

DEMO_SERVICE = "chat-pipeline-demo"
GATEWAY_SERVICE = "chat-pipeline-gateway"
FLEET_SERVICE = "chat-pipeline-fleet"
HEDGED_SERVICE = "chat-pipeline-hedged"
LIBRARY_SERVICE = "chat-pipeline-library"
REDACTION_SERVICE = "chat-pipeline-redaction"

CANARY_QUESTION = "Canary question 41c9: where is parcel heron-velvet-88?"
TOOL_ARGUMENTS = '{"order": "canary-order-walrus-17"}'
TOOL_RESULT = "canary tool result: shipped to lantern-quay-52"
CANARIES = (CANARY_QUESTION, "heron-velvet-88", DEMO_ANSWER, "walrus-17", "lantern-quay-52")


# -- what Jaeger's query API answers ---------------------------------------------------------


def tags(item: dict[str, Any]) -> dict[str, Any]:
    """The tags of a span (or the fields of a log), by key."""
    return {tag["key"]: tag["value"] for tag in item.get("tags", item.get("fields", []))}


def parent_of(span: dict[str, Any]) -> str | None:
    parents = [r["spanID"] for r in span.get("references", []) if r["refType"] == "CHILD_OF"]
    return parents[0] if parents else None


@dataclass
class Trace:
    """One trace as Jaeger's ``/api/traces`` answers it."""

    raw: dict[str, Any]

    @property
    def spans(self) -> list[dict[str, Any]]:
        return list(self.raw["spans"])

    def service(self, span: dict[str, Any]) -> str:
        return str(self.raw["processes"][span["processID"]]["serviceName"])

    def roots(self) -> list[dict[str, Any]]:
        return [s for s in self.spans if parent_of(s) is None]

    def root(self) -> dict[str, Any]:
        (root,) = self.roots()
        return root

    def children(self, span: dict[str, Any]) -> list[dict[str, Any]]:
        """`span`'s children in start order."""
        found = [s for s in self.spans if parent_of(s) == span["spanID"]]
        return sorted(found, key=lambda s: (s["startTime"], s["spanID"]))

    def attempts(self, chat: dict[str, Any]) -> list[dict[str, Any]]:
        return [s for s in self.children(chat) if s["operationName"].startswith("route_attempt ")]


def kind(span: dict[str, Any]) -> str:
    """The span's kind as Jaeger shows it (the ``span.kind`` tag, absent for INTERNAL)."""
    return str(tags(span).get("span.kind", "internal"))


def status(span: dict[str, Any]) -> str:
    """OK, ERROR or UNSET, as Jaeger shows it (``otel.status_code``, ``error``)."""
    found = tags(span)
    code = found.get("otel.status_code", "UNSET")
    assert (code == "ERROR") == (found.get("error") is True), found
    return str(code)


def stored_traces(jaeger: Jaeger, service: str, expected: int) -> list[Trace]:
    """The traces of `service` once Jaeger holds `expected` of them (the collector's
    exporter queue sends them on a moment after it took them)."""

    def probe() -> list[Trace] | None:
        traces = jaeger.traces(service)
        return [Trace(t) for t in traces] if len(traces) >= expected else None

    try:
        return poll(probe, timeout=60, interval=0.5, what=f"{expected} traces of {service}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; Jaeger has {len(jaeger.traces(service))}") from None


def by_request_id(traces: list[Trace]) -> dict[str, Trace]:
    found: dict[str, Trace] = {}
    for trace in traces:
        value = tags(trace.root())["http.response.header.x-request-id"]
        # An array attribute: Jaeger shows it as a JSON list.
        (request_id,) = json.loads(value) if isinstance(value, str) else value
        found[request_id] = trace
    return found


# -- the runs --------------------------------------------------------------------------------


def _demo(collector: Collector) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "demo", "--otlp", collector.http_url, CANARY_QUESTION],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return done


def _gateway_env(collector: Collector, service: str) -> dict[str, str]:
    return {
        "OTEL_SERVICE_NAME": service,
        # gRPC here (the demo sends OTLP/HTTP): both of the collector's receivers are used.
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{collector.grpc_endpoint}",
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }


# Content attributes (GenAI conventions, current and legacy) another instrumentation in the
# same process might record: the collector must drop each, from spans and span events.
CONTENT_ATTRIBUTES: dict[str, str] = {
    "gen_ai.input.messages": '[{"role": "user", "parts": ["canary-input-otter-3"]}]',
    "gen_ai.output.messages": '[{"role": "assistant", "parts": ["canary-output-lynx-5"]}]',
    "gen_ai.system_instructions": "canary-system-ibis-7",
    "gen_ai.tool.call.arguments": '{"canary": "arguments-mole-9"}',
    "gen_ai.tool.call.result": "canary-result-newt-11",
    "gen_ai.prompt": "canary-prompt-crane-13",
    "gen_ai.prompt.0.content": "canary-prompt-content-wren-15",
    "gen_ai.prompt.0.role": "user",
    "gen_ai.completion": "canary-completion-hare-19",
    "gen_ai.completion.0.content": "canary-completion-content-vole-21",
}
CONTROL_ATTRIBUTES: dict[str, AttributeValue] = {
    "gen_ai.operation.name": "chat",
    "gen_ai.request.model": "model-control",
    "gen_ai.usage.input_tokens": 12,
    "gen_ai.tool.name": "lookup_order",
    "chat_pipeline.route.name": "primary",
    "chat_pipeline.route.output_committed": False,
}
REDACTED_SPAN = "chat model-control"
REDACTED_EVENT = "gen_ai.client.inference.operation.details"


def _redaction(collector: Collector) -> None:
    handle = configure(
        REDACTION_SERVICE, endpoint=collector.http_url, set_global=False, metrics=False
    )
    assert handle.tracer_provider is not None
    tracer = handle.tracer_provider.get_tracer("redaction-check")
    attributes: dict[str, AttributeValue] = {**CONTENT_ATTRIBUTES, **CONTROL_ATTRIBUTES}
    with tracer.start_as_current_span(
        REDACTED_SPAN, kind=SpanKind.CLIENT, attributes=attributes
    ) as span:
        span.add_event(REDACTED_EVENT, attributes=attributes)
    handle.shutdown()
    assert (handle.spans.accepted, handle.spans.failed) == (1, 0)


def _attempts_by_service(prometheus: Prometheus) -> dict[str, float]:
    # The collector's exporter puts the service name in `job`; Prometheus keeps its own
    # scrape job there and renames the scraped one `exported_job`.
    result = prometheus.query("sum by (exported_job) (chat_pipeline_route_attempt_count_total)")
    return {s["metric"].get("exported_job", ""): float(s["value"][1]) for s in result}


def _scraped(prometheus: Prometheus, expected: dict[str, int], phase: int) -> None:
    def probe() -> bool | None:
        seen = _attempts_by_service(prometheus)
        # At least: a fleet's count is the calls its deployments saw, and an attempt cut
        # before its call arrived would be one more.
        return True if all(seen.get(j, 0) >= n for j, n in expected.items()) else None

    try:
        poll(probe, timeout=60, interval=0.25, what=f"Prometheus to scrape phase {phase}")
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}: {_attempts_by_service(prometheus)} of {expected}\n"
            f"{prometheus.server.log_tail()}"
        ) from None


@dataclass
class Exported:
    """Everything sent through the collector, and the Prometheus scraping it."""

    demo: subprocess.CompletedProcess[str]
    prometheus: Prometheus
    answered: list[str] = field(default_factory=list)  # the gateway's, by request id
    tool_rounds: list[str] = field(default_factory=list)
    hedged: list[tuple[str, bool]] = field(default_factory=list)


@pytest.fixture(scope="module")
def exported(collector: Collector, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exported]:
    workdir = tmp_path_factory.mktemp("jaeger-runs")
    library = configure(
        LIBRARY_SERVICE, endpoint=collector.http_url, set_global=False, traces=False
    )
    assert library.meter_provider is not None
    providers = {"meter_provider": library.meter_provider, "tracer_provider": TracerProvider()}
    fleet_run = scripted.FleetRun(**providers)
    try:
        with running_prometheus(
            [collector.prometheus_target], tmp_path_factory.mktemp("prometheus")
        ) as prometheus:
            run = Exported(_demo(collector), prometheus)
            _redaction(collector)
            with (
                gateway.running_gateway(
                    workdir, env=_gateway_env(collector, GATEWAY_SERVICE)
                ) as gw,
                gateway.running_fleet_gateway(
                    workdir, env=_gateway_env(collector, FLEET_SERVICE)
                ) as fleet,
                gateway.running_hedged_gateway(
                    workdir, env=_gateway_env(collector, HEDGED_SERVICE)
                ) as hedged,
            ):
                for phase in (1, 2):
                    asyncio.run(scripted.run_phase(**providers))
                    asyncio.run(fleet_run.phase())
                    library.meter_provider.force_flush()
                    run.answered += gw.phase()
                    fleet.phase()
                    expected = {
                        LIBRARY_SERVICE: scripted.ATTEMPTS_PER_PHASE * phase + fleet_run.attempts,
                        GATEWAY_SERVICE: gateway.ATTEMPTS_PER_PHASE * phase,
                        FLEET_SERVICE: fleet.attempts,
                    }
                    _scraped(prometheus, expected, phase)
                run.tool_rounds = gw.tool_calls(TOOL_ARGUMENTS, TOOL_RESULT)
                run.hedged = hedged.requests()
            # The servers stopped: their spans were flushed to the collector.
            yield run
    finally:
        library.shutdown()


# -- the collector's config ------------------------------------------------------------------


def test_the_collector_validates_the_shipped_config_unchanged() -> None:
    done = subprocess.run(
        [str(otel_binary("otelcol")), "validate", f"--config={SHIPPED_COLLECTOR_CONFIG}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_collector_is_built_from_exactly_the_components_the_config_names() -> None:
    done = subprocess.run(
        [str(otel_binary("otelcol")), "components"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    built = yaml.safe_load(done.stdout)
    config = yaml.safe_load(SHIPPED_COLLECTOR_CONFIG.read_text())
    for kind_ in ("receivers", "processors", "exporters"):
        named = {component.split("/", 1)[0] for component in config[kind_]}
        assert {c["name"] for c in built[kind_]} == named, kind_
    assert not built.get("extensions") and not built.get("connectors")
    # The release the compose stack runs (otel/opentelemetry-collector-contrib).
    assert f":{built['buildinfo']['version']}" in compose_image("otel-collector")


def compose_image(service: str) -> str:
    compose = yaml.safe_load(COMPOSE.read_text())
    return str(compose["services"][service]["image"])


def test_jaeger_is_the_release_the_compose_stack_runs() -> None:
    done = subprocess.run(
        [str(otel_binary("jaeger")), "version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    version = json.loads(done.stdout)["gitVersion"]  # its build information, as JSON
    assert compose_image("jaeger") == f"jaegertracing/jaeger:{version.removeprefix('v')}"


def _paths(value: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    if isinstance(value, dict):
        found: dict[tuple[str, ...], Any] = {}
        for key, item in value.items():
            found.update(_paths(item, (*prefix, str(key))))
        return found
    return {prefix: value}


def test_the_collector_runs_the_shipped_config_with_only_its_endpoints_moved(
    collector: Collector,
) -> None:
    shipped = yaml.safe_load(SHIPPED_COLLECTOR_CONFIG.read_text())
    ran = collector.config
    assert ran["processors"] == shipped["processors"]
    for name, pipeline in shipped["service"]["pipelines"].items():
        assert ran["service"]["pipelines"][name]["processors"] == pipeline["processors"]
    before, after = _paths(shipped), _paths(ran)
    changed = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
    tempo = {p for p in changed if "otlp_grpc/tempo" in p}
    assert tempo == {p for p in before if p[:2] == ("exporters", "otlp_grpc/tempo")}
    moved = changed - tempo - {("service", "pipelines", "traces", "exporters")}
    telemetry = ("service", "telemetry", "metrics", "readers")
    assert all(p[-1] == "endpoint" or p[: len(telemetry)] == telemetry for p in moved), moved
    assert ran["service"]["pipelines"]["traces"]["exporters"] == [
        e for e in shipped["service"]["pipelines"]["traces"]["exporters"] if "tempo" not in e
    ]


# -- the demo --------------------------------------------------------------------------------


def test_the_demo_exports_through_the_collector(exported: Exported, collector: Collector) -> None:
    assert f"spans and metrics exported to {collector.http_url}" in exported.demo.stdout
    assert exported.demo.stderr == "", exported.demo.stderr


def test_jaeger_shows_each_demo_request_as_a_chat_span_with_an_attempt_per_route(
    exported: Exported, jaeger: Jaeger
) -> None:
    traces = stored_traces(jaeger, DEMO_SERVICE, 2)
    assert len(traces) == 2  # the streamed request and the whole one
    for trace in traces:
        assert {trace.service(s) for s in trace.spans} == {DEMO_SERVICE}
        chat = trace.root()
        assert chat["operationName"] == "chat simulated-small"
        assert kind(chat) == "client" and status(chat) == "UNSET"
        assert tags(chat)["chat_pipeline.route.name"] == "backup"
        assert tags(chat)["chat_pipeline.route.attempts"] == 2
        assert tags(chat)["chat_pipeline.route.fallback"] is True
        primary, backup = trace.attempts(chat)
        assert len(trace.spans) == 3
        assert primary["operationName"] == "route_attempt primary"
        assert tags(primary)["chat_pipeline.route.outcome"] == "failed_before_output"
        assert tags(primary)["chat_pipeline.route.output_committed"] is False
        assert tags(primary)["error.type"] == "TransientProviderError"
        assert status(primary) == "ERROR" and kind(primary) == "internal"
        assert backup["operationName"] == "route_attempt backup"
        assert tags(backup)["chat_pipeline.route.outcome"] == "completed"
        assert tags(backup)["chat_pipeline.route.output_committed"] is True
        assert tags(backup)["chat_pipeline.route.time_to_first_update"] > 0
        assert status(backup) == "UNSET"
        assert primary["startTime"] <= backup["startTime"]


# -- the gateway -----------------------------------------------------------------------------


def test_jaeger_shows_each_gateway_request_under_its_server_span(
    exported: Exported, jaeger: Jaeger
) -> None:
    expected = gateway.REQUESTS_PER_PHASE * 2 + len(exported.tool_rounds)
    traces = stored_traces(jaeger, GATEWAY_SERVICE, expected)
    assert len(traces) == expected
    by_id = by_request_id(traces)
    for request_id in exported.answered:
        trace = by_id[request_id]
        server = trace.root()
        assert server["operationName"] == "POST /v1/chat/completions"
        assert kind(server) == "server" and status(server) == "UNSET"
        assert {trace.service(s) for s in trace.spans} == {GATEWAY_SERVICE}
        assert tags(server)["chat_pipeline.route.name"] == "backup"
        assert tags(server)["chat_pipeline.route.attempts"] == 2
        assert tags(server)["chat_pipeline.route.fallback"] is True
        (chat,) = trace.children(server)
        assert kind(chat) == "client" and status(chat) == "UNSET"
        assert tags(chat)["chat_pipeline.route.name"] == "backup"
        primary, backup = trace.attempts(chat)
        assert tags(primary)["chat_pipeline.route.name"] == "primary"
        assert tags(primary)["chat_pipeline.route.outcome"] == "failed_before_output"
        assert status(primary) == "ERROR"
        assert tags(backup)["chat_pipeline.route.outcome"] == "completed"
        assert tags(backup)["chat_pipeline.route.output_committed"] is True
        assert tags(backup)["chat_pipeline.route.time_to_first_update"] > 0


def test_no_question_answer_or_tool_content_reaches_jaeger(
    exported: Exported, jaeger: Jaeger
) -> None:
    everything = json.dumps(
        [jaeger.traces(service) for service in jaeger.services()], ensure_ascii=False
    )
    assert "route_attempt backup" in everything  # the traces searched are there
    for canary in CANARIES:
        assert canary not in everything, canary
    for value in CONTENT_ATTRIBUTES.values():
        if "canary" in value:
            assert value not in everything, value


# -- the collector's redaction ---------------------------------------------------------------


def test_the_collector_drops_content_from_spans_and_span_events(
    exported: Exported, jaeger: Jaeger
) -> None:
    (trace,) = stored_traces(jaeger, REDACTION_SERVICE, 1)
    span = trace.root()
    assert span["operationName"] == REDACTED_SPAN and kind(span) == "client"
    (event,) = span["logs"]
    for where in (tags(span), tags(event)):
        assert not set(CONTENT_ATTRIBUTES) & set(where), where
        for key, value in CONTROL_ATTRIBUTES.items():
            assert where[key] == value, (key, where)
    assert tags(event)["event"] == REDACTED_EVENT


# -- the dashboard through the collector -----------------------------------------------------


@pytest.mark.parametrize(
    ("title", "query", "legend"),
    [pytest.param(t, q, legend, id=f"{t[:40]}-{r}") for t, r, q, legend in dashboard_targets()],
)
def test_every_dashboard_query_answers_through_the_collector(
    exported: Exported, title: str, query: str, legend: str
) -> None:
    import math
    import re

    result = exported.prometheus.query(query)
    assert result, f"{title!r}: no series for {query}"
    values = [float(sample["value"][1]) for sample in result]
    assert any(math.isfinite(v) for v in values), f"{title!r}: {result}"
    for sample in result:
        for label in re.findall(r"{{\s*(\w+)\s*}}", legend):
            assert sample["metric"].get(label), f"{title!r}: a series without {label}: {sample}"


# -- the gateway's other runs ---------------------------------------------------------------


def array(value: Any) -> list[Any]:
    """An array attribute as Jaeger shows it: its model has no arrays, so a JSON string."""
    assert isinstance(value, str), value
    found = json.loads(value)
    assert isinstance(found, list), value
    return found


def _gateway_traces(exported: Exported, jaeger: Jaeger) -> dict[str, Trace]:
    expected = gateway.REQUESTS_PER_PHASE * 2 + len(exported.tool_rounds)
    return by_request_id(stored_traces(jaeger, GATEWAY_SERVICE, expected))


def test_jaeger_shows_the_cut_after_output_and_the_terminal_failure(
    exported: Exported, jaeger: Jaeger
) -> None:
    traces = _gateway_traces(exported, jaeger)
    answered = {*exported.answered, *exported.tool_rounds}
    failed = [t for request_id, t in traces.items() if request_id not in answered]
    assert len(failed) == 4  # each phase: a cut after output, a terminal failure
    by_status: dict[int, list[Trace]] = {}
    for trace in failed:
        by_status.setdefault(tags(trace.root())["http.response.status_code"], []).append(trace)
    assert {code: len(found) for code, found in by_status.items()} == {200: 2, 503: 2}
    for trace in by_status[200]:  # the stream had started: the cut is told in-band
        (chat,) = trace.children(trace.root())
        assert kind(chat) == "client" and status(chat) == "ERROR"
        primary, backup = trace.attempts(chat)
        assert tags(primary)["chat_pipeline.route.outcome"] == "failed_before_output"
        assert tags(backup)["chat_pipeline.route.outcome"] == "failed_after_output"
        assert tags(backup)["chat_pipeline.route.output_committed"] is True
        assert tags(backup)["chat_pipeline.route.terminal"] is True
        assert tags(backup)["chat_pipeline.route.time_to_first_update"] > 0
        assert status(backup) == "ERROR"
    for trace in by_status[503]:  # every route failed before output
        server = trace.root()
        assert status(server) == "ERROR"
        (chat,) = trace.children(server)
        assert status(chat) == "ERROR"
        primary, backup = trace.attempts(chat)
        assert [tags(a)["chat_pipeline.route.outcome"] for a in (primary, backup)] == [
            "failed_before_output",
            "failed_before_output",
        ]
        assert tags(backup)["chat_pipeline.route.terminal"] is True
        assert "chat_pipeline.route.time_to_first_update" not in tags(backup)
        assert status(primary) == status(backup) == "ERROR"


def test_jaeger_shows_the_tool_call_rounds(exported: Exported, jaeger: Jaeger) -> None:
    traces = _gateway_traces(exported, jaeger)
    rounds = [traces[request_id] for request_id in exported.tool_rounds]
    # A call, its answer; again (the first call streamed, the second not).
    reasons = []
    for trace in rounds:
        server = trace.root()
        assert status(server) == "UNSET"
        (chat,) = trace.children(server)
        reasons.append(array(tags(chat)["gen_ai.response.finish_reasons"]))
        _primary, backup = trace.attempts(chat)
        assert tags(backup)["chat_pipeline.route.outcome"] == "completed"
        assert tags(backup)["chat_pipeline.route.output_committed"] is True
    assert reasons == [["tool_calls"], ["stop"], ["tool_calls"], ["stop"]]


SELECTION_REASONS = {"strategy", "preferred", "probe", "failover", "hedge"}


def test_jaeger_shows_why_each_fleet_attempt_chose_its_route(
    exported: Exported, jaeger: Jaeger
) -> None:
    traces = stored_traces(jaeger, FLEET_SERVICE, 2)
    reasons: dict[str, int] = {}
    for trace in traces:
        (chat,) = trace.children(trace.root())
        attempts = trace.attempts(chat)
        assert [tags(a)["chat_pipeline.route.attempt"] for a in attempts] == list(
            range(1, len(attempts) + 1)
        )
        for before, attempt in zip([None, *attempts], attempts, strict=False):
            reason = tags(attempt)["chat_pipeline.route.selection"]
            assert reason in SELECTION_REASONS, reason
            reasons[reason] = reasons.get(reason, 0) + 1
            if reason == "failover":  # the attempt before it failed before output
                assert before is not None
                assert tags(before)["chat_pipeline.route.outcome"] == "failed_before_output"
        assert (
            tags(attempts[-1])["chat_pipeline.route.outcome"] == "completed"
        )  # every one answered
    assert reasons.get("strategy") and reasons.get("failover"), reasons


def test_jaeger_shows_each_hedged_request(exported: Exported, jaeger: Jaeger) -> None:
    traces = by_request_id(stored_traces(jaeger, HEDGED_SERVICE, len(exported.hedged)))
    assert len(traces) == len(exported.hedged)
    hedged_modes = set()
    for request_id, streamed in exported.hedged:
        trace = traces[request_id]
        server = trace.root()
        assert status(server) == "UNSET" and tags(server)["chat_pipeline.route.name"] == "fast"
        (chat,) = trace.children(server)
        assert status(chat) == "UNSET"
        attempts = trace.attempts(chat)
        first = tags(attempts[0])
        assert first["chat_pipeline.route.selection"] == "strategy"
        if first["chat_pipeline.route.name"] == "fast":  # its turn of the round robin: no hedge
            assert len(attempts) == 1 and first["chat_pipeline.route.outcome"] == "completed"
            continue
        hedged_modes.add(streamed)
        hung, fast = attempts
        # The hung attempt lost the race: no error, no output, not the last word.
        assert first["chat_pipeline.route.outcome"] == "abandoned"
        assert first["chat_pipeline.route.output_committed"] is False
        assert "chat_pipeline.route.time_to_first_update" not in first
        assert status(hung) == "UNSET"
        assert tags(fast)["chat_pipeline.route.selection"] == "hedge"
        assert tags(fast)["chat_pipeline.route.hedge"] is True
        assert tags(fast)["chat_pipeline.route.outcome"] == "completed"
        assert tags(fast)["chat_pipeline.route.output_committed"] is True
        assert hung["startTime"] < fast["startTime"]
    assert hedged_modes == {True, False}  # a streamed and a whole request were hedged


def test_jaeger_search_finds_failovers_and_requests_by_tag(
    exported: Exported, jaeger: Jaeger
) -> None:
    traces = _gateway_traces(exported, jaeger)
    fallbacks = {
        rid
        for rid, t in traces.items()
        if tags(t.root()).get("chat_pipeline.route.fallback") is True
    }
    assert set(exported.answered) <= fallbacks
    found = jaeger.traces(GATEWAY_SERVICE, tags={"chat_pipeline.route.fallback": "true"})
    assert {t["traceID"] for t in found} == {traces[rid].raw["traceID"] for rid in fallbacks}
    # The request id is an array attribute (HTTP conventions): Jaeger matches its JSON form.
    request_id = exported.answered[0]
    key = "http.response.header.x-request-id"
    (match,) = jaeger.traces(GATEWAY_SERVICE, tags={key: json.dumps([request_id])})
    assert match["traceID"] == traces[request_id].raw["traceID"]
    assert jaeger.traces(GATEWAY_SERVICE, tags={key: request_id}) == []
