import dataclasses

import pytest

from middleware.routing import OrderedFailoverChatClient, Price, Route
from middleware.routing.context import FailoverAttempt, as_route, attempt_record
from pipeline import ChatOptions, _scope
from pipeline.errors import ProviderError
from pipeline.testing import ScriptedChatClient
from pipeline.types import Messages


def test_route_validates() -> None:
    client = ScriptedChatClient()
    with pytest.raises(ValueError, match="non-empty"):
        Route(" ", client)
    with pytest.raises(TypeError, match="Route 'x' client must be a ChatClient"):
        Route("x", object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_input_tokens"):
        Route("x", client, max_input_tokens=0)
    route = Route("x", client, capabilities={"tools"})  # type: ignore[arg-type]
    assert route.capabilities == frozenset({"tools"})


def test_bare_client_becomes_a_route_named_from_metadata() -> None:
    client = ScriptedChatClient(name="named")
    assert as_route(client).name == "named"
    route = Route("r", client)
    assert as_route(route) is route
    with pytest.raises(TypeError, match="routes must be"):
        as_route(3, "routes")  # type: ignore[arg-type]


def test_price_cost() -> None:
    price = Price(input_per_million=1.0, output_per_million=4.0)
    assert price.cost(1_000_000, 500_000) == pytest.approx(3.0)
    assert price.cost(None, None) == 0.0
    with pytest.raises(ValueError):
        Price(-1, 0)


def test_the_engines_attempt_records_are_frozen_failover_attempts() -> None:
    client = ScriptedChatClient()
    record = attempt_record("primary", client, 2, "failed_before_output", None, 0.5, None)
    assert type(record) is FailoverAttempt
    assert record == FailoverAttempt(
        "primary", client, 2, "failed_before_output", None, 0.5, None, False, False
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.number = 3  # type: ignore[misc]
    served = attempt_record("primary", client, 1, "completed", None, 0.5, 0.25)
    assert (served.response_completed, served.output_committed) == (True, True)


async def test_a_routers_operation_id_is_made_when_first_read_and_shared() -> None:
    seen: list[str | None] = []

    class Reading(ScriptedChatClient):
        async def get_response(self, messages: Messages, options: ChatOptions | None = None):  # type: ignore[no-untyped-def]
            seen.append(_scope.current_operation())
            seen.append(_scope.current_operation())
            if len(seen) == 2:
                raise ProviderError("down", provider="first", retryable=True)
            return await super().get_response(messages, options)

    router = OrderedFailoverChatClient([Route("a", Reading()), Route("b", Reading("ok"))])
    await router.get_response("hi")
    assert len(seen) == 4 and seen[0] is not None and len(set(seen)) == 1
    assert _scope.current_operation() is None  # none left behind
    with _scope.operation_scope("order-1"):
        seen.clear()
        await router.get_response("hi")
    assert set(seen) == {"order-1"}
