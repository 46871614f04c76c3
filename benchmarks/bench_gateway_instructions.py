"""The gateway's instructions per request, counted by valgrind's callgrind: what
`bench_gateway.py` measures in CPU time, without the noise of a shared machine.

    python benchmarks/bench_gateway_instructions.py [--baseline /path/to/other/checkout]

The gateway's ASGI app (`create_app`, the layers and the pipeline a TOML file builds) is
called in process, with no HTTP server in front, for a non-streaming Chat Completions
request to a route calling ``chat-pipeline fake-server`` (run in a process of its own, not
counted) over loopback: ``plain`` is one OpenAI-compatible route, ``full`` ordered failover
over two with retry and a breaker on the first. Each case runs `--requests` and 5x
`--requests` requests in fresh processes under callgrind; the difference, divided by the
extra requests, cancels the start-up. The app runs on uvloop when it is installed, as
``chat-pipeline serve`` does (asyncio's own loop makes its timers in Python: aiohttp's read
timers alone cost some 30 thousand instructions a request more there). With ``--logs``
the gateway's loggers write to /dev/null at INFO (the request line it logs by default);
without, they are off.
``--baseline PATH`` counts the checkout at PATH too (e.g. ``git archive`` of an older
commit) and prints each case's ratio to it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The child: the app of a TOML file, called `n` times; run under callgrind.
CHILD = textwrap.dedent(
    """
    import asyncio, json, logging, os, sys
    from pipeline.config import load_config
    from pipeline.gateway.app import create_app

    n, config, logs = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "logs"
    if logs:
        # The gateway's own logging configuration where the checkout has one (an older
        # one logged through uvicorn's), every handler writing to /dev/null.
        import logging.config
        import uvicorn.config
        from pipeline.gateway import server
        made = getattr(server, "log_config", None)
        logging.config.dictConfig(made("info") if made else uvicorn.config.LOGGING_CONFIG)
        for name in ("", "chat_pipeline", "uvicorn", "uvicorn.error"):
            for handler in logging.getLogger(name).handlers:
                handler.setStream(open(os.devnull, "w"))
    else:
        logging.disable(logging.CRITICAL)
    app = create_app(load_config(config))
    body = json.dumps({"model": "pipeline", "messages": [{"role": "user", "content": "Hi"}]})
    body = body.encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "query_string": b"", "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 8080),
        "scheme": "http", "root_path": "",
        "headers": [
            (b"host", b"gateway"), (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
    }

    async def main():
        inbox, outbox = asyncio.Queue(), asyncio.Queue()
        await inbox.put({"type": "lifespan.startup"})
        lifespan = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        life = asyncio.create_task(app(lifespan, inbox.get, outbox.put))
        assert (await outbox.get())["type"] == "lifespan.startup.complete"
        for _ in range(n):
            sent, given = [], asyncio.Event()

            async def receive():
                if given.is_set():
                    await asyncio.Event().wait()  # no disconnect: the request runs out
                given.set()
                return {"type": "http.request", "body": body, "more_body": False}

            async def send(message):
                sent.append(message)

            await app(dict(scope, state={}), receive, send)
            assert sent[0]["status"] == 200, sent
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await life

    try:
        import uvloop  # the loop the gateway serves on (uvicorn's "auto")
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
    """
)


def config(directory: Path, upstream: str, case: str) -> Path:
    route = f'provider = "openai"\nmodel = "fake-model"\nbase_url = "{upstream}"\n'
    text = "[routes.primary]\n" + route
    if case == "full":
        text += (
            "retry = { max_attempts = 2 }\nbreaker = { fail_max = 5, reset_timeout = 30 }\n"
            "\n[routes.backup]\n"
            + route
            + '\n[router]\nkind = "ordered"\norder = ["primary", "backup"]\n'
        )
    path = directory / f"{case}.toml"
    path.write_text(text)
    return path


def instructions(tree: Path, child: Path, config_path: Path, n: int, logs: bool) -> int:
    out = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            str(child),
            str(n),
            str(config_path),
            "logs" if logs else "-",
        ],
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise RuntimeError(out.stderr[-2000:])
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--baseline", type=Path)
    parser.add_argument("--logs", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    child = work / "child.py"
    child.write_text(CHILD)
    upstream_log = work / "upstream.log"
    with open(upstream_log, "wb") as out:
        upstream = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "fake-server", "--port", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    try:
        deadline = time.monotonic() + 60
        while not (found := re.search(r"(http://127\.0\.0\.1:\d+/v1)", upstream_log.read_text())):
            if upstream.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fake upstream did not start: " + upstream_log.read_text())
            time.sleep(0.05)
        url = found.group(1)
        trees = {"this checkout": ROOT}
        if args.baseline is not None:
            trees["baseline"] = args.baseline.resolve()
        n, more = args.requests, args.requests * 5
        results: dict[str, dict[str, float]] = {}
        for case in ("plain", "full"):
            path = config(work, url, case)
            for name, tree in trees.items():
                low = instructions(tree, child, path, n, args.logs)
                high = instructions(tree, child, path, more, args.logs)
                results.setdefault(case, {})[name] = (high - low) / (more - n)
        print(f"instructions per request (logs {'on' if args.logs else 'off'}):")
        for case, row in results.items():
            line = f"  {case:6} " + "  ".join(f"{k}: {v / 1000:,.1f}k" for k, v in row.items())
            if "baseline" in row:
                line += f"  ratio {row['this checkout'] / row['baseline']:.3f}x"
            print(line)
        print(json.dumps(results))
    finally:
        upstream.terminate()
        upstream.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
