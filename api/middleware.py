"""Plain ASGI middleware: the body-size cap and the latency histogram (Starlette's
`@app.middleware("http")` would add a task and two streams per request)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import status
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.metrics import Metrics

log = logging.getLogger("failbench.api")


async def send_detail(send: Send, code: int, detail: str, retry_after: int | None = None) -> None:
    """A whole JSON answer `{"detail": ...}` from a middleware (no app to render it)."""
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


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
        detail = (
            f"request body over the cap max_body_bytes={self.limit} (raise "
            "FAILBENCH_MAX_BODY_BYTES)"
        )
        await send_detail(send, status.HTTP_413_CONTENT_TOO_LARGE, detail)


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


class Deadline:
    """Answer 503 to a request the app has not begun to answer within `seconds`.

    Route work runs in threads, which cannot be stopped; its cost is bounded elsewhere (the
    caps, the database's timeouts, the compute workers' deadline). This bounds what a client
    waits: the work goes on unseen and whatever it then answers is dropped. A write cut off so
    may still commit: the 503 says so, and `Idempotency-Key` makes the retry safe."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app, self.seconds = app, seconds
        self._unseen: set[asyncio.Task[None]] = set()  # strong references until they end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, cut = False, False

        async def guarded(message: Message) -> None:
            nonlocal started
            if cut:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        task = asyncio.ensure_future(self.app(scope, receive, guarded))
        try:
            await asyncio.wait_for(asyncio.shield(task), self.seconds)
            return
        except asyncio.CancelledError:  # the server's own stop gave up on it: so do we
            cut = True
            task.cancel()
            raise
        except TimeoutError:
            if started:  # mid-answer: let it finish, it is on its way
                await task
                return
        cut = True
        self._unseen.add(task)
        task.add_done_callback(self._ended)
        log.warning(
            "%s %s ran past the %g s deadline: answered 503",
            scope["method"],
            scope["path"],
            self.seconds,
        )
        write = scope["method"] not in ("GET", "HEAD", "OPTIONS")
        detail = (
            f"the request ran past the server's deadline of {self.seconds:g} s "
            "(FAILBENCH_REQUEST_TIMEOUT_S); retry shortly"
            + (
                ": it may still take effect, so retry with the same Idempotency-Key"
                if write
                else ""
            )
        )
        await send_detail(send, status.HTTP_503_SERVICE_UNAVAILABLE, detail, retry_after=2)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._unseen.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "a request answered 503 at its deadline then failed", exc_info=task.exception()
            )
