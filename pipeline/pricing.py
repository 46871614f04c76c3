"""What a provider attempt cost: `Cost`, a route's own `Price`, and `PriceBook`s, by default
`GenAIPricesBook` over the `genai-prices` package's maintained price data.

Token counts follow `UsageDetails`: `input_tokens` counts every input token, the cached ones
included (as providers report them), and `cache_read_tokens` / `cache_write_tokens` say how
many of them a prompt cache served or stored; `reasoning_tokens` are part of `output_tokens`.
So a cached token is priced once, at its own rate, never also at the input rate; reasoning
tokens cost the output rate unless the model has a rate of their own. A model the book does
not know is priced `None` (recorded unpriced, never guessed). Amounts are `Decimal`s in the
book's currency (USD for genai-prices) or the `Price`'s.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, Protocol, runtime_checkable

from pydantic import Field, PrivateAttr, StringConstraints

from pipeline._scope import PricedAttempt
from pipeline._settings import Settings
from pipeline.errors import CircuitOpenError, ProviderError, UnsendableRequestError
from pipeline.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseUpdate,
    FunctionCallContent,
    Messages,
    ReasoningContent,
    TextContent,
    UsageDetails,
    as_messages,
)

if TYPE_CHECKING:
    from genai_prices.types import ModelInfo, ModelPrice

__all__ = [
    "CHARS_PER_TOKEN",
    "PROVIDERS",
    "Cost",
    "GenAIPricesBook",
    "Price",
    "PriceBook",
    "attempt_usage",
    "default_book",
    "estimate_input_tokens",
    "estimated_output_tokens",
    "priced",
    "priced_attempt",
    "reached_provider",
    "response_characters",
    "streamed_characters",
]

CHARS_PER_TOKEN = 4
"""Characters per token where no count came: the estimate of a stream without usage."""

_MILLION = Decimal(1_000_000)
_ZERO = Decimal(0)


class Cost(NamedTuple):
    """What an attempt cost: `amount` in `currency` units; `estimated` when some of its token
    counts were estimated (the provider reported none, or the stream was cut before it did).
    Immutable (a named tuple)."""

    amount: Decimal
    currency: str = "USD"
    estimated: bool = False


@runtime_checkable
class PriceBook(Protocol):
    """Prices attempts by provider and model (the provider's `gen_ai.provider.name`, as the
    clients' metadata says it). `None`: the book does not know the model."""

    def cost(
        self, provider: str | None, model: str | None, usage: UsageDetails, *, at: datetime
    ) -> Cost | None:
        """What `usage` of `model` at `provider` cost at the time `at` (UTC)."""


def _decimal(value: float) -> Decimal:
    # The decimal a user typed (0.15), not the binary float's expansion.
    return Decimal(repr(value))


def _count(value: int | None) -> int:
    return value if value is not None and value > 0 else 0


def _charge(
    usage: UsageDetails,
    input_rate: Decimal,
    output_rate: Decimal,
    cache_read_rate: Decimal | None,
    cache_write_rate: Decimal | None,
) -> Decimal:
    """Per-million rates applied to `usage`, each token once: a cached token at its own rate
    (the input rate when there is none), the other input tokens at the input rate."""
    total_input = _count(usage.input_tokens)
    read = _count(usage.cache_read_tokens)
    written = _count(usage.cache_write_tokens)
    if read or written:
        read = min(read, total_input)
        written = min(written, total_input - read)
    plain = total_input - read - written
    amount = Decimal(plain) * input_rate + Decimal(_count(usage.output_tokens)) * output_rate
    if read:
        amount += Decimal(read) * (input_rate if cache_read_rate is None else cache_read_rate)
    if written:
        amount += Decimal(written) * (input_rate if cache_write_rate is None else cache_write_rate)
    return amount / _MILLION


_Money = Annotated[float, Field(ge=0)]


class Price(Settings):
    """What a route costs, in currency units per million tokens (finite, not negative). A
    route's price wins over the price book's for that route's attempts."""

    input_per_million: _Money
    """What a million input (prompt) tokens cost, in your currency unit."""
    output_per_million: _Money
    """What a million output (generated) tokens cost, in the same unit (reasoning tokens
    included)."""
    cache_read_per_million: _Money | None = None
    """What a million input tokens read from the provider's prompt cache cost (unset: the input
    price)."""
    cache_write_per_million: _Money | None = None
    """What a million input tokens written to the provider's prompt cache cost (unset: the input
    price)."""
    currency: Annotated[str, StringConstraints(pattern=r"^[A-Z]{3}$")] = "USD"
    """The currency of these prices (an ISO 4217 code such as `USD` or `EUR`)."""

    _rates: tuple[Decimal, Decimal, Decimal | None, Decimal | None] = PrivateAttr()

    def model_post_init(self, context: Any, /) -> None:
        cache_read, cache_write = self.cache_read_per_million, self.cache_write_per_million
        self._rates = (
            _decimal(self.input_per_million),
            _decimal(self.output_per_million),
            None if cache_read is None else _decimal(cache_read),
            None if cache_write is None else _decimal(cache_write),
        )

    def __init__(self, *prices: float, **fields: Any) -> None:
        # Price(0.15, 0.6) or Price(input_per_million=0.15, output_per_million=0.6).
        if len(prices) > 2:
            raise TypeError("Price takes the input and the output price per million tokens")
        named = dict(zip(("input_per_million", "output_per_million"), prices, strict=False))
        super().__init__(**named, **fields)

    def cost(self, input_tokens: int | None, output_tokens: int | None) -> float:
        """The price of plain input and output tokens (no prompt cache), as a float."""
        return (
            (input_tokens or 0) * self.input_per_million
            + (output_tokens or 0) * self.output_per_million
        ) / 1_000_000

    def charge(self, usage: UsageDetails, *, estimated: bool = False) -> Cost:
        """What `usage` costs at this price, each token once (see the module docstring)."""
        # The private attribute read directly: pydantic's attribute hook costs several
        # microseconds a read, and this runs for every attempt.
        rates = self.__pydantic_private__["_rates"]  # type: ignore[index]
        return Cost(_charge(usage, *rates), self.currency, estimated)


# -- genai-prices ------------------------------------------------------------------------------

PROVIDERS: Mapping[str, str | None] = {
    "openai": "openai",
    "azure.ai.openai": "azure",
    "azure.ai.inference": "azure",
    "azure_openai": "azure",
    "anthropic": "anthropic",
    "gcp.gemini": "google",
    "gcp.vertex_ai": "google",
    "gcp.gen_ai": "google",
    "google": "google",
    "aws.bedrock": "aws",
    "groq": "groq",
    "mistral_ai": "mistral",
    "mistral": "mistral",
    "deepseek": "deepseek",
    "x_ai": "x-ai",
    "xai": "x-ai",
    "together": "together",
    "fireworks": "fireworks",
    "openrouter": "openrouter",
    "perplexity": "perplexity",
    "cohere": "cohere",
    "ibm.watsonx.ai": None,  # not in genai-prices
    # Models run by the caller's own hardware, or simulated: no price to look up.
    "ollama": None,
    "vllm": None,
    "local": None,
    "scripted": None,
}
"""Providers' names (`gen_ai.provider.name`) -> genai-prices' provider ids: every name the
semantic conventions define (a test holds it whole, so a provider of a new wire API that
reports one of them needs no entry here), and the vendors' and our own names; a name not
here is looked up as it is."""

# The usage keys of genai-prices we report, by their place in `_price`'s counts.
_KEYS = (
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "output_reasoning_tokens",
    "requests",
)
_INPUT, _OUTPUT, _CACHE_READ, _CACHE_WRITE, _REASONING, _REQUESTS = range(len(_KEYS))
_EPOCH_DAY = datetime(1970, 1, 1, tzinfo=UTC).toordinal()  # the ordinal of day 0 in seconds


@dataclass(frozen=True, slots=True)
class _Rates:
    """One model's prices of one period, read from genai-prices once: per usage count we
    report (by its place in `_KEYS`), the price (a `Decimal`, or a tiered price) and its
    unit's size; which priced parts leave their whole's count."""

    units: tuple[tuple[int, Any, int], ...]
    less_read: bool  # cache reads are priced apart: not at the input price too
    less_written: bool
    less_reasoning: bool


def _compile(model_price: ModelPrice) -> _Rates:
    from genai_prices.units import _get_registry

    registry = _get_registry()
    units: list[tuple[int, Any, int]] = []
    for key, value in model_price.__dict__.items():
        if key.startswith("_") or value is None:
            continue
        try:
            unit = registry.unit_for_price_key(key)
        except KeyError:
            continue  # genai-prices ignores it too (with a warning)
        if unit.usage_key in _KEYS:
            units.append((_KEYS.index(unit.usage_key), value, unit.per))
        # Any other unit (audio, images, searches ...) counts what we never report: zero.
    priced = {unit[0] for unit in units}
    return _Rates(
        tuple(units),
        _CACHE_READ in priced,
        _CACHE_WRITE in priced,
        _REASONING in priced,
    )


def _price(rates: _Rates, usage: UsageDetails) -> Decimal | None:
    """genai-prices' ``ModelPrice.calc_price`` for the usage we report, from `rates`: each
    priced unit's own tokens (a whole's count less its priced parts'), at its price (a
    tiered price by the total input tokens), over its unit's size. None when genai-prices
    would refuse the usage (a count negative, a part larger than its whole)."""
    total_input = usage.input_tokens or 0
    output_tokens = usage.output_tokens or 0
    read = usage.cache_read_tokens or 0
    written = usage.cache_write_tokens or 0
    reasoning = usage.reasoning_tokens or 0
    if (
        min(total_input, output_tokens, read, written, reasoning) < 0
        or read + written > total_input
        or reasoning > output_tokens
    ):
        return None
    input_tokens = total_input
    if rates.less_read:
        input_tokens -= read
    if rates.less_written:
        input_tokens -= written
    if rates.less_reasoning:
        output_tokens -= reasoning
    counts = (input_tokens, output_tokens, read, written, reasoning, 1)
    amount = _ZERO
    for index, value, per in rates.units:
        count = counts[index]
        if not count:
            continue  # adds nothing (and Decimal arithmetic is what a price costs here)
        price = value
        if type(value) is not Decimal:  # tiered: by the total input tokens
            price = value.base
            for tier in reversed(value.tiers):
                if total_input > tier.start:
                    price = tier.price
                    break
        amount += price * count / per
    return amount


class _Model:
    """What the book knows of one (provider, model): its genai-prices entry, its rates when
    they never change, and those of the days asked so far when they change by date."""

    __slots__ = ("by_day", "fixed", "info")

    def __init__(self, info: ModelInfo) -> None:
        from genai_prices.types import ModelPrice, StartDateConstraint

        self.info = info
        prices = info.prices
        self.fixed: _Rates | None = None
        # Rates of dated prices, by day: only when every period starts on a date (a price
        # by the time of day, such as an off-peak rate, is read for each attempt).
        self.by_day: dict[int, _Rates] | None = None
        if isinstance(prices, ModelPrice) and not info.price_variants:
            self.fixed = _compile(prices)
        elif all(
            c.constraint is None or isinstance(c.constraint, StartDateConstraint)
            for c in (prices if isinstance(prices, list) else [])
        ):
            self.by_day = {}


class GenAIPricesBook:
    """Prices from the `genai-prices` package (cache-read, cache-write, reasoning, tiered and
    dated rates). A model's rates are read from the package once per provider, model and
    price period; each attempt is then priced from them (the package's own `calc_price`
    costs tens of microseconds a call). `providers` adds or replaces entries of the map from
    our provider names to the package's provider ids (`PROVIDERS`). At most `max_models`
    (provider, model) lookups are kept; past that, lookups are not remembered."""

    def __init__(
        self, *, providers: Mapping[str, str | None] | None = None, max_models: int = 4096
    ) -> None:
        self.providers: dict[str, str | None] = {**PROVIDERS, **(providers or {})}
        self.max_models = max_models
        self._models: dict[tuple[str, str], _Model | None] = {}
        self._rates: dict[int, tuple[ModelPrice, _Rates]] = {}
        self._lock = threading.Lock()
        self._snapshot: Any = None

    def _model(self, provider: str, model: str) -> _Model | None:
        key = (provider, model)
        found = self._models.get(key, self)
        if found is not self:
            return found  # type: ignore[return-value]
        provider_id = self.providers.get(provider, provider)
        known: _Model | None = None
        if provider_id is not None:
            snapshot = self._snapshot
            if snapshot is None:
                from genai_prices import data_snapshot

                snapshot = self._snapshot = data_snapshot.get_snapshot()
            try:
                _, info = snapshot.find_provider_model(model, None, provider_id, None)
            except LookupError:
                known = None
            else:
                known = _Model(info)
        with self._lock:
            if len(self._models) < self.max_models:
                self._models[key] = known
        return known

    def rates(self, provider: str, model: str, at: datetime | float) -> _Rates | None:
        """The rates of `model` at `provider` in force at `at` (UTC, or seconds since the
        epoch), or None when unknown."""
        known = self._model(provider, model)
        if known is None:
            return None
        if known.fixed is not None:
            return known.fixed
        by_day = known.by_day
        day = 0
        if by_day is not None:
            # The UTC day's ordinal, without making a datetime for a time in seconds.
            day = at.toordinal() if isinstance(at, datetime) else int(at // 86400) + _EPOCH_DAY
            found = by_day.get(day)
            if found is not None:
                return found
        if not isinstance(at, datetime):
            at = datetime.fromtimestamp(at, UTC)
        model_price = known.info.get_prices(at)
        cached = self._rates.get(id(model_price))
        if cached is None or cached[0] is not model_price:
            cached = (model_price, _compile(model_price))
            with self._lock:
                if len(self._rates) < self.max_models:
                    self._rates[id(model_price)] = cached
        if by_day is not None and len(by_day) < 8:
            by_day[day] = cached[1]
        return cached[1]

    def cost(
        self,
        provider: str | None,
        model: str | None,
        usage: UsageDetails,
        *,
        at: datetime | float,
    ) -> Cost | None:
        """What `usage` of `model` at `provider` cost at the time `at` (UTC, or seconds since
        the epoch), in USD; None for a model the package does not know, or usage it would
        refuse."""
        return self._cost(provider, model, usage, at, False)

    def _cost(
        self,
        provider: str | None,
        model: str | None,
        usage: UsageDetails,
        at: datetime | float,
        estimated: bool,
    ) -> Cost | None:
        if not provider or not model:
            return None
        rates = self.rates(provider, model, at)
        if rates is None:
            return None
        amount = _price(rates, usage)
        # Positionally: one per attempt, on the request's path.
        return None if amount is None else tuple.__new__(Cost, (amount, "USD", estimated))

    def warm(self) -> None:
        """Load the package's data now (about a fifth of a second), not at the first
        attempt priced."""
        self._model("openai", "gpt-4o-mini")


_default_book: GenAIPricesBook | None = None


def default_book() -> GenAIPricesBook:
    """The process's shared `GenAIPricesBook`."""
    global _default_book
    if _default_book is None:
        _default_book = GenAIPricesBook()
    return _default_book


# -- estimates ----------------------------------------------------------------------------------


def estimate_input_tokens(messages: Sequence[ChatMessage]) -> int:
    """A cheap, deterministic estimate: about four characters per token, plus framing."""
    characters = sum(len(m.text) for m in messages)
    return characters // CHARS_PER_TOKEN + 4 * len(messages)


def streamed_characters(update: ChatResponseUpdate) -> int:
    """The characters of generated output an update carries: text, reasoning and tool-call
    names and arguments (what an estimate of output tokens counts)."""
    count = 0
    for content in update.contents:
        if type(content) is TextContent or type(content) is ReasoningContent:
            count += len(content.text)
        elif type(content) is FunctionCallContent:
            count += len(content.name) + len(repr(content.arguments))
    return count


def estimated_output_tokens(characters: int) -> int:
    """Output tokens for `characters` streamed (`CHARS_PER_TOKEN` a token, rounded up)."""
    return math.ceil(characters / CHARS_PER_TOKEN)


def response_characters(response: ChatResponse) -> int:
    """The characters of generated output a whole response carries (as `streamed_characters`
    counts an update's)."""
    count = 0
    for message in response.messages:
        for content in message.contents:
            if type(content) is TextContent or type(content) is ReasoningContent:
                count += len(content.text)
            elif type(content) is FunctionCallContent:
                count += len(content.name) + len(repr(content.arguments))
    return count


def reached_provider(error: BaseException | None) -> bool:
    """Whether an attempt that ended with `error` reached its provider: not when a breaker
    refused it (`CircuitOpenError`) or the request could not be put on the wire."""
    return not isinstance(error, CircuitOpenError | UnsendableRequestError)


def attempt_usage(
    reported: UsageDetails | None,
    *,
    completed: bool,
    characters: int,
    messages: Messages,
    error: BaseException | None,
) -> tuple[UsageDetails, bool]:
    """What an attempt used, and whether any of it is estimated (one rule for every router
    and both call shapes):

    * a completed attempt's reported counts stand; a count it lacks is estimated (input from
      `messages`, output from the `characters` it generated);
    * a failure carrying the usage of the answer it refused (`ResponseValidationError`) uses
      that;
    * a provider's error answer before any output (a `ProviderError` with an HTTP status) used
      nothing;
    * anything else that ended early (cut, cancelled, abandoned, timed out) used what was
      reported, with the output at least what it had generated, and the input estimated when
      none was reported."""
    if not completed:
        carried = getattr(error, "usage", None)
        if isinstance(carried, UsageDetails):
            return carried, False
        if (
            reported is None
            and not characters
            and isinstance(error, ProviderError)
            and error.status_code is not None
        ):
            return UsageDetails(0, 0, 0), False
    estimated = False
    input_tokens = reported.input_tokens if reported is not None else None
    output_tokens = reported.output_tokens if reported is not None else None
    if input_tokens is None:
        input_tokens, estimated = estimate_input_tokens(as_messages(messages)), True
    if output_tokens is None:
        output_tokens, estimated = estimated_output_tokens(characters), True
    elif not completed:
        counted = estimated_output_tokens(characters)
        if counted > output_tokens:
            output_tokens, estimated = counted, True
    if reported is not None and not estimated:
        return reported, False
    return (
        UsageDetails(
            input_tokens,
            output_tokens,
            input_tokens + output_tokens,
            reported.reasoning_tokens if reported is not None else None,
            reported.cache_read_tokens if reported is not None else None,
            reported.cache_write_tokens if reported is not None else None,
        ),
        estimated,
    )


def priced_attempt(
    *,
    route: str,
    number: int,
    outcome: str,
    provider: str | None,
    model_requested: str | None,
    model_served: str | None,
    reported: UsageDetails | None,
    characters: int,
    messages: Messages,
    error: BaseException | None,
    price: Price | None,
    book: PriceBook | None,
    started_at: float,
    duration: float,
    time_to_first_update: float | None,
) -> PricedAttempt:
    """One attempt that reached a provider, priced: what it used (`attempt_usage`) at the
    route's `price` or the `book`'s (`priced`), for the request's attempt log. Every router
    and the spend layer (a call without a router) price attempts here, once."""
    usage, estimated = attempt_usage(
        reported,
        completed=outcome == "completed",
        characters=characters,
        messages=messages,
        error=error,
    )
    cost = priced(
        price,
        book,
        provider,
        model_served or model_requested,
        usage,
        at=started_at,
        estimated=estimated,
    )
    # Positionally, in the fields' order (one per attempt, on the request's path).
    return tuple.__new__(
        PricedAttempt,
        (
            route,
            number,
            outcome,
            provider,
            model_requested,
            model_served,
            usage,
            estimated,
            cost,
            started_at,
            duration,
            time_to_first_update,
            None,
            None,
        ),
    )


def priced(
    price: Price | None,
    book: PriceBook | None,
    provider: str | None,
    model: str | None,
    usage: UsageDetails,
    *,
    at: datetime | float,
    estimated: bool,
) -> Cost | None:
    """The one pricing decision: the route's `price` when it has one (it wins), else the
    `book`'s at the time `at` (UTC, or seconds since the epoch); `estimated` marks a cost
    whose counts were estimated. A book that fails is no price (it never fails the
    request)."""
    if price is not None:
        return price.charge(usage, estimated=estimated)
    if book is None:
        return None
    try:
        if type(book) is GenAIPricesBook:  # the default: takes the time in seconds as it is
            return book._cost(provider, model, usage, at, estimated)
        if not isinstance(at, datetime):
            at = datetime.fromtimestamp(at, UTC)
        cost = book.cost(provider, model, usage, at=at)
    except Exception:  # a book that fails prices nothing; the attempt stands
        return None
    if cost is None or not estimated:
        return cost
    return Cost(cost.amount, cost.currency, True)
