"""A scripted run that makes every metric of the library move, for the dashboard checks.

Primary fails behind a circuit breaker (which opens on the first failure: a state change),
backup answers after `BACKUP_DELAY` with token usage and a price (cost), then fails one
request before output (the last route: a terminal failure, which is no fallback), and a
third route fails after its first chunk (a committed failure). Half the routed requests
are streamed (time to first chunk). Each call of `run_phase` builds fresh pipelines (a
fresh breaker) on the given providers, so two phases move every counter twice.
"""

from __future__ import annotations

from typing import Any

from middleware.routing import Route
from middleware.routing.context import Price
from pipeline import ChatPipeline
from pipeline.errors import TransientProviderError
from pipeline.testing import ScriptedChatClient, collect, fail, fail_after, reply
from pipeline.types import UsageDetails

BACKUP_DELAY = 0.05  # the backup's scripted time to first update, in seconds
ROUTED_REQUESTS = 4  # per phase, through primary -> backup
# + the terminal failure (primary, then backup) + the committed failure's single attempt
ATTEMPTS_PER_PHASE = ROUTED_REQUESTS * 2 + 2 + 1


def _pipelines(providers: dict[str, Any]) -> tuple[ChatPipeline, ChatPipeline]:
    primary = (
        ChatPipeline.builder()
        .use_circuit_breaker(
            fail_max=1,
            reset_timeout=3600,
            name="primary",
            meter_provider=providers["meter_provider"],
        )
        .build(ScriptedChatClient(fail(TransientProviderError()), name="primary"))
    )
    answer = reply(
        "an answer",
        chunks=["an ", "answer"],
        delay=BACKUP_DELAY,
        usage=UsageDetails(input_tokens=12, output_tokens=40, total_tokens=52),
    )
    backup = ScriptedChatClient(
        [*[answer] * ROUTED_REQUESTS, fail(TransientProviderError())],
        name="backup",
        model_id="small-model",
    )
    routed = (
        ChatPipeline.builder()
        .use_telemetry(**providers)
        .use_ordered_failover(
            [
                Route("primary", primary, price=Price(5.0, 15.0)),
                Route("backup", backup, price=Price(0.5, 1.5)),
            ],
            **providers,
        )
        .build()
    )
    flaky_client = ScriptedChatClient(
        fail_after(["partial "], TransientProviderError()), name="flaky", model_id="flaky-model"
    )
    flaky = (
        ChatPipeline.builder()
        .use_telemetry(**providers)
        .use_ordered_failover([Route("flaky", flaky_client)], **providers)
        .build()
    )
    return routed, flaky


async def run_phase(*, meter_provider: Any, tracer_provider: Any) -> None:
    """One phase of the run; asserts what the caller saw."""
    providers = {"meter_provider": meter_provider, "tracer_provider": tracer_provider}
    routed, flaky = _pipelines(providers)
    async with routed, flaky:
        for index in range(ROUTED_REQUESTS):
            result = await collect(routed, "question", streaming=index % 2 == 0)
            assert result.error is None and result.text == "an answer", result
        # The last route fails too: nowhere left to fall back to.
        failed = await collect(routed, "question", streaming=False)
        assert isinstance(failed.error, TransientProviderError), failed
        # Output reached the caller before the failure: no failover, a committed failure.
        failed = await collect(flaky, "question", streaming=True)
        assert isinstance(failed.error, TransientProviderError), failed
        assert [u.text for u in failed.updates] == ["partial "]
