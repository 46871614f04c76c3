"""The gateway under load, against its floors and LiteLLM's proxy, in front of one fake upstream.

    python benchmarks/bench_gateway.py                       # both shapes, concurrency 1 and 16
    python benchmarks/bench_gateway.py --litellm-python /path/to/venv/bin/python
    python benchmarks/bench_gateway.py --no-litellm          # our gateway only
    python benchmarks/bench_gateway.py --no-litellm --baseline /path/to/other/checkout
    python benchmarks/bench_gateway.py --governed     # keys, budgets, limits: on vs off
    python benchmarks/bench_gateway.py --no-litellm --no-scripted --no-full   # the floor table

Every server runs in its own process, on loopback: the fake OpenAI-compatible upstream
(``chat-pipeline fake-server``), ``chat-pipeline serve`` (one worker, one route to the
upstream; the same with an ordered failover router, a circuit breaker and retry in front
of it; and one with an in-process scripted route: the gateway's own work, without an
upstream call), and the LiteLLM proxy (``litellm[proxy]``, one worker, one model proxying to
the upstream, no database, no retries, run offline). The servers are pinned to core 0;
the upstream and this load generator share core 1.

The load generator is a bounded, minimal HTTP/1.1 client (keep-alive connections, one
request in flight on each; a fixed number of requests; a deadline): `--concurrency`
connections send `--requests` requests in all, after `--warmup` unmeasured ones. For each
server it reports throughput, p50 and p99 latency (to the last byte), and the server's CPU
time per request, read from ``/proc`` (the server process and its children) before and
after: "per core" is requests per CPU-second of the server. Rounds interleave the servers,
and the best round of each is kept, so a busy machine slows every server alike; ratios
compare figures from the same run. Last, a table of the gateway against both floors: CPU
per request and p99 of each, and the ratios gateway / Python floor and gateway / nginx.

LiteLLM runs from the interpreter given by ``--litellm-python`` (default: this one), which
needs ``pip install 'litellm[proxy]'``.

``--baseline PATH`` runs the gateway of another checkout of this project too (its
``pipeline`` and ``middleware`` imported from PATH, with this interpreter), its plain and
its failover variants in the same rounds, and prints each of ours against it: a change is
judged against the code before it, measured in the same run.

``--governed`` measures what keys, budgets and rate limits add, in one run: the plain
gateway (an ``api_keys_env`` key) against the same with ``[keys]`` and ``[budgets]`` on (a
virtual key in a real PostgreSQL, a key budget, a team budget, requests and tokens a minute,
counted in a real redis-server, never refusing), and, as the floor, the plain gateway with
a bare reservation in front of each request (``_reserving_gateway.py``: the same Lua script
with the same four counters through the same Redis client, nothing else). Target: what
governance adds to the gateway's CPU per request is at most 1.1x what the bare reservation
adds. Beside it, a bare reservation's client CPU alone, measured in this process on the
servers' core (Redis on the other, as for the gateway), through the client's general call
and through its cheapest.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

# This directory, for `_litellm_env`; the checkout, for how a server reports its port.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from _litellm_env import litellm_env

from tests.processes import UVICORN_PORT, uvicorn_log_config

SERVER_CORE = 0
CLIENT_CORE = 1


# Both servers authenticate each request with the same key (LiteLLM refuses to start
# without a master key; the gateway checks its keys the same way).
API_KEY = "sk-" + os.urandom(32).hex()
KEYS_VARIABLE = "BENCH_GATEWAY_KEYS"
BASELINE = "baseline: "  # the name prefix of the --baseline checkout's servers
# The fake upstream's line once it listens, with the port it got.
FAKE_SERVER_URL = re.compile(r"fake OpenAI-compatible server on (http://\S+)")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of `pid` and its live descendants, in nanoseconds' resolution:
    each process's CPU clock (``clock_getcpuclockid``, which Python lacks: the kernel's
    encoding of a process's clock id), counting its threads, the ended ones too. ``/proc``'s
    clock ticks (10 ms) would be 5% of a 2,000-request cell at 0.1 ms a request."""
    total = 0.0
    try:
        total += time.clock_gettime(_process_clock(pid))
    except OSError:  # the process has gone
        return total
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += cpu_seconds(int(child))
    except (FileNotFoundError, ProcessLookupError):
        pass
    return total


def _process_clock(pid: int) -> int:
    """The clock id of `pid`'s process CPU time (Linux: ``CPUCLOCK_SCHED`` of the process,
    as glibc's ``clock_getcpuclockid`` makes it)."""
    return ((~pid) << 3) | 2


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    path: str
    model: str
    log: Path
    api_key: str = API_KEY
    # Under callgrind: where its counts are dumped (`instructions_between`).
    callgrind: Path | None = None


