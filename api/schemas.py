"""What the API returns (request bodies are the CLI's own models: ExperimentSpec, SweepSpec)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from failbench_ray.recommend import Question
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


class Cost(BaseModel):
    value: float
    source: str = Field(description="`default`, or the measured runs it was fitted from.")


class Simulated(BaseModel):
    """The seeded simulator's runs of the job (`simulate_runs` of them)."""

    ettr: float = Field(description="The runs' useful time over their wall time.")
    ci95: float = Field(description="Half-width of its 95% bootstrap interval.")
    job_interval95: tuple[float, float] = Field(
        description="Where one job's ETTR falls: the runs' 2.5th and 97.5th percentiles."
    )
    runs: int
    cut_short: int = Field(description="Runs stopped by the simulation budget before the end.")
    note: str | None = Field(None, description="Why runs were cut short, when some were.")


class Ranked(BaseModel):
    mechanism: str
    ettr: float = Field(description="Expected useful / wall time (Daly's model).")
    simulated: Simulated | None = Field(description="Null when `simulate_runs` is 0.")
    interval_s: float | None = Field(description="Checkpoint interval; null if not periodic.")
    why: str


class Policy(BaseModel):
    """What to set for the top-ranked mechanism."""

    mechanism: str
    checkpoint_interval_s: float | None
    spares: int = Field(description="Spares covering 99% of the repair windows.")
    hang_timeout_s: float
    ettr: float
    ettr_interval95: tuple[float, float] | None = Field(
        description="95% of one job's ETTR (the simulator's runs); null without them."
    )
    why: str


class NotApplicable(BaseModel):
    mechanism: str
    reason: str | None


class Recommendation(BaseModel):
    """`failbench recommend --json`'s answer: the same fields, the same values."""

    question: Question
    job_mtbf_hours: float = Field(description="One worker's MTBF divided by the workers.")
    failures_expected: float = Field(description="Failures in `job_days` of training.")
    state_gb_per_rank: float
    preset: str | None = Field(description="The failure curve's source, when a preset is used.")
    costs: dict[str, Cost] = Field(description="Unit costs: seconds per GB, phase seconds.")
    policy: Policy | None = Field(description="Null when no mechanism applies.")
    ranking: list[Ranked] = Field(description="Applicable mechanisms, highest ETTR first.")
    not_applicable: list[NotApplicable]


class Health(BaseModel):
    status: str
    database: str
    dispatchers: int


class Error(BaseModel):
    detail: Any = Field(
        description="What is wrong and what to change; for 422 a list of "
        "{loc, msg, type} with the field's path."
    )
