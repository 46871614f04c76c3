"""`FakeAnthropicServer`: a fault-injecting fake of the Anthropic Messages API.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from typing import Any

from pipeline.testing._fake_server import FakeResponse, FakeServer

__all__ = ["MESSAGES_PATH", "FakeAnthropicServer", "MessagesAnswers"]

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


class MessagesAnswers(FakeServer):
    """The Messages API's answers on any path: `FakeAnthropicServer`'s, and Anthropic's
    models on Vertex AI (`pipeline.testing.FakeGeminiServer`)."""

    async def _answer_messages(
        self, writer: asyncio.StreamWriter, payload: Any, response: FakeResponse
    ) -> bool:
        """Answer a request that passed the path's own checks (headers, auth)."""
        if not isinstance(payload, dict) or not isinstance(payload.get("max_tokens"), int):
            await self._error(writer, 400, "invalid_request_error", "max_tokens: Field required")
            return True
        refusal = self._check_thinking(payload) or _check_breakpoints(payload)
        if refusal is not None:
            await self._error(writer, 400, "invalid_request_error", refusal)
            return True
        response = self._with_cache_usage(payload, response)
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

    # -- thinking ----------------------------------------------------------------------------

    @property
    def _secret(self) -> bytes:
        secret: bytes | None = getattr(self, "_signing_key", None)
        if secret is None:
            secret = self._signing_key = os.urandom(16)
        return secret

    def signature(self, thinking: str) -> str:
        """The signature this server gives a thinking block with that text."""
        return "sig_" + hmac.new(self._secret, thinking.encode(), hashlib.sha256).hexdigest()

    @staticmethod
    def thinks(payload: Mapping[str, Any]) -> bool:
        """Whether a request asks for thinking (``enabled`` or ``adaptive``)."""
        thinking = payload.get("thinking")
        return isinstance(thinking, Mapping) and thinking.get("type") in ("enabled", "adaptive")

    def _check_thinking(self, payload: Mapping[str, Any]) -> str | None:
        """Why the API would refuse the request's thinking blocks, or None."""
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return None
        last_assistant = None
        for index, message in enumerate(messages):
            content = message.get("content") if isinstance(message, Mapping) else None
            if not isinstance(content, list):
                continue
            if message.get("role") == "assistant":
                last_assistant = index
            for position, block in enumerate(content):
                if not isinstance(block, Mapping):
                    continue
                if block.get("type") == "thinking":
                    text, signature = block.get("thinking"), block.get("signature")
                    if not isinstance(text, str) or not isinstance(signature, str):
                        return f"messages.{index}.content.{position}: thinking needs a signature"
                    # As bytes: compare_digest takes no str beyond ASCII (a client may send
                    # anything), and a fake that crashes answers 500, not the API's 400.
                    made = self.signature(text).encode()
                    if not hmac.compare_digest(signature.encode(), made):
                        return (
                            f"messages.{index}.content.{position}: Invalid `signature` in "
                            "`thinking` block"
                        )
        if last_assistant is None or not self.thinks(payload):
            return None
        content = messages[last_assistant].get("content")
        uses_tools = any(isinstance(b, Mapping) and b.get("type") == "tool_use" for b in content)
        first = content[0].get("type") if content and isinstance(content[0], Mapping) else None
        if uses_tools and first not in ("thinking", "redacted_thinking"):
            return (
                f"messages.{last_assistant}.content.0.type: Expected `thinking` or "
                "`redacted_thinking`, but found `" + str(first) + "`. When `thinking` is "
                "enabled, a final `assistant` message must start with a thinking block"
            )
        return None

    def _thinking_block(self, payload: Mapping[str, Any], response: FakeResponse) -> Any:
        if not self.thinks(payload):
            return None
        thinking = payload["thinking"]
        text = "" if thinking.get("display") == "omitted" else response.thinking
        return {"type": "thinking", "thinking": text, "signature": self.signature(text)}

    # -- prompt caching -----------------------------------------------------------------------

    def _with_cache_usage(self, payload: Mapping[str, Any], response: FakeResponse) -> FakeResponse:
        """The response, with cache usage counted when the request has breakpoints and the
        script set none."""
        if response.cache_usage != (0, 0):
            return response
        parts: list[Any] = [payload.get("tools") or [], payload.get("system") or ""]
        parts += list(payload.get("messages") or [])
        flat: list[Any] = []
        for part in parts:
            blocks = part.get("content") if isinstance(part, Mapping) else part
            flat += blocks if isinstance(blocks, list) else [blocks]
        ends = [i for i, b in enumerate(flat) if isinstance(b, Mapping) and "cache_control" in b]
        if not ends and "cache_control" not in payload:
            return response
        ends = ends or [len(flat) - 1]
        cached: set[str] = self.__dict__.setdefault("_cached_prefixes", set())
        # Each breakpoint's prefix: the longest one cached before is read, the rest of the
        # last one is written; every one is cached from now on.
        read = written = 0
        for end in ends:
            prefix = json.dumps(flat[: end + 1], sort_keys=True)
            tokens = max(1, len(prefix) // 4)
            key = hashlib.sha256(prefix.encode()).hexdigest()
            if key in cached:
                read = tokens
            cached.add(key)
            written = tokens
        usage = (max(0, written - read), read)
        return dataclasses.replace(response, cache_usage=usage)

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
        thinking = self._thinking_block(payload, response)
        if thinking is not None:
            content.append(thinking)
        if response.text:
            content.append({"type": "text", "text": response.text})
        tag = self.answer_tag()
        for index, (name, arguments) in enumerate(response.tool_calls):
            content.append(
                {
                    "type": "tool_use",
                    "id": f"toolu_{tag}_{index}",
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
        thinking = self._thinking_block(payload, response)
        if thinking is not None:
            deltas = [{"type": "thinking_delta", "thinking": thinking["thinking"]}]
            if not thinking["thinking"]:
                deltas = []
            deltas.append({"type": "signature_delta", "signature": thinking["signature"]})
            blocks.append(({"type": "thinking", "thinking": "", "signature": ""}, deltas))
        pieces = response.pieces()
        if pieces:
            deltas = [{"type": "text_delta", "text": piece} for piece in pieces]
            blocks.append(({"type": "text", "text": ""}, deltas))
        tag = self.answer_tag()
        for call, (name, arguments) in enumerate(response.tool_calls):
            tool_use = {"type": "tool_use", "id": f"toolu_{tag}_{call}", "name": name, "input": {}}
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


class FakeAnthropicServer(MessagesAnswers):
    """A Messages API server on ``127.0.0.1``: ``POST /v1/messages``.

    `base_url` is the server's root, as `AnthropicChatClient` and the ``anthropic`` SDK
    take it. Requests without ``x-api-key`` or ``anthropic-version`` are answered as the
    API would (401, 400). In `FakeResponse`, `stop_reason` is the Messages API's own value
    (``end_turn``, ``max_tokens``, ``tool_use``, ``stop_sequence``, ``refusal``), and
    `in_band_error` an error object such as ``{"type": "overloaded_error", "message": ...}``.
    """

    default_path = MESSAGES_PATH
    wire_format = "anthropic"
    title = "Anthropic Messages"

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
        return await self._answer_messages(writer, payload, response)


def _check_breakpoints(payload: Mapping[str, Any]) -> str | None:
    """Why the API would refuse the request's prompt-cache breakpoints (more than four), or
    None."""
    count = 1 if payload.get("cache_control") is not None else 0
    parts: list[Any] = [payload.get("tools"), payload.get("system")]
    parts += [m.get("content") for m in payload.get("messages") or () if isinstance(m, Mapping)]
    for part in parts:
        if isinstance(part, list):
            count += sum(1 for b in part if isinstance(b, Mapping) and "cache_control" in b)
    if count > 4:
        return f"A maximum of 4 blocks with cache_control may be provided. Found {count}."
    return None
