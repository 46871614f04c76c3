"""The response cache: an answer already given is given again, without a provider call.

`CachingChatClient` keys an answer by everything that changes it (hashed, no text in a
key), never stores an error, a cut stream or a cancelled call, replays a hit whole or as a
stream, and lets concurrent identical requests make one provider call.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, TypeVar, runtime_checkable

from opentelemetry import trace
from pydantic import Field, field_validator

from pipeline import _redis, _scope
from pipeline._cache_scope import CacheReport, current_cache_report
from pipeline._semconv import (
    CACHE_KIND,
    CACHE_LOOKUPS_METRIC,
    CACHE_RESULT,
    CACHE_SAVED_COST_METRIC,
    CACHE_SCOPE,
    CACHE_SIMILARITY,
    ROUTE_NAME,
    meter,
)
from pipeline._settings import Settings
from pipeline._streams import StreamEnd, StreamWatcher, caller_cancelling, forward
from pipeline.client import ChatClient, DelegatingChatClient, EmbeddingGenerator, metadata_of
from pipeline.errors import RedisUnavailable
from pipeline.pricing import Cost
from pipeline.types import (
    PROVIDER_EXTRAS,
    CacheMode,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    Content,
    CustomTool,
    DataContent,
    FinishReason,
    FunctionCallContent,
    FunctionResultContent,
    FunctionTool,
    Messages,
    RawTool,
    ReasoningContent,
    TextContent,
    ToolChoice,
    UsageDetails,
    as_messages,
)

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider

__all__ = [
    "DEFAULT_IGNORE_FIELDS",
    "CacheMode",
    "CacheSettings",
    "CacheStore",
    "CachingChatClient",
    "MemoryCacheStore",
    "RedisCacheStore",
    "SemanticCacheSettings",
    "cache_key",
]

_logger = logging.getLogger("chat_pipeline.cache")
_T = TypeVar("_T")

# What a request does while its store is unavailable (the end of each warning).
_FALLBACK = "answering every request as a miss"

DEFAULT_THRESHOLD = 0.94
"""The default semantic threshold: with all-MiniLM-L6-v2 on the paraphrase set of
``benchmarks/data/paraphrases.jsonl`` it gave a precision of 1.0 (no wrong answer; 0.92
was the lowest threshold at or above 0.99), at a recall of about 0.3 (see the cache's docs
page). Another embedding model needs its own measurement."""


# -- settings ----------------------------------------------------------------------------------


DEFAULT_IGNORE_FIELDS = frozenset(
    {
        "metadata",
        "user",
        "prompt_cache_key",
        "prompt_cache_retention",
        "client_metadata",
        "store",
        "stream_options",
        "safety_identifier",
        "service_tier",
    }
)
"""Request fields that cannot change an answer (who asks, for which session, how it is
billed, cached upstream, stored or streamed), left out of every cache key: two runs of an
agent that differ only in them (Claude Code's ``metadata.user_id``, Codex's
``prompt_cache_key``: both per session) share their entries."""


class CacheSettings(Settings):
    """How a response cache keys, keeps and shares answers."""

    code_only = frozenset({"scope"})

    ttl: Annotated[float, Field(gt=0)] = 3600.0
    """Seconds an answer is kept after it was stored."""
    scope: Callable[[list[ChatMessage], ChatOptions], str | None] | None = None
    """A function of the request (messages, options) whose value is part of every key:
    requests with different values never share an entry (a tenant, a user)."""
    single_flight: bool = True
    """Concurrent identical requests make one provider call; the others wait for it (within
    their own deadlines) or stream along."""
    per_session: bool = False
    """Whether `ChatOptions.session_id` is part of the key (each session its own answers;
    the same as ``"session"`` in `partition_by`)."""
    ignore_fields: frozenset[str] = Field(default=DEFAULT_IGNORE_FIELDS, strict=False)
    """Fields of `ChatOptions.additional_properties` (and of its provider-scoped tables, such
    as Anthropic's ``metadata``) left out of the key: they describe the caller, its billing,
    its session or the transport, and cannot change the answer. The defaults always apply;
    names given here are added to them."""
    partition_by: frozenset[Literal["user", "session"]] = Field(default=frozenset(), strict=False)
    """What besides the caller's identity (the partition a server gives: the gateway's
    caller key) keeps entries apart: ``"user"`` (the user a server names, else a ``user``
    in `ChatOptions.additional_properties`), ``"session"`` (`ChatOptions.session_id`)."""
    finish_reasons: frozenset[str] = Field(
        default=frozenset({"stop", "tool_calls", "length"}), strict=False
    )
    """The finish reasons of answers that are stored; anything else (content filtered, a
    provider's own reason, none) is not."""
    max_entry_bytes: Annotated[int, Field(ge=1)] = 1 << 20
    """Answers larger than this (encoded) are not stored."""
    timeout: Annotated[float, Field(gt=0)] = 0.1
    """Seconds a store of your own may take per call before the request goes on without it
    (the built-in stores bring their own bound)."""
    retry_interval: Annotated[float, Field(ge=0, le=3600)] = 1.0
    """Seconds a store of your own that failed is skipped before it is tried again."""

    @field_validator("ignore_fields")
    @classmethod
    def _with_the_defaults(cls, value: frozenset[str]) -> frozenset[str]:
        return DEFAULT_IGNORE_FIELDS | value


class SemanticCacheSettings(Settings):
    """The semantic layer of a response cache: after an exact miss, the closest stored
    answer to the last user message, at or above `threshold`, within the same partition."""

    code_only = frozenset({"embeddings"})

    embeddings: EmbeddingGenerator
    """The embedding generator (`EmbeddingGenerator`) the query and candidates are embedded
    with."""
    threshold: Annotated[float, Field(gt=0, le=1)] = DEFAULT_THRESHOLD
    """The cosine similarity at or above which a stored answer is a hit: the default gave a
    precision of at least 0.99 on the measured paraphrase set (a wrong answer is worse than a
    miss)."""
    max_candidates: Annotated[int, Field(ge=1)] = 1000
    """Answers per semantic partition kept as candidates (the oldest are forgotten)."""
    max_partitions: Annotated[int, Field(ge=1)] = 10_000
    """Semantic partitions kept in this process (least recently used first out)."""
    max_bytes: Annotated[int, Field(ge=1)] = 64 << 20
    """Bytes the candidates (vectors and keys) may hold in this process, least recently used
    partition first out; with a `MemoryCacheStore` they count in its `max_bytes` too (the
    bound of answers and candidates together)."""
    embedding_timeout: Annotated[float, Field(gt=0)] = 2.0
    """Seconds embedding a query may take; a slower, failed or empty embedding is a miss."""
    max_query_chars: Annotated[int, Field(ge=1)] = 2000
    """Queries longer than this are looked up exactly only (their embedding says little)."""


# -- stores ------------------------------------------------------------------------------------


@runtime_checkable
class CacheStore(Protocol):
    """Where answers are kept, as bytes, by key (a hash)."""

    async def get(self, key: str) -> bytes | None:
        """The entry stored under `key`, or None (absent or expired)."""
        ...

    async def set(self, key: str, value: bytes, ttl: float) -> None:
        """Store `value` under `key` for `ttl` seconds."""
        ...


# A store may also have ``async delete(key)``: an entry that no longer decodes (tampered,
# another version) is then deleted when read; without it, the entry expires with its TTL.


_ENTRY_OVERHEAD = 64
"""Bytes counted per entry beyond its key and value (the bound is of what is stored, plus
this much for the bookkeeping)."""
_PARTITION_BYTES = 256
"""Bytes counted per semantic partition beyond its index's own (its key, the objects)."""


class MemoryCacheStore:
    """Answers in this process: at most `max_bytes` of keys and values (least recently used
    first out; an entry larger than the bound is not kept), each forgotten `ttl` seconds
    after it was stored. Never waits. `clock` is injectable."""

    def __init__(
        self, max_bytes: int = 64 << 20, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError("max_bytes must be a positive integer")
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self.bytes = 0

    async def get(self, key: str) -> bytes | None:
        return self.get_now(key)

    def get_now(self, key: str) -> bytes | None:
        """`get` without awaiting (the layer calls it directly)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        value, expires = entry
        if self._clock() >= expires:
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return value

    async def set(self, key: str, value: bytes, ttl: float) -> None:
        self.set_now(key, value, ttl)

    def set_now(self, key: str, value: bytes, ttl: float) -> None:
        """`set` without awaiting."""
        size = len(key) + len(value) + _ENTRY_OVERHEAD
        if key in self._entries:
            self._drop(key)
        if size > self.max_bytes:
            return
        self._entries[key] = (value, self._clock() + ttl)
        self.bytes += size
        while self.bytes > self.max_bytes and self._entries:
            self._drop(next(iter(self._entries)))

    def hold(self, change: int) -> None:
        """Count `change` bytes held beside the entries (a semantic cache's candidates) in
        `bytes`; entries are dropped, least recently used first, to stay within
        `max_bytes` (what is held beside them is its holder's to shed)."""
        self.bytes += change
        while self.bytes > self.max_bytes and self._entries:
            self._drop(next(iter(self._entries)))

    async def delete(self, key: str) -> None:
        self.delete_now(key)

    def delete_now(self, key: str) -> None:
        """`delete` without awaiting: forget `key`'s entry, if any."""
        if key in self._entries:
            self._drop(key)

    def _drop(self, key: str) -> None:
        value, _ = self._entries.pop(key)
        self.bytes -= len(key) + len(value) + _ENTRY_OVERHEAD

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"MemoryCacheStore(entries={len(self)}, bytes={self.bytes}/{self.max_bytes})"


class RedisCacheStore:
    """Answers shared by every replica through Redis (a URL or a ``redis.asyncio`` client;
    see `pipeline._redis`): one key per answer under `namespace`, expiring with its `ttl`.

    The lookups of one turn of the event loop are one ``MGET`` and its writes one pipelined
    round trip, so a hit costs one round trip and a thousand concurrent lookups a few. Each
    call gives up after `timeout` seconds; a failure or a timeout is a miss (a dropped write),
    never an error, is logged when an outage starts (then at most once a minute, the error's
    type only) and makes the store skip Redis for `retry_interval` seconds."""

    def __init__(
        self,
        url: Any,
        *,
        namespace: str = "chat_pipeline:cache",
        timeout: float = 0.1,
        retry_interval: float = 1.0,
    ) -> None:
        for name, value in (("timeout", timeout), ("retry_interval", retry_interval)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name} must be a number of seconds")
        if not 0 < timeout < float("inf"):
            raise ValueError("timeout must be a positive number of seconds")
        if not 0 <= retry_interval <= 3600:
            raise ValueError("retry_interval must be between 0 and 3600 seconds")
        if not isinstance(namespace, str) or not namespace:
            raise ValueError("namespace must be a non-empty string")
        try:
            self._redis = _redis.RedisClient(url, timeout=timeout)
        except ValueError as exc:
            raise ValueError(f"redis: {exc}") from None
        self.namespace = namespace
        self.timeout = timeout
        self.retry_interval = retry_interval
        self._outage = _redis.Outage(
            _logger, "response cache store: Redis", _FALLBACK, retry_interval
        )
        self._lookups = _redis.Batched(self._look_up)
        self._writes = _redis.Batched(self._write)

    async def get(self, key: str) -> bytes | None:
        values, index, _ = await self._lookups.add(f"{self.namespace}:{key}")
        if values is None:
            return None
        value = values[index]
        if value is None or isinstance(value, bytes):
            return value
        # A client of the caller's own may decode replies (decode_responses=True).
        return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else None

    async def _look_up(self, keys: list[str]) -> list[Any] | None:
        try:
            return list(await self._redis.attempt(self._outage, lambda client: client.mget(keys)))
        except RedisUnavailable:
            return None

    async def set(self, key: str, value: bytes, ttl: float) -> None:
        await self._writes.add((f"{self.namespace}:{key}", value, max(1, round(ttl * 1000))))

    async def _write(self, records: list[tuple[str, bytes, int]]) -> None:
        async def write(client: Any) -> None:
            async with client.pipeline(transaction=False) as pipe:
                for key, value, ttl_ms in records:
                    pipe.set(key, value, px=ttl_ms)
                await pipe.execute()

        with contextlib.suppress(RedisUnavailable):  # logged; the answer stands
            await self._redis.attempt(self._outage, write)

    async def delete(self, key: str) -> None:
        """Forget `key`'s entry (bounded like every call; a failure is logged, not raised)."""
        name = f"{self.namespace}:{key}"
        with contextlib.suppress(RedisUnavailable):
            await self._redis.attempt(self._outage, lambda client: client.delete(name))

    async def aclose(self) -> None:
        """Close the client made from a URL (a client of your own stays open)."""
        await self._lookups.aclose()
        await self._writes.aclose()
        await self._redis.aclose()

    def __repr__(self) -> str:
        return f"RedisCacheStore({self._redis!r})"


class _GuardedStore:
    """A store of the caller's own, bounded by `timeout` per call and skipped for
    `retry_interval` after a failure (one warning per outage)."""

    def __init__(self, store: CacheStore, timeout: float, retry_interval: float) -> None:
        self.store = store
        self.timeout = timeout
        self._outage = _redis.Outage(
            _logger, f"response cache store ({type(store).__name__})", _FALLBACK, retry_interval
        )

    async def _guarded(self, call: Callable[[], Awaitable[_T]]) -> _T | None:
        return await self._outage.guard(call, self.timeout)

    async def get(self, key: str) -> bytes | None:
        value = await self._guarded(lambda: self.store.get(key))
        return value if isinstance(value, bytes) else None

    async def set(self, key: str, value: bytes, ttl: float) -> None:
        await self._guarded(lambda: self.store.set(key, value, ttl))

    async def delete(self, key: str) -> None:
        delete = getattr(self.store, "delete", None)
        if delete is not None:
            await self._guarded(lambda: delete(key))


# -- keys --------------------------------------------------------------------------------------


# A value no key (or entry) can represent faithfully raises `TypeError` here, as `json` does
# for what it cannot encode: the request is then not cached (or the answer not stored).
_UNCACHEABLE = (TypeError, ValueError, RecursionError)


_SCHEMAS: dict[type, Any] = {}
"""The JSON schema of each pydantic model class used as a response format (a class lives as
long as the process: computing its schema per request would cost more than the lookup)."""


def _json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"$dataclass": type(value).__qualname__, **dataclasses.asdict(value)}
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        schema = _SCHEMAS.get(value)
        if schema is None:
            schema = {"$model": value.__qualname__, "schema": value.model_json_schema()}
            if len(_SCHEMAS) < 1024:
                _SCHEMAS[value] = schema
        return schema
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return {"$model": type(value).__qualname__, "value": dump(mode="json")}
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode()}
    if isinstance(value, frozenset | set):
        return {"$set": sorted(json.dumps(item, default=_json_default) for item in value)}
    raise TypeError("no faithful key for this value")


def _canonical(value: Any) -> bytes:
    try:
        return json.dumps(
            value,
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
            default=_json_default,
            allow_nan=True,
        ).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError, RecursionError):
        raise TypeError("no faithful key for this value") from None


def _tool_shape(tool: Any) -> Any:
    """What a tool is to a provider: a mapping (the deprecated untyped form) as it is; a
    raw tool by its API and body; a custom tool by its kind, name, description and input
    format; any other definition by its name, description and schema, and a function
    tool's fields for each API too (but a prompt-cache breakpoint, which changes only the
    bill)."""
    match tool:
        case dict():
            return tool
        case RawTool():
            return {"$raw": tool.api, "body": dict(tool.body)}
        case CustomTool():
            return {"$custom": tool.name, "description": tool.description, "format": tool.format}
    name = getattr(tool, "name", None)
    if not isinstance(name, str):
        return tool
    shape = {
        "name": name,
        "description": getattr(tool, "description", None),
        "parameters": getattr(tool, "parameters", None),
    }
    if type(tool) is FunctionTool and tool.additional_properties:
        fields = {
            api: {key: value for key, value in extra.items() if key != "cache_control"}
            for api, extra in tool.additional_properties.items()
        }
        answering = {api: extra for api, extra in fields.items() if extra}
        if answering:
            shape["fields"] = answering
    return shape


_NOT_KEYED = frozenset({"cache", "session_id"})
_KEYED_OPTIONS = tuple(f.name for f in dataclasses.fields(ChatOptions) if f.name not in _NOT_KEYED)


class _Hasher:
    """Feeds the parts of a request to SHA-256, each framed by a tag and its length, so no
    two different requests feed the same bytes."""

    __slots__ = ("update",)

    def __init__(self, digest: Any) -> None:
        self.update = digest.update

    def text(self, tag: bytes, value: str | None) -> None:
        if value is None:
            self.update(tag + b"\x00")
            return
        data = value.encode("utf-8", "surrogatepass")
        self.update(tag + len(data).to_bytes(8, "little"))
        self.update(data)

    def data(self, tag: bytes, value: bytes) -> None:
        self.update(tag + len(value).to_bytes(8, "little"))
        self.update(value)


def _feed_content(hasher: _Hasher, content: Content) -> None:
    kind = type(content)
    if kind is TextContent:
        hasher.text(b"T", content.text)  # type: ignore[union-attr]
    elif kind is FunctionCallContent:
        assert isinstance(content, FunctionCallContent)
        hasher.text(b"C", content.call_id)
        hasher.text(b"N", content.name)
        hasher.data(b"A", _canonical(dict(content.arguments)))
        # A custom tool's call and a JSON call of one "input" argument are different turns.
        hasher.update(b"K1" if content.custom else b"K0")
    elif kind is FunctionResultContent:
        assert isinstance(content, FunctionResultContent)
        hasher.text(b"R", content.call_id)
        hasher.data(b"V", _canonical(content.result))
        error = content.exception
        hasher.text(b"E", None if error is None else f"{type(error).__qualname__}:{error}")
    elif kind is DataContent:
        assert isinstance(content, DataContent)
        hasher.data(b"D", content.data or b"")
        hasher.text(b"U", content.uri)
        hasher.text(b"M", content.media_type)
    elif kind is ReasoningContent:
        assert isinstance(content, ReasoningContent)
        hasher.text(b"G", content.text)
        hasher.text(b"P", content.protected)
        hasher.text(b"I", content.id)
        hasher.update(b"X1" if content.redacted else b"X0")
    else:
        raise TypeError("no faithful key for this value")


_ROLE_FRAMES: dict[str, str] = {role: f"\x1em{role.value}\x1f" for role in ChatRole}
"""Each role's frame, made once (a role given as a plain string finds its enum's entry):
formatting an enum per message costs more than framing its text."""


def _feed_messages(hasher: _Hasher, messages: Sequence[ChatMessage], skip_last: bool) -> None:
    # Text (most of a conversation) is framed as characters in one string, encoded and fed
    # once: per-piece hashing calls would cost more than the hashing itself. Each piece is
    # a tag and its length, so the framing stays unambiguous.
    parts: list[str] = []
    append = parts.append
    frames = _ROLE_FRAMES
    last = len(messages) - 1 if skip_last else -1
    for position, message in enumerate(messages):
        role = message.role
        append(frames.get(role) or f"\x1em{role}\x1f")
        name = message.author_name
        append("-" if name is None else f"{len(name)}:{name}")
        if position == last:
            append("\x1eq")  # the query: compared by meaning, not by bytes
            continue
        for content in message.contents:
            if type(content) is TextContent:
                text = content.text
                append(f"\x1eT{len(text)}:")
                append(text)
                continue
            if parts:
                hasher.update("".join(parts).encode("utf-8", "surrogatepass"))
                parts.clear()
            _feed_content(hasher, content)
    if parts:
        hasher.update("".join(parts).encode("utf-8", "surrogatepass"))


def _answering(extras: dict[str, Any], ignored: frozenset[str]) -> dict[str, Any]:
    """`extras` without the `ignored` fields, at the top and in the provider-scoped tables
    (a table left empty goes too): what of them can change the answer."""
    if ignored.isdisjoint(extras) and not any(
        key in PROVIDER_EXTRAS and isinstance(value, dict) and not ignored.isdisjoint(value)
        for key, value in extras.items()
    ):
        return extras
    kept: dict[str, Any] = {}
    for key, value in extras.items():
        if key in ignored:
            continue
        if key in PROVIDER_EXTRAS and isinstance(value, dict):
            value = {k: v for k, v in value.items() if k not in ignored}
            if not value:
                continue
        kept[key] = value
    return kept


def _feed_options(
    hasher: _Hasher,
    options: ChatOptions | None,
    per_session: bool,
    ignored: frozenset[str] = DEFAULT_IGNORE_FIELDS,
) -> None:
    # No options and options with nothing set are the same request.
    hasher.update(b"o")
    if options is None:
        return
    for name in _KEYED_OPTIONS:
        value = getattr(options, name)
        if name == "additional_properties" and value:
            value = _answering(value, ignored)
        if value is None or (name == "additional_properties" and not value):
            continue
        hasher.text(b"f", name)
        kind = type(value)
        if kind is str:
            hasher.text(b"s", value)
        elif kind is ToolChoice:
            hasher.text(b"c", value.mode)
            hasher.text(b"t", value.name)  # a named tool: "none" is no NONE
        elif name == "tools":
            hasher.data(b"j", _canonical([_tool_shape(tool) for tool in value]))
        else:
            hasher.data(b"j", _canonical(value))
    if per_session:
        hasher.text(b"S", options.session_id)


def cache_key(
    messages: Messages,
    options: ChatOptions | None = None,
    *,
    scope: str | None = None,
    per_session: bool = False,
    namespace: str = "",
    ignore_fields: frozenset[str] = DEFAULT_IGNORE_FIELDS,
) -> str:
    """The exact key of a request: a SHA-256 hex digest over the messages, every option
    that reaches a provider but the `ignore_fields` of its additional properties, `scope`
    and `namespace` (see the module docstring). `TypeError` when the request holds a value
    no key can represent."""
    try:
        return _digest(
            as_messages(messages), options, scope, per_session, namespace, False, ignore_fields
        )
    except _UNCACHEABLE:
        raise TypeError("the request holds a value a cache key cannot represent") from None


def _digest(
    messages: Sequence[ChatMessage],
    options: ChatOptions | None,
    scope: str | None,
    per_session: bool,
    namespace: str,
    semantic: bool,
    ignored: frozenset[str] = DEFAULT_IGNORE_FIELDS,
) -> str:
    digest = hashlib.sha256(
        b"chat_pipeline.cache/1\x00semantic" if semantic else b"chat_pipeline.cache/1"
    )
    hasher = _Hasher(digest)
    hasher.text(b"n", namespace)
    hasher.text(b"p", scope)
    _feed_options(hasher, options, per_session, ignored)
    _feed_messages(hasher, messages, semantic)
    return digest.hexdigest()


def _user_of(report: CacheReport | None, options: ChatOptions | None) -> str:
    """The user a request is for: the one its server named, else a ``user`` string in its
    additional properties, else "" (no user: every such request shares one partition)."""
    if report is not None and report.user is not None:
        return report.user
    user = options.additional_properties.get("user") if options is not None else None
    return user if isinstance(user, str) else ""


def _query_of(messages: Sequence[ChatMessage]) -> str | None:
    """The semantic query: the last message's text, when it is a user message of text only."""
    last = messages[-1]
    if last.role is not ChatRole.USER or not last.contents:
        return None
    if any(type(content) is not TextContent for content in last.contents):
        return None
    text = last.text.strip()
    return text or None


# -- entries -----------------------------------------------------------------------------------

_ROLES = {role.value: role for role in ChatRole}
_ENTRY_VERSION = 2


def _encode_content(content: Content) -> list[Any]:
    kind = type(content)
    if kind is TextContent:
        return ["t", content.text]  # type: ignore[union-attr]
    if kind is FunctionCallContent:
        assert isinstance(content, FunctionCallContent)
        return ["f", content.call_id, content.name, dict(content.arguments), content.custom]
    if kind is ReasoningContent:
        assert isinstance(content, ReasoningContent)
        return ["g", content.text, content.protected, content.id, content.redacted]
    if kind is DataContent:
        assert isinstance(content, DataContent)
        data = None if content.data is None else base64.b64encode(content.data).decode()
        return ["d", data, content.uri, content.media_type]
    if kind is FunctionResultContent:
        assert isinstance(content, FunctionResultContent)
        if content.exception is not None:
            raise TypeError("an exception cannot be stored faithfully")
        return ["r", content.call_id, content.result]
    raise TypeError("no faithful key for this value")


def _string(value: Any) -> str:
    if type(value) is not str:
        raise ValueError("expected a string")
    return value


def _optional_string(value: Any) -> str | None:
    return None if value is None else _string(value)


def _flag(value: Any) -> bool:
    if type(value) is not bool:
        raise ValueError("expected true or false")
    return value


def _fields(item: Any, count: int) -> list[Any]:
    if type(item) is not list or len(item) != count:
        raise ValueError("a record of another shape")
    return item


def _decode_content(item: Any) -> Content:
    if type(item) is not list or not item:
        raise ValueError("a content of another shape")
    tag = item[0]
    if tag == "t":
        return TextContent(_string(_fields(item, 2)[1]))
    if tag == "f":
        _, call_id, name, arguments, custom = _fields(item, 5)
        if type(arguments) is not dict:
            raise ValueError("tool call arguments that are no object")
        return FunctionCallContent(_string(call_id), _string(name), arguments, custom=_flag(custom))
    if tag == "g":
        _, text, protected, item_id, redacted = _fields(item, 5)
        return ReasoningContent(
            _string(text),
            protected=_optional_string(protected),
            id=_optional_string(item_id),
            redacted=_flag(redacted),
        )
    if tag == "d":
        _, data, uri, media_type = _fields(item, 4)
        decoded = None if data is None else base64.b64decode(_string(data), validate=True)
        return DataContent(
            data=decoded, uri=_optional_string(uri), media_type=_optional_string(media_type)
        )
    if tag == "r":
        _, call_id, result = _fields(item, 3)
        return FunctionResultContent(_string(call_id), result)
    raise ValueError("unknown content in a cache entry")


def _decode_contents(items: Any) -> list[Content]:
    if type(items) is not list:
        raise ValueError("contents that are no list")
    return [_decode_content(item) for item in items]


def _role(value: Any) -> ChatRole:
    role = _ROLES.get(value) if type(value) is str else None
    if role is None:
        raise ValueError("an unknown role")
    return role


def _encode_usage(usage: UsageDetails | None) -> list[int | None] | None:
    if usage is None:
        return None
    return [
        usage.input_tokens,
        usage.output_tokens,
        usage.total_tokens,
        usage.reasoning_tokens,
        usage.cache_read_tokens,
        usage.cache_write_tokens,
    ]


def _count(value: Any) -> int | None:
    if value is None or (type(value) is int and value >= 0):
        return value
    raise ValueError("a token count that is no whole number")


def _decode_usage(item: Any) -> UsageDetails | None:
    if item is None:
        return None
    return UsageDetails(*(_count(value) for value in _fields(item, 6)))


def _finite(value: Any) -> float:
    if type(value) is not float or not math.isfinite(value):
        raise ValueError("a time or cost that is no finite number")
    return value


@dataclasses.dataclass(slots=True)
class _Entry:
    """A stored answer: `response` (stored by a non-streaming call) or `updates` (by a
    streaming one), when it was stored (seconds since the epoch), its route and cost."""

    created: float
    response: ChatResponse | None
    updates: list[ChatResponseUpdate] | None
    route: str | None
    cost: float | None

    def as_response(self) -> ChatResponse:
        if self.response is not None:
            return self.response
        return ChatResponse.from_updates(self.updates or ())

    def as_updates(self) -> list[ChatResponseUpdate]:
        if self.updates is not None:
            return self.updates
        assert self.response is not None
        return self.response.to_updates()

    def age(self) -> int:
        return max(0, int(time.time() - self.created))


_ENTRY_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
"""Entries' JSON, compact; one encoder made once (json.dumps makes one per call)."""


def _encode_entry(
    response: ChatResponse | None,
    updates: list[ChatResponseUpdate] | None,
    route: str | None,
    cost: float | None,
) -> bytes:
    if cost is not None and not math.isfinite(cost):
        cost = None  # a price of the caller's own that said NaN: no cost known
    body: dict[str, Any] = {"v": _ENTRY_VERSION, "t": time.time(), "n": route, "c": cost}
    if response is not None:
        body["m"] = [
            [
                m.role.value,
                [_encode_content(c) for c in m.contents],
                m.author_name,
                m.additional_properties,
            ]
            for m in response.messages
        ]
        body["r"] = [
            response.response_id,
            response.model_id,
            response.finish_reason,
            _encode_usage(response.usage),
        ]
    else:
        body["u"] = [
            [
                None if u.role is None else u.role.value,
                [_encode_content(c) for c in u.contents],
                u.response_id,
                u.model_id,
                u.finish_reason,
                _encode_usage(u.usage),
            ]
            for u in updates or ()
        ]
    try:
        return _ENTRY_JSON(body).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError, RecursionError):
        raise TypeError("no faithful key for this value") from None


