"""opencode (npm ``opencode-ai``, pinned in ``tests/compat/opencode``) against the gateway,
non-interactively: ``opencode run --format json``, configured as its docs say for an
OpenAI-compatible endpoint: a project ``opencode.json`` with one provider
(``@ai-sdk/openai-compatible``, the gateway's base URL and a key) and its model.

Client (opencode, its native binary) -> gateway (in this test's event loop) -> fake
upstream (Chat Completions).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.compat.node import OPENCODE_CACHE, opencode
from tests.pipeline.gateway.conftest import Running, config, running

pytestmark = pytest.mark.compat

RUN_TIMEOUT = 180.0


@pytest.fixture(scope="module")
def opencode_bin() -> Path:
    return opencode()


@pytest.fixture
async def upstream() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server


def project(work: Path, gateway: Running) -> dict[str, str]:
    """A project directory whose ``opencode.json`` names the gateway, and the environment
    opencode runs in (a fresh home; its caches kept between runs)."""
    work.mkdir(exist_ok=True)
    (work / "home").mkdir(exist_ok=True)
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "chat-pipeline",
        "options": {"baseURL": gateway.base_url, "apiKey": "test-key"},
        "models": {"pipeline": {"name": "pipeline"}},
    }
    settings = {"provider": {"gateway": provider}, "model": "gateway/pipeline"}
    (work / "opencode.json").write_text(json.dumps(settings))
    OPENCODE_CACHE.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(work / "home"),
        "XDG_CACHE_HOME": str(OPENCODE_CACHE),
        "npm_config_cache": str(OPENCODE_CACHE / "npm"),
    }


async def run_opencode(
    opencode_bin: Path, gateway: Running, work: Path, prompt: str
) -> tuple[int, list[dict[str, Any]]]:
    """``opencode run --format json PROMPT``: its exit code and JSON events."""
    env = project(work, gateway)
    process = await asyncio.create_subprocess_exec(
        str(opencode_bin),
        "run",
        "--format",
        "json",
        prompt,
        cwd=work,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(RUN_TIMEOUT):
            out, _ = await process.communicate()
    except TimeoutError:
        pytest.fail(f"opencode did not finish in {RUN_TIMEOUT:.0f} s")
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    events = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    return process.returncode, events


async def test_answers(opencode_bin: Path, upstream: FakeOpenAIServer, tmp_path: Path) -> None:
    upstream.default = FakeResponse(text="Hello from the gateway.")
    async with running(config({"primary": upstream})) as gateway:
        returncode, events = await run_opencode(opencode_bin, gateway, tmp_path, "Say hello")
    assert returncode == 0, events
    texts = [e["part"]["text"] for e in events if e.get("type") == "text"]
    assert texts == ["Hello from the gateway."]
    # Its answer, and a title for the session: both through the gateway's Chat Completions.
    assert upstream.count() >= 1
    assert all(r.json["model"] == "model-primary" for r in upstream.requests)
