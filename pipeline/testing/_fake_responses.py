"""The Responses API side of `FakeOpenAIServer` (``POST /v1/responses``): checking a
request as strictly as the API does, and the bodies and events of its answers.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["RESPONSES_PATH", "events", "problem", "reasoning_returned", "response_body"]

RESPONSES_PATH = "/v1/responses"

_KNOWN = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "stream_options",
        "store",
        "metadata",
        "parallel_tool_calls",
        "text",
        "reasoning",
        "truncation",
        "user",
        "include",
        "previous_response_id",
        "conversation",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "top_logprobs",
        "max_tool_calls",
        "background",
    }
)
_ROLES = frozenset({"user", "system", "developer", "assistant"})
_PARTS = frozenset({"input_text", "input_image", "input_file", "output_text", "refusal"})
# Why a response stops short: a `FakeResponse.stop_reason` naming one is answered
# ``incomplete`` with that reason.
_INCOMPLETE = frozenset({"max_output_tokens", "content_filter"})
_ENCRYPTED = "reasoning.encrypted_content"
_INCLUDES = frozenset(
    {
        _ENCRYPTED,
        "message.output_text.logprobs",
        "message.input_image.image_url",
        "web_search_call.action.sources",
    }
)


class FakeResponse(Protocol):
    """What this module reads of a `pipeline.testing.FakeResponse` script (a Protocol, so the
    server imports this module and not the other way round)."""

    @property
    def text(self) -> str: ...
    @property
    def tool_calls(self) -> Sequence[tuple[str, str]]: ...
    @property
    def stop_reason(self) -> str | None: ...
    @property
    def usage(self) -> tuple[int, int]: ...
    @property
    def model(self) -> str | None: ...
    @property
    def in_band_error(self) -> Mapping[str, Any] | None: ...
    @property
    def error_after(self) -> int: ...
    @property
    def reasoning(self) -> str | None: ...
    @property
    def reasoning_tokens(self) -> int: ...
    @property
    def cache_usage(self) -> tuple[int, int]: ...
    @property
    def custom_tool_calls(self) -> Sequence[tuple[str, str]]: ...
    def pieces(self) -> list[str]: ...
    def argument_pieces(self, arguments: str) -> list[str]: ...


def _item_problem(item: Any, where: str) -> tuple[str, str] | None:
    if not isinstance(item, dict):
        return where, "Invalid type: expected an object."
    kind = item.get("type", "message")
    if kind == "message":
        if item.get("role") not in _ROLES:
            return f"{where}.role", "Invalid value: expected user, system, developer or assistant."
        content = item.get("content")
        if isinstance(content, str):
            return None
        if not isinstance(content, list):
            return f"{where}.content", "Invalid type: expected a string or a list of parts."
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _PARTS:
                return f"{where}.content[{index}].type", "Invalid value."
        return None
    required = {
        "function_call": ("call_id", "name", "arguments"),
        "function_call_output": ("call_id", "output"),
        "custom_tool_call": ("call_id", "name", "input"),
        "custom_tool_call_output": ("call_id", "output"),
        "reasoning": ("id",),
    }.get(kind)
    if kind == "reasoning" and not isinstance(item.get("summary"), list):
        return f"{where}.summary", f"Missing required parameter: '{where}.summary'."
    if required is None:
        return f"{where}.type", "Invalid value."
    for field in required:
        value = item.get(field)
        if not isinstance(value, str) and not (field == "output" and isinstance(value, list)):
            return f"{where}.{field}", f"Missing required parameter: '{where}.{field}'."
    return None


def _reasoning_problem(source: list[Any], issued: set[str]) -> tuple[str, str, int, str] | None:
    for index, item in enumerate(source):
        if item.get("type") != "reasoning":
            continue
        encrypted = item.get("encrypted_content")
        if encrypted is None:
            return (
                f"input[{index}]",
                f"Item with id '{item.get('id')}' not found. Items are not persisted when "
                "`store` is set to false.",
                404,
                "not_found",
            )
        if encrypted not in issued:
            return (
                f"input[{index}].encrypted_content",
                "The encrypted content could not be verified.",
                400,
                "invalid_encrypted_content",
            )
    return None


def reasoning_returned(payload: Any) -> int:
    """How many reasoning items with encrypted content a (checked) request sent back."""
    source = payload.get("input") if isinstance(payload, dict) else None
    if not isinstance(source, list):
        return 0
    return sum(
        1
        for item in source
        if isinstance(item, dict)
        and item.get("type") == "reasoning"
        and item.get("encrypted_content") is not None
    )


def problem(
    payload: Any, issued: set[str] | None = None
) -> tuple[str, str] | tuple[str, str, int, str] | None:
    """What the API would refuse in a request body: ``(param, message)`` (a 400), or
    ``(param, message, status, code)``; else None. `issued` is the encrypted reasoning the
    server gave out, which alone may come back."""
    if not isinstance(payload, dict):
        return "body", "The body must be a JSON object."
    for key in payload:
        if key not in _KNOWN:
            return key, f"Unknown parameter: '{key}'."
    if not isinstance(payload.get("model"), str):
        return "model", "Missing required parameter: 'model'."
    source = payload.get("input")
    if not isinstance(source, str | list):
        return "input", "Missing required parameter: 'input'."
    if isinstance(source, list):
        for index, item in enumerate(source):
            found = _item_problem(item, f"input[{index}]")
            if found is not None:
                return found
        reasoning = _reasoning_problem(source, issued if issued is not None else set())
        if reasoning is not None:
            return reasoning
    include = payload.get("include")
    if include is not None:
        if not isinstance(include, list):
            return "include", "Invalid type: expected an array."
        for index, value in enumerate(include):
            if value not in _INCLUDES:
                return f"include[{index}]", "Invalid value."
    for index, tool in enumerate(payload.get("tools") or []):
        if not isinstance(tool, dict) or tool.get("type") not in ("function", "custom"):
            return f"tools[{index}].type", "Invalid value: only function and custom tools here."
        if not isinstance(tool.get("name"), str):
            return f"tools[{index}].name", f"Missing required parameter: 'tools[{index}].name'."
    limit = payload.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or limit < 16):
        return "max_output_tokens", "Integer below minimum value. Expected a value >= 16."
    if payload.get("stream") not in (None, True, False):
        return "stream", "Invalid type: expected a boolean."
    return None


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content if status != "in_progress" else [],
    }


def _call(tag: str, index: int, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{tag}_{index}",
        "call_id": f"call_{tag}_{index}",
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _custom_call(tag: str, index: int, name: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "custom_tool_call",
        "id": f"ctc_{tag}_{index}",
        "call_id": f"call_custom_{tag}_{index}",
        "name": name,
        "input": text,
        "status": status,
    }


class _Reasoning:
    """The reasoning item of one answer, as the request asked to see it."""

    def __init__(
        self, payload: Mapping[str, Any], response: FakeResponse, number: int, issued: set[str]
    ) -> None:
        reasoning = payload.get("reasoning")
        self.summary = isinstance(reasoning, dict) and reasoning.get("summary") is not None
        self.id = f"rs_fake_{number}"
        self.text = response.reasoning or ""
        self.encrypted: str | None = None
        if _ENCRYPTED in (payload.get("include") or []):
            self.encrypted = "gAAAAB" + os.urandom(24).hex()
            issued.add(self.encrypted)

    def item(self, *, done: bool) -> dict[str, Any]:
        summary = [{"type": "summary_text", "text": self.text}] if done and self.summary else []
        item: dict[str, Any] = {"type": "reasoning", "id": self.id, "summary": summary}
        if done and self.encrypted is not None:
            item["encrypted_content"] = self.encrypted
        return item


def _output(
    response: FakeResponse, message_id: str, reasoning: _Reasoning | None, tag: str
) -> list[dict[str, Any]]:
    output = [reasoning.item(done=True)] if reasoning is not None else []
    if response.text:
        output.append(_message(message_id, response.text, "completed"))
    output += [_call(tag, i, n, a, "completed") for i, (n, a) in enumerate(response.tool_calls)]
    output += [
        _custom_call(tag, i, n, t, "completed")
        for i, (n, t) in enumerate(response.custom_tool_calls)
    ]
    return output


def _usage(response: FakeResponse) -> dict[str, Any]:
    prompt, completion = response.usage
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": response.cache_usage[1],
            "cache_write_tokens": response.cache_usage[0],
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": response.reasoning_tokens},
        "total_tokens": prompt + completion,
    }


def _response(
    payload: Mapping[str, Any],
    response: FakeResponse,
    number: int,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    incomplete = None
    if status == "incomplete":
        incomplete = {"reason": response.stop_reason}
    return {
        "id": f"resp_fake_{number}",
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": payload.get("instructions"),
        "max_output_tokens": payload.get("max_output_tokens"),
        "model": response.model or str(payload.get("model") or "fake-model"),
        "output": output,
        "parallel_tool_calls": payload.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {
            "effort": (payload.get("reasoning") or {}).get("effort"),
            "summary": (payload.get("reasoning") or {}).get("summary"),
        },
        "store": payload.get("store", True),
        "temperature": payload.get("temperature", 1.0),
        "text": payload.get("text") or {"format": {"type": "text"}},
        "tool_choice": payload.get("tool_choice", "auto"),
        "tools": payload.get("tools") or [],
        "top_p": payload.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": usage,
        "metadata": payload.get("metadata") or {},
    }


def _status(response: FakeResponse) -> str:
    return "incomplete" if response.stop_reason in _INCOMPLETE else "completed"


def _reasoning_of(
    payload: Mapping[str, Any], response: FakeResponse, number: int, issued: set[str] | None
) -> _Reasoning | None:
    if response.reasoning is None:
        return None
    return _Reasoning(payload, response, number, issued if issued is not None else set())


def response_body(
    payload: Mapping[str, Any],
    response: FakeResponse,
    number: int,
    issued: set[str] | None = None,
    *,
    tag: str,
) -> Any:
    """The body of a non-streaming answer to request `number` (`issued` collects the
    encrypted reasoning it gives out; `tag`, unique to this answer, makes its call ids)."""
    reasoning = _reasoning_of(payload, response, number, issued)
    output = _output(response, f"msg_fake_{number}", reasoning, tag)
    return _response(
        payload, response, number, status=_status(response), output=output, usage=_usage(response)
    )


def _event(kind: str, sequence: int, **fields: Any) -> str:
    """One SSE event of the Responses API: its name is also its payload's ``type``."""
    data = json.dumps({"type": kind, **fields, "sequence_number": sequence})
    return f"event: {kind}\ndata: {data}\n\n"


