"""Every Python block of README.md and docs/ runs; every TOML block goes through the loader.

How blocks are found and which run where: `tests.docs_examples`. Blocks that show a real
provider run unchanged against the fakes: an autouse fixture starts `FakeOpenAIServer`,
`FakeAnthropicServer` and `FakeGeminiServer` on 127.0.0.1 (in a thread of their own, so a
block's own ``asyncio.run`` reaches them too), makes them the providers' default endpoints
(the OpenAI-compatible vendors' too) and sets the API key variables to keys of no value.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import io
import json
import os
import re
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.docs_examples import ROOT, Block, blocks, pages, python_blocks

_PAGES = [page for page in pages() if python_blocks(page)]
_TOML_BLOCKS = [block for page in pages() for block in blocks(page) if block.lang == "toml"]


class _Servers:
    """The fake servers, served by an event loop on a thread of its own."""

    def __init__(self) -> None:
        from pipeline.testing import FakeAnthropicServer, FakeGeminiServer, FakeOpenAIServer

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.openai = FakeOpenAIServer()
        self.anthropic = FakeAnthropicServer()
        self.gemini = FakeGeminiServer()

    def __enter__(self) -> _Servers:
        self.thread.start()
        for server in (self.openai, self.anthropic, self.gemini):
            asyncio.run_coroutine_threadsafe(server.start(), self.loop).result(timeout=30)
        return self

    def __exit__(self, *_: object) -> None:
        for server in (self.openai, self.anthropic, self.gemini):
            asyncio.run_coroutine_threadsafe(server.stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


@pytest.fixture(scope="module")
def servers() -> Iterator[_Servers]:
    with _Servers() as running:
        yield running


@pytest.fixture(autouse=True)
def _providers_use_the_fakes(servers: _Servers, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    import pipeline.providers
    from pipeline.providers._vendors import VENDORS
    from pipeline.providers.openai import OpenAIAPIClient
    from pipeline.providers.vendors import VENDOR_CLIENTS

    keys = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AZURE_OPENAI_API_KEY", "GEMINI_API_KEY")
    for variable in keys:
        monkeypatch.setenv(variable, "sk-docs-example")
    for name, vendor in VENDORS.items():
        monkeypatch.setenv(vendor.key_variable, "sk-docs-example")
        faked = dataclasses.replace(vendor, base_url=servers.openai.base_url)
        monkeypatch.setattr(VENDOR_CLIENTS[name], "vendor", faked)
    fakes = {
        "https://api.openai.com/v1": servers.openai.base_url,
        "https://api.anthropic.com": servers.anthropic.base_url,
        "https://generativelanguage.googleapis.com/v1beta": servers.gemini.base_url,
    }
    classes = [
        OpenAIAPIClient,
        *(getattr(pipeline.providers, n) for n in pipeline.providers.__all__),
    ]
    for cls in classes:
        defaults = dict(getattr(cls.__init__, "__kwdefaults__", None) or {})
        if defaults.get("base_url") in fakes:
            defaults["base_url"] = fakes[defaults["base_url"]]
            monkeypatch.setattr(cls.__init__, "__kwdefaults__", defaults)
    monkeypatch.chdir(ROOT)  # examples name files relative to the repository


def prelude() -> dict[str, Any]:
    """What a page's namespace starts with: the clients the fragments name (each a
    `ScriptedChatClient` that answers every call), as the pages' notes say."""
    from pipeline.testing import ScriptedChatClient, reply

    def client(name: str) -> ScriptedChatClient:
        return ScriptedChatClient(reply(f"Answer from {name}."), name=name)

    names = ("primary", "backup", "east", "west", "central", "small", "large", "general")
    names += ("primary_client", "backup_client")
    return {"__name__": "__docs_example__", **{name: client(name) for name in names}}


