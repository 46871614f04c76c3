"""`FakeFleet`: the schedule and the fractions are what was asked, the draws belong to the
request and the deployment (not to the order calls arrive in), through the real
`OpenAIChatClient`, for both call shapes. Time is a manual clock: nothing here waits on the
wall clock."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest

from pipeline import ChatMessage
from pipeline.errors import RateLimitedError, TransientProviderError
from pipeline.providers import OpenAIChatClient
from pipeline.testing import (
    Collected,
    FakeDeployment,
    FakeFleet,
    Fault,
    FleetCounts,
    Latency,
    collect,
)

ANSWER = "w00 w01 w02 w03 w04 w05 w06 w07 w08 w09"


class ManualClock:
    """A clock the test moves; `sleep` returns when the clock has moved that far."""

    def __init__(self) -> None:
        self.now = 0.0
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []
        self.sleeping = asyncio.Event()  # set while something sleeps

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.now + seconds, future))
        self.sleeping.set()
        try:
            await future
        finally:
            self._sleepers = [s for s in self._sleepers if s[1] is not future]
            if not self._sleepers:
                self.sleeping.clear()

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for due, future in self._sleepers:
            if due <= self.now and not future.done():
                future.set_result(None)

    async def drive(self, task: asyncio.Task[Collected]) -> list[float]:
        """Advance to each sleeper's wake-up until `task` ends; the waits, in order."""
        waited: list[float] = []
        async with asyncio.timeout(10):
            while True:
                sleeping = asyncio.ensure_future(self.sleeping.wait())
                done, _ = await asyncio.wait({task, sleeping}, return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    sleeping.cancel()
                    return waited
                step = min(due for due, _ in self._sleepers) - self.now
                waited.append(round(step, 6))
                self.advance(step)


def message(request: int) -> list[ChatMessage]:
    return [ChatMessage.user(f"{FakeFleet.tag(request)} hello")]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def clients() -> AsyncIterator[dict[str, OpenAIChatClient]]:
    made: dict[str, OpenAIChatClient] = {}
    yield made
    for client in made.values():
        await client.aclose()


def client_of(fleet: FakeFleet, name: str, made: dict[str, OpenAIChatClient]) -> OpenAIChatClient:
    made[name] = OpenAIChatClient("fleet-model", api_key="sk-test", base_url=fleet.base_urls[name])
    return made[name]


# -- the draws --------------------------------------------------------------------------


def test_plans_are_a_function_of_seed_deployment_request_and_call() -> None:
    deployments = [
        FakeDeployment(
            name=name,
            time_to_first_token=Latency.lognormal(0.25, 0.5, slow_fraction=0.1, slow_factor=5),
            chunk_delay=Latency.lognormal(0.02, 0.3),
        )
        for name in ("a", "b")
    ]
    first, second = FakeFleet(deployments, seed=7), FakeFleet(deployments, seed=7)
    assert first.plan("a", 5, at=1.0) == second.plan("a", 5, at=1.0)
    assert first.plan("a", 5, at=1.0) != first.plan("b", 5, at=1.0)
    assert first.plan("a", 5, at=1.0) != first.plan("a", 6, at=1.0)
    assert first.plan("a", 5, 2, at=1.0) != first.plan("a", 5, 1, at=1.0)
    assert FakeFleet(deployments, seed=8).plan("a", 5, at=1.0) != first.plan("a", 5, at=1.0)
    plan = first.plan("a", 5, at=1.0)
    assert plan.outcome == "answered" and len(plan.chunk_delays) == 19
    # Stable across releases: a rehearsal recorded with a seed replays the same draws.
    assert round(plan.time_to_first_token, 6) == 0.1466
    assert round(first.plan("b", 0, at=None).time_to_first_token, 6) == 0.430976


def test_a_distribution_matches_what_was_asked() -> None:
    fleet = FakeFleet(
        [
            FakeDeployment(
                name="a",
                time_to_first_token=Latency.lognormal(
                    0.2, 0.4, slow_fraction=0.05, slow_factor=10, maximum=5.0
                ),
                chunks=1,
            )
        ]
    )
    draws = sorted(fleet.plan("a", n, at=0.0).time_to_first_token for n in range(4000))
    median = draws[len(draws) // 2]
    assert 0.18 < median < 0.23
    slow = sum(1 for d in draws if d > 1.0)  # 5% at 10x, a few normal ones beyond 1 s
    assert 150 < slow < 260
    assert draws[-1] <= 5.0
    assert Latency.fixed(0.3).draw(random.Random(1)) == 0.3


def test_faults_and_brownout_keep_the_same_draws() -> None:
    healthy = FakeDeployment(name="a", time_to_first_token=Latency.lognormal(0.3, 0.5))
    slowed = healthy.model_copy(update={"faults": (Fault.brownout(3.0, start=10, end=20),)})
    base, brown = FakeFleet([healthy], seed=1), FakeFleet([slowed], seed=1)
    for request in range(20):
        before, during = base.plan("a", request, at=15.0), brown.plan("a", request, at=15.0)
        assert during.time_to_first_token == pytest.approx(3 * before.time_to_first_token)
        assert during.chunk_delays == pytest.approx(tuple(3 * d for d in before.chunk_delays))
        assert during.slowdown == 3.0
        assert brown.plan("a", request, at=20.0) == base.plan("a", request, at=20.0)


def test_fractions_are_exact_for_the_seed() -> None:
    fleet = FakeFleet(
        [FakeDeployment(name="a", faults=(Fault.rate_limited(0.3), Fault.cut(0.1)))], seed=11
    )
    outcomes = [fleet.plan("a", n, at=1.0).outcome for n in range(1000)]
    # 30% rate limited; a cut applies to what the rate limit let through: 10% of the rest.
    assert outcomes.count("rate_limited") == 280  # 300 expected, 14.5 standard deviation
    assert outcomes.count("cut") == 68  # 70 expected, 8 standard deviation


# -- the schedule, through the real client ----------------------------------------------


async def test_schedule_over_time_through_the_client(
    clock: ManualClock, clients: dict[str, OpenAIChatClient], streaming: bool
) -> None:
    faults = (
        Fault.rate_limited(1.0, retry_after=2, start=10, end=20),
        Fault.cut(1.0, after=0.3, start=20, end=30),
        Fault.down(start=30, end=40),
        Fault.down(start=40, end=50, status=503),
    )
    fleet = FakeFleet(
        [FakeDeployment(name="a", chunks=10, faults=faults)], clock=clock, sleep=clock.sleep
    )
    async with fleet:
        client = client_of(fleet, "a", clients)
        results: dict[float, Collected] = {}
        for at in (5.0, 15.0, 25.0, 35.0, 45.0, 55.0):
            clock.now = at
            results[at] = await collect(client, message(int(at)), streaming=streaming)
        assert results[5.0].error is None and results[5.0].text == ANSWER
        limited = results[15.0].error
        assert isinstance(limited, RateLimitedError)
        assert limited.status_code == 429 and limited.retry_after == 2.0
        cut = results[25.0]
        assert isinstance(cut.error, TransientProviderError)
        # A stream is cut after 3 of its 10 content chunks; a whole response gives nothing.
        assert [u.text for u in cut.updates if u.text] == (
            ["w00 ", "w01 ", "w02 "] if streaming else []
        )
        assert isinstance(results[35.0].error, TransientProviderError)
        unavailable = results[45.0].error
        assert isinstance(unavailable, TransientProviderError)
        assert unavailable.status_code == 503
        assert results[55.0].error is None and results[55.0].text == ANSWER
        assert fleet.counts()["a"] == FleetCounts(
            calls=6, answered=2, rate_limited=1, cut=1, down=2
        )
        assert [(c.request, c.at, c.outcome) for c in fleet.calls] == [
            (5, 5.0, "answered"),
            (15, 15.0, "rate_limited"),
            (25, 25.0, "cut"),
            (35, 35.0, "down"),
            (45, 45.0, "down"),
            (55, 55.0, "answered"),
        ]


async def test_fraction_counts_through_the_client_match_the_plan(
    clock: ManualClock, clients: dict[str, OpenAIChatClient], streaming: bool
) -> None:
    deployment = FakeDeployment(
        name="a", chunks=4, faults=(Fault.rate_limited(0.3, start=1), Fault.cut(0.2, start=1))
    )
    fleet = FakeFleet([deployment], seed=5, clock=clock, sleep=clock.sleep)
    async with fleet:
        client = client_of(fleet, "a", clients)
        clock.now = 2.0
        for request in range(100):
            await collect(client, message(request), streaming=streaming)
        expected = [fleet.plan("a", n, at=2.0).outcome for n in range(100)]
        counts = fleet.counts()["a"]
        assert counts.calls == 100
        # Expected 30 rate limited (standard deviation 4.6), 14 cut (3.5), 56 answered.
        assert counts.rate_limited == expected.count("rate_limited") == 32
        assert counts.cut == expected.count("cut") == 11
        assert counts.answered == expected.count("answered") == 57
        # The same requests in another order meet the same fates.
        fleet.start()
        clock.now += 2.0  # the schedule restarted: 2 s into it again
        for request in reversed(range(100)):
            await collect(client, message(request), streaming=streaming)
        assert fleet.counts()["a"] == counts
        assert sorted((c.request or 0, c.outcome) for c in fleet.calls) == list(enumerate(expected))


async def test_a_retry_of_a_request_is_its_next_call(
    clients: dict[str, OpenAIChatClient],
) -> None:
    fleet = FakeFleet([FakeDeployment(name="a", chunks=2)], seed=5)
    async with fleet:
        client = client_of(fleet, "a", clients)
        for _ in range(3):
            await client.get_response(message(9))
        await client.get_response("untagged")
        await client.get_response("untagged again")
        calls = fleet.calls
        assert [(c.request, c.call) for c in calls] == [
            (9, 1),
            (9, 2),
            (9, 3),
            (None, 1),
            (None, 1),
        ]
        assert calls[1] == fleet.plan("a", 9, 2, at=calls[1].at)


async def test_the_request_header_numbers_a_request() -> None:
    fleet = FakeFleet([FakeDeployment(name="a", chunks=2)], seed=5)
    async with fleet, httpx2.AsyncClient() as http:
        response = await http.post(
            fleet.base_urls["a"] + "/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Fleet-Request": "42"},
        )
        assert response.status_code == 200
        assert response.json()["choices"][0]["message"]["content"] == "w00 w01"
        assert [c.request for c in fleet.calls] == [42]


async def test_hang_holds_calls_until_it_ends_then_recovers(
    clock: ManualClock, clients: dict[str, OpenAIChatClient], streaming: bool
) -> None:
    deployment = FakeDeployment(
        name="a",
        chunks=10,
        time_to_first_token=Latency.fixed(0.5),
        faults=(Fault.hang(start=10, end=25),),
    )
    fleet = FakeFleet([deployment], clock=clock, sleep=clock.sleep)
    async with fleet:
        client = client_of(fleet, "a", clients)
        clock.now = 12.0
        held = asyncio.create_task(collect(client, message(1), streaming=streaming))
        async with asyncio.timeout(10):
            await fleet.wait_for_calls(outcome="hung")
        assert not held.done()
        # The hang ends at 25: the call is then answered as usual, after its time to first
        # token.
        assert await clock.drive(held) == [13.0, 0.5]
        result = held.result()
        assert result.error is None and result.text == ANSWER
        assert fleet.calls[0].release_at == 25.0
        assert fleet.counts()["a"] == FleetCounts(calls=1, hung=1)


async def test_a_hung_call_ends_when_the_client_leaves(
    clock: ManualClock, clients: dict[str, OpenAIChatClient], streaming: bool
) -> None:
    fleet = FakeFleet(
        [FakeDeployment(name="a", faults=(Fault.hang(start=0),))], clock=clock, sleep=clock.sleep
    )
    async with fleet:
        client = client_of(fleet, "a", clients)
        clock.now = 1.0
        held = asyncio.create_task(collect(client, message(1), streaming=streaming))
        async with asyncio.timeout(10):
            await fleet.wait_for_calls(outcome="hung")
        held.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held
        await client.aclose()  # the pool's connection goes too
        async with asyncio.timeout(10):
            await fleet["a"].wait_for_disconnects(1)
        assert fleet.calls[0].release_at is None
        assert fleet.counts()["a"].hung == 1


async def test_latency_is_waited_on_the_fleet_clock(
    clock: ManualClock, clients: dict[str, OpenAIChatClient], streaming: bool
) -> None:
    deployment = FakeDeployment(
        name="a", chunks=3, time_to_first_token=Latency.fixed(0.4), chunk_delay=Latency.fixed(0.1)
    )
    fleet = FakeFleet([deployment], clock=clock, sleep=clock.sleep)
    async with fleet:
        client = client_of(fleet, "a", clients)
        pending = asyncio.create_task(collect(client, message(1), streaming=streaming))
        waited = await clock.drive(pending)
        assert pending.result().text == "w00 w01 w02"
        # First token, then each further chunk (a whole response waits for them at once).
        assert waited == ([0.4, 0.1, 0.1] if streaming else [0.4, 0.2])


async def test_several_deployments_and_the_oracle_view(
    clients: dict[str, OpenAIChatClient],
) -> None:
    fleet = FakeFleet(
        [
            FakeDeployment(name="a", faults=(Fault.brownout(3, start=0, end=60),)),
            FakeDeployment(name="b"),
            FakeDeployment(name="c", faults=(Fault.hang(start=30, end=45),)),
        ]
    )
    assert fleet.healthy(10.0) == ["b", "c"]
    assert fleet.healthy(40.0) == ["b"]
    assert fleet.healthy(70.0) == ["a", "b", "c"]
    async with fleet:
        assert list(fleet) == ["a", "b", "c"]
        ports = {fleet[name].port for name in fleet}
        assert len(ports) == 3
        for name in ("b", "c"):
            await client_of(fleet, name, clients).get_response(message(1))
        assert {n: c.calls for n, c in fleet.counts().items()} == {"a": 0, "b": 1, "c": 1}
        with pytest.raises(KeyError, match="no deployment named 'd'"):
            fleet["d"]


# -- configuration ------------------------------------------------------------------------


def test_scenario_files(tmp_path: Path) -> None:
    toml = tmp_path / "fleet.toml"
    toml.write_text(
        "seed = 4\n"
        "[deployments.a]\n"
        "time_to_first_token = { median = 0.25, sigma = 0.35 }\n"
        'faults = [{ kind = "rate_limited", fraction = 0.3, retry_after = 1, start = 10 }]\n'
        "[deployments.b]\n"
        "chunks = 5\n"
    )
    fleet = FakeFleet.from_scenario(toml)
    assert fleet.seed == 4 and [d.name for d in fleet.deployments] == ["a", "b"]
    assert fleet.deployments[0].faults == (Fault.rate_limited(0.3, start=10),)
    assert fleet.deployments[1].answer == "w00 w01 w02 w03 w04"
    assert FakeFleet.from_scenario(toml, seed=9).seed == 9
    as_json = tmp_path / "fleet.json"
    as_json.write_text(json.dumps({"deployments": {"x": {"faults": [{"kind": "hang"}]}}}))
    assert FakeFleet.from_scenario(as_json).deployments[0].faults == (Fault.hang(),)


def test_scenario_problems_name_their_key_paths() -> None:
    with pytest.raises(ValueError) as caught:
        FakeFleet.from_scenario(
            {
                "sed": 1,
                "deployments": {
                    "a": {
                        "chunks": 0,
                        "faults": [
                            {"kind": "rate_limited", "fraction": 1.5},
                            {"kind": "brownout", "fraction": 0.5},
                            {"kind": "hang", "start": 5, "end": 3},
                            {"kind": "melt"},
                        ],
                    },
                },
            }
        )
    text = str(caught.value)
    for expected in (
        "sed: unknown setting; did you mean 'seed'?",
        "deployments.a.chunks must be at least 1, got 0",
        "deployments.a.faults[0].fraction must be at most 1.0, got 1.5",
        "deployments.a.faults[1]: fraction: not a setting of a brownout fault",
        "deployments.a.faults[2]: end must be after start (5), got 3",
        "deployments.a.faults[3].kind must be one of",
    ):
        assert expected in text
    with pytest.raises(ValueError, match="deployments must be a table"):
        FakeFleet.from_scenario({"deployments": {}})
    with pytest.raises(ValueError, match="unique: a"):
        FakeFleet([FakeDeployment(name="a"), FakeDeployment(name="a")])
    with pytest.raises(ValueError, match=r"a \.toml or \.json file"):
        FakeFleet.from_scenario("fleet.yaml")
    with pytest.raises(ValueError, match="request number"):
        FakeFleet.tag(-1)


# -- in a process of its own --------------------------------------------------------------


async def fleet_process(scenario: Path, *options: str, **pipes: int) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline", "fake-fleet", "--scenario", str(scenario), *options,
        **pipes,
    )  # fmt: skip


