"""Real backends for the end-to-end suites (every module is marked ``e2e``: ``-m "not e2e"``
skips them locally, CI runs them). A backend that is missing or does not start fails."""

from collections.abc import Iterator

import pytest

from tests.e2e.servers import Phoenix, running_phoenix


@pytest.fixture(scope="session")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    """One Arize Phoenix server for the session, with its own empty working directory."""
    with running_phoenix(tmp_path_factory.mktemp("phoenix")) as server:
        yield server
