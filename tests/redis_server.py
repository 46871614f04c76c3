"""Start a real redis-server on a loopback port, for a test session or one test.

`RedisServer` can also pause the server (SIGSTOP: it keeps its socket but answers nothing,
like a server stuck in a long fork or a swap storm), resume it, stop it, and start it
again on the same port, so tests can show what clients do when Redis is slow or gone.

redis-server cannot bind port 0 and report the port it got (``--port 0`` turns its TCP
listener off), so its port comes from `free_port`; a port another program took in between
is replaced by a new one (see `RedisServer.start`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.processes import ChildProcess, StartError, free_port

__all__ = ["RedisServer", "counting_client", "free_port", "running_redis", "running_redis_server"]

# What redis-server logs before exiting when its port is taken.
_PORT_TAKEN = "Address already in use"


class RedisServer:
    """One redis-server process on 127.0.0.1:`port` (no persistence)."""

    def __init__(self, port: int | None = None, timeout: float = 20.0) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.timeout = timeout
        self.process: subprocess.Popen[str] | None = None
        self.paused = False
        self.started = False
        self.log = ""
        self._child: ChildProcess | None = None

    def start(self) -> None:
        """Start the server and wait for its readiness line. A port taken meanwhile by
        another program is replaced by a new free one (twice at most), unless this server
        was started before (a restart keeps its port)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server")
        for tries_left in (2, 1, 0):
            argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1"]
            child = ChildProcess("redis-server", [*argv, "--save", "", "--appendonly", "no"])
            try:
                child.wait_for_line("Ready to accept connections", self.timeout)
            except StartError:
                child.stop()
                self.log = child.output()
                if _PORT_TAKEN not in self.log or self.started or tries_left == 0:
                    raise
                self.port = free_port()
                self.url = f"redis://127.0.0.1:{self.port}/0"
                continue
            self._child, self.process = child, child.process
            self.started = True
            return

    def pause(self) -> None:
        """SIGSTOP: connections are still accepted by the kernel, nothing is answered."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.process is not None and self.paused:
            os.kill(self.process.pid, signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        child, self._child, self.process = self._child, None, None
        if child is None:
            return
        if self.paused:  # a stopped process would not handle SIGTERM until resumed
            child.send_signal(signal.SIGCONT)
            self.paused = False
        child.stop(timeout=10)
        self.log = child.output()


@contextmanager
def running_redis_server(timeout: float = 20.0) -> Iterator[RedisServer]:
    """A fresh redis-server; stopped (resumed first, if paused) afterwards."""
    server = RedisServer(timeout=timeout)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def running_redis(timeout: float = 20.0) -> Iterator[str]:
    """Yield the URL of a fresh redis-server; it is stopped afterwards."""
    with running_redis_server(timeout) as server:
        yield server.url


def counting_client(url: str) -> Any:
    """A real ``redis.asyncio`` client for `url` that records the commands it sends (in
    `sent`, upper-case names), to show how many round trips a component makes."""
    import redis.asyncio as redis_asyncio

    class CountingRedis(redis_asyncio.Redis):  # type: ignore[misc]
        async def execute_command(self, *args: Any, **options: Any) -> Any:
            self.sent.append(str(args[0]).upper())
            return await super().execute_command(*args, **options)

    client = CountingRedis.from_url(url)
    client.sent = []
    return client
