"""`FakeGeminiServer`: a fault-injecting fake of Google's Gemini API, with Vertex AI's paths
(Gemini and Anthropic's models on it); `FakeGoogleTokenServer`: the OAuth 2.0 token endpoint
Google service accounts get their access tokens from.

The details and the reasons: the design notes (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import re
import threading
import time
import urllib.parse
import uuid
from collections.abc import Collection, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self

from pipeline.testing._fake_anthropic import MessagesAnswers
from pipeline.testing._fake_server import FakeResponse, RecordedRequest

__all__ = ["GENERATE_CONTENT", "RAW_PREDICT", "FakeGeminiServer", "FakeGoogleTokenServer"]

GENERATE_CONTENT = "generateContent"
"""What `FakeGeminiServer.script` and `count` name Gemini's requests by: the Gemini API's
and Vertex AI's, streamed or not."""
RAW_PREDICT = "rawPredict"
"""What `FakeGeminiServer.script` and `count` name Anthropic's models' requests on Vertex
AI by (``:rawPredict`` and ``:streamRawPredict``)."""

_GEMINI_PATH = re.compile(
    r"^/v1(?:alpha|beta\d*)?/(?P<model>(?:models|tunedModels)/[^/:]+):(?P<method>\w+)$"
)
_VERTEX_PATH = re.compile(
    r"^/v1(?:beta1)?/projects/[^/]+/locations/[^/]+/publishers/(?P<publisher>[^/]+)"
    r"/models/(?P<model>[^/:]+):(?P<method>\w+)$"
)
_METHODS = {
    "generateContent": GENERATE_CONTENT,
    "streamGenerateContent": GENERATE_CONTENT,
    "rawPredict": RAW_PREDICT,
    "streamRawPredict": RAW_PREDICT,
}
_STATUSES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "NOT_IMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
_FIELDS = frozenset(
    {
        "contents",
        "tools",
        "toolConfig",
        "safetySettings",
        "systemInstruction",
        "generationConfig",
        "cachedContent",
        "labels",
        "model",
    }
)
_GENERATION_FIELDS = frozenset(
    {
        "stopSequences",
        "responseMimeType",
        "responseSchema",
        "responseJsonSchema",
        "responseModalities",
        "candidateCount",
        "maxOutputTokens",
        "temperature",
        "topP",
        "topK",
        "seed",
        "presencePenalty",
        "frequencyPenalty",
        "responseLogprobs",
        "logprobs",
        "enableEnhancedCivicAnswers",
        "speechConfig",
        "thinkingConfig",
        "imageConfig",
        "mediaResolution",
    }
)
_THINKING_FIELDS = frozenset({"includeThoughts", "thinkingBudget", "thinkingLevel"})
_THINKING_LEVELS = frozenset({"MINIMAL", "LOW", "MEDIUM", "HIGH"})
_DATA_FIELDS = frozenset(
    {
        "text",
        "inlineData",
        "fileData",
        "functionCall",
        "functionResponse",
        "executableCode",
        "codeExecutionResult",
    }
)
_PART_FIELDS = _DATA_FIELDS | {
    "thought",
    "thoughtSignature",
    "videoMetadata",
    "mediaResolution",
    "partMetadata",
}
_TOOL_FIELDS = frozenset(
    {
        "functionDeclarations",
        "googleSearch",
        "googleSearchRetrieval",
        "codeExecution",
        "urlContext",
        "retrieval",
        "fileSearch",
        "computerUse",
        "googleMaps",
        "enterpriseWebSearch",
    }
)
_MODES = frozenset({"MODE_UNSPECIFIED", "AUTO", "ANY", "NONE", "VALIDATED"})
# Google's documented stand-in for a function call's missing signature (written here again:
# the fake judges the client, so it shares nothing with the client's code).
_PLACEHOLDER = base64.urlsafe_b64decode("skip_thought_signature_validator")
_FILTERED = frozenset(
    {"SAFETY", "RECITATION", "BLOCKLIST", "PROHIBITED_CONTENT", "SPII", "IMAGE_SAFETY"}
)
_PROMPT_BLOCKED = "prompt_blocked:"
_BLOCKED_RATING = {
    "category": "HARM_CATEGORY_DANGEROUS_CONTENT",
    "probability": "HIGH",
    "blocked": True,
}
_RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"
_GOOGLE_TOKEN_URI = "https://oauth2.googleapis.com/token"
_ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"


