"""`chat-pipeline fake-server` in a child process, for tests of commands and examples."""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tests.processes import ChildProcess

# Printed once the server listens, with the port it got.
_LISTENING = re.compile(r" server on (http://127\.0\.0\.1:\d+(?:/v1\w*)?)$")


@contextmanager
def fake_server_process(
    wire_format: str = "openai",
    stop_signal: signal.Signals = signal.SIGINT,
    extra: Sequence[str] = (),
) -> Iterator[str]:
    """Yield the base URL of a fake server running in its own process (on port 0, with the
    `extra` arguments); stop it after with `stop_signal` (it must exit 0)."""
    argv = [sys.executable, "-m", "pipeline", "fake-server", "--port", "0", *extra]
    server = ChildProcess("chat-pipeline fake-server", [*argv, "--format", wire_format])
    try:
        yield server.wait_for_line(_LISTENING, timeout=60).group(1)
    finally:
        status = server.stop(stop_signal, timeout=10)
    assert status == 0, f"the fake server exited with {status}:\n{server.log_tail()}"
