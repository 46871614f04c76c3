"""Real backends for the end-to-end suites (every module is marked ``e2e``: ``-m "not e2e"``
skips them locally, CI runs them). A backend that is missing or does not start fails."""

from collections.abc import Iterator

import pytest

from tests.e2e.servers import (
    Collector,
    Jaeger,
    Phoenix,
    running_collector,
    running_jaeger,
    running_phoenix,
)


@pytest.fixture(scope="session")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    """One Arize Phoenix server for the session, with its own empty working directory."""
    with running_phoenix(tmp_path_factory.mktemp("phoenix")) as server:
        yield server


@pytest.fixture(scope="session")
def jaeger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jaeger]:
    """One Jaeger 2 (memory storage) for the session."""
    with running_jaeger(tmp_path_factory.mktemp("jaeger")) as server:
        yield server


@pytest.fixture(scope="session")
def collector(jaeger: Jaeger, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Collector]:
    """One collector for the session, on the shipped config with its endpoints moved,
    exporting traces to `jaeger`."""
    with running_collector(jaeger, tmp_path_factory.mktemp("otelcol")) as server:
        yield server
