"""A bare Redis connection for the one call a governed request makes: commands written as
they come on one connection (pipelined), replies parsed by hiredis, each call bounded.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.errors import RespError

__all__ = ["Done", "RespClient", "RespError", "Script", "encode_command"]

_URL_REQUIRED = "must be a redis://, rediss:// or unix:// URL with a valid host and port"


def _arg(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        raise TypeError("a Redis argument cannot be a bool")
    if isinstance(value, int | float):
        return repr(value).encode()
    raise TypeError(f"a Redis argument must be bytes, str, int or float: {type(value).__name__}")


def encode_command(args: Sequence[Any]) -> bytes:
    """One command in the Redis protocol (an array of bulk strings)."""
    parts = [b"*%d\r\n" % len(args)]
    append = parts.append
    for value in args:
        # Strings (keys, operations) are nearly every argument: their path first.
        data = value.encode() if type(value) is str else _arg(value)
        append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class Script:
    """A Lua script run by its SHA-1 (loaded on ``NOSCRIPT``)."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()


Done = Callable[[Any, BaseException | None], None]
"""A call's callback: its reply, or the error it failed with (then the reply is None)."""


class _Connection(asyncio.Protocol):
    """One connection: replies are handed to the calls waiting, in order. A call waiting is
    a future or a `Done` callback; `deadlines` holds when each runs out of time."""

    def __init__(self) -> None:
        import hiredis

        self._reader = hiredis.Reader()
        self._error = hiredis.ReplyError
        self.waiting: deque[asyncio.Future[Any] | Done] = deque()
        self.deadlines: deque[float] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport instances, but do what they do.
        self.transport = transport  # type: ignore[assignment]
        self._loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        waiting = self.waiting
        while True:
            try:
                reply = reader.gets()
            except Exception as exc:  # the stream is not the Redis protocol: unusable
                self._fail(ConnectionError(f"not a Redis reply ({type(exc).__name__})"))
                if self.transport is not None:
                    self.transport.close()
                return
            if reply is False:
                return
            if not waiting:  # nobody asked: the protocol is out of step
                self._fail(ConnectionError("a Redis reply nobody asked for"))
                if self.transport is not None:
                    self.transport.close()
                return
            entry = waiting.popleft()
            self.deadlines.popleft()
            error: BaseException | None = None
            if isinstance(reply, self._error):
                error = RespError(str(reply).split(" ", 1)[0] or "ERR")
                reply = None
            if not isinstance(entry, asyncio.Future):
                _call(entry, reply, error)
            elif entry.done():
                continue  # its caller left: the reply is dropped
            elif error is not None:
                entry.set_exception(error)
            else:
                entry.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError("the connection to Redis closed"))

    def _fail(self, error: BaseException) -> None:
        if self.lost is None:
            self.lost = error
        waiting, self.waiting = self.waiting, deque()
        self.deadlines = deque()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for entry in waiting:
            if not isinstance(entry, asyncio.Future):
                _call(entry, None, error)
            elif not entry.done():
                entry.set_exception(error)

    @property
    def open(self) -> bool:
        transport = self.transport
        return self.lost is None and transport is not None and not transport.is_closing()

    def _write(
        self, data: bytes, entries: Sequence[asyncio.Future[Any] | Done], timeout: float
    ) -> None:
        """Write `data` (one command per entry of `entries`, which wait for their replies
        `timeout` seconds at most)."""
        if not self.open:
            raise ConnectionError("the connection to Redis closed")
        loop = self._loop
        assert loop is not None  # open
        deadline = loop.time() + timeout
        if self._watchdog is None:  # none while nothing waits
            self._watchdog = loop.call_at(deadline, self._watch)
        self.waiting.extend(entries)
        self.deadlines.extend([deadline] * len(entries))
        transport = self.transport
        assert transport is not None  # open
        transport.write(data)

    def _watch(self) -> None:
        """The oldest call ran out of time: Redis stopped answering, so every call on this
        connection fails now (not each at its own bound) and the next call connects again.
        Else watch the oldest call still waiting."""
        self._watchdog = None
        if not self.deadlines:
            return
        loop = self._loop
        assert loop is not None
        oldest = self.deadlines[0]
        if oldest <= loop.time():
            self._fail(TimeoutError("Redis did not answer in time"))
            self.close()
            return
        self._watchdog = loop.call_at(oldest, self._watch)

    def send(self, data: bytes, count: int, timeout: float) -> list[asyncio.Future[Any]]:
        """Write `data` (`count` commands); the futures of their replies, in order."""
        if not self.open:
            raise ConnectionError("the connection to Redis closed")
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(count)]
        self._write(data, futures, timeout)
        return futures

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _call(done: Done, reply: Any, error: BaseException | None) -> None:
    """Call `done`; what it raises goes to the event loop's handler, never into the
    connection (the replies after it are still handed out)."""
    try:
        done(reply, error)
    except Exception as exc:  # a callback's bug: told, never breaking the connection
        asyncio.get_running_loop().call_exception_handler(
            {"message": "a Redis reply's callback failed", "exception": exc}
        )


def _options(url: str) -> dict[str, Any]:
    try:
        from redis.asyncio.connection import parse_url
    except ImportError as exc:  # pragma: no cover - only without the redis extra
        raise ValueError("needs the redis package: pip install 'chat-pipeline[redis]'") from exc
    try:
        options: dict[str, Any] = dict(parse_url(url))
    except (ValueError, TypeError):
        raise ValueError(_URL_REQUIRED) from None
    if not options.get("host") and not options.get("path"):
        raise ValueError(_URL_REQUIRED)
    options["ssl"] = url.startswith("rediss://")
    return options


