"""Sweeps: a grid of experiments (architecture x mechanism x failure trace x ...), one per cell.

A sweep file has a `name`, a `base` (a partial experiment spec) and a `grid` (lists of values).
`expand` turns it into cells in a stable order, each with its full experiment spec or the reason
it is skipped; it is pure (no Ray, no database). `prepare` records the sweep in the database and
decides what is left to run; `run_pending` runs it on the connected Ray cluster.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from sqlalchemy.orm import Session

from architectures import ARCHITECTURES
from failbench_ray.checks import resolve
from failbench_ray.errors import SpecError
from failbench_ray.results import ExperimentResult
from failbench_ray.spec import ExperimentSpec, FailureTrace, PartSpec, parse_spec
from failbench_ray.storage import queue, repo
from failbench_ray.storage.db import Database
from failbench_ray.storage.status import (
    CellStatus,
    ExperimentStatus,
    SweepStatus,
    TrialStatus,
    cell_status_of,
    sweep_status_of,
)
from mechanisms import MECHANISMS

# The grid always sets these three; every other experiment field may be a grid list or in base.
GRID_AXES = ("architecture", "mechanism", "failures")
# Trace shorthands of a grid, made concrete for each cell's world size and steps (`standard_trace`).
TRACE_SHORTHANDS = ("none", "single", "concurrent", "cascading")

ProgressFn = Callable[[str, int, int], None]  # (trial label, step, total steps)


def _fields_except(*names: str) -> list[str]:
    """Experiment fields in the spec's order, less `names`."""
    return [f for f in ExperimentSpec.model_fields if f not in names]


