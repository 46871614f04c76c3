"""`BedrockChatClient`: Amazon Bedrock's Converse and ConverseStream APIs over HTTP, signed
with AWS Signature Version 4. botocore (the ``bedrock`` extra) provides the credential chain,
the signer and the event-stream parser, nothing else; the codec is `pipeline.wire.bedrock`.
Missing or expired credentials are a `ValueError` when the client is made; how errors and
streams map is in docs/providers.md."""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import struct
import time
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx2
from opentelemetry.semconv._incubating.attributes.gen_ai_attributes import (
    GenAiProviderNameValues,
)

from pipeline.client import check_options
from pipeline.errors import FailureKind, ProviderError, parse_retry_after, provider_error
from pipeline.providers._base import HTTPChatClient, StreamReader
from pipeline.providers._http import DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_TIMEOUT, TransportName
from pipeline.providers._http import endpoint as endpoint_of
from pipeline.types import (
    BEDROCK_EXTRAS,
    ChatOptions,
    ChatResponse,
    Messages,
    as_messages,
)
from pipeline.wire import malformed
from pipeline.wire.bedrock.outbound import (
    ConverseStreamReader,
    build_request,
    error_for,
    parse_response,
)
from pipeline.wire.bedrock.vocab import STREAM_END, STREAM_EXCEPTION_MEMBERS
from pipeline.wire.sse import Payloads, scan_json
from pipeline.wire.tools import custom_tool_names

if TYPE_CHECKING:
    import aiohttp

__all__ = [
    "INSTALL_HINT",
    "BedrockChatClient",
    "EventStreamPayloads",
    "bedrock_url",
    "sigv4_headers",
]

INSTALL_HINT = "pip install 'chat-pipeline[bedrock]'"
_SERVICE = "bedrock"  # the SigV4 signing name of bedrock-runtime
_TIMESTAMP = "%Y%m%dT%H%M%SZ"
# A URL per (model, call shape): bounded, since a request may name its model.
_MAX_DESTINATIONS = 64


def _botocore(module: str) -> ModuleType:
    """A botocore module, or an ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(f"botocore.{module}")
    except ImportError as exc:
        raise ImportError(
            f"BedrockChatClient needs botocore (SigV4, AWS credentials, event streams): "
            f"{INSTALL_HINT}"
        ) from exc


def bedrock_url(region: str) -> str:
    """The Bedrock runtime endpoint of `region`."""
    return f"https://bedrock-runtime.{region}.amazonaws.com"


# -- the event-stream framing -----------------------------------------------------------------


class EventStreamPayloads:
    """A ConverseStream body's events, ``(event type, payload)``, decoded by botocore's
    event-stream parser as the chunks arrive (`pipeline.wire.sse.Payloads`).

    The ``metadata`` event ends a complete stream; an exception or error message is its
    `ProviderError`; a frame botocore refuses (its lengths or checksums) or a payload that
    is not JSON is a malformed-response `ProviderError`. Events before a failure are
    returned first and the failure kept in `failure`, as `SSEPayloads` does.
    """

    __slots__ = ("_buffer", "_parser_errors", "_provider", "done", "failure")

    def __init__(self, provider: str) -> None:
        eventstream = _botocore("eventstream")
        self._buffer = eventstream.EventStreamBuffer()
        # What a frame botocore cannot read raises: its own errors, and the struct and
        # decoding errors of a header it cannot unpack.
        self._parser_errors = (
            eventstream.ParserError,
            KeyError,
            IndexError,
            ValueError,
            TypeError,
            struct.error,
        )
        self._provider = provider
        self.done = False
        self.failure: ProviderError | None = None

    def feed(self, chunk: bytes) -> list[Any]:
        if self.failure is not None:
            raise self.failure
        if self.done:
            return []
        self._buffer.add_data(chunk)
        return self._events()

    def finish(self) -> list[Any]:
        if self.failure is not None:
            raise self.failure
        return []  # a frame still incomplete makes the stream incomplete: the caller says so

    def _events(self) -> list[Any]:
        provider = self._provider
        events: list[Any] = []
        failure: ProviderError | None = None
        try:
            for message in self._buffer:
                if message.prelude.total_length < 16:
                    # No frame is shorter; botocore would read it again and again.
                    raise ValueError("a frame shorter than its prelude")
                headers = message.headers
                kind = headers.get(":message-type")
                if kind == "event":
                    event = headers.get(":event-type")
                    try:
                        # The C scanner, as for server-sent events (bad UTF-8 is a ValueError).
                        body = scan_json(message.payload.decode()) if message.payload else {}
                    except ValueError:
                        failure = malformed(provider, f"a {event} event's payload is not JSON")
                        break
                    events.append((event, body))
                    if event == STREAM_END:
                        self.done = True
                        return events  # what follows the end does not count
                elif kind == "exception":
                    member = headers.get(":exception-type")
                    failure = error_for(
                        STREAM_EXCEPTION_MEMBERS.get(member, member),
                        _message_of(message.payload),
                        provider,
                    )
                    break
                elif kind == "error":
                    failure = error_for(
                        headers.get(":error-code"), headers.get(":error-message"), provider
                    )
                    break
                else:
                    failure = malformed(provider, "an event-stream frame of no known type")
                    break
        except self._parser_errors:
            failure = malformed(provider, "the body is not AWS event-stream framing")
        if failure is not None:
            if not events:
                raise failure
            self.failure = failure
        return events


def _message_of(payload: bytes) -> Any:
    """An exception's ``message`` (read only to classify it, never copied)."""
    try:
        decoded = json.loads(payload)
    except ValueError:
        return None
    return decoded.get("message") if isinstance(decoded, dict) else None


