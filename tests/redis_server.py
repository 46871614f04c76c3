"""Start a real redis-server on a free loopback port for the duration of a test session."""

from __future__ import annotations

import os
import selectors
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def running_redis(timeout: float = 20.0) -> Iterator[str]:
    """Yield the URL of a fresh redis-server; it is stopped afterwards."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server")
    port = _free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # Readiness is read from the server's own log line, not guessed with sleeps.
        assert process.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        seen = ""
        while "Ready to accept connections" not in seen:
            left = deadline - time.monotonic()
            if left <= 0 or process.poll() is not None:
                raise RuntimeError("redis-server did not start:\n" + seen[-4000:])
            if selector.select(left):
                # os.read, not readline: a buffered reader may hold the ready line already,
                # and the selector would then wait for output that never comes.
                seen += os.read(process.stdout.fileno(), 65536).decode(errors="replace")
        selector.close()
        # Keep reading its log so a full pipe can never stall the server.
        threading.Thread(target=process.stdout.read, daemon=True).start()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
