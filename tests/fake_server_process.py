"""`chat-pipeline fake-server` in a child process, for tests of commands and examples."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def fake_server_process(
    wire_format: str = "openai", stop_signal: signal.Signals = signal.SIGINT
) -> Iterator[str]:
    """Yield the base URL of a fake server running in its own process; stop it after with
    `stop_signal` (it must exit 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline",
            "fake-server",
            "--port",
            str(port),
            "--format",
            wire_format,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # printed once the server is listening
        base_url = f"http://127.0.0.1:{port}" + ("/v1" if wire_format == "openai" else "")
        assert line.rstrip().endswith(base_url), line
        yield base_url
    finally:
        process.send_signal(stop_signal)
        try:
            assert process.wait(timeout=10) == 0
        finally:
            if process.poll() is None:
                process.kill()
