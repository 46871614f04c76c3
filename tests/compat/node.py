"""Node clients of the compatibility suite: the Vercel AI SDK (npm packages ``ai`` and
``@ai-sdk/openai``, as ``tests/compat/ai_sdk/package.json`` pins them), Claude Code
(``@anthropic-ai/claude-code``, ``tests/compat/claude_code/package.json``), the OpenAI
Codex CLI (``@openai/codex``, ``tests/compat/codex/package.json``) and opencode
(``opencode-ai``, ``tests/compat/opencode/package.json``), installed from the npm registry
into ``.servers/ai-sdk``, ``.servers/claude-code``, ``.servers/codex`` and
``.servers/opencode`` once and reused while those files stay the same.

Node and npm are Debian's (``nodejs``, ``npm``; ``scripts/test`` installs them). A missing
tool or a failed install fails the test loudly, with npm's own words: never a skip.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).parent / "ai_sdk"
ROOT = Path(__file__).parents[2]
INSTALL_DIR = ROOT / ".servers" / "ai-sdk"
NPM_INSTALL_TIMEOUT = 600.0


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is needed for the Node clients of the compatibility suite "
            f"(the Debian package {package}; scripts/test installs it)",
            pytrace=False,
        )
    return path


def node() -> str:
    """The ``node`` executable."""
    return _tool("node", "nodejs")


def _npm_install(source: Path, install_dir: Path, what: str) -> None:
    """Install the packages `source`/package.json pins into `install_dir`, once: again only
    when that file changed."""
    package = (source / "package.json").read_bytes()
    wanted = hashlib.sha256(package).hexdigest()
    stamp = install_dir / ".installed"
    installed = stamp.read_text() if stamp.exists() else ""
    if installed == wanted and (install_dir / "node_modules").is_dir():
        return
    npm = _tool("npm", "npm")
    node()
    install_dir.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    (install_dir / "package.json").write_bytes(package)
    command = [npm, "install", "--no-audit", "--no-fund", "--loglevel=error"]
    try:
        done = subprocess.run(
            command,
            cwd=install_dir,
            capture_output=True,
            text=True,
            timeout=NPM_INSTALL_TIMEOUT,
            env={**os.environ, "npm_config_update_notifier": "false"},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"npm install did not finish in {NPM_INSTALL_TIMEOUT:.0f} s", pytrace=False)
    if done.returncode != 0:
        output = (done.stdout + done.stderr)[-4000:]
        pytest.fail(
            f"npm install of {what} failed (exit {done.returncode}):\n{output}", pytrace=False
        )
    stamp.write_text(wanted)


def ai_sdk() -> Path:
    """The directory holding the installed Vercel AI SDK and the scripts that use it
    (copied from ``tests/compat/ai_sdk``: Node resolves packages from a script's own
    directory)."""
    _npm_install(SOURCE, INSTALL_DIR, "the Vercel AI SDK")
    for script in SOURCE.glob("*.mjs"):
        shutil.copyfile(script, INSTALL_DIR / script.name)
    return INSTALL_DIR


CLAUDE_CODE_SOURCE = Path(__file__).parent / "claude_code"
CLAUDE_CODE_DIR = ROOT / ".servers" / "claude-code"


def claude_code() -> Path:
    """The ``claude`` executable of the pinned Claude Code, installed when missing."""
    _npm_install(CLAUDE_CODE_SOURCE, CLAUDE_CODE_DIR, "Claude Code")
    executable = CLAUDE_CODE_DIR / "node_modules" / ".bin" / "claude"
    if not executable.exists():
        pytest.fail(
            "npm installed Claude Code without its `claude` executable (no native binary "
            "for this platform?)",
            pytrace=False,
        )
    return executable


CODEX_SOURCE = Path(__file__).parent / "codex"
CODEX_DIR = ROOT / ".servers" / "codex"


def codex() -> Path:
    """The OpenAI Codex CLI's executable (npm ``@openai/codex``, the version
    ``tests/compat/codex/package.json`` pins; the package ships its native binary),
    installed into ``.servers/codex`` once."""
    _npm_install(CODEX_SOURCE, CODEX_DIR, "the Codex CLI")
    executable = CODEX_DIR / "node_modules" / ".bin" / "codex"
    if not executable.exists():
        pytest.fail(f"the Codex CLI install has no {executable.name} executable", pytrace=False)
    return executable


OPENCODE_SOURCE = Path(__file__).parent / "opencode"
OPENCODE_DIR = ROOT / ".servers" / "opencode"


def opencode() -> Path:
    """The ``opencode`` executable of the pinned opencode (its package ships the native
    binary), installed into ``.servers/opencode`` once. At its first run it installs the
    provider package a configuration names (``@ai-sdk/openai-compatible``) from the npm
    registry into its cache (`OPENCODE_CACHE`, kept between runs)."""
    _npm_install(OPENCODE_SOURCE, OPENCODE_DIR, "opencode")
    executable = OPENCODE_DIR / "node_modules" / ".bin" / "opencode"
    if not executable.exists():
        pytest.fail(f"the opencode install has no {executable.name} executable", pytrace=False)
    return executable


OPENCODE_CACHE = OPENCODE_DIR / "cache"
"""opencode's cache (``XDG_CACHE_HOME``) and npm's, kept between runs."""
