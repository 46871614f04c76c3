"""Prices: a route's `Price`, genai-prices' rates read once and applied per attempt, each token
priced once. Hand-computed cases from the providers' published rates, and equality with
genai-prices' own `calc_price` for every model and price period it knows."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from genai_prices import Usage, calc_price, data_snapshot
from genai_prices.types import ConditionalPrice, ModelPrice

from pipeline import pricing
from pipeline.pricing import Cost, GenAIPricesBook, Price, priced
from pipeline.types import UsageDetails

AT = datetime(2026, 1, 15, 12, tzinfo=UTC)


@pytest.fixture(scope="module")
def book() -> GenAIPricesBook:
    return GenAIPricesBook()


def cost(book: GenAIPricesBook, provider: str, model: str, usage: UsageDetails) -> Decimal:
    found = book.cost(provider, model, usage, at=AT)
    assert found is not None, (provider, model)
    assert found.currency == "USD" and not found.estimated
    return found.amount


# Published rates per million tokens (input / cache read / cache write / output), as the
# providers' pricing pages list them, multiplied out by hand below.


def test_openai_cache_reads_are_priced_once_at_their_own_rate(book: GenAIPricesBook) -> None:
    # gpt-4o: $2.50 input, $1.25 cached input, $10 output.
    usage = UsageDetails(input_tokens=10_000, output_tokens=1_000, cache_read_tokens=4_000)
    # 6,000 x 2.50 + 4,000 x 1.25 + 1,000 x 10 = 15,000 + 5,000 + 10,000 -> $0.03
    assert cost(book, "openai", "gpt-4o", usage) == Decimal("0.03")
    # The served model's dated name prices the same.
    assert cost(book, "openai", "gpt-4o-2024-08-06", usage) == Decimal("0.03")


def test_openai_reasoning_tokens_are_output_billed_once(book: GenAIPricesBook) -> None:
    # o3: $2 input, $8 output; reasoning tokens are output tokens (not added again).
    usage = UsageDetails(input_tokens=2_000, output_tokens=5_000, reasoning_tokens=4_000)
    # 2,000 x 2 + 5,000 x 8 = 4,000 + 40,000 -> $0.044
    assert cost(book, "openai", "o3", usage) == Decimal("0.044")


def test_anthropic_cache_reads_and_writes_each_at_their_rate(book: GenAIPricesBook) -> None:
    # claude-sonnet-4-5: $3 input, $0.30 cache read, $3.75 cache write (5 min), $15 output.
    usage = UsageDetails(
        input_tokens=20_000, output_tokens=2_000, cache_read_tokens=10_000, cache_write_tokens=5_000
    )
    # 5,000 x 3 + 10,000 x 0.30 + 5,000 x 3.75 + 2,000 x 15
    # = 15,000 + 3,000 + 18,750 + 30,000 -> $0.06675
    assert cost(book, "anthropic", "claude-sonnet-4-5", usage) == Decimal("0.06675")
    # Through Bedrock and Vertex AI the model is the same and priced the same.
    assert cost(book, "gcp.vertex_ai", "claude-sonnet-4-5@20250929", usage) == Decimal("0.06675")


def test_anthropic_long_context_rates_apply_to_every_token(book: GenAIPricesBook) -> None:
    # Above 200k input tokens: $6 input, $0.60 cache read, $22.50 output.
    usage = UsageDetails(input_tokens=250_000, output_tokens=1_000, cache_read_tokens=100_000)
    # 150,000 x 6 + 100,000 x 0.60 + 1,000 x 22.50 = 900,000 + 60,000 + 22,500 -> $0.9825
    assert cost(book, "anthropic", "claude-sonnet-4-5", usage) == Decimal("0.9825")


def test_gemini_thinking_and_cached_tokens(book: GenAIPricesBook) -> None:
    # gemini-2.5-pro up to 200k: $1.25 input, $0.125 cached, $10 output (thinking included).
    usage = UsageDetails(
        input_tokens=100_000, output_tokens=3_000, reasoning_tokens=2_000, cache_read_tokens=60_000
    )
    # 40,000 x 1.25 + 60,000 x 0.125 + 3,000 x 10 = 50,000 + 7,500 + 30,000 -> $0.0875
    assert cost(book, "gcp.gemini", "gemini-2.5-pro", usage) == Decimal("0.0875")
    # Above 200k: $2.50 input, $15 output.
    long = UsageDetails(input_tokens=300_000, output_tokens=1_000)
    # 300,000 x 2.50 + 1,000 x 15 = 750,000 + 15,000 -> $0.765
    assert cost(book, "gcp.gemini", "gemini-2.5-pro", long) == Decimal("0.765")


def test_a_route_price_wins_over_the_book(book: GenAIPricesBook) -> None:
    usage = UsageDetails(input_tokens=10_000, output_tokens=1_000, cache_read_tokens=4_000)
    route = Price(1.0, 2.0, cache_read_per_million=0.1)
    # 6,000 x 1 + 4,000 x 0.1 + 1,000 x 2 = 6,000 + 400 + 2,000 -> 0.0084
    found = priced(route, book, "openai", "gpt-4o", usage, at=AT, estimated=False)
    assert found == Cost(Decimal("0.0084"), "USD", False)
    assert priced(None, book, "openai", "gpt-4o", usage, at=AT, estimated=True) == Cost(
        Decimal("0.03"), "USD", True
    )


def test_a_route_price_without_cache_rates_bills_cached_tokens_as_input_once() -> None:
    usage = UsageDetails(
        input_tokens=1_000, output_tokens=100, cache_read_tokens=600, cache_write_tokens=300
    )
    # 1,000 x 3 + 100 x 15 = 4,500 -> 0.0045, whatever the cache did
    assert Price(3, 15).charge(usage).amount == Decimal("0.0045")
    eur = Price(3, 15, cache_read_per_million=0.3, cache_write_per_million=3.75, currency="EUR")
    # 100 x 3 + 600 x 0.3 + 300 x 3.75 + 100 x 15 = 300 + 180 + 1,125 + 1,500 -> 0.003105
    assert eur.charge(usage, estimated=True) == Cost(Decimal("0.003105"), "EUR", True)
    assert Price(0.15, 0.6).cost(1_000, 1_000) == pytest.approx(0.00075)


def test_bad_prices_are_refused_in_our_words() -> None:
    with pytest.raises(ValueError, match="cache_read_per_million"):
        Price(1, 2, cache_read_per_million=-1)
    with pytest.raises(ValueError, match="currency"):
        Price(1, 2, currency="dollars")
    with pytest.raises(TypeError, match="input and the output price"):
        Price(1, 2, 3)


def test_unknown_models_and_providers_are_unpriced(book: GenAIPricesBook) -> None:
    usage = UsageDetails(input_tokens=10, output_tokens=10)
    assert book.cost("openai", "model-nobody-sells", usage, at=AT) is None
    assert book.cost("ollama", "llama3", usage, at=AT) is None  # a model of your own hardware
    assert book.cost("scripted", "gpt-4o", usage, at=AT) is None
    assert book.cost("no-such-provider", "gpt-4o", usage, at=AT) is None
    assert book.cost(None, "gpt-4o", usage, at=AT) is None
    # A part larger than its whole is no usage genai-prices prices: unpriced, never guessed.
    bad = UsageDetails(input_tokens=10, output_tokens=10, cache_read_tokens=11)
    assert book.cost("openai", "gpt-4o", bad, at=AT) is None


def test_a_book_that_fails_prices_nothing() -> None:
    class Broken:
        def cost(self, *args: object, **kwargs: object) -> Cost | None:
            raise RuntimeError("the book is broken")

    usage = UsageDetails(input_tokens=1, output_tokens=1)
    assert priced(None, Broken(), "openai", "gpt-4o", usage, at=AT, estimated=False) is None


def test_dated_prices_follow_the_attempts_time(book: GenAIPricesBook) -> None:
    _, model = data_snapshot.get_snapshot().find_provider_model("o3", None, "openai", None)
    assert isinstance(model.prices, list) and len(model.prices) > 1
    usage = UsageDetails(input_tokens=1_000_000, output_tokens=1_000_000)
    for conditional in model.prices:
        constraint = conditional.constraint
        if constraint is None or not hasattr(constraint, "start_date"):
            continue
        at = datetime.combine(constraint.start_date, datetime.min.time(), UTC)
        expected = calc_price(
            Usage(input_tokens=1_000_000, output_tokens=1_000_000),
            "o3",
            provider_id="openai",
            genai_request_timestamp=at,
        ).total_price
        found = book.cost("openai", "o3", usage, at=at)
        assert found is not None and found.amount == expected
        # The same time in seconds since the epoch (as attempts give it): the same period.
        for seconds in (at.timestamp(), at.timestamp() - 1):
            moment = datetime.fromtimestamp(seconds, UTC)
            by_seconds = GenAIPricesBook().cost("openai", "o3", usage, at=seconds)
            assert by_seconds == GenAIPricesBook().cost("openai", "o3", usage, at=moment)


USAGES = [
    UsageDetails(input_tokens=0, output_tokens=0),
    UsageDetails(input_tokens=1_234, output_tokens=567),
    UsageDetails(input_tokens=10_000, output_tokens=2_000, cache_read_tokens=7_000),
    UsageDetails(input_tokens=9_000, output_tokens=800, cache_write_tokens=8_000),
    UsageDetails(input_tokens=50_000, output_tokens=9_000, reasoning_tokens=8_000),
    UsageDetails(
        input_tokens=250_001,
        output_tokens=3_000,
        reasoning_tokens=1_000,
        cache_read_tokens=120_000,
        cache_write_tokens=30_000,
    ),
    UsageDetails(input_tokens=1_500_000, output_tokens=70_000, cache_read_tokens=1_000_000),
]


def reference(model_price: ModelPrice, usage: UsageDetails) -> Decimal:
    """genai-prices' own price of `usage` under `model_price`."""
    return model_price.calc_price(
        Usage(
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cache_read_tokens=usage.cache_read_tokens,
            cache_write_tokens=usage.cache_write_tokens,
            output_reasoning_tokens=usage.reasoning_tokens,
        )
    )["total_price"]


