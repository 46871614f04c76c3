"""``/admin/keys``: virtual keys managed over HTTP, for the admin key only (``[gateway]
admin_key_env``; 401 otherwise), as ``chat-pipeline keys`` manages them:

* ``GET /admin/keys``: every key (``{"data": [...]}``), never a secret;
* ``POST /admin/keys``: a new key from ``{"name", "team", "user", "models", "rpm", "tpm",
  "budget": {"limit", "period", "soft"}, "expires_at", "metadata"}``; 201 with its
  ``secret``, shown this once;
* ``GET /admin/keys/{id or name}``, ``PATCH`` it (the fields to change), ``POST
  .../rotate`` (``{"grace": seconds}``: 200 with the new ``secret``), ``POST .../revoke``.

A bad field is 400 naming it, a name another key has 409, an unknown key 404. A change is
seen by this replica at once and by the others within their refresh interval.
"""

from __future__ import annotations

import hmac
import json
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from pipeline.errors import KeyNotFoundError
from pipeline.gateway.wire import error_body
from pipeline.keys._cli import key_fields

if TYPE_CHECKING:
    from pipeline.gateway._governance import Governance

__all__ = ["KeysAdmin", "admitted"]


def admitted(key: bytes | None, request: Request) -> bool:
    """Whether `request` carries the admin `key` (``Authorization: Bearer`` or
    ``x-api-key``, compared in constant time)."""
    if key is None:
        return False
    authorization = request.headers.get("authorization", "")
    token = authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""
    token = token or request.headers.get("x-api-key", "").strip()
    return bool(token) and hmac.compare_digest(token.encode("latin-1", "replace"), key)


def _error(status: int, message: str, code: str) -> Response:
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return Response(
        error_body(message, "invalid_request_error", code),
        status,
        headers=headers,
        media_type="application/json",
    )


def _json(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(data), status, media_type="application/json")


class KeysAdmin:
    """The ``/admin/keys`` endpoints over `governance`'s key store (see the module
    docstring)."""

    def __init__(self, governance: Governance, admin_key: bytes | None) -> None:
        self._governance = governance
        self._admin_key = admin_key

    async def handle(self, request: Request) -> Response:
        if not admitted(self._admin_key, request):
            return _error(401, "missing or invalid admin key", "invalid_api_key")
        store = self._governance.store
        if store is None:
            return _error(404, "virtual keys are off ([keys])", "not_found")
        ref = request.path_params.get("ref")
        action = request.path_params.get("action")
        method = request.method
        try:
            body: dict[str, Any] = {}
            if method in ("POST", "PATCH"):
                raw = await request.body()
                if raw.strip():
                    loaded = json.loads(raw)
                    if not isinstance(loaded, dict):
                        raise ValueError("body: expected a JSON object")
                    body = loaded
            if ref is None:
                if method == "GET":
                    return _json({"data": [key.as_dict() for key in await store.list()]})
                fields = key_fields(body)
                name = fields.pop("name", None)
                if not isinstance(name, str):
                    raise ValueError("name: expected a string")
                issued = await store.create(name, **fields)
                await self._seen()
                return _json({"secret": issued.secret, **issued.key.as_dict()}, 201)
            if action is None and method == "GET":
                return _json((await store.get(ref)).as_dict())
            if action is None and method == "PATCH":
                key = await store.update(ref, **key_fields(body))
                await self._seen()
                return _json(key.as_dict())
            if action == "rotate":
                grace = body.get("grace", 0.0)
                issued = await store.rotate(ref, grace=grace)
                await self._seen()
                return _json({"secret": issued.secret, **issued.key.as_dict()})
            if action == "revoke":
                key = await store.revoke(ref)
                await self._seen()
                return _json(key.as_dict())
            return _error(405, "method not allowed", "method_not_allowed")
        except KeyNotFoundError:
            return _error(404, "no such key", "not_found")
        except ValueError as exc:
            message = str(exc) if not isinstance(exc, json.JSONDecodeError) else "not JSON"
            status = 409 if "another key has it" in message else 400
            return _error(status, message, "conflict" if status == 409 else "invalid_value")
        except TypeError as exc:
            return _error(400, str(exc), "invalid_value")

    async def _seen(self) -> None:
        """This replica applies the change now (the others at their next refresh)."""
        ring = self._governance.ring
        if ring is not None:
            await ring.refresh()