class Grid(BaseModel):
    """The axes of a sweep; any other experiment field may be added as a list of values."""

    model_config = ConfigDict(extra="allow", frozen=True)

    architecture: list[PartSpec] = Field(min_length=1, description="Names or {name, params}.")
    mechanism: list[PartSpec] = Field(min_length=1, description="Names or {name, params}.")
    failures: list[str | dict[str, Any]] = Field(
        min_length=1,
        description="Traces: a shorthand (none, single, concurrent, cascading) or a full trace.",
    )

    @field_validator("failures")
    @classmethod
    def _traces(cls, traces: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:
        for i, t in enumerate(traces):
            if isinstance(t, str) and t not in TRACE_SHORTHANDS:
                raise ValueError(
                    f"[{i}] {t!r} is not a trace shorthand; use one of "
                    f"{', '.join(TRACE_SHORTHANDS)}, or a trace such as "
                    "{kind: single, rank: 1, at_step: 10}"
                )
            if isinstance(t, dict):
                try:
                    FailureTrace.model_validate(t)
                except ValidationError as err:
                    raise ValueError(f"[{i}] {_errors(err)}") from None
        return traces

    @model_validator(mode="after")
    def _extra_axes(self) -> Grid:
        for field, values in (self.model_extra or {}).items():
            if field == "name":
                raise ValueError("`name` cannot vary: each experiment is named <sweep>/<cell key>")
            if field not in ExperimentSpec.model_fields:
                valid = ", ".join(_fields_except("name", *GRID_AXES))
                raise ValueError(f"{field!r} is not an experiment field; valid: {valid}")
            if not isinstance(values, list) or not values:
                raise ValueError(f"{field} must be a non-empty list of values, e.g. {field}: [..]")
        return self

    def size(self) -> int:
        """The number of cells: the product of the axes' lengths, known before the grid is
        expanded (a service refuses a grid over its cap without building it)."""
        axes: list[list[Any]] = [self.architecture, self.mechanism, self.failures]
        lengths = [len(axis) for axis in [*axes, *self.extra_axes().values()]]
        return math.prod(lengths)

    def extra_axes(self) -> dict[str, list[Any]]:
        """The other grid fields, in the order of the experiment spec (stable keys)."""
        extra = self.model_extra or {}
        return {f: extra[f] for f in ExperimentSpec.model_fields if f in extra}


class SweepSpec(BaseModel):
    """A sweep file: a name, the fields every cell shares, and the grid."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="Names the sweep; a re-run finds it by name.")
    base: dict[str, Any] = Field(
        default_factory=dict, description="Experiment fields every cell shares (not the grid's)."
    )
    grid: Grid
    share_baselines: bool = Field(
        True,
        description="Cells whose baselines are the same run (they differ only in mechanism "
        "and trace) share one: the first cell runs it, the others copy it (marked reused_from).",
    )

    @model_validator(mode="after")
    def _base_fields(self) -> SweepSpec:
        for field in self.base:
            if field in GRID_AXES:
                raise ValueError(f"base.{field}: put it in the grid as a list, e.g. {field}: [..]")
            if field == "name":
                raise ValueError("base.name: each experiment is named <sweep>/<cell key>; drop it")
            if field not in ExperimentSpec.model_fields:
                valid = ", ".join(_fields_except("name", *GRID_AXES))
                raise ValueError(f"base.{field} is not an experiment field; valid: {valid}")
            if field in self.grid.extra_axes():
                raise ValueError(f"{field} is both in base and in the grid; keep it in one")
        return self


def _errors(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def parse_sweep(data: Any) -> SweepSpec:
    """Validate a sweep from a dict; raise SpecError with one line that says what to change."""
    if not isinstance(data, dict):
        raise SpecError("invalid sweep: expected a mapping with name, base and grid")
    if "grid" not in data and set(data) & (set(ExperimentSpec.model_fields) - {"name"}):
        raise SpecError(
            "invalid sweep: no grid; this looks like an experiment spec (run it with `failbench "
            "run`), a sweep file has name, base and grid"
        )
    try:
        sweep = SweepSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(f"invalid sweep: {_errors(err)}") from None
    try:  # base alone, every other field at its default: its own mistakes, once, not per cell
        ExperimentSpec.model_validate(sweep.base)
    except ValidationError as err:
        raise SpecError(f"invalid sweep: base.{_errors(err)}") from None
    return sweep


def load_sweep(path: str | Path) -> SweepSpec:
    """Load a sweep from a .yaml/.yml/.json file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise SpecError(f"cannot read sweep {p}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError(f"cannot read sweep {p}: not a UTF-8 text file") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise SpecError(f"cannot parse sweep {p}: {err}".replace("\n", " ")) from None
    return parse_sweep(data)


# ---------------------------------------------------------------------------------------------
# Expansion


def standard_trace(kind: str, world_size: int, steps: int) -> dict[str, Any]:
    """The trace a shorthand stands for. Rank 1 dies first (rank 0 is often special: the
    parameter server, the first stage), 60% into the run, past the first checkpoints."""
    at = max(1, steps * 3 // 5)
    second = 2 if world_size >= 3 else 0
    if kind == "single":
        return {"kind": "single", "rank": 1, "at_step": at}
    if kind == "concurrent":
        return {"kind": "concurrent", "ranks": sorted({1, second}), "at_step": at}
    if kind == "cascading":
        events = [{"rank": 1, "at_step": at}, {"rank": second, "during": "restoring"}]
        return {"kind": "cascading", "events": events}
    return {"kind": "none"}


@dataclass(frozen=True)
class Cell:
    """One point of the grid: its full spec, or why it is skipped (`reason`)."""

    key: str
    architecture: str
    mechanism: str
    trace: str
    spec: ExperimentSpec | None
    reason: str | None = None
    fields: dict[str, Any] | None = None  # what was given to the spec (for a spec that failed)

    @property
    def skipped(self) -> bool:
        return self.reason is not None

    def as_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "architecture": self.architecture,
            "mechanism": self.mechanism,
            "trace": self.trace,
            "skipped": self.skipped,
            "reason": self.reason,
            "spec": self.spec.model_dump(mode="json") if self.spec else self.fields,
        }


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, str | int | float | bool)


def _unique(labels: list[str], what: str) -> list[str]:
    dup = next((label for label in labels if labels.count(label) > 1), None)
    if dup is not None:
        raise SpecError(f"invalid sweep: grid.{what} lists {dup} twice; list each value once")
    return labels


def _part_labels(parts: list[PartSpec], what: str) -> list[str]:
    """The name, or name(params) where one name appears with several parameter sets."""
    names = [p.name for p in parts]
    for i, p in enumerate(parts):
        if p in parts[:i]:
            raise SpecError(f"invalid sweep: grid.{what} lists {p.name} twice; list each once")

    def label(p: PartSpec) -> str:
        if names.count(p.name) == 1:
            return p.name
        return p.name + "(" + ",".join(f"{k}={v}" for k, v in sorted(p.params.items())) + ")"

    return _unique([label(p) for p in parts], what)


def _trace_labels(traces: list[str | dict[str, Any]]) -> list[str]:
    """A shorthand is its own label; a full trace is its kind, described where kinds repeat."""
    parsed = [t if isinstance(t, str) else FailureTrace.model_validate(t) for t in traces]
    kinds = [t if isinstance(t, str) else t.kind for t in parsed]

    def label(t: str | FailureTrace) -> str:
        if isinstance(t, str) or kinds.count(t.kind) == 1:
            return t if isinstance(t, str) else t.kind
        events = ";".join(
            "+".join(map(str, e.ranks))
            + f"@{e.trigger}"
            + ("" if e.kill == "sigkill" else f":{e.kill}")
            for e in t.events
        )
        return f"{t.kind}({events})"

    return _unique([label(t) for t in parsed], "failures")


def _value_labels(field: str, values: list[Any]) -> list[str]:
    if all(_scalar(v) for v in values):
        return _unique([f"{field}={v}" for v in values], field)
    if any(values.count(v) > 1 for v in values):
        raise SpecError(f"invalid sweep: grid.{field} lists a value twice; list each value once")
    return [f"{field}#{i}" for i in range(len(values))]


def _check_names(grid: Grid) -> None:
    """Unknown names are mistakes in the whole sweep, not a cell to skip."""
    for axis, registry in (("architecture", ARCHITECTURES), ("mechanism", MECHANISMS)):
        for i, part in enumerate(getattr(grid, axis)):
            if part.name not in registry:
                raise SpecError(
                    f"invalid sweep: grid.{axis}[{i}]: unknown {axis} {part.name!r}; "
                    f"valid: {', '.join(registry.names())}"
                )


def _int_or(value: Any, default: int) -> int:
    # A bad value is refused by the spec itself; here it only sizes a shorthand trace.
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _cell(
    sweep: SweepSpec, labels: list[str], arch: PartSpec, mech: PartSpec, trace: Any, extra: dict
) -> Cell:
    key = "/".join(labels)
    fields: dict[str, Any] = {
        **sweep.base,
        **extra,
        "name": f"{sweep.name}/{key}",
        "architecture": arch.model_dump(),
        "mechanism": mech.model_dump(),
    }
    if isinstance(trace, str):
        defaults = ExperimentSpec.model_fields
        world = _int_or(fields.get("world_size"), defaults["world_size"].default)
        steps = _int_or(fields.get("steps"), defaults["steps"].default)
        trace = standard_trace(trace, world, steps)
    fields["failures"] = trace

    def cell(spec: ExperimentSpec | None, reason: str | None = None) -> Cell:
        given = fields if spec is None else None
        return Cell(key, arch.name, mech.name, labels[2], spec, reason, given)

    try:
        spec = parse_spec(fields)
    except SpecError as err:
        return cell(None, str(err))
    try:
        resolve(spec)
    except SpecError as err:  # NotApplicableError included: a cell the harness cannot run
        return cell(spec, str(err))
    return cell(spec)


def expand(sweep: SweepSpec) -> list[Cell]:
    """Every cell of the grid: architecture, then mechanism, then trace, then the other grid
    fields in the spec's field order vary slowest to fastest. Raises SpecError for an unknown
    architecture or mechanism name or a repeated grid value."""
    grid = sweep.grid
    _check_names(grid)
    extra = grid.extra_axes()
    axes: list[list[tuple[str, Any]]] = [
        list(zip(_part_labels(grid.architecture, "architecture"), grid.architecture, strict=True)),
        list(zip(_part_labels(grid.mechanism, "mechanism"), grid.mechanism, strict=True)),
        list(zip(_trace_labels(grid.failures), grid.failures, strict=True)),
        *(list(zip(_value_labels(f, vs), vs, strict=True)) for f, vs in extra.items()),
    ]
    cells = []
    for point in itertools.product(*axes):
        labels = [label for label, _ in point]
        (_, arch), (_, mech), (_, trace), *rest = point
        values = {f: v for f, (_, v) in zip(extra, rest, strict=True)}
        cells.append(_cell(sweep, labels, arch, mech, trace, values))
    return cells


def spec_hash(cells: Sequence[Cell]) -> str:
    """What makes two runs of a sweep file the same sweep: the keys and specs of its cells (the
    skip reasons may change with the code, and are brought up to date on every run)."""
    payload = [[c.key, c.spec.model_dump(mode="json") if c.spec else c.fields] for c in cells]
    text = json.dumps(payload, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Storage and running


# A sweep goes one of two ways, which share `_record` (the sweep and its cells in storage), the
# statuses (`storage/status.py`) and shared baselines (`shared_baseline`):
# - `failbench sweep`: `prepare`, then `run_pending` runs the cells here, one after another;
# - the service (POST /v1/sweeps): `enqueue` queues them, and dispatchers run them.


def _record(session: Session, sweep: SweepSpec, cells: Sequence[Cell]) -> str:
    """Find or create the sweep, and bring its skipped cells up to date."""
    sweep_id, _ = repo.get_or_create_sweep(
        session,
        name=sweep.name,
        spec=sweep.model_dump(mode="json"),
        spec_hash=spec_hash(cells),
        cells=[repo.NewCell(c.key, c.architecture, c.mechanism, c.trace, c.reason) for c in cells],
    )
    repo.refresh_skipped(session, sweep_id, {c.key: c.reason for c in cells})
    return sweep_id


def prepare(db: Database, sweep: SweepSpec, cells: Sequence[Cell], *, retry_failed: bool) -> str:
    """Find or create the sweep; make interrupted cells (and failed ones, if asked) pending."""
    with db.session() as s:
        sweep_id = _record(s, sweep, cells)
        # A cell still `running` was cut off (the process died): it runs again.
        again = [CellStatus.RUNNING, CellStatus.FAILED] if retry_failed else [CellStatus.RUNNING]
        repo.reset_cells(s, sweep_id, again)
    return sweep_id


@dataclass(frozen=True)
class Enqueued:
    sweep_id: str
    queued: list[tuple[str, str]]  # (cell key, experiment id)
    skipped: list[tuple[str, str | None]]  # (cell key, why)


def enqueue(db: Database, sweep: SweepSpec, cells: Sequence[Cell]) -> Enqueued:
    """Queue every applicable cell for the service's dispatchers, except those whose experiment
    is queued, running or done already: submitting a sweep again retries only what failed."""
    queued: list[tuple[str, str]] = []
    skipped: list[tuple[str, str | None]] = []
    with db.session() as s:
        sweep_id = _record(s, sweep, cells)
        rows = {r.key: r for r in repo.list_sweep_cells(s, sweep_id)}
        for c in cells:
            if c.skipped or c.spec is None:
                skipped.append((c.key, c.reason))
                continue
            was = rows[c.key].experiment_id
            if was is not None and repo.experiment_status(s, was) in _LIVE:
                continue
            got = queue.submit(s, c.spec, sweep_id=sweep_id)
            repo.set_cell_status(
                s, sweep_id, c.key, CellStatus.PENDING, experiment_id=got.experiment_id
            )
            queued.append((c.key, got.experiment_id))
        progress = repo.sweep_progress(s, sweep_id)
        repo.set_sweep_status(s, sweep_id, sweep_status_of(progress, active=True))
    return Enqueued(sweep_id, queued, skipped)


_LIVE = (ExperimentStatus.QUEUED, ExperimentStatus.RUNNING, ExperimentStatus.COMPLETED)


def shared_baseline(db: Database, experiment_id: str) -> str | None:
    """For an experiment that a dispatcher runs as a sweep's cell: a completed experiment of the
    same sweep with the same baseline (`runner.baseline_key`), whose baseline it copies instead
    of running its own, as `failbench sweep` does. None if there is none yet, or the sweep says
    `share_baselines: false`."""
    from failbench_ray.runner import baseline_key

    with db.session() as s:
        exp = repo.get_experiment(s, experiment_id)
        if exp.sweep_id is None:
            return None
        sweep = repo.get_sweep(s, exp.sweep_id)
        if not sweep.spec.get("share_baselines", True):
            return None
        key = baseline_key(ExperimentSpec.model_validate(exp.spec))
        for other_id, spec in repo.completed_in_sweep(s, exp.sweep_id):
            if (
                other_id != experiment_id
                and baseline_key(ExperimentSpec.model_validate(spec)) == key
            ):
                return other_id
    return None


def pending_keys(db: Database, sweep_id: str) -> list[str]:
    with db.session() as s:
        return [c.key for c in repo.list_sweep_cells(s, sweep_id) if c.status == CellStatus.PENDING]


def run_pending(
    db: Database,
    sweep_id: str,
    cells: Sequence[Cell],
    *,
    out_dir: Path = Path("runs"),
    progress: ProgressFn = lambda label, step, total: None,
    on_cell: Callable[[Cell], None] = lambda cell: None,
    on_done: Callable[[Cell, CellStatus], None] = lambda cell, status: None,
    share_baselines: bool = True,
    reuse_workers: bool = True,
) -> None:
    """Run every pending cell on the connected Ray cluster, in order. A cell that fails is
    recorded and the sweep goes on; Ctrl-C puts the current cell back to pending.
    `share_baselines`: a cell reuses the baseline of an earlier completed cell of this sweep
    that has the same one (see `runner.baseline_key`)."""
    from failbench_ray.runner import baseline_key

    by_key = {c.key: c for c in cells}
    baselines: dict[str, str] = {}  # baseline key -> an experiment with that baseline done
    with db.session() as s:
        repo.set_sweep_status(s, sweep_id, SweepStatus.RUNNING)
        if share_baselines:
            for row in repo.list_sweep_cells(s, sweep_id):
                cell = by_key.get(row.key)
                if row.status == CellStatus.COMPLETED and row.experiment_id and cell and cell.spec:
                    baselines.setdefault(baseline_key(cell.spec), row.experiment_id)
    for key in pending_keys(db, sweep_id):
        with db.session() as s:
            if not repo.claim_cell(s, sweep_id, key):
                continue  # another runner of this sweep took it
        on_cell(by_key[key])
        cell = by_key[key]
        assert cell.spec is not None
        bkey = baseline_key(cell.spec)
        try:
            status, experiment_id = _run_cell(
                db, sweep_id, cell, out_dir, progress, baselines.get(bkey), reuse_workers
            )
        except KeyboardInterrupt:
            with db.session() as s:
                # pending, not failed: resuming the sweep runs it again
                repo.set_cell_status(
                    s, sweep_id, key, CellStatus.PENDING, reason="interrupted (Ctrl-C)"
                )
                repo.set_sweep_status(s, sweep_id, SweepStatus.INTERRUPTED)
            raise
        if share_baselines and status == CellStatus.COMPLETED and experiment_id:
            baselines.setdefault(bkey, experiment_id)
        on_done(cell, status)
    with db.session() as s:
        counts = repo.sweep_progress(s, sweep_id)
        repo.set_sweep_status(s, sweep_id, sweep_status_of(counts, active=False))


def _run_cell(
    db: Database,
    sweep_id: str,
    cell: Cell,
    out_dir: Path,
    progress: ProgressFn,
    baseline_of: str | None,
    reuse_workers: bool = True,
) -> tuple[CellStatus, str | None]:
    """Run one claimed cell; return its final status (completed or failed) and experiment."""
    from failbench_ray.runner import run_experiment

    assert cell.spec is not None
    made: list[str] = []

    def created(experiment_id: str) -> None:
        made.append(experiment_id)
        with db.session() as s:
            repo.set_experiment_sweep(s, experiment_id, sweep_id)
            repo.set_cell_status(
                s, sweep_id, cell.key, CellStatus.RUNNING, experiment_id=experiment_id
            )

    reason: str | None = None
    try:
        result = run_experiment(
            cell.spec,
            db=db,
            out_dir=out_dir,
            progress=progress,
            on_created=created,
            baseline_of=baseline_of,
            reuse_workers=reuse_workers,
        )
    except Exception as err:  # a broken cell must not stop the sweep; its reason says why
        status, reason = CellStatus.FAILED, f"{type(err).__name__}: {err}"
    else:
        status = cell_status_of(result.status)
        reason = None if status == CellStatus.COMPLETED else _failure_reason(result)
    with db.session() as s:
        repo.set_cell_status(s, sweep_id, cell.key, status, reason=reason)
    return status, made[0] if made else None


def _failure_reason(result: ExperimentResult) -> str:
    if result.baseline is not None and result.baseline.status != TrialStatus.COMPLETED:
        return f"baseline {result.baseline.status}"
    for t in result.trials:
        if t.status != TrialStatus.COMPLETED:
            return f"trial {t.trial} {t.status}: {t.error or 'no error recorded'}"
    return f"experiment {result.status}"


# ---------------------------------------------------------------------------------------------
# The report


def summarize(result: ExperimentResult) -> dict[str, Any]:
    """A cell's numbers: mean overhead over the trials, the longest recovery (kill to the first
    step after it), and whether every trial matched the baseline where a match is expected."""
    overheads = [t.overhead_pct for t in result.trials if t.overhead_pct is not None]
    resumed = [f.phases.resumed_s for t in result.trials for f in t.failures if f.phases.resumed_s]
    matches = [t.matches_baseline for t in result.trials if t.matches_baseline is not None]
    return {
        "overhead_pct": sum(overheads) / len(overheads) if overheads else None,
        "recovery_s": max(resumed, default=None),
        "matches_baseline": all(matches) if matches else None,
        # the experiment whose baseline run this cell shares (None: it ran its own)
        "baseline_from": (result.baseline.model_extra or {}).get("reused_from")
        if result.baseline is not None
        else None,
    }


def report(db: Database, sweep_id: str) -> dict[str, Any]:
    """The sweep and every cell with its numbers, read back from the database."""
    with db.session() as s:
        sweep = repo.get_sweep(s, sweep_id)
        rows = []
        for c in repo.list_sweep_cells(s, sweep_id):
            numbers: dict[str, Any] = dict.fromkeys(
                ("overhead_pct", "recovery_s", "matches_baseline")
            )
            if c.experiment_id and c.status in (CellStatus.COMPLETED, CellStatus.FAILED):
                numbers = summarize(repo.load_result(s, c.experiment_id))
            rows.append(
                {
                    "key": c.key,
                    "architecture": c.architecture,
                    "mechanism": c.mechanism,
                    "trace": c.trace,
                    "status": c.status,
                    "experiment_id": c.experiment_id,
                    **numbers,
                    "reason": c.reason,
                }
            )
        return {
            "sweep_id": sweep.id,
            "name": sweep.name,
            "status": sweep.status,
            "progress": repo.sweep_progress(s, sweep_id),
            "cells": rows,
        }
