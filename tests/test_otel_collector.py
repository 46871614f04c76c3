"""The shipped collector config and observability example are consistent."""

import json
import re
from pathlib import Path

import yaml

from middleware.routing import _telemetry

ROOT = Path(__file__).resolve().parent.parent
CONFIG = yaml.safe_load((ROOT / "otel-collector.yaml").read_text())
CONTENT_KEYS = ("gen_ai.input.messages", "gen_ai.output.messages")


def test_every_pipeline_references_defined_components() -> None:
    for name, pipeline in CONFIG["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in CONFIG[kind], f"{name}: {kind} {component!r} is not defined"
        assert pipeline["receivers"] and pipeline["exporters"], name


def _drops_content(processor: dict) -> bool:
    text = json.dumps(processor)
    return all(key in text for key in CONTENT_KEYS) and "gen_ai\\\\.prompt" in text


def test_traces_pipeline_drops_content_and_batches_last() -> None:
    traces = CONFIG["service"]["pipelines"]["traces"]
    droppers = [p for p in traces["processors"] if _drops_content(CONFIG["processors"][p])]
    assert droppers, "no content-dropping processor in the traces pipeline"
    assert traces["processors"][0] == "memory_limiter"
    assert traces["processors"][-1] == "batch"
    assert {"otlp/jaeger", "otlp/tempo", "debug"} <= set(traces["exporters"])
    assert "prometheus" in CONFIG["service"]["pipelines"]["metrics"]["exporters"]


def test_otlp_receiver_listens_on_both_protocols() -> None:
    protocols = CONFIG["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert protocols["http"]["endpoint"].endswith(":4318")


def test_compose_mounts_the_config_and_runs_every_backend() -> None:
    compose = yaml.safe_load((ROOT / "examples/observability/docker-compose.yaml").read_text())
    services = compose["services"]
    assert {"otel-collector", "jaeger", "tempo", "prometheus", "grafana"} <= set(services)
    assert any("otel-collector.yaml" in v for v in services["otel-collector"]["volumes"])


def _prometheus_name(metric: str, suffix: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", metric) + suffix


def test_dashboard_queries_use_the_metrics_the_library_emits() -> None:
    dashboard = json.loads(
        (ROOT / "examples/observability/grafana/dashboards/chat-pipeline.json").read_text()
    )
    queries = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for name in (
        _prometheus_name(_telemetry.ATTEMPTS_METRIC, "_total"),
        _prometheus_name(_telemetry.BACKUP_CALLS_METRIC, "_total"),
        _prometheus_name(_telemetry.COST_METRIC, "_total"),
        _prometheus_name(_telemetry.COMMITTED_FAILURES_METRIC, "_total"),
        _prometheus_name(_telemetry.TIME_TO_FIRST_UPDATE_METRIC, "_seconds_bucket"),
    ):
        assert name in queries, name
    assert _prometheus_name(_telemetry.ROUTE_NAME, "") in queries