# -- the client -------------------------------------------------------------------------------


class _Signer:
    """SigV4 with botocore's signer, from credentials refreshed off the event loop."""

    def __init__(self, credentials: Any, region: str) -> None:
        self.credentials = credentials
        self.region = region
        self._refreshable = callable(getattr(credentials, "refresh_needed", None))
        self._refreshing: asyncio.Lock | None = None

    async def frozen(self, provider: str) -> Any:
        """The credentials to sign with now: refreshed first (in a thread: a refresh may
        call STS or run a credential process) when they are about to expire."""
        credentials = self.credentials
        try:
            if self._refreshable and credentials.refresh_needed():
                lock = self._refreshing
                if lock is None:
                    lock = self._refreshing = asyncio.Lock()
                async with lock:  # one refresh for every request waiting on it
                    if credentials.refresh_needed():
                        return await asyncio.to_thread(credentials.get_frozen_credentials)
            return credentials.get_frozen_credentials()
        except Exception as exc:  # botocore's, or a credential process's: named by type
            raise provider_error(
                FailureKind.AUTHENTICATION,
                f"the AWS credentials could not be refreshed: {type(exc).__name__}",
                provider=provider,
                code="credentials_refresh_failed",
            ) from exc

    def sign(
        self, url: str, body: bytes, headers: Mapping[str, str], frozen: Any, now: float
    ) -> dict[str, str]:
        """`headers` with the SigV4 headers of a POST of `body` to `url` at `now`."""
        return sigv4_headers("POST", url, body, headers, frozen, self.region, _SERVICE, now)


class _SigningRequest:
    """What botocore's SigV4 signer reads of a request (its ``AWSRequest`` also prepares a
    body and headers for sending, which costs a third of a signature here)."""

    __slots__ = ("body", "context", "headers", "method", "params", "url")

    def __init__(
        self, method: str, url: str, headers: dict[str, str], body: bytes, stamp: str
    ) -> None:
        self.method = method
        self.url = url
        self.headers = headers
        self.body = body
        self.params: dict[str, str] = {}
        self.context = {"timestamp": stamp}


def sigv4_headers(
    method: str,
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    credentials: Any,
    region: str,
    service: str,
    now: float,
) -> dict[str, str]:
    """`headers` with the SigV4 headers (``X-Amz-Date``, ``X-Amz-Security-Token`` for
    temporary credentials, ``Authorization``) of a request signed at `now` by botocore's
    signer (`credentials`: frozen ones, with ``access_key``, ``secret_key``, ``token``).

    botocore's steps are called one by one rather than its ``add_auth``, which reads the
    clock itself and logs the canonical request, session token included, at debug level;
    the request it reads is the few attributes it reads.
    """
    stamp = time.strftime(_TIMESTAMP, time.gmtime(now))
    signing = dict(headers)
    signing["X-Amz-Date"] = stamp
    if credentials.token:
        signing["X-Amz-Security-Token"] = credentials.token
    sent = dict(signing)
    if not any(name.lower() == "host" for name in headers):
        # The Host the HTTP client sends, as botocore reads it from the URL (once per URL:
        # botocore would parse the URL twice per request).
        signing["host"] = _host_of(url)
    request = _SigningRequest(method, url, signing, body, stamp)
    signer = _botocore("auth").SigV4Auth(credentials, service, region)
    canonical = signer.canonical_request(request)
    signature = signer.signature(signer.string_to_sign(request, canonical), request)
    signed = signer.signed_headers(signer.headers_to_sign(request))
    sent["Authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={signer.scope(request)}, "
        f"SignedHeaders={signed}, Signature={signature}"
    )
    return sent


