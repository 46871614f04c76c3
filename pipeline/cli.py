"""The `chat-pipeline` command (also `python -m pipeline`): ``demo``, ``ask``, ``eval``,
``serve``, ``db``, ``spend``, ``keys``, ``fake-server`` and ``fake-fleet``. Each prints its
options with ``--help``; the CLI reference in the docs describes them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE

from middleware.routing import Route
from pipeline._semconv import (
    ROUTE_ATTEMPTS,
    ROUTE_FALLBACK,
    ROUTE_NAME,
    ROUTE_OUTCOME,
    ROUTE_OUTPUT_COMMITTED,
    ROUTE_TERMINAL,
    ROUTE_TIME_TO_FIRST_UPDATE,
)
from pipeline.builder import ChatPipeline
from pipeline.errors import TransientProviderError

if TYPE_CHECKING:
    from pipeline.telemetry import TelemetryHandle

__all__ = ["main"]

DEMO_ANSWER = "Failover kept this answer flowing: the backup route streamed it."


def _demo_pipeline(
    tracer_provider: TracerProvider, meter_provider: MeterProvider | None = None
) -> ChatPipeline:
    from pipeline.testing import ScriptedChatClient, fail, reply

    primary = ScriptedChatClient(
        lambda messages, options: fail(
            TransientProviderError(status_code=503, provider="simulated")
        ),
        name="primary",
        model_id="simulated-large",
    )
    words = [word + " " for word in DEMO_ANSWER.split(" ")]
    words[-1] = words[-1].rstrip()
    backup = ScriptedChatClient(
        reply(DEMO_ANSWER, chunks=words, chunk_delay=0.01),
        name="backup",
        model_id="simulated-small",
    )
    return (
        ChatPipeline.builder()
        .use_telemetry(tracer_provider=tracer_provider, meter_provider=meter_provider)
        .use_logging()
        .use_ordered_failover(
            [Route("primary", primary), Route("backup", backup)],
            tracer_provider=tracer_provider,
            meter_provider=meter_provider,
        )
        .build(name="demo")
    )


def _ms(seconds: object) -> str:
    return f"{float(seconds) * 1000:.2f} ms" if isinstance(seconds, int | float) else "-"


def trace_tree(spans: Sequence[ReadableSpan]) -> list[str]:
    """Lines drawing `spans` as trees, children under parents, in start order."""
    by_parent: dict[int | None, list[ReadableSpan]] = {}
    ids = {s.context.span_id for s in spans if s.context is not None}
    for span in sorted(spans, key=lambda s: s.start_time or 0):
        parent = span.parent.span_id if span.parent is not None else None
        by_parent.setdefault(parent if parent in ids else None, []).append(span)
    lines: list[str] = []

    def draw(span: ReadableSpan, depth: int) -> None:
        attributes = dict(span.attributes or {})
        duration = ((span.end_time or 0) - (span.start_time or 0)) / 1e9
        if span.name.startswith("route_attempt"):
            detail = (
                f"outcome={attributes.get(ROUTE_OUTCOME)} "
                f"committed={attributes.get(ROUTE_OUTPUT_COMMITTED)} "
                f"time_to_first_update={_ms(attributes.get(ROUTE_TIME_TO_FIRST_UPDATE))} "
                f"terminal={attributes.get(ROUTE_TERMINAL)}"
            )
        elif ROUTE_NAME in attributes:
            detail = (
                f"{duration * 1000:.2f} ms  route={attributes.get(ROUTE_NAME)} "
                f"attempts={attributes.get(ROUTE_ATTEMPTS)} "
                f"fallback={attributes.get(ROUTE_FALLBACK)}"
            )
        else:
            detail = f"{duration * 1000:.2f} ms"
        error = attributes.get(ERROR_TYPE)
        lines.append(f"{'  ' * depth}{span.name}  {detail}" + (f"  error={error}" if error else ""))
        for child in by_parent.get(span.context.span_id if span.context else None, []):
            draw(child, depth + 1)

    for root in by_parent.get(None, []):
        draw(root, 1)
    return lines


async def _demo(question: str, otlp: str | None) -> int:
    handle = None
    if otlp or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from pipeline.telemetry import configure

        handle = configure("chat-pipeline-demo", endpoint=otlp, set_global=False)
    tracer_provider = (handle.tracer_provider if handle else None) or TracerProvider()
    spans = InMemorySpanExporter()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    chat = _demo_pipeline(tracer_provider, handle.meter_provider if handle else None)
    try:
        async with chat:
            print(f"pipeline: {' -> '.join(chat.describe())}")
            print(f"question: {question}")
            print("answer (streamed):   ", end="")
            async for update in chat.get_streaming_response(question):
                print(update.text, end="", flush=True)
            print()
            print("trace:")
            print("\n".join(trace_tree(spans.get_finished_spans())))
            spans.clear()
            response = await chat.get_response(question)
            print(f"answer (whole):      {response.text}")
            print("trace:")
            print("\n".join(trace_tree(spans.get_finished_spans())))
    finally:
        if handle is not None:
            handle.shutdown()
            print(_export_report(handle, otlp or os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]))
    return 0


def _export_report(handle: TelemetryHandle, target: str) -> str:
    """What reached `target` and what it refused, by signal (after the final flush)."""
    exported: list[str] = []
    refused: list[str] = []
    for name, provider, tally in (
        ("spans", handle.tracer_provider, handle.spans),
        ("metrics", handle.meter_provider, handle.metrics),
    ):
        if provider is None:
            continue  # turned off (OTEL_*_EXPORTER=none)
        if tally.failed:
            refused.append(f"{name} ({tally.failed} of {tally.accepted + tally.failed} exports)")
        elif tally.accepted:
            exported.append(name)
    parts = []
    if exported:
        parts.append(f"{' and '.join(exported)} exported to {target}")
    if refused:
        parts.append(
            f"{' and '.join(refused)} refused by {target} or lost on the way (see the "
            "exporter's error above; a traces-only backend such as Arize Phoenix takes no "
            "metrics: OTEL_METRICS_EXPORTER=none turns them off)"
        )
    return "; ".join(parts) or f"nothing exported to {target}"


async def _ask(question: str, config: str, environment: str | None) -> int:
    from pipeline.errors import ConfigError

    try:
        chat = ChatPipeline.from_config(config, environment)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    async with chat:
        async for update in chat.get_streaming_response(question):
            print(update.text, end="", flush=True)
    print()
    return 0


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


class _ReportFile:
    """The ``--json`` file, opened before any case runs (a path that cannot be written is
    found before the work, not after it). It is opened to append, so an existing file is
    untouched until the report replaces its content; a file this run created is removed
    when the run ends without a report."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._created = not os.path.lexists(path)
        self._stream = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept for the run

    def write(self, report: object) -> None:
        import json

        with self._stream as out:
            if out.seekable():  # a regular file (not /dev/stdout): replace what it held
                out.seek(0)
                out.truncate()
            json.dump(report, out, indent=2)
            out.write("\n")

    def discard(self) -> None:
        import contextlib

        self._stream.close()
        if self._created:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def _eval(args: argparse.Namespace) -> int:
    from pipeline.errors import ConfigError
    from pipeline.evals import load_validators, run_eval

    def progress(done: int, total: int) -> None:
        print(f"\reval: {done}/{total} requests", end="", file=sys.stderr, flush=True)

    output = None
    if args.json:
        try:
            output = _ReportFile(args.json)
        except OSError as exc:
            print(f"cannot write {args.json}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    routes = [name.strip() for name in args.routes.split(",")] if args.routes else None
    try:
        validators = load_validators(args.validators) if args.validators else {}
        report = asyncio.run(
            run_eval(
                args.config,
                args.cases,
                environment=args.env,
                routes=routes,
                validators=validators,
                concurrency=args.concurrency,
                request_timeout=args.timeout,
                include_text=args.include_text,
                progress=progress if sys.stderr.isatty() else None,
            )
        )
    except BaseException as exc:
        if output is not None:
            output.discard()
        if isinstance(exc, ConfigError):
            print(f"configuration error: {exc}", file=sys.stderr)
            return 2
        raise
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(report.table())
    failures = report.failures()
    if failures:
        print("\nfailed cases:\n" + failures)
    if output is not None:
        try:
            output.write(report.to_json())
        except OSError as exc:
            print(f"cannot write {args.json}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    if args.min_pass_rate is not None:
        below = report.below(args.min_pass_rate)
        if below:
            print(
                f"below the minimum pass rate {args.min_pass_rate:.1%}: {', '.join(below)}",
                file=sys.stderr,
            )
            return 1
    return 0


async def _fake_server(
    port: int,
    wire_format: str = "openai",
    chunk_delay: float | None = None,
    words: int | None = None,
) -> int:
    from pipeline.testing import FAKE_SERVERS, FakeResponse

    default = None
    if chunk_delay or words:
        default = FakeResponse(chunk_delay=chunk_delay or 0.0)
        if words:  # a stream's content events, one a word
            text = " ".join(f"word{n}" for n in range(1, words + 1)) + "."
            default = dataclasses.replace(default, text=text)
    server = FAKE_SERVERS[wire_format](port=port, default=default)
    await server.start()
    print(f"fake {server.title} server on {server.base_url}", flush=True)
    # Stop cleanly on Ctrl-C or SIGTERM, even where the shell that started the command left
    # SIGINT ignored (a background job of a non-interactive shell does).
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await server.stop()
    return 0


def _fake_fleet(args: argparse.Namespace) -> int:
    from pipeline.testing._fake_fleet import serve_fleet

    async def run() -> int:
        # Stop on Ctrl-C or SIGTERM as the fake server does.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        return await serve_fleet(
            args.scenario, seed=args.seed, manual_start=args.manual_start, stop=stop
        )

    try:
        return asyncio.run(run())
    except (ValueError, TypeError) as exc:
        print(f"scenario error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


def _database_arguments(parser: argparse.ArgumentParser) -> None:
    """Which database a command works on: a file's ``[spend]`` table's, or a URL's."""
    parser.add_argument("--config", metavar="FILE", help="the TOML file with a [spend] table")
    parser.add_argument("--env", metavar="NAME", help="environment overlay")
    parser.add_argument(
        "--database-env",
        metavar="VAR",
        help="the environment variable holding the database's URL (instead of --config)",
    )


def _database_of(args: argparse.Namespace) -> object:
    """The database a ``db`` command names (`pipeline._db.Database`): ``--database-env``'s
    URL, else the ``[spend]`` table's of ``--config``. `ConfigError` when there is none."""
    from pipeline import _db
    from pipeline.config import load_config
    from pipeline.errors import ConfigError

    if args.database_env:
        url = os.environ.get(args.database_env)
        if not url:
            raise ConfigError(
                "--database-env", f"the environment variable {args.database_env} is not set"
            )
        return _db.open_database(url)
    if not args.config:
        raise ConfigError("--config", "name the configuration file (or --database-env)")
    config = load_config(args.config, args.env)
    if config.spend is None:
        raise ConfigError("spend", "the file has no [spend] table: no database to upgrade")
    return _db.open_database(config.spend.database_url(), timeout=config.spend.timeout)


def _database(args: argparse.Namespace) -> int:
    from pipeline import _db
    from pipeline.errors import ConfigError, SchemaVersionError

    try:
        database = _database_of(args)
    except (ConfigError, ValueError) as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    assert isinstance(database, _db.Database)

    async def run() -> int:
        try:
            latest = _db.latest_version(database.dialect)
            if args.action == "upgrade":
                applied = await _db.upgrade(database)
                for migration in applied:
                    print(f"applied {migration.version:04d}_{migration.name}")
                print(
                    f"{database.describe()}: schema at version {latest} (the latest)"
                    + ("" if applied else "; nothing to apply")
                )
                return 0
            found = await _db.schema_version(database)
            state = "up to date" if found == latest else "run `chat-pipeline db upgrade`"
            print(f"{database.describe()}: schema at version {found} of {latest} ({state})")
            return 0 if found == latest else 1
        finally:
            await database.aclose()

    try:
        return asyncio.run(run())
    except SchemaVersionError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except Exception as exc:  # the database's failure, told by its type
        # The type only: a driver's message may name hosts or users.
        print(f"{database.describe()} failed ({type(exc).__name__})", file=sys.stderr)
        return 1


def _spend(args: argparse.Namespace) -> int:
    from pipeline import _db
    from pipeline.errors import ConfigError, SchemaVersionError
    from pipeline.spend import SqlSpendStore
    from pipeline.spend._report import parse_time, parse_where, render

    try:
        database = _database_of(args)
        group_by = [g.strip() for g in (args.group_by or "").split(",") if g.strip()]
        since = parse_time(args.since) if args.since else None
        until = parse_time(args.until) if args.until else None
        where = parse_where(args.where or [])
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    assert isinstance(database, _db.Database)
    store = SqlSpendStore(database, auto_upgrade=False)

    async def run() -> str:
        try:
            found = await store.summary(group_by, since=since, until=until, where=where)
        finally:
            await store.aclose()
        return render(found, group_by, args.format)

    try:
        print(asyncio.run(run()), end="")
    except (SchemaVersionError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except Exception as exc:  # the database's failure, told by its type
        print(f"{database.describe()} failed ({type(exc).__name__})", file=sys.stderr)
        return 1
    return 0


def _serve(args: argparse.Namespace) -> int:
    from pipeline.errors import ConfigError

    try:
        from pipeline.gateway.server import serve
    except ImportError as exc:
        print(
            f"chat-pipeline serve needs the gateway extra ({exc.name} is missing): "
            "pip install 'chat-pipeline[gateway]'",
            file=sys.stderr,
        )
        return 2
    try:
        serve(
            args.config,
            args.env,
            host=args.host,
            port=args.port,
            workers=args.workers,
            log_level=args.log_level,
            prometheus_metrics=args.prometheus_metrics,
        )
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from pipeline.testing import FAKE_SERVERS

    parser = argparse.ArgumentParser(prog="chat-pipeline", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the embedded, network-free demo pipeline")
    demo.add_argument("question", nargs="?", default="What does failover do?")
    demo.add_argument(
        "--otlp", metavar="URL", help="also export spans and metrics to this OTLP/HTTP base URL"
    )
    ask = commands.add_parser("ask", help="ask a pipeline built from a TOML file")
    ask.add_argument("question")
    ask.add_argument("--config", required=True, metavar="FILE", help="the pipeline's TOML file")
    ask.add_argument("--env", metavar="NAME", help="environment overlay (else CHAT_PIPELINE_ENV)")
    evaluate = commands.add_parser(
        "eval", help="send a case set to each route of a TOML file and score the answers"
    )
    evaluate.add_argument("--config", required=True, metavar="FILE", help="the TOML file")
    evaluate.add_argument("--env", metavar="NAME", help="environment overlay")
    evaluate.add_argument("--cases", required=True, metavar="CASES.jsonl", help="one case a line")
    evaluate.add_argument("--routes", metavar="a,b", help="only these routes (default: all)")
    evaluate.add_argument(
        "--validators", metavar="MODULE:ATTR", help="validators the cases name (dict or list)"
    )
    evaluate.add_argument("--json", metavar="OUT", help="write every result to this JSON file")
    evaluate.add_argument(
        "--include-text", action="store_true", help="keep the answers in the JSON results"
    )
    evaluate.add_argument(
        "--min-pass-rate", type=_rate, metavar="X", help="exit 1 when a route passes less (0-1)"
    )
    evaluate.add_argument(
        "--concurrency", type=_positive_int, default=4, metavar="N", help="requests in flight"
    )
    evaluate.add_argument(
        "--timeout", type=_positive_seconds, default=120.0, metavar="S", help="per request"
    )
    server = commands.add_parser(
        "fake-server", help="serve a fake OpenAI-compatible API on 127.0.0.1 until interrupted"
    )
    server.add_argument("--port", type=int, default=8765)
    server.add_argument(
        "--format",
        choices=tuple(FAKE_SERVERS),
        default="openai",
        help="the wire format to speak (default: openai)",
    )
    server.add_argument(
        "--chunk-delay",
        type=_positive_seconds,
        metavar="S",
        help="pause S seconds between a stream's content events, as an upstream that writes "
        "each as it makes it (each then comes in a read of its own; the formats whose fakes "
        "pace their events)",
    )
    server.add_argument(
        "--words",
        type=_positive_int,
        metavar="N",
        help="answer N words (a stream's content events, one a word) instead of its sentence",
    )
    fleet = commands.add_parser(
        "fake-fleet", help="serve a FakeFleet scenario (TOML or JSON) on 127.0.0.1 until stopped"
    )
    fleet.add_argument("--scenario", required=True, metavar="FILE", help="the fleet's scenario")
    fleet.add_argument("--seed", type=int, help="replaces the scenario's seed")
    fleet.add_argument(
        "--manual-start", action="store_true", help="no fault until a 'start' line on stdin"
    )
    gateway = commands.add_parser(
        "serve", help="serve a pipeline built from a TOML file as an OpenAI-compatible API"
    )
    gateway.add_argument("--config", required=True, metavar="FILE", help="the pipeline's TOML file")
    gateway.add_argument(
        "--env", metavar="NAME", help="environment overlay (else CHAT_PIPELINE_ENV)"
    )
    gateway.add_argument("--host", default="127.0.0.1", help="address to listen on")
    gateway.add_argument("--port", type=int, default=8080)
    gateway.add_argument(
        "--workers", type=int, default=1, help="worker processes (each builds the pipeline)"
    )
    gateway.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's and the gateway's (info: one line per request)",
    )
    gateway.add_argument(
        "--prometheus-metrics",
        action="store_true",
        help="serve GET /metrics in the Prometheus text format ([gateway] prometheus_metrics)",
    )
    database = commands.add_parser(
        "db", help="apply the database's migrations, or show its schema's version"
    )
    database.add_argument("action", choices=("upgrade", "status"))
    _database_arguments(database)
    spend = commands.add_parser(
        "spend", help="add up the spend ledger's records by key, team, user, tag, route ..."
    )
    _database_arguments(spend)
    spend.add_argument(
        "--group-by",
        metavar="F,G",
        help="fields to group by: key, key_name, user, team, tag, endpoint, session, route, "
        "provider, model_requested, model_served, outcome, cache, request_id, day, hour",
    )
    spend.add_argument("--since", metavar="T", help="from this time: ISO 8601, or 24h, 7d ago")
    spend.add_argument("--until", metavar="T", help="before this time (same forms)")
    spend.add_argument(
        "--where",
        action="append",
        metavar="FIELD=VALUE",
        help="only records whose field has the value (repeat a field for any of several)",
    )
    spend.add_argument("--format", choices=("table", "json", "csv"), default="table")
    from pipeline.keys import _cli as keys_cli

    keys_cli.add_commands(commands)
    args = parser.parse_args(argv)
    if args.command == "keys":
        return keys_cli.run(args, _database_of)
    if args.command == "db":
        return _database(args)
    if args.command == "spend":
        return _spend(args)
    if args.command == "demo":
        return asyncio.run(_demo(args.question, args.otlp))
    if args.command == "ask":
        return asyncio.run(_ask(args.question, args.config, args.env))
    if args.command == "eval":
        return _eval(args)
    if args.command == "fake-server":
        if args.chunk_delay and not FAKE_SERVERS[args.format].paces_events:
            paced = ", ".join(name for name, fake in FAKE_SERVERS.items() if fake.paces_events)
            print(
                f"fake-server: --chunk-delay: the {args.format} fake does not pace its events "
                f"(these do: {paced})",
                file=sys.stderr,
            )
            return 2
        try:
            return asyncio.run(_fake_server(args.port, args.format, args.chunk_delay, args.words))
        except KeyboardInterrupt:
            return 0
    if args.command == "fake-fleet":
        return _fake_fleet(args)
    if args.command == "serve":
        return _serve(args)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse exits
    return 2  # pragma: no cover
