"""configure(): OTLP export, checked on the wire by a local receiver that decodes protobuf."""

import logging

import pytest

from pipeline import ChatPipeline
from pipeline.errors import TransientProviderError
from pipeline.telemetry import TelemetryHandle, configure
from pipeline.testing import ScriptedChatClient, collect, fail, reply
from tests.otel import Receiver


def _attributes(span: object) -> dict[str, object]:
    out: dict[str, object] = {}
    for kv in span.attributes:  # type: ignore[attr-defined]
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


async def test_spans_reach_an_otlp_receiver(receiver: Receiver, streaming: bool) -> None:
    handle = configure("chat-pipeline-test", endpoint=receiver.url, set_global=False)
    assert handle.tracer_provider is not None
    providers = {"tracer_provider": handle.tracer_provider, "meter_provider": handle.meter_provider}
    pipeline = (
        ChatPipeline.builder()
        .use_telemetry(**providers)
        .use_ordered_failover(
            [
                ScriptedChatClient(fail(TransientProviderError()), name="primary"),
                ScriptedChatClient(reply("ok"), name="backup"),
            ],
            **providers,
        )
        .build()
    )
    await collect(pipeline, "hi", streaming=streaming)
    handle.shutdown()  # flushes the batch processor
    assert receiver.received.is_set()
    spans = receiver.spans()
    by_name = {s.name: s for s in spans}  # type: ignore[attr-defined]
    # The root span is named after the served route's model and tells the failover story.
    assert set(by_name) == {"chat scripted-model", "route_attempt primary", "route_attempt backup"}
    chat = by_name["chat scripted-model"]
    assert _attributes(chat)["chat_pipeline.route.name"] == "backup"
    assert _attributes(chat)["chat_pipeline.route.fallback"] is True
    for name, outcome in (("primary", "failed_before_output"), ("backup", "completed")):
        attempt = by_name[f"route_attempt {name}"]
        assert attempt.parent_span_id == chat.span_id  # type: ignore[attr-defined]
        assert _attributes(attempt)["chat_pipeline.route.outcome"] == outcome
    service = {
        kv.key: kv.value.string_value
        for kv in receiver.requests[0].resource_spans[0].resource.attributes
    }
    assert service["service.name"] == "chat-pipeline-test"
    assert "/v1/traces" in receiver.paths


def test_sdk_disabled_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    handle = configure("x", set_global=False)
    assert handle.tracer_provider is None and handle.meter_provider is None
    handle.shutdown()


