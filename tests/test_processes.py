"""`tests.processes`: the harness every suite starts its servers with."""

from __future__ import annotations

import re
import signal
import sys
import textwrap

import pytest

from tests.processes import UVICORN_PORT, ChildProcess, StartError


def python(code: str) -> list[str]:
    return [sys.executable, "-u", "-c", textwrap.dedent(code)]


# A child that prints `lines`, then waits until a signal ends it.
def printing(*lines: str) -> list[str]:
    return python(
        f"""
        import threading
        for line in {list(lines)!r}:
            print(line, flush=True)
        threading.Event().wait()
        """
    )


def test_a_readiness_line_and_the_port_it_reports() -> None:
    with ChildProcess(
        "server", printing("booting", "Uvicorn running on http://127.0.0.1:4321")
    ) as c:
        assert c.wait_for_port(UVICORN_PORT, timeout=30) == 4321
        assert c.wait_for_line("booting", timeout=30).group(0) == "booting"
    assert c.process.returncode == -signal.SIGTERM
    assert c.output() == "booting\nUvicorn running on http://127.0.0.1:4321\n"


def test_the_count_th_matching_line() -> None:
    lines = ("worker 1 ready", "noise", "worker 2 ready")
    with ChildProcess("server", printing(*lines)) as child:
        match = child.wait_for_line(re.compile(r"worker (\d) ready"), timeout=30, count=2)
        assert match.group(1) == "2"


def test_a_child_that_exits_before_its_line_fails_at_once_with_its_output() -> None:
    child = ChildProcess("broken", python("print('port 80 is taken'); raise SystemExit(3)"))
    with pytest.raises(StartError) as raised:
        child.wait_for_line("ready", timeout=600)  # the exit ends the wait, not the deadline
    message = str(raised.value)
    assert message.startswith("broken did not start (it exited with status 3")
    assert message.endswith("Its output ends with:\nport 80 is taken\n")
    assert child.stop() == 3


def test_a_line_that_never_comes_fails_at_the_deadline() -> None:
    message = r"no line matching 'ready' within 0\.2 s"
    with (
        ChildProcess("silent", printing("still booting")) as child,
        pytest.raises(StartError, match=message),
    ):
        child.wait_for_line("ready", timeout=0.2)


def test_a_child_that_ignores_sigterm_is_killed() -> None:
    code = """
        import signal, threading
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM", flush=True)
        threading.Event().wait()
    """
    child = ChildProcess("stubborn", python(code))
    child.wait_for_line("ignoring SIGTERM", timeout=30)
    assert child.stop(timeout=0.2) == -signal.SIGKILL


WORKER = """
import signal, sys
def stop(*_):
    print("worker stopped", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("worker ready", flush=True)
signal.pause()
"""


def test_a_group_of_its_own_is_stopped_together() -> None:
    # A supervisor whose worker shares its output; the worker says when SIGTERM reaches it.
    code = f"""
        import subprocess, sys, threading
        subprocess.Popen([sys.executable, "-c", {WORKER!r}])
        threading.Event().wait()
    """
    with ChildProcess("supervisor", python(code), own_group=True) as child:
        child.wait_for_line("worker ready", timeout=30)
    assert child.process.returncode == -signal.SIGTERM
    # `stop` read the output until every process holding it had closed it.
    assert child.output().splitlines() == ["worker ready", "worker stopped"]