def _decode_entry(raw: bytes) -> _Entry:
    """The entry `raw` holds, checked to be exactly what `_encode_entry` writes (its
    types, shapes and finite numbers); `ValueError` (or `TypeError`) otherwise."""
    body = json.loads(raw.decode("utf-8", "surrogatepass"))
    if type(body) is not dict or body.get("v") != _ENTRY_VERSION:
        raise ValueError("a cache entry of another version")
    created = _finite(body.get("t"))
    route = _optional_string(body.get("n"))
    cost = body.get("c")
    if cost is not None:
        cost = _finite(cost)
    response = updates = None
    if "m" in body:
        if type(body["m"]) is not list:
            raise ValueError("messages that are no list")
        messages = []
        for item in body["m"]:
            role, contents, name, extra = _fields(item, 4)
            if extra is not None and type(extra) is not dict:
                raise ValueError("message properties that are no object")
            messages.append(
                ChatMessage(
                    _role(role),
                    _decode_contents(contents),
                    author_name=_optional_string(name),
                    additional_properties=extra,
                )
            )
        response_id, model_id, finish_reason, usage = _fields(body.get("r"), 4)
        response = ChatResponse(
            messages=messages,
            response_id=_optional_string(response_id),
            model_id=_optional_string(model_id),
            finish_reason=_optional_string(finish_reason),
            usage=_decode_usage(usage),
        )
    else:
        items = body.get("u")
        if type(items) is not list:
            raise ValueError("updates that are no list")
        updates = []
        for item in items:
            role, contents, response_id, model_id, finish_reason, usage = _fields(item, 6)
            updates.append(
                ChatResponseUpdate(
                    role=None if role is None else _role(role),
                    contents=_decode_contents(contents),
                    response_id=_optional_string(response_id),
                    model_id=_optional_string(model_id),
                    finish_reason=_optional_string(finish_reason),
                    usage=_decode_usage(usage),
                )
            )
    return _Entry(created, response, updates, route, cost)


