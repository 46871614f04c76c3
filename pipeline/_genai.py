"""GenAI semantic-convention attributes shared by the telemetry layer and the routers.

Names come from `opentelemetry-semantic-conventions` constants, never hand-typed strings.
``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental`` switches to the newest names
(``gen_ai.provider.name`` instead of ``gen_ai.system``).
"""

from __future__ import annotations

import os
from typing import Any

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv.attributes.server_attributes import SERVER_ADDRESS, SERVER_PORT
from opentelemetry.trace import Status, StatusCode

__all__ = ["ERROR_STATUS", "client_attributes", "latest_experimental_semconv", "provider_key"]

ERROR_STATUS = Status(StatusCode.ERROR)
"""A failed span's status: no description, since exception messages may quote provider
bodies or prompts. Made once (a Status validates its arguments when built)."""


def latest_experimental_semconv() -> bool:
    """Whether ``OTEL_SEMCONV_STABILITY_OPT_IN`` asks for the newest GenAI conventions."""
    value = os.environ.get("OTEL_SEMCONV_STABILITY_OPT_IN", "")
    return "gen_ai_latest_experimental" in {part.strip() for part in value.split(",")}


def provider_key(latest: bool | None = None) -> str:
    """The attribute naming the provider under the conventions in use."""
    if latest is None:
        latest = latest_experimental_semconv()
    return gen_ai.GEN_AI_PROVIDER_NAME if latest else gen_ai.GEN_AI_SYSTEM


def client_attributes(metadata: Any, key: str) -> dict[str, Any]:
    """Provider, server address and port of a client's metadata (`key` names the
    provider attribute); the model is the caller's to add (it may come per request)."""
    attributes: dict[str, Any] = {}
    if metadata is None:
        return attributes
    if getattr(metadata, "provider_name", None):
        attributes[key] = metadata.provider_name
    if getattr(metadata, "server_address", None):
        attributes[SERVER_ADDRESS] = metadata.server_address
    if getattr(metadata, "server_port", None):
        attributes[SERVER_PORT] = metadata.server_port
    return attributes
