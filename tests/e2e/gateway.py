"""A real ``chat-pipeline serve`` in front of fake upstreams, for the end-to-end suites.

The upstreams (`FakeOpenAIServer`) and the clients (the official `openai` SDK) run on an
event loop of their own in a thread, so the test's thread can block on the backends
(Prometheus scraping, Phoenix ingesting) meanwhile. `GatewayRun.phase()` sends a scripted
set of requests that makes every metric and the failover story move:

* ``primary`` fails (503) behind a circuit breaker that opens on that first failure (a
  state change); later requests find it open (``CircuitOpenError``), so every request
  falls back to ``backup``;
* ``backup`` answers `ANSWERED` requests (half streamed: time to first chunk) with token
  usage and a price (cost), cuts one stream after its first chunk (a committed failure,
  terminal), and fails one request before output: the last route, it can fall back
  nowhere (a terminal failure that is no fallback);
* a spend ledger (``[spend]``, a SQLite file) records every attempt: the backup's priced,
  the primary's (a model no price book knows) unpriced.

`running_fleet_gateway` serves a balanced router (``kind = "balanced"``) over a `FakeFleet`
of three deployments instead: ``east`` answers after `FLEET_FAST`, ``west`` answers every
call 429 with ``Retry-After`` and ``central`` after `FLEET_SLOW`, so the route health
gauges and the cooldown counter of the gateway's ``/metrics`` move.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Awaitable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import openai

from pipeline.testing import (
    FakeDeployment,
    FakeFleet,
    FakeOpenAIServer,
    FakeResponse,
    Fault,
    Latency,
)
from tests.processes import UVICORN_PORT, ChildProcess, serve_argv

T = TypeVar("T")

ANSWERED = 4  # requests per phase the backup answers
REQUESTS_PER_PHASE = ANSWERED + 2  # + a stream cut after output + a terminal failure
ATTEMPTS_PER_PHASE = REQUESTS_PER_PHASE * 2  # each tries primary, then backup
MESSAGES: list[Any] = [{"role": "user", "content": "question"}]


class _Loop:
    """An event loop in a thread: coroutines run on it from the test's thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Awaitable[T], timeout: float = 120) -> T:
        async def wrapped() -> T:
            return await coroutine

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@dataclass
class GatewayRun:
    url: str
    server: ChildProcess
    primary: FakeOpenAIServer
    backup: FakeOpenAIServer
    _loop: _Loop

    def phase(self) -> list[str]:
        """One phase of the scripted requests (see the module docstring); the request ids
        of the answered ones."""
        return self._loop.run(self._phase())

    async def _phase(self) -> list[str]:
        self.primary.script(FakeResponse.error(503))  # the first phase's opens the breaker
        self.backup.script(
            *[FakeResponse(text="an answer", chunks=["an ", "answer"])] * ANSWERED,
            FakeResponse(chunks=["partial ", "answer"], disconnect_after=2),
            FakeResponse.error(503),
        )
        ids: list[str] = []
        async with openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0
        ) as client:
            for index in range(ANSWERED):
                raw = await client.chat.completions.with_raw_response.create(
                    model="pipeline", messages=MESSAGES, stream=index % 2 == 0
                )
                parsed = raw.parse()
                if index % 2 == 0:
                    text = "".join([c.choices[0].delta.content or "" async for c in parsed])  # type: ignore[union-attr]
                else:
                    text = parsed.choices[0].message.content or ""  # type: ignore[union-attr]
                assert text == "an answer", text
                ids.append(raw.headers["x-request-id"])
            stream = await client.chat.completions.create(
                model="pipeline", messages=MESSAGES, stream=True
            )
            received = ""
            try:
                async for chunk in stream:
                    received += chunk.choices[0].delta.content or "" if chunk.choices else ""
            except openai.APIError:
                pass  # the cut after output, told in-band
            else:
                raise AssertionError("the cut stream ended without an error")
            assert received == "partial ", received
            try:
                await client.chat.completions.create(model="pipeline", messages=MESSAGES)
            except openai.InternalServerError:
                pass  # every route failed before output
            else:
                raise AssertionError("the terminal failure answered")
        return ids

    def tool_calls(self, arguments: str, result: str) -> list[str]:
        """Two tool-call rounds (the first streamed, the second not): the backup answers a
        request offering a tool with a call of it carrying `arguments`, then the follow-up
        carrying `result` with text. The request ids, in order (call, answer, call,
        answer)."""
        return self._loop.run(self._tool_calls(arguments, result))

    async def _tool_calls(self, arguments: str, result: str) -> list[str]:
        call = FakeResponse(tool_calls=[(TOOL["function"]["name"], arguments)])
        self.primary.script(*[FakeResponse.error(503)] * 4)  # if its breaker let it through
        self.backup.script(call, FakeResponse(text="the order shipped"), call)
        self.backup.script(FakeResponse(text="the order shipped"))
        ids: list[str] = []
        async with openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0
        ) as client:
            for stream in (True, False):
                raw = await client.chat.completions.with_raw_response.create(
                    model="pipeline", messages=MESSAGES, tools=[TOOL], stream=stream
                )
                ids.append(raw.headers["x-request-id"])
                parsed = raw.parse()
                if stream:
                    chunks = [c async for c in parsed]  # type: ignore[union-attr]
                    (call_id,) = {
                        d.id for c in chunks for d in c.choices[0].delta.tool_calls or [] if d.id
                    }
                else:
                    (tool_call,) = parsed.choices[0].message.tool_calls or []  # type: ignore[union-attr]
                    call_id = tool_call.id
                follow_up: list[Any] = [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": call_id,
                                "type": "function",
                                "function": {
                                    "name": TOOL["function"]["name"],
                                    "arguments": arguments,
                                },
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": call_id, "content": result},
                ]
                raw = await client.chat.completions.with_raw_response.create(
                    model="pipeline", messages=follow_up, tools=[TOOL], stream=not stream
                )
                ids.append(raw.headers["x-request-id"])
                parsed = raw.parse()
                if stream:
                    answer = parsed.choices[0].message.content  # type: ignore[union-attr]
                else:
                    answer = "".join(
                        [c.choices[0].delta.content or "" async for c in parsed if c.choices]  # type: ignore[union-attr]
                    )
                assert answer == "the order shipped", answer
        return ids


