"""The gateway's ``POST /v1/responses``: the `InboundFormat` over the Responses codec
(`pipeline.wire.responses.inbound`); stored responses are `pipeline.gateway._stored_responses`."""

from __future__ import annotations

from pipeline.wire import WireError
from pipeline.wire.responses.inbound import (
    ResponsesEncoder,
    completion,
    new_response_id,
    parse_responses,
)
from pipeline.wire.sse import SSE_HEADERS

__all__ = ["RESPONSES", "Responses"]


class Responses:
    """`InboundFormat` of the Responses API."""

    path = "/v1/responses"
    x_api_key = False
    stream_headers = SSE_HEADERS
    request_id_header: bytes | None = None  # OpenAI's SDKs read x-request-id

    parse = staticmethod(parse_responses)
    new_response_id = staticmethod(new_response_id)
    completion = staticmethod(completion)
    encoder = ResponsesEncoder

    def error_body(self, error: WireError) -> bytes:
        return error.body()


RESPONSES = Responses()
