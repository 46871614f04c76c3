"""The scenarios of `bench_degradation.py`: a fleet of three deployments of one model, as a
`pipeline.testing.FakeFleet` scenario, and where each fault sits in a run.

Every deployment answers 10 chunks: time to first token lognormal around 0.25 s (sigma 0.35),
then 40 ms a chunk (sigma 0.25), so a healthy answer takes about 0.65 s. (Few chunks keep
the client's CPU per request low: the peers spend about 1 ms of CPU a chunk, and this
benchmark is about routing, not chunk parsing.) Deployment ``a`` is
the one that degrades (it is also the first route of an ordered router):

* ``rate-limit``: 30% of a's calls answer 429 with ``Retry-After: 1``;
* ``brownout``: a's latency (first token and chunks) triples;
* ``hang``: a answers nothing for 15 s (a quarter of the run at most), then recovers;
* ``heavy-tail``: no fault; on every deployment 5% of first tokens come 6x late;
* ``cuts``: a drops 10% of its connections half-way through the answer.

The 429, brownout and cut faults last from a sixth of the run to five sixths of it (10 s to
50 s of a 60 s run); the hang starts at a quarter of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEPLOYMENTS = ("a", "b", "c")
DEGRADED = "a"
CHUNKS = 10
TIME_TO_FIRST_TOKEN = {"median": 0.25, "sigma": 0.35}
CHUNK_DELAY = {"median": 0.04, "sigma": 0.25}
HANG_SECONDS = 15.0
SETTLING = 2.0  # the steady state starts this long after a fault does


@dataclass(frozen=True)
class Scenario:
    """One scenario for a run of `duration` seconds: the faults of the degraded deployment,
    the fault's window (start, end; for the heavy tail, the whole run) and the window the
    steady-state percentiles are taken over."""

    name: str
    title: str
    duration: float
    faults: list[dict[str, Any]] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)
    heavy_tail: bool = False

    @property
    def steady(self) -> tuple[float, float]:
        start, end = self.window
        return (start + SETTLING, end) if self.faults else (start, end)

    def fleet(self, seed: int) -> dict[str, Any]:
        """The `FakeFleet.from_scenario` mapping."""
        first = dict(TIME_TO_FIRST_TOKEN)
        if self.heavy_tail:
            first.update(slow_fraction=0.05, slow_factor=6.0)
        deployments = {
            name: {
                "time_to_first_token": first,
                "chunk_delay": dict(CHUNK_DELAY),
                "chunks": CHUNKS,
                "faults": list(self.faults) if name == DEGRADED else [],
            }
            for name in DEPLOYMENTS
        }
        return {"seed": seed, "deployments": deployments}


def scenarios(duration: float) -> dict[str, Scenario]:
    start, end = duration / 6, duration * 5 / 6
    hang_start = duration / 4
    hang_end = hang_start + min(HANG_SECONDS, duration / 4)
    window = (start, end)
    return {
        "rate-limit": Scenario(
            "rate-limit",
            "30% of a's calls answer 429 with Retry-After 1 s",
            duration,
            [
                {
                    "kind": "rate_limited",
                    "fraction": 0.3,
                    "retry_after": 1.0,
                    "start": start,
                    "end": end,
                }
            ],
            window,
        ),
        "brownout": Scenario(
            "brownout",
            "a's latency triples",
            duration,
            [{"kind": "brownout", "factor": 3.0, "start": start, "end": end}],
            window,
        ),
        "hang": Scenario(
            "hang",
            f"a hangs for {hang_end - hang_start:g} s, then recovers",
            duration,
            [{"kind": "hang", "start": hang_start, "end": hang_end}],
            (hang_start, hang_end),
        ),
        "heavy-tail": Scenario(
            "heavy-tail",
            "heavy tail, no faults (5% of first tokens 6x late)",
            duration,
            [],
            (0.0, duration),
            heavy_tail=True,
        ),
        "cuts": Scenario(
            "cuts",
            "a cuts 10% of its answers half-way",
            duration,
            [{"kind": "cut", "fraction": 0.1, "after": 0.5, "start": start, "end": end}],
            window,
        ),
    }