# --instructions: every server runs under valgrind's callgrind, which counts the instructions
# it executes (the same figure on a busy machine as on an idle one, unlike CPU time).
CALLGRIND = False


def under_callgrind(argv: Sequence[str], out: Path) -> list[str]:
    """`argv` run by callgrind, dumping its counts to `out`.PID.N (`instructions_between`)."""
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p", *argv]


def callgrind_summary(server: Server) -> int:
    """Dump `server`'s instruction count since it was last zeroed (and zero it)."""
    pid = server.process.pid
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    assert server.callgrind is not None
    dumps = server.callgrind.parent.glob(f"{server.callgrind.name}.{pid}.*")
    latest = max(dumps, key=lambda path: int(path.suffix[1:]))
    for line in latest.read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary in {latest}")


def callgrind_zero(server: Server) -> None:
    subprocess.run(
        ["callgrind_control", "-z", str(server.process.pid)], check=True, capture_output=True
    )


def _pinned(core: int) -> object:
    def pin() -> None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {core})

    return pin


@contextlib.contextmanager
def started(
    name: str,
    argv: Sequence[str],
    *,
    ready_path: str,
    workdir: Path,
    env: Mapping[str, str] | None = None,
    core: int = SERVER_CORE,
    path: str = "/v1/chat/completions",
    model: str = "pipeline",
    timeout: float = 300.0,
    api_key: str = API_KEY,
) -> Iterator[Server]:
    """Run `argv`, a uvicorn server told to listen on port 0, until the block ends: ready
    once uvicorn logged the port it got and `ready_path` answers there. With `CALLGRIND`,
    under callgrind."""
    log = workdir / f"{name.replace(' ', '-')}.log"
    callgrind = workdir / f"callgrind.{name.replace(' ', '-')}" if CALLGRIND else None
    if callgrind is not None:
        argv = under_callgrind(argv, callgrind)
        timeout *= 4  # valgrind runs the start-up some 50 times slower
    with open(log, "wb") as out:
        process = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            cwd=workdir,
            start_new_session=True,
            preexec_fn=_pinned(core),  # type: ignore[arg-type]
        )
    try:
        deadline = time.monotonic() + timeout
        port: int | None = None
        while True:  # bounded readiness poll of an external process
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited:\n{log.read_text(errors='replace')[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready:\n{log.read_text(errors='replace')[-3000:]}")
            if port is None:
                found = UVICORN_PORT.search(log.read_text(errors="replace"))
                port = int(found.group(1)) if found else None
            if port is not None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}{ready_path}", timeout=2):
                        break
                except (urllib.error.URLError, OSError):
                    pass
            time.sleep(0.2)
        yield Server(name, process, port, path, model, log, api_key, callgrind)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


# -- the load generator ---------------------------------------------------------------------


def request_bytes(server: Server, stream: bool) -> bytes:
    body: dict[str, object] = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Say hello."}],
    }
    if stream:
        body["stream"] = True
    data = json.dumps(body).encode()
    head = (
        f"POST {server.path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nAuthorization: Bearer {server.api_key}\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


async def one_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """Read one HTTP/1.1 response (Content-Length or chunked); its status and body."""
    line = await reader.readline()
    if not line.startswith(b"HTTP/1.1 "):
        raise RuntimeError(f"not an HTTP/1.1 response: {line[:100]!r} (connection closed?)")
    status = int(line.split(b" ", 2)[1])
    length = None
    chunked = False
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    body = b""
    if chunked:
        parts = []
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            parts.append((await reader.readexactly(size + 2))[:-2])
            if size == 0:
                break
        body = b"".join(parts)
    elif length is not None:
        body = await reader.readexactly(length)
    return status, body


def check_answer(server: Server, stream: bool, status: int, body: bytes) -> None:
    """Raise unless the response is a whole answer of the upstream's: a 200 whose body is
    the completion (with the upstream's text), or a stream ending with ``[DONE]``."""
    if status != 200:
        raise RuntimeError(f"{server.name} answered HTTP {status}: {body[:300]!r}")
    if stream:
        if not body.rstrip().endswith(b"data: [DONE]"):
            raise RuntimeError(f"{server.name}: a stream that did not end: {body[-300:]!r}")
        return
    answer = json.loads(body)
    if not answer["choices"][0]["message"]["content"]:
        raise RuntimeError(f"{server.name}: an answer without text: {body[:300]!r}")


async def load(
    server: Server, *, stream: bool, concurrency: int, requests: int, deadline: float
) -> list[float]:
    """Latencies of `requests` requests over `concurrency` keep-alive connections, each
    response checked (`check_answer`)."""
    payload = request_bytes(server, stream)
    latencies: list[float] = []
    per_connection = [
        requests // concurrency + (i < requests % concurrency) for i in range(concurrency)
    ]

    async def connection(count: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            for _ in range(count):
                started = time.perf_counter()
                writer.write(payload)
                try:
                    status, body = await one_response(reader)
                except (RuntimeError, ValueError, asyncio.IncompleteReadError) as exc:
                    raise RuntimeError(f"{server.name}: {exc}") from exc
                latencies.append(time.perf_counter() - started)
                check_answer(server, stream, status, body)
        finally:
            writer.close()

    async with asyncio.timeout(deadline):
        await asyncio.gather(*(connection(n) for n in per_connection if n))
    return latencies


@dataclass
class Result:
    throughput: float  # requests per wall-clock second
    p50: float  # seconds
    p99: float
    cpu_per_request: float  # server CPU seconds per request
    instructions: float | None = None  # per request, under callgrind (--instructions)

    @property
    def per_core(self) -> float:
        return 1.0 / self.cpu_per_request if self.cpu_per_request else float("inf")


def measure(
    server: Server, *, stream: bool, concurrency: int, requests: int, warmup: int
) -> Result:
    slow = 20 if server.callgrind is not None else 1  # valgrind's pace
    asyncio.run(
        load(server, stream=stream, concurrency=concurrency, requests=warmup, deadline=300 * slow)
    )
    if server.callgrind is not None:
        callgrind_zero(server)
    before = cpu_seconds(server.process.pid)
    started = time.perf_counter()
    latencies = asyncio.run(
        load(server, stream=stream, concurrency=concurrency, requests=requests, deadline=600 * slow)
    )
    elapsed = time.perf_counter() - started
    cpu = cpu_seconds(server.process.pid) - before
    counted = callgrind_summary(server) if server.callgrind is not None else None
    latencies.sort()
    return Result(
        throughput=len(latencies) / elapsed,
        p50=statistics.median(latencies),
        p99=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        cpu_per_request=cpu / len(latencies),
        instructions=counted / len(latencies) if counted is not None else None,
    )


def measure_round(
    servers: Sequence[Server],
    best: dict[str, Result],
    shape: str,
    concurrency: int,
    args: argparse.Namespace,
) -> None:
    """One round: each server measured in turn; `best` keeps each one's least CPU time a
    request (a busy machine slows every server of a round alike)."""
    for server in servers:
        result = measure(
            server,
            stream=shape == "streaming",
            concurrency=concurrency,
            requests=args.requests,
            warmup=args.warmup,
        )
        kept = best.get(server.name)
        if kept is None or result.cpu_per_request < kept.cpu_per_request:
            best[server.name] = result


# -- the servers ------------------------------------------------------------------------------


def gateway_config(workdir: Path, upstream: str, full: bool | None) -> Path:
    """One route to the upstream; with `full`, failover, a breaker and retry in front of
    it; with `full` None, a scripted in-process route (the gateway's own work alone)."""
    name = {False: "gateway.toml", True: "gateway-full.toml", None: "gateway-scripted.toml"}
    path = workdir / name[full]
    gateway = f'[gateway]\napi_keys_env = "{KEYS_VARIABLE}"\n'
    if full is None:
        path.write_text(
            '[routes.primary]\nprovider = "scripted"\nreply = "Hello from the fake server."\n'
            + gateway
        )
        return path
    if not full:
        path.write_text(
            f'[routes.primary]\nprovider = "openai"\nmodel = "fake-model"\n'
            f'base_url = "{upstream}"\n{gateway}'
        )
        return path
    path.write_text(
        gateway
        + f"""
[routes.primary]
provider = "openai"
model = "fake-model"
base_url = "{upstream}"
retry = {{ max_attempts = 2 }}
breaker = {{ fail_max = 5, reset_timeout = 30 }}

[routes.backup]
provider = "openai"
model = "fake-model"
base_url = "{upstream}"

[router]
kind = "ordered"
order = ["primary", "backup"]
"""
    )
    return path


def litellm_config(workdir: Path, upstream: str) -> Path:
    config = {
        "model_list": [
            {
                "model_name": "fake-model",
                "litellm_params": {
                    "model": "openai/fake-model",
                    "api_key": "sk-upstream",
                    "api_base": upstream,
                },
            }
        ],
        # Like our gateway here: no retries, no cooldowns, no database; one key.
        "litellm_settings": {"num_retries": 0, "request_timeout": 60},
        "router_settings": {"num_retries": 0, "disable_cooldowns": True},
        "general_settings": {"master_key": API_KEY},
    }
    path = workdir / "litellm.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["non-streaming", "streaming"],
        choices=["non-streaming", "streaming"],
    )
    parser.add_argument("--litellm-python", default=sys.executable)
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="PATH",
        help="also run the gateway of the checkout at PATH (e.g. `git archive main`)",
    )
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument(
        "--scripted",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure the gateway with an in-process scripted route (its own work)",
    )
    parser.add_argument(
        "--governed",
        action="store_true",
        help="only the plain gateway against the same with keys, budgets and rate limits on "
        "(Redis, PostgreSQL), and the floor of a bare reservation",
    )
    parser.add_argument(
        "--full",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure the gateway with failover, a breaker and retry in front",
    )
    parser.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the Python floor (_floor.py: a byte-forwarder on the same stack)",
    )
    parser.add_argument(
        "--nginx",
        action=argparse.BooleanOptionalAction,
        default=shutil.which("nginx") is not None or Path("/usr/sbin/nginx").exists(),
        help="measure nginx's proxy_pass (default: when nginx is installed)",
    )
    parser.add_argument(
        "--ledger",
        action="store_true",
        help="also measure the gateway with the spend ledger on ([spend] in a throwaway "
        "PostgreSQL), reported beside the floor table",
    )
    parser.add_argument(
        "--governance",
        action="store_true",
        help="also measure the gateway with keys, budgets and limits on (a virtual key in "
        "PostgreSQL, counters in redis-server), reported beside the floor table",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="run every server under valgrind's callgrind and report instructions per "
        "request too (steady on a busy machine; some 50x slower: use a few hundred requests)",
    )
    parser.add_argument(
        "--chunk-delay",
        type=float,
        metavar="S",
        help="the fake upstream pauses S seconds between a stream's content events, as "
        "upstreams that write each event as they make it (each then comes in a read of its "
        "own; the default writes a stream at once)",
    )
    parser.add_argument(
        "--words",
        type=int,
        metavar="N",
        help="the fake upstream answers N words, a stream's content events one a word (the "
        "default answers five)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.governed:
        return governed(args)
    if args.instructions:
        global CALLGRIND
        CALLGRIND = True
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {CLIENT_CORE})
    workdir = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    results: dict[str, dict[str, Result]] = {}
    try:
        with contextlib.ExitStack() as stack:
            upstream = stack.enter_context(_fake_upstream(workdir, args.chunk_delay, args.words))
            servers = []
            variants: dict[bool | None, str] = {
                False: "",
                True: " (failover+breaker+retry)",
                None: " (scripted route, no upstream)",
            }
            checkouts: list[tuple[str, dict[str, str]]] = [
                ("", {**os.environ, KEYS_VARIABLE: API_KEY})
            ]
            if args.baseline is not None:
                pythonpath = os.pathsep.join(
                    filter(None, [str(args.baseline.resolve()), os.environ.get("PYTHONPATH")])
                )
                checkouts.append(
                    (BASELINE, {**os.environ, KEYS_VARIABLE: API_KEY, "PYTHONPATH": pythonpath})
                )
            for (full, suffix), (prefix, env) in itertools.product(variants.items(), checkouts):
                if full is None and (prefix or not args.scripted):
                    continue
                if full is True and not args.full:
                    continue
                name = prefix + "chat-pipeline serve" + suffix
                servers.append(
                    stack.enter_context(
                        started(
                            name,
                            [
                                sys.executable,
                                "-m",
                                "pipeline",
                                "serve",
                                "--config",
                                str(gateway_config(workdir, upstream, full)),
                                "--port",
                                "0",
                                # info: uvicorn's startup line tells the port it got (no
                                # access log either way).
                                "--log-level",
                                "info",
                            ],
                            ready_path="/readyz",
                            workdir=workdir,
                            env=env,
                        )
                    )
                )
            servers += stack.enter_context(_beside(args, workdir, upstream))
            if args.floor:
                servers.append(
                    stack.enter_context(
                        started(
                            FLOOR,
                            [
                                sys.executable,
                                str(Path(__file__).resolve().parent / "_floor.py"),
                                "--upstream",
                                upstream,
                            ],
                            ready_path="/readyz",
                            workdir=workdir,
                            env={**os.environ, KEYS_VARIABLE: API_KEY},
                        )
                    )
                )
            if args.nginx:
                servers.append(stack.enter_context(started_nginx(workdir, upstream)))
            if not args.no_litellm:
                env = litellm_env()
                servers.append(
                    stack.enter_context(
                        started(
                            "LiteLLM proxy",
                            [
                                args.litellm_python,
                                "-m",
                                "litellm.proxy.proxy_cli",
                                "--config",
                                str(litellm_config(workdir, upstream)),
                                "--host",
                                "127.0.0.1",
                                "--port",
                                "0",
                                "--num_workers",
                                "1",
                                "--log_config",
                                str(uvicorn_log_config(workdir / "litellm-uvicorn-log.json")),
                            ],
                            ready_path="/health/liveliness",
                            workdir=workdir,
                            env=env,
                            model="fake-model",
                        )
                    )
                )
            for shape in args.shapes:
                for concurrency in args.concurrency:
                    key = f"{shape}, concurrency {concurrency}"
                    best: dict[str, Result] = {}
                    for _ in range(args.rounds):
                        measure_round(servers, best, shape, concurrency, args)
                    results[key] = best
                    report(key, best)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    floor_table(results)
    if args.json:
        args.json.write_text(
            json.dumps(
                {key: {name: vars(r) for name, r in rows.items()} for key, rows in results.items()},
                indent=2,
            )
        )
    return 0


