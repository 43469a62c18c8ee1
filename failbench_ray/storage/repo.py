"""Data access: the few reads and writes the runner, the CLI and the API need.

Every function takes the caller's `Session` and only flushes: the caller owns the transaction
(`Database.session()` commits or rolls back the whole unit of work). Records are converted to
plain Python numbers on the way in, so numpy / torch scalars never reach the driver.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from failbench_ray.errors import ExperimentNotFound, SweepNotFound
from failbench_ray.records import (
    PHASES,
    REFORM_MARKS,
    REFORM_PARTS,
    CheckpointEvent,
    FailureRecord,
    StepRecord,
)
from failbench_ray.results import BaselineResult, ExperimentResult, TrialResult, failure_result
from failbench_ray.storage.status import (
    CellStatus,
    ExperimentStatus,
    SweepStatus,
    TrialStatus,
    cell_counts,
    parse,
)
from failbench_ray.storage.tables import (
    TRIAL_KINDS,
    CheckpointEventRow,
    Experiment,
    RecoveryEventRow,
    StepRecordRow,
    Sweep,
    SweepCell,
    Trial,
    new_id,
    utcnow,
)


def _check(value: str, allowed: Sequence[str], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of: {', '.join(allowed)}")


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _nan_if_none(value: float | None) -> float:
    # SQLite stores NaN as NULL; a diverged loss must come back as NaN, not None.
    return math.nan if value is None else value


# ---------------------------------------------------------------------------------------------
# Experiments


def create_experiment(
    session: Session,
    *,
    spec: dict[str, Any],
    architecture: str,
    mechanism: str,
    name: str | None = None,
    status: ExperimentStatus | str = ExperimentStatus.QUEUED,
    sweep_id: str | None = None,
) -> str:
    """Insert an experiment and return its new id."""
    status = parse(ExperimentStatus, status, "experiment status")
    now = utcnow()
    experiment = Experiment(
        id=new_id(),
        name=name,
        created_at=now,
        updated_at=now,
        status=status,
        architecture=architecture,
        mechanism=mechanism,
        sweep_id=sweep_id,
        spec=spec,
    )
    session.add(experiment)
    session.flush()
    return experiment.id


def get_experiment(session: Session, experiment_id: str) -> Experiment:
    experiment = session.get(Experiment, experiment_id)
    if experiment is None:
        raise ExperimentNotFound(experiment_id)
    return experiment


def find_experiment_id(session: Session, id_or_prefix: str) -> str:
    """The full id of the one experiment whose id is or starts with `id_or_prefix` (tables
    show the first characters, as git shows commits)."""
    if session.get(Experiment, id_or_prefix) is not None:
        return id_or_prefix
    if len(id_or_prefix) < 4:  # too short to mean one experiment
        raise ExperimentNotFound(id_or_prefix)
    stmt = select(Experiment.id).where(Experiment.id.startswith(id_or_prefix, autoescape=True))
    found = list(session.scalars(stmt.limit(2)))
    if len(found) != 1:
        raise ExperimentNotFound(id_or_prefix, ambiguous=len(found) > 1)
    return found[0]


def set_experiment_status(
    session: Session,
    experiment_id: str,
    status: ExperimentStatus | str,
    *,
    error: str | None = None,
) -> None:
    """Move an experiment to `status`; `error` replaces any earlier error (None clears it)."""
    status = parse(ExperimentStatus, status, "experiment status")
    experiment = get_experiment(session, experiment_id)
    experiment.status = status
    experiment.error = error
    experiment.updated_at = utcnow()
    session.flush()


def list_experiments(
    session: Session, *, status: ExperimentStatus | str | None = None, limit: int = 50
) -> list[Experiment]:
    """The most recent experiments first, optionally only those with `status`."""
    stmt = select(Experiment).order_by(Experiment.created_at.desc(), Experiment.id.desc())
    if status is not None:
        status = parse(ExperimentStatus, status, "experiment status")
        stmt = stmt.where(Experiment.status == status)
    return list(session.scalars(stmt.limit(limit)))


def page_experiments(
    session: Session,
    *,
    status: ExperimentStatus | str | None = None,
    architecture: str | None = None,
    mechanism: str | None = None,
    sweep_id: str | None = None,
    limit: int = 50,
    offset: int = 0,
) -> tuple[list[Experiment], int]:
    """One page of the experiments that match every filter given, newest first, and how many
    match in all."""
    where = []
    if status is not None:
        where.append(Experiment.status == parse(ExperimentStatus, status, "experiment status"))
    if architecture is not None:
        where.append(Experiment.architecture == architecture)
    if mechanism is not None:
        where.append(Experiment.mechanism == mechanism)
    if sweep_id is not None:
        where.append(Experiment.sweep_id == sweep_id)
    total = session.scalar(select(func.count()).select_from(Experiment).where(*where)) or 0
    rows = session.scalars(
        select(Experiment)
        .where(*where)
        .order_by(Experiment.created_at.desc(), Experiment.id.desc())
        .limit(limit)
        .offset(offset)
    )
    return list(rows), int(total)


def mark_interrupted(session: Session, experiment_id: str, reason: str) -> None:
    """Close an experiment whose run died (Ctrl-C, lost driver): its running trials too."""
    experiment = get_experiment(session, experiment_id)
    now = utcnow()
    session.execute(
        update(Trial)
        .where(Trial.experiment_id == experiment_id, Trial.status == TrialStatus.RUNNING)
        .values(status=TrialStatus.INTERRUPTED, finished_at=now, error=reason)
    )
    experiment.status = ExperimentStatus.INTERRUPTED
    experiment.error = reason
    experiment.updated_at = now
    session.flush()


def experiment_status(session: Session, experiment_id: str) -> ExperimentStatus | None:
    """An experiment's status; None if there is no such experiment."""
    word = session.scalar(select(Experiment.status).where(Experiment.id == experiment_id))
    return None if word is None else parse(ExperimentStatus, word)


