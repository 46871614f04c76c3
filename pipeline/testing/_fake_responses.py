"""The Responses API side of `FakeOpenAIServer` (``POST /v1/responses``): checking a
request as strictly as the API does, and the bodies and events of its answers.

Pure functions of the request's JSON and its `FakeResponse` script: the server's HTTP
machinery (faults, delays, cuts) is `pipeline.testing._fake_server`'s. A request the API would
refuse (an unknown parameter, a tool in the Chat Completions shape, an input item without
its required fields, ``max_output_tokens`` below 16) is a 400 naming the parameter, so a
client that sends the wrong shape fails its tests here rather than against the real API.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["RESPONSES_PATH", "events", "problem", "response_body"]

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
    }.get(kind)
    if required is None:
        return f"{where}.type", "Invalid value."
    for field in required:
        value = item.get(field)
        if not isinstance(value, str) and not (field == "output" and isinstance(value, list)):
            return f"{where}.{field}", f"Missing required parameter: '{where}.{field}'."
    return None


def problem(payload: Any) -> tuple[str, str] | None:
    """What the API would refuse in a request body: ``(param, message)``, else None."""
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
    for index, tool in enumerate(payload.get("tools") or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            return f"tools[{index}].type", "Invalid value: only function tools are faked."
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


def _call(index: int, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{index}",
        "call_id": f"call_{index}",
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _output(response: FakeResponse, message_id: str) -> list[dict[str, Any]]:
    output = [_message(message_id, response.text, "completed")] if response.text else []
    output += [_call(i, n, a, "completed") for i, (n, a) in enumerate(response.tool_calls)]
    return output


def _usage(response: FakeResponse) -> dict[str, Any]:
    prompt, completion = response.usage
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
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
        "reasoning": {"effort": None, "summary": None},
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


def response_body(payload: Mapping[str, Any], response: FakeResponse, number: int) -> Any:
    """The body of a non-streaming answer to request `number`."""
    output = _output(response, f"msg_fake_{number}")
    return _response(
        payload, response, number, status=_status(response), output=output, usage=_usage(response)
    )


def _event(kind: str, sequence: int, **fields: Any) -> str:
    """One SSE event of the Responses API: its name is also its payload's ``type``."""
    data = json.dumps({"type": kind, **fields, "sequence_number": sequence})
    return f"event: {kind}\ndata: {data}\n\n"


def events(
    payload: Mapping[str, Any], response: FakeResponse, number: int
) -> tuple[list[str], str, str, int]:
    """A streamed answer to request `number`: its events (the last, which ends the stream,
    apart), the ``error`` event `in_band_error` injects, and the index of the first
    event with content."""
    message_id = f"msg_fake_{number}"
    start = _response(payload, response, number, status="in_progress", output=[], usage=None)
    kinds: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": start}),
        ("response.in_progress", {"response": start}),
    ]
    pieces = response.pieces()
    first_content = 4 if pieces else 3
    output_index = 0
    if pieces:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        where = {"item_id": message_id, "output_index": 0}
        text = "".join(pieces)
        done_part = {**part, "text": text}
        kinds += [
            (
                "response.output_item.added",
                {"output_index": 0, "item": _message(message_id, "", "in_progress")},
            ),
            ("response.content_part.added", {**where, "content_index": 0, "part": part}),
            *(
                (
                    "response.output_text.delta",
                    {**where, "content_index": 0, "delta": piece, "logprobs": []},
                )
                for piece in pieces
            ),
            (
                "response.output_text.done",
                {**where, "content_index": 0, "text": text, "logprobs": []},
            ),
            ("response.content_part.done", {**where, "content_index": 0, "part": done_part}),
            (
                "response.output_item.done",
                {"output_index": 0, "item": _message(message_id, text, "completed")},
            ),
        ]
        output_index = 1
    for call, (name, arguments) in enumerate(response.tool_calls):
        index = output_index + call
        where = {"item_id": f"fc_{call}", "output_index": index}
        kinds.append(
            (
                "response.output_item.added",
                {"output_index": index, "item": _call(call, name, "", "in_progress")},
            )
        )
        kinds += [
            ("response.function_call_arguments.delta", {**where, "delta": part})
            for part in response.argument_pieces(arguments)
        ]
        kinds += [
            ("response.function_call_arguments.done", {**where, "arguments": arguments}),
            (
                "response.output_item.done",
                {"output_index": index, "item": _call(call, name, arguments, "completed")},
            ),
        ]
    out = [_event(kind, sequence, **fields) for sequence, (kind, fields) in enumerate(kinds)]
    status = _status(response)
    final = _response(
        payload,
        response,
        number,
        status=status,
        output=_output(response, message_id),
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
    return out, end, in_band, first_content