@contextlib.contextmanager
def _beside(args: argparse.Namespace, workdir: Path, upstream: str) -> Iterator[list[Server]]:
    """The gateway with the spend ledger on (`--ledger`) and with keys, budgets and limits
    on (`--governance`), with the PostgreSQL and redis-server they need."""
    if not (args.ledger or args.governance):
        yield []
        return
    from tests.postgres_server import running_postgres

    servers: list[Server] = []
    with contextlib.ExitStack() as stack:
        postgres = stack.enter_context(running_postgres())
        env = {**os.environ, KEYS_VARIABLE: API_KEY}
        argv = [sys.executable, "-m", "pipeline", "serve", "--port", "0", "--log-level", "info"]
        if args.ledger:
            env["BENCH_LEDGER_DSN"] = postgres.new_database()
            config = workdir / "gateway-ledger.toml"
            config.write_text(
                gateway_config(workdir, upstream, False).read_text()
                + '\n[spend]\nstore = "postgres"\ndsn_env = "BENCH_LEDGER_DSN"\n'
            )
            servers.append(
                stack.enter_context(
                    started(
                        LEDGER_NAME,
                        [*argv, "--config", str(config)],
                        ready_path="/readyz",
                        workdir=workdir,
                        env=env,
                    )
                )
            )
        if args.governance:
            from tests.redis_server import running_redis

            redis_url = stack.enter_context(running_redis())
            dsn = postgres.new_database()
            secret = asyncio.run(_virtual_key(dsn))
            env = {**env, "BENCH_GOVERNED_DSN": dsn, "BENCH_GOVERNED_REDIS": redis_url}
            config = governed_config(
                workdir, upstream, "BENCH_GOVERNED_DSN", "BENCH_GOVERNED_REDIS"
            )
            servers.append(
                stack.enter_context(
                    started(
                        GOVERNED_NAME,
                        [*argv, "--config", str(config)],
                        ready_path="/readyz",
                        workdir=workdir,
                        env=env,
                        api_key=secret,
                    )
                )
            )
        yield servers


