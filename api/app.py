"""The FailBench-Ray REST API: submit experiments and sweeps to the SQL queue, follow them, read
their results. Dispatchers (see `service.dispatcher`) run what is queued.

`create_app(settings, db)` builds the app from one router per resource (`api/routers/`);
`failbench serve` runs it under uvicorn together with the dispatchers. Request bodies are the
CLI's own spec models, so a file that `failbench run` accepts is a body this API accepts.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError

from api import openapi, schemas
from api.metrics import Metrics
from api.middleware import BodyLimit, Deadline, Timed
from api.offload import Offload
from api.responses import FiniteJSONResponse
from api.routers import experiments, service, sweeps
from api.settings import Settings
from failbench_ray.errors import DatabaseError, FailBenchError, Overloaded
from failbench_ray.storage.db import Database

log = logging.getLogger("failbench.api")

API_VERSION = "v1"


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": schemas.Error, "description": text}
    for code, text in [
        (401, "Missing or wrong bearer token"),
        (404, "No such experiment or sweep"),
        (409, "Not allowed in the current state, or an Idempotency-Key reused"),
        (413, "Request body over the cap"),
        (503, "The database is unavailable, or the request ran past the server's deadline"),
    ]
}


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    # anyio's default of 40 threads, on a couple of cores, only queues requests behind each
    # other's GIL and SQLite locks, and outgrows the connection pool
    anyio.to_thread.current_default_thread_limiter().total_tokens = app.state.settings.threads
    app.state.health_threads = anyio.CapacityLimiter(2)  # /healthz queues behind nothing
    try:
        yield
    finally:
        app.state.compute.close()  # a stop does not wait for a simulation to end


async def _ours(request: Request, err: Exception) -> JSONResponse:
    # One tree (failbench_ray/errors.py): each error says its status (404 not found, 409
    # conflict, 503 database unavailable, ...), as it says the CLI's exit code.
    assert isinstance(err, FailBenchError)
    if isinstance(err, DatabaseError):
        return await _database_down(request, err)
    retry = {"Retry-After": "2"} if isinstance(err, Overloaded) else None
    return JSONResponse({"detail": str(err)}, err.http_status, headers=retry)


async def _invalid(_: Request, err: Exception) -> JSONResponse:
    # FastAPI's own handler renders the input it echoes with plain JSON, which has no NaN:
    # `{"world_size": NaN}` became a 500. Same shape, rendered finite.
    # A container is not echoed back: it may be the whole body, or nested hundreds deep.
    assert isinstance(err, RequestValidationError)
    errors = [
        {**e, "input": type(e["input"]).__name__} if isinstance(e.get("input"), dict | list) else e
        for e in err.errors()
    ]
    return FiniteJSONResponse(
        {"detail": jsonable_encoder(errors)}, status.HTTP_422_UNPROCESSABLE_CONTENT
    )


async def _database_down(_: Request, err: Exception) -> JSONResponse:
    # The driver's message names the database's host, port and name: the operator's log has
    # it, an unauthenticated reader does not.
    log.warning("database unavailable: %s", str(err).splitlines()[0] if str(err) else err)
    return JSONResponse(
        {"detail": "the database is unavailable; retry shortly"},
        status.HTTP_503_SERVICE_UNAVAILABLE,
        headers={"Retry-After": "2"},
    )


def create_app(settings: Settings, db: Database) -> FastAPI:
    app = FastAPI(
        lifespan=_lifespan,
        responses=_ERRORS,
        default_response_class=FiniteJSONResponse,
        title="FailBench-Ray",
        version=API_VERSION,
        description="Queue fault-tolerance experiments and sweeps; follow them; read results.",
    )
    # what the routes' dependencies hand them (api/deps.py)
    app.state.settings = settings
    app.state.db = db
    app.state.metrics = metrics = Metrics(db)
    app.state.compute = Offload(
        settings.compute_workers,
        settings.request_timeout_s,
        "FAILBENCH_COMPUTE_WORKERS",
        warm=("failbench_ray.recommend", "failbench_ray.storage.repo", "failbench_ray.catalog"),
    )
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    # the backstop: the compute workers' own deadline (the same) answers first, more clearly
    app.add_middleware(Deadline, seconds=settings.request_timeout_s + 1.0)
    app.add_middleware(Timed, metrics=metrics)
    app.add_exception_handler(FailBenchError, _ours)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(OperationalError, _database_down)
    routers = (experiments.router, sweeps.router, service.router)
    for router in routers:
        app.include_router(router)
    openapi.install(app, settings, routers)  # each route's `security` as api/auth.py decides
    return app
