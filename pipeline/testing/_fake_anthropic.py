"""`FakeAnthropicServer`: a fault-injecting fake of the Anthropic Messages API.

The same `FakeResponse` scripts as the OpenAI-compatible fake (latency, statuses with
``retry-after``, disconnects after N events, in-band ``event: error``, malformed SSE, hangs,
tool use), answered in the Messages API's wire format: ``POST /v1/messages``, streamed as
``message_start``, ``content_block_start``/``_delta``/``_stop``, ``ping``,
``message_delta`` and ``message_stop`` events, errors as ``{"type": "error", "error":
{"type", "message"}}`` with a ``request-id`` header.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from pipeline.testing._fake_server import FakeResponse, FakeServer

__all__ = ["MESSAGES_PATH", "FakeAnthropicServer"]

MESSAGES_PATH = "/v1/messages"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def _event(name: str, **fields: Any) -> str:
    """One SSE event of the Messages API: its name is also its payload's ``type``."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **fields})}\n\n"


class FakeAnthropicServer(FakeServer):
    """A Messages API server on ``127.0.0.1``: ``POST /v1/messages``.

    `base_url` is the server's root, as `AnthropicChatClient` and the ``anthropic`` SDK
    take it. Requests without ``x-api-key`` or ``anthropic-version`` are answered as the
    API would (401, 400). In `FakeResponse`, `stop_reason` is the Messages API's own value
    (``end_turn``, ``max_tokens``, ``tool_use``, ``stop_sequence``, ``refusal``), and
    `in_band_error` an error object such as ``{"type": "overloaded_error", "message": ...}``.
    """

    default_path = MESSAGES_PATH

    @property
    def base_url(self) -> str:
        return self.origin

    async def _handle(
        self,
        writer: asyncio.StreamWriter,
        method: str,
        path: str,
        payload: Any,
        response: FakeResponse,
    ) -> bool:
        request = self.requests[-1]
        if method != "POST" or path != MESSAGES_PATH:
            await self._error(writer, 404, "not_found_error", "not found")
            return True
        if response.status >= 400:
            if response.body is not None:
                await self._send_json(writer, response.status, response.body, response.headers)
            else:
                await self._error(
                    writer,
                    response.status,
                    response.error_type or response.error_code,
                    response.error_message,
                    response.headers,
                )
            return True
        if "x-api-key" not in request.headers and "authorization" not in request.headers:
            await self._error(writer, 401, "authentication_error", "x-api-key header is required")
            return True
        if "anthropic-version" not in request.headers:
            await self._error(
                writer, 400, "invalid_request_error", "anthropic-version header is required"
            )
            return True
        if not isinstance(payload, dict) or not isinstance(payload.get("max_tokens"), int):
            await self._error(writer, 400, "invalid_request_error", "max_tokens: Field required")
            return True
        if payload.get("stream"):
            events = self._events(payload, response)
            error = _event("error", error=dict(response.in_band_error or {}))
            return await self._send_events(
                writer,
                response,
                events,
                error_event=error,
                done_event=_event("message_stop"),
                # message_start, content_block_start, ping, then the first text delta.
                first_content=3 if response.pieces() else 2,
            )
        await self._send_json(writer, 200, self._message(payload, response), self._ids())
        return True

    def _ids(self) -> dict[str, str]:
        return {"request-id": f"req_fake_{len(self.requests)}"}

    async def _error(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        type_: str | None,
        message: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        error_type = (
            type_
            or _ERROR_TYPES.get(status)
            or ("api_error" if status >= 500 else "invalid_request_error")
        )
        body = {
            "type": "error",
            "error": {"type": error_type, "message": message},
            "request_id": f"req_fake_{len(self.requests)}",
        }
        await self._send_json(writer, status, body, {**self._ids(), **(headers or {})})

    def _stop_reason(self, response: FakeResponse) -> str:
        return response.stop_reason or ("tool_use" if response.tool_calls else "end_turn")

    def _usage(self, response: FakeResponse, *, output: int | None = None) -> dict[str, Any]:
        prompt, completion = response.usage
        written, read = response.cache_usage
        return {
            "input_tokens": prompt,
            "cache_creation_input_tokens": written,
            "cache_read_input_tokens": read,
            "output_tokens": completion if output is None else output,
        }

    def _message_head(self, payload: Mapping[str, Any], response: FakeResponse) -> dict[str, Any]:
        return {
            "id": f"msg_fake_{len(self.requests)}",
            "type": "message",
            "role": "assistant",
            "model": self._model(payload, response),
        }

    def _message(self, payload: Mapping[str, Any], response: FakeResponse) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if response.text:
            content.append({"type": "text", "text": response.text})
        for index, (name, arguments) in enumerate(response.tool_calls):
            content.append(
                {
                    "type": "tool_use",
                    "id": f"toolu_{index}",
                    "name": name,
                    "input": json.loads(arguments or "{}"),
                }
            )
        return {
            **self._message_head(payload, response),
            "content": content,
            "stop_reason": self._stop_reason(response),
            "stop_sequence": None,
            "usage": self._usage(response),
        }

    def _events(self, payload: Mapping[str, Any], response: FakeResponse) -> list[str]:
        start = {
            **self._message_head(payload, response),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": self._usage(response, output=1),
        }
        out = [_event("message_start", message=start)]
        blocks: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
        pieces = response.pieces()
        if pieces:
            deltas = [{"type": "text_delta", "text": piece} for piece in pieces]
            blocks.append(({"type": "text", "text": ""}, deltas))
        for call, (name, arguments) in enumerate(response.tool_calls):
            tool_use = {"type": "tool_use", "id": f"toolu_{call}", "name": name, "input": {}}
            deltas = [
                {"type": "input_json_delta", "partial_json": part}
                for part in response.argument_pieces(arguments)
            ]
            blocks.append((tool_use, deltas))
        for index, (block, deltas) in enumerate(blocks):
            out.append(_event("content_block_start", index=index, content_block=block))
            if index == 0:
                out.append(_event("ping"))  # where the API sends its first ping
            out += [_event("content_block_delta", index=index, delta=d) for d in deltas]
            out.append(_event("content_block_stop", index=index))
        delta = {"stop_reason": self._stop_reason(response), "stop_sequence": None}
        out.append(_event("message_delta", delta=delta, usage=self._usage(response)))
        return out
