"""Start a real redis-server on a free loopback port, for a test session or one test.

`RedisServer` can also pause the server (SIGSTOP: it keeps its socket but answers nothing,
like a server stuck in a long fork or a swap storm), resume it, stop it, and start it
again on the same port, so tests can show what clients do when Redis is slow or gone.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One redis-server process on 127.0.0.1:`port` (no persistence)."""

    def __init__(self, port: int | None = None, timeout: float = 20.0) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.timeout = timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.paused = False
        self.started = False
        self.log = ""

    def start(self) -> None:
        """Start the server and wait for its readiness line. A port taken meanwhile by
        another program is replaced by a new free one (twice at most), unless this server
        was started before (a restart keeps its port)."""
        for tries_left in (2, 1, 0):
            if self._start_once():
                self.started = True
                return
            if self.started or tries_left == 0:
                raise RuntimeError(f"redis-server did not start:\n{self.log}")
            self.port = free_port()
            self.url = f"redis://127.0.0.1:{self.port}/0"

    def _start_once(self) -> bool:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server")
        process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.process = process
        try:
            # Readiness is read from the server's own log line, not guessed with sleeps.
            # Raw reads of the pipe: a buffered reader could hold the line while `select`
            # waits for more.
            assert process.stdout is not None
            fd = process.stdout.fileno()
            selector = selectors.DefaultSelector()
            selector.register(fd, selectors.EVENT_READ)
            deadline = time.monotonic() + self.timeout
            seen = b""
            try:
                while b"Ready to accept connections" not in seen:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RuntimeError(f"redis-server did not start:\n{seen.decode()}")
                    if selector.select(left):
                        chunk = os.read(fd, 65536)
                        if not chunk:  # it exited: most likely its port was taken
                            process.wait()
                            self.process = None
                            self.log = seen.decode(errors="replace")
                            return False
                        seen += chunk
            finally:
                selector.close()
            # Keep reading its log so a full pipe can never stall the server.
            threading.Thread(target=process.stdout.read, daemon=True).start()
        except BaseException:
            self.stop()
            raise
        return True

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
        process, self.process = self.process, None
        if process is None:
            return
        if self.paused:  # a stopped process would not handle SIGTERM until resumed
            os.kill(process.pid, signal.SIGCONT)
            self.paused = False
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


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