def test_environment_endpoint_and_service_name(
    monkeypatch: pytest.MonkeyPatch, receiver: Receiver
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    handle = configure(set_global=False)
    assert handle.tracer_provider is not None
    with handle.tracer_provider.get_tracer("t").start_as_current_span("probe"):
        pass
    handle.shutdown()
    assert [s.name for s in receiver.spans()] == ["probe"]  # type: ignore[attr-defined]
    resource = receiver.requests[0].resource_spans[0].resource.attributes
    assert {kv.key: kv.value.string_value for kv in resource}["service.name"] == "from-env"


def test_bad_protocol() -> None:
    with pytest.raises(ValueError, match="protocol"):
        configure("x", protocol="udp", set_global=False)  # type: ignore[arg-type]


def _one_span_and_one_record(handle: object) -> None:
    tracer_provider = handle.tracer_provider  # type: ignore[attr-defined]
    meter_provider = handle.meter_provider  # type: ignore[attr-defined]
    if tracer_provider is not None:
        with tracer_provider.get_tracer("t").start_as_current_span("probe"):
            pass
    if meter_provider is not None:
        meter_provider.get_meter("t").create_counter("probe.count").add(1)


def test_both_signals_reach_the_receiver_by_default(receiver: Receiver) -> None:
    handle = configure("x", endpoint=receiver.url, set_global=False)
    _one_span_and_one_record(handle)
    handle.shutdown()
    assert [s.name for s in receiver.spans()] == ["probe"]  # type: ignore[attr-defined]
    assert [p.as_int for p in receiver.metrics()["probe.count"]] == [1]
    assert sorted(set(receiver.paths)) == ["/v1/metrics", "/v1/traces"]


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_traces_only_exports_no_metrics_and_logs_no_error(
    how: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if how == "environment":
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    with Receiver(reject_metrics=True) as phoenix_like:
        handle = configure(
            "x", endpoint=phoenix_like.url, set_global=False, metrics=how != "argument"
        )
        assert handle.tracer_provider is not None and handle.meter_provider is None
        _one_span_and_one_record(handle)
        handle.shutdown()
    assert phoenix_like.paths == ["/v1/traces"]
    assert [s.name for s in phoenix_like.spans()] == ["probe"]  # type: ignore[attr-defined]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_traces_only_backend_rejects_metrics_with_an_error_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Why the switch exists: with metrics on, every export interval logs this error.
    with Receiver(reject_metrics=True) as phoenix_like:
        handle = configure("x", endpoint=phoenix_like.url, set_global=False)
        _one_span_and_one_record(handle)
        handle.shutdown()
    assert "/v1/metrics" in phoenix_like.paths
    assert [r for r in caplog.records if r.levelno >= logging.ERROR and "405" in r.getMessage()]


def test_the_handle_tallies_what_each_backend_took(receiver: Receiver) -> None:
    with Receiver(reject_metrics=True) as phoenix_like:
        handle = configure("x", endpoint=phoenix_like.url, set_global=False)
        _one_span_and_one_record(handle)
        handle.shutdown()
    assert (handle.spans.accepted, handle.spans.failed) == (1, 0)
    assert handle.metrics.accepted == 0 and handle.metrics.failed >= 1
    handle = configure("x", endpoint=receiver.url, set_global=False)
    _one_span_and_one_record(handle)
    handle.shutdown()
    assert handle.spans.failed == handle.metrics.failed == 0
    assert handle.spans.accepted >= 1 and handle.metrics.accepted >= 1


def test_extra_metric_readers_get_a_meter_provider_without_an_exporter() -> None:
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    handle = configure(
        "x",
        set_global=False,
        traces=False,
        metrics=False,
        metric_readers=[reader],
        resource_attributes={"service.instance.id": "worker-1"},
    )
    assert handle.tracer_provider is None and handle.meter_provider is not None
    handle.meter_provider.get_meter("m").create_counter("c").add(1)
    data = reader.get_metrics_data()
    assert data is not None
    (resource,) = data.resource_metrics
    assert resource.resource.attributes["service.instance.id"] == "worker-1"
    assert resource.resource.attributes["service.name"] == "x"
    handle.shutdown()


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_metrics_only(how: str, monkeypatch: pytest.MonkeyPatch, receiver: Receiver) -> None:
    if how == "environment":
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", " None ")
    handle = configure("x", endpoint=receiver.url, set_global=False, traces=how != "argument")
    assert handle.tracer_provider is None and handle.meter_provider is not None
    _one_span_and_one_record(handle)
    handle.shutdown()
    assert receiver.paths == ["/v1/metrics"]
    assert [p.as_int for p in receiver.metrics()["probe.count"]] == [1]


def test_console_exporters_print_instead_of_sending(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], receiver: Receiver
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "console,otlp")
    handle = configure("x", endpoint=receiver.url, set_global=False)
    _one_span_and_one_record(handle)
    handle.shutdown()
    out = capsys.readouterr().out
    assert '"name": "probe"' in out and '"name": "probe.count"' in out
    assert receiver.paths == ["/v1/metrics"]


@pytest.mark.parametrize(
    ("value", "message"),
    [("zipkin", "unsupported exporter 'zipkin'"), ("none,otlp", "'none' cannot be combined")],
)
def test_unsupported_exporter_names_are_refused(
    value: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", value)
    with pytest.raises(ValueError, match=message):
        configure("x", set_global=False)


def test_sdk_disabled_wins_over_exporter_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    handle = configure("x", set_global=False)
    assert handle == TelemetryHandle(None, None)
