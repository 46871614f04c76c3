"""What the spend ledger costs: the gateway's CPU per request with the ledger on (PostgreSQL)
against off, and how many records the ledger writes per second per core.

    python benchmarks/bench_spend.py                         # both, the defaults
    python benchmarks/bench_spend.py --requests 4000 --rounds 5
    python benchmarks/bench_spend.py --records 100000 --no-gateway
    python benchmarks/bench_spend.py --instructions 300 --no-gateway --no-writes

The gateway part runs two ``chat-pipeline serve`` processes (one worker, one route to the
fake upstream, a priced model), the same configuration without and with ``[spend] store =
"postgres"``, pinned to core 0, and loads them with `bench_gateway`'s load generator at
concurrency 1 and 16, streamed and not. Rounds interleave the two servers and the best round
of each is kept; the ratio is ledger-on CPU per request over ledger-off, measured in the same
run. The target is at most 1.10x.

With ``--instructions N``, the same two configurations are counted in instructions instead
(valgrind's callgrind, so a busy machine does not move them), as
`bench_gateway_instructions.py` counts the gateway: its ASGI app called in process (no HTTP
server, no client, the upstream in a process of its own), N and 5N requests in fresh
processes, the difference over the extra requests; streamed and not. The ledger's writer
task runs in the counted process, so the records' writing is counted too.

The records part writes `--records` records through a `SpendLedger` (batches of
`--batch`) into SQLite and into a throwaway PostgreSQL (tests/postgres_server.py, Debian's
server), and reports records per second of wall time and per CPU-second (this process's CPU,
plus the PostgreSQL server's). The target is at least 20,000 records per second per core.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from bench_gateway import (
    API_KEY,
    CLIENT_CORE,
    KEYS_VARIABLE,
    Result,
    _fake_upstream,
    cpu_seconds,
    measure,
    started,
)
from bench_gateway_instructions import CHILD, ROOT, instructions

from pipeline import _db
from pipeline.spend import (
    Attribution,
    PostgresSpendStore,
    SpendLedger,
    SpendRecord,
    SQLiteSpendStore,
)
from pipeline.spend._record import new_record_id
from tests.postgres_server import running_postgres

DSN_VARIABLE = "BENCH_SPEND_DSN"


def gateway_config(workdir: Path, upstream: str, ledger: bool, *, keys: bool = True) -> Path:
    path = workdir / ("gateway-spend.toml" if ledger else "gateway.toml")
    text = f'[gateway]\napi_keys_env = "{KEYS_VARIABLE}"\n\n' if keys else ""
    text += (
        f'[routes.primary]\nprovider = "openai"\nmodel = "gpt-4o-mini"\nbase_url = "{upstream}"\n'
    )
    if ledger:
        text += f'\n[spend]\nstore = "postgres"\ndsn_env = "{DSN_VARIABLE}"\n'
    path.write_text(text)
    return path


def gateway_part(args: argparse.Namespace, workdir: Path, dsn: str) -> None:
    env = {**os.environ, KEYS_VARIABLE: API_KEY, DSN_VARIABLE: dsn}
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(_fake_upstream(workdir))
        servers = {
            name: stack.enter_context(
                started(
                    f"chat-pipeline serve{suffix}",
                    [
                        sys.executable,
                        "-m",
                        "pipeline",
                        "serve",
                        "--config",
                        str(gateway_config(workdir, upstream, ledger)),
                        "--port",
                        "0",
                        "--log-level",
                        "info",
                    ],
                    ready_path="/readyz",
                    workdir=workdir,
                    env=env,
                )
            )
            for name, suffix, ledger in (("off", "", False), ("on", " ([spend] postgres)", True))
        }
        print(
            f"\ngateway CPU per request, ledger on (PostgreSQL) / off "
            f"({args.requests} requests, best of {args.rounds} rounds)"
        )
        print(f"  {'shape':32} {'off ms/req':>11} {'on ms/req':>10} {'ratio':>7} {'on p99 ms':>10}")
        for shape, concurrency in itertools.product(
            ("non-streaming", "streaming"), args.concurrency
        ):
            best: dict[str, Result] = {}
            for _ in range(args.rounds):
                for name, server in servers.items():
                    result = measure(
                        server,
                        stream=shape == "streaming",
                        concurrency=concurrency,
                        requests=args.requests,
                        warmup=args.warmup,
                    )
                    kept = best.get(name)
                    if kept is None or result.cpu_per_request < kept.cpu_per_request:
                        best[name] = result
            off, on = best["off"], best["on"]
            print(
                f"  {shape + f', concurrency {concurrency}':32} "
                f"{off.cpu_per_request * 1000:11.3f} {on.cpu_per_request * 1000:10.3f} "
                f"{on.cpu_per_request / off.cpu_per_request:6.2f}x {on.p99 * 1000:10.2f}"
            )
            sys.stdout.flush()


# `bench_gateway_instructions`'s child, its request streamed when BENCH_SPEND_STREAM is 1.
_BODY_LINE = "body = body.encode()"
if _BODY_LINE not in CHILD:
    raise RuntimeError("bench_gateway_instructions' child no longer makes its body that way")
STREAMING_CHILD = CHILD.replace(
    _BODY_LINE,
    "body = json.dumps({**json.loads(body), "
    '"stream": os.environ.get("BENCH_SPEND_STREAM") == "1"}).encode()',
)


def instructions_part(args: argparse.Namespace, workdir: Path, dsn: str) -> None:
    child = workdir / "child.py"
    child.write_text(STREAMING_CHILD)
    os.environ[DSN_VARIABLE] = dsn
    n = args.instructions
    more = 5 * n
    print(f"\ngateway instructions per request, ledger on (PostgreSQL) / off ({n} and {more})")
    print(f"  {'shape':16} {'off':>10} {'on':>10} {'ratio':>7}")
    with _fake_upstream(workdir) as upstream:
        for shape in ("non-streaming", "streaming"):
            os.environ["BENCH_SPEND_STREAM"] = "1" if shape == "streaming" else "0"
            counted: dict[str, float] = {}
            for name, ledger in (("off", False), ("on", True)):
                config = gateway_config(workdir, upstream, ledger, keys=False)
                low = instructions(ROOT, child, config, n, False)
                high = instructions(ROOT, child, config, more, False)
                counted[name] = (high - low) / (more - n)
            print(
                f"  {shape:16} {counted['off'] / 1000:9,.1f}k {counted['on'] / 1000:9,.1f}k "
                f"{counted['on'] / counted['off']:6.3f}x"
            )
            sys.stdout.flush()


def records(count: int) -> list[SpendRecord]:
    now = datetime.now(UTC)
    who = Attribution(key="k1", key_name="ci", user="u1", team="ml", tags=("web", "batch"))
    return [
        SpendRecord(
            id=new_record_id(),
            time=now,
            request_id=f"req-{n}",
            attempt=1,
            route="primary",
            provider="openai",
            model_requested="gpt-4o-mini",
            model_served="gpt-4o-mini-2024-07-18",
            input_tokens=1200,
            output_tokens=300,
            cache_read_tokens=400,
            cost=Decimal("0.000348"),
            duration_ms=812.5,
            time_to_first_update_ms=210.25,
        ).attributed(who)
        for n in range(count)
    ]


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def write_all(store: object, batch: int, made: list[SpendRecord]) -> float:
    ledger = SpendLedger(store, max_batch=batch, max_queue=len(made) + 1, flush_interval=3600)  # type: ignore[arg-type]
    started = time.perf_counter()
    ledger.record(made)
    while ledger.queued:
        await ledger.flush()
    elapsed = time.perf_counter() - started
    assert ledger.written == len(made), (ledger.written, len(made))
    await ledger.aclose()
    return elapsed


def records_part(args: argparse.Namespace, workdir: Path, postgres: object) -> None:
    print(f"\nrecords written ({args.records} records, batches of {args.batch})")
    print(f"  {'store':12} {'records/s':>10} {'per CPU-s':>10}")
    for name in ("sqlite", "postgres"):
        made = records(args.records)
        if name == "sqlite":
            store: object = SQLiteSpendStore(workdir / "spend.db")
            server_pid = None
        else:
            store = PostgresSpendStore(postgres.dsn, pool_size=1)  # type: ignore[attr-defined]
            server_pid = postgres._child.pid  # type: ignore[attr-defined]
        asyncio.run(write_all(store, args.batch, records(args.batch)))  # schema, connection
        if name == "sqlite":
            store = SQLiteSpendStore(workdir / "spend.db")
        else:
            store = PostgresSpendStore(postgres.dsn, pool_size=1)  # type: ignore[attr-defined]
        cpu_before = own_cpu() + (cpu_seconds(server_pid) if server_pid else 0.0)
        elapsed = asyncio.run(write_all(store, args.batch, made))
        cpu = own_cpu() + (cpu_seconds(server_pid) if server_pid else 0.0) - cpu_before
        print(f"  {name:12} {args.records / elapsed:10.0f} {args.records / cpu:10.0f}")
        sys.stdout.flush()


async def upgrade(dsn: str) -> None:
    database = _db.open_database(dsn)
    try:
        await _db.upgrade(database)
    finally:
        await database.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--gateway", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--writes", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--instructions", type=int, metavar="N", help="count instructions with N and 5N requests"
    )
    args = parser.parse_args(argv)
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {CLIENT_CORE})
    workdir = Path(tempfile.mkdtemp(prefix="bench-spend-"))
    try:
        with running_postgres() as postgres:
            asyncio.run(upgrade(postgres.dsn))
            if args.gateway:
                gateway_part(args, workdir, postgres.dsn)
            if args.instructions:
                instructions_part(args, workdir, postgres.dsn)
            if args.writes:
                records_part(args, workdir, postgres)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
