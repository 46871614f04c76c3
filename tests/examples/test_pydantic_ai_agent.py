import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pydantic_ai_agent.py"


def load() -> object:
    spec = importlib.util.spec_from_file_location("pydantic_ai_agent", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_agent_answers_through_the_backup_route_whole_and_streamed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    module = load()
    assert await module.main("What is the weather in Paris?") == "It is sunny in Paris."  # type: ignore[attr-defined]
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "It is sunny in Paris."
    assert printed[1].startswith(
        "served by small-model ({'route': 'backup', 'route_attempts': 2, 'route_fallback': True})"
    )
    assert "input_tokens=72, output_tokens=15, requests=2, tool_calls=1" in printed[1]
    assert printed[2] == "It is sunny in Paris."  # the streamed run, piece by piece
