"""The contenders of `bench_degradation.py`, one entry each in `CONTENDERS`.

A chat-pipeline configuration is a TOML file (``$a``, ``$b``, ``$c`` stand for the
deployments' URLs) or a builder function of the URLs; `requires` names what
`middleware.routing` must export for it to run (else it is skipped, saying so). A LiteLLM
configuration is the keyword arguments of its ``Router``. The oracle calls one deployment
picked at random among those no fault touches when the request arrives (it knows the
schedule).

Each runs in a process of its own; `make_runner` builds it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import string
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# A model LiteLLM's cost map knows: for an unknown one it runs a pricing diagnostic on every
# response (about 5 ms of CPU a request on this machine), which no production user pays.
MODEL = "gpt-4o-mini"
API_KEY_ENV = "FLEET_API_KEY"
API_KEY = "sk-fleet"
ATTEMPT_TIMEOUT = 3.0  # seconds: one attempt, until its first token
REQUEST_TIMEOUT = 10.0  # seconds: the whole request
ORACLE_LOOKAHEAD = 0.1  # seconds


def _route(name: str, reset_timeout: float = 30) -> str:
    return (
        f"[routes.{name}]\n"
        'provider = "openai"\n'
        f'model = "{MODEL}"\n'
        f'base_url = "${name}"\n'
        f'api_key_env = "{API_KEY_ENV}"\n'
        "retry = { max_attempts = 2 }\n"
        f"breaker = {{ fail_max = 5, reset_timeout = {reset_timeout:g} }}\n"
    )


ROUTES_TOML = "\n".join(_route(name) for name in ("a", "b", "c"))
# Under a balanced router route health keeps a slow or failing route out and probes it
# back in; the breaker is for a route that is down, and a short reset lets health decide
# when it is back (the README's recommended balanced setup).
BALANCED_ROUTES_TOML = "\n".join(_route(name, reset_timeout=10) for name in ("a", "b", "c"))

# The README's recommended setup: ordered failover over three routes of one model, each
# route retry + breaker; an attempt is cut after 3 s, the request after 10 s.
ORDERED_TOML = (
    ROUTES_TOML
    + f"""
[router]
kind = "ordered"
order = ["a", "b", "c"]
attempt_timeout = {ATTEMPT_TIMEOUT}
request_timeout = {REQUEST_TIMEOUT}
"""
)


# The balanced router over the same routes, by route health (peak-EWMA, power of two).
BALANCED_TOML = (
    BALANCED_ROUTES_TOML
    + f"""
[router]
kind = "balanced"
strategy = "peak_ewma"
attempt_timeout = {ATTEMPT_TIMEOUT}
request_timeout = {REQUEST_TIMEOUT}
"""
)


def _routes(urls: Mapping[str, str]) -> list[Any]:
    """The balanced contender's three routes (`BALANCED_ROUTES_TOML`) in code: retry +
    breaker over the OpenAI client; route health reacts first, the breaker is the backstop,
    and a breaker open for 30 s would keep a recovered route out."""
    from middleware.routing import Route
    from pipeline import ChatPipeline
    from pipeline.providers import OpenAIChatClient

    return [
        Route(
            name,
            ChatPipeline.builder()
            .use_circuit_breaker(fail_max=5, reset_timeout=10)
            .use_retry(max_attempts=2)
            .build(OpenAIChatClient(MODEL, api_key=API_KEY, base_url=url), name=name),
        )
        for name, url in urls.items()
    ]


def build_hedged(urls: Mapping[str, str]) -> Any:
    from pipeline import ChatPipeline

    return (
        ChatPipeline.builder()
        .use_hedging(
            _routes(urls),
            delay="p90",
            budget=0.1,
            attempt_timeout=ATTEMPT_TIMEOUT,
            request_timeout=REQUEST_TIMEOUT,
        )
        .build()
    )


def _litellm_router(strategy: str) -> dict[str, Any]:
    # LiteLLM's documented setup: retries across the group's deployments, cooldowns at their
    # defaults (a 429 cools a deployment at once; so does a minute with > 50% failures), a
    # per-call timeout like chat-pipeline's attempt timeout (for a stream it bounds each read).
    return {
        "routing_strategy": strategy,
        "num_retries": 2,
        "timeout": ATTEMPT_TIMEOUT,
        "stream_timeout": ATTEMPT_TIMEOUT,
    }


@dataclass(frozen=True)
class Contender:
    name: str
    label: str
    family: str  # chat-pipeline | litellm | oracle
    toml: str | None = None
    build: Callable[[Mapping[str, str]], Any] | None = None
    requires: str | None = None
    router: Mapping[str, Any] = field(default_factory=dict)
    hedges: bool = False


CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in (
        Contender("oracle", "oracle (random healthy pick)", "oracle"),
        Contender(
            "chat-pipeline-ordered", "chat-pipeline ordered (today)", "chat-pipeline", ORDERED_TOML
        ),
        Contender(
            "chat-pipeline-balanced",
            "chat-pipeline balanced (peak_ewma)",
            "chat-pipeline",
            BALANCED_TOML,
            requires="BalancedFailoverChatClient",
        ),
        Contender(
            "chat-pipeline-hedged",
            "chat-pipeline hedged (p90)",
            "chat-pipeline",
            build=build_hedged,
            requires="HedgingChatClient",
            hedges=True,
        ),
        Contender(
            "litellm-latency",
            "LiteLLM Router latency-based",
            "litellm",
            router=_litellm_router("latency-based-routing"),
        ),
        Contender(
            "litellm-shuffle",
            "LiteLLM Router simple-shuffle",
            "litellm",
            router=_litellm_router("simple-shuffle"),
        ),
    )
}
BASELINE = "chat-pipeline-ordered"  # the CPU target compares with today's router


class Unavailable(Exception):
    """The contender cannot run here (a router not built yet, a library not installed)."""


@dataclass
class Outcome:
    """One request as its caller saw it (seconds from when it was scheduled to arrive)."""

    first_token: float | None = None
    text: str = ""
    error: str | None = None
    output_before_error: bool = False

    def received(self, text: str | None, scheduled: float) -> None:
        """A streamed piece reached the caller."""
        if text:
            if self.first_token is None:
                self.first_token = time.monotonic() - scheduled
            self.text += text

    def failed(self, exc: BaseException) -> None:
        self.error = type(exc).__name__
        self.output_before_error = self.first_token is not None


def messages_of(request: int) -> str:
    from pipeline.testing import FakeFleet

    return f"{FakeFleet.tag(request)} Tell me something."


class Runner:
    version = ""

    async def call(self, request: int, streaming: bool, at: float, scheduled: float) -> Outcome:
        """Send request number `request` (scheduled `at` seconds into the run, at
        `scheduled` on the monotonic clock)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        pass


