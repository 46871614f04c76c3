import subprocess
import sys
from pathlib import Path

import httpx2
import pytest

from pipeline.cli import DEMO_ANSWER, main
from tests.fake_server_process import fake_server_process
from tests.otel import Receiver


def test_demo_streams_the_backup_answer_and_prints_the_trace_tree(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert out.count(DEMO_ANSWER) == 2
    assert out.count("route_attempt primary  outcome=failed_before_output committed=False") == 2
    assert out.count("route_attempt backup  outcome=completed committed=True") == 2
    assert "error=TransientProviderError" in out
    lines = out.splitlines()
    chat = lines.index(next(line for line in lines if line.startswith("  chat")))
    assert lines[chat + 1].startswith("    route_attempt primary")  # nested under chat


def test_demo_exports_over_otlp(receiver: Receiver, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--otlp", receiver.url]) == 0
    assert "exported over OTLP" in capsys.readouterr().out
    names = sorted(s.name for s in receiver.spans())  # type: ignore[attr-defined]
    assert names.count("chat") == 2
    assert names.count("route_attempt backup") == 2


def test_module_entry_point_runs_the_demo() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "demo"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert DEMO_ANSWER in done.stdout


def test_fake_server_command_serves_until_interrupted() -> None:
    with fake_server_process() as base_url:
        response = httpx2.post(
            f"{base_url}/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert response.json()["choices"][0]["message"]["content"] == "Hello from the fake server."


def test_fake_server_command_speaks_the_anthropic_format() -> None:
    with fake_server_process("anthropic") as base_url:
        response = httpx2.post(
            f"{base_url}/v1/messages",
            json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": "k", "anthropic-version": "2023-06-01"},
            timeout=10,
        )
        assert response.json()["content"] == [
            {"type": "text", "text": "Hello from the fake server."}
        ]


def test_ask_uses_a_config_file(capsys: pytest.CaptureFixture[str]) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "pipeline.toml"
    assert main(["ask", "--config", str(example), "--env", "development", "hello"]) == 0
    assert capsys.readouterr().out.strip() == "Simulated small answer."
    assert main(["ask", "--config", str(example), "--env", "nowhere", "hello"]) == 2
    assert "environments.nowhere: is not defined" in capsys.readouterr().err
