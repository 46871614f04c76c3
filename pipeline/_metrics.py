"""Histograms with the bucket boundaries the OpenTelemetry GenAI conventions advise.

The SDK's default boundaries (0, 5, 10, 25, ... for any unit) put every call under five
seconds into one bucket, so a p95 of seconds-scale latencies means nothing. The boundaries
are given as the instrument's advisory: a view the application configures still wins.
"""

from __future__ import annotations

from opentelemetry.metrics import Histogram, Meter
from opentelemetry.semconv._incubating.metrics import gen_ai_metrics

__all__ = [
    "DURATION_BUCKETS",
    "TOKEN_BUCKETS",
    "duration_histogram",
    "gen_ai_client_histograms",
    "token_histogram",
]

# Seconds: 10 ms doubling up to 81.92 s.
DURATION_BUCKETS: tuple[float, ...] = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
# Tokens: powers of four from 1 to 4**13.
TOKEN_BUCKETS: tuple[float, ...] = tuple(float(4**i) for i in range(14))


def duration_histogram(meter: Meter, name: str, description: str = "") -> Histogram:
    """A histogram of seconds with the advised duration boundaries."""
    return meter.create_histogram(
        name,
        unit="s",
        description=description,
        explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
    )


def token_histogram(meter: Meter, name: str, description: str = "") -> Histogram:
    """A histogram of token counts with the advised token boundaries."""
    return meter.create_histogram(
        name,
        unit="{token}",
        description=description,
        explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
    )


def gen_ai_client_histograms(meter: Meter) -> tuple[Histogram, Histogram, Histogram]:
    """``gen_ai.client.operation.duration``, ``gen_ai.client.token.usage`` and
    ``gen_ai.client.operation.time_to_first_chunk``, named, united and described as the
    conventions' own helpers make them (those take no advisory), with the advised boundaries."""
    return (
        duration_histogram(
            meter, gen_ai_metrics.GEN_AI_CLIENT_OPERATION_DURATION, "GenAI operation duration."
        ),
        token_histogram(
            meter,
            gen_ai_metrics.GEN_AI_CLIENT_TOKEN_USAGE,
            "Number of input and output tokens used.",
        ),
        duration_histogram(
            meter,
            gen_ai_metrics.GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK,
            "Time to receive the first chunk, measured from when the client issues the"
            " generation request to when the first chunk is received in the response stream.",
        ),
    )