# -- governance: keys, budgets and rate limits --------------------------------------------------

GOVERNED_NAME = "chat-pipeline serve (keys, budgets, limits)"
LEDGER_NAME = "chat-pipeline serve ([spend] ledger)"
PLAIN_NAME = "chat-pipeline serve"
RESERVING_NAME = "chat-pipeline serve + a bare reservation"


async def _virtual_key(dsn: str) -> str:
    """Upgrade the database and make the benchmark's key: every budget and limit counted,
    none ever reached."""
    from pipeline import _db
    from pipeline.keys import Budget, DatabaseKeyStore

    database = _db.open_database(dsn)
    await _db.upgrade(database)
    store = DatabaseKeyStore(database, auto_upgrade=False)
    try:
        issued = await store.create(
            "bench", team="bench", rpm=10**9, tpm=10**12, budget=Budget("1000000", "month")
        )
    finally:
        await store.aclose()
    return issued.secret


def governed_config(workdir: Path, upstream: str, dsn_env: str, redis_env: str) -> Path:
    path = workdir / "gateway-governed.toml"
    path.write_text(
        f"""
[routes.primary]
provider = "openai"
model = "fake-model"
base_url = "{upstream}"
price = {{ input_per_million = 0.15, output_per_million = 0.6 }}

[spend]
enabled = false  # the keys' database only: no spend records (not what is measured)
store = "postgres"
dsn_env = "{dsn_env}"

[keys]

[budgets]
redis_url_env = "{redis_env}"
teams = {{ bench = {{ budget = {{ limit = "1000000", period = "month" }} }} }}
"""
    )
    return path


