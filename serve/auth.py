"""The keys: `--api-key` guards the inference routes and `--admin-api-key` the admin ones. Routers
declare these as dependencies, so `openapi.json` shows the bearer scheme and no route can forget
it.

Admin routes flip layouts, attach storage backends and flush caches, so they are off unless the
server has an admin key, or the operator starts it with `--allow-insecure-admin`. Either way they
answer only to requests whose `Host` (and `Origin`, when a browser sends one) is one of
`--allowed-hosts`, which closes DNS rebinding and cross-site requests, and take only JSON
bodies, which a cross-site form cannot send without a preflight.
"""

from __future__ import annotations

import hmac
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from serve.errors import APIError
from serve.state import ServerState, server

_bearer = HTTPBearer(auto_error=False)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
State = Annotated[ServerState, Depends(server)]


def _matches(credentials: HTTPAuthorizationCredentials | None, key: str) -> bool:
    # Constant time: the compare must not tell a caller how much of a guess was right.
    return credentials is not None and hmac.compare_digest(
        credentials.credentials.encode(), key.encode()
    )


def require_api_key(state: State, credentials: Credentials) -> None:
    if state.config.api_key is not None and not _matches(credentials, state.config.api_key):
        raise APIError(401, "missing or wrong API key", None, "authentication_error")


def _forbidden(message: str) -> APIError:
    return APIError(403, message, None, "permission_error")


def _hostname(authority: str) -> str:
    """`Host`'s name without its port; `[::1]:8000` -> `::1`."""
    return (urlsplit(f"//{authority}").hostname or "").lower()


def require_admin(request: Request, state: State, credentials: Credentials) -> None:
    admin_key = state.config.admin_api_key
    if admin_key is not None:
        if not _matches(credentials, admin_key):
            raise APIError(401, "missing or wrong admin API key", None, "authentication_error")
    elif not state.config.allow_insecure_admin:
        raise _forbidden(
            "admin routes are disabled: start the server with --admin-api-key KEY (or, on a "
            "trusted network only, --allow-insecure-admin)"
        )
    allowed = state.admin_hosts()
    if "*" not in allowed:
        host = _hostname(request.headers.get("host", ""))
        if host not in allowed:
            raise _forbidden(f"Host: {host!r} is not one of --allowed-hosts")
        origin = request.headers.get("origin")
        if origin is not None and (urlsplit(origin).hostname or "").lower() not in allowed:
            raise _forbidden(f"Origin: {origin!r} is not one of --allowed-hosts")
    has_body = request.headers.get("content-length", "0") != "0" or (
        "transfer-encoding" in request.headers
    )
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if (has_body or kind) and kind != "application/json":
        message = f"Content-Type: admin routes take application/json, got {kind!r}"
        raise APIError(415, message, None, "invalid_request_error")
