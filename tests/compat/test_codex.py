"""The OpenAI Codex CLI (npm ``@openai/codex``, pinned in ``tests/compat/codex``) against
``chat-pipeline serve``, run non-interactively as a user would: ``codex exec --json``.

Its configuration is a temporary ``CODEX_HOME`` whose ``config.toml`` holds one provider
entry with ``base_url``, ``env_key`` and ``wire_api = "responses"`` and nothing else (and
its ``name``, which Codex requires; the provider is chosen with ``-c model_provider=...``).
The gateway's config names the models Codex sends (its default ``gpt-6.2-sol``;
``gpt-5.1-codex`` with ``-m``) in ``[gateway] models``.

Client (Codex, its native binary) -> gateway (in this test's event loop) -> fake upstreams
(Chat Completions, the Responses API with encrypted reasoning, or Gemini with thought
signatures).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pipeline._semconv import CACHE_RESULT
from pipeline.config import CacheConfig, parse_config
from pipeline.testing import FakeBedrockServer, FakeGeminiServer, FakeOpenAIServer, FakeResponse
from tests.compat.node import codex
from tests.otel import Otel
from tests.pipeline.gateway.conftest import Running, config, running

pytestmark = pytest.mark.compat

RUN_TIMEOUT = 180.0
RESPONSES = "/v1/responses"
DEFAULT_MODEL = "gpt-6.2-sol"  # what Codex asks for with no model set ("code mode")
CODEX_MODEL = "gpt-5.1-codex"  # a model Codex sends its classic tools to (exec_command)
MODELS = {"pipeline": "pipeline", DEFAULT_MODEL: "pipeline", CODEX_MODEL: "pipeline"}
PROMPT = "CANARY-prompt: say hello"
REASONING = "CANARY-reasoning the user wants a greeting"
COMMAND = "echo CANARY-argument"


@pytest.fixture(scope="module")
def codex_bin() -> Path:
    return codex()


@pytest.fixture
async def upstream() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server


@pytest.fixture
async def backup() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server


def codex_home(home: Path, gateway: Running, provider_extra: str = "") -> Path:
    """A ``CODEX_HOME`` holding the one provider entry, and a working directory beside it."""
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(provider_entry(gateway, provider_extra))
    work = home.parent / "work"
    work.mkdir(exist_ok=True)
    return work


def provider_entry(gateway: Running, extra: str = "") -> str:
    """The one provider entry Codex is given: a base URL, a key variable, the wire API
    (and `extra` lines)."""
    return (
        "[model_providers.gateway]\n"
        'name = "chat-pipeline"\n'
        f'base_url = "{gateway.base_url}"\n'
        'env_key = "GATEWAY_KEY"\n'
        'wire_api = "responses"\n'
    ) + extra


async def run_codex(
    codex_bin: Path,
    gateway: Running,
    home: Path,
    prompt: str = PROMPT,
    model: str | None = None,
    *,
    key: str = "test-key",
    succeed: bool = True,
) -> list[dict[str, Any]]:
    """``codex exec --json`` once; its JSON events (with `succeed`, it must exit 0 and
    report no error)."""
    returncode, events, err = await exec_codex(codex_bin, gateway, home, prompt, model, key=key)
    if not succeed:
        return events
    if returncode != 0:
        pytest.fail(f"codex exec failed (exit {returncode}):\n{err[-4000:]}")
    errors = [e for e in events if e.get("type") in ("error", "turn.failed")]
    assert not errors, errors
    return events


async def exec_codex(
    codex_bin: Path,
    gateway: Running,
    home: Path,
    prompt: str = PROMPT,
    model: str | None = None,
    provider_extra: str = "",
    *,
    key: str = "test-key",
) -> tuple[int, list[dict[str, Any]], str]:
    """``codex exec --json`` once: its exit code, JSON events and standard error."""
    work = codex_home(home, gateway, provider_extra)
    command = [
        str(codex_bin),
        "exec",
        "--json",
        "--skip-git-repo-check",
        # The sandbox needs kernel features a CI container may lack; the gateway is tested.
        "--dangerously-bypass-approvals-and-sandbox",
        "-c",
        'model_provider="gateway"',
    ]
    if model is not None:
        command += ["-m", model]
    command.append(prompt)
    process = await asyncio.create_subprocess_exec(
        *command,
        cwd=work,
        env={**os.environ, "CODEX_HOME": str(home), "GATEWAY_KEY": key},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(RUN_TIMEOUT):
            out, err = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        pytest.fail(f"codex exec did not finish in {RUN_TIMEOUT:.0f} s")
    events = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    assert process.returncode is not None
    return process.returncode, events, err.decode()


def items(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [
        e["item"]
        for e in events
        if e.get("type") == "item.completed" and e.get("item", {}).get("type") == kind
    ]


def usage(events: list[dict[str, Any]]) -> dict[str, Any]:
    (done,) = [e for e in events if e.get("type") == "turn.completed"]
    found: dict[str, Any] = done["usage"]
    return found


def chat_tools(request: Any) -> dict[str, Any]:
    return {t["function"]["name"]: t["function"] for t in request.json.get("tools", [])}


async def test_answers(codex_bin: Path, upstream: FakeOpenAIServer, tmp_path: Path) -> None:
    upstream.script(FakeResponse(text="Hello from behind the gateway.", usage=(11, 5)))
    async with running(config({"primary": upstream}, gateway={"models": MODELS})) as gateway:
        events = await run_codex(codex_bin, gateway, tmp_path / "home")
    (message,) = items(events, "agent_message")
    assert message["text"] == "Hello from behind the gateway."
    assert upstream.count() == 1
    assert usage(events)["input_tokens"] == 11


async def test_exec_command_round_trip(
    codex_bin: Path, upstream: FakeOpenAIServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.script(
        FakeResponse(text="", tool_calls=[("exec_command", json.dumps({"cmd": COMMAND}))]),
        FakeResponse(text="The command printed its argument."),
    )
    caplog.set_level(logging.INFO, logger="chat_pipeline.gateway")
    async with running(config({"primary": upstream}, gateway={"models": MODELS})) as gateway:
        events = await run_codex(codex_bin, gateway, tmp_path / "home", model=CODEX_MODEL)
    (command,) = items(events, "command_execution")
    assert command["exit_code"] == 0
    assert "CANARY-argument" in command["aggregated_output"]
    assert items(events, "agent_message")[-1]["text"] == "The command printed its argument."
    first, second = upstream.requests
    # Namespaced tools flattened; web_search (a built-in tool) left out and said so.
    assert {"exec_command", "spawn_agent"} <= set(chat_tools(first))
    tool_message = second.json["messages"][-1]
    assert tool_message["role"] == "tool"
    assert "CANARY-argument" in tool_message["content"]
    lines = [r.getMessage() for r in caplog.records if r.name == "chat_pipeline.gateway"]
    assert any("builtin_tools=dropped=web_search" in line for line in lines)


async def test_code_mode_free_form_exec(
    codex_bin: Path, upstream: FakeOpenAIServer, tmp_path: Path
) -> None:
    """No model set: Codex sends its tools in an ``additional_tools`` input item, with a
    custom ``exec`` tool whose input is JavaScript. A Chat Completions route gets it as a
    function of one ``input`` string; its call comes back to Codex as a custom tool call."""
    script = f'const r = await tools.exec_command({{cmd: "{COMMAND}"}}); text(r.output);'
    upstream.script(
        FakeResponse(text="", custom_tool_calls=[("exec", script)]),
        FakeResponse(text="The script ran."),
    )
    async with running(config({"primary": upstream}, gateway={"models": MODELS})) as gateway:
        events = await run_codex(codex_bin, gateway, tmp_path / "home")
    (command,) = items(events, "command_execution")
    assert "CANARY-argument" in command["aggregated_output"]
    assert items(events, "agent_message")[-1]["text"] == "The script ran."
    first, second = upstream.requests
    exec_tool = chat_tools(first)["exec"]
    assert exec_tool["parameters"]["required"] == ["input"]
    call = second.json["messages"][-2]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"input": script}
    assert second.json["messages"][-1]["role"] == "tool"


async def test_encrypted_reasoning_round_trips_over_a_responses_upstream(
    codex_bin: Path,
    upstream: FakeOpenAIServer,
    tmp_path: Path,
    otel: Otel,
    caplog: pytest.LogCaptureFixture,
) -> None:
    upstream.script(
        FakeResponse(
            text="",
            reasoning=REASONING,
            reasoning_tokens=3,
            cache_usage=(0, 4),
            tool_calls=[("exec_command", json.dumps({"cmd": COMMAND}))],
            usage=(10, 6),
        ),
        FakeResponse(text="Done.", reasoning="CANARY-reasoning again", reasoning_tokens=2),
        path=RESPONSES,
    )
    caplog.set_level(logging.DEBUG)
    cfg = config(
        {"primary": upstream},
        gateway={"models": MODELS},
        layers={"telemetry": True},
        route_options={"primary": {"provider": "openai_responses"}},
    )
    async with running(cfg, **otel.providers) as gateway:
        events = await run_codex(codex_bin, gateway, tmp_path / "home", model=CODEX_MODEL)
    assert items(events, "reasoning")[0]["text"] == REASONING
    assert items(events, "agent_message")[-1]["text"] == "Done."
    first, second = upstream.requests
    assert first.json["include"] == ["reasoning.encrypted_content"]
    assert first.json["reasoning"]["summary"] == "auto"
    # The encrypted reasoning the upstream issued came back to it, and it verified it.
    assert upstream.returned_reasoning == 1
    kinds = [item.get("type") for item in second.json["input"]]
    assert kinds[-3:] == ["reasoning", "function_call", "function_call_output"]
    # Usage: the cached and reasoning tokens reached Codex.
    counted = usage(events)
    assert counted["cached_input_tokens"] == 4
    assert counted["reasoning_output_tokens"] == 5
    # No prompt, reasoning, encrypted content or tool argument in spans or logs.
    encrypted = [
        i["encrypted_content"] for i in second.json["input"] if i.get("type") == "reasoning"
    ]
    recorded = [json.dumps(dict(s.attributes or {})) for s in otel.finished()]
    recorded += [
        json.dumps([e.name, dict(e.attributes or {})]) for s in otel.finished() for e in s.events
    ]
    recorded += [r.getMessage() for r in caplog.records]
    for text in recorded:
        assert "CANARY" not in text
        assert not any(secret in text for secret in encrypted)
    attributes = [dict(s.attributes or {}) for s in otel.finished()]
    assert any(a.get("gen_ai.usage.reasoning.output_tokens") == 3 for a in attributes)


async def test_a_gemini_route_serves_a_tool_loop_with_its_thought_signatures(
    codex_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Codex served by Gemini: its reasoning asks for thought summaries, the signature of
    the exec_command call travels as the reasoning item's encrypted content, and the
    route gets it back unchanged (the fake refuses the turn otherwise)."""
    monkeypatch.setenv("CODEX_TEST_GEMINI_KEY", "gm-key")
    async with FakeGeminiServer() as gemini:
        gemini.script(
            FakeResponse(
                text="",
                thinking=REASONING,
                tool_calls=[("exec_command", json.dumps({"cmd": COMMAND}))],
                usage=(10, 6),
                reasoning_tokens=2,
            ),
            FakeResponse(text="Done."),
        )
        route = {"provider": "gemini", "api_key_env": "CODEX_TEST_GEMINI_KEY"}
        cfg = config(
            {"primary": gemini},  # type: ignore[dict-item]
            gateway={"models": MODELS},
            route_options={"primary": route},
        )
        async with running(cfg) as gateway:
            events = await run_codex(codex_bin, gateway, tmp_path / "home", model=CODEX_MODEL)
    assert items(events, "reasoning")[0]["text"] == REASONING
    (command,) = items(events, "command_execution")
    assert "CANARY-argument" in command["aggregated_output"]
    assert items(events, "agent_message")[-1]["text"] == "Done."
    first, second = (r.json for r in gemini.requests)
    assert first["generationConfig"]["thinkingConfig"]["includeThoughts"] is True
    assert gemini.returned_signatures == 1 and gemini.placeholder_signatures == 0
    answer = next(p for c in second["contents"] for p in c["parts"] if "functionResponse" in p)
    assert "CANARY-argument" in json.dumps(answer)
    assert usage(events)["reasoning_output_tokens"] == 2