def completed_in_sweep(session: Session, sweep_id: str) -> list[tuple[str, dict[str, Any]]]:
    """(id, spec) of the sweep's completed experiments, oldest first."""
    stmt = (
        select(Experiment.id, Experiment.spec)
        .where(Experiment.sweep_id == sweep_id, Experiment.status == ExperimentStatus.COMPLETED)
        .order_by(Experiment.created_at, Experiment.id)
    )
    return [(i, dict(spec)) for i, spec in session.execute(stmt).all()]


def set_experiment_sweep(session: Session, experiment_id: str, sweep_id: str) -> None:
    """Tag an experiment as run by a sweep (the runner creates it without one)."""
    get_experiment(session, experiment_id).sweep_id = sweep_id
    session.flush()


# ---------------------------------------------------------------------------------------------
# Trials


def create_trial(session: Session, *, experiment_id: str, kind: str, index: int) -> int:
    """Insert a running trial (kind "baseline", index 0, or "trial") and return its id."""
    _check(kind, TRIAL_KINDS, "trial kind")
    get_experiment(session, experiment_id)  # a clear error rather than an FK violation
    trial = Trial(
        experiment_id=experiment_id,
        kind=kind,
        index=index,
        status=TrialStatus.RUNNING,
        started_at=utcnow(),
        match_expected=False,
        extra={},
    )
    session.add(trial)
    session.flush()
    return trial.id


def has_trials(session: Session, experiment_id: str) -> bool:
    """Whether the experiment has run (a trial, or its baseline, started)."""
    stmt = select(Trial.id).where(Trial.experiment_id == experiment_id).limit(1)
    return session.scalar(stmt) is not None


def list_trials(session: Session, experiment_id: str) -> list[Trial]:
    """The experiment's trials: its baseline first, then the trials by index."""
    stmt = select(Trial).where(Trial.experiment_id == experiment_id)
    return list(session.scalars(stmt.order_by(Trial.kind, Trial.index)))