def _copy_update(update: ChatResponseUpdate) -> ChatResponseUpdate:
    return ChatResponseUpdate(
        role=update.role,
        contents=list(update.contents),
        response_id=update.response_id,
        model_id=update.model_id,
        finish_reason=update.finish_reason,
        usage=update.usage,
        value=update.value,
    )


# -- single flight -----------------------------------------------------------------------------


class _Flight:
    """One provider call that every identical request under way listens to."""

    __slots__ = (
        "cancelled",
        "cost",
        "done",
        "error",
        "finished",
        "key",
        "listeners",
        "response",
        "route",
        "streaming",
        "task",
        "tick",
        "updates",
    )

    def __init__(self, key: str, streaming: bool) -> None:
        self.key = key
        # What the call cost and which route served it (a follower's hit saved that).
        self.cost: Cost | None = None
        self.route: str | None = None
        self.streaming = streaming
        self.updates: list[ChatResponseUpdate] = []
        self.response: ChatResponse | None = None
        self.error: BaseException | None = None
        self.cancelled = False  # the call ended because its caller (or every listener) left
        self.finished = False
        # Made when someone first waits: most flights have nobody waiting beside the leader.
        self.done: asyncio.Event | None = None  # set once, when the call ended
        self.tick: asyncio.Event | None = None  # set and cleared at each update and the end
        self.listeners = 0
        self.task: asyncio.Task[None] | None = None

    def notify(self) -> None:
        tick = self.tick
        if tick is not None:
            tick.set()
            tick.clear()

    async def ended(self) -> None:
        """Wait until the call ended."""
        if self.finished:
            return
        if self.done is None:
            self.done = asyncio.Event()
        await self.done.wait()

    async def next_update(self) -> None:
        """Wait for the next update or the end."""
        if self.tick is None:
            self.tick = asyncio.Event()
        await self.tick.wait()

    def result_updates(self) -> list[ChatResponseUpdate]:
        if self.streaming:
            return self.updates
        assert self.response is not None
        return self.response.to_updates()

    def result_response(self) -> ChatResponse:
        if self.response is not None:
            return self.response
        return ChatResponse.from_updates(self.updates)


