"""A third party opening a breaker that replicas share through Redis."""

from __future__ import annotations

from middleware.breaker import CircuitBreakerChatClient
from pipeline.errors import TransientProviderError
from pipeline.testing import ScriptedChatClient, collect, fail


async def trip(name: str, redis_url: str, reset_timeout: float = 600) -> None:
    """Open the breaker `name` in the Redis at `redis_url` (one failure with fail_max=1),
    for `reset_timeout` seconds."""
    tripper = CircuitBreakerChatClient(
        ScriptedChatClient(fail(TransientProviderError())),
        name=name,
        redis=redis_url,
        redis_timeout=5,
        fail_max=1,
        reset_timeout=reset_timeout,
    )
    await collect(tripper, "hi", streaming=False)
    assert tripper.state == "open"
    await tripper.aclose()
