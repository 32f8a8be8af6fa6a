"""The keys: `--api-key` guards the inference routes and `--admin-api-key` the admin ones, which
without a key answer only when the server is bound to loopback. Routers declare these as
dependencies, so `openapi.json` shows the bearer scheme and no route can forget it."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from serve.errors import APIError
from serve.state import ServerState, server

_bearer = HTTPBearer(auto_error=False)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
State = Annotated[ServerState, Depends(server)]


def _matches(credentials: HTTPAuthorizationCredentials | None, key: str) -> bool:
    return credentials is not None and credentials.credentials == key


def require_api_key(state: State, credentials: Credentials) -> None:
    if state.api_key is not None and not _matches(credentials, state.api_key):
        raise APIError(401, "missing or wrong API key", None, "authentication_error")


def require_admin(state: State, credentials: Credentials) -> None:
    if state.admin_key is not None:
        if not _matches(credentials, state.admin_key):
            raise APIError(401, "missing or wrong admin API key", None, "authentication_error")
    elif not state.loopback:
        raise APIError(403, "admin routes need --admin-api-key off loopback", None,
                       "permission_error")  # fmt: skip