async def test_cli_serves_a_scenario_and_answers_commands(tmp_path: Path) -> None:
    scenario = tmp_path / "fleet.toml"
    scenario.write_text(
        '[deployments.a]\nchunks = 2\nfaults = [{ kind = "down", start = 1000 }]\n'
        "[deployments.b]\nchunks = 3\n"
    )
    process = await fleet_process(
        scenario, "--manual-start", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        async with asyncio.timeout(60):
            lines = [(await process.stdout.readline()).decode().split() for _ in range(3)]
            assert [line[:2] for line in lines[:2]] == [["deployment", "a"], ["deployment", "b"]]
            assert lines[2] == ["ready"]
            process.stdin.write(b"start\n")
            assert (await process.stdout.readline()).strip() == b"started"
            client = OpenAIChatClient("m", api_key="sk-test", base_url=lines[1][2])
            try:
                assert (await client.get_response(message(3))).text == "w00 w01 w02"
            finally:
                await client.aclose()
            process.stdin.write(b"counts\ncalls\nstop\n")
            counts = json.loads(await process.stdout.readline())
            assert counts["b"]["answered"] == 1 and counts["a"]["calls"] == 0
            calls = json.loads(await process.stdout.readline())
            assert [(c["deployment"], c["request"], c["outcome"]) for c in calls] == [
                ("b", 3, "answered")
            ]
            assert json.loads(await process.stdout.readline()) == counts
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_cli_refuses_a_bad_scenario(tmp_path: Path) -> None:
    scenario = tmp_path / "fleet.toml"
    scenario.write_text("[deployments.a]\nchunks = -1\n")
    process = await fleet_process(
        scenario, stdin=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(60):
        _, err = await process.communicate()
    assert process.returncode == 2
    assert b"deployments.a.chunks must be at least 1" in err