async def test_failover_before_output_is_invisible(
    codex_bin: Path, upstream: FakeOpenAIServer, backup: FakeOpenAIServer, tmp_path: Path
) -> None:
    upstream.script(FakeResponse.error(503, code="server_error"))
    backup.script(FakeResponse(text="Served by the backup."))
    cfg = config({"primary": upstream, "backup": backup}, gateway={"models": MODELS})
    async with running(cfg) as gateway:
        events = await run_codex(codex_bin, gateway, tmp_path / "home", model=CODEX_MODEL)
    assert [m["text"] for m in items(events, "agent_message")] == ["Served by the backup."]
    assert (upstream.count(), backup.count()) == (1, 1)


# -- keys, budgets and rate limits -----------------------------------------------------------


def governed_config(upstream: FakeOpenAIServer, tmp_path: Path, redis_url: str) -> Any:
    from pipeline.config import parse_config

    os.environ["CODEX_TEST_REDIS"] = redis_url
    return parse_config(
        {
            "routes": {
                "primary": {
                    "provider": "openai",
                    "model": "model-primary",
                    "base_url": upstream.base_url,
                    "price": {"input_per_million": 1.0, "output_per_million": 1.0},
                }
            },
            "gateway": {"models": MODELS},
            "layers": {"telemetry": True},
            "spend": {"path": str(tmp_path / "ledger.db")},
            "keys": {"refresh_interval": 0.1},
            "budgets": {"redis_url_env": "CODEX_TEST_REDIS", "namespace": f"cx-{os.getpid()}"},
        }
    )


