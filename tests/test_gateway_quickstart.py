"""The gateway quick start runs as written: its `serve` command (on a free port), its
``curl``, and every Python block marked ``test="gateway-quickstart"`` (the quick start's
SDK calls, and the gateway pages' SDK examples) against that server.

The only change made to what the page says is the port: the server binds port 0 and the
commands and blocks get the port it reports instead of 8080.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs_examples import ROOT, blocks, pages, python_blocks
from tests.processes import UVICORN_PORT, ChildProcess, require_module

pytestmark = pytest.mark.gateway

PAGE = ROOT / "docs" / "getting-started" / "gateway-quickstart.md"
DOCUMENTED_PORT = "8080"


def _commands(keyword: str) -> list[str]:
    found = []
    for block in blocks(PAGE):
        if block.lang == "bash":
            found += [line for line in block.source.splitlines() if keyword in line]
    assert found, f"the quick start has no {keyword} command"
    return found


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    require_module("uvicorn", what="the gateway", extra="gateway")
    (command,) = _commands("chat-pipeline serve")
    argv = shlex.split(command)
    assert argv[0] == ".venv/bin/chat-pipeline", "the quick start runs the venv's command"
    argv = [sys.executable, "-m", "pipeline", *argv[1:], "--port", "0"]
    with ChildProcess("chat-pipeline serve (quick start)", argv, cwd=ROOT) as server:
        port = server.wait_for_port(UVICORN_PORT, timeout=60)
        server.wait_for_line("Application startup complete", timeout=60)
        yield port


def test_the_install_command_names_an_extra_that_exists() -> None:
    (command,) = _commands("pip install")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert "'.[gateway]'" in command and "gateway" in extras


def test_curl_as_written(port: int) -> None:
    (command,) = _commands("curl ")
    assert f"127.0.0.1:{DOCUMENTED_PORT}" in command
    done = subprocess.run(
        ["bash", "-c", command.replace(f":{DOCUMENTED_PORT}", f":{port}")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    answer = json.loads(done.stdout)
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"] == "Hello from the primary route."


def test_sdk_call_as_written(port: int) -> None:
    (block,) = python_blocks(PAGE, test="gateway-quickstart")
    printed = _run(block.source, port)
    assert printed.splitlines() == ["Hello from the primary route.", "Hello from the backup route."]


@pytest.mark.parametrize(
    "page",
    [p for p in pages() if p != PAGE and python_blocks(p, test="gateway-quickstart")],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_gateway_pages_sdk_examples_run_against_the_quick_start(page: Path, port: int) -> None:
    for block in python_blocks(page, test="gateway-quickstart"):
        assert DOCUMENTED_PORT in block.source, block.where
        _run(block.source, port)


def _run(source: str, port: int) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(  # the docs' own example
            compile(source.replace(DOCUMENTED_PORT, str(port)), "<quick start>", "exec"),
            {"__name__": "__docs_example__"},
        )
    return out.getvalue()


def test_the_readme_serves_the_same_file() -> None:
    (command,) = _commands("chat-pipeline serve")
    assert command in (ROOT / "README.md").read_text()
