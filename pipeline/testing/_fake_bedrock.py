"""`FakeBedrockServer`: a fault-injecting fake of Amazon Bedrock's Converse and ConverseStream.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import hashlib
import hmac
import json
import os
import re
import struct
import zlib
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, unquote

from pipeline.testing._fake_server import FakeResponse, FakeServer, RecordedRequest

__all__ = [
    "BEDROCK_ACCESS_KEY_ID",
    "BEDROCK_SECRET_ACCESS_KEY",
    "CONVERSE_PATH",
    "FakeBedrockServer",
    "event_stream_frame",
]

CONVERSE_PATH = "/model/{modelId}/converse"
"""The key `FakeBedrockServer.script` queues under (both call shapes, every model)."""
BEDROCK_ACCESS_KEY_ID = "AKIDFAKEBEDROCK0001"
"""The access key id the fake accepts unless given others."""
BEDROCK_SECRET_ACCESS_KEY = "fake/bedrock+secret/key/for/tests/only"
"""Its secret key."""

_ERROR_TYPES = {
    400: "ValidationException",
    403: "AccessDeniedException",
    404: "ResourceNotFoundException",
    408: "ModelTimeoutException",
    424: "ModelErrorException",
    429: "ThrottlingException",
    500: "InternalServerException",
    503: "ServiceUnavailableException",
}
# A stream's exceptions: the error type -> the ConverseStreamOutput member that carries it.
_STREAM_MEMBERS = {
    "InternalServerException": "internalServerException",
    "ModelStreamErrorException": "modelStreamErrorException",
    "ValidationException": "validationException",
    "ThrottlingException": "throttlingException",
    "ServiceUnavailableException": "serviceUnavailableException",
}
_REQUEST_FIELDS = frozenset(
    {
        "messages",
        "system",
        "inferenceConfig",
        "toolConfig",
        "guardrailConfig",
        "additionalModelRequestFields",
        "promptVariables",
        "additionalModelResponseFieldPaths",
        "requestMetadata",
        "performanceConfig",
        "serviceTier",
        "outputConfig",
    }
)
_INFERENCE_FIELDS = frozenset({"maxTokens", "temperature", "topP", "stopSequences"})
_SIGNATURE_WINDOW = datetime.timedelta(minutes=5)
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_PADDING = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJ"  # the service pads events ("p") likewise


def event_stream_frame(headers: Mapping[str, str], payload: bytes) -> bytes:
    """One frame of AWS's event-stream encoding: a prelude (total and header lengths, their
    CRC32), string headers, the payload, and the CRC32 of all that."""
    encoded = b""
    for name, value in headers.items():
        name_bytes, value_bytes = name.encode(), value.encode()
        encoded += bytes([len(name_bytes)]) + name_bytes + b"\x07"
        encoded += struct.pack("!H", len(value_bytes)) + value_bytes
    prelude = struct.pack("!II", 12 + len(encoded) + len(payload) + 4, len(encoded))
    message = prelude + struct.pack("!I", zlib.crc32(prelude)) + encoded + payload
    return message + struct.pack("!I", zlib.crc32(message))


def _event(name: str, body: Mapping[str, Any]) -> bytes:
    headers = {
        ":event-type": name,
        ":content-type": "application/json",
        ":message-type": "event",
    }
    return event_stream_frame(headers, json.dumps({**body, "p": _PADDING}).encode())


def _exception(error: Mapping[str, Any]) -> bytes:
    kind = str(error.get("type") or "internalServerException")
    member = _STREAM_MEMBERS.get(kind, kind)
    headers = {
        ":exception-type": member,
        ":content-type": "application/json",
        ":message-type": "exception",
    }
    body = {"message": str(error.get("message", "error"))}
    return event_stream_frame(headers, json.dumps(body).encode())


_Refusal = tuple[int, str, str]
"""How the service refuses a request: (status, error type, message)."""


def _sign(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


class FakeBedrockServer(FakeServer):
    """Bedrock's runtime on ``127.0.0.1``: Converse and ConverseStream for any model id.

    `base_url` is the endpoint to give a client (``endpoint_url`` of boto3's
    ``bedrock-runtime`` client, ``base_url`` of `BedrockChatClient`). `credentials` maps each
    access key id the server accepts to its secret (default: `BEDROCK_ACCESS_KEY_ID`);
    `session_tokens` the token a key must come with, if any; `region` the one signatures
    must be scoped to. `environment()` is what a client's environment needs to reach it.
    `verified_signatures` counts the requests whose signature checked out; a request whose
    signature does not is answered 403, as AWS answers it.

    In `FakeResponse`: `stop_reason` is Converse's own (``end_turn``, ``tool_use``,
    ``max_tokens``, ``guardrail_intervened``...); `error_type` an error's type
    (``ThrottlingException``; default: the status's); `in_band_error` ``{"type",
    "message"}`` with a type such as ``throttlingException`` or ``ModelStreamErrorException``;
    `thinking` the reasoning of a request that asks for it; `cache_usage` (written, read);
    `disconnect_after` counts events from ``messageStart``; `raw_body` is sent as the stream,
    `body` as a Converse answer (or, with an error status, as the error's body).
    """

    default_path = CONVERSE_PATH
    wire_format = "bedrock"
    title = "Bedrock Converse"
    paces_events = True

    def __init__(
        self,
        *,
        port: int = 0,
        default: FakeResponse | None = None,
        host: str = "127.0.0.1",
        region: str = "us-east-1",
        credentials: Mapping[str, str] | None = None,
        session_tokens: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(port=port, default=default, host=host)
        self.region = region
        self.credentials = dict(credentials or {BEDROCK_ACCESS_KEY_ID: BEDROCK_SECRET_ACCESS_KEY})
        self.session_tokens = dict(session_tokens or {})
        self.verified_signatures = 0
        self.models: list[str] = []  # the model of each Converse request, in order
        self._reasoning_key = os.urandom(16)
        self._cached_prefixes: set[str] = set()

    def environment(self) -> dict[str, str]:
        """Environment variables that point botocore's credential chain at this server's
        first key and region, and away from anything else (no shared config files, no
        instance metadata)."""
        key, secret = next(iter(self.credentials.items()))
        variables = {
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        if key in self.session_tokens:
            variables["AWS_SESSION_TOKEN"] = self.session_tokens[key]
        return variables

    def fixture_environment(self) -> Mapping[str, str | None]:
        """`environment()`, and no ``AWS_PROFILE`` (the empty configuration has no profile)."""
        return {**self.environment(), "AWS_PROFILE": None}

    def response_for(self, request: RecordedRequest) -> FakeResponse:
        queue = self._scripts.get(CONVERSE_PATH)
        return queue.popleft() if queue else self.default

    def count(self, path: str | None = None) -> int:
        """Requests to `path` (default: every Converse and ConverseStream request)."""
        if path is not None:
            return super().count(path)
        return sum(1 for r in self.requests if r.path.startswith("/model/"))

    # -- requests ------------------------------------------------------------------------

    async def _handle(
        self,
        writer: asyncio.StreamWriter,
        method: str,
        path: str,
        payload: Any,
        response: FakeResponse,
    ) -> bool:
        request = self.requests[-1]
        parts = path.split("/")
        if method != "POST" or len(parts) != 4 or parts[1] != "model" or not parts[2]:
            await self._error(writer, 404, "UnknownOperationException", "not found")
            return True
        operation = parts[3]
        if operation not in ("converse", "converse-stream"):
            await self._error(writer, 404, "UnknownOperationException", "not found")
            return True
        refusal = self._verify_signature(request)
        if refusal is not None:
            await self._error(writer, *refusal)
            return True
        self.verified_signatures += 1
        model = unquote(parts[2])
        self.models.append(model)
        if response.status >= 400:
            if response.body is not None:
                await self._send_json(writer, response.status, response.body, response.headers)
            else:
                error_type = response.error_type or _ERROR_TYPES.get(response.status)
                await self._error(
                    writer,
                    response.status,
                    error_type or "InternalServerException",
                    response.error_message,
                    response.headers,
                )
            return True
        refusal = self._check_request(payload)
        if refusal is not None:
            await self._error(writer, *refusal)
            return True
        if response.body is not None and operation == "converse":
            await self._send_json(writer, 200, response.body, {**self._ids(), **response.headers})
            return True
        response = self._with_cache_usage(payload, response)
        if operation == "converse-stream":
            return await self._stream(writer, payload, response)
        await self._send_json(writer, 200, self._answer(payload, response), self._ids())
        return True

    def _ids(self) -> dict[str, str]:
        return {"x-amzn-RequestId": f"00000000-0000-4000-8000-{len(self.requests):012d}"}

    async def _error(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        error_type: str,
        message: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        head = {
            **self._ids(),
            "x-amzn-ErrorType": f"{error_type}:http://internal.amazon.com/coral/com.amazon.bedrock/",
            **(headers or {}),
        }
        await self._send_json(writer, status, {"message": message}, head)

    # -- SigV4, written from the specification ----------------------------------------------

    def _verify_signature(self, request: RecordedRequest) -> _Refusal | None:
        """Why AWS would refuse the request's signature, or None."""
        headers = request.headers
        authorization = headers.get("authorization", "")
        if not authorization.startswith("AWS4-HMAC-SHA256 "):
            return (403, "MissingAuthenticationTokenException", "Missing Authentication Token")
        fields = dict(
            part.strip().split("=", 1)
            for part in authorization[len("AWS4-HMAC-SHA256 ") :].split(",")
            if "=" in part
        )
        credential = fields.get("Credential", "").split("/")
        signed = fields.get("SignedHeaders", "").split(";")
        signature = fields.get("Signature", "")
        if len(credential) != 5 or not signature:
            return (403, "IncompleteSignatureException", "Authorization header is incomplete")
        key, day, region, service, terminal = credential
        secret = self.credentials.get(key)
        if secret is None:
            return (
                403,
                "UnrecognizedClientException",
                "The security token included in the request is invalid.",
            )
        token = self.session_tokens.get(key)
        if token is not None and (
            headers.get("x-amz-security-token") != token or "x-amz-security-token" not in signed
        ):
            return (
                403,
                "UnrecognizedClientException",
                "The security token included in the request is invalid.",
            )
        stamp = headers.get("x-amz-date", "")
        try:
            when = datetime.datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.UTC)
        except ValueError:
            return (403, "IncompleteSignatureException", "X-Amz-Date is missing")
        if abs(datetime.datetime.now(datetime.UTC) - when) > _SIGNATURE_WINDOW:
            return (403, "InvalidSignatureException", "Signature expired")
        if (day, region, service, terminal) != (stamp[:8], self.region, "bedrock", "aws4_request"):
            return (403, "InvalidSignatureException", "Credential should be scoped correctly")
        if "host" not in signed or "x-amz-date" not in signed or signed != sorted(signed):
            return (403, "InvalidSignatureException", "Host and X-Amz-Date must be signed")
        canonical = "\n".join(
            [
                request.method,
                quote(request.path or "/", safe="/~"),  # the path as sent, encoded again
                "",
                "".join(f"{n}:{' '.join(headers.get(n, '').split())}\n" for n in signed),
                ";".join(signed),
                hashlib.sha256(request.body).hexdigest(),
            ]
        )
        scope = f"{day}/{region}/{service}/{terminal}"
        to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        signing_key = _sign(
            _sign(_sign(_sign(f"AWS4{secret}".encode(), day), region), service), terminal
        )
        expected = hmac.new(signing_key, to_sign.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, signature):
            return (
                403,
                "InvalidSignatureException",
                "The request signature we calculated does not match the signature you provided.",
            )
        return None

    # -- what the service refuses -------------------------------------------------------------

    def reasoning_signature(self, text: str) -> str:
        """The signature this server gives reasoning with that text."""
        return "sig" + hmac.new(self._reasoning_key, text.encode(), hashlib.sha256).hexdigest()

    @staticmethod
    def thinks(payload: Mapping[str, Any]) -> bool:
        """Whether a request asks its model to reason (Claude's ``thinking``, Nova's
        ``reasoningConfig``, in ``additionalModelRequestFields``)."""
        fields = payload.get("additionalModelRequestFields")
        if not isinstance(fields, Mapping):
            return False
        thinking = fields.get("thinking")
        nova = fields.get("reasoningConfig")
        return (
            isinstance(thinking, Mapping) and thinking.get("type") in ("enabled", "adaptive")
        ) or (isinstance(nova, Mapping) and nova.get("type") == "enabled")

    def _check_request(self, payload: Any) -> _Refusal | None:
        """Why the service would refuse the request, or None."""

        def invalid(message: str) -> _Refusal:
            return (400, "ValidationException", message)

        if not isinstance(payload, dict):
            return (400, "SerializationException", "the body is not a JSON object")
        unknown = sorted(set(payload) - _REQUEST_FIELDS)
        if unknown:
            return (400, "SerializationException", f"Unknown field: {unknown[0]}")
        inference = payload.get("inferenceConfig", {})
        if not isinstance(inference, dict) or set(inference) - _INFERENCE_FIELDS:
            return invalid("inferenceConfig holds an unknown field")
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            return invalid("messages: at least one message is required")
        points = 0
        previous_uses: list[str] = []
        uses_tools = False
        for index, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            content = message.get("content") if isinstance(message, dict) else None
            expected = "user" if index % 2 == 0 else "assistant"
            if role != expected:
                return invalid(
                    "A conversation must start with a user message and alternate between "
                    "user and assistant roles."
                )
            if not isinstance(content, list) or not content:
                return invalid(f"messages.{index}.content: at least one block is required")
            uses: list[str] = []
            results: list[str] = []
            for position, block in enumerate(content):
                where = f"messages.{index}.content.{position}"
                if not isinstance(block, dict) or len(block) != 1:
                    return invalid(f"{where}: a content block has exactly one member")
                kind, value = next(iter(block.items()))
                if kind == "text" and (not isinstance(value, str) or not value.strip()):
                    return invalid(
                        f"The text field in the ContentBlock object at {where} is blank."
                    )
                if kind == "cachePoint":
                    points += 1
                if kind == "toolUse":
                    uses.append(value.get("toolUseId"))
                    uses_tools = True
                if kind == "toolResult":
                    results.append(value.get("toolUseId"))
                    uses_tools = True
                if kind == "reasoningContent":
                    refused = self._check_reasoning(value, where, role)
                    if refused is not None:
                        return refused
            if sorted(map(str, results)) != sorted(map(str, previous_uses)) and results:
                return invalid(
                    f"messages.{index}.content: the toolResult blocks do not answer the "
                    "toolUse blocks of the previous turn"
                )
            previous_uses = uses if role == "assistant" else []
        for block in payload.get("system", []):
            if isinstance(block, dict) and "cachePoint" in block:
                points += 1
            if isinstance(block, dict) and "text" in block and not str(block["text"]).strip():
                return invalid("The text field in a system block is blank.")
        config = payload.get("toolConfig")
        if uses_tools and not isinstance(config, dict):
            return invalid(
                "The toolConfig field must be defined when using toolUse and toolResult "
                "content blocks."
            )
        if isinstance(config, dict):
            tools = config.get("tools")
            if not isinstance(tools, list) or not tools:
                return invalid("toolConfig.tools: at least one tool is required")
            for index, tool in enumerate(tools):
                spec = tool.get("toolSpec") if isinstance(tool, dict) else None
                name = spec.get("name") if isinstance(spec, dict) else None
                if spec is not None and not (isinstance(name, str) and _TOOL_NAME.fullmatch(name)):
                    return invalid(
                        f"toolConfig.tools.{index}.toolSpec.name: a tool's name is 1 to 64 "
                        "letters, digits, _ or -"
                    )
            points += sum(1 for tool in tools if isinstance(tool, dict) and "cachePoint" in tool)
        if points > 4:
            return invalid(f"The request has {points} cache points; at most 4 are allowed.")
        if self.thinks(payload):
            # As Claude's API: the last assistant turn, if it used tools, starts with its
            # reasoning.
            assistants = [m for m in messages if m.get("role") == "assistant"]
            blocks = assistants[-1].get("content", []) if assistants else []
            if any("toolUse" in b for b in blocks) and "reasoningContent" not in blocks[0]:
                return invalid(
                    "Expected `thinking` or `redacted_thinking`, but found `tool_use`. When "
                    "thinking is enabled, a final assistant message must start with a thinking "
                    "block"
                )
        return None

    def _check_reasoning(self, value: Any, where: str, role: str) -> _Refusal | None:
        if role != "assistant" or not isinstance(value, dict):
            return (400, "ValidationException", f"{where}: reasoning is an assistant's")
        if "redactedContent" in value:
            return None
        text_block = value.get("reasoningText")
        text = text_block.get("text") if isinstance(text_block, dict) else None
        signature = text_block.get("signature") if isinstance(text_block, dict) else None
        if (
            not isinstance(text, str)
            or not isinstance(signature, str)
            or not hmac.compare_digest(signature, self.reasoning_signature(text))
        ):
            return (
                400,
                "ValidationException",
                f"{where}: the signature in the reasoning block is invalid",
            )
        return None

    # -- prompt caching -----------------------------------------------------------------------

    def _with_cache_usage(self, payload: Mapping[str, Any], response: FakeResponse) -> FakeResponse:
        """The response, with cache usage counted from the request's cache points when the
        script set none: the first request with a prefix writes it, later ones read it."""
        if response.cache_usage != (0, 0):
            return response
        config = payload.get("toolConfig")
        flat: list[Any] = list(config.get("tools", [])) if isinstance(config, Mapping) else []
        flat += list(payload.get("system") or [])
        for message in payload.get("messages") or []:
            flat += list(message.get("content") or [])
        ends = [
            i
            for i, block in enumerate(flat)
            if isinstance(block, Mapping) and "cachePoint" in block
        ]
        if not ends:
            return response
        read = written = 0
        for end in ends:
            prefix = json.dumps(flat[:end], sort_keys=True)
            tokens = max(1, len(prefix) // 4)
            key = hashlib.sha256(prefix.encode()).hexdigest()
            if key in self._cached_prefixes:
                read = tokens
            self._cached_prefixes.add(key)
            written = tokens
        return dataclasses.replace(response, cache_usage=(max(0, written - read), read))

    # -- answers ------------------------------------------------------------------------------

    def _stop_reason(self, response: FakeResponse) -> str:
        return response.stop_reason or ("tool_use" if response.chat_tool_calls() else "end_turn")

    def _usage(self, response: FakeResponse) -> dict[str, Any]:
        prompt, completion = response.usage
        written, read = response.cache_usage
        return {
            "inputTokens": prompt,
            "outputTokens": completion,
            "totalTokens": prompt + completion + written + read,
            "cacheReadInputTokens": read,
            "cacheWriteInputTokens": written,
        }

    def _tool_use_id(self, index: int) -> str:
        # Unique per call, as the service's are (a tool loop replays them).
        return f"tooluse_{len(self.requests):04d}{index}_{os.urandom(4).hex()}"

    def _reasoning(
        self, payload: Mapping[str, Any], response: FakeResponse
    ) -> dict[str, Any] | None:
        if not self.thinks(payload):
            return None
        text = response.thinking
        return {"reasoningText": {"text": text, "signature": self.reasoning_signature(text)}}

    def _answer(self, payload: Mapping[str, Any], response: FakeResponse) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        reasoning = self._reasoning(payload, response)
        if reasoning is not None:
            content.append({"reasoningContent": reasoning})
        if response.text:
            content.append({"text": response.text})
        for index, (name, arguments) in enumerate(response.chat_tool_calls()):
            use = {"toolUseId": self._tool_use_id(index), "name": name}
            content.append({"toolUse": {**use, "input": json.loads(arguments or "{}")}})
        return {
            "output": {"message": {"role": "assistant", "content": content}},
            "stopReason": self._stop_reason(response),
            "usage": self._usage(response),
            "metrics": {"latencyMs": 1},
        }

    def _events(self, payload: Mapping[str, Any], response: FakeResponse) -> list[bytes]:
        events = [_event("messageStart", {"role": "assistant"})]
        index = 0
        delta: dict[str, Any]
        reasoning = self._reasoning(payload, response)
        if reasoning is not None:
            text_block = reasoning["reasoningText"]
            if text_block["text"]:
                delta = {"reasoningContent": {"text": text_block["text"]}}
                events.append(
                    _event("contentBlockDelta", {"delta": delta, "contentBlockIndex": index})
                )
            delta = {"reasoningContent": {"signature": text_block["signature"]}}
            events.append(_event("contentBlockDelta", {"delta": delta, "contentBlockIndex": index}))
            events.append(_event("contentBlockStop", {"contentBlockIndex": index}))
            index += 1
        pieces = response.pieces()
        if pieces:
            for piece in pieces:
                delta = {"text": piece}
                events.append(
                    _event("contentBlockDelta", {"delta": delta, "contentBlockIndex": index})
                )
            events.append(_event("contentBlockStop", {"contentBlockIndex": index}))
            index += 1
        for call, (name, arguments) in enumerate(response.chat_tool_calls()):
            start = {"toolUse": {"toolUseId": self._tool_use_id(call), "name": name}}
            events.append(_event("contentBlockStart", {"start": start, "contentBlockIndex": index}))
            for part in response.argument_pieces(arguments):
                delta = {"toolUse": {"input": part}}
                events.append(
                    _event("contentBlockDelta", {"delta": delta, "contentBlockIndex": index})
                )
            events.append(_event("contentBlockStop", {"contentBlockIndex": index}))
            index += 1
        events.append(_event("messageStop", {"stopReason": self._stop_reason(response)}))
        return events

    async def _stream(
        self, writer: asyncio.StreamWriter, payload: Mapping[str, Any], response: FakeResponse
    ) -> bool:
        head = (
            "HTTP/1.1 200 OK\r\nContent-Type: application/vnd.amazon.eventstream\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in self._ids().items())
            + "Transfer-Encoding: chunked\r\n\r\n"
        )
        writer.write(head.encode("latin-1"))
        await writer.drain()

        async def send(data: bytes) -> None:
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()

        if response.first_chunk_delay:
            await asyncio.sleep(response.first_chunk_delay)
        if response.raw_body is not None:
            if response.raw_body:
                await send(response.raw_body)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        events = self._events(payload, response)
        end = _event("metadata", {"usage": self._usage(response), "metrics": {"latencyMs": 1}})
        if not response.omit_done:
            events.append(end)
        for index, event in enumerate(events):
            if response.disconnect_after is not None and index >= response.disconnect_after:
                writer.transport.abort()
                return False
            if response.hang_after is not None and index >= response.hang_after:
                await self._until_client_leaves(self._readers[writer])
                return False
            if response.in_band_error is not None and index >= response.error_after:
                await send(_exception(response.in_band_error))
                break
            if index > 1 and response.chunk_delay:
                await asyncio.sleep(response.chunk_delay)
            await send(event)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True