def bare_reservations(redis_url: str, concurrency: int, calls: int) -> dict[str, float]:
    """Client CPU seconds per bare reservation: the gateway's Lua script with the same four
    counters (a key's and a team's budget, the key's requests and tokens a minute), one
    ``EVALSHA`` each through the same client (`pipeline._resp`), `concurrency` at a time,
    measured on the servers' core (Redis is on the other, as for the gateway). Two ways:
    ``evalsha``, the client's general call (a coroutine, the command encoded, the call
    bounded), and ``callback``, its cheapest (`RespClient.evalsha_then`: the command
    encoded once, the reply handed to a callback that wakes the caller), the call the
    gateway's reservations make."""
    import uvloop
    from _reserving_gateway import answered, bare_reservation

    from pipeline._reservations import SCRIPT, Reservations
    from pipeline._resp import RespClient

    async def run() -> dict[str, float]:
        client = RespClient(redis_url, timeout=10.0)
        reservations = Reservations(client, namespace="bench-floor", rebuild_delay=0.0)
        await reservations.prepare()
        keys, args, command = bare_reservation(reservations)
        loop = asyncio.get_running_loop()

        async def general(count: int) -> None:
            for _ in range(count):
                await client.evalsha(SCRIPT, keys, args)

        async def callback(count: int) -> None:
            for _ in range(count):
                reply: asyncio.Future[object] = loop.create_future()
                client.evalsha_then(SCRIPT, command, partial(answered, reply), loop)
                await reply

        spent: dict[str, float] = {}
        for name, worker in (("evalsha", general), ("callback", callback)):
            await worker(200)  # warm
            before = time.process_time()
            await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))
            spent[name] = (time.process_time() - before) / (calls // concurrency * concurrency)
        await client.aclose()
        return spent

    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {SERVER_CORE})
    try:
        return uvloop.run(run())
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {CLIENT_CORE})