def every_price() -> list[tuple[str, str, ModelPrice]]:
    found = []
    for provider in data_snapshot.get_snapshot().providers:
        for model in provider.models:
            prices = model.prices
            periods = [prices] if isinstance(prices, ModelPrice) else prices
            for period in periods:
                price = period.prices if isinstance(period, ConditionalPrice) else period
                found.append((provider.id, model.id, price))
    return found


def test_rates_read_once_price_every_model_and_period_as_calc_price_does() -> None:
    checked = 0
    for provider, model, model_price in every_price():
        rates = pricing._compile(model_price)
        for usage in USAGES:
            assert pricing._price(rates, usage) == reference(model_price, usage), (
                provider,
                model,
                usage,
            )
            checked += 1
    assert checked > 1000  # every model genai-prices knows, each period, every usage


@pytest.mark.parametrize(
    ("provider", "provider_id", "model"),
    [
        ("openai", "openai", "gpt-4o-mini-2024-07-18"),
        ("openai", "openai", "o4-mini"),
        ("anthropic", "anthropic", "claude-3-5-haiku-latest"),
        ("anthropic", "anthropic", "claude-opus-4-1"),
        ("gcp.gemini", "google", "gemini-2.5-flash"),
        ("aws.bedrock", "aws", "anthropic.claude-sonnet-4-20250514-v1:0"),
        ("azure.ai.openai", "azure", "gpt-4o"),
        ("groq", "groq", "llama-3.3-70b-versatile"),
        ("mistral_ai", "mistral", "mistral-large-latest"),
        ("deepseek", "deepseek", "deepseek-chat"),
    ],
)
def test_the_book_finds_models_as_calc_price_does(
    book: GenAIPricesBook, provider: str, provider_id: str, model: str
) -> None:
    for usage in USAGES:
        expected = calc_price(
            Usage(
                input_tokens=usage.input_tokens,
                output_tokens=usage.output_tokens,
                cache_read_tokens=usage.cache_read_tokens,
                cache_write_tokens=usage.cache_write_tokens,
                output_reasoning_tokens=usage.reasoning_tokens,
            ),
            model,
            provider_id=provider_id,
            genai_request_timestamp=AT,
        ).total_price
        assert cost(book, provider, model, usage) == expected


