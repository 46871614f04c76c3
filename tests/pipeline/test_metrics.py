"""Histogram bucket boundaries: the GenAI conventions' advice, as an exporter receives them."""

from typing import Any

from middleware.routing import Route
from pipeline import ChatPipeline
from pipeline._metrics import DURATION_BUCKETS, TOKEN_BUCKETS
from pipeline.errors import TransientProviderError
from pipeline.testing import ScriptedChatClient, collect, fail, reply
from pipeline.types import UsageDetails
from tests.otel import Otel

DURATIONS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
TOKENS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864]


def _histograms(otel: Otel) -> dict[str, tuple[str, list[Any]]]:
    """name -> (unit, data points) of every histogram the reader collected."""
    data = otel.reader.get_metrics_data()
    found: dict[str, tuple[str, list[Any]]] = {}
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                points = list(metric.data.data_points)
                if points and hasattr(points[0], "explicit_bounds"):
                    found[metric.name] = (metric.unit or "", points)
    return found


def test_the_boundaries_are_the_advised_ones() -> None:
    assert list(DURATION_BUCKETS) == DURATIONS
    assert list(TOKEN_BUCKETS) == TOKENS


async def test_every_histogram_exports_the_advised_boundaries(otel: Otel, streaming: bool) -> None:
    usage = UsageDetails(input_tokens=10, output_tokens=300, total_tokens=310)
    pipeline = (
        ChatPipeline.builder()
        .use_telemetry(**otel.providers)
        .use_ordered_failover(
            [
                Route("primary", ScriptedChatClient(fail(TransientProviderError()))),
                Route("backup", ScriptedChatClient(reply("ok", chunks=["o", "k"], usage=usage))),
            ],
            **otel.providers,
        )
        .build()
    )
    await collect(pipeline, "hi", streaming=streaming)
    histograms = _histograms(otel)
    expected = {
        "gen_ai.client.operation.duration": ("s", DURATIONS),
        "gen_ai.client.token.usage": ("{token}", TOKENS),
        "chat_pipeline.route.time_to_first_update": ("s", DURATIONS),
    }
    if streaming:
        expected["gen_ai.client.operation.time_to_first_chunk"] = ("s", DURATIONS)
    assert set(histograms) == set(expected)
    for name, (unit, bounds) in expected.items():
        found_unit, points = histograms[name]
        assert found_unit == unit, name
        for point in points:
            assert list(point.explicit_bounds) == bounds, name
            assert len(point.bucket_counts) == len(bounds) + 1, name
    # Token counts land in their power-of-four bucket: 10 in (4, 16], 300 in (256, 1024].
    tokens = {
        p.attributes["gen_ai.token.type"]: list(p.bucket_counts)
        for p in histograms["gen_ai.client.token.usage"][1]
    }
    assert tokens["input"] == [0, 0, 1] + [0] * 12
    assert tokens["output"] == [0] * 5 + [1] + [0] * 9
