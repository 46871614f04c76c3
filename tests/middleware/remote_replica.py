"""Drive a replica process (``python -m tests.middleware.<x>_replica ...``) over its stdin
and stdout: one command a line, one answer a line, every wait bounded. (Servers the suites
start go through `tests.processes`; a replica is a dialogue, driven from the test's event
loop.)"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


class Remote:
    """A replica process: `send` a command, `read` its answer (split into words)."""

    def __init__(self, process: asyncio.subprocess.Process, timeout: float) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self.stdin = process.stdin
        self.stdout = process.stdout
        self.timeout = timeout

    async def send(self, command: str) -> None:
        self.stdin.write(f"{command}\n".encode())
        await self.stdin.drain()

    async def line(self) -> str:
        """The next line the replica prints."""
        async with asyncio.timeout(self.timeout):
            line = await self.stdout.readline()
        if not line:
            raise RuntimeError(f"the replica exited ({await self.process.wait()})")
        return line.decode()

    async def read(self) -> list[str]:
        """The next answer, split into words."""
        return (await self.line()).split()

    async def read_json(self) -> Any:
        """The next answer, one line of JSON."""
        return json.loads(await self.line())

    async def ask(self, command: str) -> list[str]:
        await self.send(command)
        return await self.read()


@asynccontextmanager
async def remote(module: str, *args: str, bound: float = 120.0) -> AsyncIterator[Remote]:
    """Start ``python -m module args...``, wait for its ``ready``; on leaving, tell it to
    quit and require a clean exit (it is killed if it does not exit in time). Each answer
    and the exit are awaited for at most `bound` seconds."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    replica = Remote(process, bound)
    try:
        assert await replica.read() == ["ready"]
        yield replica
        await replica.send("quit")
        async with asyncio.timeout(bound):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
