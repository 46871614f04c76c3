import pytest

from middleware.routing import Price, Route
from middleware.routing.context import as_route
from pipeline.testing import ScriptedChatClient


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