def responses_statuses(otel: Otel) -> list[Any]:
    from opentelemetry.trace import SpanKind

    return [
        dict(s.attributes or {}).get("http.response.status_code")
        for s in otel.finished()
        if s.kind is SpanKind.SERVER and s.name == f"POST {RESPONSES}"
    ]


async def test_a_spent_budget_stops_codex_and_shows_why(
    codex_bin: Path,
    upstream: FakeOpenAIServer,
    otel: Otel,
    tmp_path: Path,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pipeline.keys import Budget, SQLiteKeyStore

    monkeypatch.setenv("CODEX_TEST_REDIS", redis_url)
    store = SQLiteKeyStore(tmp_path / "ledger.db")
    issued = await store.create("agent", budget=Budget("0"))
    async with running(governed_config(upstream, tmp_path, redis_url), **otel.providers) as gw:
        events = await run_codex(
            codex_bin, gw, tmp_path / "home", model=CODEX_MODEL, key=issued.secret, succeed=False
        )
        await gw.gateway.wait_idle()
    await store.aclose()
    # Codex retries a 402 five times (it reads no x-should-retry); the gateway answers it
    # the 429 "usage_limit_reached" it stops on: one request, the limit told, no retry.
    (failed,) = [e for e in events if e.get("type") == "turn.failed"]
    assert "usage limit" in failed["error"]["message"]
    assert not [e for e in events if "Reconnecting" in str(e.get("message"))], events
    assert responses_statuses(otel) == [429]
    assert upstream.count() == 0


async def test_a_rate_limited_codex_waits_and_goes_on(
    codex_bin: Path,
    upstream: FakeOpenAIServer,
    otel: Otel,
    tmp_path: Path,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import httpx

    from pipeline.keys import SQLiteKeyStore

    monkeypatch.setenv("CODEX_TEST_REDIS", redis_url)
    store = SQLiteKeyStore(tmp_path / "ledger.db")
    # One every 5 s: the limit is still reached when Codex, a second or two later, starts.
    issued = await store.create("agent", rpm=12)
    upstream.script(*[FakeResponse(text="Hello!")] * 10)
    async with running(governed_config(upstream, tmp_path, redis_url), **otel.providers) as gw:
        async with httpx.AsyncClient(base_url=gw.base_url) as client:
            body = {"model": CODEX_MODEL, "input": "x"}
            headers = {"authorization": f"Bearer {issued.secret}"}
            for _ in range(10):  # one is admitted, the next refused
                response = await client.post("/responses", json=body, headers=headers)
                if response.status_code == 429:
                    break
            assert response.status_code == 429
        # Codex tells its retry as an "error" event ("Reconnecting... 1/5"), then goes on.
        events = await run_codex(
            codex_bin, gw, tmp_path / "home", model=CODEX_MODEL, key=issued.secret, succeed=False
        )
        await gw.gateway.wait_idle()
    await store.aclose()
    assert not [e for e in events if e.get("type") == "turn.failed"], events
    assert [m["text"] for m in items(events, "agent_message")] == ["Hello!"]
    statuses = responses_statuses(otel)
    assert statuses.count(429) >= 2 and statuses[-1] == 200


@pytest.fixture
def bedrock(fake_bedrock_server: FakeBedrockServer) -> FakeBedrockServer:
    """The kit's fake, its credentials in the environment (the gateway's AWS credentials)."""
    return fake_bedrock_server


def bedrock_config(bedrock: FakeBedrockServer, backup: FakeOpenAIServer | None = None) -> Any:
    model = "us.anthropic.claude-sonnet-4-5-20250929-v1:0"
    routes: dict[str, Any] = {
        "claude": {"provider": "bedrock", "model": model, "base_url": bedrock.base_url}
    }
    data: dict[str, Any] = {"routes": routes, "gateway": {"models": MODELS}}
    if backup is not None:
        routes["backup"] = {"provider": "openai", "model": "m", "base_url": backup.base_url}
        data["router"] = {"kind": "ordered", "order": ["claude", "backup"]}
    return parse_config(data)


async def test_exec_command_round_trip_over_a_bedrock_route(
    codex_bin: Path, bedrock: FakeBedrockServer, tmp_path: Path
) -> None:
    """Codex (the Responses API) against a Bedrock route: its tools become Converse tool
    specs (names the service takes), its command's output goes back as a tool result."""
    bedrock.script(
        FakeResponse(text="", tool_calls=[("exec_command", json.dumps({"cmd": COMMAND}))]),
        FakeResponse(text="The command printed its argument."),
    )
    async with running(bedrock_config(bedrock)) as gateway:
        events = await run_codex(codex_bin, gateway, tmp_path / "home", model=CODEX_MODEL)
    (command,) = items(events, "command_execution")
    assert command["exit_code"] == 0 and "CANARY-argument" in command["aggregated_output"]
    assert items(events, "agent_message")[-1]["text"] == "The command printed its argument."
    first, second = bedrock.requests
    names = {t["toolSpec"]["name"] for t in first.json["toolConfig"]["tools"] if "toolSpec" in t}
    assert "exec_command" in names
    results = [b["toolResult"] for b in second.json["messages"][-1]["content"] if "toolResult" in b]
    assert len(results) == 1 and "CANARY-argument" in json.dumps(results)
    assert bedrock.verified_signatures == 2


async def test_failover_from_a_bedrock_route_is_invisible(
    codex_bin: Path, bedrock: FakeBedrockServer, backup: FakeOpenAIServer, tmp_path: Path
) -> None:
    bedrock.script(FakeResponse.error(503, type="ServiceUnavailableException"))
    backup.script(FakeResponse(text="Served by the backup."))
    async with running(bedrock_config(bedrock, backup)) as gateway:
        events = await run_codex(codex_bin, gateway, tmp_path / "home", model=CODEX_MODEL)
    assert [m["text"] for m in items(events, "agent_message")] == ["Served by the backup."]
    assert (bedrock.count(), backup.count()) == (1, 1)


async def test_every_route_down_with_codexs_retries_bounded(
    codex_bin: Path, upstream: FakeOpenAIServer, backup: FakeOpenAIServer, tmp_path: Path
) -> None:
    """Codex retries whatever the gateway says (``x-should-retry: false`` included): 30
    requests in about 25 s with every route answering 500. Its provider entry bounds that:
    with ``request_max_retries = 0`` and ``stream_max_retries = 0`` it sends one request and
    shows the error."""
    down = FakeResponse.error(500)
    upstream.script(*[down] * 40)
    backup.script(*[down] * 40)
    cfg = config({"primary": upstream, "backup": backup}, gateway={"models": MODELS})
    bounded = "request_max_retries = 0\nstream_max_retries = 0\n"
    async with running(cfg) as gateway:
        returncode, events, _ = await exec_codex(
            codex_bin, gateway, tmp_path / "home", model=CODEX_MODEL, provider_extra=bounded
        )
    assert returncode != 0
    (failed,) = [e for e in events if e.get("type") == "turn.failed"]
    assert "503" in failed["error"]["message"]  # the gateway's answer, shown
    assert (upstream.count(), backup.count()) == (1, 1)  # one request: one try per route


async def test_a_second_identical_exec_is_a_cache_hit(
    codex_bin: Path, upstream: FakeOpenAIServer, tmp_path: Path, otel: Otel
) -> None:
    upstream.script(FakeResponse(text="Hello, once."))
    cfg = dataclasses.replace(
        config({"primary": upstream}, gateway={"models": MODELS}), cache=CacheConfig()
    )
    async with running(cfg, **otel.providers) as gateway:
        first = await run_codex(codex_bin, gateway, tmp_path / "home", model=CODEX_MODEL)
        second = await run_codex(codex_bin, gateway, tmp_path / "home", model=CODEX_MODEL)
        await gateway.gateway.wait_idle()
    texts = [items(events, "agent_message")[-1]["text"] for events in (first, second)]
    assert texts == ["Hello, once.", "Hello, once."]
    assert upstream.count() == 1
    results = [
        (s.attributes or {})[CACHE_RESULT]
        for s in sorted(otel.finished(), key=lambda span: span.start_time or 0)
        if CACHE_RESULT in (s.attributes or {})
    ]
    assert results == ["miss", "hit"]  # what x-cache said