TOOL: Any = {
    "type": "function",
    "function": {
        "name": "lookup_order",
        "description": "Look an order up by its number.",
        "parameters": {"type": "object", "properties": {"order": {"type": "string"}}},
    },
}


def _config(path: Path, primary: FakeOpenAIServer, backup: FakeOpenAIServer) -> Path:
    path.write_text(
        f"""
[routes.primary]
provider = "openai"
model = "model-primary"
base_url = "{primary.base_url}"
breaker = {{ fail_max = 1, reset_timeout = 3600 }}

[routes.backup]
provider = "openai"
model = "model-backup"
base_url = "{backup.base_url}"
price = {{ input_per_million = 0.5, output_per_million = 1.5 }}

[router]
kind = "ordered"
order = ["primary", "backup"]

[layers]
telemetry = true

[spend]
path = "{path.parent / "spend.db"}"
flush_interval = 0.1
"""
    )
    return path


@contextlib.contextmanager
def _serving(
    config: Path, args: tuple[str, ...], env: Mapping[str, str] | None, timeout: float
) -> Iterator[tuple[str, ChildProcess]]:
    """``chat-pipeline serve`` of `config` on port 0 until the block ends: its URL and
    process; ready once its startup is logged (it listens by then)."""
    env = {**os.environ, **(env or {})}
    # A group of its own: stopping it stops its workers too.
    with ChildProcess(
        "chat-pipeline serve", serve_argv(config, *args), env=env, own_group=True
    ) as server:
        port = server.wait_for_port(UVICORN_PORT, timeout)  # logged once bound
        server.wait_for_line("Application startup complete", timeout)
        yield f"http://127.0.0.1:{port}", server


@contextlib.contextmanager
def running_gateway(
    workdir: Path, *args: str, env: Mapping[str, str] | None = None, timeout: float = 90
) -> Iterator[GatewayRun]:
    """``chat-pipeline serve`` (with `args`) in front of two fake upstreams (the module
    docstring), until the block ends."""
    loop = _Loop()
    primary, backup = FakeOpenAIServer(), FakeOpenAIServer()
    try:
        loop.run(primary.start())
        loop.run(backup.start())
        config = _config(workdir / "gateway.toml", primary, backup)
        with _serving(config, args, env, timeout) as (url, server):
            yield GatewayRun(url, server, primary, backup, loop)
    finally:
        try:
            loop.run(primary.stop())
        finally:
            try:
                loop.run(backup.stop())
            finally:
                loop.close()


# -- a balanced fleet --------------------------------------------------------------------------

FLEET_FAST = 0.05  # east's time to first token, in seconds
FLEET_SLOW = 0.5  # central's
FLEET_RETRY_AFTER = 0.5  # west's every answer: 429 with Retry-After this many seconds
# A phase goes on until west was tried in it; west fails, so after its cooldown it gets only
# a probe now and then (every 2 to 5 s): each request takes at least FLEET_FAST, so this
# bounds a phase at about 20 s.
MAX_FLEET_REQUESTS = 400


def _fleet() -> FakeFleet:
    return FakeFleet(
        [
            FakeDeployment(name="east", time_to_first_token=Latency.fixed(FLEET_FAST), chunks=2),
            FakeDeployment(
                name="west", faults=(Fault.rate_limited(1.0, retry_after=FLEET_RETRY_AFTER),)
            ),
            FakeDeployment(name="central", time_to_first_token=Latency.fixed(FLEET_SLOW), chunks=2),
        ]
    )


