"""`FakeFleet`: several fake OpenAI-compatible deployments of one model, on loopback, whose
latency is drawn from distributions and whose faults follow a schedule.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import re
import sys
import threading
import time
import tomllib
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any, ClassVar, Literal, Self, TextIO

import pydantic
from pydantic import Field, StringConstraints, field_validator, model_validator

from pipeline._counting import CountWaiters
from pipeline._settings import (
    Settings,
    collecting_problems,
    problems_of,
    settings_error,
    suggest,
)
from pipeline.testing._fake_server import (
    FakeOpenAIServer,
    FakeResponse,
    RecordedRequest,
    _Stream,
)

__all__ = [
    "FakeDeployment",
    "FakeFleet",
    "Fault",
    "FleetCall",
    "FleetCounts",
    "Latency",
    "serve_fleet",
]

REQUEST_HEADER = "x-fleet-request"
_TAG = re.compile(r"\[fleet request (\d+)\]")

Outcome = Literal["answered", "rate_limited", "hung", "cut", "down"]
FaultKind = Literal["rate_limited", "brownout", "hang", "cut", "down"]

_Seconds = Annotated[float, Field(ge=0)]
_Fraction = Annotated[float, Field(ge=0, le=1)]


class Latency(Settings):
    """A distribution of seconds: lognormal around `median` with shape `sigma` (0: always
    the median); a `slow_fraction` of draws is multiplied by `slow_factor` (a heavy tail);
    `maximum` caps a draw.

    Each draw takes the same amount of randomness whatever the parameters, so changing one
    deployment's distribution does not shift the draws that follow it.
    """

    median: _Seconds = 0.0
    """The median of the lognormal draws, in seconds."""
    sigma: _Seconds = 0.0
    """The lognormal's shape (0: always the median; 0.5 puts the 99th percentile at 3.2x the
    median)."""
    slow_fraction: _Fraction = 0.0
    """The fraction of draws multiplied by `slow_factor` (a heavy tail)."""
    slow_factor: Annotated[float, Field(ge=1)] = 1.0
    """What a slow draw is multiplied by."""
    maximum: Annotated[float, Field(gt=0)] | None = None
    """The largest draw, in seconds (unset: no cap)."""

    @classmethod
    def fixed(cls, seconds: float) -> Latency:
        """Always `seconds`."""
        return cls(median=seconds)

    @classmethod
    def lognormal(
        cls,
        median: float,
        sigma: float,
        *,
        slow_fraction: float = 0.0,
        slow_factor: float = 1.0,
        maximum: float | None = None,
    ) -> Latency:
        """Lognormal around `median`; ``sigma=0.5`` puts the 99th percentile at 3.2x it."""
        return cls(
            median=median,
            sigma=sigma,
            slow_fraction=slow_fraction,
            slow_factor=slow_factor,
            maximum=maximum,
        )

    def draw(self, rng: random.Random) -> float:
        """One draw from `rng` (two of its numbers)."""
        z = rng.gauss(0.0, 1.0)
        slow = rng.random() < self.slow_fraction
        value = self.median * math.exp(self.sigma * z) * (self.slow_factor if slow else 1.0)
        return value if self.maximum is None else min(value, self.maximum)


# Which settings each kind of fault reads (besides kind, start and end).
_FAULT_SETTINGS: dict[str, frozenset[str]] = {
    "rate_limited": frozenset({"fraction", "retry_after", "status"}),
    "brownout": frozenset({"factor"}),
    "hang": frozenset(),
    "cut": frozenset({"fraction", "after"}),
    "down": frozenset({"status"}),
}


class Fault(Settings):
    """Something a deployment does to the calls that arrive between `start` and `end`
    (seconds after `FakeFleet.start`; ``end=None``: until the fleet stops).

    * ``rate_limited``: a `fraction` of calls answer `status` (429 unless told, or 503) with
      ``Retry-After: retry_after`` (``None``: no header), at once;
    * ``brownout``: time to first token and every chunk delay multiplied by `factor`;
    * ``hang``: calls get no answer until the hang ends (then they are answered as usual)
      or the client goes away;
    * ``cut``: a `fraction` of calls end mid-way: a stream is cut after `after` of its
      content chunks (``after=0``: before any content), a whole response after half of its
      body, by dropping the connection;
    * ``down``: every call is refused by dropping the connection, or answered `status`.

    When several apply, down comes first, then hang, then rate limit, then cut; a brownout
    slows whatever is answered. Build them with the class methods (``Fault.hang(start=15,
    end=30)``) or, in a scenario file, as tables (``{kind = "hang", start = 15, end = 30}``).
    """

    kind: FaultKind
    """What the fault does: `rate_limited`, `brownout`, `hang`, `cut` or `down`."""
    start: _Seconds = 0.0
    """Seconds after the fleet started when the fault begins (it applies to calls that arrive from
    then on)."""
    end: Annotated[float, Field(gt=0)] | None = None
    """Seconds after the fleet started when the fault ends (unset: until the fleet stops)."""
    fraction: _Fraction = 1.0
    """The share of calls a `rate_limited` or `cut` fault hits."""
    retry_after: _Seconds | None = 1.0
    """The `Retry-After` seconds of a `rate_limited` answer (unset: no header)."""
    status: Annotated[int, Field(ge=400, le=599)] | None = None
    """The status a `rate_limited` fault answers (429 unless told, or 503), or a `down` one (unset:
    the connection is dropped)."""
    factor: Annotated[float, Field(gt=0)] = 1.0
    """What a `brownout` multiplies the time to first token and every chunk delay by."""
    after: Annotated[float, Field(ge=0, lt=1)] = 0.5
    """Where a `cut` stream ends: after this fraction of its content chunks (0: before any content).
    """

    _common: ClassVar[frozenset[str]] = frozenset({"kind", "start", "end"})

    @model_validator(mode="before")
    @classmethod
    def _settings_of_its_kind(cls, data: Any) -> Any:
        # A setting another kind of fault reads is a mistake, not something to ignore.
        if isinstance(data, Mapping) and data.get("kind") in _FAULT_SETTINGS:
            kind = data["kind"]
            foreign = sorted(
                str(key)
                for key in data
                if key in cls.model_fields
                and key not in cls._common
                and key not in _FAULT_SETTINGS[kind]
            )
            if foreign:
                raise ValueError(f"{', '.join(foreign)}: not a setting of a {kind} fault")
            if kind == "rate_limited" and data.get("status") is None:
                data = {**data, "status": 429}
        return data

    @model_validator(mode="after")
    def _ends_after_it_starts(self) -> Self:
        if self.end is not None and self.end <= self.start:
            raise ValueError(f"end must be after start ({self.start:g}), got {self.end:g}")
        return self

    @classmethod
    def rate_limited(
        cls,
        fraction: float,
        *,
        retry_after: float | None = 1.0,
        status: int = 429,
        start: float = 0.0,
        end: float | None = None,
    ) -> Fault:
        return cls(
            kind="rate_limited",
            fraction=fraction,
            retry_after=retry_after,
            status=status,
            start=start,
            end=end,
        )

    @classmethod
    def brownout(cls, factor: float, *, start: float = 0.0, end: float | None = None) -> Fault:
        return cls(kind="brownout", factor=factor, start=start, end=end)

    @classmethod
    def hang(cls, *, start: float = 0.0, end: float | None = None) -> Fault:
        return cls(kind="hang", start=start, end=end)

    @classmethod
    def cut(
        cls,
        fraction: float,
        *,
        after: float = 0.5,
        start: float = 0.0,
        end: float | None = None,
    ) -> Fault:
        return cls(kind="cut", fraction=fraction, after=after, start=start, end=end)

    @classmethod
    def down(
        cls, *, start: float = 0.0, end: float | None = None, status: int | None = None
    ) -> Fault:
        return cls(kind="down", start=start, end=end, status=status)

    def active(self, at: float) -> bool:
        """Whether a call arriving `at` seconds into the schedule meets this fault."""
        return self.start <= at and (self.end is None or at < self.end)


_DeploymentName = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
]


class FakeDeployment(Settings):
    """One deployment of the fleet: its latency (time to first token, then a delay before
    each further chunk), the length of its answers in chunks, its faults, and a port
    (0: a free one)."""

    name: _DeploymentName
    """The deployment's name (letters, digits, `_.-`): `fleet.base_urls` and the counts are keyed by
    it."""
    time_to_first_token: Latency = Latency()
    """The delay before an answer's first content chunk (a whole response waits for it and
    every chunk delay)."""
    chunk_delay: Latency = Latency()
    """The delay before each further chunk."""
    chunks: Annotated[int, Field(ge=1, le=10_000)] = 20
    """Content chunks per answer."""
    faults: tuple[Fault, ...] = ()
    """The deployment's faults, each on its schedule."""
    port: Annotated[int, Field(ge=0, le=65_535)] = 0
    """The port to listen on, on 127.0.0.1 (0: a free one)."""

    @field_validator("faults", mode="before")
    @classmethod
    def _faults_from_a_list(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value

    @property
    def answer(self) -> str:
        """The text every answer of this deployment carries (``w00 w01 ...``), one word a
        chunk."""
        return " ".join(f"w{index:02d}" for index in range(self.chunks))


@dataclass(frozen=True, slots=True)
class FleetCall:
    """One call a deployment received and what it does with it (`outcome`).

    `request` is the number the request was tagged with (None: untagged), `call` the
    how-many-th call of that request on this deployment, `at` the seconds into the schedule
    when it arrived (None: before `FakeFleet.start`). The times are what the deployment
    waits, brownout included: `time_to_first_token` before its first content, then one of
    `chunk_delays` before each further chunk (a whole response waits for all of them).
    `cut_after`: content chunks sent before a cut; `release_at`: when a hang lets the call
    go (schedule seconds; None: only when the client leaves)."""

    deployment: str
    request: int | None
    call: int
    at: float | None
    outcome: Outcome
    time_to_first_token: float
    chunk_delays: tuple[float, ...]
    slowdown: float = 1.0
    status: int | None = None
    retry_after: float | None = None
    cut_after: int | None = None
    release_at: float | None = None

    def summary(self) -> dict[str, Any]:
        """The call as a JSON-ready mapping, without the per-chunk delays."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "chunk_delays"}
        out["duration"] = self.time_to_first_token + sum(self.chunk_delays)
        return out


@dataclass(frozen=True, slots=True)
class FleetCounts:
    """What one deployment did since `FakeFleet.start`: `calls` in all, by outcome
    (`answered` in full, `rate_limited`, `hung`, `cut`, `down`), and `slowed` by a
    brownout."""

    calls: int = 0
    answered: int = 0
    rate_limited: int = 0
    hung: int = 0
    cut: int = 0
    down: int = 0
    slowed: int = 0


@dataclass(slots=True)
class _Tally:
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, call: FleetCall) -> None:
        for key in ("calls", call.outcome) + (("slowed",) if call.slowdown != 1.0 else ()):
            self.counts[key] = self.counts.get(key, 0) + 1

    def frozen(self) -> FleetCounts:
        return FleetCounts(**self.counts)


@dataclass(frozen=True, slots=True)
class _PlannedResponse(FakeResponse):
    """The base server's response, carrying the fleet's plan for the call."""

    plan: FleetCall | None = None


class _DeploymentServer(FakeOpenAIServer):
    """One deployment: a `FakeOpenAIServer` whose chat completions follow the fleet's plan."""

    def __init__(self, fleet: FakeFleet, deployment: FakeDeployment) -> None:
        super().__init__(port=deployment.port)
        self.fleet = fleet
        self.deployment = deployment
        self._pieces = FakeResponse(text=deployment.answer).pieces()

    def response_for(self, request: RecordedRequest) -> FakeResponse:
        if (
            request.method != "POST"
            or not request.path.endswith("/chat/completions")
            or not isinstance(request.json, dict)
        ):
            return super().response_for(request)
        plan = self.fleet._arrive(self.deployment.name, request)
        return _PlannedResponse(text=self.deployment.answer, chunks=self._pieces, plan=plan)

    async def _handle(
        self,
        writer: asyncio.StreamWriter,
        method: str,
        path: str,
        payload: Any,
        response: FakeResponse,
    ) -> bool:
        plan = response.plan if isinstance(response, _PlannedResponse) else None
        if plan is None:
            return await super()._handle(writer, method, path, payload, response)
        if plan.outcome == "down" and plan.status is None:
            writer.transport.abort()
            return False
        if plan.status is not None:
            headers = {}
            if plan.retry_after is not None:
                headers["Retry-After"] = f"{plan.retry_after:g}"
            code = "rate_limit_exceeded" if plan.status == 429 else None
            body = self._error_body(plan.status, "the fleet says no", None, code)
            await self._send_json(writer, plan.status, body, headers)
            return True
        if plan.outcome == "hung" and not await self._hold(writer, plan):
            return False
        await self.fleet._wait(plan.time_to_first_token)
        if payload.get("stream"):
            return await self._stream(writer, payload, response, plan)
        await self.fleet._wait(sum(plan.chunk_delays))
        completion = self._completion(payload, response)
        if plan.cut_after is not None:
            data = json.dumps(completion).encode()
            head = (
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n"
            )
            writer.write(head.encode("latin-1") + data[: len(data) // 2])
            await writer.drain()
            writer.transport.abort()
            return False
        await self._send_json(writer, 200, completion)
        return True

    async def _hold(self, writer: asyncio.StreamWriter, plan: FleetCall) -> bool:
        """Hold a hung call until its hang ends (True) or the client leaves (False)."""
        left = asyncio.ensure_future(self._readers[writer].read())
        waits: set[asyncio.Future[Any]] = {left}
        if plan.release_at is not None:
            waits.add(asyncio.ensure_future(self.fleet._wait_until(plan.release_at)))
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        if left in done:
            self.disconnects += 1
            self._disconnect_waiters.notify(self.disconnects)
            return False
        return True

    async def _stream(
        self,
        writer: asyncio.StreamWriter,
        payload: Mapping[str, Any],
        response: FakeResponse,
        plan: FleetCall,
    ) -> bool:
        # Event 0 is the role chunk, events 1..N the content, then the finish (and usage).
        events = self._chunk_payloads(payload, response)
        content = len(self._pieces)
        stream = _Stream(writer)
        await stream.open()
        for index, event in enumerate(events):
            if plan.cut_after is not None and index > plan.cut_after:
                writer.transport.abort()
                return False
            if 2 <= index <= content:
                await self.fleet._wait(plan.chunk_delays[index - 2])
            await stream.send(f"data: {event}\n\n")
        await stream.send("data: [DONE]\n\n")
        await stream.close()
        return True


class FakeFleet:
    """Fake OpenAI-compatible deployments on ``127.0.0.1`` with scripted latency and faults.

    ::

        fleet = FakeFleet(
            [
                FakeDeployment(
                    name="a",
                    time_to_first_token=Latency.lognormal(0.25, 0.35),
                    chunk_delay=Latency.lognormal(0.02, 0.25),
                    faults=(Fault.rate_limited(0.3, retry_after=1, start=10, end=50),),
                ),
                FakeDeployment(name="b", time_to_first_token=Latency.lognormal(0.25, 0.35)),
            ],
            seed=7,
        )
        async with fleet:  # binds every deployment and starts the schedule
            urls = fleet.base_urls  # {"a": "http://127.0.0.1:PORT/v1", ...}
            ...
            print(fleet.counts()["a"].rate_limited)

    `start(at)` (re)starts the schedule and clears the counts and the call log; before the
    first start (after `open()` alone) no fault applies. Every answer is the deployment's
    `FakeDeployment.answer`, streamed a word a chunk. `clock` (seconds, monotonic) places
    calls in the schedule; `sleep` is what the deployments wait with (latency, hangs), so a
    test can drive both.
    """

    def __init__(
        self,
        deployments: Sequence[FakeDeployment],
        *,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        deployments = tuple(deployments)
        if not deployments:
            raise ValueError("a fleet needs at least one deployment")
        for deployment in deployments:
            if not isinstance(deployment, FakeDeployment):
                raise TypeError(
                    f"deployments must be FakeDeployment, not {type(deployment).__name__}"
                )
        names = [d.name for d in deployments]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"deployment names must be unique: {', '.join(duplicates)}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, not {type(seed).__name__}")
        self.deployments = deployments
        self.seed = seed
        self._clock = clock
        self._sleep = sleep
        self._by_name = {d.name: d for d in deployments}
        self._servers = {d.name: _DeploymentServer(self, d) for d in deployments}
        self._zero: float | None = None
        self._calls: list[FleetCall] = []
        self._tallies: dict[str, _Tally] = {}
        self._calls_per_request: dict[tuple[str, int], int] = {}
        self._untagged: dict[str, int] = {}
        self._waiters: dict[tuple[str | None, str | None], tuple[CountWaiters, list[int]]] = {}

    # -- building from a scenario -------------------------------------------------------

    @classmethod
    def from_scenario(
        cls,
        scenario: Mapping[str, Any] | str | os.PathLike[str],
        *,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> FakeFleet:
        """A fleet from a scenario: a mapping, or a TOML or JSON file of the same shape::

            seed = 7
            [deployments.a]
            time_to_first_token = { median = 0.25, sigma = 0.35 }
            chunk_delay = { median = 0.02, sigma = 0.25 }
            chunks = 20
            faults = [{ kind = "rate_limited", fraction = 0.3, retry_after = 1, start = 10 }]
            [deployments.b]
            time_to_first_token = { median = 0.25, sigma = 0.35 }

        Deployments keep the file's order. `seed` overrides the scenario's. A problem raises
        `ValueError` (or `TypeError` when every problem is a wrong type) naming each key
        path (``deployments.a.faults[0].fraction must be at most 1, got 1.5``)."""
        data = _read_scenario(scenario) if not isinstance(scenario, Mapping) else scenario
        problems: list[tuple[str, str, bool]] = []
        unknown = sorted(str(k) for k in data if k not in ("seed", "deployments"))
        known = ("seed", "deployments")
        problems += [(key, f"unknown setting{suggest(key, known)}", False) for key in unknown]
        scenario_seed = data.get("seed", 0)
        if isinstance(scenario_seed, bool) or not isinstance(scenario_seed, int):
            problems.append(
                ("seed", f"expected an integer, got {type(scenario_seed).__name__}", True)
            )
        tables = data.get("deployments")
        deployments: list[FakeDeployment] = []
        if not isinstance(tables, Mapping) or not tables:
            problems.append(("deployments", "expected a table of one or more deployments", False))
            tables = {}
        for name, table in tables.items():
            prefix = ("deployments", str(name))
            if not isinstance(table, Mapping):
                problems.append((".".join(prefix), "expected a table", True))
                continue
            if "name" in table:
                problems.append((".".join(prefix) + ".name", "the table's key names it", False))
                continue
            try:
                with collecting_problems():
                    deployments.append(FakeDeployment(name=str(name), **table))
            except pydantic.ValidationError as exc:
                problems += problems_of(exc, FakeDeployment, prefix)
        if problems:
            raise settings_error(problems)
        return cls(
            deployments,
            seed=scenario_seed if seed is None else seed,
            clock=clock,
            sleep=sleep,
        )

    # -- lifecycle ------------------------------------------------------------------------

    async def open(self) -> None:
        """Bind every deployment (the schedule is not started: no fault applies yet)."""
        try:
            for server in self._servers.values():
                await server.start()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        for server in self._servers.values():
            await server.stop()

    async def __aenter__(self) -> Self:
        await self.open()
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def start(self, at: float | None = None) -> None:
        """Start the schedule at `at` on the fleet's clock (default: now), and forget every
        count and call so far (the draws start again too: request 7's first call on ``a``
        meets the same fate as before)."""
        self._zero = self._clock() if at is None else at
        self._calls.clear()
        self._tallies.clear()
        self._calls_per_request.clear()
        self._untagged.clear()
        for server in self._servers.values():
            server.requests.clear()
        for waiters, current in self._waiters.values():
            current[0] = 0
            waiters.notify(0)

    def elapsed(self) -> float | None:
        """Seconds into the schedule (None before the first `start`)."""
        return None if self._zero is None else self._clock() - self._zero

    # -- what users read ------------------------------------------------------------------

    def __getitem__(self, name: str) -> FakeOpenAIServer:
        """The server of deployment `name` (its `base_url`, `port`, `requests`)."""
        try:
            return self._servers[name]
        except KeyError:
            raise KeyError(f"no deployment named {name!r}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._servers)

    @property
    def base_urls(self) -> dict[str, str]:
        """Each deployment's ``/v1`` URL, by name, in the fleet's order."""
        return {name: server.base_url for name, server in self._servers.items()}

    @property
    def calls(self) -> list[FleetCall]:
        """Every call since `start`, in arrival order (a copy)."""
        return list(self._calls)

    def counts(self) -> dict[str, FleetCounts]:
        """Each deployment's counts since `start`, by name."""
        return {
            name: self._tallies[name].frozen() if name in self._tallies else FleetCounts()
            for name in self._servers
        }

    async def wait_for_calls(
        self, count: int = 1, *, deployment: str | None = None, outcome: Outcome | None = None
    ) -> None:
        """Return once at least `count` calls (to `deployment`, with `outcome`, when given)
        arrived since `start`. Unbounded: wrap it in ``asyncio.timeout``."""
        if deployment is not None and deployment not in self._servers:
            raise KeyError(f"no deployment named {deployment!r}")
        waiters, current = self._waiter(deployment, outcome)
        await waiters.wait(current[0], count)

    def healthy(self, at: float) -> list[str]:
        """The deployments no fault touches at `at` (seconds into the schedule): what an
        oracle that knows the schedule would pick from."""
        return [d.name for d in self.deployments if not any(f.active(at) for f in d.faults)]

    @staticmethod
    def tag(request: int) -> str:
        """The marker that numbers a request: put it in a message of the request (for
        example, ``f"{FakeFleet.tag(17)} Hello"``), so its draws are request 17's whatever
        route it takes. An ``X-Fleet-Request: 17`` header works too."""
        if isinstance(request, bool) or not isinstance(request, int) or request < 0:
            raise ValueError(f"a request number is an int of at least 0, got {request!r}")
        return f"[fleet request {request}]"

    def plan(self, deployment: str, request: int, call: int = 1, *, at: float | None) -> FleetCall:
        """What `deployment` does with the `call`-th call of request number `request`
        arriving `at` seconds into the schedule (None: before it starts, so no fault).
        Deterministic: the same arguments always give the same plan; this is what the
        deployment does when such a call arrives."""
        return self._plan(deployment, f"{request}:{call}", request, call, at)

    # -- the deployments' side ------------------------------------------------------------

    def _plan(
        self, deployment: str, key: str, request: int | None, call: int, at: float | None
    ) -> FleetCall:
        spec = self._by_name.get(deployment)
        if spec is None:
            raise KeyError(f"no deployment named {deployment!r}")
        rng = random.Random(f"{self.seed}:{deployment}:{key}")
        # Always the same draws in the same order, whatever faults apply.
        limit_draw, cut_draw = rng.random(), rng.random()
        first = spec.time_to_first_token.draw(rng)
        delays = [spec.chunk_delay.draw(rng) for _ in range(spec.chunks - 1)]
        active = [f for f in spec.faults if f.active(at)] if at is not None else []
        slowdown = math.prod((f.factor for f in active if f.kind == "brownout"), start=1.0)
        down = next((f for f in active if f.kind == "down"), None)
        hang_ends = [f.end for f in active if f.kind == "hang"]
        limited = next(
            (f for f in active if f.kind == "rate_limited" and limit_draw < f.fraction), None
        )
        cut = next((f for f in active if f.kind == "cut" and cut_draw < f.fraction), None)
        outcome: Outcome = "answered"
        status = retry_after = cut_after = release_at = None
        if down is not None:
            outcome, status = "down", down.status
        elif hang_ends:
            outcome = "hung"
            if None not in hang_ends:
                release_at = max(end for end in hang_ends if end is not None)
        elif limited is not None:
            outcome, status = "rate_limited", limited.status
            retry_after = limited.retry_after
        elif cut is not None:
            outcome, cut_after = "cut", int(cut.after * spec.chunks)
        return FleetCall(
            deployment=deployment,
            request=request,
            call=call,
            at=at,
            outcome=outcome,
            time_to_first_token=first * slowdown,
            chunk_delays=tuple(delay * slowdown for delay in delays),
            slowdown=slowdown,
            status=status,
            retry_after=retry_after,
            cut_after=cut_after,
            release_at=release_at,
        )

    def _arrive(self, deployment: str, request: RecordedRequest) -> FleetCall:
        number = _request_number(request)
        if number is None:
            sequence = self._untagged.get(deployment, 0) + 1
            self._untagged[deployment] = sequence
            key, call = f"untagged:{sequence}", 1
        else:
            call = self._calls_per_request.get((deployment, number), 0) + 1
            self._calls_per_request[(deployment, number)] = call
            key = f"{number}:{call}"
        plan = self._plan(deployment, key, number, call, self.elapsed())
        self._calls.append(plan)
        self._tallies.setdefault(deployment, _Tally()).add(plan)
        for waiter_key in (
            (None, None),
            (deployment, None),
            (None, plan.outcome),
            (deployment, plan.outcome),
        ):
            found = self._waiters.get(waiter_key)
            if found is not None:
                found[1][0] += 1
                found[0].notify(found[1][0])
        return plan

    def _waiter(
        self, deployment: str | None, outcome: str | None
    ) -> tuple[CountWaiters, list[int]]:
        key = (deployment, outcome)
        if key not in self._waiters:
            current = sum(
                1
                for c in self._calls
                if deployment in (None, c.deployment) and outcome in (None, c.outcome)
            )
            self._waiters[key] = (CountWaiters(), [current])
        return self._waiters[key]

    async def _wait(self, seconds: float) -> None:
        if seconds > 0:
            await self._sleep(seconds)

    async def _wait_until(self, at: float) -> None:
        """Wait until `at` seconds into the schedule (bounded: the clock only moves on)."""
        elapsed = self.elapsed()
        if elapsed is not None and at > elapsed:
            await self._sleep(at - elapsed)


def _request_number(request: RecordedRequest) -> int | None:
    header = request.headers.get(REQUEST_HEADER)
    if header is not None and header.isdigit():
        return int(header)
    messages = request.json.get("messages") if isinstance(request.json, dict) else None
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        texts = [content] if isinstance(content, str) else []
        if isinstance(content, list):
            texts = [p["text"] for p in content if isinstance(p, dict) and "text" in p]
        for text in texts:
            found = _TAG.search(text) if isinstance(text, str) else None
            if found:
                return int(found.group(1))
    return None


def _read_scenario(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    file = Path(path)
    if file.suffix not in (".toml", ".json"):
        raise ValueError(f"a scenario is a .toml or .json file, not {file.name!r}")
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the scenario {file}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text) if file.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the scenario {file.name} does not parse: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"the scenario {file.name} is not a table")
    return data


# -- a fleet in a process of its own (``chat-pipeline fake-fleet``) ---------------------------


def _stdin_lines(queue: asyncio.Queue[str | None]) -> None:
    """Start a daemon thread putting stdin's lines on `queue` (None at its end)."""
    loop = asyncio.get_running_loop()

    def read() -> None:
        with contextlib.suppress(RuntimeError):  # the loop may be gone at exit
            for line in sys.stdin:
                loop.call_soon_threadsafe(queue.put_nowait, line)
            loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=read, name="fleet-commands", daemon=True).start()


async def serve_fleet(
    scenario: str | os.PathLike[str],
    *,
    seed: int | None = None,
    manual_start: bool = False,
    stop: asyncio.Event | None = None,
    output: TextIO | None = None,
) -> int:
    """Serve the fleet of a scenario file until `stop` is set or ``stop`` is read on stdin.

    Prints ``deployment NAME URL`` for each deployment (each bound to a free port unless
    the scenario gives one), then ``started`` (or ``ready``, with `manual_start`: no fault
    applies until a ``start`` command). Commands, one a line on stdin, each answered with
    one line: ``start [T]`` (re)starts the schedule now, or at ``T`` on this machine's
    monotonic clock (``time.monotonic()`` of another process), and clears the counts
    (``started``); ``counts`` and ``calls`` print JSON; ``stop`` ends. At the end the
    counts are printed as JSON."""
    out = output or sys.stdout

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    fleet = FakeFleet.from_scenario(scenario, seed=seed)
    stop = stop or asyncio.Event()
    commands: asyncio.Queue[str | None] = asyncio.Queue()
    await fleet.open()
    try:
        for name, url in fleet.base_urls.items():
            say(f"deployment {name} {url}")
        if manual_start:
            say("ready")
        else:
            fleet.start()
            say("started")
        _stdin_lines(commands)
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                reading = asyncio.ensure_future(commands.get())
                done, _ = await asyncio.wait(
                    {reading, stopping}, return_when=asyncio.FIRST_COMPLETED
                )
                if reading not in done:
                    reading.cancel()
                    break
                line = reading.result()
                if line is None:  # stdin ended: serve on until stopped
                    await stopping
                    break
                words = line.split()
                if not words:
                    continue
                if words[0] == "start" and len(words) <= 2:
                    try:
                        at = float(words[1]) if len(words) == 2 else None
                    except ValueError:
                        say(f"error: not a time: {words[1]!r}")
                        continue
                    fleet.start(at)
                    say("started")
                elif words == ["counts"]:
                    say(json.dumps({n: _counts(c) for n, c in fleet.counts().items()}))
                elif words == ["calls"]:
                    say(json.dumps([call.summary() for call in fleet.calls]))
                elif words == ["stop"]:
                    break
                else:
                    say(f"error: unknown command {words[0]!r} (start [T], counts, calls, stop)")
        finally:
            stopping.cancel()
        say(json.dumps({n: _counts(c) for n, c in fleet.counts().items()}))
    finally:
        await fleet.close()
    return 0


def _counts(counts: FleetCounts) -> dict[str, int]:
    return {f.name: getattr(counts, f.name) for f in fields(counts)}
