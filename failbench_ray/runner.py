"""Runs one experiment: the matched baseline, then the trials; everything lands in SQL.

The baseline is the same spec with mechanism `none` and no failures. The result JSON is read
back from the database (`repo.load_result`), so `failbench run --json` and `failbench show`
print the same thing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from failbench_ray import ettr, results, telemetry
from failbench_ray.checks import Resolved, resolve
from failbench_ray.controller import TrialController, TrialOutcome
from failbench_ray.errors import LeaseLost, TrialInterrupted
from failbench_ray.pool import WorkerPool, shared_pool
from failbench_ray.results import ExperimentResult, failure_reason
from failbench_ray.runtime import node_ip
from failbench_ray.spec import ExperimentSpec, FailureTrace, PartSpec
from failbench_ray.storage import repo
from failbench_ray.storage.db import Database
from failbench_ray.storage.status import ExperimentStatus, TrialStatus
from failbench_ray.worker_group import Placement, choose_placement


@dataclass(frozen=True)
class TrialSummary:
    status: str
    step_time_s: float | None
    mean_step_time_s: float | None
    final_loss: float | None
    params_digest: str | None


ProgressFn = Callable[[str, int, int], None]  # (trial label, step, total steps)


def baseline_spec(spec: ExperimentSpec) -> ExperimentSpec:
    return spec.model_copy(update={"mechanism": PartSpec(name="none"), "failures": FailureTrace()})


def baseline_key(spec: ExperimentSpec) -> str:
    """Equal for experiments whose baselines are the same run (they differ only in name,
    trials, mechanism and failures)."""
    base = baseline_spec(spec).model_copy(update={"name": None, "trials": 1})
    return hashlib.sha256(base.model_dump_json().encode()).hexdigest()


# How long a run's writes retry while the database cannot be reached: as long as a service's
# lease lasts, after which another dispatcher may take the experiment over.
DB_RETRY_S = 30.0


def run_experiment(
    spec: ExperimentSpec,
    *,
    db: Database,
    out_dir: Path = Path("runs"),
    progress: ProgressFn = lambda label, step, total: None,
    keep_checkpoints: bool = False,
    on_created: Callable[[str], None] = lambda experiment_id: None,
    baseline_of: str | None = None,
    experiment_id: str | None = None,
    should_stop: Callable[[], str | None] = lambda: None,
    guard: Callable[[Session], None] = lambda session: None,
    cluster_share: float = 1.0,
    reuse_workers: bool = True,
    db_retry_s: float | None = None,
) -> ExperimentResult:
    """Run `spec` on the connected Ray cluster. Raises SpecError before anything starts.

    `baseline_of`: an experiment with the same `baseline_key` whose completed baseline this one
    reuses instead of running its own (a sweep runs each distinct baseline once); the copy
    says `reused_from`. Without one, the baseline runs here.

    A queued experiment (the service): `experiment_id` is its row, already `running`; what an
    earlier attempt left of it is discarded. `should_stop` returning a reason stops the run
    (every actor) with `TrialInterrupted`, and the caller writes the outcome. `guard(session)`
    runs in every session that writes and raises to refuse the write (a lost lease).
    `db_retry_s`: how long a write retries while the database is unreachable (DB_RETRY_S).
    `cluster_share`: the fraction of the cluster's CPUs (GPUs) this experiment sizes its
    actors to; N experiments at once each take 1/N, so no two ever wait on each other's
    resources (half-placed groups would deadlock).
    `reuse_workers`: trials take their first ranks (and hot spares) from this driver's pool
    of started processes (`failbench_ray.pool`); a replacement is always a new process.
    """
    resolved = resolve(spec)
    base = resolve(baseline_spec(spec))
    exp_id = _experiment_row(db, spec, experiment_id, guard)
    on_created(exp_id)
    exp_dir = out_dir / exp_id
    # An earlier, cut-off attempt's files (checkpoints above all) must not be restored from.
    shutil.rmtree(exp_dir, ignore_errors=True)
    runner = _Runner(db, exp_id, exp_dir, progress, keep_checkpoints, baseline_of)
    runner.should_stop, runner.guard, runner.share = should_stop, guard, cluster_share
    runner.pool = shared_pool() if reuse_workers else None
    runner.db_retry_s = DB_RETRY_S if db_retry_s is None else db_retry_s
    try:
        ok = runner.run_all(resolved, base)
    except (TrialInterrupted, OperationalError):
        raise  # the caller decides: stopped, or the database stayed unreachable past retries
    except KeyboardInterrupt:
        with db.session() as s:
            repo.mark_interrupted(s, exp_id, "interrupted (Ctrl-C)")
        raise
    except BaseException as err:
        with contextlib.suppress(LeaseLost), db.session() as s:
            guard(s)
            repo.set_experiment_status(
                s, exp_id, ExperimentStatus.FAILED, error=f"{type(err).__name__}: {err}"
            )
        raise
    return _finish(db, exp_id, exp_dir, ok, guard, runner.db_retry_s)


def mark_database_lost(db: Database, exp_id: str, retry_s: float, wait_s: float) -> bool:
    """A run (not a dispatcher's) whose writes outlasted `retry_s` of an outage: mark its
    experiment failed, saying so, once the database answers within `wait_s`. False: it did
    not, and the row still says `running`."""
    reason = (
        f"the database stayed unreachable for more than {retry_s:g} s during the run, so "
        "its later records were not stored: run the spec again"
    )
    try:
        db.write(
            lambda s: repo.set_experiment_status(s, exp_id, ExperimentStatus.FAILED, error=reason),
            retry_s=wait_s,
        )
    except OperationalError:
        return False
    return True


def _experiment_row(
    db: Database, spec: ExperimentSpec, experiment_id: str | None, guard: Callable[[Session], None]
) -> str:
    """A new experiment row, or a queued one's (`experiment_id`) with what an earlier attempt
    left of it discarded."""
    with db.session() as s:
        if experiment_id is None:
            return repo.create_experiment(
                s,
                spec=spec.model_dump(mode="json"),
                architecture=spec.architecture.name,
                mechanism=spec.mechanism.name,
                name=spec.name,
                status=ExperimentStatus.RUNNING,
            )
        guard(s)
        repo.delete_trials(s, experiment_id)
        return experiment_id


def _finish(
    db: Database,
    exp_id: str,
    exp_dir: Path,
    ok: bool,
    guard: Callable[[Session], None],
    retry_s: float = 0.0,
) -> ExperimentResult:
    """Store the experiment's status, and its result beside its files (result.json)."""

    def store(s: Session) -> ExperimentResult:
        guard(s)
        done = ExperimentStatus.COMPLETED if ok else ExperimentStatus.FAILED
        # a failed experiment says why on its own row, not only on its trials'
        why = None if ok else failure_reason(repo.load_result(s, exp_id)) or "a run failed"
        repo.set_experiment_status(s, exp_id, done, error=why)
        return repo.load_result(s, exp_id)

    result = db.write(store, retry_s=retry_s)
    exp_dir.mkdir(parents=True, exist_ok=True)
    (exp_dir / "result.json").write_text(json.dumps(result.model_dump(mode="json"), indent=2))
    return result


class _Runner:
    def __init__(
        self,
        db: Database,
        exp_id: str,
        exp_dir: Path,
        progress: ProgressFn,
        keep: bool,
        baseline_of: str | None = None,
    ) -> None:
        self.baseline_of = baseline_of
        self.should_stop: Callable[[], str | None] = lambda: None
        self.guard: Callable[[Session], None] = lambda session: None
        self.share = 1.0
        self.pool: WorkerPool | None = None
        self.db = db
        self.exp_id = exp_id
        self.exp_dir = exp_dir
        self.progress = progress
        self.keep = keep
        self.baseline: TrialSummary | None = None
        self.db_retry_s = DB_RETRY_S

    def run_all(self, resolved: Resolved, base: Resolved) -> bool:
        spec = resolved.spec
        resources = dict(ray.cluster_resources())
        for kind in ("CPU", "GPU"):
            if kind in resources:
                resources[kind] *= self.share
        placement = choose_placement(spec.world_size, resources)
        ok = True
        if spec.baseline:
            self.baseline = self._reused_baseline() or self.run_trial(
                base, "baseline", 0, placement, inject=False
            )
            ok = self.baseline.status == TrialStatus.COMPLETED
        for i in range(spec.trials):
            ok = (
                self.run_trial(resolved, "trial", i, placement, inject=True).status
                == TrialStatus.COMPLETED
                and ok
            )
        return ok

    def _reused_baseline(self) -> TrialSummary | None:
        if self.baseline_of is None:
            return None
        with self.db.session() as s:
            self.guard(s)
            t = repo.copy_baseline(s, self.baseline_of, self.exp_id)
            if t is None:
                return None
            return TrialSummary(
                t.status, t.step_time_s, t.mean_step_time_s, t.final_loss, t.params_digest
            )

    def run_trial(
        self, resolved: Resolved, kind: str, index: int, placement: Placement, *, inject: bool
    ) -> TrialSummary:
        spec = resolved.spec
        trial_id = self.db.write(
            lambda s: (
                self.guard(s)
                or repo.create_trial(s, experiment_id=self.exp_id, kind=kind, index=index)
            ),
            retry_s=self.db_retry_s,
        )
        label = f"{kind}{index}"
        run_dir = self.exp_dir / label
        controller = TrialController(
            resolved,
            run_dir=run_dir,
            placement=placement,
            label=f"fb-{self.exp_id[:8]}-{label}",
            tags=telemetry.run_tags(
                self.exp_id, label, spec.architecture.name, spec.mechanism.name
            ),
            inject=inject,
            store_host=node_ip(),
            on_progress=lambda step: self.progress(label, step, spec.steps),
            should_stop=self.should_stop,
            pool=self.pool,
        )
        try:
            outcome = controller.run()
        except (KeyboardInterrupt, TrialInterrupted) as err:
            if isinstance(err, TrialInterrupted):
                controller.outcome.error = str(err)
            self._save(
                trial_id, controller.outcome, resolved, kind, label, status=TrialStatus.INTERRUPTED
            )
            raise
        summary = self._save(trial_id, outcome, resolved, kind, label, status=outcome.status)
        shutil.rmtree(run_dir / "records", ignore_errors=True)  # read back already
        if not self.keep:
            shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
            shutil.rmtree(run_dir / "jit", ignore_errors=True)
        return summary

    def _tags(self, spec: ExperimentSpec, trial_label: str) -> dict[str, str]:
        arch, mech = spec.architecture.name, spec.mechanism.name
        return telemetry.run_tags(self.exp_id, trial_label, arch, mech)

    def _save(
        self,
        trial_id: int,
        outcome: TrialOutcome,
        resolved: Resolved,
        kind: str,
        trial_label: str,
        *,
        status: TrialStatus | str,
    ) -> TrialSummary:
        spec = resolved.spec
        results.fill_resume_phases(outcome.failures, outcome.records)
        recorder = telemetry.Recorder(
            telemetry.run_tags(
                self.exp_id, trial_label, spec.architecture.name, spec.mechanism.name
            ),
            enabled=spec.metrics,
        )
        for f in outcome.failures:
            recorder.recovery(f.phases, telemetry.LATE_PHASES)
        steady = results.steady_state_steps(outcome.records, outcome.failures, spec.warmup_steps)
        summary = TrialSummary(
            status=status,
            step_time_s=results.median_or_none(steady),
            mean_step_time_s=results.mean_or_none(steady),
            final_loss=results.final_loss(outcome.records)
            if status == TrialStatus.COMPLETED
            else None,
            params_digest=outcome.params_digest,
        )
        match_expected = kind == "trial" and resolved.mech.match_expected(resolved.arch)
        extra = _extras(resolved, outcome, steady)
        self._store(trial_id, kind, summary, outcome, extra, match_expected)
        return summary

    def _store(
        self,
        trial_id: int,
        kind: str,
        summary: TrialSummary,
        outcome: TrialOutcome,
        extra: dict[str, Any],
        match_expected: bool,
    ) -> None:
        """A trial's records and result, in one transaction; what the trial measured outlives
        a database outage shorter than the retry window."""
        base = self.baseline
        overhead = (
            results.overhead_pct(summary.mean_step_time_s, base.mean_step_time_s if base else None)
            if kind == "trial"
            else None
        )
        matches = results.matches_baseline(
            summary.params_digest, base.params_digest if base else None, match_expected
        )

        def store(s: Session) -> None:
            self.guard(s)
            repo.add_step_records(s, trial_id, outcome.records)
            repo.add_failures(s, trial_id, outcome.failures)
            repo.add_checkpoint_events(s, trial_id, outcome.checkpoints)
            repo.finish_trial(
                s,
                trial_id,
                status=summary.status,
                step_time_s=summary.step_time_s,
                mean_step_time_s=summary.mean_step_time_s,
                overhead_pct=overhead,
                final_loss=summary.final_loss,
                params_digest=summary.params_digest,
                matches_baseline=matches,
                match_expected=match_expected,
                error=outcome.error,
                extra=extra,
            )

        self.db.write(store, retry_s=self.db_retry_s)


def _extras(resolved: Resolved, outcome: TrialOutcome, steady: list[float]) -> dict[str, Any]:
    spec = resolved.spec
    mean = results.mean_or_none(steady)
    return {
        "steady_steps": len(steady),
        "samples_per_s": spec.batch_size / mean if mean else None,
        "state_bytes_per_rank": outcome.state_bytes_per_rank,
        "state_layout": {
            "holds": list(resolved.arch.layout().holds),
            "replica_groups": resolved.arch.layout().replica_groups(),
        },
        "ranks_at_end": outcome.members,
        "rank_nodes": {str(r): n for r, n in sorted(outcome.rank_nodes.items())},
        "replica_spread": outcome.replica_spread,
        "silently_diverged": outcome.silently_diverged,
        "stragglers": outcome.stragglers,
        **outcome.arch_metrics,
        **results.throughput_around_failures(outcome.records, outcome.failures, spec.warmup_steps),
        **results.throughput_around_slowdowns(outcome.records, outcome.slowed, spec.warmup_steps),
        "recoveries": sum(f.restored_from_step is not None for f in outcome.failures),
        "grown_s": [f.phases.get("grown") for f in outcome.failures if "grown" in f.phases],
        **results.sample_accounting(
            outcome.records, spec.batch_size, resolved.arch.commits_whole_batch()
        ),
        "checkpoint": results.mechanism_costs(outcome.records, outcome.checkpoints, spec.steps),
        **_ettr(outcome),
    }


def _ettr(outcome: TrialOutcome) -> dict[str, Any]:
    got = ettr.measure(outcome.records, outcome.failures)
    parts = {"wall_s": got["wall_s"], "useful_s": got["useful_s"], **got["breakdown"]}
    return {"ettr": got["ettr"], "ettr_breakdown": parts, "ettr_steady": got["steady"]}