@dataclasses.dataclass(slots=True)
class _Request:
    mode: CacheMode
    key: str | None
    messages: list[ChatMessage]
    options: ChatOptions | None
    partition: str | None = None  # the semantic partition
    query: str | None = None
    vector: Any = None
    kind: str = "exact"
    similarity: float | None = None


# -- the layer ---------------------------------------------------------------------------------


class CachingChatClient(DelegatingChatClient):
    """The response cache (see the module docstring). `store` defaults to a new
    `MemoryCacheStore`; `close_store` closes it with the layer (a store made for this layer
    alone)."""

    def __init__(
        self,
        inner: ChatClient,
        store: CacheStore | None = None,
        settings: CacheSettings | None = None,
        *,
        semantic: SemanticCacheSettings | None = None,
        meter_provider: MeterProvider | None = None,
        close_store: bool | None = None,
        leave_open: bool = False,
    ) -> None:
        super().__init__(inner, leave_open=leave_open)
        if settings is not None and not isinstance(settings, CacheSettings):
            raise TypeError(f"settings must be CacheSettings, not {type(settings).__name__}")
        if semantic is not None and not isinstance(semantic, SemanticCacheSettings):
            raise TypeError(
                f"semantic must be SemanticCacheSettings, not {type(semantic).__name__}"
            )
        self.settings = settings if settings is not None else CacheSettings()
        made = store is None
        if store is None:
            store = MemoryCacheStore()
        elif not isinstance(store, CacheStore):
            raise TypeError("store must have async get(key) and set(key, value, ttl)")
        self.store: CacheStore = store
        self.semantic = semantic
        self._close_store = made if close_store is None else close_store
        self._memory = store if type(store) is MemoryCacheStore else None
        self._reader: CacheStore = (
            store
            if isinstance(store, MemoryCacheStore | RedisCacheStore)
            else _GuardedStore(store, self.settings.timeout, self.settings.retry_interval)
        )
        metadata = metadata_of(inner)
        # Two pipelines over one shared store keep their answers apart by what they call.
        self._namespace = f"{metadata.name}\x00{metadata.provider_name}\x00{metadata.model_id}"
        self._flights: dict[str, _Flight] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._partitions: OrderedDict[str, Any] = OrderedDict()
        self._candidate_bytes = 0  # what the semantic candidates hold, in bytes
        self._embedding_outage = _redis.Outage(
            _logger, "semantic cache embeddings", "looking answers up exactly only", 1.0
        )
        instruments = meter(CACHE_SCOPE, meter_provider)
        self._lookups = instruments.create_counter(
            CACHE_LOOKUPS_METRIC,
            unit="{request}",
            description="Requests through a response cache, by result and kind",
        )
        self._saved = instruments.create_counter(
            CACHE_SAVED_COST_METRIC,
            unit="{currency}",
            description="What cache hits saved: the stored answers' cost",
        )

    def describe_layer(self) -> str:
        kind = type(self.store).__name__
        return f"CachingChatClient({kind}{', semantic' if self.semantic else ''})"

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await super().aclose()
        finally:
            close = getattr(self.store, "aclose", None) if self._close_store else None
            if close is not None:
                await close()

    # -- per request -------------------------------------------------------------------------

    def _begin(self, messages: Messages, options: ChatOptions | None) -> _Request:
        listed = as_messages(messages)
        mode = CacheMode.USE if options is None or options.cache is None else options.cache
        if mode is not CacheMode.USE and not isinstance(mode, CacheMode):
            mode = CacheMode(mode)  # ValueError for a mode of no meaning
        if mode is CacheMode.BYPASS:
            return _Request(mode, None, listed, options)
        settings = self.settings
        report = current_cache_report()
        partition = report.partition if report is not None else None
        scope = settings.scope
        if scope is not None:
            value = scope(listed, options if options is not None else ChatOptions())
            if value is not None and not isinstance(value, str):
                raise TypeError(
                    f"the cache scope must return a str or None, not {type(value).__name__}"
                )
            partition = f"{partition}\x00{value}"
        partition_by = settings.partition_by
        if "user" in partition_by:
            partition = f"{partition}\x00user\x00{_user_of(report, options)}"
        per_session = settings.per_session or "session" in partition_by
        namespace = self._namespace
        ignored = settings.ignore_fields
        try:
            key = _digest(listed, options, partition, per_session, namespace, False, ignored)
        except _UNCACHEABLE:
            return _Request(CacheMode.BYPASS, None, listed, options)
        request = _Request(mode, key, listed, options)
        if self.semantic is not None:
            query = _query_of(listed)
            if query is not None and len(query) <= self.semantic.max_query_chars:
                request.query = query
                request.partition = _digest(
                    listed, options, partition, per_session, namespace, True, ignored
                )
        return request

    def _record(
        self,
        result: str,
        request: _Request,
        *,
        kind: str | None = None,
        age: int | None = None,
        entry: _Entry | None = None,
    ) -> None:
        kind = kind or request.kind
        similarity = request.similarity
        span = trace.get_current_span()
        if span.is_recording():
            attributes: dict[str, Any] = {CACHE_RESULT: result, CACHE_KIND: kind}
            if similarity is not None:
                attributes[CACHE_SIMILARITY] = similarity
            span.set_attributes(attributes)
        labels = _LABELS.get((result, kind))
        if labels is None:
            labels = _LABELS[(result, kind)] = {CACHE_RESULT: result, CACHE_KIND: kind}
        self._lookups.add(1, labels)
        if entry is not None and result == "hit":
            if entry.cost:
                self._saved.add(entry.cost, {ROUTE_NAME: entry.route or ""})
            _log_hit(
                _scope.current_attempt_log(),
                _scope.current_attempt_mark(),
                entry.route,
                _model_of(entry),
                entry.cost,
            )
        report = current_cache_report()
        if report is not None:
            report.result = result
            report.kind = kind
            report.age = age
            report.similarity = similarity

    async def _read(self, key: str) -> _Entry | None:
        memory = self._memory
        raw = memory.get_now(key) if memory is not None else await self._reader.get(key)
        if raw is None:
            return None
        try:
            return _decode_entry(raw)
        except Exception:
            # Another writer's garbage, an older format, a tampered entry: a miss, and gone
            # before this request stores its answer in its place (a store's call is bounded
            # and never raises; this is the rare path).
            await self._delete(key)
            return None

    async def _delete(self, key: str) -> None:
        memory = self._memory
        if memory is not None:
            memory.delete_now(key)
            return
        delete = getattr(self._reader, "delete", None)
        if delete is not None:
            await delete(key)

    async def _look_up(self, request: _Request) -> _Entry | None:
        assert request.key is not None
        entry = await self._read(request.key)
        if entry is not None or request.query is None or self.semantic is None:
            return entry
        return await self._look_up_semantic(request)

    async def _embed(self, text: str) -> Any:
        semantic = self.semantic
        assert semantic is not None
        from middleware._vectors import unit_vector

        # An embedder's failure is a miss, never an error.
        vectors = await self._embedding_outage.guard(
            lambda: semantic.embeddings.generate([text]), semantic.embedding_timeout
        )
        if vectors is None:
            return None
        try:
            rows = list(vectors)
        except TypeError:
            return None
        return unit_vector(rows[0]) if len(rows) == 1 else None

    async def _look_up_semantic(self, request: _Request) -> _Entry | None:
        semantic = self.semantic
        assert semantic is not None
        assert request.query is not None
        request.kind = "semantic"
        vector = await self._embed(request.query)
        if vector is None:
            return None
        request.vector = vector
        index = self._partitions.get(request.partition or "")
        if index is None:
            return None
        self._partitions.move_to_end(request.partition or "")
        best = index.best(vector)
        if best is None:
            return None
        key, score = best
        request.similarity = round(score, 6)
        if score < semantic.threshold:
            return None
        entry = await self._read(key)
        if entry is None:
            before = index.nbytes
            index.remove(key)  # expired or evicted from the store
            self._count_candidates(index.nbytes - before)
        return entry

    def _remember(self, request: _Request) -> None:
        """Make the stored answer a semantic candidate of its partition."""
        semantic = self.semantic
        if semantic is None or request.vector is None or request.partition is None:
            return
        from middleware._vectors import RingIndex

        partitions = self._partitions
        index = partitions.get(request.partition)
        if index is None or index.dimensions != request.vector.shape[0]:
            if index is not None:
                self._count_candidates(-index.nbytes - _PARTITION_BYTES)
            index = partitions[request.partition] = RingIndex(
                request.vector.shape[0], semantic.max_candidates
            )
            self._count_candidates(index.nbytes + _PARTITION_BYTES)
        partitions.move_to_end(request.partition)
        assert request.key is not None
        before = index.nbytes
        index.add(request.vector, request.key)
        self._count_candidates(index.nbytes - before)
        bound = semantic.max_bytes
        memory = self._memory
        if memory is not None:
            bound = min(bound, memory.max_bytes)
        # Least recently used partitions out, past the count or the bytes (the one just
        # added to last: alone larger than the bound, it is not kept either).
        while len(partitions) > semantic.max_partitions or (
            self._candidate_bytes > bound and partitions
        ):
            _, dropped = partitions.popitem(last=False)
            self._count_candidates(-dropped.nbytes - _PARTITION_BYTES)

    def _count_candidates(self, change: int) -> None:
        """The candidates' bytes changed by `change` (counted in a memory store's bound)."""
        self._candidate_bytes += change
        memory = self._memory
        if memory is not None:
            memory.hold(change)

    def _storable(self, finish_reason: str | None) -> bool:
        if finish_reason is None:
            return False
        allowed = self.settings.finish_reasons
        if finish_reason in allowed:
            return True
        known = FinishReason.of(finish_reason)
        return known is not None and known.value in allowed

    def _entry(
        self,
        request: _Request,
        response: ChatResponse | None,
        updates: list[ChatResponseUpdate] | None,
        report: _scope.RouteReport,
    ) -> bytes | None:
        """The entry to store for a completed answer, or None when it may not be stored."""
        if request.mode is CacheMode.BYPASS or request.key is None:
            return None
        if response is not None:
            finish_reason = response.finish_reason
        else:
            # The last finish reason wins, as when the updates are assembled.
            finish_reason = next(
                (u.finish_reason for u in reversed(updates or ()) if u.finish_reason), None
            )
        if not self._storable(finish_reason):
            return None
        # What the attempt that served it cost, as the router priced it (None: unpriced).
        cost = float(report.cost.amount) if report.cost is not None else None
        try:
            value = _encode_entry(response, updates, report.route_name, cost)
        except _UNCACHEABLE:
            return None
        if len(value) > self.settings.max_entry_bytes:
            return None
        return value

    def _store_now(
        self,
        request: _Request,
        response: ChatResponse | None,
        updates: list[ChatResponseUpdate] | None,
        report: _scope.RouteReport,
    ) -> Awaitable[None] | None:
        """Store a completed answer (when it may be stored): at once in memory, else the
        write to await (never raising)."""
        value = self._entry(request, response, updates, report)
        if value is None:
            return None
        assert request.key is not None
        self._remember(request)
        memory = self._memory
        if memory is not None:
            memory.set_now(request.key, value, self.settings.ttl)
            return None
        return self._reader.set(request.key, value, self.settings.ttl)

    async def _store(
        self,
        request: _Request,
        response: ChatResponse | None,
        updates: list[ChatResponseUpdate] | None,
        report: _scope.RouteReport,
    ) -> None:
        write = self._store_now(request, response, updates, report)
        if write is not None:
            await write

    # -- the call, alone or single-flighted ----------------------------------------------------

    def _report(self) -> tuple[_scope.RouteReport, Any]:
        outer = _scope.current_report()
        if outer is not None:
            return outer, None
        report = _scope.RouteReport()
        return report, _scope.enter_report(report)

    def _start(self, request: _Request) -> _Flight:
        """A streaming flight: its call runs in a task of its own, which every listener
        reads (so one leaving never cuts the others' stream)."""
        assert request.key is not None
        flight = _Flight(request.key, streaming=True)
        self._flights[request.key] = flight
        task = asyncio.get_running_loop().create_task(self._run_stream(flight, request))
        flight.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return flight

    def _end_flight(self, flight: _Flight) -> None:
        flight.finished = True
        if flight.done is not None:
            flight.done.set()
        flight.notify()

    def _forget(self, flight: _Flight) -> None:
        if self._flights.get(flight.key) is flight:
            del self._flights[flight.key]

    async def _run_stream(self, flight: _Flight, request: _Request) -> None:
        report, token = self._report()
        stream = self.inner.get_streaming_response(request.messages, request.options)
        try:
            async for update in stream:
                flight.updates.append(update)
                flight.notify()
        except BaseException as exc:
            await _close(stream)
            flight.error = exc
            flight.cancelled = isinstance(exc, asyncio.CancelledError) and caller_cancelling()
            self._forget(flight)
            self._end_flight(flight)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        finally:
            if token is not None:
                _scope.exit_report(token)
        closing = await _close(stream)
        if closing is not None:
            flight.error = closing
            self._forget(flight)
            self._end_flight(flight)
            return
        flight.cost, flight.route = report.cost, report.route_name
        self._end_flight(flight)
        try:
            await self._store(request, None, flight.updates, report)
        finally:
            self._forget(flight)

    def _leave(self, flight: _Flight) -> None:
        """A listener leaves `flight` (whatever its call shape, however it ends): when it
        was the last one and the call runs in a task of its own, the call is cancelled and
        forgotten, so nobody joins a call nobody waits for (and `aclose` does not wait
        for it)."""
        flight.listeners -= 1
        if flight.listeners == 0 and not flight.finished and flight.task is not None:
            # Nobody listens any more: the call is cancelled, and a newcomer starts afresh.
            self._forget(flight)
            flight.task.cancel()

    async def _call(self, request: _Request) -> ChatResponse:
        """A miss (or a refresh): the provider call, stored; single-flighted if set."""
        if not self.settings.single_flight:
            self._record(_miss_result(request), request)
            report, token = self._report()
            try:
                response = await self.inner.get_response(request.messages, request.options)
            finally:
                if token is not None:
                    _scope.exit_report(token)
            write = self._store_now(request, response, None, report)
            if write is not None:
                self._spawn(write)
            return response
        assert request.key is not None
        called_again = False
        recorded = False
        while True:
            flight = self._flights.get(request.key)
            if flight is None and recorded:
                # Calling again: another follower may have answered meanwhile.
                entry = await self._read(request.key)
                if entry is not None:
                    return entry.as_response()
                flight = self._flights.get(request.key)
            if flight is None:
                # The leader calls in its own task (no task of the flight's: a miss costs
                # no more than the call); the others wait for its answer.
                if not recorded:
                    self._record(_miss_result(request), request)
                return await self._lead(request)
            if not recorded:
                recorded = True
                self._record("hit", request, age=0)
            flight.listeners += 1
            try:
                await flight.ended()
            finally:
                # The one way out of a flight: the last listener to leave cancels its call.
                self._leave(flight)
            if flight.error is None:
                answer = _copy_response(flight.result_response())
                _log_hit(
                    _scope.current_attempt_log(),
                    _scope.current_attempt_mark(),
                    flight.route,
                    answer.model_id,
                    flight,
                )
                return answer
            if flight.cancelled:
                continue  # the leader's caller left: its call is no answer; call again
            if called_again:
                raise flight.error
            called_again = True  # the leader's call failed: call again, once

    async def _lead(self, request: _Request) -> ChatResponse:
        """Make the call of a non-streaming flight in the caller's own task."""
        assert request.key is not None
        flight = _Flight(request.key, streaming=False)
        self._flights[request.key] = flight
        report, token = self._report()
        try:
            response = await self.inner.get_response(request.messages, request.options)
        except BaseException as exc:
            flight.error = exc
            flight.cancelled = isinstance(exc, asyncio.CancelledError) and caller_cancelling()
            self._forget(flight)
            self._end_flight(flight)
            raise
        finally:
            if token is not None:
                _scope.exit_report(token)
        flight.response = response
        flight.cost, flight.route = report.cost, report.route_name
        self._end_flight(flight)
        write = self._store_now(request, response, None, report)
        if write is None:
            self._forget(flight)
        else:
            # Newcomers join the finished flight until the write has landed.
            self._spawn(_then_forget(write, self, flight))
        return response

    async def get_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> ChatResponse:
        request = self._begin(messages, options)
        if request.key is None:
            self._record("bypass", request)
            return await self.inner.get_response(messages, options)
        if request.mode is CacheMode.USE:
            entry = await self._look_up(request)
            if entry is not None:
                self._record("hit", request, age=entry.age(), entry=entry)
                return entry.as_response()
        return await self._call(request)

    def get_streaming_response(
        self, messages: Messages, options: ChatOptions | None = None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        return self._stream(messages, options)

    async def _stream(
        self, messages: Messages, options: ChatOptions | None
    ) -> AsyncGenerator[ChatResponseUpdate, None]:
        request = self._begin(messages, options)
        # Current at the first read, maybe not after.
        log, within = _scope.current_attempt_log(), _scope.current_attempt_mark()
        if request.key is None:
            self._record("bypass", request)
            async for update in forward(
                lambda: self.inner.get_streaming_response(messages, options)
            ):
                yield update
            return
        if request.mode is CacheMode.USE:
            entry = await self._look_up(request)
            if entry is not None:
                self._record("hit", request, age=entry.age(), entry=entry)
                for update in entry.as_updates():
                    yield update
                return
        if not self.settings.single_flight:
            async for update in self._stream_alone(request):
                yield update
            return
        assert request.key is not None
        called_again = False
        recorded = False
        while True:
            flight = self._flights.get(request.key)
            if flight is None and recorded:
                # Calling again: another follower may have answered meanwhile.
                entry = await self._read(request.key)
                if entry is not None:
                    for update in entry.as_updates():
                        yield update
                    return
                flight = self._flights.get(request.key)
            leading = flight is None
            if flight is None:
                flight = self._start(request)
            if not recorded:
                recorded = True
                if leading:
                    self._record(_miss_result(request), request)
                else:
                    self._record("hit", request, age=0)
            flight.listeners += 1
            sent = 0
            try:
                if flight.streaming:
                    updates = flight.updates
                    while True:
                        if sent < len(updates):
                            update = updates[sent]
                            sent += 1
                            yield update if leading else _copy_update(update)
                            continue
                        if flight.finished:
                            break
                        await flight.next_update()
                else:
                    await flight.ended()
                    if flight.error is None:
                        for update in flight.result_updates():
                            sent += 1
                            yield _copy_update(update)
            finally:
                self._leave(flight)
            if flight.error is None:
                if not leading:
                    _log_hit(log, within, flight.route, _first_model(flight.updates), flight)
                return
            if leading or sent:
                raise flight.error
            if flight.cancelled:
                continue  # the leader's caller left: its call is no answer; call again
            if called_again:
                raise flight.error
            called_again = True

    def _stream_alone(self, request: _Request) -> AsyncGenerator[ChatResponseUpdate, None]:
        self._record(_miss_result(request), request)
        return forward(
            lambda: self.inner.get_streaming_response(request.messages, request.options),
            _Collect(self, request),
        )

    def _spawn(self, work: Awaitable[None]) -> None:
        """Run `work` (a store write) beside the request, which does not wait for it."""

        async def run() -> None:
            await work

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class _Collect(StreamWatcher):
    """What a cache without single flight sees of the stream it forwards: the router's
    report current while the layers beneath run, the updates, and how the stream ended."""

    __slots__ = ("layer", "own", "report", "request", "updates")
    scoped = True

    def __init__(self, layer: CachingChatClient, request: _Request) -> None:
        self.layer = layer
        self.request = request
        outer = _scope.current_report()
        self.own = outer is None
        self.report = outer if outer is not None else _scope.RouteReport()
        self.updates: list[ChatResponseUpdate] = []

    def enter(self) -> Any:
        return _scope.enter_report(self.report) if self.own else None

    def exit(self, token: Any) -> None:
        if token is not None:
            _scope.exit_report(token)

    def update(self, update: ChatResponseUpdate) -> None:
        self.updates.append(update)

    def end(self, how: StreamEnd, error: BaseException | None) -> None:
        if how == "completed":
            layer = self.layer
            write = layer._store_now(self.request, None, self.updates, self.report)
            if write is not None:
                layer._spawn(write)


async def _then_forget(write: Awaitable[None], layer: CachingChatClient, flight: _Flight) -> None:
    try:
        await write
    finally:
        layer._forget(flight)


_LABELS: dict[tuple[str, str], dict[str, str]] = {}
"""The lookup counter's labels by (result, kind): a handful, made once."""


def _model_of(entry: _Entry) -> str | None:
    if entry.response is not None:
        return entry.response.model_id
    return _first_model(entry.updates or ())


def _first_model(updates: Sequence[ChatResponseUpdate]) -> str | None:
    return next((u.model_id for u in updates if u.model_id), None)


def _log_hit(
    log: _scope.AttemptLog | None,
    within: _scope.AttemptMark | None,
    route: str | None,
    model: str | None,
    saved: float | _Flight | None,
) -> None:
    """Tell the request's attempt log (when a spend layer or the gateway opened one) that
    the cache answered: nothing used, and `saved` what the answer had cost (a stored entry's
    cost, or the cost of the call a follower waited for). The hit stands for the attempt
    `within` (a router's above the cache), which records no call of its own."""
    if log is None:
        return
    amount = saved.cost if isinstance(saved, _Flight) else saved
    if isinstance(amount, float):
        amount = Cost(Decimal(repr(amount)))
    log.add(
        _scope.PricedAttempt(
            route=route or "",
            number=0,
            outcome="completed",
            provider=None,
            model_requested=None,
            model_served=model,
            usage=UsageDetails(0, 0, 0),
            estimated=False,
            cost=Cost(Decimal(0), amount.currency if amount is not None else "USD"),
            started_at=time.time(),
            duration=0.0,
            time_to_first_update=None,
            cache="hit",
            saved=amount,
        ),
        within,
    )


def _miss_result(request: _Request) -> str:
    return "refresh" if request.mode is CacheMode.REFRESH else "miss"


def _copy_response(response: ChatResponse) -> ChatResponse:
    return ChatResponse(
        messages=[
            ChatMessage(m.role, list(m.contents), author_name=m.author_name)
            for m in response.messages
        ],
        response_id=response.response_id,
        model_id=response.model_id,
        finish_reason=response.finish_reason,
        usage=response.usage,
        value=response.value,
    )


async def _close(stream: AsyncGenerator[ChatResponseUpdate, None]) -> BaseException | None:
    try:
        await stream.aclose()
    except BaseException as exc:  # the caller decides what a failed close means
        return exc
    return None
