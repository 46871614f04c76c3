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


def test_fake_server_command_serves_until_interrupted() -> None:
    import signal
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "fake-server", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # printed once the server is listening
        assert f"127.0.0.1:{port}/v1" in line
        import httpx

        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert response.json()["choices"][0]["message"]["content"] == "Hello from the fake server."
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=10)