def _fleet_config(path: Path, fleet: FakeFleet) -> Path:
    routes = "".join(
        f"""
[routes.{name}]
provider = "openai"
model = "model-{name}"
base_url = "{url}"
"""
        for name, url in fleet.base_urls.items()
    )
    # Round robin: every route is tried whatever its estimates say.
    path.write_text(
        f"""{routes}
[router]
kind = "balanced"
strategy = "round_robin"

[layers]
telemetry = true
"""
    )
    return path


@dataclass
class FleetGatewayRun:
    url: str
    server: ChildProcess
    fleet: FakeFleet
    _loop: _Loop

    @property
    def attempts(self) -> int:
        """The calls the fleet got over every phase so far: the gateway's attempts."""
        return sum(counts.calls for counts in self.fleet.counts().values())

    def phase(self) -> None:
        """Requests until each route was tried in this phase (every request is answered)."""
        self._loop.run(self._phase())

    async def _phase(self) -> None:
        before = now = self.fleet.counts()
        async with openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0
        ) as client:
            for _ in range(MAX_FLEET_REQUESTS):
                answer = await client.chat.completions.create(model="pipeline", messages=MESSAGES)
                assert answer.choices[0].message.content, answer
                now = self.fleet.counts()
                if all(now[name].calls > before[name].calls for name in now):
                    return
        raise AssertionError(f"a route got no call in {MAX_FLEET_REQUESTS} requests: {now}")


@contextlib.contextmanager
def running_fleet_gateway(
    workdir: Path, *args: str, env: Mapping[str, str] | None = None, timeout: float = 90
) -> Iterator[FleetGatewayRun]:
    """``chat-pipeline serve`` (with `args`) with a balanced router in front of a
    `FakeFleet` (the module docstring), until the block ends."""
    loop = _Loop()
    fleet = _fleet()
    try:
        loop.run(fleet.open())
        fleet.start()
        config = _fleet_config(workdir / "fleet.toml", fleet)
        with _serving(config, args, env, timeout) as (url, server):
            yield FleetGatewayRun(url, server, fleet, loop)
    finally:
        try:
            loop.run(fleet.close())
        finally:
            loop.close()


# -- a hedging router ----------------------------------------------------------------------------

HEDGE_DELAY = 0.05  # seconds without a first update before the hedge starts


@dataclass
class HedgedGatewayRun:
    url: str
    server: ChildProcess
    hung: FakeOpenAIServer
    fast: FakeOpenAIServer
    _loop: _Loop

    def requests(self) -> list[tuple[str, bool]]:
        """Requests, streamed and not, until one of each started on ``hung`` (which never
        answers) and was hedged on ``fast``: (request id, streamed) of each, in order."""
        return self._loop.run(self._requests())

    async def _requests(self) -> list[tuple[str, bool]]:
        sent: list[tuple[str, bool]] = []
        async with openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0
        ) as client:
            for stream in (True, True, False, False):  # round robin: every other one is hedged
                raw = await client.chat.completions.with_raw_response.create(
                    model="pipeline", messages=MESSAGES, stream=stream
                )
                parsed = raw.parse()
                if stream:
                    text = "".join([c.choices[0].delta.content or "" async for c in parsed])  # type: ignore[union-attr]
                else:
                    text = parsed.choices[0].message.content or ""  # type: ignore[union-attr]
                assert text == "a hedged answer", text
                sent.append((raw.headers["x-request-id"], stream))
        return sent


def _hedged_config(path: Path, hung: FakeOpenAIServer, fast: FakeOpenAIServer) -> Path:
    # Round robin, so the hung route is tried first every other request; outlier gaps wide
    # enough that its lost races never take it out of rotation.
    path.write_text(
        f"""
[routes.hung]
provider = "openai"
model = "model-hung"
base_url = "{hung.base_url}"

[routes.fast]
provider = "openai"
model = "model-fast"
base_url = "{fast.base_url}"

[router]
kind = "hedged"
strategy = "round_robin"
delay = {HEDGE_DELAY}
budget = 1.0

[router.health]
outlier_latency_gap = 1000.0
outlier_failure_gap = 1.0

[layers]
telemetry = true
"""
    )
    return path


@contextlib.contextmanager
def running_hedged_gateway(
    workdir: Path, *args: str, env: Mapping[str, str] | None = None, timeout: float = 90
) -> Iterator[HedgedGatewayRun]:
    """``chat-pipeline serve`` (with `args`) with a hedging router over ``hung`` (a fake
    upstream that never answers) and ``fast``, until the block ends."""
    loop = _Loop()
    hung = FakeOpenAIServer(default=FakeResponse(hang=True))
    fast = FakeOpenAIServer(
        default=FakeResponse(text="a hedged answer", chunks=["a hedged ", "answer"])
    )
    try:
        loop.run(hung.start())
        loop.run(fast.start())
        config = _hedged_config(workdir / "hedged.toml", hung, fast)
        with _serving(config, args, env, timeout) as (url, server):
            yield HedgedGatewayRun(url, server, hung, fast, loop)
    finally:
        try:
            loop.run(hung.stop())
        finally:
            try:
                loop.run(fast.stop())
            finally:
                loop.close()
