"""Property tests of the failover engine: whatever the routes do and however the caller
reads, output is never duplicated or mixed, every attempt is reported once, the last one
terminal, and every stream a route opened is closed."""

import contextlib

from hypothesis import given
from hypothesis import strategies as st

from pipeline.errors import RequestInvalidError, TransientProviderError
from pipeline.testing import ScriptedChatClient, ScriptStep, collect, fail, fail_after, reply

from .conftest import RecordingFailover

behaviours = st.one_of(
    st.tuples(st.just("reply"), st.integers(0, 3)),
    st.tuples(st.just("fail_before"), st.booleans()),  # eligible for failover or not
    st.tuples(st.just("fail_after"), st.integers(1, 3)),
    st.tuples(st.just("close_error"), st.integers(0, 2)),
)


def step(route: int, behaviour: tuple[str, object]) -> ScriptStep:
    kind, value = behaviour
    chunks = [f"r{route}c{i}" for i in range(int(value))] if isinstance(value, int) else []
    if kind == "reply":
        return reply("".join(chunks), chunks=chunks)
    if kind == "fail_before":
        return fail(TransientProviderError() if value else RequestInvalidError())
    if kind == "fail_after":
        return fail_after(chunks, TransientProviderError())
    return reply("".join(chunks), chunks=chunks).failing_on_close(TransientProviderError())


@given(
    routes=st.lists(behaviours, min_size=1, max_size=4),
    streaming=st.booleans(),
    abandon_after=st.one_of(st.none(), st.integers(1, 3)),
    max_attempts=st.one_of(st.none(), st.integers(1, 4)),
)
def test_failover_invariants(
    routes: list[tuple[str, object]],
    streaming: bool,
    abandon_after: int | None,
    max_attempts: int | None,
) -> None:
    import asyncio

    clients = [ScriptedChatClient(step(i, b), name=f"r{i}") for i, b in enumerate(routes)]
    router = RecordingFailover(clients, max_attempts_per_request=max_attempts)

    async def run() -> tuple[list[str], BaseException | None]:
        if abandon_after is not None and streaming:
            texts: list[str] = []
            error: BaseException | None = None
            try:
                async with contextlib.aclosing(router.get_streaming_response("hi")) as stream:
                    async for update in stream:
                        texts.append(update.text)
                        if len(texts) == abandon_after:
                            break
            except Exception as exc:
                error = exc
            return texts, error
        result = await collect(router, "hi", streaming=streaming)
        return [u.text for u in result.updates if u.text], result.error

    texts, error = asyncio.run(run())
    attempts = [a for a, _ in router.updates]
    terminals = [t for _, t in router.updates]

    # Every attempt reported once, in order, the last (and only the last) terminal.
    assert attempts, "a request always makes at least one attempt"
    assert [a.number for a in attempts] == list(range(1, len(attempts) + 1))
    assert terminals == [False] * (len(attempts) - 1) + [True]
    # Routes were tried in order, each once, none after the terminal attempt.
    assert [c.call_count for c in clients] == [1] * len(attempts) + [0] * (
        len(clients) - len(attempts)
    )
    if max_attempts is not None:
        assert len(attempts) <= max_attempts
    # Output comes from the last attempt's route only, in order, never duplicated.
    served = len(attempts) - 1
    chunks = [f"r{served}c{i}" for i in range(8)]
    if streaming:
        assert texts == chunks[: len(texts)]
    elif texts:
        assert texts == ["".join(chunks[: len("".join(texts)) // 4])]
    # Only the last attempt may have committed output; earlier ones failed before it.
    assert all(not a.output_committed for a in attempts[:-1])
    assert all(a.outcome == "failed_before_output" for a in attempts[:-1])
    # A failed request ends with the last attempt's own exception.
    last = attempts[-1]
    if error is not None and last.exception is not None:
        assert error is last.exception
    if last.outcome == "completed":
        assert error is None
    # Every stream a route opened was closed.
    assert all(c.streams_opened == c.streams_closed for c in clients)
