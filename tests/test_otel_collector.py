"""The shipped collector config, compose file and Grafana dashboard are consistent with each
other, with current component names, and with the metrics the library really emits."""

import asyncio
import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from opentelemetry.sdk.metrics.export import Histogram, Sum

from tests.e2e.scripted import FleetRun, awaiting, run_phase
from tests.otel import make_otel

ROOT = Path(__file__).resolve().parent.parent
CONFIG = yaml.safe_load((ROOT / "otel-collector.yaml").read_text())
COMPOSE = yaml.safe_load((ROOT / "examples/observability/docker-compose.yaml").read_text())
DASHBOARD = json.loads(
    (ROOT / "examples/observability/grafana/dashboards/chat-pipeline.json").read_text()
)
QUERIES = [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]]
# A query of a series no run here makes yet fails, strictly (see tests.e2e.scripted.AWAITING).
QUERY_CASES = [
    pytest.param(
        q, marks=[pytest.mark.xfail(reason=why, strict=True)] if (why := awaiting(q)) else []
    )
    for q in QUERIES
]
CONTENT_KEYS = ("gen_ai.input.messages", "gen_ai.output.messages")

# Component type names of otelcol-contrib 0.161 that this config may use, and the
# deprecated aliases each replaced (collector 0.144 renamed the OTLP exporters).
CURRENT = {
    "receivers": {"otlp"},
    "processors": {"memory_limiter", "attributes", "transform", "batch"},
    "exporters": {"otlp_grpc", "otlp_http", "prometheus", "debug"},
}
DEPRECATED = {"otlp": "otlp_grpc", "otlphttp": "otlp_http", "logging": "debug"}
PUSH_EXPORTERS = {"otlp_grpc", "otlp_http"}


def _type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