@functools.lru_cache(maxsize=_MAX_DESTINATIONS)
def _host_of(url: str) -> str:
    host: str = _botocore("auth")._host_from_url(url)
    return host


def _credentials(profile: str | None, given: Any) -> tuple[Any, str | None]:
    """The credentials to sign with (`given`, else botocore's chain for `profile`) and the
    region the configuration names, checked: a clear `ValueError` when none are found or
    they have expired and cannot be refreshed."""
    session_module = _botocore("session")
    exceptions = _botocore("exceptions")
    if given is not None:
        where = "the credentials given"
    elif profile:
        where = f"the AWS profile {profile!r}"
    else:
        where = "the environment, the shared AWS files or a role"
    try:
        session = session_module.Session(profile=profile)
        region = session.get_config_variable("region")
        credentials = given if given is not None else session.get_credentials()
    except exceptions.ProfileNotFound:
        raise ValueError(f"the AWS profile {profile!r} is not configured") from None
    except exceptions.BotoCoreError as exc:
        raise ValueError(
            f"AWS credentials could not be loaded from {where}: {type(exc).__name__}"
        ) from exc
    if credentials is None:
        raise ValueError(
            "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "name a profile (profile = ...), or run with a role"
        )
    try:
        frozen = credentials.get_frozen_credentials()
        expired = callable(getattr(credentials, "refresh_needed", None)) and (
            credentials.refresh_needed(0)
        )
    except Exception as exc:
        raise ValueError(
            f"the AWS credentials from {where} are expired and could not be refreshed: "
            f"{type(exc).__name__}"
        ) from exc
    if expired:
        raise ValueError(f"the AWS credentials from {where} are expired")
    if not frozen.access_key or not frozen.secret_key:
        raise ValueError(f"the AWS credentials from {where} are incomplete")
    return credentials, region