def test_lookups_are_bounded() -> None:
    small = GenAIPricesBook(max_models=2)
    usage = UsageDetails(input_tokens=1, output_tokens=1)
    for index in range(10):
        small.cost("openai", f"nobody-{index}", usage, at=AT)
    assert len(small._models) == 2
    assert small.cost("openai", "gpt-4o", usage, at=AT) is not None  # still priced


def test_estimates_count_characters() -> None:
    from pipeline.types import (
        ChatMessage,
        ChatResponseUpdate,
        FunctionCallContent,
        ReasoningContent,
        TextContent,
    )

    assert pricing.estimate_input_tokens([ChatMessage.user("x" * 40)]) == 10 + 4
    update = ChatResponseUpdate(
        contents=[
            TextContent("abcd" * 3),
            ReasoningContent("think"),
            FunctionCallContent("c1", "f", {"a": 1}),
        ]
    )
    assert pricing.streamed_characters(update) == 12 + 5 + 1 + len(repr({"a": 1}))
    assert pricing.estimated_output_tokens(9) == 3
    assert pricing.estimated_output_tokens(0) == 0


def test_every_provider_name_of_the_semantic_conventions_has_its_price_book_id() -> None:
    """A provider reporting a `gen_ai.provider.name` of the conventions needs no entry of its
    own in `PROVIDERS` (docs/development.md, "Adding a wire API")."""
    from opentelemetry.semconv._incubating.attributes.gen_ai_attributes import (
        GenAiProviderNameValues,
    )

    assert {name.value for name in GenAiProviderNameValues} <= set(pricing.PROVIDERS)
    known = {provider.id for provider in data_snapshot.get_snapshot().providers}
    assert {book for book in pricing.PROVIDERS.values() if book is not None} <= known
