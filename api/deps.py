"""What the routes take from the app, as `Annotated` dependencies: the database, the settings,
the metrics, the compute workers, and who may call (`Reader`, `Writer`).

They are `async` and do no I/O: a sync dependency would cost each request a trip to the
thread pool. There is no session dependency on purpose: each route does its database work in
one `with db.session()` block, committed before the response goes out (a client reading right
after a 202 sees what it was told; a failed commit is an error, not a 2xx for a lost write),
in one trip to the thread pool."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.auth import require_reader, require_writer
from api.metrics import Metrics
from api.offload import Offload
from api.settings import Settings
from failbench_ray.storage.db import Database


async def _db(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


async def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def _metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


async def _compute(request: Request) -> Offload:
    compute: Offload = request.app.state.compute
    return compute


Db = Annotated[Database, Depends(_db)]
Config = Annotated[Settings, Depends(_settings)]
Meters = Annotated[Metrics, Depends(_metrics)]
Compute = Annotated[Offload, Depends(_compute)]

Reader = [Depends(require_reader)]  # reads: open on loopback, the token elsewhere
Writer = [Depends(require_writer)]  # writes: the token, wherever the service listens
