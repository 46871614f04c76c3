"""Google credentials for Vertex AI, through google-auth: loading them (a credentials file,
or Application Default Credentials) and bearer tokens refreshed before they expire.

google-auth's transports are synchronous: a refresh runs in a worker thread, never on the
event loop. Tokens, keys and the token endpoint's answers never reach errors or logs.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import math
import os
from typing import TYPE_CHECKING, Any, cast

from pipeline.errors import FailureKind, ProviderError, provider_error

if TYPE_CHECKING:
    from google.auth.credentials import Credentials

__all__ = [
    "CLOUD_PLATFORM_SCOPE",
    "GoogleTokens",
    "load_credentials",
    "refusal",
]

CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
REFRESH_AHEAD = 300.0
"""Seconds before a token expires when a refresh starts, in the background: the requests
meanwhile go with the token they have."""
MIN_VALIDITY = 30.0
"""Seconds of validity below which a request waits for a new token."""
TOKEN_TIMEOUT = 10.0
"""Seconds one call to the token endpoint may take."""

_logger = logging.getLogger("chat_pipeline.providers")


def _google_auth() -> Any:
    try:
        import google.auth
        import google.auth.transport.requests
    except ImportError:
        raise ValueError(
            "Vertex AI needs google-auth: pip install 'chat-pipeline[vertex]'"
        ) from None
    return google.auth


def load_credentials(path: str | None) -> Credentials:
    """The credentials in the file at `path` (a service account key, or an authorized
    user's, each read by its own loader, as google-auth asks of files from elsewhere), or
    Application Default Credentials when `path` is None, scoped to Cloud Platform.

    Raises `ValueError` saying what is missing, naming the file but never quoting it.
    """
    google_auth = _google_auth()
    from google.auth.exceptions import DefaultCredentialsError

    if path is None:
        try:
            credentials, _ = google_auth.default(scopes=[CLOUD_PLATFORM_SCOPE])
        except (DefaultCredentialsError, ValueError) as exc:
            raise ValueError(
                "no Google credentials were found (Application Default Credentials: "
                f"{type(exc).__name__}): set credentials_file, or "
                "GOOGLE_APPLICATION_CREDENTIALS, or run `gcloud auth application-default login`"
            ) from None
        return cast("Credentials", credentials)
    if not os.path.isfile(path):
        raise ValueError(f"the credentials file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as file:
            info = json.load(file)
        kind = info.get("type") if isinstance(info, dict) else None
        if kind == "service_account":
            from google.oauth2 import service_account

            loaded: Any = service_account.Credentials.from_service_account_info(  # type: ignore[no-untyped-call]
                info, scopes=[CLOUD_PLATFORM_SCOPE]
            )
            return cast("Credentials", loaded)
        if kind == "authorized_user":
            from google.oauth2 import credentials as user

            loaded = user.Credentials.from_authorized_user_info(  # type: ignore[no-untyped-call]
                info, scopes=[CLOUD_PLATFORM_SCOPE]
            )
            return cast("Credentials", loaded)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"the credentials file {path} holds no credentials google-auth can use "
            f"({type(exc).__name__})"
        ) from None
    raise ValueError(
        f"the credentials file {path} is not a service account key or an authorized user's "
        "credentials (other kinds: through Application Default Credentials)"
    )


def refusal(exc: BaseException) -> str | None:
    """Why the token endpoint refused the credentials (its OAuth error code, such as
    ``invalid_grant``), or None when `exc` is no refusal (the endpoint could not be reached,
    or failed: worth trying again)."""
    from google.auth.exceptions import RefreshError

    if not isinstance(exc, RefreshError) or exc.retryable:
        return None
    details = exc.args[1] if len(exc.args) > 1 else None
    code = details.get("error") if isinstance(details, dict) else None
    return code if isinstance(code, str) and code.isidentifier() else "refused"


class _Bounded:
    """google-auth's requests transport, each call bounded by `timeout` seconds."""

    __slots__ = ("_request", "_timeout")

    def __init__(self, timeout: float) -> None:
        import google.auth.transport.requests

        self._request = google.auth.transport.requests.Request()
        self._timeout = timeout

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("timeout", self._timeout)
        return self._request(*args, **kwargs)


class GoogleTokens:
    """The bearer tokens of one client's `credentials`.

    A request takes the current token; once less than `REFRESH_AHEAD` seconds remain, a
    refresh starts in the background (one at a time) and requests keep the current token;
    only without a token, or with less than `MIN_VALIDITY` seconds left, does a request
    wait for the refresh. A refused refresh is an `AuthenticationError`, an unreachable
    token endpoint a `TransientProviderError`, both naming no secret.
    """

    __slots__ = ("_credentials", "_provider", "_request", "_task", "_watched")

    def __init__(self, credentials: Credentials, provider: str) -> None:
        _google_auth()
        self._credentials = credentials
        self._provider = provider
        self._request = _Bounded(TOKEN_TIMEOUT)
        self._task: asyncio.Task[None] | None = None
        self._watched: asyncio.Task[None] | None = None

    def _remaining(self) -> float | None:
        """Seconds the current token stays valid (None: there is none)."""
        credentials = self._credentials
        if not credentials.token:
            return None
        expiry = credentials.expiry
        if expiry is None:
            return math.inf
        now = datetime.datetime.now(datetime.UTC)
        if expiry.tzinfo is None:  # google-auth keeps naive UTC times
            now = now.replace(tzinfo=None)
        return float((expiry - now).total_seconds())

    def refresh_now(self) -> None:
        """Refresh in this thread, raising what google-auth raised (for a check at
        startup)."""
        self._credentials.refresh(self._request)  # type: ignore[no-untyped-call]

    async def authorization(self) -> str:
        """The ``Authorization`` header's value for a request now."""
        remaining = self._remaining()
        if remaining is None or remaining < MIN_VALIDITY:
            try:
                # Shielded: a request cancelled meanwhile leaves the refresh to the others.
                await asyncio.shield(self._refreshing())
            except Exception as exc:
                raise self._error(exc) from exc
        elif remaining < REFRESH_AHEAD:
            task = self._refreshing()
            if task is not self._watched:
                # Nobody waits for it: a failure is reported when it ends.
                self._watched = task
                task.add_done_callback(self._report)
        return f"Bearer {self._credentials.token}"

    def _refreshing(self) -> asyncio.Task[None]:
        """The refresh under way in this loop, or a new one."""
        task = self._task
        loop = asyncio.get_running_loop()
        if task is None or task.done() or task.get_loop() is not loop:
            task = self._task = loop.create_task(self._refresh())
        return task

    async def _refresh(self) -> None:
        await asyncio.to_thread(self._credentials.refresh, self._request)

    def _report(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            # The current token is still good: a warning, and the next request tries again.
            error = self._error(exc)
            _logger.warning(
                "refreshing the Google access token of %s failed: %s (%s)",
                self._provider,
                error,
                error.code,
            )

    def _error(self, exc: BaseException) -> ProviderError:
        code = refusal(exc)
        if code is not None:
            return provider_error(
                FailureKind.AUTHENTICATION,
                "Google refused the credentials",
                provider=self._provider,
                code=code,
            )
        return provider_error(
            FailureKind.TRANSIENT,
            f"no Google access token: {type(exc).__name__}",
            provider=self._provider,
            code="token_unavailable",
        )
