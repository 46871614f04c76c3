"""Two gateway replicas behind nginx, sharing breakers and session affinity through Redis,
all on this machine's loopback interface.

    python examples/gateway/replicas.py                      # fake upstreams, Ctrl-C stops
    python examples/gateway/replicas.py --ask "Hello?"       # one request, then stop
    python examples/gateway/replicas.py --config my.toml --no-fake-upstreams

It starts, in order: (with ``--fake-upstreams``, the default) two fake OpenAI-compatible
upstreams (``chat-pipeline fake-server``), ``redis-server``, two ``chat-pipeline serve``
replicas of the same configuration, and ``nginx`` with a generated configuration that
balances between them; then it waits. Ctrl-C (or the end of ``--ask``) stops everything in
reverse order: nginx first (no new requests), the replicas next (each drains its requests
in flight), Redis last. Every process's log is in the work directory it prints.

Needs ``nginx`` and ``redis-server`` (Debian: ``apt-get install nginx redis-server``) and
the gateway extra (``pip install -e '.[gateway]'``). The configuration names its Redis URL
by the variable ``GATEWAY_REDIS_URL``, which this script sets for the replicas.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "gateway.toml"
REDIS_VARIABLE = "GATEWAY_REDIS_URL"


class StartError(RuntimeError):
    """A process did not start (its log's last lines are in the message)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def find_binary(name: str) -> str:
    """The path of `name` (also looked for in /usr/sbin, where Debian puts nginx)."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise StartError(
            f"{name} is not installed; on Debian or Ubuntu: apt-get install {name}"
            + (" (package redis-server)" if name == "redis-server" else "")
        )
    return found


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class Process:
    """A child process with its log file; `stop()` signals it and waits, bounded."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        return int(self.popen.returncode)


def start(
    name: str, argv: Sequence[str], workdir: Path, env: Mapping[str, str] | None = None
) -> Process:
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            cwd=workdir,
        )
    return Process(name, popen, log)


def wait_http(process: Process, url: str, timeout: float = 60.0) -> None:
    """Poll `url` until it answers 200 (bounded; fails at once if the process exits)."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            raise StartError(
                f"{process.name} exited ({process.popen.returncode}) before it was ready:\n"
                + _tail(process.log)
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.1)
    raise StartError(
        f"{process.name} not ready within {timeout:g} s ({last}):\n" + _tail(process.log)
    )


def start_redis(workdir: Path, port: int, timeout: float = 30.0) -> Process:
    process = start(
        "redis",
        [
            find_binary("redis-server"),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        workdir,
    )
    # Ready once its log says so (read from the file: no pipe can fill and stall it).
    deadline = time.monotonic() + timeout
    while "Ready to accept connections" not in process.log.read_text(errors="replace"):
        if process.popen.poll() is not None or time.monotonic() > deadline:
            process.stop()
            raise StartError("redis-server did not start:\n" + _tail(process.log))
        time.sleep(0.05)
    return process


def nginx_conf(workdir: Path, port: int, upstreams: Sequence[int]) -> str:
    """An nginx configuration balancing 127.0.0.1:`port` over the replicas' ports."""
    servers = "\n".join(
        f"        server 127.0.0.1:{p} max_fails=1 fail_timeout=2s;" for p in upstreams
    )
    return f"""# Generated by examples/gateway/replicas.py.
worker_processes 1;
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/nginx-tmp/body;
    proxy_temp_path {workdir}/nginx-tmp/proxy;
    fastcgi_temp_path {workdir}/nginx-tmp/fastcgi;
    uwsgi_temp_path {workdir}/nginx-tmp/uwsgi;
    scgi_temp_path {workdir}/nginx-tmp/scgi;
    # Bodies stay in memory; the gateway enforces its own limit (413) below this one.
    client_max_body_size 16m;
    client_body_buffer_size 16m;
    upstream gateways {{
{servers}
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://gateways;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            # Streams (SSE) pass event by event; answers can take minutes.
            proxy_buffering off;
            proxy_read_timeout 600s;
            # A replica that refuses the connection is skipped; a request that reached
            # one is never sent again (nginx does not retry a POST that was sent).
            proxy_next_upstream error timeout;
        }}
    }}
}}
"""


