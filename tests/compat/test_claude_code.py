"""Claude Code (the real CLI, ``@anthropic-ai/claude-code`` from the npm registry, pinned in
``tests/compat/claude_code/package.json``) against the gateway, non-interactively.

Claude Code is configured as a new user would: ``ANTHROPIC_BASE_URL`` and
``ANTHROPIC_API_KEY`` only (and a fresh ``HOME``); the gateway maps the names it sends
(``claude-opus-...``, ``claude-haiku-...``) with one pattern, ``"claude-*" = "pipeline"``.
The only network is loopback: what Claude Code phones home to besides the base URL fails at
once (it also sends ``HEAD {base}/api/hello`` to the base URL, answered 404), so a run
takes seconds.

Client (``claude -p ... --output-format json``) -> gateway (uvicorn, in this test's event
loop) -> fake upstreams (Chat Completions, or the fake Anthropic server, which checks
strictly that thinking blocks come back with their signatures unchanged, or the fake Gemini
server, which checks thought signatures as strictly).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.trace import SpanKind

from pipeline._semconv import CACHE_RESULT
from pipeline.config import CacheConfig, parse_config
from pipeline.testing import (
    FakeAnthropicServer,
    FakeBedrockServer,
    FakeGeminiServer,
    FakeOpenAIServer,
    FakeResponse,
)
from tests.compat.node import claude_code
from tests.otel import Otel
from tests.pipeline.gateway.conftest import Running, running

pytestmark = pytest.mark.compat

RUN_TIMEOUT = 120.0
GIVE_UP_BOUND = 60.0
"""The bound within which Claude Code, every route down, gives up: it sends one request,
the gateway answers ``api_error`` with ``x-should-retry: false``, and Claude Code stops at
once (asserted as a count of requests: one; the bound is only this test's timeout)."""
CANARY = "CANARY-7f3e"


@pytest.fixture(scope="module")
def claude() -> Path:
    return claude_code()


@pytest.fixture
async def openai_upstream() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server


@pytest.fixture
async def backup_upstream() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server


@pytest.fixture
async def anthropic_upstream() -> AsyncIterator[FakeAnthropicServer]:
    async with FakeAnthropicServer() as server:
        yield server


@pytest.fixture
def bedrock_upstream(fake_bedrock_server: FakeBedrockServer) -> FakeBedrockServer:
    """The kit's fake, its credentials in the environment (the gateway's AWS credentials)."""
    return fake_bedrock_server


def bedrock_route(server: FakeBedrockServer) -> dict[str, Any]:
    model = "us.anthropic.claude-sonnet-4-5-20250929-v1:0"
    return {"provider": "bedrock", "model": model, "base_url": server.base_url}


def gateway_config(routes: dict[str, tuple[str, str]], **router: Any) -> Any:
    """Routes by name -> (provider, base URL), in order, behind ``claude-*``."""
    data: dict[str, Any] = {
        "routes": {
            name: {
                "provider": provider,
                "model": f"model-{name}",
                "base_url": url,
                "api_key_env": "CLAUDE_CODE_TEST_UPSTREAM_KEY",
                "retry": {"max_attempts": 1},
            }
            for name, (provider, url) in routes.items()
        },
        "gateway": {"models": {"claude-*": "pipeline"}},
        "layers": {"telemetry": True, "logging": True},
    }
    if len(routes) > 1:
        data["router"] = {"kind": "ordered", "order": list(routes), **router}
    return parse_config(data)


async def ask(
    claude: Path,
    gateway: Running,
    workdir: Path,
    prompt: str,
    *options: str,
    bound: float = RUN_TIMEOUT,
    env: dict[str, str] | None = None,
    api_key: str = f"sk-gateway-{CANARY}",
) -> dict[str, Any]:
    """``claude -p PROMPT --output-format json [OPTIONS]`` with only the base URL and a key
    set; its JSON result (the test fails when it takes more than `bound` seconds)."""
    home = workdir / "home"
    home.mkdir(exist_ok=True)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": gateway.url,
        "ANTHROPIC_API_KEY": api_key,
        **(env or {}),
    }
    process = await asyncio.create_subprocess_exec(
        str(claude),
        "-p",
        prompt,
        "--output-format",
        "json",
        *options,
        cwd=workdir,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(bound):
            out, err = await process.communicate()
    except TimeoutError:
        pytest.fail(f"claude did not finish in {bound:.0f} s")
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    lines = out.decode().strip().splitlines()
    if not lines:
        pytest.fail(f"claude printed nothing (exit {process.returncode}):\n{err.decode()[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def assert_never_recorded(secrets: list[str], caplog: pytest.LogCaptureFixture, otel: Otel) -> None:
    """None of `secrets` in the logs (the SDKs' own aside) or in anything exported."""
    records = [r for r in caplog.records if not r.name.startswith(("anthropic", "openai"))]
    logged = [r.getMessage() for r in records] + [str(r.args) for r in records]
    for secret in secrets:
        assert not [line for line in logged if secret in line]
        assert not [text for text in otel.everything_exported() if secret in text]


def every_route(
    openai_upstream: FakeOpenAIServer, backup_upstream: FakeOpenAIServer, answer: FakeResponse
) -> Any:
    """Two routes in order, each answering `answer` to every request (30 of them)."""
    openai_upstream.script(*[answer] * 30)
    backup_upstream.script(*[answer] * 30)
    return gateway_config(
        {
            "primary": ("openai", openai_upstream.base_url),
            "backup": ("openai", backup_upstream.base_url),
        }
    )


async def served(
    claude: Path, cfg: Any, otel: Otel, workdir: Path, prompt: str, **ask_options: Any
) -> tuple[dict[str, Any], int]:
    """One ``claude -p`` run against a gateway serving `cfg`: its result, and how many
    ``POST /v1/messages`` the gateway served."""
    async with running(cfg, **otel.providers) as gateway:
        result = await ask(claude, gateway, workdir, prompt, **ask_options)
        await gateway.gateway.wait_idle()
    posts = [s for s in server_spans(otel) if s.name == "POST /v1/messages"]
    return result, len(posts)


def server_spans(otel: Otel) -> list[Any]:
    return [s for s in otel.finished() if s.kind is SpanKind.SERVER]


async def test_answers_over_a_chat_completions_route(
    claude: Path,
    openai_upstream: FakeOpenAIServer,
    otel: Otel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CLAUDE_CODE_TEST_UPSTREAM_KEY", "upstream-key")
    openai_upstream.script(FakeResponse(text="Hello from the gateway."))
    cfg = gateway_config({"primary": ("openai", openai_upstream.base_url)})
    async with running(cfg, **otel.providers) as gateway:
        result = await ask(claude, gateway, tmp_path, "Say hello")
        await gateway.gateway.wait_idle()
    assert result["is_error"] is False, result
    assert result["result"] == "Hello from the gateway."
    # What Claude Code sent (thinking, context_management, output_config, a system turn in
    # the middle, cache_control) was accepted: one request, served.
    posts = [s for s in server_spans(otel) if s.name == "POST /v1/messages"]
    assert len(posts) == 1
    body = openai_upstream.requests[0].json
    roles = [m["role"] for m in body["messages"]]
    assert roles[0] == "system" and "system" in roles[1:]  # the mid-conversation one, in place
    assert "context_management" not in body and "thinking" not in body


async def test_a_read_tool_round_trip_over_a_chat_completions_route(
    claude: Path,
    openai_upstream: FakeOpenAIServer,
    otel: Otel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CLAUDE_CODE_TEST_UPSTREAM_KEY", "upstream-key")
    notes = tmp_path / "notes.txt"
    notes.write_text(f"the launch code is {CANARY}\n")
    openai_upstream.script(
        FakeResponse(text="", tool_calls=[("Read", json.dumps({"file_path": str(notes)}))]),
        FakeResponse(text="The file holds a launch code."),
    )
    cfg = gateway_config({"primary": ("openai", openai_upstream.base_url)})
    async with running(cfg, **otel.providers) as gateway:
        result = await ask(claude, gateway, tmp_path, "What is in notes.txt?")
        await gateway.gateway.wait_idle()
    assert result["is_error"] is False, result
    assert result["result"] == "The file holds a launch code."
    assert openai_upstream.count() == 2
    second = openai_upstream.requests[1].json["messages"]
    call = next(m for m in second if m.get("tool_calls"))
    assert call["tool_calls"][0]["function"]["name"] == "Read"
    tool = next(m for m in second if m["role"] == "tool")
    assert tool["tool_call_id"] == call["tool_calls"][0]["id"]
    assert CANARY in json.dumps(tool["content"])  # Claude Code read the file and sent it


async def test_web_search_is_served_without_the_server_tool(
    claude: Path,
    openai_upstream: FakeOpenAIServer,
    otel: Otel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Claude Code's WebSearch asks the API for Anthropic's ``web_search`` server tool, which
    no route runs: the gateway serves that request without it (``[gateway] builtin_tools``,
    "drop" by default) and says so, the search returns what the model answered, and the
    turn completes instead of failing. (Print mode needs the tool allowed, as any tool that
    asks for permission: that is Claude Code's setting, not the gateway's.)"""
    monkeypatch.setenv("CLAUDE_CODE_TEST_UPSTREAM_KEY", "upstream-key")
    caplog.set_level(logging.INFO, logger="chat_pipeline.gateway")
    openai_upstream.script(
        FakeResponse(text="", tool_calls=[("WebSearch", json.dumps({"query": "gateway news"}))]),
        FakeResponse(text="No search results here."),
        FakeResponse(text="Nothing new about gateways."),
    )
    cfg = gateway_config({"primary": ("openai", openai_upstream.base_url)})
    async with running(cfg, **otel.providers) as gateway:
        result = await ask(
            claude,
            gateway,
            tmp_path,
            "Search the web for gateway news",
            "--allowedTools",
            "WebSearch",
        )
        await gateway.gateway.wait_idle()
    assert result["is_error"] is False, result
    assert result["result"] == "Nothing new about gateways."
    assert openai_upstream.count() == 3
    # The search's own request: the query, and no tool left for the route (the server
    # tool was its only one).
    search = openai_upstream.requests[1].json
    assert "gateway news" in json.dumps(search["messages"])
    assert "tools" not in search
    lines = [r.getMessage() for r in caplog.records if r.name == "chat_pipeline.gateway"]
    dropped = [line for line in lines if "builtin_tools=dropped=web_search_" in line]
    assert len(dropped) == 1, lines
    # What the model answered came back to it as the search's result.
    (tool,) = [m for m in openai_upstream.requests[2].json["messages"] if m["role"] == "tool"]
    assert "No search results here." in tool["content"]


async def test_thinking_with_signatures_round_trips_over_an_anthropic_route(
    claude: Path,
    anthropic_upstream: FakeAnthropicServer,
    otel: Otel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("CLAUDE_CODE_TEST_UPSTREAM_KEY", "upstream-key")
    caplog.set_level(logging.DEBUG)
    notes = tmp_path / f"notes-{CANARY}.txt"
    notes.write_text(f"the launch code is {CANARY}\n")
    anthropic_upstream.script(
        FakeResponse(
            text="",
            thinking=f"I should read the file {CANARY}.",
            tool_calls=[("Read", json.dumps({"file_path": str(notes)}))],
            usage=(40, 9),
        ),
        FakeResponse(text="The file holds a launch code.", thinking=f"Done {CANARY}."),
    )
    cfg = gateway_config({"claude": ("anthropic", anthropic_upstream.base_url)})
    async with running(cfg, **otel.providers) as gateway:
        result = await ask(claude, gateway, tmp_path, f"What is in the notes file? {CANARY}")
        await gateway.gateway.wait_idle()
    assert result["is_error"] is False, result
    assert result["result"] == "The file holds a launch code."
    # The fake refuses a thinking block that does not come back exactly as it was signed,
    # and a tool_use turn without its thinking: two requests, both served.
    assert anthropic_upstream.count() == 2
    first, second = (r.json for r in anthropic_upstream.requests)
    # Claude Code's betas reach the Anthropic route, for the fields that need them.
    betas = anthropic_upstream.requests[0].headers["anthropic-beta"].split(",")
    assert "context-management-2025-06-27" in betas
    assert first["thinking"]["type"] in ("adaptive", "enabled")
    assert first["context_management"]["edits"]  # passed on: there is thinking to clear
    assert any("cache_control" in block for block in first["system"])
    assistant = [m for m in second["messages"] if m["role"] == "assistant"][-1]
    thinking = assistant["content"][0]
    assert thinking["type"] == "thinking"
    assert thinking["signature"] == anthropic_upstream.signature(thinking["thinking"])
    assert assistant["content"][-1]["type"] == "tool_use"
    # Cache tokens reached Claude Code: the second request read the prefix the first wrote.
    assert result["usage"]["cache_read_input_tokens"] > 0
    # Canaries: no prompt, reasoning text, signature, tool argument or key in spans or logs.
    assert_never_recorded([CANARY, thinking["signature"]], caplog, otel)


async def test_a_read_tool_loop_with_thought_signatures_over_a_gemini_route(
    claude: Path, otel: Otel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claude Code served by Gemini: its thinking asks the route to think, the thought
    signature of the Read call travels as a thinking block's signature and comes back to
    the route unchanged (the fake refuses the turn otherwise)."""
    monkeypatch.setenv("CLAUDE_CODE_TEST_UPSTREAM_KEY", "upstream-key")
    notes = tmp_path / "notes.txt"
    notes.write_text(f"the launch code is {CANARY}\n")
    async with FakeGeminiServer() as gemini:
        gemini.script(
            FakeResponse(text="", tool_calls=[("Read", json.dumps({"file_path": str(notes)}))]),
            FakeResponse(text="The file holds a launch code."),
        )
        cfg = gateway_config({"gemini": ("gemini", gemini.base_url)})
        async with running(cfg, **otel.providers) as gateway:
            result = await ask(claude, gateway, tmp_path, "What is in notes.txt?")
            await gateway.gateway.wait_idle()
    assert result["is_error"] is False, result
    assert result["result"] == "The file holds a launch code."
    assert gemini.count() == 2
    first, second = (r.json for r in gemini.requests)
    assert "thinkingConfig" in first["generationConfig"]  # Claude Code's thinking, mapped
    model_turn = [c for c in second["contents"] if c["role"] == "model"][-1]
    call = next(p for p in model_turn["parts"] if "functionCall" in p)
    assert call["functionCall"]["name"] == "Read"
    assert gemini.returned_signatures == 1 and gemini.placeholder_signatures == 0
    answer = next(p for c in second["contents"] for p in c["parts"] if "functionResponse" in p)
    assert CANARY in json.dumps(answer)  # Claude Code read the file and sent it


@pytest.mark.parametrize("first", ["gemini", "bedrock"])
async def test_failover_between_a_gemini_and_a_bedrock_route_is_invisible(
    claude: Path,
    bedrock_upstream: FakeBedrockServer,
    otel: Otel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    first: str,
) -> None:
    """Either route fails before output (throttled, saying when it will be back); the other
    serves: Claude Code sees one answer and no error."""
    monkeypatch.setenv("CLAUDE_CODE_TEST_UPSTREAM_KEY", "upstream-key")
    async with FakeGeminiServer() as gemini:
        routes = {
            "gemini": {
                "provider": "gemini",
                "model": "gemini-2.5-flash",
                "base_url": gemini.base_url,
                "api_key_env": "CLAUDE_CODE_TEST_UPSTREAM_KEY",
                "retry": {"max_attempts": 1},
            },
            "bedrock": {**bedrock_route(bedrock_upstream), "retry": {"max_attempts": 1}},
        }
        order = [first, "bedrock" if first == "gemini" else "gemini"]
        if first == "gemini":
            gemini.script(FakeResponse.error(429, retry_after="30"))
            bedrock_upstream.script(FakeResponse(text="Served by the other cloud."))
        else:
            bedrock_upstream.script(
                FakeResponse.error(429, type="ThrottlingException", retry_after="30")
            )
            gemini.script(FakeResponse(text="Served by the other cloud."))
        cfg = parse_config(
            {
                "routes": {name: routes[name] for name in order},
                "router": {"kind": "ordered", "order": order},
                "gateway": {"models": {"claude-*": "pipeline"}},
            }
        )
        async with running(cfg, **otel.providers) as gateway:
            result = await ask(claude, gateway, tmp_path, "Say hello")
            await gateway.gateway.wait_idle()
    assert result["is_error"] is False, result
    assert result["result"] == "Served by the other cloud."
    assert (gemini.count(), bedrock_upstream.count()) == (1, 1)


async def test_failover_before_output_is_invisible(
    claude: Path,
    openai_upstream: FakeOpenAIServer,
    backup_upstream: FakeOpenAIServer,
    otel: Otel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CLAUDE_CODE_TEST_UPSTREAM_KEY", "upstream-key")
    openai_upstream.script(FakeResponse.error(503))
    backup_upstream.script(FakeResponse(text="Served by the backup."))
    cfg = gateway_config(
        {
            "primary": ("openai", openai_upstream.base_url),
            "backup": ("openai", backup_upstream.base_url),
        }
    )
    async with running(cfg, **otel.providers) as gateway:
        result = await ask(claude, gateway, tmp_path, "Say hello")
        await gateway.gateway.wait_idle()
    assert result["is_error"] is False, result
    assert result["result"] == "Served by the backup."
    assert (openai_upstream.count(), backup_upstream.count()) == (1, 1)
    assert len([s for s in server_spans(otel) if s.name == "POST /v1/messages"]) == 1


@pytest.mark.parametrize("status", [503, 500])
async def test_every_route_down_ends_after_one_request(
    claude: Path,
    openai_upstream: FakeOpenAIServer,
    backup_upstream: FakeOpenAIServer,
    otel: Otel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    status: int,
) -> None:
    monkeypatch.setenv("CLAUDE_CODE_TEST_UPSTREAM_KEY", "upstream-key")
    cfg = every_route(openai_upstream, backup_upstream, FakeResponse.error(status))
    result, posts = await served(claude, cfg, otel, tmp_path, "Say hello", bound=GIVE_UP_BOUND)
    assert result["is_error"] is True, result
    # One request: nothing tells when a route may serve again, so the gateway said a retry
    # cannot help (api_error, x-should-retry: false) and Claude Code did not retry.
    assert posts == 1
    assert (openai_upstream.count(), backup_upstream.count()) == (1, 1)
    assert result["result"]  # the error is shown


RATE_LIMITED_BOUND = 20.0
"""The bound within which Claude Code, every route rate limited, gives up."""
RATE_LIMITED = FakeResponse.error(429, retry_after="1")


async def test_every_route_rate_limited_ends_within_20_s_with_the_error_shown(
    claude: Path,
    openai_upstream: FakeOpenAIServer,
    backup_upstream: FakeOpenAIServer,
    otel: Otel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CLAUDE_CODE_TEST_UPSTREAM_KEY", "upstream-key")
    cfg = every_route(openai_upstream, backup_upstream, RATE_LIMITED)
    result, posts = await served(claude, cfg, otel, tmp_path, "Say hello", bound=RATE_LIMITED_BOUND)
    assert result["is_error"] is True, result
    assert result["result"]  # the error is shown
    assert 1 <= posts <= 4


async def test_every_route_rate_limited_bounded_on_claude_codes_side(
    claude: Path,
    openai_upstream: FakeOpenAIServer,
    backup_upstream: FakeOpenAIServer,
    otel: Otel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``CLAUDE_CODE_MAX_RETRIES`` bounds Claude Code's retries whatever the gateway says:
    with 0, every route rate limited ends after one request, the error shown."""
    monkeypatch.setenv("CLAUDE_CODE_TEST_UPSTREAM_KEY", "upstream-key")
    cfg = every_route(openai_upstream, backup_upstream, RATE_LIMITED)
    bounded = {"CLAUDE_CODE_MAX_RETRIES": "0"}
    result, posts = await served(
        claude, cfg, otel, tmp_path, "Say hello", bound=RATE_LIMITED_BOUND, env=bounded
    )
    assert result["is_error"] is True, result
    assert result["result"]  # the error is shown
    assert posts == 1


def cached(cfg: Any) -> Any:
    """`cfg` with the response cache on (in memory)."""
    return dataclasses.replace(cfg, cache=CacheConfig())


def cache_results(otel: Otel) -> list[str]:
    """What the cache said of each request (its `x-cache`), in order: the request's span
    carries it."""
    return [
        str((s.attributes or {})[CACHE_RESULT])
        for s in sorted(otel.finished(), key=lambda span: span.start_time or 0)
        if CACHE_RESULT in (s.attributes or {})
    ]


async def test_a_second_identical_run_is_a_cache_hit(
    claude: Path,
    openai_upstream: FakeOpenAIServer,
    otel: Otel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CLAUDE_CODE_TEST_UPSTREAM_KEY", "upstream-key")
    openai_upstream.script(FakeResponse(text="Hello, once."))
    cfg = cached(gateway_config({"primary": ("openai", openai_upstream.base_url)}))
    async with running(cfg, **otel.providers) as gateway:
        # The same directory (Claude Code's prompt names it), a new session each time.
        first = await ask(claude, gateway, tmp_path, "Say hello")
        second = await ask(claude, gateway, tmp_path, "Say hello")
        await gateway.gateway.wait_idle()
    assert first["result"] == second["result"] == "Hello, once."
    assert openai_upstream.count() == 1
    assert cache_results(otel) == ["miss", "hit"]  # what x-cache said


async def test_two_successive_tool_calls_over_the_fake_anthropic_server(
    claude: Path,
    anthropic_upstream: FakeAnthropicServer,
    otel: Otel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each tool call the fake answers has an id of its own: Claude Code runs both and
    sends each result back under its call's id (a reused id looked answered already)."""
    monkeypatch.setenv("CLAUDE_CODE_TEST_UPSTREAM_KEY", "upstream-key")
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text("alpha\n")
    second.write_text("beta\n")
    anthropic_upstream.script(
        FakeResponse(text="", tool_calls=[("Read", json.dumps({"file_path": str(first)}))]),
        FakeResponse(text="", tool_calls=[("Read", json.dumps({"file_path": str(second)}))]),
        FakeResponse(text="Both files read."),
    )
    cfg = gateway_config({"claude": ("anthropic", anthropic_upstream.base_url)})
    result, _ = await served(claude, cfg, otel, tmp_path, "Read first.txt, then second.txt")
    assert result["is_error"] is False, result
    assert result["result"] == "Both files read."
    assert anthropic_upstream.count() == 3
    last = anthropic_upstream.requests[2].json["messages"]
    calls = [
        block
        for message in last
        if message["role"] == "assistant" and isinstance(message["content"], list)
        for block in message["content"]
        if block["type"] == "tool_use"
    ]
    results = [
        block
        for message in last
        if message["role"] == "user" and isinstance(message["content"], list)
        for block in message["content"]
        if block["type"] == "tool_result"
    ]
    assert len(calls) == 2 and calls[0]["id"] != calls[1]["id"]
    assert [r["tool_use_id"] for r in results] == [c["id"] for c in calls]
    assert "alpha" in json.dumps(results[0]) and "beta" in json.dumps(results[1])


async def test_thinking_and_a_read_tool_round_trip_over_a_bedrock_route(
    claude: Path,
    bedrock_upstream: FakeBedrockServer,
    otel: Otel,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Claude Code against a Claude model on Bedrock: its thinking goes out as Converse
    reasoning and comes back signed; its Read tool runs; its cache breakpoints are cache
    points (the fake refuses a tool turn without its signed reasoning, and checks every
    request's SigV4 signature)."""
    caplog.set_level(logging.DEBUG)
    notes = tmp_path / f"notes-{CANARY}.txt"
    notes.write_text(f"the launch code is {CANARY}\n")
    bedrock_upstream.script(
        FakeResponse(
            text="",
            thinking=f"I should read the file {CANARY}.",
            tool_calls=[("Read", json.dumps({"file_path": str(notes)}))],
        ),
        FakeResponse(text="The file holds a launch code.", thinking=f"Done {CANARY}."),
    )
    cfg = parse_config(
        {
            "routes": {"claude": bedrock_route(bedrock_upstream)},
            "gateway": {"models": {"claude-*": "pipeline"}},
            "layers": {"telemetry": True, "logging": True},
        }
    )
    async with running(cfg, **otel.providers) as gateway:
        result = await ask(claude, gateway, tmp_path, f"What is in the notes file? {CANARY}")
        await gateway.gateway.wait_idle()
    assert result["is_error"] is False, result
    assert result["result"] == "The file holds a launch code."
    assert bedrock_upstream.count() == 2 and bedrock_upstream.verified_signatures == 2
    first, second = (r.json for r in bedrock_upstream.requests)
    assert "thinking" in first["additionalModelRequestFields"]
    assert any("cachePoint" in block for block in first["system"])
    assistant = [m for m in second["messages"] if m["role"] == "assistant"][-1]
    reasoning = assistant["content"][0]["reasoningContent"]["reasoningText"]
    assert reasoning["signature"] == bedrock_upstream.reasoning_signature(reasoning["text"])
    results = [b["toolResult"] for b in second["messages"][-1]["content"] if "toolResult" in b]
    assert CANARY in json.dumps(results)  # Claude Code read the file and sent it
    assert result["usage"]["cache_read_input_tokens"] > 0
    assert_never_recorded([CANARY, reasoning["signature"]], caplog, otel)


async def test_failover_from_a_bedrock_route_is_invisible(
    claude: Path,
    bedrock_upstream: FakeBedrockServer,
    openai_upstream: FakeOpenAIServer,
    otel: Otel,
    tmp_path: Path,
) -> None:
    bedrock_upstream.script(FakeResponse.error(429, type="ThrottlingException", retry_after="30"))
    openai_upstream.script(FakeResponse(text="Served by the backup."))
    cfg = parse_config(
        {
            "routes": {
                "claude": bedrock_route(bedrock_upstream),
                "backup": {
                    "provider": "openai",
                    "model": "model-backup",
                    "base_url": openai_upstream.base_url,
                },
            },
            "router": {"kind": "ordered", "order": ["claude", "backup"]},
            "gateway": {"models": {"claude-*": "pipeline"}},
        }
    )
    async with running(cfg, **otel.providers) as gateway:
        result = await ask(claude, gateway, tmp_path, "Say hello")
        await gateway.gateway.wait_idle()
    assert result["is_error"] is False, result
    assert result["result"] == "Served by the backup."
    assert (bedrock_upstream.count(), openai_upstream.count()) == (1, 1)


# -- keys, budgets and rate limits -----------------------------------------------------------


async def governed(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch, upstream: FakeOpenAIServer
) -> tuple[Any, Any]:
    """A gateway configuration with virtual keys and budgets, and its key store."""
    from pipeline.keys import SQLiteKeyStore

    monkeypatch.setenv("CLAUDE_CODE_TEST_UPSTREAM_KEY", "upstream-key")
    monkeypatch.setenv("CLAUDE_CODE_TEST_REDIS", redis_url)
    data = {
        "routes": {
            "primary": {
                "provider": "openai",
                "model": "model-primary",
                "base_url": upstream.base_url,
                "api_key_env": "CLAUDE_CODE_TEST_UPSTREAM_KEY",
                "price": {"input_per_million": 1.0, "output_per_million": 1.0},
            }
        },
        "gateway": {"models": {"claude-*": "pipeline"}},
        "layers": {"telemetry": True},
        "spend": {"path": str(tmp_path / "ledger.db")},
        "keys": {"refresh_interval": 0.1},
        "budgets": {
            "redis_url_env": "CLAUDE_CODE_TEST_REDIS",
            "namespace": f"cc-{uuid.uuid4().hex[:8]}",
        },
    }
    return parse_config(data), SQLiteKeyStore(tmp_path / "ledger.db")


async def test_a_spent_budget_stops_claude_code_after_one_request(
    claude: Path,
    openai_upstream: FakeOpenAIServer,
    otel: Otel,
    tmp_path: Path,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pipeline.keys import Budget

    cfg, store = await governed(tmp_path, redis_url, monkeypatch, openai_upstream)
    issued = await store.create("agent", budget=Budget("0"))
    async with running(cfg, **otel.providers) as gateway:
        async with asyncio.timeout(GIVE_UP_BOUND):
            result = await ask(claude, gateway, tmp_path, "Say hello", api_key=issued.secret)
        await gateway.gateway.wait_idle()
    await store.aclose()
    assert result["is_error"] is True, result
    assert "budget_exceeded" in json.dumps(result)
    # One request, refused with the 402 (no retry loop), and no provider call.
    posts = [s for s in server_spans(otel) if s.name == "POST /v1/messages"]
    assert [dict(s.attributes or {}).get("http.response.status_code") for s in posts] == [402]
    assert openai_upstream.count() == 0


async def test_a_rate_limited_claude_code_waits_and_goes_on(
    claude: Path,
    openai_upstream: FakeOpenAIServer,
    otel: Otel,
    tmp_path: Path,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import httpx

    cfg, store = await governed(tmp_path, redis_url, monkeypatch, openai_upstream)
    # One every 5 s: the limit is still reached when Claude Code, a second later, starts.
    issued = await store.create("agent", rpm=12)
    openai_upstream.script(*[FakeResponse(text="Hello!")] * 10)
    async with running(cfg, **otel.providers) as gateway:
        # The key's burst used up: Claude Code's first request is refused with 429 and
        # retry-after, which it waits out before asking again.
        async with httpx.AsyncClient(base_url=gateway.url) as client:
            body = {
                "model": "claude-x",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "x"}],
            }
            headers = {"x-api-key": issued.secret, "anthropic-version": "2023-06-01"}
            while (
                await client.post("/v1/messages", json=body, headers=headers)
            ).status_code == 200:
                pass
        async with asyncio.timeout(GIVE_UP_BOUND):
            result = await ask(claude, gateway, tmp_path, "Say hello", api_key=issued.secret)
        await gateway.gateway.wait_idle()
    await store.aclose()
    assert result["is_error"] is False, result
    statuses = [
        dict(s.attributes or {}).get("http.response.status_code")
        for s in server_spans(otel)
        if s.name == "POST /v1/messages"
    ]
    assert statuses.count(429) >= 2 and statuses[-1] == 200  # ours, then Claude Code's
