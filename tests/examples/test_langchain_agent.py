import asyncio
import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "langchain_agent.py"


def load() -> object:
    spec = importlib.util.spec_from_file_location("langchain_agent", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_tool_loop_answers_through_the_backup_route_whole_and_streamed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    module = load()
    # The example is a script of blocking calls: run it as one, off the test's event loop.
    answer = await asyncio.to_thread(module.main, "What is the weather in Paris?")  # type: ignore[attr-defined]
    assert answer == "It is sunny in Paris."
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "It is sunny in Paris."
    assert printed[1] == (
        "served by small-model ({'route': 'backup', 'route_attempts': 2, 'route_fallback': True}); "
        "usage {'input_tokens': 42, 'output_tokens': 9, 'total_tokens': 51}"
    )
    assert printed[2] == "It is sunny in Paris."