async def chat_call(client: Any, request: int, streaming: bool, scheduled: float) -> Outcome:
    """One request through a chat-pipeline client, either call shape."""
    from pipeline import ChatMessage

    messages = [ChatMessage.user(messages_of(request))]
    outcome = Outcome()
    try:
        if not streaming:
            outcome.text = (await client.get_response(messages)).text
            return outcome
        async with contextlib.aclosing(client.get_streaming_response(messages)) as stream:
            async for update in stream:
                outcome.received(update.text, scheduled)
    except Exception as exc:
        outcome.failed(exc)
    return outcome


class ChatPipelineRunner(Runner):
    def __init__(self, contender: Contender, urls: Mapping[str, str]) -> None:
        from importlib.metadata import version

        import middleware.routing

        if contender.requires and not hasattr(middleware.routing, contender.requires):
            raise Unavailable(f"middleware.routing has no {contender.requires} yet")
        self.version = f"chat-pipeline {version('chat-pipeline')}"
        if contender.toml is not None:
            from pipeline import ChatPipeline

            text = string.Template(contender.toml).substitute(urls)
            with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as file:
                file.write(text)
            try:
                os.environ[API_KEY_ENV] = API_KEY
                self.client = ChatPipeline.from_config(file.name)
            finally:
                os.unlink(file.name)
        else:
            assert contender.build is not None
            self.client = contender.build(urls)

    async def call(self, request: int, streaming: bool, at: float, scheduled: float) -> Outcome:
        return await chat_call(self.client, request, streaming, scheduled)

    async def aclose(self) -> None:
        await self.client.aclose()


class LiteLLMRunner(Runner):
    def __init__(self, contender: Contender, urls: Mapping[str, str]) -> None:
        from importlib.metadata import version

        try:
            import litellm
        except ImportError as exc:
            raise Unavailable("litellm is not installed (pip install -e '.[bench]')") from exc
        self.version = f"litellm {version('litellm')}"
        model_list = [
            {
                "model_name": "fleet",
                "litellm_params": {"model": f"openai/{MODEL}", "api_base": url, "api_key": API_KEY},
                "model_info": {"id": name},
            }
            for name, url in urls.items()
        ]
        self.router = litellm.Router(model_list=model_list, **contender.router)

    async def call(self, request: int, streaming: bool, at: float, scheduled: float) -> Outcome:
        messages = [{"role": "user", "content": messages_of(request)}]
        outcome = Outcome()
        try:
            # LiteLLM has no deadline for the whole request: the caller's own, as a user sets.
            async with asyncio.timeout(REQUEST_TIMEOUT):
                if not streaming:
                    response = await self.router.acompletion(model="fleet", messages=messages)
                    outcome.text = str(response.choices[0].message.content or "")
                    return outcome
                response = await self.router.acompletion(
                    model="fleet", messages=messages, stream=True
                )
                async for chunk in response:
                    outcome.received(
                        chunk.choices[0].delta.content if chunk.choices else None, scheduled
                    )
        except Exception as exc:
            outcome.failed(exc)
        return outcome


class OracleRunner(Runner):
    """One deployment per request, picked at random among the healthy ones (by the
    schedule), called directly: no retry, no failover."""

    def __init__(self, urls: Mapping[str, str], scenario: Mapping[str, Any], seed: int) -> None:
        from importlib.metadata import version

        from pipeline.providers import OpenAIChatClient
        from pipeline.testing import FakeFleet

        self.version = f"chat-pipeline {version('chat-pipeline')} (OpenAIChatClient alone)"
        self.fleet = FakeFleet.from_scenario(scenario)  # not started: only its schedule is read
        self.clients = {
            name: OpenAIChatClient(MODEL, api_key=API_KEY, base_url=url)
            for name, url in urls.items()
        }
        self.seed = seed

    async def call(self, request: int, streaming: bool, at: float, scheduled: float) -> Outcome:
        # Healthy now and a moment later: a call reaches the fleet a little after it is due.
        soon = set(self.fleet.healthy(at + ORACLE_LOOKAHEAD))
        healthy = [name for name in self.fleet.healthy(at) if name in soon] or list(self.clients)
        pick = random.Random(f"{self.seed}:oracle:{request}").choice(healthy)
        return await chat_call(self.clients[pick], request, streaming, scheduled)

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.aclose()


def make_runner(
    name: str, urls: Mapping[str, str], scenario: Mapping[str, Any], seed: int
) -> Runner:
    contender = CONTENDERS[name]
    if contender.family == "oracle":
        return OracleRunner(urls, scenario, seed)
    if contender.family == "litellm":
        return LiteLLMRunner(contender, urls)
    return ChatPipelineRunner(contender, urls)