class RespClient:
    """A Redis for calls on a request's path (see the module docstring). Building checks
    the URL and imports hiredis; nothing connects until the first call."""

    def __init__(self, url: str, *, timeout: float) -> None:
        self._options = _options(url)
        import hiredis  # noqa: F401  (a missing parser fails here, while building)

        self.timeout = timeout
        self._connection: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _connect(self) -> _Connection:
        # Bounded on its own: callers share it, and each may leave at its own bound.
        async with asyncio.timeout(self.timeout):
            return await self._open()

    async def _open(self) -> _Connection:
        options = self._options
        loop = asyncio.get_running_loop()
        connection: _Connection
        if options.get("path"):
            _, connection = await loop.create_unix_connection(_Connection, options["path"])
        else:
            context = ssl.create_default_context() if options["ssl"] else None
            _, connection = await loop.create_connection(
                _Connection, options["host"], int(options.get("port") or 6379), ssl=context
            )
        setup: list[bytes] = []
        password = options.get("password")
        if password:
            username = options.get("username")
            auth = ["AUTH", username, password] if username else ["AUTH", password]
            setup.append(encode_command(auth))
        database = int(options.get("db") or 0)
        if database:
            setup.append(encode_command(["SELECT", database]))
        if setup:
            try:
                for future in connection.send(b"".join(setup), len(setup), self.timeout):
                    await future
            except BaseException:
                connection.close()
                raise
        return connection

    async def _get(self) -> _Connection:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new event loop: a connection of its own
            self._loop, self._connection, self._connecting = loop, None, None
        connection = self._connection
        if connection is not None and connection.open:
            return connection
        self._connection = None
        connecting = self._connecting
        if connecting is None:
            # One connection attempt shared by every caller arriving meanwhile.
            connecting = self._connecting = asyncio.ensure_future(self._connect())
            connecting.add_done_callback(self._connected)
        return await asyncio.shield(connecting)

    def _connected(self, future: asyncio.Future[_Connection]) -> None:
        if self._connecting is future:
            self._connecting = None
        if not future.cancelled() and future.exception() is None:
            self._connection = future.result()

    async def execute_many(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Run `commands` in one write; their replies (an error reply raises `RespError`)."""
        data = b"".join(encode_command(command) for command in commands)
        return await self._execute_bytes(data, len(commands))

    async def _execute_bytes(self, data: bytes, count: int) -> list[Any]:
        """Write `data` (`count` encoded commands); their replies."""
        connection: _Connection | None = None
        futures: list[asyncio.Future[Any]] = []
        try:
            async with asyncio.timeout(self.timeout):
                connection = await self._get()
                futures = connection.send(data, count, self.timeout)
                return [await future for future in futures]
        except BaseException as exc:
            for future in futures:  # what is left of their replies is dropped as it comes
                future.cancel()
            if isinstance(exc, TimeoutError) and connection is not None:
                # Redis stopped answering: every call on this connection fails now, not at
                # its own bound, and the next call connects again.
                connection._fail(TimeoutError("Redis did not answer in time"))
                connection.close()
            raise

    async def execute(self, *args: Any) -> Any:
        """One command's reply."""
        return (await self.execute_many([args]))[0]

    async def evalsha(self, script: Script, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Run `script` (``EVALSHA``, loaded first on ``NOSCRIPT``)."""
        command = ["EVALSHA", script.sha, len(keys), *keys, *args]
        try:
            return await self.execute(*command)
        except RespError as exc:
            if exc.code != "NOSCRIPT":
                raise
        load = ["SCRIPT", "LOAD", script.source]
        return (await self.execute_many([load, command]))[1]

    def evalsha_then(
        self,
        script: Script,
        command: bytes,
        done: Done,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """Run `command` (``EVALSHA`` of `script`, encoded) and call `done` with its reply or
        error, once, never before this returns. On the common path (a connection open in
        `loop`, the script loaded) the command is written now and `done` is called from the
        reply itself. Bounded by the timeout like every call."""
        connection = self._connection
        if connection is not None and self._loop is loop and connection.open:

            def replied(reply: Any, error: BaseException | None) -> None:
                if isinstance(error, RespError) and error.code == "NOSCRIPT":
                    self._later(script, command, done, loop)
                else:
                    done(reply, error)

            connection._write(command, (replied,), self.timeout)
            return
        self._later(script, command, done, loop)

    def _later(
        self, script: Script, command: bytes, done: Done, loop: asyncio.AbstractEventLoop
    ) -> None:
        """`evalsha_then` through a task: connecting first, loading the script on
        ``NOSCRIPT``."""

        async def run() -> Any:
            try:
                return (await self._execute_bytes(command, 1))[0]
            except RespError as exc:
                if exc.code != "NOSCRIPT":
                    raise
            load = encode_command(["SCRIPT", "LOAD", script.source])
            return (await self._execute_bytes(load + command, 2))[1]

        def finished(task: asyncio.Task[Any]) -> None:
            if task.cancelled():
                _call(done, None, asyncio.CancelledError())
            elif (error := task.exception()) is not None:
                _call(done, None, error)
            else:
                _call(done, task.result(), None)

        loop.create_task(run()).add_done_callback(finished)

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection._fail(ConnectionError("the client was closed"))
            connection.close()

    def __repr__(self) -> str:  # never the URL: it may hold a password
        return "RespClient()"
