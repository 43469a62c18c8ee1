"""Who may do what: mutating requests need the bearer token; reads too, off loopback.

The checks are `async`: they do no I/O, and a sync dependency would cost each request a trip
to the thread pool."""

from __future__ import annotations

import hmac

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="FAILBENCH_API_TOKEN")


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def _check(settings: Settings, creds: HTTPAuthorizationCredentials | None) -> None:
    token = settings.api_token
    if token is None:
        return  # only possible on loopback: `serve` refuses other addresses without a token
    given = creds.credentials if creds is not None else ""
    # compare_digest: the time taken does not tell how much of a guess was right
    if not hmac.compare_digest(given.encode(), token.get_secret_value().encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or wrong bearer token: send Authorization: Bearer <FAILBENCH_API_TOKEN>",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def require_writer(
    request: Request, creds: HTTPAuthorizationCredentials | None = Depends(_bearer)
) -> None:
    _check(_settings(request), creds)


async def require_reader(
    request: Request, creds: HTTPAuthorizationCredentials | None = Depends(_bearer)
) -> None:
    settings = _settings(request)
    if not settings.loopback:
        _check(settings, creds)
