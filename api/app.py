"""The FailBench-Ray REST API: submit experiments and sweeps to the SQL queue, follow them, read
their results. Dispatchers (see `service.dispatcher`) run what is queued.

`create_app(settings, db)` builds the app; `failbench serve` runs it under uvicorn together with
the dispatchers. Request bodies are the CLI's own spec models, so a file that `failbench run`
accepts is a body this API accepts.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import lru_cache
from typing import Annotated, Any

import anyio
from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request, Response, status
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import schemas
from api.auth import require_reader, require_writer
from api.metrics import Metrics
from api.settings import Settings
from failbench_ray import sweep as sw
from failbench_ray.checks import resolve
from failbench_ray.errors import DatabaseError, FailBenchError, SpecError, UsageError
from failbench_ray.models import param_count
from failbench_ray.recommend import Question, recommend, stored_results
from failbench_ray.spec import ExperimentSpec
from failbench_ray.storage import queue, repo
from failbench_ray.storage.db import Database
from failbench_ray.storage.status import (
    CellStatus,
    ExperimentStatus,
    cell_counts,
    cell_status_of,
    sweep_status_of,
)
from failbench_ray.storage.tables import Experiment, SweepCell, Trial

API_VERSION = "v1"
_BYTES_PER_PARAM = 4 * 3  # fp32 weights + Adam's two moments


class _BodyTooLarge(Exception):
    pass


def _json(model: BaseModel, status_code: int = 200) -> Response:
    """`model` serialised once, by pydantic-core. Returning the model itself would make FastAPI
    validate it against the response model and serialise it again (most of the CPU a small
    request costs). The route's `response_model` still documents the body."""
    return Response(model.model_dump_json(), status_code, media_type="application/json")


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