def governed(args: argparse.Namespace) -> int:
    """The ``--governed`` run (see the module docstring)."""
    from tests.postgres_server import running_postgres
    from tests.redis_server import running_redis

    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {CLIENT_CORE})
    workdir = Path(tempfile.mkdtemp(prefix="bench-governed-"))
    workdir.chmod(0o755)
    try:
        with contextlib.ExitStack() as stack:
            upstream = stack.enter_context(_fake_upstream(workdir))
            redis_url = stack.enter_context(running_redis())
            postgres = stack.enter_context(running_postgres())
            dsn = postgres.new_database()
            secret = asyncio.run(_virtual_key(dsn))
            env = {
                **os.environ,
                KEYS_VARIABLE: API_KEY,
                "BENCH_GOVERNED_DSN": dsn,
                "BENCH_GOVERNED_REDIS": redis_url,
            }
            argv = [sys.executable, "-m", "pipeline", "serve", "--port", "0", "--log-level", "info"]
            plain_config = str(gateway_config(workdir, upstream, False))
            plain = stack.enter_context(
                started(
                    PLAIN_NAME,
                    [*argv, "--config", plain_config],
                    ready_path="/readyz",
                    workdir=workdir,
                    env=env,
                )
            )
            reserving = stack.enter_context(
                started(
                    RESERVING_NAME,
                    [
                        sys.executable,
                        str(Path(__file__).resolve().parent / "_reserving_gateway.py"),
                        "--config",
                        plain_config,
                        "--port",
                        "0",
                    ],
                    ready_path="/readyz",
                    workdir=workdir,
                    env=env,
                )
            )
            config = governed_config(
                workdir, upstream, "BENCH_GOVERNED_DSN", "BENCH_GOVERNED_REDIS"
            )
            governed_server = stack.enter_context(
                started(
                    GOVERNED_NAME,
                    [*argv, "--config", str(config)],
                    ready_path="/readyz",
                    workdir=workdir,
                    env=env,
                    api_key=secret,
                )
            )
            servers = [plain, reserving, governed_server]
            for shape in args.shapes:
                for concurrency in args.concurrency:
                    key = f"{shape}, concurrency {concurrency}"
                    best: dict[str, Result] = {}
                    floors = {"evalsha": math.inf, "callback": math.inf}
                    for _ in range(args.rounds):
                        measure_round(servers, best, shape, concurrency, args)
                        measured = bare_reservations(redis_url, concurrency, args.requests)
                        floors = {k: min(v, measured[k]) for k, v in floors.items()}
                    report(key, best)
                    off, on = best[PLAIN_NAME], best[GOVERNED_NAME]
                    added = on.cpu_per_request - off.cpu_per_request
                    floor = best[RESERVING_NAME].cpu_per_request - off.cpu_per_request
                    print(
                        f"  governance adds {added * 1e6:.1f} us of gateway CPU per request; a "
                        f"bare reservation in the gateway adds {floor * 1e6:.1f} us: "
                        f"{added / floor:.2f}x (target <= 1.1x); governed / ungoverned: "
                        f"{on.per_core / off.per_core:.2f}x throughput per core"
                    )
                    print(
                        f"  a bare reservation alone costs {floors['evalsha'] * 1e6:.1f} us of "
                        f"client CPU through the client's general call (evalsha), "
                        f"{floors['callback'] * 1e6:.1f} us through its cheapest (a callback)"
                    )
                    sys.stdout.flush()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


