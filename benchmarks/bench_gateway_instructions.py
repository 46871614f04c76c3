"""The gateway's instructions per request, counted by valgrind's callgrind: what
`bench_gateway.py` measures in CPU time, without the noise of a shared machine.

    python benchmarks/bench_gateway_instructions.py [--baseline /path/to/other/checkout]

The gateway's ASGI app (`create_app`, the layers and the pipeline a TOML file builds) is
called in process, with no HTTP server in front, for a Chat Completions request
(``--stream``: a streamed one) to a route calling ``chat-pipeline fake-server`` (run in a
process of its own, not counted; ``--words`` and ``--chunk-delay`` are passed to it) over
loopback: ``plain`` is one OpenAI-compatible route, ``full`` ordered failover over two with
retry and a breaker on the first. The scope is the one the gateway's own server makes (its
disconnect hook in place: no task watches ``receive``). With ``--floor``, the Python floor
of ``bench_gateway.py`` (``benchmarks/_floor.py``'s app, a key checked and a line logged) is
counted the same way on the same upstream, and each case's ratio to it printed (uvicorn's
own work a request, the same for both, is left out of both: the ratio comes out larger than
``bench_gateway.py``'s). Each case runs `--requests` and 5x
`--requests` requests in fresh processes under callgrind; the difference, divided by the
extra requests, cancels the start-up. The app runs on uvloop when it is installed, as
``chat-pipeline serve`` does (asyncio's own loop makes its timers in Python: aiohttp's read
timers alone cost some 30 thousand instructions a request more there). With ``--logs``
the gateway's loggers write to /dev/null at INFO (the request line it logs by default);
without, they are off. The handlers' streams are line-buffered, as stderr is under
``chat-pipeline serve`` (the request line is then written without its record).
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
from pathlib import Path

from bench_gateway import _fake_upstream

ROOT = Path(__file__).resolve().parents[1]

# The child: the app of a TOML file, called `n` times; run under callgrind.
CHILD = textwrap.dedent(
    """
    import asyncio, json, logging, os, sys
    from pipeline.config import load_config
    from pipeline.gateway.app import create_app

    n, config, logs = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "logs"
    stream = sys.argv[4] == "stream"
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
                handler.setStream(open(os.devnull, "w", buffering=1))
    else:
        logging.disable(logging.CRITICAL)
    headers = []
    if config.startswith("floor="):
        sys.path.insert(0, sys.argv[5])  # the benchmarks' directory
        from _floor import Floor
        floor_log = logging.getLogger("floor")
        floor_log.setLevel(logging.INFO if logs else logging.CRITICAL)
        floor_log.addHandler(logging.StreamHandler(open(os.devnull, "w", buffering=1)))
        app = Floor(config.removeprefix("floor="), "key")
        headers = [(b"authorization", b"Bearer key")]
    else:
        app = create_app(load_config(config))
    request = {"model": "pipeline", "messages": [{"role": "user", "content": "Hi"}]}
    if stream:
        request["stream"] = True
    body = json.dumps(request).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "query_string": b"", "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 8080),
        "scheme": "http", "root_path": "",
        "headers": [
            (b"host", b"gateway"), (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ],
        "chat_pipeline.on_disconnect": None,  # as the gateway's own server's scopes
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
            assert not sent[-1].get("more_body"), sent[-1]  # the answer ended
            if stream:
                assert b"data: [DONE]" in b"".join(m.get("body", b"") for m in sent[1:])
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


def instructions(
    tree: Path, child: Path, config: Path | str, n: int, logs: bool, stream: bool
) -> int:
    out = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            str(child),
            str(n),
            str(config),
            "logs" if logs else "-",
            "stream" if stream else "whole",
            str(tree / "benchmarks"),
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
    parser.add_argument("--stream", action="store_true", help="streamed requests")
    parser.add_argument("--floor", action="store_true", help="count the Python floor too")
    parser.add_argument("--words", type=int, help="the fake's answers of N words")
    parser.add_argument("--chunk-delay", type=float, help="the fake's pause between events")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    child = work / "child.py"
    child.write_text(CHILD)
    with _fake_upstream(work, args.chunk_delay, args.words) as url:
        trees = {"this checkout": ROOT}
        if args.baseline is not None:
            trees["baseline"] = args.baseline.resolve()
        n, more = args.requests, args.requests * 5
        results: dict[str, dict[str, float]] = {}
        cases: dict[str, Path | str] = {case: config(work, url, case) for case in ("plain", "full")}
        if args.floor:
            cases["floor"] = "floor=" + url
        for case, setting in cases.items():
            for name, tree in trees.items():
                if case == "floor" and name == "baseline":
                    continue  # the floor is this checkout's
                low = instructions(tree, child, setting, n, args.logs, args.stream)
                high = instructions(tree, child, setting, more, args.logs, args.stream)
                results.setdefault(case, {})[name] = (high - low) / (more - n)
        shown = "streamed" if args.stream else "whole"
        print(f"instructions per {shown} request (logs {'on' if args.logs else 'off'}):")
        floor = results.get("floor", {}).get("this checkout")
        for case, row in results.items():
            line = f"  {case:6} " + "  ".join(f"{k}: {v / 1000:,.1f}k" for k, v in row.items())
            if "baseline" in row:
                line += f"  ratio {row['this checkout'] / row['baseline']:.3f}x"
            if floor and case != "floor":
                line += f"  / floor {row['this checkout'] / floor:.2f}x"
            print(line)
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
