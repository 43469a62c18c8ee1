"""The OpenAPI schema says who may call each route, as this server decides it.

FastAPI marks every route whose dependencies read the bearer header as needing it; but reads
are open on loopback, and with no token configured (loopback only) so are writes. A client
generated from the plain schema would send a token nobody asked for, or demand one the
operator never set. This sets each operation's `security` from the same rule `api/auth.py`
applies: required (`[{"HTTPBearer": []}]`), optional (`[{}, {"HTTPBearer": []}]`) or none.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute

from api.auth import require_reader, require_writer
from api.settings import Settings

BEARER: dict[str, list[str]] = {"HTTPBearer": []}


def _who(route: APIRoute) -> str | None:
    calls = {d.call for d in route.dependant.dependencies}
    if require_writer in calls:
        return "writer"
    if require_reader in calls:
        return "reader"
    return None


def security_of(who: str | None, settings: Settings) -> list[dict[str, Any]]:
    """What `api/auth.py` asks of a caller, as an OpenAPI security requirement."""
    if who is None or settings.api_token is None:
        return []  # no token configured: `serve` allows that on loopback only
    if who == "reader" and settings.loopback:
        return [{}, BEARER]  # open on loopback; a token is accepted
    return [BEARER]


def install(app: FastAPI, settings: Settings, routers: Iterable[APIRouter]) -> None:
    """`routers`: those the app includes (their routes carry the dependencies)."""
    generate = app.openapi  # FastAPI's own (it caches its result in app.openapi_schema)
    routes = [r for router in routers for r in router.routes]

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = generate()
            for route in routes:
                if not isinstance(route, APIRoute) or not route.include_in_schema:
                    continue
                for method in route.methods or ():
                    op = doc["paths"].get(route.path_format, {}).get(method.lower())
                    if op is not None:
                        op["security"] = security_of(_who(route), settings)
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
