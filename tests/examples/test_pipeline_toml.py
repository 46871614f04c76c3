from pathlib import Path

import pytest

from pipeline import ChatPipeline
from pipeline.testing import collect

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pipeline.toml"


async def test_development_runs_offline(streaming: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    chat = ChatPipeline.from_config(EXAMPLE, "development")
    assert chat.describe() == [
        "LoggingChatClient",
        "TieredRoutingChatClient(small, standard, offline; default small)",
    ]
    assert (await collect(chat, "hi", streaming=streaming)).text == "Simulated small answer."
    assert (await collect(chat, "x" * 40_000, streaming=streaming)).text == (
        "Simulated standard answer."
    )


def test_production_builds_with_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.delenv("CHAT_PIPELINE_ENV", raising=False)
    chat = ChatPipeline.from_config(EXAMPLE)
    assert chat.describe()[0] == "TelemetryChatClient"