def run_block(block: Block, namespace: dict[str, Any], loop: asyncio.AbstractEventLoop) -> None:
    """Run `block` in `namespace`; top-level ``await`` runs on `loop`. When the block has
    ``#>`` comments, what it prints must be those lines, in order (as pytest-examples
    checks printed output)."""
    code = compile(
        block.source, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = eval(code, namespace)  # the docs' own examples
        if inspect.iscoroutine(result):
            loop.run_until_complete(result)
    expected = [
        line.strip().removeprefix("#>").strip()
        for line in block.source.splitlines()
        if line.strip().startswith("#>")
    ]
    if expected:
        assert printed.getvalue().splitlines() == expected, block.where


@pytest.mark.parametrize("page", _PAGES, ids=[str(p.relative_to(ROOT)) for p in _PAGES])
def test_python_blocks_run(page: Path, capsys: pytest.CaptureFixture[str]) -> None:
    namespace = prelude()
    loop = asyncio.new_event_loop()
    try:
        for block in python_blocks(page):
            try:
                run_block(block, namespace, loop)
            except BaseException as exc:
                raise AssertionError(f"{block.where} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def test_skipped_blocks_say_why() -> None:
    """A block shown but not run has its reason in the paragraph right after it, or in a
    comment that opens it (``# Skipped: ...``)."""
    for page in pages():
        text = page.read_text().splitlines()
        for block in blocks(page):
            if block.attrs.get("test") != "skip":
                continue
            end = block.line + len(block.source.splitlines())
            after = " ".join(text[end : end + 4])
            if block.source.lstrip().lower().startswith(("# skipped", "# not run")):
                continue
            assert "skip" in after.lower() or "not run" in after.lower(), block.where


def _config_like(block: Block) -> bool:
    data = tomllib.loads(block.source)
    return bool({"routes", "router", "gateway", "layers", "groups"} & set(data))


@pytest.mark.parametrize("block", _TOML_BLOCKS, ids=[block.where for block in _TOML_BLOCKS] or None)
def test_toml_blocks_parse_and_configurations_load(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every TOML block is TOML; one that is a pipeline's file (or a part of one) loads,
    completed with what it leaves to the rest of its page (routes it names, variables)."""
    from pipeline.config import load_config

    data = tomllib.loads(block.source)
    if "deployments" in data:  # a FakeFleet scenario (chat-pipeline fake-fleet --scenario)
        from pipeline.testing import FakeFleet

        FakeFleet.from_scenario(data)
        return
    if not _config_like(block):
        return  # another file's TOML (a pyproject table, say): parsing it is the check
    # Every variable the block names (`*_env = "NAME"`), as the page's reader would set it.
    named_variables = set(re.findall(r'_env\s*=\s*"([A-Za-z_][A-Za-z0-9_]*)"', block.source))
    # And the keys of the OpenAI-compatible vendors' presets (`provider = "groq"`).
    from pipeline.providers._vendors import VENDORS

    named_variables |= {vendor.key_variable for vendor in VENDORS.values()}
    for variable in {"GATEWAY_API_KEYS", "GATEWAY_REDIS_URL", "OPENAI_API_KEY"} | named_variables:
        monkeypatch.setenv(variable, "redis://127.0.0.1:1/0" if "REDIS" in variable else "k")
    text = block.source
    named = _route_names(data)
    defined = set(data.get("routes", {})) | set(data.get("groups", {}))
    for group in data.get("groups", {}).values():
        named |= set(group.get("routes", []))
    for name in sorted(named - defined - set(data.get("routes", {}))):
        text += f'\n[routes.{_key(name)}]\nprovider = "scripted"\n'
    if "routes" not in data and not named:
        text += '\n[routes.only]\nprovider = "scripted"\n'
    if 'provider = "vertex"' in text:
        # Application Default Credentials, as the page's reader would have them set.
        from pipeline.testing import FakeGoogleTokenServer

        with FakeGoogleTokenServer() as tokens:
            key = tmp_path / "service-account.json"
            key.write_text(json.dumps(tokens.service_account_info()))
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    path = tmp_path / "pipeline.toml"
    path.write_text(text)
    load_config(path)


def _key(name: str) -> str:
    return name if name.replace("-", "").replace("_", "").isalnum() else f'"{name}"'


def _route_names(data: dict[str, Any]) -> set[str]:
    router = data.get("router", {})
    names: set[str] = set(router.get("order", [])) | set(router.get("routes", []))
    if "default" in router:
        names.add(router["default"])
    for source, targets in router.get("fallback", {}).items():
        names |= {source, *targets}
    names |= set(router.get("kinds", {}).values()) | set(router.get("profiles", {}))
    names |= {v for v in data.get("gateway", {}).get("models", {}).values() if v != "pipeline"}
    return names


def test_every_page_with_python_is_collected() -> None:
    assert _PAGES, "no page with a Python block was found"
    assert any(page.name == "README.md" for page in _PAGES)
    assert os.path.isdir(ROOT / "docs")


def _offline_commands() -> list[tuple[str, str]]:
    """The docs' `chat-pipeline demo`, `ask` and `eval` command lines that need nothing but
    the checkout (no ``--otlp`` backend), as ``(where, command)``."""
    found = []
    for page in pages():
        for block in blocks(page):
            if block.lang != "bash":
                continue
            for line in block.source.replace("\\\n", " ").splitlines():
                command = line.split("&&")[-1].strip()
                words = command.split()
                runs_offline = len(words) > 1 and words[1] in ("demo", "ask", "eval")
                if runs_offline and words[0].endswith("chat-pipeline") and "--otlp" not in words:
                    found.append((block.where, command))
    return found


@pytest.mark.parametrize(("where", "command"), _offline_commands())
def test_offline_cli_commands_run_as_written(where: str, command: str) -> None:
    import shlex
    import subprocess
    import sys

    argv = [sys.executable, "-m", "pipeline", *shlex.split(command)[1:]]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{where}: {command}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    assert done.stdout.strip(), where


_PYTEST_BLOCKS = [b for page in pages() for b in python_blocks(page, test="pytest")]


@pytest.mark.parametrize("block", _PYTEST_BLOCKS, ids=[b.where for b in _PYTEST_BLOCKS])
def test_pytest_blocks_pass_as_a_users_suite(block: Block, tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text('pytest_plugins = ["pipeline.testing.pytest_plugin"]\n')
    (tmp_path / "test_example.py").write_text(block.source)
    options = ["-q", "-p", "no:cacheprovider", "-p", "no:phoenix", "-o", "asyncio_mode=auto"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *options, str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{block.where}\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
    assert " passed" in done.stdout
