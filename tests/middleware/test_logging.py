import contextlib
import logging

import pytest

from pipeline import ChatMessage, ChatOptions, ChatPipeline
from pipeline.testing import ScriptedChatClient, collect, fail, fail_after, reply

CANARY = "CANARY-7f3a-logging"


def _chat(script: object, logger: logging.Logger) -> ChatPipeline:
    return (
        ChatPipeline.builder().use_logging(logger).build(ScriptedChatClient(script, model_id="m"))
    )  # type: ignore[arg-type]


async def test_logs_success_without_content(
    streaming: bool, caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger("test.logging.success")
    chat = _chat(reply(CANARY, chunks=[CANARY[:5], CANARY[5:]]), logger)
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        await collect(
            chat, [ChatMessage.user(CANARY)], ChatOptions(stop=[CANARY]), streaming=streaming
        )
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "start" in messages[0] and "done" in messages[1]
    assert "model=m" in messages[1]
    assert f"updates={2 if streaming else 1}" in messages[1]
    assert all(CANARY not in m for m in messages)


async def test_logs_failure_by_type_only(streaming: bool, caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.logging.failure")
    chat = _chat(fail_after(["a"], ValueError(CANARY)), logger)
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        result = await collect(chat, CANARY, streaming=streaming)
    assert isinstance(result.error, ValueError)
    end = caplog.records[-1]
    assert end.levelno == logging.WARNING
    assert "error=ValueError" in end.getMessage()
    assert f"updates={1 if streaming else 0}" in end.getMessage()  # the one before the failure
    assert all(CANARY not in r.getMessage() for r in caplog.records)


async def test_logs_abandoned_stream(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.logging.abandon")
    inner = ScriptedChatClient(reply("abc", chunks=["a", "b", "c"]))
    chat = ChatPipeline.builder().use_logging(logger).build(inner)
    with caplog.at_level(logging.INFO, logger=logger.name):
        async with contextlib.aclosing(chat.get_streaming_response("x")) as stream:
            await anext(stream)
    assert "abandoned" in caplog.records[-1].getMessage()
    assert "updates=1" in caplog.records[-1].getMessage()
    assert inner.streams_abandoned == 1


async def test_failure_before_output_logged(
    streaming: bool, caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger("test.logging.before")
    chat = _chat(fail(KeyError("k")), logger)
    with caplog.at_level(logging.INFO, logger=logger.name):
        result = await collect(chat, "x", streaming=streaming)
    assert isinstance(result.error, KeyError)
    assert "error=KeyError" in caplog.records[-1].getMessage()
