"""Two real gateway replicas for a test: examples/gateway/replicas.py (Redis, two
`chat-pipeline serve` processes, nginx) started for a configuration, failing loudly when a
part cannot run."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gateway" / "replicas.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gateway_replicas_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


replicas_example = load_example()


@contextlib.contextmanager
def started(configuration: str, tmp_path: Path) -> Iterator[Any]:
    """The replicas of `configuration` (TOML text), stopped when the block ends."""
    config = tmp_path / "gateway.toml"
    config.write_text(configuration)
    workdir = tmp_path / "run"
    workdir.mkdir()
    workdir.chmod(0o755)  # nginx workers may run as another user
    tmp_path.chmod(0o755)
    try:
        with replicas_example.replicas(config, workdir=workdir) as running:
            yield running
    except replicas_example.StartError as exc:
        pytest.fail(f"GATEWAY REPLICAS CANNOT RUN: {exc}", pytrace=False)