def _route(path: str) -> tuple[str, str, str] | None:
    """(publisher, model, method) of a Gemini API or a Vertex AI path, or None."""
    found = _GEMINI_PATH.match(path)
    if found is not None:
        return "google", found["model"].split("/", 1)[1], found["method"]
    found = _VERTEX_PATH.match(path)
    if found is not None:
        return found["publisher"], found["model"], found["method"]
    return None


# Fields whose values are the caller's data, never the API's names.
_OPAQUE = frozenset(
    {"args", "response", "parametersJsonSchema", "responseJsonSchema", "responseSchema",
     "parameters", "labels", "data"}
)  # fmt: skip


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word[:1].upper() + word[1:] for word in rest)


def _normalized(value: Any) -> Any:
    """A request with every field name in lowerCamelCase: the API, parsing protocol buffers'
    JSON, takes a field's proto name (``thinking_budget``, as google-genai sends some) as
    well as its JSON name (``thinkingBudget``)."""
    if isinstance(value, list):
        return [_normalized(item) for item in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        name = _camel(key) if isinstance(key, str) else key
        out[name] = item if name in _OPAQUE else _normalized(item)
    return out


def _signature_bytes(signature: Any) -> bytes | None:
    """A signature's bytes: the API reads the field as bytes, in base64 of either alphabet
    (google-genai sends back the URL-safe one)."""
    if not isinstance(signature, str):
        return None
    text = signature.replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except ValueError:
        return None


def _chunk(payload: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\r\n\r\n"


class FakeGeminiServer(MessagesAnswers):
    """A Gemini API and Vertex AI server on ``127.0.0.1``.

    `base_url` is the ``/v1beta`` URL to give `GeminiChatClient`; `vertex_base_url` the
    root to give `VertexChatClient` (``/v1/projects/{project}/locations/{location}/
    publishers/{google|anthropic}/models/{model}:{method}``). Gemini API requests need an
    API key (``x-goog-api-key`` or ``key=``; one of `api_keys` when given, else any);
    Vertex AI requests a bearer token (one `tokens` holds when given, such as a
    `FakeGoogleTokenServer`'s, else any).

    Scripts and counts name requests by `GENERATE_CONTENT` (Gemini, the default) or
    `RAW_PREDICT` (Anthropic's models on Vertex AI, answered as `FakeAnthropicServer`
    answers, the body checked for an ``anthropic_version`` and no ``model``). In
    `FakeResponse`, `stop_reason` is a ``finishReason`` (``STOP``, ``MAX_TOKENS``,
    ``SAFETY``...), `blocked_prompt` answers a prompt the API refuses to answer,
    `in_band_error` is an error object (``{"code": 500, "status": "INTERNAL", ...}``),
    `usage` the prompt's and the answer's tokens (`reasoning_tokens` of them are thoughts,
    `cache_usage`'s read part the cached prompt tokens), and a ``Retry-After`` header of
    an error is sent as the API sends it, a ``RetryInfo`` detail. Function calls carry no
    id, as the Gemini API's; `issued_signatures` are the thought signatures this server
    gave, `returned_signatures` and `placeholder_signatures` count those that came back.
    """

    default_path = GENERATE_CONTENT
    wire_format = "gemini"
    title = "Gemini API"

    def __init__(
        self,
        *,
        port: int = 0,
        default: FakeResponse | None = None,
        host: str = "127.0.0.1",
        api_keys: Collection[str] | None = None,
        tokens: Collection[str] | None = None,
    ) -> None:
        super().__init__(port=port, default=default, host=host)
        self.api_keys = None if api_keys is None else frozenset(api_keys)
        self.tokens = tokens
        self.issued_signatures: set[str] = set()
        self._issued: set[bytes] = set()  # the same, decoded
        self.returned_signatures = 0
        self.placeholder_signatures = 0

    @property
    def base_url(self) -> str:
        return f"{self.origin}/v1beta"

    @property
    def vertex_base_url(self) -> str:
        return self.origin

    @staticmethod
    def blocked_prompt(reason: str = "SAFETY") -> FakeResponse:
        """A response refusing the prompt (``promptFeedback.blockReason``, no candidates)."""
        return FakeResponse(text="", stop_reason=_PROMPT_BLOCKED + reason)

    # -- scripts ------------------------------------------------------------------------------

    @staticmethod
    def _key(path: str) -> str:
        route = _route(path)
        return _METHODS.get(route[2], path) if route is not None else path

    def response_for(self, request: RecordedRequest) -> FakeResponse:
        queue = self._scripts.get(self._key(request.path))
        return queue.popleft() if queue else self.default

    def count(self, path: str | None = None) -> int:
        key = path or self.default_path
        return sum(1 for r in self.requests if self._key(r.path) == key)

    # -- HTTP ---------------------------------------------------------------------------------

    async def _handle(
        self,
        writer: asyncio.StreamWriter,
        method: str,
        path: str,
        payload: Any,
        response: FakeResponse,
    ) -> bool:
        request = self.requests[-1]
        route = _route(path)
        if method != "POST" or route is None or route[2] not in _METHODS:
            await self._google_error(writer, 404, "NOT_FOUND", "not found")
            return True
        publisher, model, call = route
        vertex = path.startswith(("/v1/projects/", "/v1beta1/projects/"))
        if response.status >= 400:
            await self._scripted_error(writer, response, anthropic=publisher == "anthropic")
            return True
        refused = self._credential_problem(request, vertex)
        if refused is not None:
            await self._send_json(writer, refused[0], refused[1])
            return True
        if publisher == "anthropic" and vertex:
            return await self._anthropic(writer, payload, response, model, call)
        if publisher != "google" or call not in ("generateContent", "streamGenerateContent"):
            await self._google_error(writer, 404, "NOT_FOUND", f"{call} is not served here")
            return True
        stream = call == "streamGenerateContent"
        payload = _normalized(payload)
        try:
            if stream and "alt=sse" not in request.query.split("&"):
                raise ValueError("this server streams server-sent events only: pass alt=sse")
            returned = self._check(payload)
        except ValueError as exc:  # a request the API would refuse: its words
            await self._google_error(writer, 400, "INVALID_ARGUMENT", str(exc))
            return True
        self.returned_signatures += returned[0]
        self.placeholder_signatures += returned[1]
        model = response.model or model
        if stream:
            return await self._stream(writer, payload, response, model)
        await self._send_json(writer, 200, self._answer(payload, response, model))
        return True

    def _credential_problem(
        self, request: RecordedRequest, vertex: bool
    ) -> tuple[int, dict[str, Any]] | None:
        """The error an unauthenticated request gets, or None."""
        if vertex:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            known = self.tokens is None or token in self.tokens
            if scheme != "Bearer" or not token or not known:
                return 401, self._error_body(
                    401, "UNAUTHENTICATED", "Request had invalid authentication credentials."
                )
            return None
        key = request.headers.get("x-goog-api-key")
        if key is None:
            query = urllib.parse.parse_qs(request.query)
            key = query.get("key", [None])[0]
        if not key:
            return 403, self._error_body(
                403, "PERMISSION_DENIED", "Method doesn't allow unregistered callers."
            )
        if self.api_keys is not None and key not in self.api_keys:
            details = [{"@type": _ERROR_INFO, "reason": "API_KEY_INVALID"}]
            body = self._error_body(400, "INVALID_ARGUMENT", "API key not valid.", details)
            return 400, body
        return None

    @staticmethod
    def _error_body(
        status: int, name: str, message: str, details: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        error: dict[str, Any] = {"code": status, "message": message, "status": name}
        if details:
            error["details"] = details
        return {"error": error}

    async def _google_error(
        self, writer: asyncio.StreamWriter, status: int, name: str, message: str
    ) -> None:
        await self._send_json(writer, status, self._error_body(status, name, message))

    async def _scripted_error(
        self, writer: asyncio.StreamWriter, response: FakeResponse, *, anthropic: bool
    ) -> None:
        headers = dict(response.headers)
        if response.body is not None:
            await self._send_json(writer, response.status, response.body, headers)
            return
        if anthropic and response.error_type is not None:
            # A model's own error, in Anthropic's shape (Vertex AI's are Google's).
            await self._error(
                writer, response.status, response.error_type, response.error_message, headers
            )
            return
        details: list[dict[str, Any]] = []
        wait = next((headers.pop(k) for k in list(headers) if k.lower() == "retry-after"), None)
        if wait is not None:
            try:
                details.append({"@type": _RETRY_INFO, "retryDelay": f"{float(wait):g}s"})
            except ValueError:
                headers["Retry-After"] = wait  # a date: no Duration says it
        fallback = "INTERNAL" if response.status >= 500 else "UNKNOWN"
        name = (
            response.error_type or response.error_code or _STATUSES.get(response.status, fallback)
        )
        body = self._error_body(response.status, name, response.error_message, details)
        await self._send_json(writer, response.status, body, headers)

    # -- requests -----------------------------------------------------------------------------

    def _thinks(self, payload: Mapping[str, Any]) -> bool:
        config = payload.get("generationConfig") or {}
        thinking = config.get("thinkingConfig")
        return isinstance(thinking, Mapping) and thinking.get("thinkingBudget") != 0

    def _check(self, payload: Any) -> tuple[int, int]:
        """Refuse what the API refuses (a `ValueError` with the API's words); the signatures
        that came back: (this server's, placeholders)."""
        if not isinstance(payload, dict):
            raise ValueError("Invalid JSON payload received.")
        unknown = sorted(set(payload) - _FIELDS)
        if unknown:
            raise ValueError(f'Invalid JSON payload received. Unknown name "{unknown[0]}"')
        config = payload.get("generationConfig", {})
        if not isinstance(config, dict):
            raise ValueError("generationConfig: expected an object")
        unknown = sorted(set(config) - _GENERATION_FIELDS)
        if unknown:
            raise ValueError(f"Unknown name \"{unknown[0]}\" at 'generation_config'")
        thinking = config.get("thinkingConfig", {})
        if not isinstance(thinking, dict) or set(thinking) - _THINKING_FIELDS:
            raise ValueError("generation_config.thinking_config: unknown field")
        if "thinkingBudget" in thinking and "thinkingLevel" in thinking:
            raise ValueError("thinking_budget and thinking_level are not supported together.")
        level = thinking.get("thinkingLevel")
        if level is not None and level not in _THINKING_LEVELS:
            raise ValueError("Invalid value at 'generation_config.thinking_config.thinking_level'")
        if "responseSchema" in config and "responseJsonSchema" in config:
            raise ValueError("response_schema and response_json_schema cannot both be set")
        json_type = config.get("responseMimeType") == "application/json"
        if "responseJsonSchema" in config and not json_type:
            raise ValueError("response_json_schema needs response_mime_type application/json")
        declared = self._check_tools(payload)
        system = payload.get("systemInstruction")
        if system is not None:
            parts = system.get("parts") if isinstance(system, dict) else None
            texts = isinstance(parts, list) and all(self._part_kind(p) == "text" for p in parts)
            if not texts:
                raise ValueError("system_instruction: expected text parts")
        return self._check_contents(payload, declared)

    def _check_tools(self, payload: Mapping[str, Any]) -> set[str]:
        declared: set[str] = set()
        tools = payload.get("tools", [])
        if not isinstance(tools, list):
            raise ValueError("tools: expected a list")
        for tool in tools:
            if not isinstance(tool, dict) or not tool or set(tool) - _TOOL_FIELDS:
                raise ValueError("tools: a tool names one kind of tool")
            for function in tool.get("functionDeclarations", []):
                name = function.get("name") if isinstance(function, dict) else None
                if not isinstance(name, str) or not name:
                    raise ValueError("function_declarations: a function needs a name")
                if "parameters" in function and "parametersJsonSchema" in function:
                    raise ValueError("parameters and parameters_json_schema cannot both be set")
                declared.add(name)
        config = payload.get("toolConfig")
        if config is not None:
            calling = config.get("functionCallingConfig", {}) if isinstance(config, dict) else 0
            if not isinstance(calling, dict) or calling.get("mode", "AUTO") not in _MODES:
                raise ValueError("tool_config.function_calling_config.mode: invalid value")
            for name in calling.get("allowedFunctionNames", []):
                if calling.get("mode") not in ("ANY", "VALIDATED") or name not in declared:
                    raise ValueError("allowed_function_names: names a function not declared")
        return declared

    @staticmethod
    def _part_kind(part: Any) -> str:
        if not isinstance(part, dict) or set(part) - _PART_FIELDS:
            raise ValueError("a part has an unknown field")
        kinds: list[str] = [key for key in part if key in _DATA_FIELDS]
        if len(kinds) != 1:
            raise ValueError("a part must hold exactly one kind of data")
        return kinds[0]

    def _check_contents(self, payload: Mapping[str, Any], declared: set[str]) -> tuple[int, int]:
        contents = payload.get("contents")
        if not isinstance(contents, list) or not contents:
            raise ValueError("contents is not specified")
        returned = placeholders = 0
        current_turn = 0  # the first content after the last user input
        previous_calls = 0
        for index, content in enumerate(contents):
            if not isinstance(content, dict) or content.get("role") not in ("user", "model"):
                raise ValueError(f"contents[{index}].role: expected user or model")
            parts = content.get("parts")
            if not isinstance(parts, list) or not parts:
                raise ValueError(f"contents[{index}].parts must not be empty")
            kinds = [self._part_kind(part) for part in parts]
            responses = kinds.count("functionResponse")
            if responses and responses != previous_calls:
                raise ValueError(
                    "Please ensure that the number of function response parts is equal to "
                    "the number of function call parts of the function call turn."
                )
            for part, kind in zip(parts, kinds, strict=True):
                if kind == "functionCall" and not isinstance(part[kind].get("name"), str):
                    raise ValueError("function_call.name is required")
                if kind == "functionResponse" and (
                    not isinstance(part[kind].get("name"), str)
                    or not isinstance(part[kind].get("response"), dict)
                ):
                    raise ValueError("function_response needs a name and a response object")
                signature = part.get("thoughtSignature")
                if signature is None:
                    continue
                if content["role"] != "model":
                    raise ValueError("a thought signature belongs to a model turn")
                signed = _signature_bytes(signature)
                if signed == _PLACEHOLDER:
                    placeholders += 1
                elif signed in self._issued:
                    returned += 1
                else:
                    raise ValueError("Thought signature is not valid.")
            if content["role"] == "user" and any(k != "functionResponse" for k in kinds):
                current_turn = index + 1
            previous_calls = kinds.count("functionCall") if content["role"] == "model" else 0
        if self._thinks(payload):
            for content in contents[current_turn:]:
                calls = [p for p in content["parts"] if "functionCall" in p]
                if content["role"] == "model" and calls and "thoughtSignature" not in calls[0]:
                    raise ValueError(
                        "Function call is missing a thought_signature in functionCall parts. "
                        "This is required for tools to work correctly."
                    )
        return returned, placeholders

    # -- answers ------------------------------------------------------------------------------

    def _sign(self) -> str:
        secret: bytes | None = getattr(self, "_signing_key", None)
        if secret is None:
            secret = self._signing_key = uuid.uuid4().bytes
        issued = f"{len(self.requests)}:{len(self.issued_signatures)}".encode()
        mac = hmac.new(secret, issued, hashlib.sha256)
        signed = b"fake-gemini:" + mac.digest()
        signature = base64.b64encode(signed).decode()
        self.issued_signatures.add(signature)
        self._issued.add(signed)
        return signature

    def _usage_metadata(self, response: FakeResponse, *, final: bool = True) -> dict[str, Any]:
        prompt, completion = response.usage
        if not final:
            return {"promptTokenCount": prompt, "totalTokenCount": prompt}
        thoughts = min(response.reasoning_tokens, completion)
        usage: dict[str, Any] = {
            "promptTokenCount": prompt,
            "candidatesTokenCount": completion - thoughts,
            "totalTokenCount": prompt + completion,
            "promptTokensDetails": [{"modality": "TEXT", "tokenCount": prompt}],
        }
        if response.cache_usage[1]:
            usage["cachedContentTokenCount"] = response.cache_usage[1]
        if thoughts:
            usage["thoughtsTokenCount"] = thoughts
        return usage

    def _head(self, model: str) -> dict[str, Any]:
        return {"modelVersion": model, "responseId": f"fake-gemini-{len(self.requests)}"}

    def _calls(self, response: FakeResponse, signed: bool) -> list[dict[str, Any]]:
        calls = []
        for index, (name, arguments) in enumerate(response.chat_tool_calls()):
            call = {"name": name, "args": json.loads(arguments or "{}")}
            part: dict[str, Any] = {"functionCall": call}
            if signed and index == 0:
                part["thoughtSignature"] = self._sign()
            calls.append(part)
        return calls

    def _thought(self, payload: Mapping[str, Any], response: FakeResponse) -> list[dict[str, Any]]:
        thinking = (payload.get("generationConfig") or {}).get("thinkingConfig") or {}
        if self._thinks(payload) and thinking.get("includeThoughts") and response.thinking:
            return [{"text": response.thinking, "thought": True}]
        return []

    def _finish_reason(self, response: FakeResponse) -> str:
        return response.stop_reason or "STOP"

    def _blocked(self, response: FakeResponse, model: str) -> dict[str, Any] | None:
        reason = response.stop_reason or ""
        if not reason.startswith(_PROMPT_BLOCKED):
            return None
        feedback = {"blockReason": reason.removeprefix(_PROMPT_BLOCKED)}
        usage = self._usage_metadata(response, final=False)
        return {"promptFeedback": feedback, "usageMetadata": usage, **self._head(model)}

    def _answer(
        self, payload: Mapping[str, Any], response: FakeResponse, model: str
    ) -> dict[str, Any]:
        blocked = self._blocked(response, model)
        if blocked is not None:
            return blocked
        reason = self._finish_reason(response)
        candidate: dict[str, Any] = {"finishReason": reason, "index": 0}
        if reason in _FILTERED:
            candidate["safetyRatings"] = [_BLOCKED_RATING]
        else:
            thinks = self._thinks(payload)
            calls = self._calls(response, thinks)
            parts = self._thought(payload, response)
            answer = [{"text": response.text}] if response.text else [{"text": ""}]
            if thinks and not calls:
                answer[-1]["thoughtSignature"] = self._sign()
            if response.text or not calls:
                parts += answer
            candidate["content"] = {"role": "model", "parts": parts + calls}
        usage = self._usage_metadata(response)
        return {"candidates": [candidate], "usageMetadata": usage, **self._head(model)}

    async def _stream(
        self,
        writer: asyncio.StreamWriter,
        payload: Mapping[str, Any],
        response: FakeResponse,
        model: str,
    ) -> bool:
        head = self._head(model)
        error = _chunk({"error": dict(response.in_band_error or {})})
        blocked = self._blocked(response, model)
        if blocked is not None:
            return await self._send_events(
                writer, response, [], error_event=error, done_event=_chunk(blocked), first_content=0
            )
        thinks = self._thinks(payload)
        reason = self._finish_reason(response)
        thought = self._thought(payload, response)
        pieces = [thought] if thought else []
        pieces += [[{"text": piece}] for piece in response.pieces()]
        calls = self._calls(response, thinks) if reason not in _FILTERED else []
        pieces += [[call] for call in calls]
        early = self._usage_metadata(response, final=False)
        events = [
            _chunk({"candidates": [{"content": {"role": "model", "parts": parts}, "index": 0}],
                    "usageMetadata": early, **head})
            for parts in pieces
        ]  # fmt: skip
        last: dict[str, Any] = {"finishReason": reason, "index": 0}
        if reason in _FILTERED:
            last["safetyRatings"] = [_BLOCKED_RATING]
        else:
            ending: dict[str, Any] = {"text": ""}
            if thinks and not calls:
                ending["thoughtSignature"] = self._sign()
            last["content"] = {"role": "model", "parts": [ending]}
        usage = self._usage_metadata(response)
        done = _chunk({"candidates": [last], "usageMetadata": usage, **head})
        return await self._send_events(
            writer, response, events, error_event=error, done_event=done, first_content=0
        )

    # -- Anthropic's models -------------------------------------------------------------------

    async def _anthropic(
        self,
        writer: asyncio.StreamWriter,
        payload: Any,
        response: FakeResponse,
        model: str,
        call: str,
    ) -> bool:
        problem = None
        if not isinstance(payload, dict):
            problem = "the body is not a JSON object"
        elif "model" in payload:
            problem = "model: Extra inputs are not permitted (the URL names the model)"
        elif not isinstance(payload.get("anthropic_version"), str):
            # "vertex-2023-10-16" in Google's documents; the anthropic SDK sends its own
            # API version.
            problem = "anthropic_version: Field required"
        elif bool(payload.get("stream")) != (call == "streamRawPredict"):
            problem = "stream: true goes to :streamRawPredict, and only there"
        if problem is not None:
            await self._error(writer, 400, "invalid_request_error", problem)
            return True
        body = {k: v for k, v in payload.items() if k != "anthropic_version"}
        return await self._answer_messages(writer, {**body, "model": model}, response)


class FakeGoogleTokenServer:
    """Google's OAuth 2.0 token endpoint on ``127.0.0.1``, in a thread of its own (so a
    client refreshing synchronously, as google-auth does at startup, is answered even when
    it blocks the event loop).

    `service_account_info()` makes a service account with a fresh RSA key whose
    ``token_uri`` is this server's (write it to a file for `VertexChatClient`); the server
    checks each assertion's signature, issuer, audience and expiry, and answers a token
    valid for `expires_in` seconds (`issued`, in order; ``token in server`` tells whether
    this server issued it). While `refusing` holds an OAuth error code (``invalid_grant``),
    every request is refused with it, as Google refuses a revoked or expired key.
    """

    def __init__(self, *, expires_in: int = 3600, host: str = "127.0.0.1", port: int = 0) -> None:
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("the fake server listens on loopback only")
        self.expires_in = expires_in
        self.refusing: str | None = None
        self.issued: list[str] = []
        self.requests = 0
        self._address = (host, port)
        self._keys: dict[str, tuple[str, Any]] = {}  # key id -> (client email, public key)
        self._changed = threading.Condition()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def token_uri(self) -> str:
        if self._server is None:
            raise RuntimeError("the server is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/token"

    def __contains__(self, token: object) -> bool:
        return token in self.issued

    def service_account_info(
        self, *, client_email: str = "fake@fake-project.iam.gserviceaccount.com"
    ) -> dict[str, str]:
        """A service account's key file contents, its key made now and known to this server."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        key_id = uuid.uuid4().hex
        self._keys[key_id] = (client_email, key.public_key())
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()
        return {
            "type": "service_account",
            "project_id": "fake-project",
            "private_key_id": key_id,
            "private_key": pem,
            "client_email": client_email,
            "client_id": "1",
            "auth_uri": "https://accounts.google.com/o/oauth2/auth",
            "token_uri": self.token_uri,
        }

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                form = urllib.parse.parse_qs(self.rfile.read(length).decode())
                status, body = fake._answer(form)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: tests read what was asked from the server's counts

        self._server = ThreadingHTTPServer(self._address, Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)

    async def wait_for_requests(self, count: int = 1, within: float = 60.0) -> None:
        """Return once at least `count` token requests have arrived (`TimeoutError` after
        `within` seconds: a bound, not a pace)."""

        def wait() -> bool:
            with self._changed:
                return self._changed.wait_for(lambda: self.requests >= count, within)

        if not await asyncio.to_thread(wait):
            raise TimeoutError(f"{self.requests} token requests, not {count}")

    # -- the endpoint -------------------------------------------------------------------------

    def _answer(self, form: Mapping[str, list[str]]) -> tuple[int, dict[str, Any]]:
        with self._changed:
            self.requests += 1
            try:
                if self.refusing is not None:
                    raise ValueError(self.refusing)
                if form.get("grant_type") != ["urn:ietf:params:oauth:grant-type:jwt-bearer"]:
                    raise ValueError("unsupported_grant_type")
                self._verify((form.get("assertion") or [""])[0])
            except ValueError as exc:  # a request the API would refuse: its words
                return 400, {"error": str(exc), "error_description": "refused by the fake"}
            finally:
                self._changed.notify_all()
            token = f"ya29.fake-{len(self.issued)}-{uuid.uuid4().hex}"
            self.issued.append(token)
            answer = {"access_token": token, "expires_in": self.expires_in, "token_type": "Bearer"}
            return 200, answer

    def _verify(self, assertion: str) -> None:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        def decoded(segment: str) -> bytes:
            return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))

        try:
            head, claims, signature = assertion.split(".")
            header = json.loads(decoded(head))
            payload = json.loads(decoded(claims))
            email, key = self._keys[header["kid"]]
            signed = f"{head}.{claims}".encode()
            key.verify(decoded(signature), signed, padding.PKCS1v15(), hashes.SHA256())
        except (ValueError, KeyError, TypeError, InvalidSignature):
            raise ValueError("invalid_grant") from None
        # google-auth names Google's token endpoint as the audience whatever the URI is.
        audience = payload.get("aud")
        if payload.get("iss") != email or audience not in (self.token_uri, _GOOGLE_TOKEN_URI):
            raise ValueError("invalid_grant")
        if not isinstance(payload.get("exp"), int) or payload["exp"] < time.time():
            raise ValueError("invalid_grant")
