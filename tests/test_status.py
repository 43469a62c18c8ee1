"""The stored statuses and the one mapping between them (failbench_ray/storage/status.py):
the dispatcher, the API and `failbench sweep` all go through it."""

from __future__ import annotations

import pytest

from failbench_ray.storage.status import (
    CellStatus,
    ExperimentStatus,
    SweepStatus,
    cell_counts,
    cell_status_of,
    parse,
    sweep_status_of,
)


def test_a_status_is_its_stored_word() -> None:
    assert ExperimentStatus.QUEUED == "queued" and f"{ExperimentStatus.QUEUED}" == "queued"
    assert str(CellStatus.SKIPPED) == "skipped"
    assert parse(ExperimentStatus, "cancelled") is ExperimentStatus.CANCELLED
    with pytest.raises(ValueError, match="unknown experiment status 'done'; expected one of: "
                       "queued, running, completed, failed, interrupted, cancelled"):  # fmt: skip
        parse(ExperimentStatus, "done", "experiment status")


@pytest.mark.parametrize(
    ("experiment", "cell"),
    [
        ("queued", CellStatus.PENDING),
        ("running", CellStatus.RUNNING),
        ("completed", CellStatus.COMPLETED),
        ("failed", CellStatus.FAILED),
        ("cancelled", CellStatus.FAILED),
        ("interrupted", CellStatus.FAILED),
    ],
)
def test_a_cell_follows_its_experiment(experiment: str, cell: CellStatus) -> None:
    assert cell_status_of(experiment) is cell


def test_every_experiment_status_maps_to_a_cell_status() -> None:
    assert {cell_status_of(s) for s in ExperimentStatus} <= set(CellStatus)


@pytest.mark.parametrize(
    ("cells", "active", "sweep"),
    [
        ({"pending": 1, "completed": 2}, True, SweepStatus.RUNNING),
        ({"pending": 1, "completed": 2}, False, SweepStatus.INTERRUPTED),
        ({"running": 1, "failed": 1}, True, SweepStatus.RUNNING),
        ({"completed": 2, "failed": 1, "skipped": 3}, True, SweepStatus.FAILED),
        ({"completed": 2, "skipped": 3}, False, SweepStatus.COMPLETED),
        ({"skipped": 3}, True, SweepStatus.COMPLETED),
    ],
)
def test_a_sweep_follows_its_cells(cells: dict[str, int], active: bool, sweep: SweepStatus) -> None:
    assert sweep_status_of({**cell_counts(), **cells}, active=active) is sweep


def test_progress_counts_every_cell_status() -> None:
    assert cell_counts() == {"pending": 0, "running": 0, "completed": 0, "failed": 0, "skipped": 0}
