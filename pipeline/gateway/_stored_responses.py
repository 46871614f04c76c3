"""Stored responses of the Responses format: ``store``, ``previous_response_id``,
``item_reference`` input items, and ``GET``/``DELETE /v1/responses/{id}`` and
``GET /v1/responses/{id}/input_items``, over a `ResponseStore`
(`pipeline.gateway.response_store`).

`StoredResponses` is the Responses handler's `AnswerHooks`. Before the pipeline call it
completes the conversation: the previous response's input and output, then the request's
input with each reference replaced by the item it names. Once an answer is complete (and
unless the request said ``store: false``) it keeps the response, its whole input and its
output, the reasoning's encrypted content as the route gave it, before the end of the
answer is sent: a client's next request finds it. `NoStoredResponses` refuses what needs a
store (``[gateway] responses_store = "none"``). `StoredResponseEndpoint` serves the paths.

Each call to the store is bounded (``responses_timeout``); a store that fails is skipped for
a second, warned about once per outage; meanwhile a stored response is answered as not
found, saying the store is unavailable (never a 5xx) and answers are not stored. Records
are partitioned by the caller's key (`Exchange.key`): another key's are not found. Nothing
stored reaches a log line or a span.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from pipeline import _redis
from pipeline.errors import RedisUnavailable as _Unavailable
from pipeline.gateway._exchange import EXCHANGE, JSON, Exchange, Receive, Scope, Send
from pipeline.gateway.response_store import MemoryResponseStore, ResponseStore
from pipeline.gateway.wire import ChatRequest, WireError
from pipeline.wire import dumps as _dumps
from pipeline.wire.responses.inbound import ResponsesRequest, resume
from pipeline.wire.responses.vocab import ENCRYPTED_REASONING

__all__ = ["NoStoredResponses", "StoredResponseEndpoint", "StoredResponses"]

_logger = logging.getLogger("chat_pipeline.gateway")
_T = TypeVar("_T")

PATH = "/v1/responses/"
"""The prefix of the stored responses' paths."""

# Ids the store indexes and the paths accept (an id is in a key's name, never free text).
_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
# The prefix of an id given to an input item that came without one, by its type.
_ID_PREFIXES = {
    "message": "msg_",
    "function_call": "fc_",
    "function_call_output": "fco_",
    "custom_tool_call": "ctc_",
    "custom_tool_call_output": "ctco_",
    "reasoning": "rs_",
}
_RETRY_INTERVAL = 1.0
_UNAVAILABLE = (
    "the response store is unavailable now, so no stored response can be found; send the "
    "whole conversation in input (store: false), or try again later"
)
_NONE = "this gateway stores no responses ([gateway] responses_store = 'none')"


def _named(value: str) -> str:
    """An id as an error message may quote it (only an id's characters, never free text)."""
    return repr(value) if _ID.match(value) else "given"


def _not_found(param: str | None, what: str, unavailable: bool) -> WireError:
    detail = _UNAVAILABLE if unavailable else "it was never stored, or has expired or been deleted"
    return WireError(404, f"{what} not found: {detail}", param=param, code="not_found")


class _Guarded:
    """A store whose every call is bounded by `timeout`, skipped for a second after a
    failure (one warning per outage, the error's type only). A call not made, or failed,
    raises `_Unavailable` (the error `pipeline._redis` raises for any shared store it did
    without)."""

    def __init__(self, store: ResponseStore, timeout: float) -> None:
        self.store = store
        self.timeout = timeout
        # The memory store never waits nor fails: nothing to bound.
        self._direct = isinstance(store, MemoryResponseStore)
        self._outage = _redis.Outage(
            _logger,
            f"response store ({type(store).__name__})",
            "answering stored responses as not found and storing none",
            _RETRY_INTERVAL,
        )

    async def __call__(self, call: Callable[[ResponseStore], Awaitable[_T]]) -> _T:
        if self._direct:
            return await call(self.store)
        outage = self._outage
        if outage.skipping():
            raise _Unavailable
        try:
            async with asyncio.timeout(self.timeout):
                result = await call(self.store)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # the request's own cancellation (its client left)
            outage.failed(exc)
            raise _Unavailable from None
        except Exception as exc:  # any failure of the store: answered as not found
            outage.failed(exc)
            raise _Unavailable from None
        outage.succeeded()
        return result


class _Record:
    """One stored response: its whole input (items with ids), the response object (its
    reasoning's encrypted content kept), and whether the request asked to see that."""

    __slots__ = ("include", "input", "response")

    def __init__(self, input: list[Any], response: dict[str, Any], include: bool) -> None:
        self.input = input
        self.response = response
        self.include = include

    def encode(self) -> bytes:
        body = {"input": self.input, "response": self.response, "include": self.include}
        return _dumps(body).encode()

    @classmethod
    def decode(cls, raw: bytes) -> _Record | None:
        try:
            body = json.loads(raw)
            return cls(list(body["input"]), dict(body["response"]), bool(body["include"]))
        except (ValueError, KeyError, TypeError):
            return None  # not a record of ours: as good as absent

    @property
    def output(self) -> list[Any]:
        output = self.response.get("output")
        return output if isinstance(output, list) else []

    def items(self) -> Iterable[dict[str, Any]]:
        for item in (*self.input, *self.output):
            if isinstance(item, dict):
                yield item


