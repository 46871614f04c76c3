"""A real Arize Phoenix receives `chat-pipeline demo --otlp`: traces, and never any text.

Phoenix is traces-only (it answers 405 on /v1/metrics), so the demo runs with
``OTEL_METRICS_EXPORTER=none`` and must log no export error. The question passed on the
command line and the demo's answer are canaries: neither may appear in what Phoenix
returns through its REST API nor anywhere in the files it stored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from pipeline.cli import DEMO_ANSWER
from tests.e2e import gateway
from tests.e2e.servers import Phoenix, poll

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CANARY_QUESTION = "Canary question 7f3a: which route answered zebra-otter-41?"
CANARIES = (CANARY_QUESTION, "zebra-otter-41", DEMO_ANSWER, "kept this answer flowing")
REQUESTS = 2  # the demo streams one answer, then asks for one whole
SPANS_PER_REQUEST = 3  # the chat span and one attempt span per route
GATEWAY_PROJECT = "gateway"  # the gateway's traces go to a Phoenix project of their own


@dataclass
class DemoRun:
    stdout: str
    stderr: str
    spans: list[dict[str, Any]]

    def roots(self) -> list[dict[str, Any]]:
        return [s for s in self.spans if s["parent_id"] is None]

    def children(self, root: dict[str, Any]) -> list[dict[str, Any]]:
        return [s for s in self.spans if s["parent_id"] == root["context"]["span_id"]]


@pytest.fixture(scope="module")
def demo(phoenix: Phoenix) -> DemoRun:
    env = {**os.environ, "OTEL_METRICS_EXPORTER": "none"}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "demo", "--otlp", phoenix.url, CANARY_QUESTION],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    expected = REQUESTS * SPANS_PER_REQUEST

    def stored() -> list[dict[str, Any]] | None:
        spans = phoenix.spans()
        return spans if len(spans) >= expected else None

    # Phoenix acknowledges the export before its bulk inserter writes the spans.
    spans = poll(stored, timeout=60, interval=0.5, what=f"{expected} spans in Phoenix")
    return DemoRun(done.stdout, done.stderr, spans)


def test_the_demo_exports_traces_only_without_an_export_error(
    demo: DemoRun, phoenix: Phoenix
) -> None:
    assert f"spans exported to {phoenix.url}" in demo.stdout
    assert demo.stderr == "", demo.stderr  # no "Failed to export" from a 405 on /v1/metrics


def test_phoenix_returns_each_request_as_one_trace_with_an_attempt_per_route(
    demo: DemoRun,
) -> None:
    assert len(demo.spans) == REQUESTS * SPANS_PER_REQUEST
    roots = demo.roots()
    assert len(roots) == REQUESTS
    assert len({r["context"]["trace_id"] for r in roots}) == REQUESTS
    for root in roots:
        assert root["span_kind"] == "LLM"  # Phoenix derives it from gen_ai.operation.name
        attempts = {a["attributes"]["chat_pipeline.route.name"]: a for a in demo.children(root)}
        assert set(attempts) == {"primary", "backup"}
        primary, backup = attempts["primary"], attempts["backup"]
        assert all(
            a["context"]["trace_id"] == root["context"]["trace_id"] for a in (primary, backup)
        )
        assert primary["attributes"]["chat_pipeline.route.outcome"] == "failed_before_output"
        assert primary["attributes"]["error.type"] == "TransientProviderError"
        assert primary["status_code"] == "ERROR"
        assert backup["attributes"]["chat_pipeline.route.outcome"] == "completed"
        assert backup["attributes"]["chat_pipeline.route.output_committed"] is True
        assert backup["status_code"] == "UNSET"
        assert primary["start_time"] <= backup["start_time"]


def test_no_question_or_answer_text_anywhere_in_what_phoenix_stored(
    demo: DemoRun, phoenix: Phoenix
) -> None:
    served = json.dumps(phoenix.spans())
    stored = phoenix.stored_bytes()
    # The files searched do hold the spans (so the canaries' absence means something).
    assert b"failed_before_output" in stored and b"route_attempt backup" in stored
    for canary in CANARIES:
        assert canary not in served, canary
        assert canary.encode() not in stored, canary
    assert CANARY_QUESTION in demo.stdout  # the canary really went through the demo


# -- the failover story on the trace list (lands with the router refactor) -----------------


def test_root_span_tells_which_route_served_and_that_a_fallback_fired(demo: DemoRun) -> None:
    for root in demo.roots():
        attributes = root["attributes"]
        assert root["name"] == "chat simulated-small"  # no requested model: the served one
        assert attributes["chat_pipeline.route.name"] == "backup"
        assert attributes["chat_pipeline.route.attempts"] == 2
        assert attributes["chat_pipeline.route.fallback"] is True
        provider = attributes.get("gen_ai.provider.name", attributes.get("gen_ai.system"))
        assert provider not in (None, "router")
        assert attributes["gen_ai.request.model"] == "simulated-small"


def test_each_attempt_span_carries_its_routes_model(demo: DemoRun) -> None:
    models = {"primary": "simulated-large", "backup": "simulated-small"}
    for root in demo.roots():
        for attempt in demo.children(root):
            attributes = attempt["attributes"]
            assert (
                attributes["gen_ai.request.model"] == models[attributes["chat_pipeline.route.name"]]
            )


# -- the demo says what Phoenix refused ----------------------------------------------------


def test_the_demo_says_phoenix_refused_its_metrics(phoenix: Phoenix) -> None:
    # Phoenix answers 405 to /v1/metrics: the demo used to print "spans and metrics
    # exported" all the same.
    env = {**os.environ, "OTEL_RESOURCE_ATTRIBUTES": "openinference.project.name=demo-metrics"}
    env.pop("OTEL_METRICS_EXPORTER", None)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "demo", "--otlp", phoenix.url],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    (report,) = [line for line in done.stdout.splitlines() if "exported to" in line]
    assert "spans and metrics exported" not in report
    assert report.startswith(f"spans exported to {phoenix.url}; metrics (")
    assert f"refused by {phoenix.url}" in report
    assert "405" in done.stderr  # the exporter's own error says what Phoenix answered


# -- the gateway's trace list --------------------------------------------------------------


@dataclass
class GatewayTraces:
    request_ids: list[str]
    spans: list[dict[str, Any]]

    def roots(self) -> list[dict[str, Any]]:
        return [s for s in self.spans if s["parent_id"] is None]


@pytest.fixture(scope="module")
def gateway_traces(phoenix: Phoenix, tmp_path_factory: pytest.TempPathFactory) -> GatewayTraces:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.url,
        "OTEL_METRICS_EXPORTER": "none",  # Phoenix takes traces only
        "OTEL_SERVICE_NAME": "chat-pipeline-gateway",
        "OTEL_RESOURCE_ATTRIBUTES": f"openinference.project.name={GATEWAY_PROJECT}",
    }
    with gateway.running_gateway(tmp_path_factory.mktemp("gateway"), env=env) as run:
        request_ids = run.phase()
    # The server stopped: its spans were flushed. Phoenix writes them a little later.

    def stored() -> list[dict[str, Any]] | None:
        try:
            spans = phoenix.spans(GATEWAY_PROJECT)
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code == 404:
                return None  # the project appears with its first span
            raise
        roots = [s for s in spans if s["parent_id"] is None]
        return spans if len(roots) >= gateway.REQUESTS_PER_PHASE else None

    spans = poll(stored, timeout=60, interval=0.5, what="the gateway's traces in Phoenix")
    return GatewayTraces(request_ids, spans)


def test_the_gateways_trace_list_shows_served_model_and_fallback(
    gateway_traces: GatewayTraces,
) -> None:
    roots = gateway_traces.roots()
    assert len(roots) == gateway.REQUESTS_PER_PHASE
    by_request = {r["attributes"]["http.response.header.x-request-id"][0]: r for r in roots}
    for request_id in gateway_traces.request_ids:  # the answered requests
        root = by_request[request_id]
        attributes = root["attributes"]
        assert root["name"] == "POST /v1/chat/completions"
        assert root["span_kind"] == "CHAIN"  # before: unknown
        assert attributes["chat_pipeline.route.name"] == "backup"
        assert attributes["chat_pipeline.route.attempts"] == 2
        assert attributes["chat_pipeline.route.fallback"] is True
        assert attributes["gen_ai.response.model"] == "model-backup"
        # What Phoenix lists as the row's output: the response the client got, by id and
        # served model (no text).
        assert json.loads(attributes["output.value"]) == {
            "id": attributes["gen_ai.response.id"],
            "model": "model-backup",
        }
    failed = [r for r in roots if r["attributes"].get("http.response.status_code") == 503]
    assert len(failed) == 1 and failed[0]["status_code"] == "ERROR"
    assert "gen_ai.response.model" not in failed[0]["attributes"]  # nothing was served
