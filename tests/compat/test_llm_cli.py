"""simonw's ``llm`` CLI (PyPI ``llm``, the compat extra) against the gateway, configured as
its users do: a model in ``extra-openai-models.yaml`` with the gateway's ``api_base`` and a
key in ``keys.json``, under a fresh ``LLM_USER_PATH``.

Client (``llm -m gateway``, a subprocess) -> gateway (in this test's event loop) -> fake
upstreams.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pipeline.testing import FakeOpenAIServer, FakeResponse
from tests.pipeline.gateway.conftest import Running, config, running
from tests.processes import require_module

pytestmark = pytest.mark.compat

RUN_TIMEOUT = 60.0


@pytest.fixture
async def upstream() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server


@pytest.fixture
async def backup() -> AsyncIterator[FakeOpenAIServer]:
    async with FakeOpenAIServer() as server:
        yield server


def llm_home(home: Path, gateway: Running) -> None:
    """An ``LLM_USER_PATH`` with the gateway as its one extra model, and its key."""
    home.mkdir(exist_ok=True)
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: gateway\n  model_name: pipeline\n  api_base: {gateway.base_url}\n"
        "  api_key_name: gateway\n"
    )
    (home / "keys.json").write_text(json.dumps({"gateway": "test-key"}))


async def run_llm(gateway: Running, home: Path, *arguments: str) -> tuple[int, str, str]:
    """``llm -m gateway ARGUMENTS`` with the gateway as its one extra model: exit code,
    standard output and standard error."""
    require_module("llm", what="simonw's llm CLI", extra="compat")
    llm_home(home, gateway)
    executable = Path(sys.executable).parent / "llm"
    process = await asyncio.create_subprocess_exec(
        str(executable),
        "-m",
        "gateway",
        *arguments,
        env={**os.environ, "LLM_USER_PATH": str(home)},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(RUN_TIMEOUT):
            out, err = await process.communicate()
    except TimeoutError:
        pytest.fail(f"llm did not finish in {RUN_TIMEOUT:.0f} s")
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_answers_streamed_and_whole(upstream: FakeOpenAIServer, tmp_path: Path) -> None:
    upstream.script(
        FakeResponse(chunks=["Hello ", "from ", "the ", "gateway."]),
        FakeResponse(text="Hello, whole."),
    )
    async with running(config({"primary": upstream})) as gateway:
        streamed = await run_llm(gateway, tmp_path / "home", "Say hello")
        whole = await run_llm(gateway, tmp_path / "home", "--no-stream", "Say hello")
    assert streamed[:2] == (0, "Hello from the gateway.\n")
    assert whole[:2] == (0, "Hello, whole.\n")
    assert upstream.requests[0].json["stream"] is True
    assert upstream.requests[1].json.get("stream") in (None, False)


async def test_every_route_down_ends_after_one_request(
    upstream: FakeOpenAIServer, backup: FakeOpenAIServer, tmp_path: Path
) -> None:
    """The gateway says a retry cannot help (``x-should-retry: false``): ``llm`` (the
    official openai SDK beneath it) sends one request and shows the error."""
    down = FakeResponse.error(500)
    upstream.script(*[down] * 10)
    backup.script(*[down] * 10)
    async with running(config({"primary": upstream, "backup": backup})) as gateway:
        returncode, _, err = await run_llm(gateway, tmp_path / "home", "Say hello")
    assert returncode != 0
    assert "unavailable" in err  # the gateway's message, shown
    assert (upstream.count(), backup.count()) == (1, 1)