def ping(session: Session) -> None:
    """A round trip to the database (raises when it cannot be reached)."""
    session.execute(text("SELECT 1"))


def finish_trial(
    session: Session,
    trial_id: int,
    *,
    status: TrialStatus | str,
    step_time_s: float | None = None,
    mean_step_time_s: float | None = None,
    overhead_pct: float | None = None,
    final_loss: float | None = None,
    params_digest: str | None = None,
    matches_baseline: bool | None = None,
    match_expected: bool = False,
    error: str | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Record a trial's outcome; `extra` holds result fields beyond the fixed columns."""
    status = parse(TrialStatus, status, "trial status")
    trial = session.get(Trial, trial_id)
    if trial is None:
        raise LookupError(f"no trial with id {trial_id} in this database")
    trial.status = status
    trial.finished_at = utcnow()
    trial.step_time_s = _opt_float(step_time_s)
    trial.mean_step_time_s = _opt_float(mean_step_time_s)
    trial.overhead_pct = _opt_float(overhead_pct)
    trial.final_loss = _opt_float(final_loss)
    trial.params_digest = params_digest
    trial.matches_baseline = None if matches_baseline is None else bool(matches_baseline)
    trial.match_expected = bool(match_expected)
    trial.error = error
    trial.extra = dict(extra or {})
    session.flush()


def delete_trials(session: Session, experiment_id: str) -> None:
    """Drop an experiment's trials and everything they recorded (a re-run starts clean)."""
    session.execute(delete(Trial).where(Trial.experiment_id == experiment_id))


def copy_baseline(session: Session, source_experiment_id: str, experiment_id: str) -> Trial | None:
    """Give `experiment_id` a copy of `source_experiment_id`'s completed baseline trial (its
    step records too), marked `reused_from`; None if the source has no completed baseline."""
    src = session.scalars(
        select(Trial).where(
            Trial.experiment_id == source_experiment_id,
            Trial.kind == "baseline",
            Trial.status == TrialStatus.COMPLETED,
        )
    ).first()
    if src is None:
        return None
    get_experiment(session, experiment_id)
    trial = Trial(
        experiment_id=experiment_id,
        kind="baseline",
        index=0,
        status=src.status,
        started_at=src.started_at,
        finished_at=src.finished_at,
        step_time_s=src.step_time_s,
        mean_step_time_s=src.mean_step_time_s,
        final_loss=src.final_loss,
        params_digest=src.params_digest,
        match_expected=False,
        extra={**src.extra, "reused_from": src.extra.get("reused_from", source_experiment_id)},
    )
    session.add(trial)
    session.flush()
    add_step_records(session, trial.id, load_step_records(session, src.id))
    return trial


# ---------------------------------------------------------------------------------------------
# Records of a trial


def _step_row(trial_id: int, r: StepRecord) -> dict[str, Any]:
    return {
        "trial_id": trial_id,
        "rank": int(r.rank),
        "step": int(r.step),
        "generation": int(r.generation),
        "loss": float(r.loss),
        "t_start": float(r.t_start),
        "t_end": float(r.t_end),
        "samples": int(r.samples),
        "blocked_s": float(r.blocked_s),
    }


def _checkpoint_row(trial_id: int, e: CheckpointEvent) -> dict[str, Any]:
    return {
        "trial_id": trial_id,
        "rank": int(e.rank),
        "step": int(e.step),
        "kind": e.kind,
        "nbytes": int(e.nbytes),
        "duration_s": float(e.duration_s),
        "t_end": float(e.t_end),
        "path": str(e.path),
    }


_REFORM_COLUMNS = (*REFORM_PARTS, *REFORM_MARKS)


def _failure_row(trial_id: int, f: FailureRecord) -> dict[str, Any]:
    return {
        "trial_id": trial_id,
        "failure_index": int(f.index),
        "ranks": [int(r) for r in f.ranks],
        "kill_kind": f.kill_kind,
        "trigger": f.trigger,
        "injected_at_step": int(f.injected_at_step),
        "t_injected": float(f.t_injected),
        "quiesce": f.quiesce,
        "quiesce_reason": f.quiesce_reason,
        "replacement": f.replacement,
        "detector": f.detector,
        "restore_source": f.restore_source,
        "restored_from_step": f.restored_from_step,
        "lost_steps": f.lost_steps,
        "interrupted_by": f.interrupted_by,
        **{f"{phase}_s": _opt_float(f.phases.get(phase)) for phase in PHASES},
        **{f"{part}_s": _opt_float(f.reform.get(part)) for part in _REFORM_COLUMNS},
    }


def add_step_records(session: Session, trial_id: int, records: Sequence[StepRecord]) -> None:
    """Bulk insert (one executemany, not one ORM object per row): trials have many thousand."""
    if records:
        session.execute(insert(StepRecordRow), [_step_row(trial_id, r) for r in records])


def add_checkpoint_events(
    session: Session, trial_id: int, events: Sequence[CheckpointEvent]
) -> None:
    if events:
        session.execute(insert(CheckpointEventRow), [_checkpoint_row(trial_id, e) for e in events])


def add_failures(session: Session, trial_id: int, failures: Sequence[FailureRecord]) -> None:
    """Insert a trial's failures; a failure index can be stored only once per trial."""
    if failures:
        session.execute(insert(RecoveryEventRow), [_failure_row(trial_id, f) for f in failures])


def load_step_records(session: Session, trial_id: int) -> list[StepRecord]:
    """A trial's step records in execution order: by generation, step, then rank."""
    t = StepRecordRow
    stmt = (
        select(t.rank, t.step, t.generation, t.loss, t.t_start, t.t_end, t.samples, t.blocked_s)
        .where(t.trial_id == trial_id)
        .order_by(t.generation, t.step, t.rank, t.id)
    )
    return [
        StepRecord(**{**row._mapping, "loss": _nan_if_none(row.loss)})
        for row in session.execute(stmt)
    ]


def load_checkpoint_events(session: Session, trial_id: int) -> list[CheckpointEvent]:
    """A trial's checkpoint saves and restores in the order they finished."""
    t = CheckpointEventRow
    stmt = (
        select(t.rank, t.step, t.kind, t.nbytes, t.duration_s, t.t_end, t.path)
        .where(t.trial_id == trial_id)
        .order_by(t.t_end, t.id)
    )
    return [CheckpointEvent(**row._mapping) for row in session.execute(stmt)]


def _failure_record(row: RecoveryEventRow) -> FailureRecord:
    return FailureRecord(
        index=row.failure_index,
        ranks=list(row.ranks),
        kill_kind=row.kill_kind,
        trigger=row.trigger,
        injected_at_step=row.injected_at_step,
        t_injected=row.t_injected,
        quiesce=row.quiesce,
        quiesce_reason=row.quiesce_reason,
        replacement=row.replacement,
        detector=row.detector,
        restore_source=row.restore_source,
        restored_from_step=row.restored_from_step,
        phases={phase: getattr(row, f"{phase}_s") for phase in PHASES},
        reform={part: getattr(row, f"{part}_s") for part in _REFORM_COLUMNS},
        interrupted_by=row.interrupted_by,
    )


def load_failures(session: Session, trial_id: int) -> list[FailureRecord]:
    """A trial's failures by failure index, phases keyed by `records.PHASES`."""
    stmt = (
        select(RecoveryEventRow)
        .where(RecoveryEventRow.trial_id == trial_id)
        .order_by(RecoveryEventRow.failure_index)
    )
    return [_failure_record(row) for row in session.scalars(stmt)]


# ---------------------------------------------------------------------------------------------
# The result contract


def _baseline_result(trial: Trial) -> BaselineResult:
    columns = {
        "status": trial.status,
        "step_time_s": trial.step_time_s,
        "mean_step_time_s": trial.mean_step_time_s,
        "final_loss": trial.final_loss,
        "params_digest": trial.params_digest,
    }
    return BaselineResult.model_validate({**trial.extra, **columns})


def _trial_result(session: Session, trial: Trial) -> TrialResult:
    columns = {
        "trial": trial.index,
        "status": trial.status,
        "step_time_s": trial.step_time_s,
        "mean_step_time_s": trial.mean_step_time_s,
        "overhead_pct": trial.overhead_pct,
        "final_loss": trial.final_loss,
        "params_digest": trial.params_digest,
        "matches_baseline": trial.matches_baseline,
        "match_expected": trial.match_expected,
        "error": trial.error,
        "failures": [failure_result(f) for f in load_failures(session, trial.id)],
    }
    return TrialResult.model_validate({**trial.extra, **columns})


def load_result(session: Session, experiment_id: str) -> ExperimentResult:
    """The result JSON of an experiment, rebuilt from its rows (the columns win over `extra`)."""
    experiment = get_experiment(session, experiment_id)
    trials = session.scalars(
        select(Trial).where(Trial.experiment_id == experiment_id).order_by(Trial.index, Trial.id)
    ).all()
    baseline = next((_baseline_result(t) for t in trials if t.kind == "baseline"), None)
    return ExperimentResult(
        experiment_id=experiment.id,
        status=experiment.status,
        spec=dict(experiment.spec),
        baseline=baseline,
        trials=[_trial_result(session, t) for t in trials if t.kind == "trial"],
    )


# ---------------------------------------------------------------------------------------------
# Sweeps


@dataclass(frozen=True)
class NewCell:
    """A cell as the expansion gives it: skipped when `reason` is set, else pending."""

    key: str
    architecture: str
    mechanism: str
    trace: str
    reason: str | None = None


def _find_sweep(session: Session, name: str, spec_hash: str) -> Sweep | None:
    stmt = select(Sweep).where(Sweep.name == name, Sweep.spec_hash == spec_hash)
    return session.scalars(stmt).one_or_none()


def get_or_create_sweep(
    session: Session,
    *,
    name: str,
    spec: dict[str, Any],
    spec_hash: str,
    cells: Sequence[NewCell],
) -> tuple[str, bool]:
    """The id of the sweep `name` with these cells (`spec_hash`), created if new; and whether it
    was created. Two processes creating the same sweep at once end up with the same one."""
    found = _find_sweep(session, name, spec_hash)
    if found is not None:
        return found.id, False
    sweep = Sweep(id=new_id(), name=name, spec=spec, spec_hash=spec_hash, status="pending")
    try:
        with session.begin_nested():  # a savepoint: losing the race must not end the caller's unit
            session.add(sweep)
            session.flush()
            session.execute(
                insert(SweepCell),
                [
                    {
                        "sweep_id": sweep.id,
                        "position": i,
                        "key": c.key,
                        "architecture": c.architecture,
                        "mechanism": c.mechanism,
                        "trace": c.trace,
                        "status": "skipped" if c.reason is not None else "pending",
                        "reason": c.reason,
                        "updated_at": utcnow(),
                    }
                    for i, c in enumerate(cells)
                ],
            )
    except IntegrityError:
        found = _find_sweep(session, name, spec_hash)
        if found is None:
            raise
        return found.id, False
    return sweep.id, True


def get_sweep(session: Session, sweep_id: str) -> Sweep:
    sweep = session.get(Sweep, sweep_id)
    if sweep is None:
        raise SweepNotFound(sweep_id)
    return sweep


def set_sweep_status(session: Session, sweep_id: str, status: SweepStatus | str) -> None:
    status = parse(SweepStatus, status, "sweep status")
    get_sweep(session, sweep_id).status = status
    session.flush()


def list_sweep_cells(session: Session, sweep_id: str) -> list[SweepCell]:
    """A sweep's cells in the order of its expansion."""
    stmt = select(SweepCell).where(SweepCell.sweep_id == sweep_id).order_by(SweepCell.position)
    return list(session.scalars(stmt))


_UNCHANGED: Any = object()


def set_cell_status(
    session: Session,
    sweep_id: str,
    key: str,
    status: CellStatus | str,
    *,
    reason: str | None = None,
    experiment_id: str | None = _UNCHANGED,
) -> None:
    """Move a cell to `status`; `reason` replaces the earlier one (None clears it)."""
    status = parse(CellStatus, status, "cell status")
    values: dict[str, Any] = {"status": status, "reason": reason, "updated_at": utcnow()}
    if experiment_id is not _UNCHANGED:
        values["experiment_id"] = experiment_id
    done = session.execute(
        update(SweepCell)
        .where(SweepCell.sweep_id == sweep_id, SweepCell.key == key)
        .values(**values)
    )
    if done.rowcount != 1:  # type: ignore[attr-defined]
        raise LookupError(f"no cell {key!r} in sweep {sweep_id}")


def claim_cell(session: Session, sweep_id: str, key: str) -> bool:
    """pending -> running, only if still pending: two runners of one sweep never share a cell."""
    done = session.execute(
        update(SweepCell)
        .where(
            SweepCell.sweep_id == sweep_id,
            SweepCell.key == key,
            SweepCell.status == CellStatus.PENDING,
        )
        .values(status=CellStatus.RUNNING, reason=None, updated_at=utcnow())
    )
    return bool(done.rowcount == 1)  # type: ignore[attr-defined]


def reset_cells(session: Session, sweep_id: str, statuses: Sequence[CellStatus | str]) -> list[str]:
    """Move the cells in any of `statuses` back to pending; return their keys."""
    statuses = [parse(CellStatus, s, "cell status") for s in statuses]
    where = (SweepCell.sweep_id == sweep_id, SweepCell.status.in_(statuses))
    keys = list(session.scalars(select(SweepCell.key).where(*where).order_by(SweepCell.position)))
    session.execute(
        update(SweepCell).where(*where).values(status=CellStatus.PENDING, updated_at=utcnow())
    )
    return keys


def refresh_skipped(session: Session, sweep_id: str, reasons: Mapping[str, str | None]) -> None:
    """Bring cells that have not run (pending, skipped) in line with today's expansion: a part
    that learnt to apply somewhere makes a skipped cell pending again, and the reverse."""
    for cell in list_sweep_cells(session, sweep_id):
        if cell.status not in (CellStatus.PENDING, CellStatus.SKIPPED) or cell.key not in reasons:
            continue
        reason = reasons[cell.key]
        status = CellStatus.PENDING if reason is None else CellStatus.SKIPPED
        if (cell.status, cell.reason) != (status, reason):
            cell.status, cell.reason, cell.updated_at = status, reason, utcnow()
    session.flush()


def cell_experiment_statuses(session: Session, sweep_id: str) -> dict[str, ExperimentStatus]:
    """The status of each cell's experiment, by cell key (cells with none are left out)."""
    stmt = (
        select(SweepCell.key, Experiment.status)
        .join(Experiment, Experiment.id == SweepCell.experiment_id)
        .where(SweepCell.sweep_id == sweep_id)
    )
    return {key: parse(ExperimentStatus, word) for key, word in session.execute(stmt).all()}


def sweep_progress(session: Session, sweep_id: str) -> dict[str, int]:
    """How many cells are in each status (every status, zero included)."""
    stmt = (
        select(SweepCell.status, func.count())
        .where(SweepCell.sweep_id == sweep_id)
        .group_by(SweepCell.status)
    )
    counts = cell_counts()
    counts.update({status: n for status, n in session.execute(stmt).all()})
    return counts
