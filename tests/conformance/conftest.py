"""The conformance suite's budget, its rig (one gateway for the session) and its summary.

In CI each property test draws `CI_EXAMPLES` requests (plus the ones sent again without a
refused field) from a fixed seed; ``--conformance-examples N`` (or
``CHAT_PIPELINE_CONFORMANCE_EXAMPLES``) draws more, and ``--conformance-seed random`` a new
seed each run (printed, to replay it).
"""

from __future__ import annotations

import os
import random
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, seed, settings

from tests.conformance.harness import Rig, Tally

CI_EXAMPLES = 200
"""Examples per property test in CI (docs/development.md has the requests they send and
the time they take)."""
CI_SEED = 45
EXAMPLES_VARIABLE = "CHAT_PIPELINE_CONFORMANCE_EXAMPLES"
# The options are tests/conftest.py's (pytest reads options only from the root conftest).
_TALLY = pytest.StashKey[Tally]()
_SEED = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_TALLY] = Tally()
    chosen = config.getoption("--conformance-seed")
    if chosen == "random":
        config.stash[_SEED] = random.SystemRandom().randrange(2**32)
    else:
        config.stash[_SEED] = int(chosen) if chosen is not None else CI_SEED


def _examples(config: pytest.Config) -> int:
    chosen = config.getoption("--conformance-examples")
    return int(chosen or os.environ.get(EXAMPLES_VARIABLE, CI_EXAMPLES))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A property test's time grows with its examples (and a failure's shrinking): its
    # timeout too, instead of the suite's 120 s.
    timeout = 300 + 2 * _examples(config)
    for item in items:
        if "rig" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(timeout))


@pytest.fixture(scope="session")
def tally(request: pytest.FixtureRequest) -> Tally:
    return request.config.stash[_TALLY]


@pytest.fixture(scope="session")
def rig(tmp_path_factory: pytest.TempPathFactory, tally: Tally) -> Iterator[Rig]:
    rig = Rig(Path(tmp_path_factory.mktemp("conformance")), tally)
    try:
        yield rig
    finally:
        rig.close()


@pytest.fixture
def budget(request: pytest.FixtureRequest) -> Callable[[Any], Any]:
    """Decorates a property test with the run's settings, and the run's seed made the
    test's own (a streamed test draws other requests than its whole twin)."""
    config = request.config
    examples = _examples(config)
    chosen = config.stash[_SEED] ^ zlib.crc32(request.node.nodeid.encode())
    run = settings(
        max_examples=examples,
        deadline=None,
        database=None,  # a fixed seed replays a failure; nothing is kept between runs
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
            HealthCheck.data_too_large,
        ],
    )

    def decorate(test: Any) -> Any:
        return seed(chosen)(run(test))

    return decorate


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    tally = config.stash.get(_TALLY, None)
    if tally is None or not tally.requests():
        return
    terminalreporter.write_line(
        f"conformance (seed {config.stash[_SEED]}): what the vendors' descriptions drew"
    )
    for line in tally.lines():
        terminalreporter.write_line(line)
