"""The service itself: health, Prometheus metrics, the registry, and `recommend` from the costs
this database has measured."""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Query, Request, Response, status
from fastapi.encoders import jsonable_encoder
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api import schemas
from api.deps import Compute, Db, Meters, Reader
from api.responses import unprocessable
from failbench_ray.errors import UsageError
from failbench_ray.recommend import Question, recommend_stored
from failbench_ray.storage import queue, repo
from failbench_ray.storage.db import Database

log = logging.getLogger("failbench.api")
router = APIRouter(tags=["service"])


@lru_cache(maxsize=1)
def _registry() -> dict[str, Any]:
    from failbench_ray.catalog import catalog, matrix

    return jsonable_encoder({**catalog(), "matrix": matrix()}, custom_encoder={type: repr})


@router.get("/v1/recommend", dependencies=Reader, response_model=schemas.Recommendation)
async def recommend_mechanisms(
    question: Annotated[Question, Query()], db: Db, compute: Compute
) -> dict[str, Any]:
    """The applicable mechanisms ranked by expected useful / wall time, with why (the
    same answer as `failbench recommend --json`), from the costs this database measured.
    Seconds of CPU at worst: run by the compute workers, under the request deadline (503)."""
    try:
        answer: dict[str, Any] = await compute.call(recommend_stored, db.url, question)
        return answer
    except UsageError as err:
        raise unprocessable(["query"], str(err)) from None


@router.get("/v1/registry", dependencies=Reader)
def registry() -> dict[str, Any]:
    """Architectures, mechanisms, traces, kill kinds and the applicability matrix."""
    return _registry()


def _dispatchers(db: Database) -> int:
    with db.session() as s:
        repo.ping(s)
        return len(queue.dispatchers(s))


@router.get("/healthz", response_model=schemas.Health)
async def healthz(request: Request, response: Response, db: Db) -> schemas.Health:
    """Liveness and the database's reachability (503 when it is down)."""
    try:
        # threads of its own: health never queues behind other requests' database work
        n = await anyio.to_thread.run_sync(
            _dispatchers, db, limiter=request.app.state.health_threads
        )
    except Exception as err:  # noqa: BLE001  (any failure to reach it is "down")
        # The reason names the database's host, port and name: for the log, not the reader.
        log.warning("healthz: database unavailable: %s", str(err).splitlines()[0])
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        return schemas.Health(status="degraded", database="unavailable", dispatchers=0)
    return schemas.Health(status="ok", database="ok", dispatchers=n)


@router.get("/metrics", include_in_schema=False)
def prometheus(metrics: Meters) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
