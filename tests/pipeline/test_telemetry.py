"""configure(): OTLP export, checked on the wire by a local receiver that decodes protobuf."""

import pytest

from pipeline import ChatPipeline
from pipeline.errors import TransientProviderError
from pipeline.telemetry import configure
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
    assert _attributes(chat)["ai.route.name"] == "backup"
    assert _attributes(chat)["ai.route.fallback"] is True
    for name, outcome in (("primary", "failed_before_output"), ("backup", "completed")):
        attempt = by_name[f"route_attempt {name}"]
        assert attempt.parent_span_id == chat.span_id  # type: ignore[attr-defined]
        assert _attributes(attempt)["ai.route.outcome"] == outcome
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
