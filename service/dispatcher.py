"""A dispatcher: takes queued experiments from the SQL queue and runs them on Ray, one at a time.

Several dispatchers (threads of `failbench serve`, or `failbench dispatch` processes on other
machines) share one queue; `queue.claim` gives each experiment to exactly one of them. While an
experiment runs, a renewer thread extends its lease and watches for a cancel request; if the
lease is lost (this process was too slow, or presumed dead and the experiment re-queued), the run
stops and writes nothing more.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from failbench_ray.errors import FailBenchError, LeaseLost, TrialInterrupted
from failbench_ray.spec import ExperimentSpec
from failbench_ray.storage import queue, repo
from failbench_ray.storage.db import Database
from failbench_ray.storage.status import (
    CellStatus,
    ExperimentStatus,
    cell_status_of,
    parse,
    sweep_status_of,
)
from failbench_ray.storage.tables import Experiment, SweepCell
from failbench_ray.sweep import shared_baseline

log = logging.getLogger("failbench.dispatcher")


@dataclass
class _LeaseState:
    held: bool = True
    cancel: bool = False


class Dispatcher:
    def __init__(
        self,
        db: Database,
        *,
        owner: str | None = None,
        lease_s: float = queue.DEFAULT_LEASE_S,
        poll_s: float = 1.0,
        max_attempts: int = queue.DEFAULT_MAX_ATTEMPTS,
        out_dir: Path = Path("runs"),
        stop_event: threading.Event | None = None,
        cluster_share: float = 1.0,
        reuse_workers: bool = True,
    ) -> None:
        self.cluster_share = cluster_share  # 1/N with N dispatchers on one cluster
        self.reuse_workers = reuse_workers
        self.stopping = stop_event or threading.Event()  # set: give the current run back
        self.db = db
        self.owner = owner or queue.new_owner_id()
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.max_attempts = max_attempts
        self.out_dir = out_dir
        self.current: str | None = None
        self.runs = 0

    # -- the loop --------------------------------------------------------------------------
    def run_forever(self, stop: threading.Event) -> None:
        """Run queued experiments until `stop` is set (the current one is finished first)."""
        log.info("dispatcher %s started", self.owner)
        try:
            while not stop.is_set():
                try:
                    ran = self.run_once()
                except Exception:  # noqa: BLE001  (the database blinked: try again shortly)
                    log.exception("dispatcher %s: queue step failed", self.owner)
                    ran = False
                if not ran:
                    stop.wait(self.poll_s)
        finally:
            with contextlib.suppress(Exception), self.db.session() as s:
                queue.forget_dispatcher(s, self.owner)
            log.info("dispatcher %s stopped after %d runs", self.owner, self.runs)

    def abandon(self) -> None:
        """The service stops without waiting for this dispatcher's run to wind down: its
        experiment goes back to the queue now (no attempt counted). The run, when it notices,
        no longer holds the lease and writes nothing more."""
        exp_id = self.current
        try:
            with self.db.session() as s:
                if exp_id is not None:
                    queue.give_back(s, exp_id, self.owner, "re-queued: the service stopped")
                queue.forget_dispatcher(s, self.owner)
        except Exception as err:  # noqa: BLE001  (then its lease expires as usual)
            log.warning("dispatcher %s: could not give back %s: %s", self.owner, exp_id, err)

    def run_once(self) -> bool:
        """Re-queue expired leases, then claim and run one experiment. False if none queued."""
        with self.db.session() as s:
            for moved in queue.requeue_expired(s, self.max_attempts):
                log.warning("experiment %s: lease expired, moved on", moved)
            for gone in queue.forget_expired_dispatchers(s):
                log.warning("dispatcher %s: heartbeat expired, forgotten", gone)
        with self.db.session() as s:
            exp_id = queue.claim(s, self.owner, self.lease_s)
        with self.db.session() as s:
            queue.heartbeat(s, self.owner, exp_id, lease_s=self.lease_s)
        if exp_id is None:
            return False
        self.run(exp_id)
        return True

    # -- one experiment --------------------------------------------------------------------
    def run(self, exp_id: str) -> ExperimentStatus | None:
        """Run a claimed experiment to its end. Returns its final status (None: lease lost)."""
        self.current = exp_id
        lease, done = _LeaseState(), threading.Event()
        renewer = threading.Thread(
            target=self._renew, args=(exp_id, lease, done), name=f"lease-{exp_id[:8]}", daemon=True
        )
        renewer.start()
        with self.db.session() as s:
            _sync_cell(s, exp_id, ExperimentStatus.RUNNING)
        status: ExperimentStatus | None = None
        try:
            status = self._execute(exp_id, lease)
        except TrialInterrupted as err:
            status = self._interrupted(exp_id, lease, err)
        except LeaseLost:
            status = None
        except OperationalError as err:  # the database, not the experiment: say so
            status = self._outlasted(exp_id, err)
        except Exception as err:  # noqa: BLE001  (run_experiment recorded it as failed)
            log.warning("experiment %s failed: %s: %s", exp_id, type(err).__name__, err)
            status = ExperimentStatus.FAILED
        finally:
            done.set()
            renewer.join()
            self._finish(exp_id, status)
        log.info("experiment %s: %s", exp_id, status or "lease lost")
        return status

    def _execute(self, exp_id: str, lease: _LeaseState) -> ExperimentStatus:
        from failbench_ray.runner import run_experiment

        spec = self._spec(exp_id)
        if spec is None:
            return ExperimentStatus.FAILED
        result = run_experiment(
            spec,
            db=self.db,
            out_dir=self.out_dir,
            baseline_of=shared_baseline(self.db, exp_id),
            experiment_id=exp_id,
            should_stop=lambda: self._should_stop(lease),
            guard=lambda session: self._guard(session, exp_id),
            cluster_share=self.cluster_share,
            reuse_workers=self.reuse_workers,
            db_retry_s=self.lease_s,  # an outage shorter than the lease costs the run nothing
        )
        return parse(ExperimentStatus, result.status)

    def _should_stop(self, lease: _LeaseState) -> str | None:
        if self.stopping.is_set():
            return "the dispatcher is stopping"
        if not lease.held:
            return "the lease on this experiment was lost (another dispatcher took it over)"
        if lease.cancel:
            return "cancelled"
        return None

    def _guard(self, session: Session, exp_id: str) -> None:
        """Before each write of the run: this dispatcher still holds the experiment."""
        if not queue.holds(session, exp_id, self.owner):
            raise LeaseLost(f"dispatcher {self.owner} no longer holds experiment {exp_id}")

    def _interrupted(
        self, exp_id: str, lease: _LeaseState, err: TrialInterrupted
    ) -> ExperimentStatus | None:
        """What a run stopped by `_should_stop` becomes."""
        if not lease.held:
            return None
        if self.stopping.is_set():  # not the experiment's fault: it runs again later
            with self.db.session() as s:
                queue.give_back(s, exp_id, self.owner, f"re-queued: {err}")
            return ExperimentStatus.QUEUED
        with contextlib.suppress(LeaseLost), self.db.session() as s:
            self._guard(s, exp_id)
            repo.set_experiment_status(s, exp_id, ExperimentStatus.CANCELLED, error=str(err))
        return ExperimentStatus.CANCELLED

    def _outlasted(self, exp_id: str, err: OperationalError) -> ExperimentStatus | None:
        """The database stayed unreachable longer than the run's writes retry: not the
        experiment's failure. Back in the queue, without counting an attempt, once the
        database answers (within ten leases, or a minute); else its lease expires as usual."""
        reason = "re-queued: the database was unreachable for longer than the lease"
        log.warning(
            "experiment %s: the database stayed unreachable (%s); not failed: %s",
            exp_id,
            str(err).splitlines()[0][:200],
            reason,
        )
        try:
            # Nothing else to do meanwhile: no experiment can be claimed without the database.
            back = self.db.write(
                lambda s: queue.give_back(s, exp_id, self.owner, reason),
                retry_s=max(60.0, 10 * self.lease_s),
            )
        except OperationalError:
            return None  # its lease expires and it is re-queued then
        return ExperimentStatus.QUEUED if back else None

    def _finish(self, exp_id: str, status: ExperimentStatus | None) -> None:
        self.current = None
        self.runs += 1

        def release(s: Session) -> None:
            queue.release(s, exp_id, self.owner)
            queue.heartbeat(s, self.owner, None, ran=1, lease_s=self.lease_s)
            if status is not None:
                _sync_cell(s, exp_id, status)

        # a short outage here must not leave the experiment to wait out its lease
        self.db.write(release, retry_s=self.lease_s)

    def _spec(self, exp_id: str) -> ExperimentSpec | None:
        """The stored spec, or None after failing the experiment with why it cannot run."""
        from failbench_ray.checks import resolve

        with self.db.session() as s:
            data: dict[str, Any] = dict(repo.get_experiment(s, exp_id).spec)
        try:
            spec = ExperimentSpec.model_validate(data)
            resolve(spec)
        except (ValidationError, FailBenchError) as err:
            with self.db.session() as s:
                repo.set_experiment_status(
                    s, exp_id, ExperimentStatus.FAILED, error=f"invalid spec: {err}"
                )
            return None
        return spec

    def _renew(self, exp_id: str, lease: _LeaseState, done: threading.Event) -> None:
        # Often enough to renew well before expiry and to see a cancel within ~2 s.
        while not done.wait(min(self.lease_s / 3, 2.0)):
            try:
                with self.db.session() as s:
                    got = queue.renew(s, exp_id, self.owner, self.lease_s)
                    queue.heartbeat(s, self.owner, exp_id, lease_s=self.lease_s)
            except Exception:  # noqa: BLE001  (the lease outlives a short database outage)
                log.exception("experiment %s: renewing the lease failed", exp_id)
                continue
            lease.held, lease.cancel = got.held, got.cancel_requested
            if not got.held:
                return


def _sync_cell(session: Session, exp_id: str, status: ExperimentStatus) -> None:
    """A sweep's cell follows its experiment, and the stored sweep status its cells (with the
    mapping that the API and `failbench sweep` use: `failbench_ray.storage.status`)."""
    cell = session.scalars(select(SweepCell).where(SweepCell.experiment_id == exp_id)).first()
    if cell is None:
        return
    cell_status = cell_status_of(status)
    exp = session.get(Experiment, exp_id)
    reason = None if cell_status in _NO_REASON else (exp.error if exp else None)
    repo.set_cell_status(session, cell.sweep_id, cell.key, cell_status, reason=reason)
    counts = repo.sweep_progress(session, cell.sweep_id)
    repo.set_sweep_status(session, cell.sweep_id, sweep_status_of(counts, active=True))


_NO_REASON = (CellStatus.PENDING, CellStatus.RUNNING, CellStatus.COMPLETED)
