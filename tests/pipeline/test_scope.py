"""`pipeline._scope`: what one request may still spend, the operation it belongs to, the
routing report and the attempt timeout; all request-local."""

from __future__ import annotations

import asyncio
import re

import pytest

from pipeline._scope import (
    RequestBudget,
    RouteReport,
    attempt_timed_out,
    current_budget,
    current_operation,
    current_report,
    enter_attempt_timeout,
    enter_budget,
    enter_report,
    exit_attempt_timeout,
    exit_budget,
    exit_report,
    new_operation_id,
    operation_scope,
)

# -- RequestBudget ---------------------------------------------------------------------------


def test_a_budget_without_a_deadline_has_no_remaining_time() -> None:
    assert RequestBudget(None, None, lambda: 0.0).remaining() is None


def test_remaining_time_is_read_on_the_budgets_clock_and_never_negative() -> None:
    now = [10.0]
    budget = RequestBudget(None, 12.5, lambda: now[0])
    assert budget.remaining() == 2.5
    now[0] = 12.5
    assert budget.remaining() == 0.0
    now[0] = 99.0
    assert budget.remaining() == 0.0


def test_calls_are_taken_until_none_is_left_and_a_refusal_spends_nothing() -> None:
    budget = RequestBudget(2, None, lambda: 0.0)
    assert [budget.take_call() for _ in range(4)] == [True, True, False, False]
    assert budget.calls_left == 0


def test_no_call_limit_takes_every_call_without_counting() -> None:
    budget = RequestBudget(None, None, lambda: 0.0)
    assert all(budget.take_call() for _ in range(100))
    assert budget.calls_left is None


def test_a_budgets_repr_shows_what_is_left() -> None:
    budget = RequestBudget(3, 5.0, lambda: 4.0)
    assert repr(budget) == "RequestBudget(calls_left=3, remaining=1.0)"


# -- request-local state ---------------------------------------------------------------------


def test_nothing_is_current_outside_a_request() -> None:
    assert current_budget() is None
    assert current_report() is None
    assert current_operation() is None
    assert attempt_timed_out() is False


def test_entered_state_is_current_until_exited() -> None:
    budget, report = RequestBudget(1, None, lambda: 0.0), RouteReport()
    budget_token, report_token = enter_budget(budget), enter_report(report)
    try:
        assert current_budget() is budget and current_report() is report
    finally:
        exit_report(report_token)
        exit_budget(budget_token)
    assert current_budget() is None and current_report() is None


async def test_concurrent_requests_see_only_their_own_state() -> None:
    both_entered = asyncio.Barrier(2)

    async def request(calls: int) -> tuple[int | None, str]:
        budget = RequestBudget(calls, None, lambda: 0.0)
        token = enter_budget(budget)
        try:
            with operation_scope(f"op-{calls}") as operation:
                await both_entered.wait()  # both requests hold their state at once
                seen = current_budget()
                assert seen is not None and current_operation() == operation
                return seen.calls_left, operation
        finally:
            exit_budget(token)

    assert await asyncio.gather(request(1), request(2)) == [(1, "op-1"), (2, "op-2")]
    assert current_budget() is None and current_operation() is None


def test_a_route_report_starts_empty() -> None:
    report = RouteReport()
    assert (report.route_name, report.metadata, report.attempts, report.fallback) == (
        None,
        None,
        0,
        False,
    )


# -- attempt_timed_out ---------------------------------------------------------------------


async def attempt(limit: asyncio.Timeout, waiting: asyncio.Event, seen: list[bool]) -> None:
    """An attempt under `limit`, as a router runs it: records what `attempt_timed_out()`
    says before it waits, and while it is being cancelled."""
    token = enter_attempt_timeout(limit)
    try:
        async with limit:
            seen.append(attempt_timed_out())
            waiting.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                seen.append(attempt_timed_out())
                raise
    finally:
        exit_attempt_timeout(token)


async def test_an_attempt_timeout_that_fired_is_seen_while_the_attempt_is_cancelled() -> None:
    seen: list[bool] = []
    with pytest.raises(TimeoutError):
        await attempt(asyncio.timeout(0), asyncio.Event(), seen)
    assert seen == [False, True]
    assert attempt_timed_out() is False


async def test_a_callers_cancellation_is_not_an_attempt_timeout() -> None:
    waiting = asyncio.Event()
    seen: list[bool] = []
    task = asyncio.create_task(attempt(asyncio.timeout(3600), waiting, seen))
    await waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [False, False]


# -- operations ------------------------------------------------------------------------------


def test_operation_ids_are_unique_and_share_this_process_prefix() -> None:
    ids = [new_operation_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(re.fullmatch(r"[0-9a-f]{12}-[0-9a-f]+", i) for i in ids)
    assert len({i.split("-")[0] for i in ids}) == 1


def test_an_operation_scope_makes_a_fresh_id_current_and_restores_the_outer_one() -> None:
    with operation_scope() as outer:
        assert current_operation() == outer
        with operation_scope("order-17") as inner:
            assert inner == "order-17" and current_operation() == "order-17"
        assert current_operation() == outer
        with operation_scope() as fresh:
            assert fresh != outer
    assert current_operation() is None


def test_an_operation_scope_is_left_when_its_block_raises() -> None:
    with pytest.raises(KeyError), operation_scope("op"):
        raise KeyError("x")
    assert current_operation() is None


@pytest.mark.parametrize("bad", ["", 17, b"op"])
def test_an_operation_id_must_be_a_non_empty_string(bad: object) -> None:
    message = "operation_id must be a non-empty string or None"
    with pytest.raises(ValueError, match=message), operation_scope(bad):  # type: ignore[arg-type]
        pass
    assert current_operation() is None
