"""What the API returns (request bodies are the CLI's own models: ExperimentSpec, SweepSpec)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from failbench_ray.results import ExperimentResult
from failbench_ray.storage.tables import Experiment


class Submitted(BaseModel):
    id: str
    status: str
    created: bool = Field(description="False when the Idempotency-Key named an earlier one.")


class ExperimentSummary(BaseModel):
    id: str
    name: str | None
    status: str
    architecture: str
    mechanism: str
    sweep_id: str | None
    created_at: datetime
    updated_at: datetime
    attempts: int
    cancel_requested: bool
    error: str | None

    @classmethod
    def of(cls, e: Experiment) -> ExperimentSummary:
        return cls(**summary_fields(e))


def summary_fields(e: Experiment) -> dict[str, Any]:
    """A row's fields that a summary shows (and a detail starts with)."""
    return {
        "id": e.id,
        "name": e.name,
        "status": e.status,
        "architecture": e.architecture,
        "mechanism": e.mechanism,
        "sweep_id": e.sweep_id,
        "created_at": e.created_at,
        "updated_at": e.updated_at,
        "attempts": e.attempts,
        "cancel_requested": e.cancel_requested,
        "error": e.error,
    }


class ExperimentPage(BaseModel):
    items: list[ExperimentSummary]
    total: int
    limit: int
    offset: int


class ExperimentDetail(ExperimentSummary):
    spec: dict[str, Any]
    result: ExperimentResult | None = Field(
        None, description="When it has run: the same JSON as `failbench run --json`."
    )


class TrialEvents(BaseModel):
    kind: str
    index: int
    status: str
    failures: list[dict[str, Any]] = Field(description="The recovery timeline, per failure.")
    checkpoints: list[dict[str, Any]] = Field(description="Saves, replications, restores.")


class ExperimentEvents(BaseModel):
    id: str
    status: str
    trials: list[TrialEvents]


class Cancelled(BaseModel):
    id: str
    status: str = Field(description="`cancelled`, or `running` until its dispatcher stops it.")


class SweepCellOut(BaseModel):
    key: str
    architecture: str
    mechanism: str
    trace: str
    status: str
    reason: str | None
    experiment_id: str | None
    experiment_status: str | None


class SweepSubmitted(BaseModel):
    sweep_id: str
    experiments: list[dict[str, str]] = Field(description="Cells queued now: key, experiment id.")
    skipped: list[dict[str, str | None]] = Field(description="Cells not run: key and reason.")


class SweepOut(BaseModel):
    sweep_id: str
    name: str
    status: str
    progress: dict[str, int]
    cells: list[SweepCellOut]


class Health(BaseModel):
    status: str
    database: str
    dispatchers: int


class Error(BaseModel):
    detail: Any = Field(
        description="What is wrong and what to change; for 422 a list of "
        "{loc, msg, type} with the field's path."
    )
