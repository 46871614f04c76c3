"""The child processes the test suites start, and what they need to start.

One harness, `ChildProcess`, runs every server a suite starts (redis-server, Prometheus,
Arize Phoenix, the LiteLLM proxy, llama-cpp-python's server, ``chat-pipeline serve``,
``chat-pipeline fake-server`` and the chaos fault server): it starts the child, keeps its
merged output (always read, so a full pipe never stalls the child), waits for a readiness
line under a deadline, and stops it with SIGTERM, then SIGKILL, each wait
bounded. A child that exits or misses its deadline raises `StartError` with the end of its
output: a suite whose server cannot start fails loudly, never skips.

Ports: a child binds port 0 and reports the port it got (`ChildProcess.wait_for_port`), so
no port is picked here and handed over while another process could take it. redis-server
cannot (its ``--port 0`` means "no TCP listener at all"): for it, and only for it,
`free_port` picks a port, and `tests.redis_server` starts again on a new one when the
child reports the address in use.

`require_module` and `require_binary` fail a suite whose packages or programs are missing,
saying how to install them. Nothing here needs pytest until a suite fails: the benchmarks
start their servers with the same pieces.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

INSTALL_HINT = "run ./scripts/test, which installs everything the suites need"

# The line uvicorn logs once it listens, with the port it got (also for port 0).
UVICORN_PORT = re.compile(r"Uvicorn running on https?://\S+:(\d+)")


def serve_argv(config: Path, *args: str) -> list[str]:
    """The command line of ``chat-pipeline serve`` for `config` on 127.0.0.1, port 0 (it
    logs the port it got: `UVICORN_PORT`, at log level ``info``), with `args`."""
    argv = [sys.executable, "-m", "pipeline", "serve", "--config", str(config), "--port", "0"]
    return [*argv, *args]


def uvicorn_log_config(path: Path) -> Path:
    """A uvicorn logging configuration, written to `path` (JSON), that keeps uvicorn's
    startup lines (the port it got) and leaves its access log out, for a server that would
    otherwise log errors only: the LiteLLM proxy takes uvicorn's level from ``LITELLM_LOG``
    unless it is given a configuration (``--log_config``)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["uvicorn.error"]["level"] = "INFO"
    config["loggers"]["uvicorn.access"]["level"] = "WARNING"
    path.write_text(json.dumps(config))
    return path


class StartError(RuntimeError):
    """A child process did not start (its output's last lines are in the message)."""


def require_module(module: str, *, what: str, extra: str) -> None:
    """Fail the test (never skip) when `module`, from the project's `extra`, is missing.

    Give a top-level name where importing its package has side effects (litellm starts
    network fetches when imported): finding a submodule imports its parent package.
    """
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing too
        found = False
    if not found:
        import pytest

        pytest.fail(
            f"{what} is not installed (no module {module!r}): {INSTALL_HINT}, "
            f"or pip install -e '.[{extra}]'",
            pytrace=False,
        )


def require_binary(name: str, *, package: str | None = None, marker: str) -> str:
    """The path of the program `name` (also looked for in /usr/sbin, where Debian puts
    nginx); fails the test (never skips) when it is missing."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")
    if found is None:
        import pytest

        pytest.fail(
            f"{name} is not installed: {INSTALL_HINT} (as root on Debian), or apt-get "
            f"install {package or name}; or deselect its tests with -m 'not {marker}'",
            pytrace=False,
        )
    return found


def run_python(script: str, *args: str, timeout: float = 60) -> str:
    """What `script` prints, run by this Python in a process of its own from the project's
    root (so `tests` imports): for what a process allows once, as setting a global
    OpenTelemetry provider. Fails with its error output unless it exits 0."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).resolve().parents[1],
    )
    if done.returncode != 0:
        raise AssertionError(f"the script exited {done.returncode}: {done.stderr[-3000:]}")
    return done.stdout.strip()


def free_port() -> int:
    """A loopback port free at this moment, for a server that cannot bind port 0 and report
    what it got (redis-server). Another process may take it before the server binds it: the
    caller must start the server again on a new port when it reports the address in use."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ChildProcess:
    """A child process whose merged stdout and stderr are read line by line into `lines`.

    With `own_group`, the child leads a process group of its own and signals go to the
    whole group (servers that fork workers). Use it as a context manager, or call `stop`.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        own_group: bool = False,
    ) -> None:
        self.name = name
        self.lines: list[str] = []
        self._own_group = own_group
        self._changed = threading.Condition()
        self._output_ended = False
        self.process = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=own_group,
        )
        self._reader = threading.Thread(target=self._read, name=f"{name} output", daemon=True)
        self._reader.start()

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._output_ended = True
            self._changed.notify_all()

    def output(self) -> str:
        """Everything the child wrote so far."""
        with self._changed:
            return "".join(self.lines)

    def log_tail(self, count: int = 40) -> str:
        with self._changed:
            return "".join(self.lines[-count:])

    def _failure(self, why: str) -> StartError:
        return StartError(
            f"{self.name} did not start ({why}). Its output ends with:\n{self.log_tail()}"
        )

    def _exited(self) -> str | None:
        status = self.process.poll()
        return None if status is None else f"it exited with status {status}"

    def wait_for_line(
        self, pattern: str | re.Pattern[str], timeout: float, *, count: int = 1
    ) -> re.Match[str]:
        """The match of the `count`-th output line matching `pattern` (a regular expression
        or a literal string), waited for at most `timeout` seconds; `StartError` if the
        child exits or the time runs out first."""
        regex = re.compile(re.escape(pattern)) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        seen = found = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    match = regex.search(line)
                    if match is not None:
                        found += 1
                        if found == count:
                            return match
                seen = len(self.lines)
                exited = self._exited()
                if self._output_ended or exited is not None:
                    # Its last lines may still be on their way: read them before failing.
                    self._changed.wait_for(lambda: self._output_ended, timeout=1)
                    if len(self.lines) > seen and time.monotonic() < deadline:
                        continue
                    # A child that closed its output is about to exit: tell its status.
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.process.wait(timeout=1)
                    raise self._failure(self._exited() or "it closed its output")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._failure(f"no line matching {regex.pattern!r} within {timeout:g} s")
                # Woken by every new line; at least once a second to notice an exit of a
                # child whose workers keep its output open.
                self._changed.wait(min(left, 1.0))

    def line(self, index: int, timeout: float) -> str:
        """Output line `index` (from 0), waited for at most `timeout` seconds: for a reader
        that keeps its place in a long output; `StartError` if the child closes its output
        or the time runs out first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self.lines) <= index:
                left = deadline - time.monotonic()
                if self._output_ended or left <= 0:
                    raise self._failure(f"no output line {index} within {timeout:g} s")
                self._changed.wait(min(left, 1.0))
            return self.lines[index]

    def wait_for_port(self, pattern: re.Pattern[str], timeout: float) -> int:
        """The port the child reports in the first line matching `pattern` (its first
        group), waited for like `wait_for_line`."""
        return int(self.wait_for_line(pattern, timeout).group(1))

    def send_signal(self, sig: int) -> None:
        """Send `sig` to the child (to its whole group with `own_group`), unless it ended."""
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if self._own_group:
                os.killpg(self.process.pid, sig)
            else:
                self.process.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Send `sig` (SIGTERM by default), wait at most `timeout` seconds, then SIGKILL and
        wait again (bounded); the child's exit status."""
        if self.process.poll() is None:
            self.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.send_signal(signal.SIGKILL)
                self.process.wait(timeout=10)
        self._reader.join(timeout=10)
        return self.process.returncode