def events(
    payload: Mapping[str, Any],
    response: FakeResponse,
    number: int,
    issued: set[str] | None = None,
    *,
    tag: str,
) -> tuple[list[str], str, str, int]:
    """A streamed answer to request `number`: its events (the last, which ends the stream,
    apart), the ``error`` event `in_band_error` injects, and the index of the first
    event with content (`issued` collects the encrypted reasoning it gives out; `tag`,
    unique to this answer, makes its call ids)."""
    message_id = f"msg_fake_{number}"
    reasoning = _reasoning_of(payload, response, number, issued)
    start = _response(payload, response, number, status="in_progress", output=[], usage=None)
    kinds: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": start}),
        ("response.in_progress", {"response": start}),
    ]
    first: list[int] = []  # the index of the first event with content, once there is one

    def content(kind: str, fields: dict[str, Any]) -> None:
        if not first:
            first.append(len(kinds))
        kinds.append((kind, fields))

    output_index = 0
    if reasoning is not None:
        kinds.append(
            ("response.output_item.added", {"output_index": 0, "item": reasoning.item(done=False)})
        )
        if reasoning.summary and reasoning.text:
            where = {"item_id": reasoning.id, "output_index": 0, "summary_index": 0}
            summary_part = {"type": "summary_text", "text": ""}
            kinds.append(("response.reasoning_summary_part.added", {**where, "part": summary_part}))
            words = reasoning.text.split(" ")
            for piece in [w + " " for w in words[:-1]] + [words[-1]]:
                content("response.reasoning_summary_text.delta", {**where, "delta": piece})
            done_text = {**where, "text": reasoning.text}
            kinds.append(("response.reasoning_summary_text.done", done_text))
            done = {**summary_part, "text": reasoning.text}
            kinds.append(("response.reasoning_summary_part.done", {**where, "part": done}))
        content("response.output_item.done", {"output_index": 0, "item": reasoning.item(done=True)})
        output_index = 1
    pieces = response.pieces()
    if pieces:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        where = {"item_id": message_id, "output_index": output_index}
        text = "".join(pieces)
        done_part = {**part, "text": text}
        kinds += [
            (
                "response.output_item.added",
                {"output_index": output_index, "item": _message(message_id, "", "in_progress")},
            ),
            ("response.content_part.added", {**where, "content_index": 0, "part": part}),
        ]
        for piece in pieces:
            content(
                "response.output_text.delta",
                {**where, "content_index": 0, "delta": piece, "logprobs": []},
            )
        kinds += [
            (
                "response.output_text.done",
                {**where, "content_index": 0, "text": text, "logprobs": []},
            ),
            ("response.content_part.done", {**where, "content_index": 0, "part": done_part}),
            (
                "response.output_item.done",
                {
                    "output_index": output_index,
                    "item": _message(message_id, text, "completed"),
                },
            ),
        ]
        output_index += 1
    for call, (name, arguments) in enumerate(response.tool_calls):
        index = output_index
        output_index += 1
        where = {"item_id": f"fc_{tag}_{call}", "output_index": index}
        kinds.append(
            (
                "response.output_item.added",
                {"output_index": index, "item": _call(tag, call, name, "", "in_progress")},
            )
        )
        kinds += [
            ("response.function_call_arguments.delta", {**where, "delta": part})
            for part in response.argument_pieces(arguments)
        ]
        kinds.append(("response.function_call_arguments.done", {**where, "arguments": arguments}))
        content(
            "response.output_item.done",
            {"output_index": index, "item": _call(tag, call, name, arguments, "completed")},
        )
    for call, (name, text) in enumerate(response.custom_tool_calls):
        index = output_index
        output_index += 1
        where = {"item_id": f"ctc_{tag}_{call}", "output_index": index}
        kinds.append(
            (
                "response.output_item.added",
                {"output_index": index, "item": _custom_call(tag, call, name, "", "in_progress")},
            )
        )
        kinds += [
            ("response.custom_tool_call_input.delta", {**where, "delta": part})
            for part in response.argument_pieces(text)
        ]
        kinds.append(("response.custom_tool_call_input.done", {**where, "input": text}))
        content(
            "response.output_item.done",
            {"output_index": index, "item": _custom_call(tag, call, name, text, "completed")},
        )
    out = [_event(kind, sequence, **fields) for sequence, (kind, fields) in enumerate(kinds)]
    status = _status(response)
    final = _response(
        payload,
        response,
        number,
        status=status,
        output=_output(response, message_id, reasoning, tag),
        usage=_usage(response),
    )
    end = _event(f"response.{status}", len(out), response=final)
    error = dict(response.in_band_error or {})
    in_band = _event(
        "error",
        min(response.error_after, len(out)),
        code=error.get("code"),
        message=error.get("message", "error"),
        param=None,
    )
    return out, end, in_band, first[0] if first else len(out)
