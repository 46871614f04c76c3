"""Start a real, throwaway PostgreSQL cluster on a loopback port, for a test session or one test.

Debian's packages put the server's programs in ``/usr/lib/postgresql/<version>/bin`` (not on
PATH): `server_binaries` finds the newest. `PostgresServer` makes a cluster in a temporary
folder (``initdb``: trust authentication on 127.0.0.1 only, no fsync), runs ``postgres`` on
127.0.0.1 and a free port, and can stop it (a fast shutdown: clients are disconnected), kill
it (SIGKILL, a crash) and start it again on the same port and data, so tests can show what
the spend ledger does while its database is gone.

PostgreSQL refuses to run as root: as root, the cluster belongs to the ``postgres`` system
user (which Debian's package creates) and its programs run as that user (``setpriv``, which
execs the program itself, so signals reach the server directly). A cluster that cannot start
raises `StartError` with the end of the server's log: a suite needing it fails, never skips.
postgres cannot bind port 0 and report the port it got, so its port comes from `free_port`;
a port taken in between is replaced by a new one (see `PostgresServer.start`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.processes import INSTALL_HINT, ChildProcess, StartError, free_port

__all__ = ["PostgresServer", "running_postgres", "server_binaries"]

_READY = "database system is ready to accept connections"
_PORT_TAKEN = "Address already in use"
USER = "chat_pipeline"
DATABASE = "chat_pipeline"


def server_binaries() -> Path:
    """The folder of the newest installed PostgreSQL server's programs (Debian's layout, or
    ``postgres`` on PATH); `FileNotFoundError` naming the package when there is none."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/postgres"),
        key=lambda path: int(Path(path).parts[-3]) if Path(path).parts[-3].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("postgres")
    if on_path is not None:
        return Path(on_path).parent
    raise FileNotFoundError(
        f"PostgreSQL's server is not installed: {INSTALL_HINT} (as root on Debian), or "
        "apt-get install postgresql"
    )


def _as_owner(owner: pwd.struct_passwd | None, argv: list[str]) -> list[str]:
    if owner is None:
        return argv
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        return [
            setpriv,
            f"--reuid={owner.pw_uid}",
            f"--regid={owner.pw_gid}",
            "--init-groups",
            "--",
            *argv,
        ]
    return ["runuser", "-u", owner.pw_name, "--", *argv]  # pragma: no cover - util-linux


class PostgresServer:
    """One PostgreSQL cluster in a temporary folder, served on 127.0.0.1:`port`."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.bin = server_binaries()
        self.timeout = timeout
        self.port = free_port()
        # As root the cluster is the postgres user's (PostgreSQL will not run as root).
        self._owner = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
        self.folder = Path(tempfile.mkdtemp(prefix="chat-pipeline-postgres-"))
        self.data = self.folder / "data"
        self.log = ""
        self.started = False
        self._child: ChildProcess | None = None
        self._initialized = False
        self._databases = 0

    @property
    def dsn(self) -> str:
        """A libpq connection URL for the test database (trust authentication)."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{DATABASE}"

    @property
    def running(self) -> bool:
        return self._child is not None and self._child.process.poll() is None

    def _run(self, argv: list[str]) -> None:
        done = subprocess.run(
            _as_owner(self._owner, argv),
            capture_output=True,
            text=True,
            timeout=self.timeout,
            check=False,
        )
        if done.returncode != 0:
            raise StartError(
                f"{Path(argv[0]).name} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
            )

    def _initialize(self) -> None:
        self.data.mkdir()
        if self._owner is not None:
            # The folder is made by root: hand it (and only it) to the postgres user.
            os.chown(self.folder, self._owner.pw_uid, self._owner.pw_gid)
            os.chown(self.data, self._owner.pw_uid, self._owner.pw_gid)
        self._run(
            [
                str(self.bin / "initdb"),
                "-D",
                str(self.data),
                "-U",
                USER,
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--no-instructions",
            ]
        )
        self._initialized = True

    def _server(self) -> ChildProcess:
        argv = [
            str(self.bin / "postgres"),
            "-D",
            str(self.data),
            "-p",
            str(self.port),
            "-h",
            "127.0.0.1",
            "-k",
            str(self.folder),  # its Unix socket beside the data, not in /var/run
            "-c",
            "fsync=off",
            "-c",
            "synchronous_commit=off",
            "-c",
            "full_page_writes=off",
            "-c",
            "max_connections=200",
            "-c",
            "logging_collector=off",
        ]
        return ChildProcess("postgres", _as_owner(self._owner, argv))

    def start(self) -> None:
        """Start the server (making the cluster and its database the first time) and wait
        until it accepts connections. A port taken meanwhile by another program is replaced
        by a new free one (twice at most), unless the server ran before (a restart keeps
        its port)."""
        if self.running:
            return
        if not self._initialized:
            self._initialize()
        for tries_left in (2, 1, 0):
            child = self._server()
            try:
                child.wait_for_line(_READY, self.timeout)
            except StartError:
                child.stop(signal.SIGKILL)
                self.log = child.output()
                if _PORT_TAKEN not in self.log or self.started or tries_left == 0:
                    raise
                self.port = free_port()
                continue
            self._child = child
            break
        if not self.started:
            self._create(DATABASE)
        self.started = True

    def _create(self, name: str) -> None:
        self._run(
            [
                str(self.bin / "createdb"),
                *("-h", "127.0.0.1", "-p", str(self.port), "-U", USER, "-T", "template0"),
                name,
            ]
        )

    def new_database(self) -> str:
        """The URL of a new, empty database of this cluster (each test takes its own)."""
        self._databases += 1
        name = f"test_{os.getpid()}_{self._databases}"
        self._create(name)
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        """A fast shutdown (SIGINT: clients are disconnected, the data is kept)."""
        child, self._child = self._child, None
        if child is not None:
            child.stop(signal.SIGINT, timeout=30)
            self.log = child.output()

    def kill(self) -> None:
        """SIGKILL, as a crash: the next start recovers from the write-ahead log."""
        child, self._child = self._child, None
        if child is not None:
            child.stop(signal.SIGKILL)
            self.log = child.output()

    def remove(self) -> None:
        """Stop the server and delete the cluster."""
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def running_postgres(timeout: float = 60.0) -> Iterator[PostgresServer]:
    """A fresh PostgreSQL cluster; stopped and deleted afterwards."""
    server = PostgresServer(timeout=timeout)
    try:
        server.start()
        yield server
    finally:
        server.remove()
