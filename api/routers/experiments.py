"""/v1/experiments: submit (to the SQL queue), list, read, follow and cancel experiments."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Response, status
from fastapi.encoders import jsonable_encoder
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api import schemas
from api.deps import Config, Db, Reader, Writer
from api.responses import check_runnable, json_response, known_id, unprocessable
from failbench_ray.spec import ExperimentSpec
from failbench_ray.storage import queue, repo
from failbench_ray.storage.status import ExperimentStatus
from failbench_ray.storage.tables import Experiment

router = APIRouter(prefix="/v1/experiments", tags=["experiments"])


def _experiment(session: Session, experiment_id: str) -> Experiment:
    missing = repo.ExperimentNotFound(experiment_id)
    return repo.get_experiment(session, known_id(experiment_id, missing))


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=schemas.Submitted,
    dependencies=Writer,
    responses={200: {"model": schemas.Submitted, "description": "Idempotent replay"}},
)
def submit_experiment(
    spec: ExperimentSpec,
    db: Db,
    settings: Config,
    # An empty key is refused, not taken as a key every key-less retry would then share.
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=200)] = None,
) -> Response:
    """Queue an experiment (the same spec as `failbench run` files)."""
    check_runnable(spec, settings, ["body"])
    for attempt in (0, 1):
        try:
            with db.session() as s:
                got = queue.submit(s, spec, idempotency_key=idempotency_key)
            break
        except IntegrityError:  # the same key submitted at the same moment: read it back
            if attempt:
                raise
    body = schemas.Submitted(id=got.experiment_id, status=got.status, created=got.created)
    return json_response(body, status.HTTP_201_CREATED if got.created else status.HTTP_200_OK)


@router.get("", response_model=schemas.ExperimentPage, dependencies=Reader)
def list_experiments(
    db: Db,
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
        raise unprocessable(
            ["query", "status"],
            f"unknown status {status_!r}; one of {', '.join(ExperimentStatus)}",
        )
    with db.session() as s:
        rows, total = repo.page_experiments(
            s,
            status=status_,
            architecture=architecture,
            mechanism=mechanism,
            sweep_id=sweep,
            limit=limit,
            offset=offset,
        )
        items = [schemas.ExperimentSummary.of(e) for e in rows]
        return schemas.ExperimentPage(items=items, total=total, limit=limit, offset=offset)


@router.get("/{experiment_id}", response_model=schemas.ExperimentDetail, dependencies=Reader)
def get_experiment(experiment_id: str, db: Db) -> Response:
    """An experiment's status and, once it has run, its result."""
    with db.session() as s:
        e = _experiment(s, experiment_id)
        result = repo.load_result(s, e.id) if repo.has_trials(s, e.id) else None
        detail = schemas.ExperimentDetail(
            **schemas.summary_fields(e), spec=dict(e.spec), result=result
        )
    return json_response(detail)


@router.get("/{experiment_id}/events", response_model=schemas.ExperimentEvents, dependencies=Reader)
def experiment_events(experiment_id: str, db: Db) -> schemas.ExperimentEvents:
    """The recovery timeline (each failure's phases) and checkpoint events, per trial."""
    with db.session() as s:
        e = _experiment(s, experiment_id)
        out = [
            schemas.TrialEvents(
                kind=t.kind,
                index=t.index,
                status=t.status,
                failures=[jsonable_encoder(f) for f in repo.load_failures(s, t.id)],
                checkpoints=[jsonable_encoder(c) for c in repo.load_checkpoint_events(s, t.id)],
            )
            for t in repo.list_trials(s, e.id)
        ]
        return schemas.ExperimentEvents(id=e.id, status=e.status, trials=out)


@router.post(
    "/{experiment_id}/cancel",
    response_model=schemas.Cancelled,
    status_code=status.HTTP_202_ACCEPTED,
    dependencies=Writer,
)
def cancel_experiment(experiment_id: str, db: Db) -> schemas.Cancelled:
    """Cancel a queued experiment, or stop a running one (and its actors)."""
    with db.session() as s:
        _experiment(s, experiment_id)
        return schemas.Cancelled(id=experiment_id, status=queue.cancel(s, experiment_id))