def _shown(items: Iterable[Any], include: bool) -> list[Any]:
    """Items as a client sees them: a reasoning item's encrypted content only when asked."""
    if include:
        return list(items)
    return [
        {k: v for k, v in item.items() if k != "encrypted_content"}
        if isinstance(item, dict) and item.get("type") == "reasoning"
        else item
        for item in items
    ]


def _stored_input(items: list[dict[str, Any]], response_id: str) -> list[str]:
    """Make the request's input (the request's own objects: nothing reads them after the
    answer) what is stored and listed: each item with an id (one the response's id makes
    unique, when it came without), a message's content as parts (as the API lists input
    items). Returns the ids an item reference may name."""
    ids: list[str] = []
    tag = response_id.removeprefix("resp_")
    for index, item in enumerate(items):
        kind = item.setdefault("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                text_part: dict[str, Any] = {"type": part, "text": content}
                if part == "output_text":
                    text_part["annotations"] = []
                item["content"] = [text_part]
            item.setdefault("status", "completed")
        item_id = item.get("id")
        if not isinstance(item_id, str):
            item["id"] = f"{_ID_PREFIXES.get(str(kind), 'item_')}{tag}_{index}"
            ids.append(item["id"])
        elif _ID.match(item_id):
            ids.append(item_id)
    return ids


def _full_output(request: ResponsesRequest, answer: dict[str, Any]) -> dict[str, Any]:
    """The response object as stored: its reasoning items with the encrypted content the
    answer withheld (the request did not include it), as the route gave it."""
    if not request.withheld:
        return answer
    output = [
        {**item, "encrypted_content": request.withheld[item["id"]]}
        if isinstance(item, dict)
        and item.get("type") == "reasoning"
        and item.get("id") in request.withheld
        else item
        for item in answer.get("output", [])
    ]
    return {**answer, "output": output}


class NoStoredResponses:
    """`AnswerHooks` of a gateway that stores nothing: what needs a stored response is a
    400 naming it; nothing is kept."""

    async def before(self, exchange: Exchange, request: ChatRequest) -> None:
        if not isinstance(request, ResponsesRequest):
            return
        if request.previous_response_id is not None:
            raise _unsupported(
                "previous_response_id", f"{_NONE}: send the whole conversation in input"
            )
        if request.references:
            raise _unsupported(
                f"input[{request.references[0]}].type",
                f"{_NONE}, so a reference finds nothing: send the item itself (clients do "
                "with store: false)",
            )
        if request.store is True:
            raise _unsupported("store", f"{_NONE}: set store to false or leave it out")
        request.store = False

    async def after(self, exchange: Exchange, request: ChatRequest) -> None:
        return None


def _unsupported(param: str, why: str) -> WireError:
    return WireError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


class StoredResponses:
    """`AnswerHooks` over a `ResponseStore` (see the module docstring); the store's
    partition is the caller's key."""

    def __init__(self, store: ResponseStore, *, timeout: float) -> None:
        self.store = store
        self._guarded = _Guarded(store, timeout)

    @staticmethod
    def partition(exchange: Exchange) -> str:
        return str(exchange.key)

    async def aclose(self) -> None:
        await self.store.aclose()

    async def record(self, partition: str, response_id: str) -> _Record | None:
        """A stored response (None when absent); `_Unavailable` when the store fails."""
        if not _ID.match(response_id):
            return None
        raw = await self._guarded(lambda store: store.get(partition, response_id))
        return None if raw is None else _Record.decode(raw)

    async def delete(self, partition: str, response_id: str) -> bool:
        if not _ID.match(response_id):
            return False
        return await self._guarded(lambda store: store.delete(partition, response_id))

    async def _items(self, partition: str, ids: list[str]) -> dict[str, dict[str, Any]]:
        """The stored items of `ids` that were found, by id."""
        wanted = [item_id for item_id in dict.fromkeys(ids) if _ID.match(item_id)]
        if not wanted:
            return {}
        owners = await self._guarded(lambda store: store.owners(partition, wanted))
        looked_for = set(wanted)
        responses = [owner for owner in dict.fromkeys(owners) if owner is not None]
        records = await asyncio.gather(*(self.record(partition, r) for r in responses))
        found: dict[str, dict[str, Any]] = {}
        for record in records:
            if record is not None:
                for item in record.items():
                    item_id = item.get("id")
                    if item_id in looked_for and item_id not in found:
                        found[item_id] = item
        return found

    async def before(self, exchange: Exchange, request: ChatRequest) -> None:
        if not isinstance(request, ResponsesRequest):
            return
        previous = request.previous_response_id
        if previous is None and not request.references:
            return
        partition = self.partition(exchange)
        context: list[Any] = []
        if previous is not None:
            try:
                record = await self.record(partition, previous)
            except _Unavailable:
                raise _not_found(
                    "previous_response_id", f"previous response {_named(previous)}", True
                ) from None
            if record is None:
                raise _not_found(
                    "previous_response_id", f"previous response {_named(previous)}", False
                )
            context = [*record.input, *record.output]
        items = list(request.items)
        if request.references:
            ids = [str(items[index]["id"]) for index in request.references]
            try:
                found = await self._items(partition, ids)
            except _Unavailable:
                found, unavailable = {}, True
            else:
                unavailable = False
            for index, item_id in zip(request.references, ids, strict=True):
                item = found.get(item_id)
                if item is None:
                    where = f"input[{index}]"
                    raise _not_found(where, f"item {_named(item_id)}", unavailable)
                items[index] = item
        request.items = [*context, *items]
        resume(request, request.items)

    async def after(self, exchange: Exchange, request: ChatRequest) -> None:
        if not isinstance(request, ResponsesRequest) or request.store is False:
            return
        answer = request.answer
        response_id = exchange.response_id
        if answer is None or response_id is None:
            return
        items = _stored_input(request.items, response_id)
        record = _Record(request.items, _full_output(request, answer), request.include_reasoning)
        for item in record.output:
            item_id = item.get("id") if isinstance(item, dict) else None
            if isinstance(item_id, str) and _ID.match(item_id):
                items.append(item_id)
        raw = record.encode()
        partition = self.partition(exchange)
        try:
            kept = await self._guarded(
                lambda store: store.put(partition, response_id, raw, list(dict.fromkeys(items)))
            )
        except _Unavailable:
            return  # the outage is logged; the answer stands
        if not kept:
            _logger.warning(
                "response not stored: %d bytes, more than [gateway] responses_max_bytes "
                "(request %s)",
                len(raw),
                exchange.request_id,
            )


_NOT_ALLOWED = WireError(405, "method not allowed", code="method_not_allowed")
_NO_SUCH_PATH = WireError(404, "no such endpoint", code="not_found")


class StoredResponseEndpoint:
    """``GET``/``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``
    (``limit`` 1-100, default 20; ``order`` ``asc`` or ``desc``, the default; ``after`` an
    item id), for the caller's key's own responses. ``include=reasoning.encrypted_content``
    shows the reasoning's encrypted content (a response whose request included it shows it
    anyway). Behind the request id, telemetry and auth layers (`pipeline.gateway.app`)."""

    __slots__ = ("_stored",)

    def __init__(self, stored: StoredResponses | None) -> None:
        self._stored = stored

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange: Exchange = scope[EXCHANGE]
        try:
            body = await self._answer(exchange, scope)
        except WireError as error:
            exchange.failure = error
            await exchange.error(error)
            return
        await exchange.whole(200, _dumps(body).encode(), JSON)

    async def _answer(self, exchange: Exchange, scope: Scope) -> dict[str, Any]:
        rest = scope["path"][len(PATH) :]
        response_id, _, tail = rest.partition("/")
        method = scope["method"]
        if tail not in ("", "input_items") or not response_id:
            raise _NO_SUCH_PATH
        if method != "GET" and not (method == "DELETE" and not tail):
            raise _NOT_ALLOWED
        exchange.response_id = response_id if _ID.match(response_id) else None
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"))
        stored = self._stored
        what = f"response {_named(response_id)}"
        if stored is None:
            raise WireError(404, f"{what} not found: {_NONE}", code="not_found")
        partition = stored.partition(exchange)
        try:
            if method == "DELETE":
                if not await stored.delete(partition, response_id):
                    raise _not_found(None, what, False)
                return {"id": response_id, "object": "response", "deleted": True}
            record = await stored.record(partition, response_id)
        except _Unavailable:
            raise _not_found(None, what, True) from None
        if record is None:
            raise _not_found(None, what, False)
        include = record.include or any(
            key in ("include", "include[]") and value == ENCRYPTED_REASONING for key, value in query
        )
        if not tail:
            return {**record.response, "output": _shown(record.output, include)}
        return _page(_shown(record.input, include), dict(query))


def _page(items: list[Any], query: dict[str, str]) -> dict[str, Any]:
    """A page of input items, as the API lists them."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise WireError(400, "order: expected asc or desc", param="order", code="invalid_value")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise WireError(400, "limit: expected 1 to 100", param="limit", code="invalid_value")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") if isinstance(item, dict) else None for item in ordered]
        if after not in ids:
            raise WireError(400, "after: no such item", param="after", code="invalid_value")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    first = page[0].get("id") if page else None
    last = page[-1].get("id") if page else None
    return {
        "object": "list",
        "data": page,
        "first_id": first,
        "last_id": last,
        "has_more": len(ordered) > limit,
    }
