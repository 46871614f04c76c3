import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest

from pipeline._metrics import DURATION_BUCKETS
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
    assert f"spans and metrics exported to {receiver.url}" in capsys.readouterr().out
    names = sorted(s.name for s in receiver.spans())  # type: ignore[attr-defined]
    assert names.count("chat simulated-small") == 2
    assert names.count("route_attempt backup") == 2


def _attributes(point: object) -> dict[str, object]:
    return {
        kv.key: getattr(kv.value, kv.value.WhichOneof("value"))
        for kv in point.attributes  # type: ignore[attr-defined]
    }


def test_demo_exports_metrics_too(receiver: Receiver) -> None:
    assert main(["demo", "--otlp", receiver.url]) == 0
    metrics = receiver.metrics()
    attempts = {
        (a["chat_pipeline.route.name"], a["chat_pipeline.route.outcome"]): p.as_int
        for p in metrics["chat_pipeline.route.attempt.count"]
        for a in [_attributes(p)]
    }
    # Two requests (streamed, then whole), each failing over from primary to backup.
    assert attempts == {("primary", "failed_before_output"): 2, ("backup", "completed"): 2}
    assert sum(p.as_int for p in metrics["chat_pipeline.route.backup_calls"]) == 2
    assert sum(p.count for p in metrics["gen_ai.client.operation.duration"]) == 2
    assert sum(p.count for p in metrics["gen_ai.client.operation.time_to_first_chunk"]) == 1
    first_update = metrics["chat_pipeline.route.time_to_first_update"]
    assert sum(p.count for p in first_update) == 2
    assert all(list(p.explicit_bounds) == list(DURATION_BUCKETS) for p in first_update)


def test_demo_to_a_traces_only_backend(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    with Receiver(reject_metrics=True) as phoenix_like:
        assert main(["demo", "--otlp", phoenix_like.url]) == 0
    assert f"spans exported to {phoenix_like.url}" in capsys.readouterr().out
    assert set(phoenix_like.paths) == {"/v1/traces"}
    assert len(phoenix_like.spans()) == 6


def test_the_demo_says_what_the_backend_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # A traces-only backend answers 405 to metrics: never "spans and metrics exported".
    with Receiver(reject_metrics=True) as phoenix_like:
        assert main(["demo", "--otlp", phoenix_like.url]) == 0
    (report,) = [line for line in capsys.readouterr().out.splitlines() if "exported" in line]
    assert report.startswith(f"spans exported to {phoenix_like.url}; metrics (1 of 1 exports)")
    assert f"refused by {phoenix_like.url}" in report


def test_module_entry_point_runs_the_demo() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "demo"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert DEMO_ANSWER in done.stdout


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_fake_server_command_serves_until_interrupted(stop_signal: signal.Signals) -> None:
    # Either signal ends it with status 0, also where SIGINT was ignored when it started
    # (a background job of a non-interactive shell).
    with fake_server_process(stop_signal=stop_signal) as base_url:
        response = httpx2.post(
            f"{base_url}/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert response.json()["choices"][0]["message"]["content"] == "Hello from the fake server."


def streamed_events(base_url: str) -> list[str]:
    """The ``data: `` lines of a Chat Completions stream of the fake at `base_url`."""
    with httpx2.stream(
        "POST",
        f"{base_url}/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        timeout=10,
    ) as response:
        return [line for line in response.iter_lines() if line.startswith("data: ")]


def test_fake_server_command_paces_a_streams_events_when_asked() -> None:
    # The pause only spaces the events (what arrives is the same stream); a fake that does
    # not pace its events refuses the option rather than ignore it.
    with fake_server_process(extra=["--chunk-delay", "0.001"]) as base_url:
        events = streamed_events(base_url)
    assert events[-1] == "data: [DONE]"
    text = "".join(
        json.loads(e[6:])["choices"][0]["delta"].get("content") or ""
        for e in events[:-1]
        if json.loads(e[6:])["choices"]
    )
    assert text == "Hello from the fake server."
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "fake-server",
            "--format",
            "gemini",
            "--chunk-delay",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "--chunk-delay: the gemini fake does not pace its events" in refused.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "pipeline", "fake-server", "--chunk-delay", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "expected a positive number of seconds" in bad.stderr


def test_fake_server_command_answers_as_many_words_as_asked() -> None:
    with fake_server_process(extra=["--words", "40"]) as base_url:
        lines = streamed_events(base_url)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    texts = [e["choices"][0]["delta"].get("content") for e in events if e["choices"]]
    assert [text for text in texts if text] == [f"word{n} " for n in range(1, 40)] + ["word40."]
    bad = subprocess.run(
        [sys.executable, "-m", "pipeline", "fake-server", "--words", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "expected a positive integer" in bad.stderr


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


def test_fake_server_command_speaks_the_gemini_format() -> None:
    with fake_server_process("gemini") as base_url:
        response = httpx2.post(
            f"{base_url}/models/m:generateContent",
            json={"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
            headers={"x-goog-api-key": "k"},
            timeout=10,
        )
        [candidate] = response.json()["candidates"]
        assert candidate["content"]["parts"] == [{"text": "Hello from the fake server."}]


def test_ask_uses_a_config_file(capsys: pytest.CaptureFixture[str]) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "pipeline.toml"
    assert main(["ask", "--config", str(example), "--env", "development", "hello"]) == 0
    assert capsys.readouterr().out.strip() == "Simulated small answer."
    assert main(["ask", "--config", str(example), "--env", "nowhere", "hello"]) == 2
    assert "environments.nowhere: is not defined" in capsys.readouterr().err