@contextlib.contextmanager
def _fake_upstream(
    workdir: Path, chunk_delay: float | None = None, words: int | None = None
) -> Iterator[str]:
    """``chat-pipeline fake-server`` pinned to the client's core, on port 0 (pausing
    `chunk_delay` seconds between a stream's content events, answering `words` words, when
    given); ready when it says so, with its base URL."""
    log = workdir / "upstream.log"
    paced = ["--chunk-delay", str(chunk_delay)] if chunk_delay else []
    if words:
        paced += ["--words", str(words)]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "fake-server", "--port", "0", *paced],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_pinned(CLIENT_CORE),  # type: ignore[arg-type]
        )
    try:
        deadline = time.monotonic() + 120
        while (found := FAKE_SERVER_URL.search(log.read_text(errors="replace"))) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fake upstream did not start:\n" + log.read_text())
            time.sleep(0.05)
        yield found.group(1)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


FLOOR = "Python floor (forwarder)"
NGINX = "nginx proxy_pass"

NGINX_CONFIG = """\
{master}
worker_processes 1;
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log {workdir}/nginx-access.log;
    client_body_temp_path {workdir}/nginx-body;
    proxy_temp_path {workdir}/nginx-proxy;
    fastcgi_temp_path {workdir}/nginx-fastcgi;
    uwsgi_temp_path {workdir}/nginx-uwsgi;
    scgi_temp_path {workdir}/nginx-scgi;
    upstream fake {{ server {upstream}; keepalive 64; keepalive_requests 1000000; }}
    server {{
        listen 127.0.0.1:{port};
        location = /readyz {{ return 200 "ok"; }}
        location / {{
            if ($http_authorization != "Bearer {key}") {{ return 401; }}
            proxy_pass http://fake;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
        # As the Python servers: a client's connection is kept for every request it sends
        # (nginx closes one after 1,000 by default, which a cell's single connection
        # outlives).
        keepalive_requests 1000000;
    }}
}}
"""


