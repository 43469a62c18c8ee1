"""Plain ASGI middleware: the body-size cap and the latency histogram (Starlette's
`@app.middleware("http")` would add a task and two streams per request)."""

from __future__ import annotations

import json
import time

from fastapi import status
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.metrics import Metrics


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Refuse a request body over `limit` bytes with 413, whether or not it says its length
    (a streamed body is counted as it arrives; whatever the app then answers is replaced)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send)
            return
        seen, over, refused = 0, False, False

        async def counted() -> Message:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    over = True
                    raise _BodyTooLarge
            return message

        async def guarded(message: Message) -> None:
            nonlocal refused
            if not over:
                await send(message)
            elif not refused:  # the app's answer to the cut-off body: ours goes out instead
                refused = True
                await self._refuse(send)

        try:
            await self.app(scope, counted, guarded)
        except _BodyTooLarge:
            if not refused:
                await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            {
                "detail": f"request body over the cap max_body_bytes={self.limit} (raise "
                "FAILBENCH_MAX_BODY_BYTES)"
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status.HTTP_413_CONTENT_TOO_LARGE,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class Timed:
    """Observe each request's latency by method, route and status (a plain ASGI middleware:
    Starlette's `@app.middleware("http")` would add a task and two streams per request)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        code = 500  # what the client gets if the app raises before answering

        async def observed(message: Message) -> None:
            nonlocal code
            if message["type"] == "http.response.start":
                code = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed)
        finally:
            route = scope.get("route")  # the router fills it in on the shared scope
            self.metrics.latency.labels(
                scope["method"], getattr(route, "path", "unmatched"), str(code)
            ).observe(time.perf_counter() - t0)
