import logging

import pytest

from middleware.routing import Route
from middleware.routing.tiered import KIND_HINT, PIN_HINT, TieredRoutingChatClient
from pipeline import ChatMessage, ChatOptions, DataContent
from pipeline.errors import RequestInvalidError, RoutingError, TransientProviderError
from pipeline.testing import ScriptedChatClient, collect, fail, reply


def tiers(**scripts: object) -> dict[str, ScriptedChatClient]:
    return {name: ScriptedChatClient(s, name=name) for name, s in scripts.items()}  # type: ignore[arg-type]


def router(clients: dict[str, ScriptedChatClient], **options: object) -> TieredRoutingChatClient:
    routes = [
        Route("small", clients["small"], max_input_tokens=100, capabilities=frozenset({"json"})),
        Route(
            "standard",
            clients["standard"],
            max_input_tokens=1000,
            capabilities=frozenset({"tools", "json"}),
        ),
        Route(
            "large",
            clients["large"],
            max_input_tokens=100_000,
            capabilities=frozenset({"tools", "json", "vision"}),
        ),
    ]
    options.setdefault("fallback", {"small": ["standard"], "standard": ["large"]})
    return TieredRoutingChatClient(routes, default="small", **options)  # type: ignore[arg-type]


def answers() -> dict[str, ScriptedChatClient]:
    return tiers(small=reply("small"), standard=reply("standard"), large=reply("large"))


async def test_default_tier(streaming: bool) -> None:
    assert (await collect(router(answers()), "hi", streaming=streaming)).text == "small"


async def test_escalates_past_a_too_small_context_window(
    streaming: bool, caplog: pytest.LogCaptureFixture
) -> None:
    clients = answers()
    with caplog.at_level(logging.INFO, logger="chat_pipeline.routing.tiered"):
        result = await collect(router(clients), "x" * 2000, streaming=streaming)
    assert result.text == "standard"
    assert clients["small"].call_count == 0
    assert any("small skipped" in r.getMessage() for r in caplog.records)
    assert all("xxxx" not in r.getMessage() for r in caplog.records)


async def test_required_capabilities(streaming: bool) -> None:
    clients = answers()
    chat = router(clients)
    assert (
        await collect(chat, "hi", ChatOptions(tools=[{"type": "function"}]), streaming=streaming)
    ).text == "standard"
    image = ChatMessage.user(["look", DataContent(uri="https://example.invalid/a.png")])
    assert (await collect(chat, [image], streaming=streaming)).text == "large"


async def test_fails_over_along_the_chain(streaming: bool) -> None:
    clients = tiers(
        small=fail(TransientProviderError()),
        standard=fail(TransientProviderError()),
        large=reply("large"),
    )
    result = await collect(router(clients), "hi", streaming=streaming)
    assert result.text == "large"
    assert [c.call_count for c in clients.values()] == [1, 1, 1]


async def test_chain_exhausted_raises_the_last_failure(streaming: bool) -> None:
    errors = [TransientProviderError() for _ in range(3)]
    clients = tiers(small=fail(errors[0]), standard=fail(errors[1]), large=fail(errors[2]))
    assert (await collect(router(clients), "hi", streaming=streaming)).error is errors[2]


async def test_request_errors_do_not_escalate(streaming: bool) -> None:
    clients = tiers(
        small=fail(RequestInvalidError()), standard=reply("standard"), large=reply("large")
    )
    result = await collect(router(clients), "hi", streaming=streaming)
    assert isinstance(result.error, RequestInvalidError)
    assert clients["standard"].call_count == 0


async def test_pin_and_kind_hints_never_reach_the_route(streaming: bool) -> None:
    clients = answers()
    chat = router(clients, kinds={"summarize": "standard"})
    pinned = ChatOptions(additional_properties={PIN_HINT: "large", "user": "u"})
    assert (await collect(chat, "hi", pinned, streaming=streaming)).text == "large"
    assert clients["large"].calls[0].options_snapshot is not None
    assert clients["large"].calls[0].options_snapshot.additional_properties == {"user": "u"}
    assert pinned.additional_properties[PIN_HINT] == "large"  # the caller's object is untouched
    kind = ChatOptions(additional_properties={KIND_HINT: "summarize"})
    assert (await collect(chat, "hi", kind, streaming=streaming)).text == "standard"
    unknown = await collect(
        chat, "hi", ChatOptions(additional_properties={KIND_HINT: "poetry"}), streaming=streaming
    )
    assert isinstance(unknown.error, RoutingError)


async def test_sticky_sessions(streaming: bool) -> None:
    clients = tiers(
        small=fail(TransientProviderError()), standard=reply("standard"), large=reply("large")
    )
    chat = router(clients)
    session = ChatOptions(session_id="s-1")
    assert (await collect(chat, "hi", session, streaming=streaming)).text == "standard"
    assert (await collect(chat, "hi", session, streaming=streaming)).text == "standard"
    assert clients["small"].call_count == 1  # the second request started on the sticky route
    assert (
        await collect(chat, "hi", ChatOptions(session_id="s-2"), streaming=streaming)
    ).error is None
    assert clients["small"].call_count == 2


async def test_no_eligible_route(streaming: bool) -> None:
    result = await collect(router(answers()), "x" * 500_000, streaming=streaming)
    assert isinstance(result.error, RoutingError)
    assert "no route can serve this request" in str(result.error)


def test_configuration_errors() -> None:
    clients = answers()
    with pytest.raises(ValueError, match="default route 'medium'"):
        TieredRoutingChatClient([Route("small", clients["small"])], default="medium")
    with pytest.raises(ValueError, match="fallback names unknown route 'huge'"):
        TieredRoutingChatClient(
            [Route("small", clients["small"])], default="small", fallback={"small": ["huge"]}
        )
    with pytest.raises(TypeError, match="Route objects"):
        TieredRoutingChatClient([clients["small"]], default="small")  # type: ignore[list-item]