def start_nginx(workdir: Path, port: int, upstreams: Sequence[int]) -> Process:
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (workdir / "nginx-tmp" / sub).mkdir(parents=True, exist_ok=True)
    conf = workdir / "nginx.conf"
    conf.write_text(nginx_conf(workdir, port, upstreams))
    argv = [
        find_binary("nginx"),
        "-p",
        str(workdir),
        "-c",
        str(conf),
        "-e",
        str(workdir / "nginx-error.log"),
    ]
    check = subprocess.run([*argv, "-t"], capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        raise StartError("nginx refused its configuration:\n" + check.stderr)
    return start("nginx", argv, workdir)


@dataclass
class Replicas:
    """What `replicas()` started: the balanced URL and each replica's own URL."""

    url: str
    replica_urls: list[str]
    redis_url: str
    workdir: Path
    processes: list[Process] = field(default_factory=list)


@contextlib.contextmanager
def replicas(
    config: Path,
    *,
    count: int = 2,
    port: int = 0,
    workdir: Path | None = None,
    environment: str | None = None,
    env: Mapping[str, str] | None = None,
    python: str = sys.executable,
) -> Iterator[Replicas]:
    """Redis, `count` gateway replicas of `config` and nginx in front, on loopback; all
    stopped when the block ends (nginx, then the replicas, then Redis)."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gateway-")))
            workdir.chmod(0o755)  # nginx workers may run as another user
        started: list[Process] = []

        def stop_all() -> None:
            for process in reversed(started):
                process.stop(signal.SIGQUIT if process.name == "nginx" else signal.SIGTERM)

        stack.callback(stop_all)
        redis_port = free_port()
        started.append(start_redis(workdir, redis_port))
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        child_env = {**os.environ, **(env or {}), REDIS_VARIABLE: redis_url}
        ports = [free_port() for _ in range(count)]
        gateways = []
        for index, gateway_port in enumerate(ports):
            argv = [
                python,
                "-m",
                "pipeline",
                "serve",
                "--config",
                str(config),
                "--port",
                str(gateway_port),
            ]
            if environment:
                argv += ["--env", environment]
            gateways.append(start(f"gateway-{index + 1}", argv, workdir, child_env))
        started.extend(gateways)
        for process, gateway_port in zip(gateways, ports, strict=True):
            wait_http(process, f"http://127.0.0.1:{gateway_port}/readyz")
        port = port or free_port()
        nginx = start_nginx(workdir, port, ports)
        started.append(nginx)
        wait_http(nginx, f"http://127.0.0.1:{port}/readyz")
        yield Replicas(
            url=f"http://127.0.0.1:{port}",
            replica_urls=[f"http://127.0.0.1:{p}" for p in ports],
            redis_url=redis_url,
            workdir=workdir,
            processes=started,
        )


@contextlib.contextmanager
def fake_upstreams(workdir: Path, ports: Sequence[int]) -> Iterator[list[str]]:
    """``chat-pipeline fake-server`` on each port (the example configuration's upstreams)."""
    processes = [
        start(
            f"upstream-{p}",
            [sys.executable, "-m", "pipeline", "fake-server", "--port", str(p)],
            workdir,
        )
        for p in ports
    ]
    try:
        for process in processes:
            deadline = time.monotonic() + 60
            while "fake OpenAI-compatible server" not in process.log.read_text(errors="replace"):
                if process.popen.poll() is not None or time.monotonic() > deadline:
                    raise StartError("the fake upstream did not start:\n" + _tail(process.log))
                time.sleep(0.05)
        yield [f"http://127.0.0.1:{p}/v1" for p in ports]
    finally:
        for process in processes:
            process.stop(signal.SIGINT)


def ask(url: str, question: str) -> str:
    """One non-streaming request to the balanced URL, with the standard library."""
    body = json.dumps({"model": "pipeline", "messages": [{"role": "user", "content": question}]})
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return str(json.load(response)["choices"][0]["message"]["content"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--env", help="environment overlay of the configuration")
    parser.add_argument("--port", type=int, default=8080, help="nginx's port on 127.0.0.1")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument(
        "--fake-upstreams",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start fake upstreams on 127.0.0.1:8765 and :8766 (the example file's routes)",
    )
    parser.add_argument("--ask", metavar="QUESTION", help="send one request, print, stop")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="gateway-replicas-"))
    workdir.chmod(0o755)
    print(f"logs and generated nginx.conf: {workdir}", flush=True)
    try:
        with contextlib.ExitStack() as stack:
            if args.fake_upstreams:
                stack.enter_context(fake_upstreams(workdir, [8765, 8766]))
            running = stack.enter_context(
                replicas(
                    args.config,
                    count=args.replicas,
                    port=args.port,
                    workdir=workdir,
                    environment=args.env,
                )
            )
            print(
                f"nginx: {running.url}/v1  replicas: {', '.join(running.replica_urls)}  "
                f"redis: {running.redis_url}",
                flush=True,
            )
            if args.ask is not None:
                print(ask(running.url, args.ask), flush=True)
                return 0
            print("Ctrl-C stops everything.", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()
    except StartError as exc:
        print(f"could not start: {exc}", file=sys.stderr)
        return 1
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
