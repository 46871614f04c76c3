"""The README's eval example: examples/eval_cases.jsonl against examples/pipeline.toml."""

from pathlib import Path

import pytest

from pipeline.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_example_cases_run_offline(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    argv = [
        "eval",
        "--config",
        str(EXAMPLES / "pipeline.toml"),
        "--env",
        "development",
        "--cases",
        str(EXAMPLES / "eval_cases.jsonl"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:4] for line in out.splitlines()[1:4]}
    assert rows == {
        "small": ["3", "2", "66.7%"],
        "standard": ["3", "2", "66.7%"],
        "offline": ["3", "1", "33.3%"],
    }
    assert "offline  tier-named: does not match the expected regex" in out
    assert main([*argv, "--min-pass-rate", "0.5"]) == 1
    assert main([*argv, "--routes", "small,standard", "--min-pass-rate", "0.5"]) == 0