class BedrockChatClient(HTTPChatClient):
    """A Converse client for one Bedrock model: a model id (``anthropic.claude-...``,
    ``amazon.nova-pro-v1:0``), an inference profile (``us.anthropic.claude-...``) or an ARN.
    See the module docstring for its failure boundaries.

    `region` is the AWS region (unset: the one the environment or the profile's config
    names); `profile` a named profile of the shared AWS config; `credentials` a botocore
    credentials object to use instead of the chain (``boto3.Session().get_credentials()``).
    `base_url` replaces the region's endpoint (a VPC endpoint, a proxy, a test server; the
    signature is still for `region`). `max_tokens` is sent when a request sets no output
    limit (unset: the model's default). `transport`, `http_client`, `timeout` and the stream
    deadlines are those of every HTTP provider (see `pipeline.providers.openai`).
    """

    provider_name = GenAiProviderNameValues.AWS_BEDROCK.value
    api_name = "Bedrock's Converse API"
    api_key_env = None
    default_base_url = ""
    stream_end_types = frozenset({STREAM_END})
    extras_scope = BEDROCK_EXTRAS

    def __init__(
        self,
        model: str,
        *,
        region: str | None = None,
        profile: str | None = None,
        credentials: Any = None,
        base_url: str | None = None,
        http_client: httpx2.AsyncClient | aiohttp.ClientSession | None = None,
        transport: TransportName | None = None,
        timeout: float | httpx2.Timeout = DEFAULT_TIMEOUT,
        max_tokens: int | None = None,
        default_headers: Mapping[str, str] | None = None,
        first_chunk_timeout: float | None = None,
        stream_idle_timeout: float | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        name: str | None = None,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise ValueError("model must be a non-empty string (a Bedrock model id or ARN)")
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise ValueError("max_tokens must be a positive int or None")
        if profile is not None and (not isinstance(profile, str) or not profile):
            raise ValueError("profile must be a non-empty string or None")
        resolved, configured_region = _credentials(profile, credentials)
        region = region or configured_region
        if not isinstance(region, str) or not region:
            raise ValueError(
                "no AWS region: pass region=, set AWS_REGION, or name one in the profile"
            )
        self.region = region
        self.max_tokens = max_tokens
        self._signer = _Signer(resolved, region)
        self._destinations: dict[tuple[str, bool], tuple[Any, str]] = {}
        super().__init__(
            model,
            api_key=None,
            base_url=base_url or bedrock_url(region),
            http_client=http_client,
            timeout=timeout,
            headers=dict(default_headers or {}),
            first_chunk_timeout=first_chunk_timeout,
            stream_idle_timeout=stream_idle_timeout,
            max_response_bytes=max_response_bytes,
            name=name,
            transport=transport,
        )

    def __repr__(self) -> str:
        return (
            f"BedrockChatClient(model={self.model!r}, region={self.region!r}, "
            f"server={self._metadata.server_address}:{self._metadata.server_port})"
        )

    # -- the format ---------------------------------------------------------------------------

    def _model_of(self, options: ChatOptions | None) -> str:
        return (options.model_id if options else None) or self.model or ""

    def _path(self, model: str, stream: bool) -> httpx2.URL:
        operation = "converse-stream" if stream else "converse"
        # The model id is one path segment: ``:`` and ``/`` (an ARN's) are escaped.
        return self._base_url.join(f"model/{quote(model, safe='')}/{operation}")

    def _chat_url(self) -> httpx2.URL:
        return self._path(self.model or "", False)

    def _destination(self, options: ChatOptions | None, stream: bool) -> tuple[Any, str]:
        key = (self._model_of(options), stream)
        found = self._destinations.get(key)
        if found is None:
            if len(self._destinations) >= _MAX_DESTINATIONS:
                self._destinations.clear()
            url = self._path(key[0], stream)
            found = self._destinations[key] = (self._transport.target(url), endpoint_of(url))
        return found

    async def _signed(self, url: str, body: bytes, headers: dict[str, str]) -> dict[str, str]:
        frozen = await self._signer.frozen(self.provider_name)
        return self._signer.sign(url, body, headers, frozen, time.time())

    def _status_error(
        self, status: int, headers: Mapping[str, str], body: bytes, provider: str, where: str
    ) -> ProviderError:
        # The error's type is the header's first part ("ThrottlingException:http://...").
        error_type = (headers.get("x-amzn-errortype") or "").split(":", 1)[0] or None
        message: Any = None
        try:
            decoded = json.loads(body) if body else None
        except ValueError:
            decoded = None
        if isinstance(decoded, dict):
            message = decoded.get("message") or decoded.get("Message")
            if error_type is None and isinstance(decoded.get("__type"), str):
                error_type = decoded["__type"].rsplit("#", 1)[-1]
        error = error_for(error_type, message, provider, status_code=status, url=where)
        error.retry_after = parse_retry_after(headers.get("retry-after"))
        return error

    def _body(
        self, messages: Messages, options: ChatOptions | None, stream: bool
    ) -> dict[str, Any]:
        options = check_options(options)
        return build_request(
            as_messages(messages),
            options,
            model=self._model_of(options),
            max_tokens=self.max_tokens,
        )

    def _parse_response(self, payload: Any) -> ChatResponse:
        return parse_response(payload, self.provider_name, self.model)

    def _parse_response_for(self, payload: Any, options: ChatOptions | None) -> ChatResponse:
        custom = custom_tool_names(options.tools if options is not None else None)
        return parse_response(payload, self.provider_name, self._model_of(options), custom)

    def _stream_reader(self) -> StreamReader:
        return ConverseStreamReader(self.provider_name, self.model)

    def _stream_reader_for(self, options: ChatOptions | None) -> StreamReader:
        custom = custom_tool_names(options.tools if options is not None else None)
        return ConverseStreamReader(self.provider_name, self._model_of(options), custom)

    def _stream_payloads(self) -> Payloads:
        return EventStreamPayloads(self.provider_name)