def _finite_json(obj: Any) -> Any:
    """NaN and infinities (a diverged loss) as null: JSON has no such numbers."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite_json(v) for v in obj]
    return obj


class FiniteJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(_finite_json(content), ensure_ascii=False, separators=(",", ":")).encode()


_ID = re.compile(r"[0-9a-f]{1,32}")


def _known_id(value: str, missing: Exception) -> str:
    """Ids are hex: anything else names nothing (and never reaches the database)."""
    if not _ID.fullmatch(value):
        raise missing
    return value


def _experiment(session: Session, experiment_id: str) -> Experiment:
    return repo.get_experiment(
        session, _known_id(experiment_id, repo.ExperimentNotFound(experiment_id))
    )


def _detail(loc: list[Any], msg: str, kind: str) -> list[dict[str, Any]]:
    return [{"loc": loc, "msg": msg, "type": kind}]


def _unprocessable(loc: list[Any], msg: str, kind: str = "value_error") -> HTTPException:
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, _detail(loc, msg, kind))


def check_caps(spec: ExperimentSpec, settings: Settings) -> None:
    """Raise 422 naming the cap a spec goes over (the operator sets the caps)."""
    state_mb = param_count(spec.model) * _BYTES_PER_PARAM / 1e6
    for field, value, cap, name in [
        ("world_size", spec.world_size, settings.max_world_size, "max_world_size"),
        ("steps", spec.steps, settings.max_steps, "max_steps"),
        ("trials", spec.trials, settings.max_trials, "max_trials"),
        ("model", state_mb, settings.max_state_mb, "max_state_mb"),
    ]:
        if value > cap:
            shown = f"{value:.0f} MB of state" if field == "model" else f"{field}={value}"
            raise _unprocessable(
                ["body", field],
                f"{shown} is over the cap {name}={cap} of this service (FAILBENCH_{name.upper()})",
                "cap",
            )


def _no_nul(model: BaseModel) -> None:
    # PostgreSQL text cannot hold NUL: refuse it here rather than fail in the database
    if "\\u0000" in model.model_dump_json():
        raise _unprocessable(["body"], "strings in a spec may not contain NUL (\\u0000)")


def _check_runnable(spec: ExperimentSpec, settings: Settings, loc: list[Any]) -> None:
    _no_nul(spec)
    check_caps(spec, settings)
    try:
        resolve(spec)  # unknown params, not-applicable pairs: refused now, not at run time
    except SpecError as err:
        raise _unprocessable([*loc, *err.loc], str(err), "spec") from None


@lru_cache(maxsize=1)
def _registry() -> dict[str, Any]:
    from failbench_ray.catalog import catalog, matrix

    return jsonable_encoder({**catalog(), "matrix": matrix()}, custom_encoder={type: repr})


def create_app(settings: Settings, db: Database) -> FastAPI:
    errors: dict[int | str, dict[str, Any]] = {
        code: {"model": schemas.Error, "description": text}
        for code, text in [
            (401, "Missing or wrong bearer token"),
            (404, "No such experiment or sweep"),
            (409, "Not allowed in the current state, or an Idempotency-Key reused"),
            (413, "Request body over the cap"),
            (503, "The database is unavailable"),
        ]
    }

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # anyio's default of 40 threads, on a couple of cores, only queues requests behind
        # each other's GIL and SQLite locks, and outgrows the connection pool
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.threads
        yield

    app = FastAPI(
        lifespan=lifespan,
        responses=errors,
        default_response_class=FiniteJSONResponse,
        title="FailBench-Ray",
        version=API_VERSION,
        description="Queue fault-tolerance experiments and sweeps; follow them; read results.",
    )
    app.state.settings = settings
    app.state.db = db
    metrics = Metrics(db)
    app.state.metrics = metrics
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(Timed, metrics=metrics)

    @app.exception_handler(FailBenchError)
    async def _ours(_: Request, err: Exception) -> JSONResponse:
        # One tree (failbench_ray/errors.py): each error says its status (404 not found,
        # 409 conflict, 503 database unavailable, ...), as it says the CLI's exit code.
        assert isinstance(err, FailBenchError)
        if isinstance(err, DatabaseError):
            return await _db_down(_, err)
        return JSONResponse({"detail": str(err)}, err.http_status)

    @app.exception_handler(OperationalError)
    async def _db_down(_: Request, err: Exception) -> JSONResponse:
        return JSONResponse(
            {"detail": f"the database is unavailable: {str(err).splitlines()[0]}"},
            status.HTTP_503_SERVICE_UNAVAILABLE,
        )

    # Each endpoint does its database work in one `with db.session()` block: committed before
    # the response is sent (a client reading right after a 202 sees what it was told, and a
    # failed commit is an error response, not a 2xx for a lost write), and in one trip to the
    # thread pool (a session dependency would cost two more).
    writer = [Depends(require_writer)]
    reader = [Depends(require_reader)]

    # -- experiments -----------------------------------------------------------------------
    @app.post(
        "/v1/experiments",
        status_code=status.HTTP_201_CREATED,
        response_model=schemas.Submitted,
        dependencies=writer,
        responses={200: {"model": schemas.Submitted, "description": "Idempotent replay"}},
    )
    def submit_experiment(
        spec: ExperimentSpec,
        idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
    ) -> Response:
        """Queue an experiment (the same spec as `failbench run` files)."""
        _check_runnable(spec, settings, ["body"])
        for attempt in (0, 1):
            try:
                with db.session() as s:
                    got = queue.submit(s, spec, idempotency_key=idempotency_key)
                break
            except IntegrityError:  # the same key submitted at the same moment: read it back
                if attempt:
                    raise
        body = schemas.Submitted(id=got.experiment_id, status=got.status, created=got.created)
        return _json(body, status.HTTP_201_CREATED if got.created else status.HTTP_200_OK)

    @app.get("/v1/experiments", response_model=schemas.ExperimentPage, dependencies=reader)
    def list_experiments(
        status_: Annotated[
            str | None, Query(alias="status", description=", ".join(ExperimentStatus))
        ] = None,
        architecture: Annotated[str | None, Query(pattern=r"^\w{1,64}$")] = None,
        mechanism: Annotated[str | None, Query(pattern=r"^\w{1,64}$")] = None,
        sweep: Annotated[str | None, Query(pattern=r"^[0-9a-f]{1,32}$")] = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
        offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
    ) -> schemas.ExperimentPage:
        """Experiments, newest first, filtered and paginated."""
        if status_ is not None and status_ not in set(ExperimentStatus):
            raise _unprocessable(
                ["query", "status"],
                f"unknown status {status_!r}; one of {', '.join(ExperimentStatus)}",
            )
        where = []
        if status_ is not None:
            where.append(Experiment.status == status_)
        if architecture is not None:
            where.append(Experiment.architecture == architecture)
        if mechanism is not None:
            where.append(Experiment.mechanism == mechanism)
        if sweep is not None:
            where.append(Experiment.sweep_id == sweep)
        with db.session() as s:
            total = s.scalar(select(func.count()).select_from(Experiment).where(*where)) or 0
            rows = s.scalars(
                select(Experiment)
                .where(*where)
                .order_by(Experiment.created_at.desc(), Experiment.id.desc())
                .limit(limit)
                .offset(offset)
            )
            items = [schemas.ExperimentSummary.of(e) for e in rows]
            return schemas.ExperimentPage(items=items, total=total, limit=limit, offset=offset)

    @app.get(
        "/v1/experiments/{experiment_id}",
        response_model=schemas.ExperimentDetail,
        dependencies=reader,
    )
    def get_experiment(experiment_id: str) -> Response:
        """An experiment's status and, once it has run, its result."""
        with db.session() as s:
            e = _experiment(s, experiment_id)
            has_trials = s.scalar(select(Trial.id).where(Trial.experiment_id == e.id).limit(1))
            result = repo.load_result(s, e.id) if has_trials is not None else None
            detail = schemas.ExperimentDetail(
                **schemas.summary_fields(e), spec=dict(e.spec), result=result
            )
        return _json(detail)

    @app.get(
        "/v1/experiments/{experiment_id}/events",
        response_model=schemas.ExperimentEvents,
        dependencies=reader,
    )
    def experiment_events(experiment_id: str) -> schemas.ExperimentEvents:
        """The recovery timeline (each failure's phases) and checkpoint events, per trial."""
        with db.session() as s:
            e = _experiment(s, experiment_id)
            trials = s.scalars(
                select(Trial).where(Trial.experiment_id == e.id).order_by(Trial.kind, Trial.index)
            )
            out = [
                schemas.TrialEvents(
                    kind=t.kind,
                    index=t.index,
                    status=t.status,
                    failures=[jsonable_encoder(f) for f in repo.load_failures(s, t.id)],
                    checkpoints=[jsonable_encoder(c) for c in repo.load_checkpoint_events(s, t.id)],
                )
                for t in trials
            ]
            return schemas.ExperimentEvents(id=e.id, status=e.status, trials=out)

    @app.post(
        "/v1/experiments/{experiment_id}/cancel",
        response_model=schemas.Cancelled,
        status_code=status.HTTP_202_ACCEPTED,
        dependencies=writer,
    )
    def cancel_experiment(experiment_id: str) -> schemas.Cancelled:
        """Cancel a queued experiment, or stop a running one (and its actors)."""
        with db.session() as s:
            _experiment(s, experiment_id)
            return schemas.Cancelled(id=experiment_id, status=queue.cancel(s, experiment_id))

    # -- sweeps ----------------------------------------------------------------------------
    @app.post(
        "/v1/sweeps",
        response_model=schemas.SweepSubmitted,
        status_code=status.HTTP_201_CREATED,
        dependencies=writer,
    )
    def submit_sweep(sweep: sw.SweepSpec) -> schemas.SweepSubmitted:
        """Queue every applicable cell of a grid (the `failbench sweep` file); skipped cells
        come back with their reasons. Submitting the same sweep again queues only what is not
        already queued, running or done."""
        _no_nul(sweep)
        try:
            cells = sw.expand(sweep)
        except SpecError as err:
            raise _unprocessable(["body"], str(err), "spec") from None
        if len(cells) > settings.max_sweep_cells:
            raise _unprocessable(
                ["body", "grid"],
                f"{len(cells)} cells is over the cap max_sweep_cells={settings.max_sweep_cells} "
                "(FAILBENCH_MAX_SWEEP_CELLS)",
                "cap",
            )
        for c in cells:
            if c.spec is not None:
                check_caps(c.spec, settings)
        with db.session() as s:
            sweep_id, _ = repo.get_or_create_sweep(
                s,
                name=sweep.name,
                spec=sweep.model_dump(mode="json"),
                spec_hash=sw.spec_hash(cells),
                cells=[
                    repo.NewCell(c.key, c.architecture, c.mechanism, c.trace, c.reason)
                    for c in cells
                ],
            )
            repo.refresh_skipped(s, sweep_id, {c.key: c.reason for c in cells})
            rows = {r.key: r for r in repo.list_sweep_cells(s, sweep_id)}
            queued: list[dict[str, str]] = []
            skipped: list[dict[str, str | None]] = []
            for c in cells:
                row = rows[c.key]
                if c.skipped or c.spec is None:
                    skipped.append({"key": c.key, "reason": c.reason})
                    continue
                live = row.experiment_id is not None and s.scalar(
                    select(Experiment.status).where(Experiment.id == row.experiment_id)
                ) in (ExperimentStatus.QUEUED, ExperimentStatus.RUNNING, ExperimentStatus.COMPLETED)
                if live:
                    continue
                got = queue.submit(s, c.spec, sweep_id=sweep_id)
                repo.set_cell_status(
                    s, sweep_id, c.key, CellStatus.PENDING, experiment_id=got.experiment_id
                )
                queued.append({"key": c.key, "experiment_id": got.experiment_id})
            progress = repo.sweep_progress(s, sweep_id)
            repo.set_sweep_status(s, sweep_id, sweep_status_of(progress, active=True))
        return schemas.SweepSubmitted(sweep_id=sweep_id, experiments=queued, skipped=skipped)

    @app.get(
        "/v1/sweeps/{sweep_id}",
        response_model=schemas.SweepOut,
        dependencies=reader,
    )
    def get_sweep(sweep_id: str) -> schemas.SweepOut:
        """A sweep's progress, cell by cell (a cell follows its experiment)."""
        with db.session() as s:
            row = repo.get_sweep(s, _known_id(sweep_id, repo.SweepNotFound(sweep_id)))
            statuses = dict(
                s.execute(
                    select(SweepCell.key, Experiment.status)
                    .join(Experiment, Experiment.id == SweepCell.experiment_id)
                    .where(SweepCell.sweep_id == sweep_id)
                ).all()
            )
            cells = []
            for c in repo.list_sweep_cells(s, sweep_id):
                exp_status = statuses.get(c.key)
                cells.append(
                    schemas.SweepCellOut(
                        key=c.key,
                        architecture=c.architecture,
                        mechanism=c.mechanism,
                        trace=c.trace,
                        status=(
                            c.status
                            if c.status == CellStatus.SKIPPED or exp_status is None
                            else cell_status_of(exp_status)
                        ),
                        reason=c.reason,
                        experiment_id=c.experiment_id,
                        experiment_status=exp_status,
                    )
                )
        progress = cell_counts()
        for cell in cells:
            progress[cell.status] += 1
        overall = sweep_status_of(progress, active=True)
        return schemas.SweepOut(
            sweep_id=row.id, name=row.name, status=overall, progress=progress, cells=cells
        )

    # -- the rest --------------------------------------------------------------------------
    @app.get("/v1/recommend", dependencies=reader)
    def recommend_mechanisms(question: Annotated[Question, Query()]) -> dict[str, Any]:
        """The applicable mechanisms ranked by expected useful / wall time, with why (the
        same answer as `failbench recommend --json`), from the costs this database measured."""
        try:
            return recommend(question, stored_results(db, limit=500))
        except UsageError as err:
            raise _unprocessable(["query"], str(err)) from None

    # -- the rest --------------------------------------------------------------------------
    @app.get("/v1/registry", dependencies=reader)
    def registry() -> dict[str, Any]:
        """Architectures, mechanisms, traces, kill kinds and the applicability matrix."""
        return _registry()

    @app.get("/healthz", response_model=schemas.Health)
    def healthz(response: Response) -> schemas.Health:
        """Liveness and the database's reachability (503 when it is down)."""
        try:
            with db.session() as s:
                s.execute(text("SELECT 1"))
                n = len(queue.dispatchers(s))
        except Exception as err:  # noqa: BLE001  (any failure to reach it is "down")
            response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
            return schemas.Health(
                status="degraded", database=str(err).splitlines()[0], dispatchers=0
            )
        return schemas.Health(status="ok", database="ok", dispatchers=n)

    @app.get("/metrics", include_in_schema=False)
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
