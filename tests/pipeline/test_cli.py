import subprocess
import sys

import pytest

from pipeline.cli import DEMO_ANSWER, main


def test_demo_streams_the_backup_answer_after_a_failover(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert DEMO_ANSWER in out
    assert "attempt 1: route=primary outcome=failed_before_output" in out
    assert "attempt 2: route=backup outcome=completed committed=True" in out


def test_module_entry_point_runs_the_demo() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "demo"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert DEMO_ANSWER in done.stdout
