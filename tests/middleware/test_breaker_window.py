"""The sliding window of the breaker's ratio policies, against a plain recount."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from middleware._breaker_window import BUCKETS, Counts, RatioPolicy, SlidingWindow

# Each step: move the clock on by 0-12 buckets, then add outcomes to a bucket 0-12 back.
steps = st.lists(
    st.tuples(
        st.integers(0, 12),
        st.integers(0, 12),
        st.integers(0, 3),
        st.integers(0, 3),
        st.integers(0, 3),
    ),
    max_size=60,
)


@given(steps)
def test_the_window_holds_what_a_recount_of_its_buckets_finds(
    script: list[tuple[int, int, int, int, int]],
) -> None:
    window = SlidingWindow()
    added: list[tuple[int, int, int, int]] = []
    now = 1_000
    for forward, back, calls, failures, slow in script:
        now += forward
        bucket = now - back
        window.add(bucket, calls, failures, slow)
        if bucket > now - BUCKETS:
            added.append((bucket, calls, failures, slow))
        kept = [a for a in added if a[0] > now - BUCKETS]
        expected = Counts(*(sum(a[i] for a in kept) for i in (1, 2, 3)))
        assert window.counts(now) == expected
    window.clear()
    assert window.counts(now) == Counts(0, 0, 0) and window.buckets() == []


def test_thresholds_are_reached_at_or_above_with_minimum_calls() -> None:
    policy = RatioPolicy(window=30, minimum_calls=10, failure_ratio=0.3, slow_call_ratio=0.5)
    assert policy.width == 3.0
    assert policy.bucket(29.999) == 9 and policy.bucket(30.0) == 10
    assert policy.passed(Counts(9, 9, 9)) is None  # below minimum_calls
    assert policy.passed(Counts(10, 3, 0)) == "failure_ratio"  # 0.3 exactly
    assert policy.passed(Counts(10, 2, 4)) is None
    assert policy.passed(Counts(10, 2, 5)) == "slow_call_ratio"
    off = RatioPolicy(window=30, minimum_calls=1, failure_ratio=None, slow_call_ratio=None)
    assert off.passed(Counts(10, 10, 10)) is None


def test_a_jump_of_more_than_one_window_drops_every_bucket_it_held() -> None:
    # Found by the property test: from bucket 28 to 39, bucket 19 (still in the window at 28)
    # must leave although it is older than the first bucket 39's window could evict.
    window = SlidingWindow()
    window.add(19, 1, 0, 1)
    window.add(28, 0, 0, 1)
    assert window.counts(28) == Counts(1, 0, 2)
    assert window.counts(39) == Counts(0, 0, 0) and window.buckets() == []
