"""/v1/sweeps: submit a grid (the `failbench sweep` file) and follow it cell by cell. A sweep
goes through `failbench_ray.sweep` as the CLI's does: the same cells, statuses and shared
baselines; here dispatchers run the cells."""

from __future__ import annotations

from typing import Any, cast

from fastapi import APIRouter, HTTPException, status
from pydantic import ValidationError

from api import schemas
from api.deps import Config, Db, Reader, Writer
from api.responses import check_caps, known_id, no_nul, unprocessable
from api.settings import Settings
from failbench_ray import sweep as sw
from failbench_ray.errors import SpecError
from failbench_ray.spec import ExperimentSpec
from failbench_ray.storage import repo
from failbench_ray.storage.status import CellStatus, cell_counts, cell_status_of, sweep_status_of

router = APIRouter(prefix="/v1/sweeps", tags=["sweeps"])


@router.post(
    "",
    response_model=schemas.SweepSubmitted,
    status_code=status.HTTP_201_CREATED,
    dependencies=Writer,
)
def submit_sweep(sweep: sw.SweepSpec, db: Db, settings: Config) -> schemas.SweepSubmitted:
    """Queue every applicable cell of a grid (the `failbench sweep` file); skipped cells
    come back with their reasons. Submitting the same sweep again queues only what is not
    already queued, running or done."""
    no_nul(sweep)
    size = sweep.grid.size()  # sized before it is expanded: a few KB can name millions of cells
    if size > settings.max_sweep_cells:
        raise unprocessable(
            ["body", "grid"],
            f"{size} cells is over the cap max_sweep_cells={settings.max_sweep_cells} "
            "(FAILBENCH_MAX_SWEEP_CELLS): split the grid into smaller sweeps",
            "cap",
        )
    _check_values(sweep, settings)
    try:
        cells = sw.expand(sweep)
    except SpecError as err:
        raise unprocessable(["body"], str(err), "spec") from None
    for c in cells:
        if c.spec is not None:
            check_caps(c.spec, settings)
    got = sw.enqueue(db, sweep, cells)
    return schemas.SweepSubmitted(
        sweep_id=got.sweep_id,
        experiments=[{"key": k, "experiment_id": i} for k, i in got.queued],
        skipped=[{"key": k, "reason": why} for k, why in got.skipped],
    )


# The spec fields the operator's caps bound (api/responses.py check_caps)
_CAPPED = ("world_size", "steps", "trials", "batch_size", "threads_per_worker", "model")


def _check_values(sweep: sw.SweepSpec, settings: Settings) -> None:
    """Every value a capped field takes (in `base` or on a grid axis) against its cap, before
    any cell is built: building one checks it against its architecture, at a cost that grows
    with the value (a pipeline lists the micro-batch counts that fit a batch of 10^9)."""
    axes = sweep.grid.extra_axes()
    for field in _CAPPED:
        values = axes.get(field, [sweep.base[field]] if field in sweep.base else [])
        for value in values:
            try:
                alone = ExperimentSpec.model_validate({field: value})
            except ValidationError:
                continue  # not a value of the field at all: its cell is skipped, saying why
            try:
                check_caps(alone, settings)
            except HTTPException as err:  # said of the sweep's own field, not a spec's
                (said,) = cast(list[dict[str, Any]], err.detail)
                where = ["body", "grid" if field in axes else "base", field]
                raise unprocessable(where, said["msg"], said["type"]) from None


@router.get("/{sweep_id}", response_model=schemas.SweepOut, dependencies=Reader)
def get_sweep(sweep_id: str, db: Db) -> schemas.SweepOut:
    """A sweep's progress, cell by cell (a cell follows its experiment)."""
    with db.session() as s:
        row = repo.get_sweep(s, known_id(sweep_id, repo.SweepNotFound(sweep_id)))
        statuses = repo.cell_experiment_statuses(s, sweep_id)
        cells = [
            schemas.SweepCellOut(
                key=c.key,
                architecture=c.architecture,
                mechanism=c.mechanism,
                trace=c.trace,
                status=(
                    c.status
                    if c.status == CellStatus.SKIPPED or c.key not in statuses
                    else cell_status_of(statuses[c.key])
                ),
                reason=c.reason,
                experiment_id=c.experiment_id,
                experiment_status=statuses.get(c.key),
            )
            for c in repo.list_sweep_cells(s, sweep_id)
        ]
    progress = cell_counts()
    for cell in cells:
        progress[cell.status] += 1
    return schemas.SweepOut(
        sweep_id=row.id,
        name=row.name,
        status=sweep_status_of(progress, active=True),
        progress=progress,
        cells=cells,
    )