@contextlib.contextmanager
def started_nginx(workdir: Path, upstream: str) -> Iterator[Server]:
    """nginx in front of the upstream (one worker, keep-alive to the upstream, the key
    checked, an access log), pinned to the servers' core."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    with contextlib.closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    host = upstream.removeprefix("http://").split("/", 1)[0]
    config = workdir / "nginx.conf"
    # Under callgrind, one process serves (no master forking a worker): its counts are the
    # worker's.
    master = "master_process off;" if CALLGRIND else ""
    config.write_text(
        NGINX_CONFIG.format(workdir=workdir, upstream=host, port=port, key=API_KEY, master=master)
    )
    log = workdir / "nginx.log"
    argv = [nginx, "-p", str(workdir), "-c", str(config)]
    callgrind = workdir / "callgrind.nginx" if CALLGRIND else None
    if callgrind is not None:
        argv = under_callgrind(argv, callgrind)
    with open(log, "wb") as out:
        process = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_pinned(SERVER_CORE),  # type: ignore[arg-type]
        )
    try:
        deadline = time.monotonic() + (120 if CALLGRIND else 30)
        while True:  # bounded readiness poll of an external process
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("nginx did not start:\n" + log.read_text(errors="replace"))
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        yield Server(
            NGINX, process, port, "/v1/chat/completions", "pipeline", log, API_KEY, callgrind
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGQUIT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def floor_table(results: Mapping[str, Mapping[str, Result]]) -> None:
    """The gateway against its two floors, a row per cell: CPU per request and p99 (and
    instructions per request under callgrind); then what the spend ledger and key
    governance add, when they ran, beside."""
    gateway = "chat-pipeline serve"
    rows = []
    for key, servers in results.items():
        ours, floor, nginx = servers.get(gateway), servers.get(FLOOR), servers.get(NGINX)
        if ours is None or (floor is None and nginx is None):
            continue
        rows.append((key, ours, floor, nginx, servers))
    if not rows:
        return
    print("\nthe gateway against its floors (CPU ms per request; p99 ms)")
    print(
        f"  {'cell':42} {'gateway':>8} {'floor':>8} {'nginx':>8} {'gw/floor':>9} "
        f"{'gw/nginx':>9} {'p99 gw':>8} {'p99 fl':>8} {'p99 ngx':>8} {'p99 gw/fl':>9}"
    )

    def cpu(r: Result | None) -> str:
        return f"{r.cpu_per_request * 1000:8.3f}" if r else f"{'-':>8}"

    def p99(r: Result | None) -> str:
        return f"{r.p99 * 1000:8.2f}" if r else f"{'-':>8}"

    def ratio(a: float, b: Result | None, field: str) -> str:
        return f"{a / getattr(b, field):9.2f}" if b and getattr(b, field) else f"{'-':>9}"

    # Each cell's gateway, and the --baseline checkout's measured in the same rounds below it.
    lines = [
        (label, row, floor, nginx)
        for key, ours, floor, nginx, servers in rows
        for label, row in ((key, ours), (f"before: {key}", servers.get(BASELINE + gateway)))
        if row is not None
    ]
    for label, row, floor, nginx in lines:
        print(
            f"  {label:42} {cpu(row)} {cpu(floor)} {cpu(nginx)} "
            f"{ratio(row.cpu_per_request, floor, 'cpu_per_request')} "
            f"{ratio(row.cpu_per_request, nginx, 'cpu_per_request')} "
            f"{p99(row)} {p99(floor)} {p99(nginx)} {ratio(row.p99, floor, 'p99')}"
        )
    if any(ours.instructions is not None for _, ours, *_ in rows):
        print("\ninstructions per request (thousands, callgrind)")
        print(
            f"  {'cell':42} {'gateway':>8} {'floor':>8} {'nginx':>8} {'gw/floor':>9} "
            f"{'gw/nginx':>9}"
        )

        def count(r: Result | None) -> str:
            return f"{r.instructions / 1000:8.1f}" if r and r.instructions else f"{'-':>8}"

        for label, row, floor, nginx in lines:
            print(
                f"  {label:42} {count(row)} {count(floor)} {count(nginx)} "
                f"{ratio(row.instructions or 0, floor, 'instructions')} "
                f"{ratio(row.instructions or 0, nginx, 'instructions')}"
            )
    beside = [name for name in (LEDGER_NAME, GOVERNED_NAME) if any(name in r[4] for r in rows)]
    if beside:
        print("\nbeside: the gateway with the spend ledger, or key governance, on (CPU ms per")
        print("request; what it adds to the plain gateway's; its CPU over the floor's)")
        for key, ours, floor, _, servers in rows:
            for name in beside:
                on = servers.get(name)
                if on is None:
                    continue
                added = on.cpu_per_request - ours.cpu_per_request
                print(
                    f"  {key:34} {name:44} {cpu(on)} {added * 1000:+8.3f} "
                    f"{ratio(on.cpu_per_request, floor, 'cpu_per_request')}"
                )
    sys.stdout.flush()


def report(key: str, rows: Mapping[str, Result]) -> None:
    print(f"\n{key}")
    print(
        f"  {'server':44} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/req':>11} "
        f"{'req/CPU-s':>10}"
    )
    for name, r in rows.items():
        counted = f" {r.instructions / 1000:10.1f}k instructions" if r.instructions else ""
        print(
            f"  {name:44} {r.throughput:8.0f} {r.p50 * 1000:8.2f} {r.p99 * 1000:8.2f} "
            f"{r.cpu_per_request * 1000:11.3f} {r.per_core:10.0f}{counted}"
        )
    for name, r in rows.items():
        base = rows.get(BASELINE + name)
        if base is not None:
            print(
                f"  {name} / baseline: {r.per_core / base.per_core:.2f}x throughput per "
                f"core, {r.throughput / base.throughput:.2f}x throughput, "
                f"p99 {r.p99 * 1000:.2f} vs {base.p99 * 1000:.2f} ms"
            )
    litellm = rows.get("LiteLLM proxy")
    ours = rows.get("chat-pipeline serve")
    if litellm is not None and ours is not None:
        print(
            f"  chat-pipeline serve / LiteLLM proxy: {ours.per_core / litellm.per_core:.1f}x "
            f"throughput per core, {ours.throughput / litellm.throughput:.1f}x throughput, "
            f"p99 {ours.p99 * 1000:.2f} vs {litellm.p99 * 1000:.2f} ms"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