def test_every_pipeline_references_defined_components() -> None:
    for name, pipeline in CONFIG["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in CONFIG[kind], f"{name}: {kind} {component!r} is not defined"
        assert pipeline["receivers"] and pipeline["exporters"], name


@pytest.mark.parametrize("kind", ["receivers", "processors", "exporters"])
def test_component_names_are_current(kind: str) -> None:
    for component in CONFIG[kind]:
        assert _type(component) in CURRENT[kind], f"{kind}: {component!r} is not a current name"
        if kind == "exporters":
            assert _type(component) not in DEPRECATED, (
                f"{component!r}: deprecated alias, use {DEPRECATED[_type(component)]!r}"
            )


def _drops_content(processor: dict[str, Any]) -> bool:
    text = json.dumps(processor)
    return all(key in text for key in CONTENT_KEYS) and "gen_ai\\\\.prompt" in text


def test_traces_pipeline_drops_content_and_every_push_exporter_batches() -> None:
    traces = CONFIG["service"]["pipelines"]["traces"]
    droppers = [p for p in traces["processors"] if _drops_content(CONFIG["processors"][p])]
    assert droppers, "no content-dropping processor in the traces pipeline"
    assert traces["processors"][0] == "memory_limiter"
    assert {"otlp_grpc/jaeger", "otlp_grpc/tempo", "debug"} <= set(traces["exporters"])
    assert "prometheus" in CONFIG["service"]["pipelines"]["metrics"]["exporters"]
    for name, exporter in CONFIG["exporters"].items():
        if _type(name) in PUSH_EXPORTERS:
            # Batching in the exporter's queue replaces the batch processor.
            assert "batch" in exporter["sending_queue"], name


def test_prometheus_exporter_names_metrics_as_the_dashboard_expects() -> None:
    assert CONFIG["exporters"]["prometheus"]["translation_strategy"] == (
        "UnderscoreEscapingWithSuffixes"
    )


def test_otlp_receiver_listens_on_both_protocols() -> None:
    protocols = CONFIG["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert protocols["http"]["endpoint"].endswith(":4318")


def _image(service: str) -> tuple[str, tuple[int, ...]]:
    name, tag = COMPOSE["services"][service]["image"].rsplit(":", 1)
    return name, tuple(int(part) for part in tag.lstrip("v").split("."))


def test_compose_runs_every_backend_on_current_pinned_versions() -> None:
    services = COMPOSE["services"]
    assert {"otel-collector", "jaeger", "tempo", "prometheus", "grafana"} <= set(services)
    assert any("otel-collector.yaml" in v for v in services["otel-collector"]["volumes"])
    # Every image pinned to a full version (no `latest`): the tag parses as numbers.
    name, version = _image("otel-collector")
    assert name == "otel/opentelemetry-collector-contrib"
    assert version >= (0, 144), "otlp_grpc needs collector 0.144 or later"
    name, version = _image("jaeger")
    assert name == "jaegertracing/jaeger" and version[0] == 2, "Jaeger 1 reached end of life"
    assert _image("prometheus")[1][0] >= 3
    assert _image("tempo")[0] == "grafana/tempo"
    assert _image("grafana")[0] == "grafana/grafana"
    assert services["jaeger"]["environment"]["JAEGER_LISTEN_HOST"] == "0.0.0.0"


# -- the dashboard against the metrics the library emits ---------------------------------


def _prometheus_name(name: str, unit: str, kind: str) -> str:
    """The collector's UnderscoreEscapingWithSuffixes translation of an OTel metric name."""
    base = re.sub(r"_+", "_", re.sub(r"[^a-zA-Z0-9_:]", "_", name))
    unit = re.sub(r"\{[^}]*\}", "", unit)  # annotations such as {token} carry no unit
    suffix = {"s": "seconds", "ms": "milliseconds", "By": "bytes", "1": ""}.get(unit, unit)
    if suffix and not base.endswith(f"_{suffix}"):
        base = f"{base}_{suffix}"
    return f"{base}_total" if kind == "counter" else base


def _gateway_request(providers: dict[str, Any]) -> None:
    """One request through the gateway's app (in process): its HTTP metric."""
    from starlette.testclient import TestClient

    from pipeline.config import parse_config
    from pipeline.gateway import create_app

    config = parse_config({"routes": {"scripted": {"provider": "scripted"}}})
    with TestClient(create_app(config, **providers)) as client:
        response = client.post(
            "/v1/chat/completions",
            json={"model": "pipeline", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert response.status_code == 200, response.text


@functools.cache
def emitted() -> dict[str, tuple[str, set[str]]]:
    """Prometheus name -> (kind, label names) of every metric a scripted failover run, a
    balanced fleet (and a request through the gateway) emit."""
    otel = make_otel()
    asyncio.run(run_phase(**otel.providers))
    fleet = FleetRun(**otel.providers)  # its route health is read when the metrics are
    asyncio.run(fleet.phase())
    _gateway_request(otel.providers)
    data = otel.reader.get_metrics_data()
    emitted: dict[str, tuple[str, set[str]]] = {}
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if isinstance(metric.data, Histogram):
                    kind = "histogram"
                elif isinstance(metric.data, Sum) and metric.data.is_monotonic:
                    kind = "counter"
                else:
                    kind = "gauge"
                labels = {
                    re.sub(r"[^a-zA-Z0-9_]", "_", key)
                    for point in metric.data.data_points
                    for key in (point.attributes or {})
                }
                name = _prometheus_name(metric.name, metric.unit or "", kind)
                emitted[name] = (kind, labels)
    return emitted


_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_KEYWORDS = {"and", "or", "unless", "bool", "offset"}


def _series_names(query: str) -> set[str]:
    """The metric names a PromQL query selects: the identifiers left once label lists,
    matchers, ranges and function calls are set aside (a bare ``name`` selects too)."""
    unquoted = re.sub(r'"(?:[^"\\]|\\.)*"', " ", query)  # label_replace's strings name labels
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", _GROUPING.sub(" ", unquoted))
    return set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", bare)) - _KEYWORDS


def _family(series: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if series.endswith(suffix) and series.removesuffix(suffix) in emitted():
            return series.removesuffix(suffix)
    return series


def test_the_run_emits_every_metric_the_library_has() -> None:
    assert set(emitted()) == {
        "gen_ai_client_operation_duration_seconds",
        "gen_ai_client_token_usage",
        "gen_ai_client_operation_time_to_first_chunk_seconds",
        "chat_pipeline_route_attempt_count_total",
        "chat_pipeline_route_backup_calls_total",
        "chat_pipeline_route_output_committed_failures_total",
        "chat_pipeline_route_time_to_first_update_seconds",
        "chat_pipeline_route_cost_total",
        "chat_pipeline_route_cooldowns_total",
        "chat_pipeline_route_health_latency_seconds",
        "chat_pipeline_route_health_in_flight",
        "chat_pipeline_route_health_failure_ratio",
        "chat_pipeline_route_hedges_started_total",
        "chat_pipeline_route_hedges_won_total",
        "chat_pipeline_circuit_breaker_state_changes_total",
        "http_server_request_duration_seconds",
        "chat_pipeline_cache_lookups_total",
        "chat_pipeline_cache_saved_cost_total",
        "chat_pipeline_spend_cost_total",
        "chat_pipeline_spend_unpriced_total",
        "chat_pipeline_spend_written_total",
        "chat_pipeline_spend_spooled_total",
        "chat_pipeline_spend_dropped_total",
    }


@pytest.mark.parametrize("query", QUERY_CASES)
def test_every_query_selects_emitted_series_by_their_labels(query: str) -> None:
    names = _series_names(query)
    assert names, query
    for series in names:
        family = _family(series)
        assert family in emitted(), f"{series!r} is not a metric the library emits"
        kind, labels = emitted()[family]
        if kind == "histogram":
            assert series != family, f"{series!r}: query a histogram's _bucket, _sum or _count"
        used = set(re.findall(r"by \(([^)]*)\)", query))
        used = {label.strip() for group in used for label in group.split(",")} - {"le"}
        used |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*=~?\s*\"", query))
        assert used <= labels, f"{query}: labels {sorted(used - labels)} are not on {family}"


def test_every_emitted_metric_has_a_panel() -> None:
    shown = {_family(series) for query in QUERIES for series in _series_names(query)}
    assert set(emitted()) <= shown, f"no panel for {sorted(set(emitted()) - shown)}"


# -- the compose stack names what the e2e suite builds and runs ------------------------------


def _pinned(name: str) -> str:
    """A version pinned in scripts/build-otel (``NAME=value``), without its leading v."""
    script = (ROOT / "scripts/build-otel").read_text()
    match = re.search(rf"^{name}=v?(\S+)", script, re.MULTILINE)
    assert match, f"scripts/build-otel pins no {name}"
    return match.group(1)


def test_compose_runs_the_collector_and_jaeger_the_e2e_suite_builds() -> None:
    # tests/e2e/test_jaeger.py runs otel-collector.yaml on these very releases.
    images = {name: COMPOSE["services"][name]["image"] for name in ("otel-collector", "jaeger")}
    assert images["otel-collector"].endswith(f":{_pinned('COLLECTOR_VERSION')}"), images
    assert images["jaeger"].endswith(f":{_pinned('JAEGER_RELEASE')}"), images
